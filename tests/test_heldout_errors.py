"""benchmarks/heldout_errors.py: failure kinds from the real checker's messages, template copies and
repetition loops on hand-made records, and the grid read back only where it matches the run files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import load_benchmark
from lopd_lightning.tasks.bfcl.calls import ToolCall, unparsed_reason
from lopd_lightning.tasks.bfcl.checker import check_tool_calls
from lopd_lightning.tasks.bfcl.prompt import DEFAULT_SYSTEM_PROMPT, tools_system_text

FUNCTIONS = [{"name": "todo_add", "description": "Add a todo.", "parameters": {
    "type": "dict", "required": ["content"], "properties": {"content": {"type": "string", "description": "text"},
                                                          "urgent": {"type": "boolean", "description": "flag"}}}}]
TRUTH = [{"todo_add": {"content": ["buy milk"], "urgent": ["", False]}}]


@pytest.fixture(scope="module")
def he():
    return load_benchmark("heldout_errors")


def record(reply: str, *, success: bool = False, error: str | None = None) -> dict:
    system = tools_system_text(DEFAULT_SYSTEM_PROMPT, FUNCTIONS)
    return {"example_id": "q", "success": success, "errors": [error] if error else [],
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "add milk"},
                         {"role": "assistant", "content": reply}]}


def verdict(args: dict) -> str:
    return check_tool_calls([ToolCall("todo_add", args)], TRUTH, FUNCTIONS, category="simple").error


def check(calls: list[ToolCall], truth: list = TRUTH, category: str = "simple") -> str:
    return check_tool_calls(calls, truth, FUNCTIONS, category=category).error


CALL = ToolCall("todo_add", {"content": "buy milk"})


@pytest.mark.parametrize("error, kind", [
    (lambda: unparsed_reason("<tool_call>[{oops</tool_call>"), "malformed"),
    (lambda: unparsed_reason("[{oops"), "malformed"),
    (lambda: unparsed_reason(3), "malformed"),
    (lambda: unparsed_reason("I cannot help."), "no call"),
    (lambda: unparsed_reason("  "), "no call"),
    (lambda: check([]), "no call"),
    (lambda: check([ToolCall("other", {})]), "wrong function"),
    (lambda: check([CALL, CALL]), "wrong function"),
    (lambda: check([CALL], TRUTH * 2, "parallel"), "wrong function"),
    (lambda: check([CALL, ToolCall("todo_add", {"content": "x"})], TRUTH * 2, "parallel"), "no matching call"),
    (lambda: verdict({}), "missing argument"),
    (lambda: check([CALL], [{"todo_add": {"content": ["buy milk"], "urgent": [True]}}]), "missing argument"),
    (lambda: verdict({"content": "buy milk", "argument1": "x"}), "unexpected argument"),
    (lambda: verdict({"content": 3}), "wrong type"),
    (lambda: verdict({"content": "buy bread"}), "wrong value"),
    (lambda: check([CALL], [{"gone": {}}]), "other"),  # the dataset lacks the expected schema
    (lambda: "the sandbox timed out", "other"),
])
def test_every_checker_reason_gets_its_kind(he, error, kind):
    assert he.failure_kind(record("...", error=error())) == kind


def hidden_rules_records():
    """``(task, example)``: the hidden_rules task and its first held-out request whose tool hides a date format."""
    from lopd_lightning.tasks import get_task

    task = get_task("hidden_rules")
    example = next(e for e in task.examples("val") if task.example_category(e) == "date_format")
    return task, example


def hidden_rules_record(task, example, calls: list[dict] | str) -> dict:
    reply = calls if isinstance(calls, str) else task.format_calls(calls)
    reward, info = task.score_with_info(example, reply)
    return {"example_id": example.id, "success": reward >= 1.0, "errors": [info["error"]] if info else [],
            "info": info, "messages": [*task.initial_messages(example), {"role": "assistant", "content": reply}]}


def test_hidden_rules_checker_reasons_get_their_kinds(he):
    """The hidden_rules checker's messages (the task's own verdicts, not copies of them) each get a kind."""
    task, example = hidden_rules_records()
    expected = example.data["expected"]
    tool = expected[-1]
    plain_args = dict(tool["arguments"])
    argument = task.rule_table()[tool["name"]]["argument"]
    cases = {
        "solved": expected,
        "hidden rule": example.data["format_only"],
        # the rule's own argument left out is the rule broken ("it is missing"); another one left out is not
        "missing argument": [*expected[:-1], dict(tool, arguments={k: v for k, v in plain_args.items()
                                                                  if k != next(a for a in plain_args if a != argument)})],
        "unexpected argument": [*expected[:-1], dict(tool, arguments={**plain_args, "argument9": 1})],
        "wrong function": [{"name": "no_such_tool", "arguments": {}}],
        "wrong function ": [*expected, *expected],  # "unexpected calls besides ...": the call made twice
        "malformed": "<tool_call>[{oops</tool_call>",
    }
    for kind, calls in cases.items():
        rec = hidden_rules_record(task, example, calls)
        assert he.failure_kind(rec) == kind.strip(), (kind, rec["errors"])
    rec = hidden_rules_record(task, example, [*expected[:-1], dict(tool, arguments={k: v for k, v in plain_args.items()
                                                                                     if k != argument})])
    assert he.failure_kind(rec) == "hidden rule" and "it is missing" in rec["errors"][0]
    wrong = {k: (v + "x" if isinstance(v, str) else v) for k, v in plain_args.items() if k != argument}
    rec = hidden_rules_record(task, example, [*expected[:-1], dict(tool, arguments={**plain_args, **wrong})])
    assert he.failure_kind(rec) == "wrong value", rec["errors"]


def test_a_broken_rule_is_counted_whatever_problem_comes_first(he):
    """``breaks_hidden_rule`` reads the checker's ``info["rule"]``: a reply that breaks the rule and also adds an
    argument gets the kind of the first problem ("unexpected argument") but still counts as breaking the rule."""
    task, example = hidden_rules_records()
    expected = example.data["expected"]
    tool = expected[-1]
    both = hidden_rules_record(task, example, [*example.data["format_only"][:-1],
                                               dict(example.data["format_only"][-1], arguments={
                                                   **example.data["format_only"][-1]["arguments"], "argument9": 1})])
    assert he.failure_kind(both) == "unexpected argument" and "hidden rule of" in both["errors"][0]
    assert he.breaks_hidden_rule(both) is True
    assert he.breaks_hidden_rule(hidden_rules_record(task, example, example.data["format_only"])) is True
    assert he.breaks_hidden_rule(hidden_rules_record(task, example, expected)) is False
    extra = hidden_rules_record(task, example, [*expected[:-1], dict(tool, arguments={**tool["arguments"], "argument9": 1})])
    assert he.breaks_hidden_rule(extra) is False and he.failure_kind(extra) == "unexpected argument"
    assert he.breaks_hidden_rule(record("x", success=True)) is None  # not a hidden_rules episode


def test_schema_keywords_copied_into_the_arguments_are_counted(he):
    """The broken replies of the experience comparison's LOPD runs: the schema's "required" list inside
    arguments; a clean call, prose, or a tool with a parameter named "required" is not a copy."""
    task, example = hidden_rules_records()
    tool = example.data["expected"][-1]
    required = [*tool["arguments"]]
    copy = task.format_calls([dict(tool, arguments={**tool["arguments"], "required": required})])
    assert he.copies_tool_schema(hidden_rules_record(task, example, copy))
    cut = copy[: copy.index('"required"') + 14]  # cut at the token limit: the text does not parse
    assert he.copies_tool_schema(hidden_rules_record(task, example, cut))
    # beside the arguments, in a call that parses (the checker ignores the key, so it even solves): a copy too
    beside = copy.replace(', "required"', '}, "required"', 1)[:-len("}]</tool_call>")] + "]</tool_call>"
    rec = hidden_rules_record(task, example, beside)
    assert rec["success"] and he.copies_tool_schema(rec)
    # the schema itself inside arguments (step 63-70 replies): "properties" below "parameters"
    nested = task.format_calls([dict(tool, arguments={**tool["arguments"], "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}})])
    assert he.copies_tool_schema(hidden_rules_record(task, example, nested))
    assert he.copies_tool_schema(hidden_rules_record(task, example, nested[:-30]))  # cut: read as text
    # a right reply whose calls name their arguments "parameters" (the parser reads it as "arguments"),
    # in BFCL's format and OpenAI's: solved, not a copy; cut short it is not a copy either
    for calls in ([{"name": c["name"], "parameters": c["arguments"]} for c in example.data["expected"]],
                  [{"type": "function", "function": {"name": c["name"], "parameters": c["arguments"]}}
                   for c in example.data["expected"]]):
        text = "<tool_call>" + json.dumps(calls) + "</tool_call>"
        rec = hidden_rules_record(task, example, text)
        assert rec["success"] and not he.copies_tool_schema(rec)
        assert not he.copies_tool_schema(hidden_rules_record(task, example, text[:-20]))
    assert not he.copies_tool_schema(hidden_rules_record(task, example, example.data["expected"]))
    assert not he.copies_tool_schema(hidden_rules_record(task, example, "Every parameter is required: date."))
    assert not he.copies_format_example(hidden_rules_record(task, example, copy))  # a flag of its own
    own = [dict(FUNCTIONS[0], parameters={"type": "dict", "required": ["required"],
                                          "properties": {"required": {"type": "boolean"}}})]
    rec = record('<tool_call>[{"name": "todo_add", "arguments": {"required": true}}]</tool_call>')
    rec["messages"][0]["content"] = tools_system_text(DEFAULT_SYSTEM_PROMPT, own)
    assert not he.copies_tool_schema(rec)
    rec["messages"][0]["content"] = "no tool list here"
    assert he.copies_tool_schema(rec) is None
    assert he.tool_parameter_names(tools_system_text(DEFAULT_SYSTEM_PROMPT, FUNCTIONS)) == {"content", "urgent"}
    assert he.tool_parameter_names("<tools>[{broken</tools>") is None
    assert he.tool_parameter_names('<tools>{"name": "f"}</tools>') is None  # not a list
    odd = '<tools>[null, 3, {"name": "f", "parameters": "x"}, {"name": "g", "parameters": ["a"]}]</tools>'
    assert he.tool_parameter_names(odd) == set()


def test_solved_and_info_only_records(he):
    assert he.failure_kind(record("...", success=True, error="ignored")) == "solved"
    assert he.failure_kind({"success": False, "errors": [], "info": {"error": "malformed reply"}}) == "malformed"
    assert he.failure_kind({"success": False}) == "other"


def test_the_format_example_is_read_from_the_system_message(he):
    functions, arguments = he.format_example_names(tools_system_text(DEFAULT_SYSTEM_PROMPT, FUNCTIONS))
    assert functions == {"func_name1"} and arguments == {"argument1", "argument2"}
    assert he.format_example_names("no example here") == (set(), set())


def test_template_copies_are_counted_even_when_the_reply_does_not_parse(he):
    copy = '<tool_call>[{"name": "todo_add", "arguments": {"argument1": "buy milk", "argument2": "value2"}}]</tool_call>'
    assert he.copies_format_example(record(copy))
    assert he.copies_format_example(record('<tool_call>[{"name": "func_name1", "arguments": {}'))  # unclosed
    assert not he.copies_format_example(record('<tool_call>[{"name": "todo_add", "arguments": {"content": "x"}}]'))
    assert not he.copies_format_example(record('I used argument1 as a word, not as a key.'))
    # a tool that really has a parameter named like the example's is not a copy
    own = [dict(FUNCTIONS[0], parameters={"type": "dict", "required": ["argument1"],
                                          "properties": {"argument1": {"type": "string"}}})]
    rec = record('{"argument1": "x"}')
    rec["messages"][0]["content"] = tools_system_text(DEFAULT_SYSTEM_PROMPT, own)
    assert not he.copies_format_example(rec)


def test_repetition_loops(he):
    assert he.has_repetition_loop(record('{"fabricName": "cisco-nir-100-100-100-100-100-100"}'))
    assert he.has_repetition_loop(record('{"cast": ["Dance", "Dance", "Dance", "Dance", "Dance", "Dance"]}'))
    assert not he.has_repetition_loop(record('{"fabricName": "cisco-nir-100-100"}'))  # 2 repeats
    assert not he.has_repetition_loop(record('{"x": "' + " " * 30 + "-" * 30 + "0" * 30 + '"}'))  # one character
    assert he.has_repetition_loop(record("0" * 30 + " abcabcabcabcabc"))  # a real loop after a run of zeros


def write_run(root: Path, runs: Path, method: str, seed: int, steps: dict[int, list[dict]], reported: dict | None):
    gen = root / method / f"seed_{seed}" / "generations"
    gen.mkdir(parents=True)
    for step, records in steps.items():
        (gen / f"val_step_{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if reported is not None:
        (runs / method).mkdir(parents=True, exist_ok=True)
        evaluations = [{"step": k, "per_question": v} for k, v in reported.items()]
        (runs / method / f"seed_{seed}.json").write_text(json.dumps({"evaluations": evaluations}))


def test_the_grid_is_read_where_it_matches_the_run_files_and_the_report_is_written(he, tmp_path):
    ok, bad = record("x", success=True), record("<tool_call>[{", error=unparsed_reason("<tool_call>[{"))
    ok2 = dict(ok, example_id="q2")
    bad2 = dict(bad, example_id="q2")
    copy = dict(record('{"argument1": "v"}', error=verdict({"argument1": "v"})), example_id="q2")
    runs, old, new = tmp_path / "compare_runs", tmp_path / "old", tmp_path / "new"
    write_run(old, runs, "lopd", 0, {0: [ok, bad2], 4: [bad, copy]}, {0: {"q": True, "q2": False},
                                                                      4: {"q": False, "q2": False}})
    write_run(old, runs, "lopd", 1, {0: [bad, ok2], 4: [ok, copy]}, None)  # an aborted attempt in the old root
    write_run(new, runs, "lopd", 1, {0: [ok, bad2], 4: [ok, copy]}, {0: {"q": True, "q2": False},  # the reported
                                                                     4: {"q": True, "q2": False}})
    write_run(new, runs, "grpo", 0, {0: [ok, bad2]}, None)  # still running: no run file
    (runs / "grpo").mkdir(parents=True)
    (runs / "grpo" / "seed_1.json").write_text(json.dumps({"evaluations": []}))  # finished, generations gone
    result = he.main(["--runs-root", str(old), str(new), "--run-files", str(runs), "--out", str(tmp_path / "he")])
    assert set(result["runs"]) == {"lopd"} and set(result["runs"]["lopd"]) == {"seed_0", "seed_1"}
    assert [e["step"] for e in result["runs"]["lopd"]["seed_1"]] == [0, 4]
    assert result["runs"]["lopd"]["seed_1"][1]["solved"] == 1
    last = result["summary"]["lopd"]["last"]
    assert last["solved"] == 0.5 and last["malformed"] == 0.5 and last["missing argument"] == 1.0
    assert last["copies_format_example"] == 1.0 and result["summary"]["lopd"]["steps"] == [0, 4]
    assert last["copies_tool_schema"] == 0.0
    assert last["cut_at_length"] is None  # old records, no tokenizer: unknown
    assert result["runs_without_generations"] == ["grpo/seed_1"]
    assert set(result["run_folders_not_used"]) == {"grpo/seed_0"}  # lopd/seed_1 was found in the new root
    saved = json.loads((tmp_path / "he.json").read_text())
    assert saved["summary"] == result["summary"] and saved["runs"]["lopd"]["seed_1"][1]["step"] == 4
    report = (tmp_path / "he.md").read_text()
    assert "| lopd | 2 | 0 -> 4 | 1.0 -> 0.5 |" in report and "grpo/seed_1" in report
    assert last["breaks_hidden_rule"] is None  # BFCL-style records: no hidden rule to break
    assert report.count("n/a -> n/a") == 2
    assert "- lopd seed_1: 0: 1 / 1 / 0 / 0 / 0 / n/a / n/a, 4: 1 / 0 / 1 / 0 / 0 / n/a / n/a" in report
    assert "grpo/seed_0: " in report and "no run file" in report


def test_a_folder_that_is_not_the_reported_run_is_named(he, tmp_path):
    runs, root = tmp_path / "compare_runs", tmp_path / "runs"
    ok = record("x", success=True)
    write_run(root, runs, "lopd", 0, {0: [ok]}, {0: {"q": False}})
    with pytest.raises(SystemExit):
        he.main(["--runs-root", str(root), "--run-files", str(runs), "--out", str(tmp_path / "he")])
    with pytest.raises(he.GridError, match="not a compare.py run file"):
        (runs / "lopd" / "seed_0.json").write_text("{}")
        he.read_grid([root], runs)
    _, skipped = he.read_grid([root], tmp_path)  # no run files at all
    assert "no run file" in skipped["lopd/seed_0"]


def test_bad_roots_get_one_line(he, tmp_path, capsys):
    with pytest.raises(SystemExit):
        he.main(["--runs-root", str(tmp_path / "missing"), "--out", str(tmp_path / "he")])
    assert "--runs-root" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        he.main(["--runs-root", str(tmp_path), "--run-files", str(tmp_path / "missing"), "--out", str(tmp_path / "he")])
    assert "--run-files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        he.main(["--runs-root", str(tmp_path), "--run-files", str(tmp_path), "--out", str(tmp_path / "he")])
    assert "no val_step_<k>.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        he.main(["--runs-root", str(tmp_path), "--run-files", str(tmp_path), "--tokenizer", str(tmp_path)])
    assert "--tokenizer" in capsys.readouterr().err


def test_replies_cut_at_the_token_limit(he, tmp_path):
    rec = record("<tool_call>[{")
    assert he.cut_at_length(rec) is None  # an old record and no tokenizer: unknown, not 0
    chars = len  # one "token" per character; the reply has 13
    assert he.cut_at_length(rec, chars, max_new_tokens=13) is True and he.cut_at_length(rec, chars, 14) is False
    assert he.cut_at_length(dict(rec, stop_reasons=["eos", "length"]), chars, 100) is True  # recorded reasons win
    assert he.cut_at_length(dict(rec, stop_reasons=["eos"])) is False
    assert he.cut_at_length(dict(rec, stop_reasons=[])) is None  # a batch that was not generated: unknown
    (tmp_path / "config.yaml").write_text("model:\n  init_args:\n    max_new_tokens: 96\n    val_max_new_tokens: null\n")
    assert he.run_max_new_tokens(tmp_path) == 96
    (tmp_path / "config.yaml").write_text("model:\n  init_args:\n    max_new_tokens: 96\n    val_max_new_tokens: 128\n")
    assert he.run_max_new_tokens(tmp_path) == 128 and he.run_max_new_tokens(tmp_path / "none") is None
    path = tmp_path / "val_step_0.jsonl"
    path.write_text(json.dumps(dict(rec, stop_reasons=["length"])) + "\n" + json.dumps(rec) + "\n")
    assert he.evaluation_counts(path)["cut_at_length"] is None  # one record cannot tell
    assert he.evaluation_counts(path, chars, 13)["cut_at_length"] == 2
