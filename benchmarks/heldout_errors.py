"""Why held-out questions fail: every greedy evaluation of a comparison grid, by failure kind.

``benchmarks/compare.py`` counts the held-out questions each run solves; this script reads the same
``<runs-root>/<method>/seed_<s>/generations/val_step_<k>.jsonl`` files (one JSON line per greedy episode,
written by ``lopd_lightning.modules.observability``) and sorts every unsolved episode by the first reason
the BFCL checker gave (:func:`failure_kind`), so a fall in success can be traced to what changed in the
replies. It also counts the replies that loop (:func:`has_repetition_loop`) and those that copy the system prompt's format example instead of the tools'
schemas (:func:`copies_format_example`: e.g. ``{"argument1": ...}`` where the schema names ``todo``).

Writes ``<out>.json`` (every run and evaluation, plus :func:`common.run_metadata`) and ``<out>.md`` (the
mean over seeds per method at its first and last evaluation, each seed's template copies, and the
finished runs of ``--run-files`` whose generations folder is gone).

    python benchmarks/heldout_errors.py --runs-root runs/compare [more roots] --out benchmarks/results/heldout_errors
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

#: Failure kinds, in report order; an unsolved episode gets the first whose prefixes start its first error.
FAILURE_KINDS: dict[str, tuple[str, ...]] = {
    "no call": ("no function call", "no tool call", "empty reply"),
    "malformed": ("malformed",),
    "wrong function": ("function name", "wrong number of functions", "no model call matches", "no schema"),
    "missing argument": ("missing required parameter", "parameter "),  # "parameter 'x' not provided ..."
    "unexpected argument": ("unexpected parameter",),
    "wrong type": ("wrong type for",),
    "wrong value": ("invalid value for",),
}
KINDS = ("solved", *FAILURE_KINDS, "other")


def failure_kind(record: dict[str, Any]) -> str:
    """``"solved"``, one of :data:`FAILURE_KINDS`, or ``"other"`` (an error no prefix matches), from the
    record's ``success`` and its first ``errors`` entry (``info["error"]`` when ``errors`` is empty)."""
    if record.get("success"):
        return "solved"
    errors = record.get("errors") or [(record.get("info") or {}).get("error") or ""]
    first = str(errors[0])
    for kind, prefixes in FAILURE_KINDS.items():
        if first.startswith(prefixes):
            return kind
    return "other"


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


def copies_format_example(record: dict[str, Any]) -> bool:
    """Whether an assistant reply names a function or argument of the system prompt's format example
    (as a JSON key ``"argument1":`` or ``"name": "func_name1"``) that none of the offered tools has.

    Reads the raw reply text, so a reply that does not parse still counts."""
    messages = record.get("messages") or []
    system = next((m.get("content") or "" for m in messages if m.get("role") == "system"), "")
    functions, arguments = format_example_names(str(system))
    tools = str(system).partition("</tools>")[0]
    patterns = [rf'"name"\s*:\s*"{re.escape(f)}"' for f in functions if f'"{f}"' not in tools]
    patterns += [rf'"{re.escape(a)}"\s*:' for a in arguments if f'"{a}"' not in tools]
    if not patterns:
        return False
    found = re.compile("|".join(patterns))
    return any(m.get("role") == "assistant" and found.search(str(m.get("content") or "")) for m in messages)


#: A unit of 3-40 characters repeated at least 5 times in a row: a degenerate decoding loop.
REPETITION = re.compile(r"(.{3,40}?)\1{4,}", re.S)


def has_repetition_loop(record: dict[str, Any]) -> bool:
    """Whether an assistant reply contains :data:`REPETITION` (e.g. ``-100-100-100-100-100``)."""
    return any(m.get("role") == "assistant" and REPETITION.search(str(m.get("content") or ""))
               for m in record.get("messages") or [])


