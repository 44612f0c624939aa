"""The task calibration (benchmarks/task_calibration.py) and the start student's --task-options
(benchmarks/start_student.py): the paired bootstrap against hand-derived and enumerated values, the
breakdowns, hidden_rules' scoring under either references option, and a tiny end-to-end run (seconds)."""

from __future__ import annotations

import json

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def calibration():
    return load_benchmark("task_calibration")


@pytest.fixture(scope="module")
def start():
    return load_benchmark("start_student")


def test_the_difference_is_the_comparisons_paired_bootstrap(calibration):
    """The interval is compare_stats.paired_differences' (the comparison's own paired bootstrap), over the same
    questions: every question gaining 1 gives [1, 1]; identical outcomes, however mixed, give [0, 0]."""
    def summary(student, text):
        records = [record(str(i), "book_flight", "date_format", False, True, s, t)
                   for i, (s, t) in enumerate(zip(student, text, strict=True))]
        return calibration.summarise(records, resamples=500, seed=0)

    gain = summary([0, 0, 0], [1, 1, 1])
    assert gain["difference"] == 1.0 and gain["difference_ci"] == [1.0, 1.0] and gain["met"]["difference_ci_excludes_0"]
    same = summary([1, 0, 1, 0], [1, 0, 1, 0])
    assert same["difference"] == 0.0 and same["difference_ci"] == [0.0, 0.0] and not same["met"]["difference_ci_excludes_0"]


def record(qid, tool, kind, plain, same, student, text):
    return {"id": qid, "tool": tool, "rule_kind": kind, "plain": plain, "same_tool": same,
            "student_reward": student, "text_nearest_reward": text}


def test_summary_and_breakdowns_by_hand(calibration):
    records = [
        record("a", "book_flight", "date_format", False, True, 0.0, 1.0),
        record("b", "book_flight", "date_format", False, True, 0.0, 1.0),
        record("c", "send_sms", "id_prefix", False, False, 0.0, 0.0),
        record("d", "get_weather", "none", True, True, 1.0, 1.0),
        record("e", "get_weather", "none", True, False, 1.0, 0.0),
    ]
    out = calibration.summarise(records, resamples=200, seed=0)
    assert out["n_heldout"] == 5 and out["student_solved"] == 2 and out["text_nearest_solved"] == 3
    assert out["student_success"] == pytest.approx(0.4) and out["text_nearest_success"] == pytest.approx(0.6)
    assert out["difference"] == pytest.approx(0.2) and out["difference_ci"][0] <= 0.2 <= out["difference_ci"][1]
    assert out["same_tool_rate"] == pytest.approx(3 / 5) and out["same_tool_count"] == 3
    assert out["by_group"] == {
        "plain_tools": {"n": 2, "student_success": 1.0, "text_nearest_success": 0.5, "difference": -0.5,
                        "same_tool_rate": 0.5},
        "rule_tools": {"n": 3, "student_success": 0.0, "text_nearest_success": pytest.approx(2 / 3),
                       "difference": pytest.approx(2 / 3), "same_tool_rate": pytest.approx(2 / 3)},
    }
    assert set(out["by_rule_kind"]) == {"date_format", "id_prefix", "none"}
    assert out["by_rule_kind"]["date_format"]["difference"] == 1.0 and out["by_tool"]["send_sms"]["n"] == 1
    assert out["met"] == {"student_success": False, "difference": True,  # 0.4 is above the 10-25% band
                          "difference_ci_excludes_0": out["difference_ci"][0] > 0}
    # a task without tools or rules (toy): no breakdowns, no same-tool rate
    bare = [record("x", None, None, None, None, 0.0, 1.0)]
    out = calibration.summarise(bare, resamples=20, seed=0)
    assert out["by_group"] == out["by_rule_kind"] == out["by_tool"] == {} and out["same_tool_rate"] is None


