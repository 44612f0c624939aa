"""The privilege check (lopd_lightning.privilege): batched greedy replies equal one request at a time, the report
against hand-derived values and a naive reference loop, the warning of a teacher no better than its student (and
its silence for a better one), the callback's logs at step 0 and every n steps, training bitwise unchanged by it,
the state it leaves as it found it, and ``lopd privilege-check``.

Tiny random Llama (``model: tiny``), the toy task, CPU, seconds.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

import lopd_lightning.privilege as privilege
from lopd_lightning.cli import main
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.modules import LOPDModule
from lopd_lightning.modules.opsd import OPSDModule
from lopd_lightning.privilege import (
    LOPD_KEYS,
    PrivilegeCheck,
    PrivilegeReport,
    RequestContext,
    check_privilege,
    check_supported,
    not_privileged_warning,
    request_contexts,
    teacher_greedy_replies,
    teacher_greedy_reply,
)
from lopd_lightning.tasks.toy import ToyTask
from helpers import TINY_BANK, EvenToy, assert_one_line_error, quiet_trainer, run_main

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
METRICS = {"privilege/teacher_greedy_success", "privilege/student_greedy_success",
           "privilege/other_context_greedy_success", "privilege/teacher_minus_student", "privilege/swap_effect",
           "privilege/context_gain"}


def lopd_module(**overrides) -> LOPDModule:
    """configs/tiny.yaml's module (LoRA student, K=4, J=2, hashing embedder) on the tiny bank."""
    options = dict(lora=LORA, group_size=2, max_new_tokens=4, num_latents=4, num_experiences=2, composer_depth=2,
                   max_experience_tokens=64, embedder="hashing", bank_path=str(TINY_BANK), distill_top_k=8,
                   learning_rate=1e-3, composer_lr=1e-3)
    options.update(overrides)
    torch.manual_seed(0)
    return LOPDModule("tiny", **options)


def scrambled(module):
    """The module with its base weight matrices redrawn at std 0.3 (seeded): replies that differ between requests
    and end at different lengths (the tiny model's own weights answer every prompt alike)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in module.backbone.named_parameters():
            if "lora" not in name and p.dim() == 2:
                p.normal_(0.0, 0.3, generator=generator)
    return module


@pytest.fixture(scope="module")
def fresh():
    """An LOPD module with a freshly initialised composer on the tiny random model: a teacher not privileged."""
    return lopd_module()


@pytest.fixture(scope="module")
def chaotic():
    return scrambled(lopd_module())


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call: ``(step, metrics)``."""

    def __init__(self, root: Path):
        super().__init__()
        self.logged: list[tuple[int, dict]] = []
        self._root = str(root)

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    @property
    def save_dir(self):
        return self._root

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))


def fake_trainer(task, root: Path, step: int = 0):
    """What PrivilegeCheck.run reads of a Trainer."""
    dm = SimpleNamespace(task=task, train_examples=task.examples("train"))
    return SimpleNamespace(global_step=step, datamodule=dm, is_global_zero=True, loggers=[MemoryLogger(root)])


# ---------------------------------------------------------------------------------------- greedy replies
def test_batched_greedy_replies_equal_one_request_at_a_time(chaotic):
    task = ToyTask()
    examples = task.examples("train")[:7]
    contexts = request_contexts(chaotic, task, examples, batch_size=4)
    assert all(c.latents is not None and c.latents.shape == (8, 64) for c in contexts)  # J*K = 2*4 latents, d 64
    # a mixed batch: latents, a text context, none
    text = chaotic.teacher.encode_text_context(["the answer is 7"])[0]
    contexts[1], contexts[2], contexts[5] = RequestContext(context_ids=text), None, RequestContext()
    with torch.no_grad():
        batched = teacher_greedy_replies(chaotic, task, examples, contexts, max_new_tokens=8, batch_size=3)
        alone = [teacher_greedy_replies(chaotic, task, [ex], [ctx], max_new_tokens=8)[0]
                 for ex, ctx in zip(examples, contexts, strict=True)]
        student = teacher_greedy_replies(chaotic, task, examples, None, max_new_tokens=8, batch_size=4, weights="student")
        student_alone = [teacher_greedy_replies(chaotic, task, [ex], None, max_new_tokens=8, weights="student")[0]
                         for ex in examples]
    assert batched == alone and student == student_alone
    assert len(set(batched)) > 3 and len({len(r) for r in batched}) > 2, batched  # replies differ, lengths too
    # live mode: no context under the teacher's weights is the student; the benchmark's signature gives the same
    assert teacher_greedy_reply(chaotic, task, examples[2], max_new_tokens=8) == student[2] == batched[2]
    assert teacher_greedy_reply(chaotic, task, examples[1], context_ids=text, max_new_tokens=8) == batched[1]
    assert teacher_greedy_reply(chaotic, task, examples[0], composer=chaotic.composer, max_new_tokens=8) == batched[0]


