"""Exact resume: a run interrupted mid-training and resumed from its last checkpoint continues exactly
like an uninterrupted run with the same seed (LOPD on the tiny model and the toy task, CPU).

What must come back for the metrics to match: student and composer weights (and the frozen anchor), both
optimisers' moments, beta, the margin schedule's position (the global step), the experience bank grown
by the memory refresh, the refresh's pending candidates, the data position and the rollout seeds
(derived from the seed and the global step), and the trajectory counter.
"""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lopd_lightning.modules.lopd_callbacks import MarginSchedule, MemoryRefresh
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.memory import Experience
from lopd_lightning.modules import LOPDModule
from lopd_lightning.tasks.toy import ToyTask
from helpers import EvenToy

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
TOTAL_STEPS, INTERRUPT_AT = 4, 2



class Interrupt(Exception):
    pass


class InterruptAt(Callback):
    """Stops the run at the start of ``step`` (after the checkpoint of the step before was written)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Interrupt(f"interrupted at step {self.step}")


class StepLog(Callback):
    """Per step: the logged scalars (no timings), beta, the bank size and a checksum of every weight."""

    def __init__(self):
        self.steps: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith("time/")}
        self.steps[trainer.global_step] = {
            "logged": logged,
            "beta": pl_module.beta,
            "bank": len(pl_module.bank),
            "example_ids": list(batch.example_ids),
            "weights": sum(float(p.detach().double().abs().sum()) for p in pl_module.parameters()),
        }


def seed_bank(module: LOPDModule, task: ToyTask) -> None:
    """Four successful references in the bank, so that retrieval and latents exist from step 1."""
    records = []
    for ex in task.examples("train")[:4]:
        messages = [*task.initial_messages(ex), {"role": "assistant", "content": task.reference_solution(ex)}]
        records.append(Experience(task_id=ex.id, task_text=ex.text, trace=task.experience_text(ex, messages), reward=1.0))
    module.bank.add(records)


def build(tmp_path, name: str, extra_callbacks=()):
    L.seed_everything(0)
    task = EvenToy()
    module = LOPDModule(
        "tiny", lora=LORA, group_size=2, max_new_tokens=8, num_latents=4, num_experiences=2,
        composer_depth=2, max_experience_tokens=64, embedder="hashing", distill_top_k=8, learning_rate=1e-3,
        composer_lr=1e-3, margin=0.3, seed=0,
    )
    seed_bank(module, task)
    dm = OnPolicyDataModule(task, examples_per_step=2, val_limit=4, val_batch_size=4)
    log = StepLog()
    callbacks = [
        MarginSchedule(schedule="linear", warmup_steps=TOTAL_STEPS),  # the margin depends on the step
        MemoryRefresh(every_n_steps=2, min_reward=1.0),  # candidates pend across a checkpoint
        ModelCheckpoint(dirpath=tmp_path / name / "ckpt", every_n_train_steps=1, save_top_k=-1, save_last=True),
        log,
        *extra_callbacks,
    ]
    trainer = L.Trainer(
        max_steps=TOTAL_STEPS, accelerator="cpu", devices=1, logger=False, limit_val_batches=0,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path / name),
        callbacks=callbacks,
    )
    return module, dm, trainer, log


def test_resume_after_an_interruption_matches_the_uninterrupted_run(tmp_path):
    module, dm, trainer, reference = build(tmp_path, "straight")
    trainer.fit(module, dm)
    assert trainer.global_step == TOTAL_STEPS

    module, dm, trainer, first = build(tmp_path, "interrupted", [InterruptAt(INTERRUPT_AT)])
    with pytest.raises(Interrupt):
        trainer.fit(module, dm)
    assert sorted(first.steps) == list(range(1, INTERRUPT_AT + 1))
    last = tmp_path / "interrupted" / "ckpt" / "last.ckpt"
    assert last.exists()

    # a fresh process's view: new module, new DataModule, new callbacks; everything else from the file
    module, dm, trainer, resumed = build(tmp_path, "resumed")
    trainer.fit(module, dm, ckpt_path=str(last))
    assert trainer.global_step == TOTAL_STEPS
    assert sorted(resumed.steps) == list(range(INTERRUPT_AT + 1, TOTAL_STEPS + 1))

    for step in range(1, INTERRUPT_AT + 1):  # the interrupted run's first steps are the reference's
        assert first.steps[step]["logged"] == pytest.approx(reference.steps[step]["logged"], rel=1e-6, abs=1e-7)
    for step in range(INTERRUPT_AT + 1, TOTAL_STEPS + 1):
        want, got = reference.steps[step], resumed.steps[step]
        assert got["example_ids"] == want["example_ids"], step
        assert got["bank"] == want["bank"], step
        assert got["beta"] == pytest.approx(want["beta"], rel=1e-6, abs=1e-9), step
        assert got["weights"] == pytest.approx(want["weights"], rel=1e-9), step
        # callback_metrics keeps a tag's last value: the uninterrupted run still shows step 2's refresh
        # count at step 3, which the resumed process never logged; every tag logged at a step matches
        assert set(got["logged"]) <= set(want["logged"])
        # (and step 0's latent probe, logged once every latent_probe_every_n_steps)
        assert set(want["logged"]) - set(got["logged"]) <= {"train/bank_added", "train/latent_spread",
                                                            "train/latent_swap_effect", "train/latent_own_minus_other"}
        for key, value in got["logged"].items():
            assert value == pytest.approx(want["logged"][key], rel=1e-6, abs=1e-7), (step, key)
    # the run did something worth restoring
    assert resumed.steps[TOTAL_STEPS]["logged"]["train/bank_added"] == reference.steps[TOTAL_STEPS]["logged"]["train/bank_added"]
    assert reference.steps[TOTAL_STEPS]["bank"] > 4
    assert reference.steps[TOTAL_STEPS]["beta"] > 0


def one_step_grpo_checkpoint(tmp_path):
    """``(path, datamodule)``: the checkpoint of a one-step GRPO run on the tiny model and ParityToy."""
    from lopd_lightning.modules import GRPOModule
    from helpers import ParityToy, quiet_trainer

    dm = OnPolicyDataModule(ParityToy(), examples_per_step=2, val_limit=2, val_batch_size=2)
    trainer = quiet_trainer(tmp_path, max_steps=1, enable_checkpointing=True,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1)])
    trainer.fit(GRPOModule("tiny", lora=LORA, group_size=2, max_new_tokens=4), dm)
    return next((tmp_path / "ck").glob("*.ckpt")), dm


def test_a_checkpoint_this_version_cannot_restore_is_refused_in_one_line(tmp_path, capsys):
    """Weights under names the module does not have (here: a composer adapter, which a GRPO of another
    version carried) or a state without an entry the module writes: resuming, load_from_checkpoint and
    lopd export stop with one line that says what to do, before anything loads."""
    import torch

    from lopd_lightning.modules import GRPOModule
    from helpers import assert_one_line_error, quiet_trainer, run_main

    path, dm = one_step_grpo_checkpoint(tmp_path)
    checkpoint = torch.load(path, weights_only=False)
    extra = {k.replace(".student.", ".composer."): torch.zeros_like(v) for k, v in checkpoint["state_dict"].items()
             if ".student." in k}
    assert extra and all(k not in checkpoint["state_dict"] for k in extra)
    fix = ("another version of lopd_lightning, or other settings, wrote it; retrain, or load it with the settings "
           "and the lopd_lightning commit that wrote it")
    weights = f"this checkpoint's weights do not match GRPOModule's ({len(extra)} unexpected, e.g. {min(extra)!r}): {fix}"
    no_counter = f"this checkpoint has no non_finite_steps in the state of GRPOModule: {fix}"
    for change, expected in (("weights", weights), ("state", no_counter)):
        broken = torch.load(path, weights_only=False)
        if change == "weights":
            broken["state_dict"].update(extra)
        else:
            del broken["lopd_state"]["non_finite_steps"]
        other = tmp_path / f"{change}.ckpt"
        torch.save(broken, other)
        with pytest.raises(ValueError) as caught:
            resumed = GRPOModule("tiny", lora=LORA, group_size=2, max_new_tokens=4)
            quiet_trainer(tmp_path / change, max_steps=2).fit(resumed, dm, ckpt_path=str(other))
        assert str(caught.value) == expected
        with pytest.raises(ValueError) as caught:
            GRPOModule.load_from_checkpoint(other)
        assert str(caught.value) == expected
        code, err = run_main(["export", str(other), "--out", str(tmp_path / f"student_{change}")], capsys)
        assert code == 1
        assert_one_line_error(err, expected)


def test_a_resumed_run_keeps_its_validation_history_and_its_summary_its_before(tmp_path):
    """The step-0 validation ran in the first process; the resumed process's summary still reports it as
    "before" (the checkpoint carries val_history), and its history lists every validation once, in order."""
    import torch

    from lopd_lightning.callbacks import RunSummary
    from lopd_lightning.modules import GRPOModule
    from helpers import ParityToy, quiet_trainer

    def run(name, max_steps, ckpt_path=None, extra=()):
        L.seed_everything(0)
        module = GRPOModule("tiny", lora=LORA, group_size=2, max_new_tokens=4, validate_before_training=True)
        dm = OnPolicyDataModule(ParityToy(), examples_per_step=2, val_limit=2, val_batch_size=2)
        summary = RunSummary()
        trainer = quiet_trainer(tmp_path / name, max_steps=max_steps, enable_checkpointing=True,
                                limit_val_batches=None, val_check_interval=2, check_val_every_n_epoch=None,
                                callbacks=[ModelCheckpoint(dirpath=tmp_path / name / "ck", every_n_train_steps=1,
                                                           save_last=True), summary, *extra])
        trainer.fit(module, dm, ckpt_path=ckpt_path)
        return summary.summary(trainer, module)

    straight = run("straight", 4)
    assert [step for step, _ in straight["history"]] == [0, 2, 4]
    with pytest.raises(Interrupt):
        run("first", 4, extra=[InterruptAt(3)])
    last = tmp_path / "first" / "ck" / "last.ckpt"  # written after step 3
    saved = torch.load(last, weights_only=False)["lopd_state"]["val_history"]
    assert [step for step, _ in saved] == [0, 2]
    resumed = run("resumed", 4, ckpt_path=str(last))
    assert [step for step, _ in resumed["history"]] == [0, 2, 4]
    for (_, got), (_, want) in zip(resumed["history"], straight["history"]):  # val/success_rate at each
        assert got == pytest.approx(float(want))
    assert resumed["before"] is not None
    assert resumed["before"] == pytest.approx(float(straight["before"]))
    assert resumed["after"] == pytest.approx(float(straight["after"]))


def test_a_checkpoint_without_a_validation_history_still_resumes(tmp_path):
    """Checkpoints written before val_history was saved resume with an empty history (nothing refused)."""
    import torch

    from lopd_lightning.modules import GRPOModule
    from helpers import quiet_trainer

    path, dm = one_step_grpo_checkpoint(tmp_path)
    old = torch.load(path, weights_only=False)
    del old["lopd_state"]["val_history"]
    torch.save(old, tmp_path / "old.ckpt")
    module = GRPOModule("tiny", lora=LORA, group_size=2, max_new_tokens=4)
    quiet_trainer(tmp_path / "resumed", max_steps=2).fit(module, dm, ckpt_path=str(tmp_path / "old.ckpt"))
    assert module.global_step == 2 and module.val_history == []