def test_hidden_rules_scoring_does_not_depend_on_references():
    """The format-only student's dev and held-out numbers are the real reward: references change the SFT
    targets, never the checker."""
    from lopd_lightning.tasks import get_task

    rules = get_task("hidden_rules", n_train=30, n_heldout=15)
    format_only = get_task("hidden_rules", n_train=30, n_heldout=15, references="format_only")
    for split in ("train", "val"):
        for a, b in zip(rules.examples(split), format_only.examples(split), strict=True):
            assert (a.id, a.text) == (b.id, b.text)
            for reply in (rules.reference_solution(a), format_only.reference_solution(b), "no call"):
                assert rules.score(a, reply) == format_only.score(b, reply) == rules.score(b, reply)
            assert format_only.score(b, format_only.reference_solution(b)) == (1.0 if b.data["plain"] else 0.0)


def test_task_options_are_parsed_and_recorded(start):
    import argparse

    assert start.task_options('{"references": "format_only"}') == {"references": "format_only"}
    for bad in ("format_only", "[1]"):
        with pytest.raises(argparse.ArgumentTypeError):
            start.task_options(bad)
    args = argparse.Namespace(task="t", model="m", lr=1e-4, examples_per_step=2, steps=[1], dev=2, seed=0,
                              max_new_tokens=8, task_options={})
    assert "task_options" not in start.recipe_of(args)  # the recipes cached before the option still match
    args.task_options = {"references": "format_only"}
    assert start.recipe_of(args)["task_options"] == {"references": "format_only"}


def test_start_student_format_only_then_calibration_on_tiny(start, calibration, tmp_path):
    options = {"n_train": 24, "n_heldout": 4}
    student, results = tmp_path / "student", tmp_path / "start_student.json"
    data = start.main(["--task", "hidden_rules", "--task-options", json.dumps({"references": "format_only", **options}),
                       "--model", "tiny", "--steps", "1", "--dev", "4", "--examples-per-step", "2",
                       "--max-new-tokens", "4", "--out", str(student), "--results", str(results)])
    assert data["recipe"]["task_options"] == {"references": "format_only", **options}
    assert json.loads((student / "recipe.json").read_text()) == data["recipe"] and data["heldout_questions"] == 4

    out, work = tmp_path / "calibration.json", tmp_path / "work"
    argv = ["--student", str(student), "--task", "hidden_rules", "--task-options", json.dumps(options),
            "--embedder", "hashing", "--limit", "3", "--max-new-tokens", "4", "--batch-size", "2",
            "--resamples", "100", "--pairing-check", "2", "--out", str(out), "--work-dir", str(work)]
    report = calibration.main(argv)
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(report))
    for key in ("n_heldout", "student_success", "student_solved", "text_nearest_success", "text_nearest_solved",
                "difference", "difference_ci", "same_tool_rate", "targets", "met", "by_rule_kind", "by_group",
                "by_tool", "bank", "pairing_check", "per_question", "settings", "timings_s", "versions",
                "hardware", "git_sha", "seed", "argv"):
        assert key in written, key
    assert written["n_heldout"] == 3 and len(written["per_question"]) == 3
    low, high = written["difference_ci"]
    assert low <= written["difference"] <= high
    assert written["bank"]["size"] == written["bank"]["n_train"] == 24 and written["bank"]["cached"] is False
    assert written["bank"]["embedder"].startswith("hashing") and written["bank"]["index"] == "flat"  # exact cosine
    assert written["settings"]["framing_prefix"].startswith("Here is a reference example")
    assert written["pairing_check"]["n"] == 2
    for row in written["per_question"]:
        assert row["retrieved_id"].startswith("hidden_rules/train/") and row["tool"] and row["retrieved_tool"]
        assert row["same_tool"] == (row["tool"] == row["retrieved_tool"]) and row["context_tokens"] > 0
        assert {row["student_reward"], row["text_nearest_reward"]} <= {0.0, 1.0}
    # again: the bank is read back (same hash), the journal's answers are kept, the numbers are the same
    lines = (work / "journal.jsonl").read_text().splitlines()
    again = calibration.main(argv)
    assert again["bank"]["cached"] is True and again["bank"]["hash"] == written["bank"]["hash"]
    assert again["per_question"] == written["per_question"] and again["difference_ci"] == written["difference_ci"]
    assert (work / "journal.jsonl").read_text().splitlines() == lines
    with pytest.raises(SystemExit):  # the bank must hold the rules' successes
        calibration.main([*argv, "--task-options", json.dumps({"references": "format_only"})])
