"""The task calibration (benchmarks/task_calibration.py) and the start student's --task-options
(benchmarks/start_student.py): the paired bootstrap against hand-derived and enumerated values, the
breakdowns, hidden_rules' scoring under either references option, a tiny end-to-end run (seconds), and
--in-context-fraction's rows (the teacher's framing of another request's trace under rules that are not seed
0's, that environment's target; the other rows unchanged; seeded)."""

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


# ----------------------------------------------------------------------- --in-context-fraction (issue 33)
SIZES = {"n_train": 60, "n_heldout": 15}


def offset_env(k: int):
    from lopd_lightning.tasks import get_task

    return get_task("hidden_rules", references="rules", rule_offset=k, **SIZES)


@pytest.fixture(scope="module")
def in_context(start):
    from lopd_lightning.tasks import get_task

    view = start.dev_split_task(get_task("hidden_rules", references="format_only", **SIZES), 8, 0)
    return view, *start.in_context_task(view, offset_env, 0.5, 0)


@pytest.fixture(scope="module")
def tiny_module(calibration):
    import argparse

    return calibration.build_module("tiny", argparse.Namespace(max_new_tokens=4, embedder="hashing", seed=0))


def test_in_context_rows_are_the_teachers_framing_of_another_request_under_other_rules(in_context, tiny_module):
    """Each in-context row: the first user message is SelfTeacher's framing of the bank's trace of another SFT
    request of the same tool in an environment whose rule differs from seed 0's (its ids are the calibration's
    text_nearest ids: the context's ids inserted where insert_context puts them); its target keeps that
    environment's rule and breaks seed 0's; plain tools keep the plain reply. Other rows are unchanged."""
    from lopd_lightning.cli.commands import _reference_experiences
    from lopd_lightning.rollout import encode_prompt
    from lopd_lightning.tasks import get_task
    from lopd_lightning.tasks.hidden_rules import offsets_changing
    from lopd_lightning.tasks.hidden_rules.tools import tool_by_name

    view, ic, counts = in_context
    seed0 = get_task("hidden_rules", references="rules", **SIZES)
    rows, dev = view.examples("train"), {e.id for e in view.examples("val")}
    heldout = {e.id for e in seed0.examples("val")}
    assert len(rows) == 52 and counts["sft_rows"] == 52 and counts["in_context"] == len(ic.in_context) == 26
    assert sum(counts["by_group"].values()) == sum(counts["by_kind"].values()) == sum(counts["by_offset"].values()) == 26
    assert counts["without_example"] == 0 and counts["by_group"]["rule_tools"] > 0 and counts["by_group"]["plain_tools"] > 0
    tokenizer, teacher = tiny_module.tokenizer, tiny_module.teacher
    by_id = {e.id: e for e in rows}
    for ex in rows:
        row = ic.in_context.get(ex.id)
        if row is None:  # as today: no context, the format-only target
            assert ic.initial_messages(ex) == view.initial_messages(ex)
            assert ic.reference_replies(ex) == view.reference_replies(ex) == [seed0.format_only_reply(ex)]
            continue
        shown_id, offset = row["example_id"], row["offset"]
        assert shown_id != ex.id and shown_id in by_id and shown_id not in dev | heldout
        assert by_id[shown_id].data["tool"] == ex.data["tool"]
        made = offset_env(offset)
        shown = next(e for e in made.examples("train") if e.id == shown_id)
        trace = _reference_experiences(tiny_module, made, [shown], 1.0)[0].trace  # what the bank stores
        assert [row["prefix"]] == teacher.frame_text_context([trace])
        messages = ic.initial_messages(ex)
        assert messages[0] == view.initial_messages(ex)[0] and messages[1]["content"] == row["prefix"] + ex.text
        plain = encode_prompt(tokenizer, view.initial_messages(ex))
        context = teacher.encode_text_context([trace])[0]
        spliced = plain.input_ids[: plain.context_position] + context + plain.input_ids[plain.context_position :]
        assert encode_prompt(tokenizer, messages).input_ids == spliced  # byte-level tiny tokenizer: exactly
        target = ic.reference_replies(ex)
        sft_messages, reward = tiny_module.reference_trajectory(ic, ex)  # what SFT trains on
        assert reward == 1.0 and sft_messages == [*messages, {"role": "assistant", "content": target[0]}]
        if ex.data["plain"]:
            assert offset == 0 and target == [seed0.format_only_reply(ex)] == [seed0.rule_reply(ex)]
            continue
        assert offset in offsets_changing(tool_by_name(ex.data["tool"]))
        assert made.rules[ex.data["tool"]] != seed0.rules[ex.data["tool"]]
        target_env = next(e for e in made.examples("train") if e.id == ex.id)
        assert target == [made.rule_reply(target_env)] and target[0] != seed0.rule_reply(ex)
        assert seed0.score(ex, target[0]) == 0.0 and ic.score(ex, target[0]) == 1.0
        assert seed0.score(by_id[shown_id], made.rule_reply(shown)) == 0.0  # the example shows no seed-0 rule
        assert seed0.rule_reply(ex) not in trace
    # the dev slice and the held-out split are the view's: no context
    for split in ("val", "heldout"):
        assert [e.id for e in ic.examples(split)] == [e.id for e in view.examples(split)]
        assert all(e.id not in ic.in_context for e in ic.examples(split))