def cut_at_length(record: dict[str, Any], count_tokens: Callable[[str], int] | None = None,
                  max_new_tokens: int | None = None) -> bool | None:
    """Whether a reply of the episode was cut at the token limit.

    From the record's ``stop_reasons`` (``"length"``) when it has them; records written before they
    existed are re-tokenized instead, when ``count_tokens`` (text -> tokens, the run's tokenizer) and the
    run's ``max_new_tokens`` are given (a reply of at least that many tokens was cut; decoding and
    re-encoding can differ by a token). None when neither is possible."""
    if "stop_reasons" in record:
        return "length" in record["stop_reasons"]
    if count_tokens is None or max_new_tokens is None:
        return None
    return any(m.get("role") == "assistant" and count_tokens(str(m.get("content") or "")) >= max_new_tokens
               for m in record.get("messages") or [])


def evaluation_counts(path: Path, count_tokens: Callable[[str], int] | None = None,
                      max_new_tokens: int | None = None) -> dict[str, int | None]:
    """``{kind: episodes}`` over :data:`KINDS`, plus ``questions``, ``copies_format_example``,
    ``repetition_loop`` and ``cut_at_length`` (episodes, each counted once; these three cut across the
    kinds; ``cut_at_length`` is None when some record cannot tell, see :func:`cut_at_length`)."""
    counts: dict[str, int | None] = dict.fromkeys(KINDS, 0) | {
        "questions": 0, "copies_format_example": 0, "repetition_loop": 0, "cut_at_length": 0}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        counts[failure_kind(record)] += 1
        counts["questions"] += 1
        counts["copies_format_example"] += copies_format_example(record)
        counts["repetition_loop"] += has_repetition_loop(record)
        cut = cut_at_length(record, count_tokens, max_new_tokens)
        counts["cut_at_length"] = None if cut is None or counts["cut_at_length"] is None else counts["cut_at_length"] + cut
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


def read_grid(runs_roots: list[Path], run_files: Path | None = None, split: str = "val",
              count_tokens: Callable[[str], int] | None = None) -> dict[str, dict[str, dict[int, dict[str, int]]]]:
    """``{method: {"seed_<s>": {step: evaluation_counts}}}`` from every ``<root>/<method>/seed_<s>/``
    with ``generations/<split>_step_<k>.jsonl`` files.

    With ``run_files`` (compare.py's ``<method>/seed_<s>.json``), only finished runs are read, and a
    folder only when its solved count at every step equals its run file's ``evaluations`` (an aborted
    attempt or an older run left in another root is not the run that was reported); the first such root
    wins. ``count_tokens`` re-tokenizes replies of records without ``stop_reasons`` (:func:`cut_at_length`,
    with each run's :func:`run_max_new_tokens`)."""
    grid: dict[str, dict[str, dict[int, dict[str, int]]]] = {}
    for root in runs_roots:
        for folder in sorted(root.glob("*/seed_*/generations")):
            method, seed = folder.parent.parent.name, folder.parent.name
            if seed in grid.get(method, {}):
                continue
            steps, limit = {}, run_max_new_tokens(folder.parent)
            for path in folder.glob(f"{split}_step_*.jsonl"):
                match = re.fullmatch(rf"{re.escape(split)}_step_(\d+)\.jsonl", path.name)
                if match:
                    steps[int(match.group(1))] = evaluation_counts(path, count_tokens, limit)
            reported = run_files / method / f"{seed}.json" if run_files else None
            if reported is not None:
                if not reported.is_file():  # still running, or never reported
                    continue
                solved = {e["step"]: e["solved"] for e in json.loads(reported.read_text())["evaluations"]}
                if solved != {k: c["solved"] for k, c in steps.items()}:
                    continue
            if steps:
                grid.setdefault(method, {})[seed] = dict(sorted(steps.items()))
    return {method: dict(sorted(seeds.items())) for method, seeds in sorted(grid.items())}


def summarise(grid: dict[str, dict[str, dict[int, dict[str, int]]]]) -> dict[str, Any]:
    """Per method, the mean over seeds of every count at the first and the last evaluation step that
    all its seeds share (``None`` for a method whose seeds share fewer than two steps)."""
    out: dict[str, Any] = {}
    for method, seeds in grid.items():
        shared = sorted(set.intersection(*(set(steps) for steps in seeds.values())))
        if len(shared) < 2:
            out[method] = None
            continue
        out[method] = {"seeds": sorted(seeds), "steps": [shared[0], shared[-1]]}
        for label, step in (("first", shared[0]), ("last", shared[-1])):
            keys = seeds[next(iter(seeds))][step]
            out[method][label] = {k: None if any(s[step][k] is None for s in seeds.values())
                                  else statistics.fmean(s[step][k] for s in seeds.values()) for k in keys}
    return out


