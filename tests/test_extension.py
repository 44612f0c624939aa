"""The documented extension example (examples/custom_task.py): a new Task and an LOPDModule subclass
that overrides the public hooks, trained for two steps; each hook is called and has its effect. And
subclasses of a method module: an argument of their own, an ABC mixin."""

from __future__ import annotations

import abc
import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lopd_lightning.modules.lopd_callbacks import MemoryRefresh
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.modules import GRPOModule, LOPDModule
from lopd_lightning.tasks.verify import verify_task
from helpers import ParityToy, quiet_trainer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_task.py"




@pytest.fixture(scope="module")
def custom_task():
    spec = importlib.util.spec_from_file_location("custom_task", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_task"] = module  # importable by name, as with PYTHONPATH=examples
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("custom_task", None)


def test_the_example_task_is_a_valid_task(custom_task):
    task = custom_task.ReverseWordTask()
    assert len(task.examples("all")) == 12
    assert len(task.examples("train")) + len(task.examples("val")) == 12
    assert verify_task(task).ok  # every reference solution earns full marks
    ex = task.examples("all")[0]
    assert (ex.text, task.reference_solution(ex)) == ("Spell the word apple backwards.", "elppa")
    assert task.score(ex, "It is ELPPA.") == 1.0 and task.score(ex, "apple") == 0.0


def test_shaped_reward_by_hand(custom_task):
    # answer "elppa" (5 characters): correct and short -> 0.8 + 0.2; wrong, 10 characters -> 0.2 * 5/10
    assert custom_task.shaped_reward("elppa", "elppa", 1.0) == pytest.approx(1.0)
    assert custom_task.shaped_reward("elppa", "x" * 10, 0.0) == pytest.approx(0.1)
    assert custom_task.shaped_reward("elppa", "", 0.0) == 0.0


def test_subclass_hooks_are_called_and_take_effect_in_training(tmp_path, custom_task):
    module, dm = custom_task.build()
    calls: Counter[str] = Counter()
    for hook in ("build_messages", "score_trajectory", "experience_from_trajectory"):
        bound = getattr(module, hook)

        def counted(*args, _bound=bound, _hook=hook, **kwargs):
            calls[_hook] += 1
            return _bound(*args, **kwargs)

        setattr(module, hook, counted)

    class Batches(Callback):
        def __init__(self):
            self.batches = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.batches.append(batch)

    log = Batches()
    # min_reward 0: every trajectory goes to experience_from_trajectory, which decides what is kept
    refresh = MemoryRefresh(every_n_steps=1, min_reward=0.0)
    trainer = custom_task.train(module, dm, callbacks=[refresh, log], default_root_dir=str(tmp_path))
    assert trainer.global_step == 2
    rows = [(b, i) for b in log.batches for i in range(len(b))]
    assert len(rows) == 8  # 2 steps x 2 examples x 2 rollouts
    assert calls["build_messages"] >= 8 and calls["score_trajectory"] == 8 and calls["experience_from_trajectory"] == 8

    # build_messages: every trajectory starts with the system prompt, also in the tokens the student saw
    for batch, i in rows:
        assert batch.messages[i][0] == {"role": "system", "content": custom_task.SYSTEM_PROMPT}
        prompt = module.tokenizer.decode(batch.input_ids[i][: int(batch.context_position[i])])
        assert custom_task.SYSTEM_PROMPT in prompt

    # score_trajectory: the batch's rewards are the shaped rewards, not the task's 0/1
    task = dm.task
    for batch, i in rows:
        example = dm.example(batch.example_ids[i])
        reply = custom_task.last_reply(batch.messages[i])
        expected = custom_task.shaped_reward(example.data["answer"], reply, task.score(example, reply))
        assert float(batch.rewards[i]) == pytest.approx(expected, abs=1e-6)
    assert any(0.0 < float(b.rewards[i]) < 1.0 for b, i in rows)  # shaped values the task never gives

    # experience_from_trajectory: the bank holds answer-only traces of the non-empty replies
    expected_records = {
        (b.example_ids[i], f"[answer] {custom_task.last_reply(b.messages[i])}")
        for b, i in rows
        if custom_task.last_reply(b.messages[i])
    }
    assert {(r.task_id, r.trace) for r in module.bank.records} == expected_records
    # and the second step retrieved the first step's custom experiences for the composer
    second = log.batches[1]
    retrieved = [e for exps in second.experiences for e in exps]
    assert retrieved and all(e.trace.startswith("[answer] ") for e in retrieved)


def test_a_tasks_own_turn_limit_is_kept_through_the_hooks(custom_task):
    """A task's ``max_turns`` attribute (read by the rollout code) still applies to the module's rollouts."""
    from lopd_lightning.tasks import Episode, StepResult

    class Endless(Episode):
        def step(self, reply):
            return StepResult(messages=[{"role": "user", "content": "again"}], done=False)

        def reward(self):
            return 0.0

    class ThreeTurns(custom_task.ReverseWordTask):
        multi_turn = True
        max_turns = 3

        def start(self, example):
            return Endless()

    module, _ = custom_task.build(max_new_tokens=2, group_size=1)
    task = ThreeTurns()
    batch = module.make_batch(task, task.examples("train")[:2])
    assert [m["turns"] for m in batch.metadata] == [3, 3]
    assert all(m["truncation"] == "max_turns" for m in batch.metadata)


def test_module_hooked_task_routes_messages_and_rewards_through_the_hooks(custom_task):
    """ModuleHookedTask, the one place the hooks enter the rollout loop, works with any object that has them."""
    import pytest

    from lopd_lightning.modules.hooked_task import ModuleHookedEpisode, ModuleHookedTask, TrajectoryHooks

    class Hooks:
        def __init__(self):
            self.scored = []

        def build_messages(self, task, example):
            return [{"role": "system", "content": "be brief"}, *task.initial_messages(example)]

        def score_trajectory(self, task, example, messages, reward):
            self.scored.append((example.id, [m["role"] for m in messages], reward))
            return 0.5 * reward

    task, hooks = custom_task.ReverseWordTask(), Hooks()
    assert isinstance(hooks, TrajectoryHooks)
    hooked = ModuleHookedTask(task, hooks)
    example = task.examples("train")[0]
    assert hooked.name == task.name and hooked.examples("train") == task.examples("train")
    assert hooked.initial_messages(example)[0] == {"role": "system", "content": "be brief"}
    episode = hooked.start(example)
    assert isinstance(episode, ModuleHookedEpisode)
    assert episode.step(example.data["answer"]).done
    assert episode.reward() == 0.5
    assert hooks.scored == [(example.id, ["system", "user", "assistant"], 1.0)]

    class Broken(custom_task.ReverseWordTask):
        def score(self, example, completion):
            return 2.0  # outside [0, 1]: the task's reward is checked before the hook sees it

    broken = ModuleHookedTask(Broken(), hooks).start(example)
    broken.step("x")
    with pytest.raises(ValueError, match=r"returned reward 2\.0 .*rewards must be in \[0, 1\]"):
        broken.reward()


def test_a_drawing_build_messages_runs_once_per_episode_and_scores_what_the_student_saw(custom_task):
    """A hook that draws its messages (here: a counter standing in for random few-shot examples) is called once
    per rollout, and score_trajectory receives the conversation whose prompt the student was given."""
    calls, scored = [], []

    class Drawing(custom_task.ReverseWordLOPD):
        def build_messages(self, task, example):
            calls.append(example.id)
            return [{"role": "system", "content": f"draw {len(calls)}"}, *task.initial_messages(example)]

        def score_trajectory(self, task, example, messages, reward):
            scored.append(messages[0]["content"])
            return reward

    torch.manual_seed(0)
    module, _ = custom_task.build(max_new_tokens=2, group_size=2)
    module.__class__ = Drawing
    task = custom_task.ReverseWordTask()
    batch = module.make_batch(task, task.examples("train")[:2])
    prompts = [m[0]["content"] for m in batch.messages]
    assert len(calls) == 4 and prompts == [f"draw {i}" for i in range(1, 5)]  # once per rollout, in order
    assert sorted(scored) == sorted(prompts)  # each scored conversation is the one the student was prompted with
    assert all(module.tokenizer.decode(batch.input_ids[i]).count(p) == 1 for i, p in enumerate(prompts))


# ------------------------------------------------------------------ subclasses of a method module
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


class BonusGRPO(GRPOModule):
    """(i) an argument of its own, and a default group size of its own."""

    def __init__(self, bonus: float = 0.1, group_size: int = 2, **kwargs):
        super().__init__(group_size=group_size, **kwargs)


class Scorer(abc.ABC):
    """An abstract mixin."""

    @abc.abstractmethod
    def bonus_for(self, reward: float) -> float: ...


class ScoredGRPO(GRPOModule, Scorer):
    """(ii) a method module with an abc.ABC mixin."""

    def bonus_for(self, reward: float) -> float:
        return 0.5 * reward


def test_a_method_module_with_an_abc_mixin_builds():
    module = ScoredGRPO(lora=LORA, max_new_tokens=4, group_size=2)
    assert isinstance(module, Scorer) and module.bonus_for(1.0) == 0.5
    assert type(ScoredGRPO) is abc.ABCMeta  # no metaclass conflict: the modules keep type's

    class Unfinished(GRPOModule, Scorer):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Unfinished(lora=LORA)


def test_a_subclass_with_an_argument_of_its_own_builds_and_its_checkpoint_loads(tmp_path):
    module = BonusGRPO(lora=LORA, max_new_tokens=4)
    assert module.hparams.bonus == 0.1 and module.hparams.group_size == 2
    dm = OnPolicyDataModule(ParityToy(), examples_per_step=2, val_limit=2, val_batch_size=2)
    trainer = quiet_trainer(tmp_path, max_steps=1, enable_checkpointing=True,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1)])
    trainer.fit(module, dm)
    path = next((tmp_path / "ck").glob("*.ckpt"))
    assert torch.load(path, weights_only=False)["hyper_parameters"]["group_size"] == 2
    loaded = BonusGRPO.load_from_checkpoint(path)
    assert dict(loaded.hparams) == dict(module.hparams)
    for key, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