def test_greedy_replies_refuse_bad_arguments(fresh):
    task = ToyTask()
    examples = task.examples("train")[:2]
    with pytest.raises(ValueError, match="max_new_tokens and batch_size must be >= 1"):
        teacher_greedy_replies(fresh, task, examples, max_new_tokens=0)
    with pytest.raises(ValueError, match="1 contexts for 2 examples"):
        teacher_greedy_replies(fresh, task, examples, [None], max_new_tokens=2)
    with pytest.raises(ValueError, match="weights must be"):
        teacher_greedy_replies(fresh, task, examples, max_new_tokens=2, weights="ema")


# ---------------------------------------------------------------------------------------- the report
def naive_nll(module, task, example, context: RequestContext | None) -> tuple[float, int]:
    """The teacher's NLL of ``example``'s reference, one row, full logits, log-softmax by hand."""
    batch = module.reference_batch(task, [example])
    kwargs = {}
    if context is not None and context.latents is not None:
        kwargs["latents"] = context.latents[None]
    elif context is not None and context.context_ids:
        kwargs["context_ids"] = [context.context_ids]
    with torch.no_grad():
        logits = module.teacher.logits_on_student_positions(batch.input_ids, batch.attention_mask,
                                                            batch.context_position, **kwargs)  # [1, T, V]
    logp = torch.log_softmax(logits[0, :-1].double(), dim=-1).gather(1, batch.input_ids[0, 1:, None])[:, 0]
    mask = (batch.assistant_mask[0, 1:] * batch.attention_mask[0, 1:]).bool()
    return float(-logp[mask].sum()), int(mask.sum())


def naive_context(module, task, example) -> RequestContext:
    """One request's own context computed alone: LOPD's latents of its retrieval, OPSD's reference text."""
    with torch.no_grad():
        if isinstance(module, LOPDModule):
            composed = module.composer.compose([[(example.text, e.trace) for e in module.retrieve(task, [example])[0]]])
            return RequestContext(latents=composed.latents[0][composed.latent_mask[0]])
        return RequestContext(context_ids=module.teacher_context_ids([module.reference_text(task, example)])[0])


@pytest.mark.parametrize("kind", ["lopd", "opsd"])
def test_the_report_against_hand_derived_values_and_a_naive_loop(kind, chaotic):
    module = chaotic if kind == "lopd" else scrambled(OPSDModule("tiny", lora=LORA, max_new_tokens=4))
    task = EvenToy()  # reward 1 on the even-numbered examples whatever the reply
    examples = task.examples("train")[:6]
    report = check_privilege(module, task, examples, max_new_tokens=4, batch_size=4)
    even = sum(int(ex.id.split("/")[1]) % 2 == 0 for ex in examples)
    assert 0 < even < 6
    assert report.requests == 6
    assert report.teacher_success == report.student_success == report.other_context_success == even / 6
    own = [naive_context(module, task, ex) for ex in examples]
    sums = {"own": 0.0, "other": 0.0, "none": 0.0}
    tokens = 0
    for i, example in enumerate(examples):
        for name, context in (("own", own[i]), ("other", own[(i + 1) % 6]), ("none", None)):
            total, count = naive_nll(module, task, example, context)
            sums[name] += total
        tokens += count
    swap, gain = (sums["other"] - sums["own"]) / tokens, (sums["none"] - sums["own"]) / tokens
    assert abs(swap) > 1e-3 and abs(gain) > 1e-3  # contexts that move the teacher: the comparison means something
    assert report.swap_effect == pytest.approx(swap, rel=1e-4, abs=1e-5)
    assert report.context_gain == pytest.approx(gain, rel=1e-4, abs=1e-5)
    metrics = report.metrics()
    assert set(metrics) == METRICS
    assert metrics["privilege/teacher_minus_student"] == 0.0 and metrics["privilege/swap_effect"] == report.swap_effect
    line = report.line()
    assert "\n" not in line and f"teacher {even}/6 solved greedily" in line and "nats/token" in line