def runs_without_generations(grid: dict[str, Any], run_files: Path) -> list[str]:
    """``<method>/seed_<s>`` of every finished run file under ``run_files`` (compare.py's
    ``compare_runs/<method>/seed_<s>.json``) whose generations are not in ``grid``."""
    finished = sorted(f"{p.parent.name}/{p.stem}" for p in run_files.glob("*/seed_*.json"))
    return [run for run in finished if run.split("/")[1] not in grid.get(run.split("/")[0], {})]


def markdown(grid: dict[str, Any], summary: dict[str, Any], missing: list[str]) -> str:
    """The report: per method, the mean episodes of each kind at the first -> last evaluation, then
    each seed's template copies at every evaluation, then the finished runs it could not read."""
    columns = (*KINDS, "copies_format_example", "repetition_loop", "cut_at_length")
    header = ["method", "seeds", "steps", *(c.replace("_", " ") for c in columns)]
    lines = ["# Held-out failures by kind (mean episodes over seeds, first -> last evaluation)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, s in summary.items():
        if s is None:
            continue
        cells = [" -> ".join("n/a" if s[end][k] is None else f"{s[end][k]:.1f}" for end in ("first", "last"))
                 for k in columns]
        lines.append(f"| {method} | {len(s['seeds'])} | {s['steps'][0]} -> {s['steps'][1]} | " + " | ".join(cells) + " |")
    lines += ["", "Replies copying the format example, per evaluation step (solved in brackets):", ""]
    for method, seeds in grid.items():
        for seed, steps in seeds.items():
            row = ", ".join(f"{k}: {c['copies_format_example']} ({c['solved']})" for k, c in steps.items())
            lines.append(f"- {method} {seed}: {row}")
    if missing:
        lines += ["", "Finished runs whose generations files are gone (not counted above): " + ", ".join(missing)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs-root", type=Path, nargs="+", default=[Path("runs/compare")],
                        help="the grid's run folders, <runs-root>/<method>/seed_<s>/ (compare.py's --root); "
                             "several roots are searched in order")
    parser.add_argument("--run-files", type=Path, default=Path("benchmarks/results/compare_runs"),
                        help="compare.py's run files; finished runs without generations are listed")
    parser.add_argument("--split", default="val")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="the runs' tokenizer folder (e.g. runs/evidence/sft_student): counts the replies "
                             "cut at the token limit in records written before they carried stop_reasons")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/heldout_errors"),
                        help="output path without suffix: writes <out>.json and <out>.md")
    args = parser.parse_args(argv)
    for root in args.runs_root:
        if not root.is_dir():
            parser.error(f"--runs-root {root} is not a folder; pass compare.py's --root (runs/compare)")
    count_tokens = None
    if args.tokenizer is not None:
        if not (args.tokenizer / "tokenizer_config.json").is_file():
            parser.error(f"--tokenizer {args.tokenizer} has no tokenizer_config.json; pass the runs' model folder")
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
        def count_tokens(text: str) -> int:
            return len(tokenizer(text, add_special_tokens=False).input_ids)
    grid = read_grid(args.runs_root, args.run_files, args.split, count_tokens)
    if not grid:
        parser.error(f"no {args.split}_step_<k>.jsonl under <runs-root>/<method>/seed_<s>/generations/ of "
                     f"{', '.join(map(str, args.runs_root))}; were the runs made by benchmarks/compare.py?")
    summary = summarise(grid)
    missing = runs_without_generations(grid, args.run_files)
    result = {"runs_roots": [str(r) for r in args.runs_root], "split": args.split, "kinds": list(KINDS), "summary": summary,
              "runs": grid, "runs_without_generations": missing, **run_metadata(seed=0, argv=argv)}
    write_json_atomic(result, args.out.with_suffix(".json"))
    args.out.with_suffix(".md").write_text(markdown(grid, summary, missing), encoding="utf-8")
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
