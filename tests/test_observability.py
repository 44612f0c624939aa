"""What a run shows (issue 14): sample trajectories as TensorBoard text and every validation episode in a
JSONL file; one progress line per step; a progress bar that counts steps; no sanity-check validation in
the logs, and the validation after step k at x = k (val/), the x of training step k (train/), and at
x = trajectories so far (by_rollouts/)."""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from lopd_lightning.callbacks import (LastCheckpointAtTrainEnd, RunSummary, StepRichProgressBar, StepTQDMProgressBar,
                                     step_description)
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.modules.observability import _fenced
from lopd_lightning.modules.grpo import GRPOModule
from helpers import EvenToy, quiet_trainer

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
EXAMPLES_PER_STEP, G, VAL_EXAMPLES, STEPS = 2, 2, 3, 2


def make_module(**overrides) -> GRPOModule:
    options = dict(lora=LORA, group_size=G, max_new_tokens=4, learning_rate=1e-3,
                   log_samples=2, log_samples_every_n_steps=1)
    options.update(overrides)
    return GRPOModule("tiny", **options)


def make_dm(**overrides) -> OnPolicyDataModule:
    # EvenToy: reward 1 exactly for the even-numbered examples, whatever the model says
    options = dict(examples_per_step=EXAMPLES_PER_STEP, val_limit=VAL_EXAMPLES, val_batch_size=2)
    options.update(overrides)
    return OnPolicyDataModule(EvenToy(num_examples=16), **options)


def even(example_id: str) -> float:
    return 1.0 if int(example_id.split("/")[1]) % 2 == 0 else 0.0


def read_events(log_dir: Path) -> tuple[dict[str, list], dict[str, list]]:
    """(scalars, texts) of every event file under ``log_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list] = {}
    texts: dict[str, list] = {}
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
        for tag in acc.Tags()["tensors"]:
            texts.setdefault(tag, []).extend((e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag))
    return scalars, texts


@contextmanager
def base_log_records():
    """The INFO records of ``lopd_lightning.modules`` (the module's progress and evaluation lines) logged inside the
    block (a list, filled as they come)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.INFO)
    base_log = logging.getLogger("lopd_lightning.modules")
    old_level = base_log.level
    base_log.setLevel(logging.INFO)
    base_log.addHandler(handler)
    try:
        yield records
    finally:
        base_log.removeHandler(handler)
        base_log.setLevel(old_level)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One logged fit: validation before training, after each of 2 steps, and Lightning's sanity check."""
    root = tmp_path_factory.mktemp("observed")
    with base_log_records() as records:
        module = make_module(validate_before_training=True)
        dm = make_dm()
        trainer = L.Trainer(
            max_steps=STEPS, accelerator="cpu", devices=1, enable_checkpointing=False, enable_model_summary=False,
            enable_progress_bar=False, logger=TensorBoardLogger(save_dir=str(root), name="run"),
            val_check_interval=1, check_val_every_n_epoch=None, num_sanity_val_steps=2, log_every_n_steps=1,
            default_root_dir=str(root), callbacks=[RunSummary()],
        )
        trainer.fit(module, dm)
    scalars, texts = read_events(root)
    return dict(module=module, dm=dm, trainer=trainer, log_dir=Path(trainer.logger.log_dir), scalars=scalars,
                texts=texts, lines=[r.getMessage() for r in records])


# ----------------------------------------------------------------------- 5. exact validation x-axes
def test_validation_after_step_k_is_at_k_and_the_sanity_check_is_not_logged(run):
    scalars, module = run["scalars"], run["module"]
    val_ids = [ex.id for ex in run["dm"].val_examples]
    expected = sum(even(i) for i in val_ids) / len(val_ids)  # every validation: the same 3 held-out examples
    # before training (0), after step 1 (1), after step 2 (2); nothing from the sanity check
    assert [s for s, _ in scalars["val/reward_mean"]] == [0, 1, 2]
    assert [v for _, v in scalars["val/reward_mean"]] == pytest.approx([expected] * 3)
    # by_rollouts: x = trajectories generated so far (0, then 4 per step)
    per_step = EXAMPLES_PER_STEP * G
    assert [s for s, _ in scalars["by_rollouts/val_reward_mean"]] == [0, per_step, 2 * per_step]
    assert [s for s, _ in scalars["by_rollouts/val_success_rate"]] == [0, per_step, 2 * per_step]
    assert [step for step, _ in module.val_history] == [0, 1, 2]
    assert run["trainer"].callback_metrics["val/reward_mean"] == pytest.approx(expected)  # monitors still see it


