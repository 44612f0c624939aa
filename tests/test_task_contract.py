"""The Task contract (issue 14, item 4): docs/tasks.md documents every attribute and method, its two-turn example
runs as documented, and an episode cut at the turn limit before it said ``done`` is recorded and warned
about once per task, naming ``multi_turn``, ``max_turns`` and ``model.init_args.max_turns``."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from lopd_lightning import rollout
from lopd_lightning.rollout import generate_rollouts
from lopd_lightning.tasks import Episode, Example, StepResult, Task

TASKS_DOC = Path(__file__).resolve().parents[1] / "docs" / "tasks.md"  # the README links to it


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """The turn-limit warning is given once per task name and process: start each test without it."""
    rollout._TURN_LIMIT_WARNED.clear()
    yield
    rollout._TURN_LIMIT_WARNED.clear()


def contract_section() -> str:
    text = TASKS_DOC.read_text()
    start = text.index("# Your own task: the Task contract")
    end = text.find("\n## ", start)
    return text[start:] if end < 0 else text[start:end]


def readme_example() -> dict:
    """docs/tasks.md's two-turn task, executed as a user would paste it."""
    code = re.search(r"```python\n(.*?)```", contract_section(), flags=re.S).group(1)
    namespace: dict = {"__name__": "readme_guess"}
    exec(compile(code, "docs/tasks.md", "exec"), namespace)
    return namespace


class TwoStepEpisode(Episode):
    """Asks for a second reply (done=False after the first), then scores 1."""

    def __init__(self):
        self.replies = 0

    def step(self, reply):
        self.replies += 1
        if self.replies == 1:
            return StepResult(messages=[{"role": "user", "content": "And now?"}], done=False)
        return StepResult(messages=[], done=True)

    def reward(self):
        return 1.0 if self.replies >= 2 else 0.0


class Undeclared(Task):
    """A two-step task that declares neither ``multi_turn`` nor ``max_turns``."""

    name = "undeclared_two_step"

    def all_examples(self):
        return [Example(id=f"u/{i}", text=f"task {i}") for i in range(4)]

    def initial_messages(self, example):
        return [{"role": "user", "content": example.text}]

    def start(self, example):
        return TwoStepEpisode()

    def reference_solution(self, example):
        return "x"


class Declared(Undeclared):
    name = "declared_two_step"
    multi_turn = True
    max_turns = 2


def roll(model, tokenizer, task, **options):
    return generate_rollouts(model, tokenizer, task, task.all_examples()[:2], max_new_tokens=3, seed=0, **options)


def turn_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lopd_lightning.rollout" and "max_turns" in r.getMessage()]


def test_readme_documents_every_part_of_the_contract():
    section = contract_section()
    for name in ("name", "multi_turn", "max_turns", "all_examples()", "examples(split)", "initial_messages(example)",
                 "tools(example)", "start(example)", "Episode.step(reply)", "StepResult(messages, done, info)",
                 "Episode.reward()", "score(example, reply)", "score_with_info(example, reply)",
                 "reference_solution(example)", "reference_replies(example)", "experience_text(example, messages)",
                 "model.init_args.max_turns", 'truncation="max_turns"'):
        assert f"`{name}`" in section, name
    # every public method of Task is in the table
    public = {n for n in vars(Task) if not n.startswith("_") and callable(getattr(Task, n))} - {"check_split"}
    assert {n for n in public if f"`{n}(" not in section} == set()


def test_the_readme_two_turn_task_runs_two_turns_without_a_warning(model, tokenizer, caplog):
    ns = readme_example()
    task = ns["GuessTask"]()
    batch = roll(model, tokenizer, task)
    assert [m["turns"] for m in batch.metadata] == [2, 2]
    assert [m["done"] for m in batch.metadata] == [True, True] and all(m["truncation"] is None for m in batch.metadata)
    assert [[msg["role"] for msg in conv] for conv in batch.messages] == [["user", "assistant", "tool", "assistant"]] * 2
    assert batch.messages[0][2]["content"] == "hint: it is 0"
    # the random model does not answer "0"/"1": the checker's verdict is kept with the trajectory
    assert batch.rewards.tolist() == [0.0, 0.0]
    assert [m["info"] for m in batch.metadata] == [{"error": "expected 0"}, {"error": "expected 1"}]
    assert turn_warnings(caplog) == []
    # the reference replays to full marks through the same episode
    example = task.all_examples()[3]
    episode = task.start(example)
    results = [episode.step(r) for r in task.reference_replies(example)]
    assert [r.done for r in results] == [False, True] and episode.reward() == 1.0


def test_an_undeclared_two_step_task_is_cut_after_one_reply_with_one_warning(model, tokenizer, caplog):
    caplog.set_level(logging.WARNING, logger="lopd_lightning.rollout")
    batch = roll(model, tokenizer, Undeclared())
    assert [m["turns"] for m in batch.metadata] == [1, 1]
    assert all(m["truncated"] and m["truncation"] == "max_turns" and not m["done"] for m in batch.metadata)
    assert batch.rewards.tolist() == [0.0, 0.0]
    (line,) = turn_warnings(caplog)
    assert "'undeclared_two_step' has multi_turn = False" in line
    assert "example 'u/0' asked for another turn (StepResult.done = False) after 1 reply" in line
    assert "2 of 2 episodes were cut at max_turns=1" in line
    assert "`multi_turn = True`" in line and "`max_turns`" in line and "model.init_args.max_turns" in line
    assert "\n" not in line
    roll(model, tokenizer, Undeclared())  # once per task
    assert len(turn_warnings(caplog)) == 1