def test_success_is_the_checker_on_the_greedy_replies(chaotic, monkeypatch):
    """Teacher, student and other-context successes count the replies the checker passes: a checker that passes
    exactly the replies of one kind tells which replies each count read."""
    task = ToyTask()
    examples = task.examples("train")[:5]
    contexts = request_contexts(chaotic, task, examples)
    with torch.no_grad():
        own = teacher_greedy_replies(chaotic, task, examples, contexts, max_new_tokens=4)
        other = teacher_greedy_replies(chaotic, task, examples, contexts[1:] + contexts[:1], max_new_tokens=4)
        student = teacher_greedy_replies(chaotic, task, examples, None, max_new_tokens=4, weights="student")
    for passed, expected in ((own, "teacher_success"), (other, "other_context_success"), (student, "student_success")):
        wanted = {(ex.id, r) for ex, r in zip(examples, passed, strict=True)}
        monkeypatch.setattr(privilege, "reply_outcome", lambda task, ex, reply, w=wanted: (float((ex.id, reply) in w), None))
        report = check_privilege(chaotic, task, examples, max_new_tokens=4)
        fractions = {"teacher_success": report.teacher_success, "other_context_success": report.other_context_success,
                     "student_success": report.student_success}
        assert fractions[expected] == 1.0, (expected, fractions)
        same = {name for name, replies in (("teacher_success", own), ("other_context_success", other),
                                           ("student_success", student)) if replies == passed}
        assert {name for name, value in fractions.items() if value == 1.0} == same


def test_the_check_leaves_flags_adapter_and_random_state_as_it_found_them(fresh):
    task = ToyTask()
    fresh.train()
    fresh.composer.eval()  # a mixed state, restored as it was
    flags = [m.training for m in fresh.modules()]
    grads = [p.requires_grad for p in fresh.parameters()]
    adapter = fresh.backbone.active_adapter
    random.seed(3)
    torch.manual_seed(3)
    state = (torch.get_rng_state(), random.getstate())
    check_privilege(fresh, task, task.examples("train")[:3], max_new_tokens=2)
    assert torch.equal(torch.get_rng_state(), state[0]) and random.getstate() == state[1]
    assert [m.training for m in fresh.modules()] == flags
    assert [p.requires_grad for p in fresh.parameters()] == grads
    assert fresh.backbone.active_adapter == adapter
    assert torch.is_grad_enabled()
    fresh.train()


def test_what_it_cannot_measure_is_refused_in_one_line(fresh):
    with pytest.raises(ValueError, match="single-turn tasks only"):
        check_supported(fresh, ToyTask(multi_turn=True))
    with pytest.raises(ValueError, match="an LOPDModule or an OPSDModule.*remove PrivilegeCheck"):
        check_supported(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="at least one request"):
        check_privilege(fresh, ToyTask(), [])
    for bad in (dict(num_requests=0), dict(every_n_steps=-1), dict(max_new_tokens=0), dict(num_requests=True)):
        with pytest.raises(ValueError, match="PrivilegeCheck .* must be"):
            PrivilegeCheck(**bad)


# ---------------------------------------------------------------------------------------- the warning
def privilege_records(caplog, level):
    return [r for r in caplog.records if r.name == "lopd_lightning.privilege" and r.levelno == level]


def test_the_warning_fires_once_for_a_teacher_no_better_than_its_student(fresh, tmp_path, caplog):
    trainer = fake_trainer(ToyTask(), tmp_path)
    with caplog.at_level(logging.INFO, logger="lopd_lightning"):
        report = PrivilegeCheck(num_requests=4, max_new_tokens=4).run(trainer, fresh)
    assert report.teacher_success <= report.student_success  # a fresh composer on a random model
    warnings = privilege_records(caplog, logging.WARNING)
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "\n" not in message and "not privileged" in message
    for key in ("model.init_args.allow_self_retrieval", "model.init_args.composer_path", "warm_start_self_retrieval",
                "warm_start_steps", "model.init_args.context_framing", "model.init_args.num_latents"):
        assert key in message
    info = privilege_records(caplog, logging.INFO)
    assert len(info) == 1 and report.line() in info[0].getMessage()
    assert trainer.loggers[0].logged == [(0, report.metrics())]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lopd_lightning"):
        PrivilegeCheck(num_requests=4, max_new_tokens=4, warn=False).run(fake_trainer(ToyTask(), tmp_path), fresh)
    assert privilege_records(caplog, logging.WARNING) == [] and len(privilege_records(caplog, logging.INFO)) == 1


def test_no_warning_for_a_teacher_better_than_its_student(fresh, tmp_path, caplog, monkeypatch):
    real = privilege.teacher_greedy_replies

    def teacher_knows_the_answer(module, task, examples, contexts=None, **options):
        replies = real(module, task, examples, contexts, **options)  # the decoding still runs
        return [ex.data["answer"] for ex in examples] if options.get("weights") == "teacher" else replies

    monkeypatch.setattr(privilege, "teacher_greedy_replies", teacher_knows_the_answer)
    with caplog.at_level(logging.INFO, logger="lopd_lightning"):
        report = PrivilegeCheck(num_requests=4, max_new_tokens=4).run(fake_trainer(ToyTask(), tmp_path), fresh)
    assert report.teacher_success == 1.0 and report.student_success == 0.0 and report.privileged
    assert privilege_records(caplog, logging.WARNING) == []
    assert len(privilege_records(caplog, logging.INFO)) == 1