def test_training_step_k_and_the_validation_after_it_share_x_k(run):
    """Issue 32: the k-th optimiser step (1-based) is at x = k under train/ and time/, the x of the validation
    that follows it (Lightning's self.log under manual optimisation would file it under k - 1)."""
    scalars = run["scalars"]
    for tag in ("train/loss", "train/reward_mean", "train/rollouts", "time/generation"):
        assert [s for s, _ in scalars[tag]] == list(range(1, STEPS + 1)), tag
    val_steps = [s for s, _ in scalars["val/reward_mean"]]
    assert val_steps[1:] == [s for s, _ in scalars["train/loss"]]  # after the evaluation before training (0)
    # train/rollouts at x = k is the trajectories generated by step k; by_rollouts/ keeps that x
    per_step = EXAMPLES_PER_STEP * G
    assert [v for _, v in scalars["train/rollouts"]] == [per_step * k for k in range(1, STEPS + 1)]
    assert [s for s, _ in scalars["by_rollouts/reward_mean"]] == [per_step * k for k in range(1, STEPS + 1)]
    assert [s for s, _ in scalars["by_rollouts/loss"]] == [per_step * k for k in range(1, STEPS + 1)]


def test_only_the_phases_that_ran_are_timed(run):
    """GRPO on the HF backend has no bank to retrieve from and no engine to sync: no time/retrieval,
    no time/weight_sync (LOPD's time/retrieval: tests/test_lopd_module.py)."""
    scalars = run["scalars"]
    assert "time/generation" in scalars and "time/student_step" in scalars
    assert "time/retrieval" not in scalars and "time/weight_sync" not in scalars
    assert not any(t in scalars for t in ("by_rollouts/retrieval", "by_rollouts/weight_sync"))


def test_run_summary_reads_the_real_validations_and_names_the_generations(run):
    (summary_cb,) = [c for c in run["trainer"].callbacks if isinstance(c, RunSummary)]
    summary = summary_cb.summary(run["trainer"], run["module"])
    val_ids = [ex.id for ex in run["dm"].val_examples]
    expected = sum(even(i) for i in val_ids) / len(val_ids)
    assert [step for step, _ in summary["history"]] == [0, 1, 2]
    assert summary["before"] == pytest.approx(expected) and summary["after"] == pytest.approx(expected)
    assert summary["generations"] == str(run["log_dir"] / "generations")