def test_in_context_rows_are_seeded_and_cycle_the_offsets(start, in_context):
    from lopd_lightning.tasks import get_task

    view, ic, _ = in_context
    again, _ = start.in_context_task(view, offset_env, 0.5, 0)
    strip = lambda rows: {k: {f: v[f] for f in ("offset", "example_id", "prefix", "replies")} for k, v in rows.items()}  # noqa: E731
    assert strip(again.in_context) == strip(ic.in_context)
    other, _ = start.in_context_task(view, offset_env, 0.5, 1)
    assert set(other.in_context) != set(ic.in_context)
    everything, counts = start.in_context_task(view, offset_env, 1.0, 0)
    assert counts["in_context"] + counts["without_example"] == 52 and counts["in_context"] >= 50
    offsets: dict[str, set[int]] = {}
    for example_id, row in everything.in_context.items():
        offsets.setdefault(next(e for e in view.examples() if e.id == example_id).data["tool"], set()).add(row["offset"])
    assert offsets["refund_order"] == {1, 2} and offsets["create_invoice"] == {1} and offsets["get_weather"] == {0}
    none, counts = start.in_context_task(view, offset_env, 0.0, 0)
    assert none.in_context == {} and counts["in_context"] == 0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="--in-context-fraction must be in"):
            start.in_context_task(view, offset_env, bad, 0)
    with pytest.raises(ValueError, match="needs a hidden-rules task"):
        start.in_context_task(start.dev_split_task(get_task("toy"), 4, 0), offset_env, 0.5, 0)


def test_in_context_fraction_is_recorded_only_when_given_and_checked(start, tmp_path):
    import argparse

    args = argparse.Namespace(task="t", model="m", lr=1e-4, examples_per_step=2, steps=[1], dev=2, seed=0,
                              max_new_tokens=8, task_options={}, in_context_fraction=0.0)
    assert "in_context_fraction" not in start.recipe_of(args)  # the recipes cached before the option still match
    args.in_context_fraction = 0.5
    assert start.recipe_of(args)["in_context_fraction"] == 0.5
    common = ["--model", "tiny", "--out", str(tmp_path / "s"), "--results", str(tmp_path / "r.json")]
    format_only = ["--task-options", json.dumps({"references": "format_only"})]
    for bad in (["--task", "hidden_rules", *format_only, "--in-context-fraction", "1.5"],
                ["--task", "hidden_rules", "--in-context-fraction", "0.5"],  # rules references: seed 0's rules
                ["--task", "toy", *format_only, "--in-context-fraction", "0.5"],
                ["--task", "hidden_rules", "--task-options", json.dumps({"references": "format_only", "rule_offset": 1}),
                 "--in-context-fraction", "0.5"]):
        with pytest.raises(SystemExit):
            start.main([*bad, *common])


def test_start_student_with_in_context_rows_on_tiny(start, tmp_path):
    options = {"references": "format_only", "n_train": 24, "n_heldout": 4}
    data = start.main(["--task", "hidden_rules", "--task-options", json.dumps(options), "--in-context-fraction", "0.5",
                       "--model", "tiny", "--steps", "1", "--dev", "4", "--examples-per-step", "2",
                       "--max-new-tokens", "4", "--out", str(tmp_path / "student"),
                       "--results", str(tmp_path / "start_student.json")])
    assert data["recipe"]["in_context_fraction"] == 0.5 and data["dev_curve"][0]["steps"] == 1
    rows = data["in_context_rows"]
    assert rows["sft_rows"] == 20 and rows["in_context"] + rows["without_example"] == 10
    assert sum(rows["by_group"].values()) == rows["in_context"] and data["heldout_questions"] == 4


def test_smollm2_tokenises_the_framed_prefix_as_the_teacher_does_but_at_the_seam():
    """With SmolLM2's tokenizer the in-context row's ids are the calibration's except one token: the framing's
    closing "\\n\\n" is one token alone (encode_text_context) and two before the request (documented)."""
    from lopd_lightning.models import SMOLLM2_NAME, cache_dir, load_tokenizer
    from lopd_lightning.rollout import encode_prompt
    from lopd_lightning.tasks import get_task
    from lopd_lightning.teacher import frame_text
    from lopd_lightning.text import encode_data

    if not (cache_dir() / SMOLLM2_NAME / "tokenizer.json").is_file():
        pytest.skip("SmolLM2's converted folder is not cached here")
    tokenizer = load_tokenizer(SMOLLM2_NAME)
    task = get_task("hidden_rules", **SIZES)
    example = task.examples()[0]
    framed = frame_text("Task:\nBook a flight.\n\nTrajectory:\n[action] <tool_call>[]</tool_call>")
    plain = encode_prompt(tokenizer, task.initial_messages(example))
    context = encode_data(tokenizer, framed)
    spliced = plain.input_ids[: plain.context_position] + context + plain.input_ids[plain.context_position :]
    system, user = task.initial_messages(example)
    prefixed = encode_prompt(tokenizer, [system, {"role": "user", "content": framed + user["content"]}]).input_ids
    seam = plain.context_position + len(context) - 1
    newline = encode_data(tokenizer, "\n")
    assert spliced[:seam] == prefixed[:seam] and spliced[seam + 1 :] == prefixed[seam + 2 :]
    assert spliced[seam] == encode_data(tokenizer, "\n\n")[0] and prefixed[seam : seam + 2] == newline * 2