def test_a_declared_two_step_task_gets_two_replies(model, tokenizer, caplog):
    caplog.set_level(logging.WARNING, logger="lopd_lightning.rollout")
    batch = roll(model, tokenizer, Declared())
    assert [m["turns"] for m in batch.metadata] == [2, 2]
    assert all(m["truncation"] is None and m["done"] for m in batch.metadata)
    assert batch.rewards.tolist() == [1.0, 1.0]
    assert turn_warnings(caplog) == []


def test_a_multi_turn_task_cut_by_the_config_limit_is_warned_about(model, tokenizer, caplog):
    caplog.set_level(logging.WARNING, logger="lopd_lightning.rollout")
    batch = roll(model, tokenizer, Declared(), max_turns=1)
    assert [m["truncation"] for m in batch.metadata] == ["max_turns", "max_turns"]
    (line,) = turn_warnings(caplog)
    assert line.startswith("task 'declared_two_step': 2 of 2 episodes were cut at max_turns=1 "
                           "(from the max_turns argument (model.init_args.max_turns)) before they ended")
    assert "raise the task's `max_turns` attribute or model.init_args.max_turns" in line


def test_the_module_path_warns_too_and_records_the_cut(caplog):
    """Through a method's make_batch (the hooked task the modules use), as in training."""
    from lopd_lightning.modules.grpo import GRPOModule

    caplog.set_level(logging.WARNING, logger="lopd_lightning.rollout")
    module = GRPOModule("tiny", group_size=2, max_new_tokens=3)
    task = Undeclared()
    batch = module.make_batch(task, task.all_examples()[:1])
    assert [m["truncation"] for m in batch.metadata] == ["max_turns", "max_turns"]
    assert len(turn_warnings(caplog)) == 1 and "multi_turn = False" in turn_warnings(caplog)[0]


def test_single_turn_info_reaches_the_metadata(model, tokenizer):
    class Checked(Undeclared):
        name = "checked"

        def start(self, example):
            return Task.start(self, example)

        def score_with_info(self, example, completion):
            return 0.0, {"error": f"wrong answer for {example.id}"}

    batch = roll(model, tokenizer, Checked())
    assert [m["info"] for m in batch.metadata] == [{"error": "wrong answer for u/0"}, {"error": "wrong answer for u/1"}]
    assert [m["errors"] for m in batch.metadata] == [["wrong answer for u/0"], ["wrong answer for u/1"]]
    assert all(m["truncation"] is None for m in batch.metadata)


def test_task_declares_max_turns_default():
    assert Task.max_turns is None and Task.multi_turn is False


# ----------------------------------------------------------------------- score and score_with_info: one computation
def test_a_task_implements_one_of_score_and_score_with_info_and_the_base_derives_the_other():
    from lopd_lightning.tasks.toy import ToyTask

    class Explained(ToyTask):  # ToyTask implements score; this subclass says why instead
        def score_with_info(self, example, completion):
            return 0.0, {"error": "never right"}

    class PlainAgain(Explained):  # and back: its score is the source of both again
        def score(self, example, completion):
            return 1.0

    toy = ToyTask(num_examples=2)
    example = toy.examples()[0]
    answer = example.data["answer"]
    assert toy.score(example, answer) == 1.0 and toy.score_with_info(example, answer) == (1.0, {})
    explained = Explained(num_examples=2)
    assert explained.score(example, answer) == 0.0  # not ToyTask's score, which would say 1.0
    assert explained.score_with_info(example, answer) == (0.0, {"error": "never right"})
    assert PlainAgain(num_examples=2).score_with_info(example, "x") == (1.0, {})
    assert explained.start(example).step(answer).info == {"error": "never right"}


def test_an_override_that_calls_super_reaches_its_parents_computation():
    """A subclass of a score_with_info task that overrides score and calls super().score, and a subclass of a
    score task that overrides score_with_info and calls super().score_with_info: each gets its parent's value
    (no NotImplementedError, no recursion), and the rollout (score_with_info) reads the override."""
    from lopd_lightning.tasks.toy import ToyTask

    class Explaining(ToyTask):  # the parent: a score_with_info task
        def score_with_info(self, example, completion):
            return float(completion.strip() == example.data["answer"]), {"why": "parent"}

    class Bonus(Explaining):  # overrides score on top of it
        def score(self, example, completion):
            return min(1.0, super().score(example, completion) + 0.25)

    class Noted(ToyTask):  # overrides score_with_info on top of a score task
        def score_with_info(self, example, completion):
            reward, info = super().score_with_info(example, completion)
            return reward, {**info, "note": "checked"}

    example = ToyTask(num_examples=2).examples()[0]
    answer = example.data["answer"]
    bonus, noted = Bonus(num_examples=2), Noted(num_examples=2)
    assert bonus.score(example, "wrong") == 0.25 and bonus.score(example, answer) == 1.0
    assert bonus.score_with_info(example, "wrong") == (0.25, {})  # the rollout's reward is the override's
    episode = bonus.start(example)
    episode.step("wrong")
    assert episode.reward() == 0.25
    assert noted.score_with_info(example, answer) == (1.0, {"note": "checked"})
    assert noted.score(example, "wrong") == 0.0


def test_a_task_that_defines_both_is_refused():
    with pytest.raises(TypeError, match="Both defines both score and score_with_info: a task implements one of them"):
        class Both(Undeclared):
            def score(self, example, completion):
                return 1.0

            def score_with_info(self, example, completion):
                return 1.0, {}