# ----------------------------------------------------------------------- 2. generations and samples
def test_every_validation_episode_is_written_to_jsonl(run):
    folder = run["log_dir"] / "generations"
    assert sorted(p.name for p in folder.iterdir()) == ["val_step_0.jsonl", "val_step_1.jsonl", "val_step_2.jsonl"]
    val_ids = [ex.id for ex in run["dm"].val_examples]
    for step in (0, 1, 2):
        lines = (folder / f"val_step_{step}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        assert len(rows) == VAL_EXAMPLES  # both val batches (2 + 1 examples), in the split's order
        assert [r["example_id"] for r in rows] == val_ids
        for r in rows:
            assert set(r) >= {"step", "split", "example_id", "messages", "reward", "success", "turns", "done",
                              "truncation", "errors", "info"}
            assert r["step"] == step and r["split"] == "val"
            assert r["reward"] == even(r["example_id"]) and r["success"] == (r["reward"] == 1.0)
            assert r["turns"] == 1 and r["done"] is True and r["truncation"] is None
            # one entry per reply: how many tokens, and why it ended (a cut reply has the full budget)
            assert len(r["reply_tokens"]) == len(r["stop_reasons"]) == 1
            assert r["stop_reasons"][0] in {"eos", "stop_string", "length"}
            max_new = run["module"].hparams.val_max_new_tokens or run["module"].hparams.max_new_tokens
            cut = r["stop_reasons"][0] == "length"
            assert r["reply_tokens"][0] == max_new if cut else 0 < r["reply_tokens"][0] <= max_new
            assert r["messages"][0] == {"role": "user", "content": run["dm"].example(r["example_id"]).text}
            assert [m["role"] for m in r["messages"]] == ["user", "assistant"]


def test_reply_lengths_are_logged_per_reply_and_match_the_generations(run):
    scalars, folder = run["scalars"], run["log_dir"] / "generations"
    for step in (0, 1, 2):  # val: the mean over every reply written to the generations file, and the cut fraction
        rows = [json.loads(line) for line in (folder / f"val_step_{step}.jsonl").read_text().splitlines()]
        tokens = [n for r in rows for n in r["reply_tokens"]]
        cut = [reason == "length" for r in rows for reason in r["stop_reasons"]]
        assert dict(scalars["val/reply_tokens_mean"])[step] == pytest.approx(sum(tokens) / len(tokens))
        assert dict(scalars["val/cut_at_length_rate"])[step] == pytest.approx(sum(cut) / len(cut))
    max_new = run["module"].hparams.max_new_tokens
    assert [s for s, _ in scalars["train/reply_tokens_mean"]] == [1, 2]  # training step k at x = k
    assert all(0 < v <= max_new for _, v in scalars["train/reply_tokens_mean"])
    assert all(0 <= v <= 1 for _, v in scalars["train/cut_at_length_rate"])
    assert "by_rollouts/reply_tokens_mean" in scalars and "by_rollouts/val_cut_at_length_rate" in scalars


def test_reply_lengths_of_a_batch_by_hand():
    from lopd_lightning.rollout import RolloutBatch

    def batch(metadata):
        n = len(metadata)
        zeros = torch.zeros(n, 3, dtype=torch.long)
        return RolloutBatch(zeros, zeros, zeros.bool(), torch.zeros(n), torch.arange(n), zeros.float(),
                            torch.zeros(n, dtype=torch.long), [str(i) for i in range(n)], [[]] * n, metadata)

    tokens, cut = batch([{"reply_tokens": [3, 8], "stop_reasons": ["eos", "length"]},
                         {"reply_tokens": [5], "stop_reasons": ["stop_string"]}, {}]).reply_lengths()
    assert tokens.tolist() == [3.0, 8.0, 5.0] and cut.tolist() == [0.0, 1.0, 0.0] and tokens.dtype == torch.float32
    assert batch([{}]).reply_lengths()[0].numel() == 0  # teacher-forced: no replies
    with pytest.raises(ValueError, match="2 reply_tokens but 1 stop_reasons"):
        batch([{"reply_tokens": [3, 8], "stop_reasons": ["eos"]}]).reply_lengths()


def test_samples_reach_tensorboard_as_text(run):
    texts, dm = run["texts"], run["dm"]
    val = dict(texts["samples/val/text_summary"])
    assert sorted(val) == [0, 1, 2]
    first, second, third = dm.val_examples
    text = val[2]
    # log_samples=2: the first two held-out episodes, separated by a rule; the third is not shown
    assert text.count("\n\n---\n\n") == 1
    assert f"**{first.id}** (step 2) · reward {even(first.id):.3f} · " in text
    assert f"**{second.id}** (step 2)" in text and f"**{third.id}**" not in text
    assert f"prompt:\n\n```text\n[user] {first.text}\n```" in text
    assert "assistant (turn 1)" in text
    # training samples every step (log_samples_every_n_steps=1), the step's first 2 rollouts
    train = dict(texts["samples/train/text_summary"])
    assert sorted(train) == [1, 2]
    step_examples = dm.examples_at(0)  # step 1's examples; rows are [ex0 s0, ex0 s1, ex1 s0, ...]
    assert train[1].count(f"**{step_examples[0].id}** (step 1)") == G


def test_sample_markdown_is_exact_and_fences_model_text():
    from tensorboard.plugin_util import markdown_to_safe_html

    module = make_module(sample_prompt_chars=12)
    reply = "# Title\n**bold** <script>x</script>\n```\ncode\n```"
    record = {
        "step": 3, "split": "val", "example_id": "live_simple_1-2", "reward": 0.0, "success": False,
        "turns": 1, "done": True, "truncation": None, "errors": ["malformed tool call: `f(`"],
        "info": {"error": "malformed tool call: `f(`", "n_calls": 0},
        "messages": [{"role": "system", "content": "Tools: f"}, {"role": "user", "content": "Call f with x=1"},
                     {"role": "assistant", "content": reply}, {"role": "tool", "content": "   "}],
    }
    expected = (
        "**live\\_simple\\_1\\-2** (step 3) · reward 0.000 · failure · 1 turn\n\n"
        "checker:\n\n```text\nmalformed tool call: `f(`\n```\n\n"
        'info:\n\n```text\n{"n_calls": 0}\n```\n\n'
        "prompt (last 12 characters):\n\n```text\n...l f with x=1\n```\n\n"
        f"assistant (turn 1):\n\n````text\n{reply}\n````\n\n"  # a fence longer than the ``` inside
        "tool (whitespace only, shown escaped):\n\n```text\n'   '\n```"
    )
    markdown = module.sample_markdown(record)
    assert markdown == expected
    html = markdown_to_safe_html(markdown)
    assert "<h1>" not in html and "<script>" not in html and "<strong>bold" not in html
    assert "# Title\n**bold** &lt;script&gt;x&lt;/script&gt;\n```\ncode\n```" in html  # verbatim, in <code>
    assert _fenced("a ````` b").startswith("``````text\n")


# ----------------------------------------------------------------------- 3. one progress line per step
def test_one_progress_line_per_step_with_the_steps_numbers(run):
    lines = [line for line in run["lines"] if line.startswith("step ")]
    assert len(lines) == STEPS
    dm, scalars = run["dm"], run["scalars"]
    losses = [v for _, v in sorted(scalars["train/loss"])]
    pattern = re.compile(
        r"^step (\d+)/(\d+) \| trajectories (\d+) \| reward ([\d.]+) \| success ([\d.]+) \| loss (\S+) \| "
        r"gen \d+\.\ds student \d+\.\ds$"
    )
    for k, line in enumerate(lines, start=1):
        match = pattern.match(line)
        assert match, line
        examples = dm.examples_at((k - 1) * EXAMPLES_PER_STEP)
        reward = sum(even(ex.id) for ex in examples) / len(examples)  # G rollouts each, same reward
        assert match.group(1, 2, 3) == (str(k), str(STEPS), str(k * EXAMPLES_PER_STEP * G))
        assert match.group(4) == f"{reward:.3f}" and match.group(5) == f"{reward:.3f}"
        assert match.group(6) == f"{losses[k - 1]:.4g}"
    assert "retrieval" not in lines[0]  # a method without a bank retrieves nothing
    val_lines = [line for line in run["lines"] if line.startswith("val after step ")]
    assert [line.split(":")[0] for line in val_lines] == ["val after step 0", "val after step 1", "val after step 2"]
    assert all(f"| {VAL_EXAMPLES} episodes | generations " in line for line in val_lines)


# ----------------------------------------------------------------------- 3. the progress bar counts steps
def test_default_rich_progress_bar_shows_steps_not_epoch_minus_two(tmp_path):
    trainer = quiet_trainer(tmp_path, max_steps=2, enable_progress_bar=True)
    assert type(trainer.progress_bar_callback) is RichProgressBar  # Lightning's default here (rich installed)
    trainer.fit(make_module(log_samples=0), make_dm(val_limit=1))
    bar = trainer.progress_bar_callback
    assert isinstance(bar, StepRichProgressBar)
    description = bar.train_description()
    assert description.strip() == "step 2/2" and "/-2" not in description and "Epoch" not in description


def test_tqdm_progress_bar_shows_steps(tmp_path):
    trainer = quiet_trainer(tmp_path, max_steps=2, enable_progress_bar=True, callbacks=[TQDMProgressBar()])
    trainer.fit(make_module(log_samples=0), make_dm(val_limit=1))
    bar = trainer.progress_bar_callback
    assert isinstance(bar, StepTQDMProgressBar)
    assert bar.train_progress_bar.desc == "step 2/2: "  # tqdm appends ": "


def test_a_disabled_or_custom_progress_bar_is_left_alone(tmp_path):
    trainer = quiet_trainer(tmp_path, max_steps=1)  # enable_progress_bar=False
    trainer.fit(make_module(log_samples=0), make_dm(val_limit=1))
    assert trainer.progress_bar_callback is None

    class Mine(TQDMProgressBar):
        pass

    trainer = quiet_trainer(tmp_path, max_steps=1, enable_progress_bar=True, callbacks=[Mine()])
    trainer.fit(make_module(log_samples=0), make_dm(val_limit=1))
    assert type(trainer.progress_bar_callback) is Mine


def test_the_step_bar_replaces_the_default_without_lightnings_override_line(tmp_path):
    """Lightning's "callbacks returned in configure_callbacks will override ... RichProgressBar" INFO line
    came with every run; the default bar is now taken out before the step bar is added, so no line. Nor for
    LastCheckpointAtTrainEnd, on a later stage of the same Trainer or when the Trainer has its own."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.INFO)
    lightning_log = logging.getLogger("lightning")  # the parent of Lightning's rank_zero loggers
    old_level = lightning_log.level
    lightning_log.setLevel(logging.INFO)
    lightning_log.addHandler(handler)
    try:
        trainer = quiet_trainer(tmp_path, max_steps=1, enable_progress_bar=True)
        module, dm = make_module(log_samples=0), make_dm(val_limit=1)
        trainer.fit(module, dm)
        trainer.validate(module, dm, verbose=False)  # a later stage: configure_callbacks runs again
        own = quiet_trainer(tmp_path, max_steps=1, callbacks=[LastCheckpointAtTrainEnd()])  # a user's own one
        own.fit(make_module(log_samples=0), make_dm(val_limit=1))
    finally:
        lightning_log.removeHandler(handler)
        lightning_log.setLevel(old_level)
    messages = [r.getMessage() for r in records]
    assert messages, "no Lightning INFO line reached the handler: the check below would prove nothing"
    assert not [m for m in messages if "will override" in m], messages
    bars = [c for c in trainer.callbacks if isinstance(c, (RichProgressBar, TQDMProgressBar))]
    assert len(bars) == 1 and isinstance(bars[0], StepRichProgressBar)  # one bar, the step-counting one
    for t in (trainer, own):  # and one final-checkpoint callback
        assert len([c for c in t.callbacks if isinstance(c, LastCheckpointAtTrainEnd)]) == 1


def test_the_validation_line_counts_the_episodes_without_a_logger(tmp_path):
    """Without a logger no records are gathered; the line used to say "0 episodes" although 3 ran."""
    with base_log_records() as records:
        trainer = quiet_trainer(tmp_path, max_steps=1, limit_val_batches=None, val_check_interval=1,
                                check_val_every_n_epoch=None)
        trainer.fit(make_module(), make_dm())
    [line] = [r.getMessage() for r in records if r.getMessage().startswith("val after step ")]
    assert line.endswith(f"| {VAL_EXAMPLES} episodes"), line


def test_step_description_without_a_step_limit():
    class FakeTrainer:
        global_step, max_steps = 7, -1

    assert step_description(FakeTrainer()) == "step 7"
    FakeTrainer.max_steps = 20
    assert step_description(FakeTrainer()) == "step 7/20"


# ----------------------------------------------------------------------- without a logger, outside fit
def test_nothing_is_written_without_a_logger(tmp_path):
    trainer = quiet_trainer(tmp_path, max_steps=1, limit_val_batches=None, val_check_interval=1,
                            check_val_every_n_epoch=None)
    module = make_module()
    trainer.fit(module, make_dm())
    assert [step for step, _ in module.val_history] == [1]
    assert not list(tmp_path.rglob("*.jsonl")) and not list(tmp_path.rglob("generations"))


def test_standalone_validate_returns_and_logs_its_metrics(tmp_path):
    trainer = quiet_trainer(tmp_path, limit_val_batches=None, logger=TensorBoardLogger(save_dir=str(tmp_path), name="v"))
    dm = make_dm()
    (results,) = trainer.validate(make_module(), dm)
    val_ids = [ex.id for ex in dm.val_examples]
    assert results["val/reward_mean"] == pytest.approx(sum(even(i) for i in val_ids) / len(val_ids))
    rows = (Path(trainer.logger.log_dir) / "generations" / "val_step_0.jsonl").read_text().splitlines()
    assert len(rows) == VAL_EXAMPLES


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_validate_or_test_of_a_checkpoint_is_labelled_with_its_step(tmp_path, caplog, stage):
    """`lopd validate --ckpt_path` on a step-4 checkpoint used its weights but reported "val after step 0", wrote
    val_step_0.jsonl and logged at x = 0 (the global_step of a Trainer that never trained): it read as a check of
    the untrained model."""
    fit = quiet_trainer(tmp_path / "fit", max_steps=4)
    dm = make_dm()
    fit.fit(make_module(), dm)
    ckpt = tmp_path / "step4.ckpt"
    fit.save_checkpoint(ckpt)
    prefix = "val" if stage == "validate" else "test"
    trainer = quiet_trainer(tmp_path, limit_val_batches=None, logger=TensorBoardLogger(save_dir=str(tmp_path), name=stage))
    with caplog.at_level(logging.INFO, logger="lopd_lightning.modules.evaluation"):
        (results,) = getattr(trainer, stage)(make_module(), dm, ckpt_path=str(ckpt), verbose=False)
    assert trainer.global_step == 0  # the Trainer's own count: not what the labels say
    log_dir = Path(trainer.logger.log_dir)
    assert sorted(p.name for p in (log_dir / "generations").iterdir()) == [f"{prefix}_step_4.jsonl"]
    assert {json.loads(line)["step"] for line in (log_dir / "generations" / f"{prefix}_step_4.jsonl").open()} == {4}
    scalars, texts = read_events(log_dir)
    assert [step for step, _ in scalars[f"{prefix}/reward_mean"]] == [4]
    assert [step for step, _ in texts[f"samples/{prefix}/text_summary"]] == [4]
    assert "step" not in scalars and "epoch" not in scalars
    assert [m.split(":")[0] for m in caplog.messages if " after step " in m] == [f"{prefix} after step 4"]
    val_ids = [ex.id for ex in dm.val_examples]
    assert results[f"{prefix}/reward_mean"] == pytest.approx(sum(even(i) for i in val_ids) / len(val_ids))
    assert results["step"] == 4.0


def test_negative_settings_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="model.init_args.log_samples"):
        make_module(log_samples=-1)


def test_a_generations_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write stopped part-way (here: the third record fails to serialise, as a kill would stop it) leaves no
    val_step file that a resume could take for a finished evaluation; a whole write leaves only the file."""
    module = make_module()
    monkeypatch.setattr(type(module), "generations_dir", lambda self: tmp_path / "generations")
    records = [{"example_id": i, "reward": 1.0} for i in range(4)]
    path = module.write_generations("val", 3, records)
    assert [json.loads(line) for line in path.read_text().splitlines()] == records
    assert sorted(p.name for p in (tmp_path / "generations").iterdir()) == ["val_step_3.jsonl"]

    calls = {"n": 0}
    real_dumps = json.dumps

    def dumps_then_die(obj, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # the process stops in the middle of the file
        return real_dumps(obj, **kw)

    monkeypatch.setattr("lopd_lightning.modules.observability.json.dumps", dumps_then_die)
    with pytest.raises(KeyboardInterrupt):
        module.write_generations("val", 5, records)
    assert not (tmp_path / "generations" / "val_step_5.jsonl").exists()
