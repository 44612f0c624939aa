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


@pytest.mark.parametrize("error, kind", [
    (lambda: unparsed_reason("<tool_call>[{oops</tool_call>"), "malformed"),
    (lambda: unparsed_reason("I cannot help."), "no call"),
    (lambda: check_tool_calls([], TRUTH, FUNCTIONS, category="simple").error, "no call"),
    (lambda: check_tool_calls([ToolCall("other", {})], TRUTH, FUNCTIONS, category="simple").error, "wrong function"),
    (lambda: verdict({}), "missing argument"),
    (lambda: verdict({"content": "buy milk", "argument1": "x"}), "unexpected argument"),
    (lambda: verdict({"content": 3}), "wrong type"),
    (lambda: verdict({"content": "buy bread"}), "wrong value"),
    (lambda: "the sandbox timed out", "other"),
])
def test_every_checker_reason_gets_its_kind(he, error, kind):
    assert he.failure_kind(record("...", error=error())) == kind
    assert he.failure_kind(record("...", success=True)) == "solved"
    assert he.failure_kind({"success": False, "errors": [], "info": {"error": "malformed reply"}}) == "malformed"


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
    assert not he.has_repetition_loop(record('{"fabricName": "cisco-nir-100-100"}'))


def write_run(root: Path, runs: Path, method: str, seed: int, steps: dict[int, list[dict]], reported: dict | None):
    gen = root / method / f"seed_{seed}" / "generations"
    gen.mkdir(parents=True)
    for step, records in steps.items():
        (gen / f"val_step_{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if reported is not None:
        (runs / method).mkdir(parents=True, exist_ok=True)
        evaluations = [{"step": k, "solved": v} for k, v in reported.items()]
        (runs / method / f"seed_{seed}.json").write_text(json.dumps({"evaluations": evaluations}))


def test_the_grid_is_read_where_it_matches_the_run_files_and_the_report_is_written(he, tmp_path):
    ok, bad = record("x", success=True), record("<tool_call>[{", error=unparsed_reason("<tool_call>[{"))
    copy = record('{"argument1": "v"}', error=verdict({"argument1": "v"}))
    runs, old, new = tmp_path / "compare_runs", tmp_path / "old", tmp_path / "new"
    write_run(old, runs, "lopd", 0, {0: [ok, bad], 4: [bad, copy]}, {0: 1, 4: 0})
    write_run(old, runs, "lopd", 1, {0: [ok, ok]}, None)  # an aborted attempt in the old root...
    write_run(new, runs, "lopd", 1, {0: [ok, bad], 4: [ok, copy]}, {0: 1, 4: 1})  # ...the reported run in the new
    write_run(new, runs, "grpo", 0, {0: [ok, bad]}, None)  # still running: no run file
    (runs / "grpo").mkdir()
    (runs / "grpo" / "seed_1.json").write_text(json.dumps({"evaluations": []}))  # finished, generations gone
    result = he.main(["--runs-root", str(old), str(new), "--run-files", str(runs), "--out", str(tmp_path / "he")])
    assert set(result["runs"]) == {"lopd"} and set(result["runs"]["lopd"]) == {"seed_0", "seed_1"}
    assert result["runs"]["lopd"]["seed_1"][4]["solved"] == 1
    last = result["summary"]["lopd"]["last"]
    assert last["solved"] == 0.5 and last["malformed"] == 0.5 and last["missing argument"] == 1.0
    assert last["copies_format_example"] == 1.0 and result["summary"]["lopd"]["steps"] == [0, 4]
    assert result["runs_without_generations"] == ["grpo/seed_1"]
    assert json.loads((tmp_path / "he.json").read_text())["summary"] == json.loads(json.dumps(result["summary"]))
    report = (tmp_path / "he.md").read_text()
    assert "| lopd | 2 | 0 -> 4 | 1.0 -> 0.5 |" in report and "grpo/seed_1" in report


def test_bad_roots_get_one_line(he, tmp_path, capsys):
    with pytest.raises(SystemExit):
        he.main(["--runs-root", str(tmp_path / "missing"), "--out", str(tmp_path / "he")])
    assert "--runs-root" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        he.main(["--runs-root", str(tmp_path), "--run-files", str(tmp_path), "--out", str(tmp_path / "he")])
    assert "no val_step_<k>.jsonl" in capsys.readouterr().err


def test_replies_cut_at_the_token_limit(he, tmp_path):
    rec = record("<tool_call>[{")
    assert he.cut_at_length(rec) is None  # an old record and no tokenizer: unknown, not 0
    words = len  # one "token" per character; the reply has 13
    assert he.cut_at_length(rec, words, max_new_tokens=13) is True and he.cut_at_length(rec, words, 14) is False
    assert he.cut_at_length(dict(rec, stop_reasons=["eos", "length"]), words, 100) is True  # recorded reasons win
    assert he.cut_at_length(dict(rec, stop_reasons=["eos"])) is False
    (tmp_path / "config.yaml").write_text("model:\n  init_args:\n    max_new_tokens: 96\n    val_max_new_tokens: null\n")
    assert he.run_max_new_tokens(tmp_path) == 96
    (tmp_path / "config.yaml").write_text("model:\n  init_args:\n    max_new_tokens: 96\n    val_max_new_tokens: 128\n")
    assert he.run_max_new_tokens(tmp_path) == 128 and he.run_max_new_tokens(tmp_path / "none") is None
    path = tmp_path / "val_step_0.jsonl"
    path.write_text(json.dumps(dict(rec, stop_reasons=["length"])) + "\n" + json.dumps(rec) + "\n")
    assert he.evaluation_counts(path)["cut_at_length"] is None  # one record cannot tell
    assert he.evaluation_counts(path, words, 13)["cut_at_length"] == 2