def test_the_warning_is_lopds_only():
    report = PrivilegeReport(requests=4, teacher_success=0.25, student_success=0.25, other_context_success=0.0,
                             swap_effect=None, context_gain=None, seconds=0.1)
    assert not_privileged_warning(SimpleNamespace(), report) is None
    assert set(report.metrics()) == METRICS - {"privilege/swap_effect", "privilege/context_gain"}
    assert "n/a nats/token" in report.line() and "teacher 1/4" in report.line()
    assert all(key.split(" ")[0].startswith("model.init_args.") for key in LOPD_KEYS)


# ---------------------------------------------------------------------------------------- the callback in fit
class Losses(Callback):
    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith("time/")})


@pytest.fixture(scope="module")
def two_fits(tmp_path_factory):
    """Three LOPD steps with PrivilegeCheck(every_n_steps=2) and a logger, and three without either. One torch thread
    (a module fixture runs before conftest's): with two, two runs without the check already differ by float rounding."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = {}
    for name in ("with", "without"):
        root = tmp_path_factory.mktemp(name)
        # LoRA dropout: the steps read the global RNG and the train flags, which the check must leave as they were
        module = lopd_module(max_new_tokens=4, latent_probe_every_n_steps=0, lora={**LORA, "lora_dropout": 0.1})
        dm = OnPolicyDataModule("toy", examples_per_step=2, val_limit=4, val_batch_size=4)
        losses = Losses()
        check = PrivilegeCheck(num_requests=4, every_n_steps=2, max_new_tokens=4)
        logger = MemoryLogger(root)
        callbacks = [check, losses] if name == "with" else [losses]
        trainer = quiet_trainer(root, max_steps=3, callbacks=callbacks, logger=logger if name == "with" else False)
        torch.manual_seed(0)
        trainer.fit(module, datamodule=dm)
        params = [p.detach().clone() for p in (*module.student_parameters(), *module.composer.trainable_parameters())]
        runs[name] = SimpleNamespace(losses=losses.steps, params=params, logger=logger, check=check)
    torch.set_num_threads(threads)
    return runs


def test_the_callback_logs_at_step_0_and_every_n_steps(two_fits):
    run = two_fits["with"]
    logged = [(step, metrics) for step, metrics in run.logger.logged if any(k.startswith("privilege/") for k in metrics)]
    assert [step for step, _ in logged] == [0, 2]
    assert all(set(metrics) == METRICS for _, metrics in logged)
    assert [step for step, _ in run.check.reports] == [0, 2]
    assert logged[0][1] == run.check.reports[0][1].metrics()


def test_training_is_bitwise_the_same_with_the_check(two_fits):
    with_check, without = two_fits["with"], two_fits["without"]
    assert len(with_check.losses) == len(without.losses) == 3
    assert with_check.losses == without.losses  # every logged train/* value, exactly
    assert all(torch.equal(a, b) for a, b in zip(with_check.params, without.params, strict=True))


# ---------------------------------------------------------------------------------------- the command
def test_the_command_writes_its_report(tmp_path, capsys):
    out = tmp_path / "reports" / "privilege.json"
    assert main(["privilege-check", "-c", str(TINY_YAML), "--requests", "4", "--max-new-tokens", "4",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "privilege check on 4 train requests" in printed and "composer_path is null" in printed
    record = json.loads(out.read_text())
    assert record["report"]["requests"] == 4 and set(record["metrics"]) == METRICS
    assert record["request_ids"] == [ex.id for ex in ToyTask().examples("train")[:4]]
    assert record["module"].endswith("LOPDModule") and record["task"] == "toy" and record["composer_path"] is None
    assert record["config"]["model"]["init_args"]["num_latents"] == 4
    assert set(record["versions"]) == {"lopd_lightning", "torch", "transformers", "lightning"}
    assert record["privileged"] is False


@pytest.mark.parametrize("argv, expected", [
    (["--requests", "0"], "lopd privilege-check: --requests must be >= 1, got 0"),
    (["--model.class_path=lopd_lightning.modules.SFTModule"],
     "model.class_path lopd_lightning.modules.SFTModule has no privileged teacher to check; privilege-check is for "
     "LOPDModule or OPSDModule (or a subclass)"),
])
def test_the_command_says_what_to_fix_in_one_line(argv, expected, capsys, no_model_loading):
    code, err = run_main(["privilege-check", "-c", str(TINY_YAML), *argv], capsys)
    assert code == 2
    assert_one_line_error(err, expected)


def test_a_bad_key_is_one_error_line(capsys, no_model_loading):
    code, err = run_main(["privilege-check", "-c", str(TINY_YAML), "--model.init_args.num_latentz=4"], capsys)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "model.init_args.num_latentz" in lines[0] and "num_latents" in lines[0], err
    assert "Traceback" not in err
