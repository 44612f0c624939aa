"""MemoryRefresh (bank growth from successful rollouts only; 0 = frozen) and MarginSchedule (m by step)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lopd_lightning.modules.lopd_callbacks import MarginSchedule, MemoryRefresh
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.memory import Experience, ExperienceBank
from lopd_lightning.memory.embed import get_embedder
from lopd_lightning.modules import GRPOModule, LOPDModule
from lopd_lightning.tasks.toy import ToyTask
from helpers import TINY_BANK, EvenToy

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}





def make_module(**overrides) -> LOPDModule:
    options = dict(
        lora=LORA, group_size=2, max_new_tokens=8, num_latents=4, num_experiences=2, composer_depth=2,
        max_experience_tokens=64, embedder="hashing", distill_top_k=8, learning_rate=1e-3, composer_lr=1e-3,
        bank_path=str(TINY_BANK),
    )
    options.update(overrides)
    return LOPDModule("tiny", **options)


def fit(root, module, dm, callbacks, max_steps=2):
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
        callbacks=callbacks,
    )
    trainer.fit(module, dm)
    return trainer


class BatchLog(Callback):
    """Keeps every training batch (the finished RolloutBatch) and the bank size after each step."""

    def __init__(self):
        self.batches, self.bank_sizes = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(batch)
        self.bank_sizes.append(len(pl_module.bank))


# ------------------------------------------------------------------ MemoryRefresh, hand-built inputs
class FakeModule:
    """What MemoryRefresh uses of a module: ``bank``, ``hparams.num_experiences`` (J: the bank is short below it),
    ``experience_from_trajectory``, ``log`` (callback_metrics), ``log_step_scalars`` and ``log_by_rollouts`` (the
    loggers)."""

    def __init__(self):
        self.bank = ExperienceBank(get_embedder("hashing"))
        self.hparams = SimpleNamespace(num_experiences=2)
        self.logged = {}
        self.written = {}
        self.hook_calls = []

    def experience_from_trajectory(self, task, example, messages, reward):
        self.hook_calls.append((example.id, reward))
        return Experience(task_id=example.id, task_text=example.text, trace=messages[-1]["content"], reward=reward)

    def log(self, name, value, **kwargs):
        assert kwargs.get("logger") is False, "the loggers get it from log_step_scalars, at x = the step"
        self.logged[name] = value

    def log_step_scalars(self, values):
        self.written.update(values)

    def log_by_rollouts(self, values):
        self.written.update({f"by_rollouts/{name}": value for name, value in values.items()})


def fake_trainer(global_step: int):
    task = ToyTask()
    examples = {ex.id: ex for ex in task.examples("all")}
    dm = SimpleNamespace(task=task, example=lambda example_id: examples[example_id])
    return SimpleNamespace(global_step=global_step, world_size=1, datamodule=dm)


def rollout_batch(rewards, example_ids, replies):
    return SimpleNamespace(
        rewards=torch.tensor(rewards),
        example_ids=list(example_ids),
        messages=[[{"role": "user", "content": "q"}, {"role": "assistant", "content": r}] for r in replies],
    )


def test_memory_refresh_adds_only_successful_rollouts():
    cb, module = MemoryRefresh(every_n_steps=1, min_reward=1.0), FakeModule()
    batch = rollout_batch([1.0, 0.0, 0.99, 1.0], ["toy/0", "toy/1", "toy/2", "toy/3"], ["a", "b", "c", "d"])
    cb.on_train_batch_end(fake_trainer(1), module, None, batch, 0)
    # rows 0 and 3 reach min_reward 1.0; 0.99 does not
    assert module.hook_calls == [("toy/0", 1.0), ("toy/3", 1.0)]
    assert [(r.task_id, r.trace) for r in module.bank.records] == [("toy/0", "a"), ("toy/3", "d")]
    assert cb.added_total == 2 and cb.pending == []
    assert module.logged["train/bank_added"] == 2.0
    assert module.written == {"train/bank_added": 2.0, "by_rollouts/bank_added": 2.0}


def test_memory_refresh_waits_for_its_period_and_keeps_pending_in_its_state():
    cb, module = MemoryRefresh(every_n_steps=2, min_reward=0.5), FakeModule()
    cb.on_train_batch_end(fake_trainer(1), module, None, rollout_batch([0.5, 0.2], ["toy/0", "toy/1"], ["a", "b"]), 0)
    assert len(module.bank) == 0 and len(cb.pending) == 1  # step 1: 1 % 2 != 0, only collected
    state = cb.state_dict()
    restored = MemoryRefresh(every_n_steps=2, min_reward=0.5)
    restored.load_state_dict(state)
    restored.on_train_batch_end(fake_trainer(2), module, None, rollout_batch([1.0], ["toy/2"], ["c"]), 0)
    assert [r.task_id for r in module.bank.records] == ["toy/0", "toy/2"]  # both steps' successes at step 2
    assert restored.added_total == 2
    del state["empty_steps"]  # a state this version does not write: one line, what to do
    with pytest.raises(ValueError, match=r"^this checkpoint has no empty_steps in the state of MemoryRefresh: another "
                                         r"version of lopd_lightning wrote it; retrain, or resume with the "
                                         r"lopd_lightning commit that wrote it$"):
        MemoryRefresh().load_state_dict(state)


def test_memory_refresh_zero_period_is_off():
    cb, module = MemoryRefresh(every_n_steps=0), FakeModule()
    for step in (1, 2, 3):
        cb.on_train_batch_end(fake_trainer(step), module, None, rollout_batch([1.0], ["toy/0"], ["a"]), 0)
    assert len(module.bank) == 0 and cb.pending == [] and module.hook_calls == []
    with pytest.raises(ValueError, match="every_n_steps must be >= 0"):
        MemoryRefresh(every_n_steps=-1)


# ------------------------------------------------------------------ MemoryRefresh during a fit
def test_memory_refresh_in_a_fit_grows_the_bank_with_successes_only(tmp_path):
    module = make_module(bank_path=None)  # an empty bank that MemoryRefresh fills
    log = BatchLog()
    dm = OnPolicyDataModule(EvenToy(), examples_per_step=4)
    fit(tmp_path, module, dm, [MemoryRefresh(every_n_steps=1, min_reward=1.0), log])
    task = dm.task
    expected = {
        (batch.example_ids[i], task.experience_text(dm.example(batch.example_ids[i]), batch.messages[i]))
        for batch in log.batches
        for i in range(len(batch))
        if batch.rewards[i] >= 1.0
    }
    assert expected, "no even example was drawn"
    assert all(int(eid.split("/")[1]) % 2 == 0 for eid, _ in expected)
    assert {(r.task_id, r.trace) for r in module.bank.records} == expected
    assert all(r.reward == 1.0 for r in module.bank.records)
    assert {r.step for r in module.bank.records} <= {1, 2}  # made after each step by the module's hook
    # (the log callback runs after the refresh in the same hook, so the second size includes step 2)
    assert log.bank_sizes[-1] == len(expected)


def test_memory_refresh_off_leaves_the_bank_frozen(tmp_path):
    module = make_module(bank_path=None, num_experiences=1)  # the one experience added below: J of them
    module.bank.add([Experience(task_id="seed/0", task_text="Repeat the word: apple", trace="apple", reward=1.0)])
    log = BatchLog()
    fit(tmp_path, module, OnPolicyDataModule(EvenToy(), examples_per_step=4), [MemoryRefresh(every_n_steps=0), log])
    assert any(float(r) == 1.0 for b in log.batches for r in b.rewards)  # there were successes to add
    assert [r.task_id for r in module.bank.records] == ["seed/0"]
    assert log.bank_sizes == [1, 1]


# ------------------------------------------------------------------ MarginSchedule
def test_margin_schedule_fractions_by_hand():
    constant = MarginSchedule()
    assert [constant.fraction(s) for s in (0, 1, 100)] == [1.0, 1.0, 1.0]
    linear = MarginSchedule(schedule="linear", warmup_steps=4)
    # s / 4 for s < 4, then 1
    assert [linear.fraction(s) for s in range(6)] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.0])
    cosine = MarginSchedule(schedule="cosine", warmup_steps=4)
    # (1 - cos(pi s / 4)) / 2: s=1 -> (1 - sqrt(2)/2) / 2 = 0.1464466; s=2 -> 0.5; s=3 -> 0.8535534
    assert [cosine.fraction(s) for s in range(6)] == pytest.approx([0.0, 0.1464466, 0.5, 0.8535534, 1.0, 1.0], abs=1e-7)
    with pytest.raises(ValueError, match="schedule must be"):
        MarginSchedule(schedule="step")
    with pytest.raises(ValueError, match="warmup_steps >= 1"):
        MarginSchedule(schedule="linear", warmup_steps=0)


def test_module_margin_follows_the_schedule_during_a_fit(tmp_path):
    module = make_module(margin=0.09)  # the target m; the schedule ramps the m in effect up to it

    class Margins(Callback):
        def __init__(self):
            self.used, self.logged = [], []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.used.append(pl_module.margin)
            self.logged.append(float(trainer.callback_metrics["train/margin_m"]))

    margins = Margins()
    schedule = MarginSchedule(schedule="linear", warmup_steps=3)
    fit(tmp_path, module, OnPolicyDataModule("toy", examples_per_step=1), [schedule, margins], max_steps=3)
    # steps 0, 1, 2 of a 3-step ramp to 0.09: 0, 0.03, 0.06
    assert margins.used == pytest.approx([0.0, 0.03, 0.06])
    assert margins.logged == pytest.approx([0.0, 0.03, 0.06])
    module.scale_margin(schedule.fraction(3))
    assert module.margin == 0.09 and module.hparams.margin == 0.09  # the module's target, unchanged


# ------------------------------------------------------------------ LOPD-only
@pytest.mark.parametrize(
    "callback, does",
    [(MarginSchedule(), "it sets LOPDModule's privileged margin"),
     (MemoryRefresh(every_n_steps=1), "it adds successful rollouts to LOPDModule's experience bank")],
    ids=["margin_schedule", "memory_refresh"],
)
def test_an_lopd_only_callback_refuses_a_fit_of_another_method(callback, does, tmp_path):
    """MarginSchedule ended in AttributeError ('AttributeDict' has no 'margin') at its first step, and
    MemoryRefresh did nothing, silently."""
    module = GRPOModule("tiny", lora=LORA, group_size=2, max_new_tokens=8)
    with pytest.raises(ValueError) as raised:
        fit(tmp_path, module, OnPolicyDataModule("toy", examples_per_step=1), [callback], max_steps=1)
    name = type(callback).__name__
    assert str(raised.value) == (f"trainer.callbacks: {name} ({does}) works only with LOPDModule, and GRPOModule is "
                                 f"not one; drop it from trainer.callbacks")


@pytest.mark.parametrize("context", ["reference", "retrieved"])
def test_memory_refresh_refuses_opsd_with_or_without_a_bank(tmp_path, context):
    """OPSDModule has a `bank` attribute (None unless privileged_context is "retrieved", then a fixed bank): the
    old check looked for the attribute, so the first step ended in TypeError (object of type 'NoneType' has no
    len()), or a Python fit accepted what `lopd fit` refuses."""
    from lopd_lightning.modules import OPSDModule

    bank = {"bank_path": str(TINY_BANK), "embedder": "hashing"} if context == "retrieved" else {}
    module = OPSDModule("tiny", lora=LORA, group_size=2, max_new_tokens=8, privileged_context=context, **bank)
    assert (module.bank is None) == (context == "reference")
    with pytest.raises(ValueError, match=r"^trainer.callbacks: MemoryRefresh \(it adds successful rollouts to "
                                         r"LOPDModule's experience bank\) works only with LOPDModule, and OPSDModule"):
        fit(tmp_path, module, OnPolicyDataModule("toy", examples_per_step=1), [MemoryRefresh(every_n_steps=1)],
            max_steps=1)


def test_an_lopd_only_callback_accepts_lopd_and_its_subclasses_and_refuses_the_rest():
    """The check is ``isinstance(pl_module, LOPDModule)``: a user's subclass of LOPDModule is accepted."""
    from lopd_lightning.modules import OPSDModule

    class MyLOPD(LOPDModule):
        pass

    for callback in (MarginSchedule(), MemoryRefresh()):
        for method in (LOPDModule, MyLOPD):
            callback.setup(None, object.__new__(method), "fit")
        for method in (GRPOModule, OPSDModule):
            with pytest.raises(ValueError, match=rf"^trainer.callbacks: {type(callback).__name__} .* works only "
                                                 rf"with LOPDModule, and {method.__name__} is not one"):
                callback.setup(None, object.__new__(method), "fit")
