"""BFCL multi-turn: the live environment of BFCL's tool classes and its turn-by-turn scoring."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("bfcl_eval")

from lopd_lightning.tasks import get_task  # noqa: E402
from lopd_lightning.tasks.bfcl import (  # noqa: E402
    END_OF_TURN_REPLY,
    BFCLMultiTurnTask,
    ToolCall,
    format_tool_calls,
    missing_results,
    parse_ground_truth_call,
)
from lopd_lightning.tasks.verify import verify_task  # noqa: E402


def call(name, **arguments):
    return format_tool_calls([ToolCall(name, arguments)])


@pytest.fixture(scope="module")
def task():
    return BFCLMultiTurnTask()


@pytest.fixture(scope="module")
def entry0(task):
    # multi_turn_base_0: GorillaFileSystem + TwitterAPI; turn 0's truth is
    # cd(folder='document'), mkdir(dir_name='temp'), mv(source='final_report.pdf', destination='temp')
    example = task.examples("all")[0]
    assert example.id == "multi_turn_base_0"
    return example


def test_hand_played_episode(task, entry0):
    episode = task.start(entry0)
    first = task.initial_messages(entry0)
    assert [m["role"] for m in first] == ["system", "user"]
    assert first[1]["content"] == entry0.text and '"name": "mkdir"' in first[0]["content"]

    out = episode.step(call("cd", folder="document"))
    assert not out.done
    assert out.messages == [{"role": "tool", "name": "cd", "content": '{"current_working_directory": "document"}'}]

    out = episode.step(
        format_tool_calls(
            [
                ToolCall("mkdir", {"dir_name": "temp"}),
                ToolCall("mv", {"source": "final_report.pdf", "destination": "temp"}),
            ]
        )
    )
    assert [m["role"] for m in out.messages] == ["tool", "tool"] and not out.done
    assert "moved to" in out.messages[1]["content"]

    out = episode.step("I moved the report.")  # no call: the turn ends, the next user turn comes
    assert out.messages == entry0.data["question"][1] and not out.done
    assert out.info["turn_ended"] and out.info["turn_passed"] and out.info["fraction_passed"] == 0.25
    assert episode.reward() == 0.0  # not done yet

    replies = task.reference_replies(entry0)
    for reply in replies[2:]:  # the reference replies of turns 1..3
        out = episode.step(reply)
    assert out.done and out.messages == []
    assert episode.turn_passed == [True] * 4
    assert episode.reward() == 1.0
    with pytest.raises(RuntimeError):
        episode.step("more")


def test_reference_replay_first_10(task):
    report = verify_task(task, limit=10)
    assert (report.n, report.n_full_marks, report.failures) == (10, 10, [])


def test_reference_replies_shape(task, entry0):
    replies = task.reference_replies(entry0)
    assert len(replies) == 2 * len(entry0.data["question"])
    assert replies[1::2] == [END_OF_TURN_REPLY] * 4
    # "sort('final_report.pdf')": the positional argument is named from GorillaFileSystem.sort
    assert replies[4] == call("sort", file_name="final_report.pdf")
    assert task.reference_solution(entry0) == "\n\n".join(replies)


def test_wrong_call_gives_zero(entry0):
    for mode in ("all_turns", "fraction"):
        task = BFCLMultiTurnTask(reward_mode=mode)
        episode = task.start(entry0)
        wrong = format_tool_calls(
            [
                ToolCall("cd", {"folder": "document"}),
                ToolCall("mkdir", {"dir_name": "tmp"}),  # truth: 'temp'
                ToolCall("mv", {"source": "final_report.pdf", "destination": "tmp"}),
            ]
        )
        episode.step(wrong)
        out = episode.step(END_OF_TURN_REPLY)
        assert out.info["turn_passed"] is False and "state differs" in out.info["error"]
        for reply in task.reference_replies(entry0)[2:]:
            out = episode.step(reply)
        assert out.done and episode.turn_passed[0] is False
        expected = 0.0 if mode == "all_turns" else sum(episode.turn_passed) / 4
        assert episode.reward() == expected < 1.0
        assert out.info["fraction_passed"] == sum(episode.turn_passed) / 4


def test_tool_errors_are_observations(task, entry0):
    episode = task.start(entry0)
    out = episode.step('[nope(x=1), cd(bad=1), cd(folder="nowhere"), kill(pid=1)]')
    contents = [m["content"] for m in out.messages]
    assert contents[0] == "Error during execution: name 'nope' is not defined"
    assert contents[1].startswith("Error during execution:") and "bad" in contents[1]
    assert "nowhere" in contents[2]  # the tool's own error result
    assert contents[3].startswith("Error during execution:")
    assert not out.done


def test_malformed_reply_ends_the_turn(task, entry0):
    episode = task.start(entry0)
    out = episode.step('<tool_call>[{"name": "cd", "arguments": {')
    assert out.messages == entry0.data["question"][1] and not out.done
    assert out.info["turn_passed"] is False and out.info["parsed"] is False
    assert "no function call" in out.info["error"]


def test_max_steps_per_turn(entry0):
    task = BFCLMultiTurnTask(max_steps_per_turn=2)
    episode = task.start(entry0)
    out = episode.step(call("pwd"))
    assert [m["role"] for m in out.messages] == ["tool"] and "forced_end_of_turn" not in out.info
    out = episode.step(call("pwd"))  # the 2nd reply: its call runs, then the turn is ended
    assert out.info["forced_end_of_turn"] and out.info["turn_ended"]
    assert [m["role"] for m in out.messages] == ["tool", "user"]
    assert out.messages[1] == entry0.data["question"][1][0]
    assert episode.turn == 1


def test_state_is_fresh_per_episode(task, entry0):
    first = task.start(entry0)
    first.step(call("cd", folder="document"))
    first.step(call("rm", file_name="final_report.pdf"))
    assert "final_report.pdf" not in first.step(call("ls")).messages[0]["content"]
    second = task.start(entry0)
    second.step(call("cd", folder="document"))
    assert "final_report.pdf" in second.step(call("ls")).messages[0]["content"]


def test_examples_deterministic_and_splits(task):
    train, val = task.examples("train"), task.examples("val")
    assert [e.id for e in BFCLMultiTurnTask().examples("train")] == [e.id for e in train]
    assert not {e.id for e in train} & {e.id for e in val}
    assert len(train) + len(val) == 200
    assert get_task("bfcl_multi_turn_base").name == "bfcl_multi_turn_base"
    with pytest.raises(ValueError):
        BFCLMultiTurnTask(reward_mode="best")
    with pytest.raises(ValueError):
        BFCLMultiTurnTask("multi_turn_miss_func")


def test_ground_truth_parsing_and_results_multiset():
    classes = ["GorillaFileSystem"]
    assert parse_ground_truth_call("sort('a.txt')", classes) == ToolCall("sort", {"file_name": "a.txt"})
    assert parse_ground_truth_call("ls(a=True)", classes) == ToolCall("ls", {"a": True})
    with pytest.raises(ValueError):
        parse_ground_truth_call("cd(folder=x)", classes)
    assert missing_results(["a", "b", "a"], ["a", "a"]) == []
    assert missing_results(["a", "b"], ["a", "a"]) == ["a"]


def test_agrees_with_bfcl_own_checker(task):
    # bfcl_eval's multi-turn checker imports without API clients: compare verdicts on a few entries,
    # for the reference and for a reference with the last call of the first turn dropped
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    def as_string(c):
        return f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})"

    for i, example in enumerate(task.examples("all")[:5]):
        truth = task.ground_truth_calls(example)
        for variant, plan in enumerate([truth, [truth[0][:-1], *truth[1:]]]):
            episode = task.start(example)
            for calls in plan:
                if calls:
                    episode.step(format_tool_calls(calls))
                episode.step(END_OF_TURN_REPLY)
            entry = {k: example.data[k] for k in ("initial_config", "involved_classes")}
            verdict = multi_turn_checker(
                [[[as_string(c) for c in calls]] if calls else [] for calls in plan],
                example.data["ground_truth"],
                {"id": example.id, **entry},
                "multi_turn_base",
                f"lopd_test_{i}_{variant}",
            )
            assert episode.reward() == (1.0 if verdict["valid"] else 0.0), (example.id, variant, verdict)


@pytest.mark.slow
def test_every_reference_replay_scores_full_marks(task):
    start = time.perf_counter()
    report = verify_task(task)
    print(f"multi_turn_base: {report.n_full_marks}/{report.n} in {time.perf_counter() - start:.2f}s")
    assert report.ok and report.n == 200, (report.failures[:10], list(report.errors.items())[:3])
