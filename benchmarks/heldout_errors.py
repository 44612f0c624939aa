"""Why held-out questions fail: every greedy evaluation of a comparison grid, by failure kind.

``benchmarks/compare.py`` counts the held-out questions each run solves; this script reads the same
``<runs-root>/<method>/seed_<s>/generations/val_step_<k>.jsonl`` files (one JSON line per greedy episode,
written by ``lopd_lightning.modules.observability``) and sorts every unsolved episode by the first reason
the checker gave (:func:`failure_kind`; BFCL's and hidden_rules'), so a fall in success can be traced to
what changed in the replies. Five counts cut across the kinds: replies that copy the system prompt's format
example instead of the tools' schemas (:func:`copies_format_example`: ``{"argument1": ...}`` where the schema
names ``todo``), replies that copy a keyword of the tools' schemas as a key (:func:`copies_tool_schema`:
``"required": [...]`` inside ``arguments``), repetition loops (:func:`has_repetition_loop`), replies cut at
the token limit (:func:`cut_at_length`) and, on hidden_rules, replies that break the hidden rule whatever
problem the checker names first (:func:`breaks_hidden_rule`).

Writes ``<out>.json`` (every run's evaluations, plus :func:`common.run_metadata`) and ``<out>.md`` (the
mean over seeds per method at its first and last evaluation, each seed's counts at every evaluation, and
the finished runs it could not read, with why).

    python benchmarks/heldout_errors.py --runs-root runs/compare [more roots] \
        [--tokenizer runs/evidence/sft_student] --out benchmarks/results/heldout_errors
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import run_metadata, write_json_atomic  # noqa: E402
from compare_runs import generation_files, heldout_evaluations  # noqa: E402

#: Failure kinds, in report order: an unsolved episode gets the first whose pattern matches the start of
#: its first error (the messages of ``lopd_lightning.tasks.bfcl.checker``, ``.calls`` and
#: ``lopd_lightning.tasks.hidden_rules.checker``, which joins every problem of a reply in one message: a rule
#: broken after another problem counts as that problem).
FAILURE_KINDS: dict[str, str] = {
    "no call": r"no function call|no tool call|empty reply",
    "malformed": r"malformed",
    "wrong function": r"function name |wrong number of functions|no call to |unexpected calls besides",
    "no matching call": r"no model call matches",  # parallel categories: some expected call has no match
    "missing argument": r"missing required parameter|parameter '.*' not provided|missing parameter ",
    "unexpected argument": r"unexpected parameter",
    "wrong type": r"wrong type for",
    "wrong value": r"invalid value for",
    # hidden_rules (lopd_lightning.tasks.hidden_rules.checker): a call that breaks its tool's undocumented rule
    "hidden rule": r"hidden rule of ",
}
KINDS = ("solved", *FAILURE_KINDS, "other")
#: The counts that cut across :data:`KINDS` (each episode at most once in each).
FLAGS = ("copies_format_example", "copies_tool_schema", "repetition_loop", "cut_at_length", "breaks_hidden_rule")
#: The example-id prefix of the tasks whose checker marks a broken hidden rule in ``info["rule"]``
#: (``hidden_rules`` and ``hidden_rules_multi_turn``, which share its examples).
HIDDEN_RULES_ID = "hidden_rules/"
#: The JSON-schema keywords of the offered tools' schemas that :func:`copies_tool_schema` looks for.
SCHEMA_KEYWORDS = ("required", "properties", "parameters")


def failure_kind(record: dict[str, Any]) -> str:
    """``"solved"``, one of :data:`FAILURE_KINDS`, or ``"other"`` (an error no pattern matches, e.g. a
    dataset without the expected function's schema), from the record's ``success`` and its first
    ``errors`` entry (``info["error"]`` when ``errors`` is empty)."""
    if record.get("success"):
        return "solved"
    errors = record.get("errors") or [(record.get("info") or {}).get("error") or ""]
    first = str(errors[0])
    return next((kind for kind, pattern in FAILURE_KINDS.items() if re.match(pattern, first)), "other")


def format_example_names(system_text: str) -> tuple[set[str], set[str]]:
    """The function and argument names of the format example after ``</tools>`` in a system message.

    Every line there that reads as a JSON object with ``name`` and ``arguments`` (a trailing comma
    allowed) is an example call; returns ``(function names, argument names)``, both empty when none is.
    """
    _, _, tail = system_text.partition("</tools>")
    functions: set[str] = set()
    arguments: set[str] = set()
    for line in tail.splitlines():
        try:
            call = json.loads(line.strip().rstrip(","))
        except ValueError:
            continue
        if isinstance(call, dict) and "name" in call and isinstance(call.get("arguments"), dict):
            functions.add(str(call["name"]))
            arguments.update(str(k) for k in call["arguments"])
    return functions, arguments


def system_message(record: dict[str, Any]) -> str:
    """The text of the record's first system message ("" without one)."""
    return str(next((m.get("content") or "" for m in record.get("messages") or [] if m.get("role") == "system"), ""))


def copies_format_example(record: dict[str, Any]) -> bool:
    """Whether an assistant reply names a function or argument of the system prompt's format example
    (as a JSON key ``"argument1":`` or ``"name": "func_name1"``) that none of the offered tools has.

    Reads the raw reply text, so a reply that does not parse still counts."""
    messages = record.get("messages") or []
    system = system_message(record)
    functions, arguments = format_example_names(system)
    tools = system.partition("</tools>")[0]
    patterns = [rf'"name"\s*:\s*"{re.escape(f)}"' for f in functions if f'"{f}"' not in tools]
    patterns += [rf'"{re.escape(a)}"\s*:' for a in arguments if f'"{a}"' not in tools]
    if not patterns:
        return False
    found = re.compile("|".join(patterns))
    return any(m.get("role") == "assistant" and found.search(str(m.get("content") or "")) for m in messages)


def tool_parameter_names(system_text: str) -> set[str] | None:
    """The parameter names of every tool in a system message's ``<tools>[...]</tools>`` JSON list (the
    BFCL prompt's, which hidden_rules shares); None when there is no such list or it does not parse."""
    start, end = system_text.find("<tools>"), system_text.find("</tools>")
    if start < 0 or end < start:
        return None
    try:
        tools = json.loads(system_text[start + len("<tools>"):end])
    except ValueError:
        return None
    if not isinstance(tools, list):
        return None
    names: set[str] = set()
    for tool in tools:
        parameters = tool.get("parameters") if isinstance(tool, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if isinstance(properties, dict):
            names.update(str(k) for k in properties)
    return names


#: A call's ``"name": "...", "parameters":`` (the parser reads ``parameters`` as ``arguments``): not a copy.
CALL_PARAMETERS_KEY = re.compile(r'("name"\s*:\s*"[^"]*"\s*,\s*)"parameters"(\s*:)')


def copies_tool_schema(record: dict[str, Any]) -> bool | None:
    """Whether an assistant reply writes a keyword of the tools' JSON schemas (:data:`SCHEMA_KEYWORDS`, e.g.
    the schema's ``"required": [...]`` list) as a JSON key, inside a call's arguments or beside them, where
    no offered tool has a parameter of that name.

    Reads the raw reply text, so a reply that does not parse (e.g. cut at the token limit) still counts; a
    call that names its arguments ``"parameters"`` right after its ``"name"`` (BFCL's parser accepts it, as
    does OpenAI's ``{"function": {"name": ..., "parameters": ...}}``) is not a copy. None when the system
    message has no tool list that parses (see :func:`tool_parameter_names`)."""
    messages = record.get("messages") or []
    system = system_message(record)
    parameters = tool_parameter_names(system)
    if parameters is None:
        return None
    keywords = [k for k in SCHEMA_KEYWORDS if k not in parameters]
    if not keywords:
        return False
    found = re.compile(r'"(?:' + "|".join(map(re.escape, keywords)) + r')"\s*:')
    return any(m.get("role") == "assistant"
               and found.search(CALL_PARAMETERS_KEY.sub(r'\1"arguments"\2', str(m.get("content") or "")))
               for m in messages)


def breaks_hidden_rule(record: dict[str, Any]) -> bool | None:
    """Whether the checker marked the hidden rule as broken by the episode's last reply (``info["rule"]``, set
    by ``lopd_lightning.tasks.hidden_rules.checker`` whenever the rule is broken, even when another problem comes
    first in the error and so decides :func:`failure_kind`; a multi-turn episode's record keeps its last
    attempt's info); None for an episode of a task without hidden rules (its ``example_id`` does not start with
    :data:`HIDDEN_RULES_ID`)."""
    if not str(record.get("example_id", "")).startswith(HIDDEN_RULES_ID):
        return None
    return bool((record.get("info") or {}).get("rule"))


#: A unit of 3-40 characters, not starting with whitespace, that occurs at least 5 times in a row.
REPETITION = re.compile(r"(\S.{2,39}?)\1{4,}", re.S)


def has_repetition_loop(record: dict[str, Any]) -> bool:
    """Whether an assistant reply has a degenerate decoding loop: a :data:`REPETITION` whose unit is not
    one character repeated (``-100-100-100-100-100`` counts; runs of dashes or zeros do not)."""
    return any(len(set(match.group(1))) > 1
               for m in record.get("messages") or [] if m.get("role") == "assistant"
               for match in REPETITION.finditer(str(m.get("content") or "")))


def cut_at_length(record: dict[str, Any], count_tokens: Callable[[str], int] | None = None,
                  max_new_tokens: int | None = None) -> bool | None:
    """Whether a reply of the episode was cut at the token limit.

    From the record's ``stop_reasons`` (``"length"``) when it has them; records written before they
    existed are re-tokenized instead, when ``count_tokens`` (text -> tokens, the run's tokenizer) and the
    run's ``max_new_tokens`` are given (a reply of at least that many tokens was cut; decoding and
    re-encoding can differ by a token). None when neither is possible."""
    if record.get("stop_reasons"):  # absent, or empty for a batch that was not generated: unknown
        return "length" in record["stop_reasons"]
    if count_tokens is None or max_new_tokens is None:
        return None
    return any(m.get("role") == "assistant" and count_tokens(str(m.get("content") or "")) >= max_new_tokens
               for m in record.get("messages") or [])


def evaluation_counts(path: Path, count_tokens: Callable[[str], int] | None = None,
                      max_new_tokens: int | None = None) -> dict[str, int | None]:
    """``{kind: episodes}`` over :data:`KINDS`, plus ``questions`` and the :data:`FLAGS` (episodes, each
    counted once; these five cut across the kinds; a flag is None when some record cannot tell, see
    :func:`copies_tool_schema`, :func:`cut_at_length` and :func:`breaks_hidden_rule`).

    Raises:
        json.JSONDecodeError: a line that is not JSON (a file still being written)."""
    counts: dict[str, int | None] = dict.fromkeys(KINDS, 0) | {"questions": 0} | dict.fromkeys(FLAGS, 0)
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        counts[failure_kind(record)] += 1
        counts["questions"] += 1
        flags = {"copies_format_example": copies_format_example(record), "copies_tool_schema": copies_tool_schema(record),
                 "repetition_loop": has_repetition_loop(record),
                 "cut_at_length": cut_at_length(record, count_tokens, max_new_tokens),
                 "breaks_hidden_rule": breaks_hidden_rule(record)}
        for flag, value in flags.items():  # unknown for one record: unknown for the evaluation
            counts[flag] = None if value is None or counts[flag] is None else counts[flag] + value
    return counts


def run_max_new_tokens(run_dir: Path) -> int | None:
    """The held-out token limit per reply of a run: ``val_max_new_tokens``, else ``max_new_tokens``, of
    ``model.init_args`` in its ``config.yaml`` (None without one)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    init_args = ((yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("model") or {}).get("init_args") or {}
    value = init_args.get("val_max_new_tokens") or init_args.get("max_new_tokens")
    return int(value) if value is not None else None


class GridError(ValueError):
    """No run could be read (the message says what was found and why none was used)."""


def _reported_per_question(path: Path) -> dict[int, dict[str, bool]]:
    """``{step: per_question}`` of a compare.py run file's ``evaluations``.

    Raises:
        GridError: the file is not JSON or has no ``evaluations`` with ``step`` and ``per_question``."""
    try:
        return {int(e["step"]): dict(e["per_question"]) for e in json.loads(path.read_text())["evaluations"]}
    except (ValueError, KeyError, TypeError) as err:
        raise GridError(f"{path} is not a compare.py run file ({type(err).__name__}: {err})") from err


def read_grid(runs_roots: list[Path], run_files: Path, split: str = "val",
              count_tokens: Callable[[str], int] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The finished runs' evaluations, and the run folders not used with why.

    A folder ``<root>/<method>/seed_<s>/`` is used when ``run_files`` (compare.py's ``--runs-dir``) has
    its ``<method>/seed_<s>.json`` and every question's outcome at every step of its
    ``generations/<split>_step_<k>.jsonl`` equals that file's ``evaluations`` (an aborted attempt, or
    an older run left in another root, is not the run that was reported); the first such root wins.
    ``count_tokens`` re-tokenizes replies of records without ``stop_reasons`` (:func:`cut_at_length`,
    with each run's :func:`run_max_new_tokens`).

    Returns:
        ``({method: {"seed_<s>": [{"step": k, **evaluation_counts}, ...]}}, {"<method>/seed_<s>": why})``
        (steps ascending, as the run files write ``evaluations``).

    Raises:
        GridError: a run file that does not read (see :func:`_reported_per_question`).
    """
    grid: dict[str, dict[str, list[dict[str, Any]]]] = {}
    skipped: dict[str, str] = {}
    for root in runs_roots:
        for run_dir in sorted(p.parent for p in root.glob("*/seed_*/generations")):
            method, seed, name = run_dir.parent.name, run_dir.name, f"{run_dir.parent.name}/{run_dir.name}"
            files = generation_files(run_dir, split)
            if seed in grid.get(method, {}) or not files:
                continue
            reported = run_files / method / f"{seed}.json"
            if not reported.is_file():
                skipped[name] = f"{run_dir}: no run file {reported} (still running, or never finished)"
                continue
            found = {e["step"]: e["per_question"] for e in heldout_evaluations(run_dir, 1, split)}
            if found != _reported_per_question(reported):
                skipped[name] = f"{run_dir}: its held-out outcomes differ from {reported} (not the reported run)"
                continue
            limit = run_max_new_tokens(run_dir)
            grid.setdefault(method, {})[seed] = [
                {"step": step, **evaluation_counts(path, count_tokens, limit)} for step, path in files]
            skipped.pop(name, None)
    grid = {method: dict(sorted(seeds.items())) for method, seeds in sorted(grid.items())}
    return grid, dict(sorted(skipped.items()))


def summarise(grid: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per method, ``seeds``, ``steps`` (the first and last evaluation step all its seeds share) and the
    mean over seeds of every count at each (``first``, ``last``; a count is None when some seed's is).
    A method whose seeds share fewer than two steps gets None."""
    out: dict[str, Any] = {}
    for method, seeds in grid.items():
        by_step = {seed: {e["step"]: e for e in evaluations} for seed, evaluations in seeds.items()}
        shared = sorted(set.intersection(*(set(steps) for steps in by_step.values())))
        if len(shared) < 2:
            out[method] = None
            continue
        out[method] = {"seeds": sorted(seeds), "steps": [shared[0], shared[-1]]}
        for label, step in (("first", shared[0]), ("last", shared[-1])):
            at = [steps[step] for steps in by_step.values()]
            out[method][label] = {k: None if any(e[k] is None for e in at) else statistics.fmean(e[k] for e in at)
                                  for k in at[0] if k != "step"}
    return out


def runs_without_generations(grid: dict[str, Any], run_files: Path, skipped: dict[str, str]) -> list[str]:
    """``<method>/seed_<s>`` of every run file under ``run_files`` whose run folder was found in no root
    (neither read into ``grid`` nor ``skipped``)."""
    finished = sorted(f"{p.parent.name}/{p.stem}" for p in run_files.glob("*/seed_*.json"))
    return [run for run in finished
            if run.split("/")[1] not in grid.get(run.split("/")[0], {}) and run not in skipped]


def markdown(grid: dict[str, Any], summary: dict[str, Any], missing: list[str], skipped: dict[str, str]) -> str:
    """The report: per method, the mean episodes of each kind at the first -> last evaluation; each
    seed's solved, malformed and :data:`FLAGS` counts at every evaluation; the runs it could not read."""
    columns = (*KINDS, *FLAGS)
    header = ["method", "seeds", "steps", *(c.replace("_", " ") for c in columns)]
    lines = ["# Held-out failures by kind (mean episodes over seeds, first -> last evaluation)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, s in summary.items():
        if s is None:
            continue
        cells = [" -> ".join("n/a" if s[end][k] is None else f"{s[end][k]:.1f}" for end in ("first", "last"))
                 for k in columns]
        lines.append(f"| {method} | {len(s['seeds'])} | {s['steps'][0]} -> {s['steps'][1]} | " + " | ".join(cells) + " |")
    short = [m for m, s in summary.items() if s is None]
    if short:
        lines += ["", "Not in the table (its seeds share fewer than two evaluations): " + ", ".join(short)]
    lines += ["", "Per seed and evaluation step: solved / malformed / " + " / ".join(f.replace("_", " ") for f in FLAGS)
              + " (episodes; n/a: the records cannot tell):", ""]
    for method, seeds in grid.items():
        for seed, evaluations in seeds.items():
            row = ", ".join(f"{e['step']}: " + " / ".join("n/a" if e[k] is None else str(e[k])
                                                          for k in ("solved", "malformed", *FLAGS))
                            for e in evaluations)
            lines.append(f"- {method} {seed}: {row}")
    if missing:
        lines += ["", "Finished runs whose generations folder is in no root (not counted): " + ", ".join(missing)]
    if skipped:
        lines += ["", "Run folders not used:", ""] + [f"- {name}: {why}" for name, why in skipped.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs-root", type=Path, nargs="+", default=[Path("runs/compare")],
                        help="the grid's run folders, <runs-root>/<method>/seed_<s>/ (compare.py's --root); "
                             "several roots are searched in order")
    parser.add_argument("--run-files", type=Path, default=Path("benchmarks/results/compare_runs"),
                        help="compare.py's --runs-dir: <method>/seed_<s>.json of every finished run")
    parser.add_argument("--split", default="val", help="the generations files' split: <split>_step_<k>.jsonl")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="the runs' tokenizer folder (e.g. runs/evidence/sft_student): counts the replies "
                             "cut at the token limit in records written before they carried stop_reasons")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/heldout_errors"),
                        help="output path without suffix: writes <out>.json and <out>.md")
    args = parser.parse_args(argv)
    for root in args.runs_root:
        if not root.is_dir():
            parser.error(f"--runs-root {root} is not a folder; pass compare.py's --root (runs/compare)")
    if not args.run_files.is_dir():
        parser.error(f"--run-files {args.run_files} is not a folder; pass compare.py's --runs-dir "
                     "(benchmarks/results/compare_runs)")
    count_tokens = None
    if args.tokenizer is not None:
        if not (args.tokenizer / "tokenizer_config.json").is_file():
            parser.error(f"--tokenizer {args.tokenizer} has no tokenizer_config.json; pass the runs' model folder")
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))

        def count_tokens(text: str) -> int:
            return len(tokenizer(text, add_special_tokens=False).input_ids)
    try:
        grid, skipped = read_grid(args.runs_root, args.run_files, args.split, count_tokens)
    except GridError as err:
        parser.error(str(err))
    if not grid:
        roots = ", ".join(map(str, args.runs_root))
        if skipped:
            parser.error(f"{len(skipped)} run folders under {roots}, none a finished run matching its file in "
                         f"--run-files {args.run_files}; the first: {next(iter(skipped.values()))}")
        parser.error(f"no {args.split}_step_<k>.jsonl under <runs-root>/<method>/seed_<s>/generations/ of "
                     f"{roots}; were the runs made by benchmarks/compare.py?")
    summary = summarise(grid)
    missing = runs_without_generations(grid, args.run_files, skipped)
    result = {"runs_roots": [str(r) for r in args.runs_root], "split": args.split, "kinds": list(KINDS),
              "flags": list(FLAGS), "summary": summary, "runs": grid, "runs_without_generations": missing,
              "run_folders_not_used": skipped, **run_metadata(seed=0, argv=argv)}
    write_json_atomic(result, args.out.with_suffix(".json"))
    args.out.with_suffix(".md").write_text(markdown(grid, summary, missing, skipped), encoding="utf-8")
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
