"""Record a finished ``lopd pretrain-composer`` run as a result file: its curve, its final numbers and the hashes
that the runs loading it record.

``lopd pretrain-composer --out DIR`` leaves ``DIR/composer.pt``, ``DIR/tensorboard/version_*/events.*`` (the
``pretrain/*`` tags, one value per step) and, in the command's own log, a last line of the form
``composer: N steps on M bank trajectories (S s); L_init a, L_rec b, latent spread c -> DIR``. This script
reads all three; it runs nothing.

Output keys: ``task``, ``what``, ``command`` (as given), ``pretrain_steps``, ``bank_trajectories``,
``pretrain_s`` (seconds, from the log line: the last session's only, so ``pretrain_s_complete`` is false when
the events come from more than one session, ``pretrain_sessions``), ``final`` (the last step's ``L_init``,
``L_rec``: nats per token, and ``latent_spread``), ``curve_per_step`` (every ``pretrain/*`` tag, steps in
order; a resumed run's later session replaces the earlier one's values of the same step), ``curve_means`` and
``window`` (means of the first and the last ``--window`` steps of each tag), ``composer_hash`` and
``student_hash`` (first 16 hex of the SHA-256 of ``composer.pt`` and of the student's weights:
``compare_provenance``'s, the values the comparison's run files record), and ``common.run_metadata``; with
``--compare-to RECORD``, ``compared_to`` (:func:`compare_curves`: how closely the curve follows that record's,
step by step).

The three inputs are checked against each other: the log line's folder must be ``--composer-dir``, the curve
must hold one value per step of the log line, and the log line's final numbers must be the curve's last.

Usage::

    python benchmarks/composer_pretrain_record.py --composer-dir runs/experience/composer \\
        --log runs/exp33/composer.log --student runs/hidden_rules/sft_student_in_context --task hidden_rules \\
        --command "lopd pretrain-composer -c ..." --out benchmarks/results/composer_pretrain_hidden_rules.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import run_metadata, write_json_atomic  # noqa: E402
from compare_provenance import file_sha256, student_hash  # noqa: E402

#: the last line `lopd pretrain-composer` prints (composer/pretrain.py's summary).
SUMMARY = re.compile(r"composer: (?P<steps>\d+) steps on (?P<bank>\d+) bank trajectories \((?P<seconds>[\d.]+) s\); "
                     r"L_init (?P<L_init>[-\d.naif]+), L_rec (?P<L_rec>[-\d.naif]+), "
                     r"latent spread (?P<latent_spread>[-\d.naif]+) -> (?P<out>.+?)\s*$")


def summary_line(log: Path) -> dict[str, Any]:
    """The numbers of the last summary line of ``log``.

    Raises:
        SystemExit: the log holds no summary line (the run did not finish).
    """
    matches = [m for m in (SUMMARY.search(line) for line in log.read_text(errors="replace").splitlines()) if m]
    if not matches:
        raise SystemExit(f"error: --log {log} holds no 'composer: N steps ...' line: the pretraining has not finished")
    m = matches[-1]
    final = {k: float(m[k]) for k in ("L_init", "L_rec", "latent_spread")}
    return {"pretrain_steps": int(m["steps"]), "bank_trajectories": int(m["bank"]), "pretrain_s": float(m["seconds"]),
            "final": {k: (v if math.isfinite(v) else None) for k, v in final.items()}, "out": m["out"]}


def _session_order(path: Path) -> tuple[int, str]:
    """Sort key of an events file: its ``version_N`` folder's N (a later session has a larger N), then its name."""
    version = next((p.name for p in path.parents if p.name.startswith("version_")), "version_-1")
    number = version.removeprefix("version_")
    return (int(number) if number.lstrip("-").isdigit() else -1, path.name)


def pretrain_curve(folder: Path) -> tuple[dict[str, dict[int, float]], int]:
    """``({tag without 'pretrain/': {step: value}}, sessions)`` from every events file under
    ``folder/tensorboard``; where two sessions hold the same step (a resumed run), the later session's value is
    kept. ``sessions`` counts the files that hold ``pretrain/*`` scalars.

    Raises:
        SystemExit: no ``pretrain/*`` scalar is found.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    by_tag: dict[str, dict[int, float]] = {}
    sessions = 0
    for path in sorted((folder / "tensorboard").glob("**/events.out.tfevents.*"), key=_session_order):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0})
        events.Reload()
        tags = [tag for tag in events.Tags()["scalars"] if tag.startswith("pretrain/")]
        sessions += bool(tags)
        for tag in tags:
            by_tag.setdefault(tag.removeprefix("pretrain/"), {}).update({e.step: e.value for e in events.Scalars(tag)})
    if not by_tag:
        raise SystemExit(f"error: no pretrain/* scalars under {folder / 'tensorboard'}")
    return by_tag, sessions


def check_consistent(summary: dict[str, Any], by_tag: dict[str, dict[int, float]], composer_dir: Path) -> None:
    """Refuse (one ``error:`` line) a log of another folder, a curve with missing steps, or final numbers that
    are not the curve's last."""
    named, here = Path(summary["out"]), composer_dir.resolve()
    same = named.resolve() == here or (not named.is_absolute() and here.parts[-len(named.parts):] == named.parts)
    if not same:  # a relative path is the lopd command's: its working directory may differ from this one's
        raise SystemExit(f"error: --log's summary line names {summary['out']}, not --composer-dir {composer_dir}: "
                         "pass the log of this run")
    steps = summary["pretrain_steps"]
    for tag, values in by_tag.items():
        if sorted(values) != list(range(steps)):
            raise SystemExit(f"error: pretrain/{tag} holds {len(values)} steps, the log {steps}: the events are "
                             "incomplete or from another run")
    for key, tag in (("L_init", "task_nll"), ("L_rec", "reconstruction_nll"), ("latent_spread", "latent_spread")):
        final, last = summary["final"][key], by_tag.get(tag, {}).get(steps - 1)
        if final is not None and (last is None or abs(final - last) > 1e-3):
            raise SystemExit(f"error: the log's final {key} {final} is not pretrain/{tag}'s last value {last}: "
                             "the log and the events are of different runs")


def curve_means(curve: dict[str, list[float]], window: int) -> dict[str, dict[str, float]]:
    """Per tag, the mean of the first and of the last ``window`` values."""
    return {tag: {"first": round(sum(v[:window]) / len(v[:window]), 4), "last": round(sum(v[-window:]) / len(v[-window:]), 4)}
            for tag, v in curve.items() if v}


def read_record(path: Path) -> dict[str, Any]:
    """A record of this script for ``--compare-to``: its ``curve_per_step`` must map each tag to a list of numbers.

    Raises:
        SystemExit: the file cannot be read or is not such a record (one line).
    """
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: --compare-to {path} cannot be read as JSON ({type(error).__name__}: {error})") from None
    curve = record.get("curve_per_step") if isinstance(record, dict) else None
    if not isinstance(curve, dict) or not curve or not all(
            isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
            for v in curve.values()):
        raise SystemExit(f"error: --compare-to {path} is not a record of this script (no curve_per_step of numbers "
                         "per tag): pass a composer_pretrain_*.json it wrote")
    return record


def compare_curves(curve: dict[str, list[float]], other: dict[str, Any], other_path: Path, window: int) -> dict[str, Any]:
    """How closely ``curve`` (this run's ``curve_per_step``) follows the one of ``other``, a record read by
    :func:`read_record` from ``other_path`` (``--compare-to``): the evidence for declaring a composer pretrained
    again the same as the original (``compare.py --same-input composer:NEW=ORIGINAL``), whose weights differ in
    rounding when the CPU model differs.

    Returns:
        ``{"record": path as given, "composer_hash", "student_hash": the other's, "per_tag": {tag:
        {"max_abs_diff": max over steps of |this - other|, "at_step": where (steps count from 0),
        "first_step_over_1e-3": the first step where they differ by more than 1e-3 after rounding to 4 decimals,
        as the curves are (None: never), "last_mean": [this, other] over the last ``window`` steps}},
        "tags_only_here", "tags_only_there": the tags one curve lacks}``.

    Raises:
        SystemExit: the curves share no tag, or a shared tag has another number of steps.
    """
    theirs = other["curve_per_step"]
    per_tag = {}
    for tag in sorted(set(curve) & set(theirs)):
        mine, other_values = curve[tag], theirs[tag]
        if len(mine) != len(other_values):
            raise SystemExit(f"error: --compare-to {other_path} has {len(other_values)} steps of pretrain/{tag}, this "
                             f"run {len(mine)}: compare runs of the same length")
        diffs = [round(abs(a - b), 4) for a, b in zip(mine, other_values)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        per_tag[tag] = {"max_abs_diff": diffs[worst], "at_step": worst,
                        "first_step_over_1e-3": next((i for i, d in enumerate(diffs) if d > 1e-3), None),
                        "last_mean": [round(sum(v[-window:]) / len(v[-window:]), 4) for v in (mine, other_values)]}
    if not per_tag:
        raise SystemExit(f"error: --compare-to {other_path} shares no pretrain/* tag with this run")
    return {"record": str(other_path), "composer_hash": other.get("composer_hash"),
            "student_hash": other.get("student_hash"), "per_tag": per_tag,
            "tags_only_here": sorted(set(curve) - set(theirs)), "tags_only_there": sorted(set(theirs) - set(curve))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--composer-dir", type=Path, required=True, help="the --out folder of lopd pretrain-composer")
    parser.add_argument("--log", type=Path, required=True, help="the command's output (its last line is the summary)")
    parser.add_argument("--student", required=True, help="model.init_args.model of the run (a folder)")
    parser.add_argument("--task", required=True)
    parser.add_argument("--command", required=True, help="the command that ran, recorded as given")
    parser.add_argument("--what", default="", help="one line on what the run is for")
    parser.add_argument("--window", type=int, default=10, help="steps averaged at each end of the curve (at most the "
                        "run's steps)")
    parser.add_argument("--compare-to", type=Path, default=None, help="another record of this script (e.g. the "
                        "original composer's): add how closely this curve follows it, step by step (compared_to)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error(f"--window must be >= 1, got {args.window}")
    composer = args.composer_dir / "composer.pt"
    if not composer.is_file():
        parser.error(f"--composer-dir {args.composer_dir} holds no composer.pt: the pretraining has not finished")
    if not args.log.is_file():
        parser.error(f"--log {args.log} is not a file")
    student = Path(args.student)
    as_name = not student.exists() and not student.is_absolute() and len(student.parts) <= 2 \
        and not args.student.startswith(".")  # "name" or "org/name": recorded with student_hash null
    if not as_name and not (student / "config.json").is_file():
        raise SystemExit(f"error: --student {args.student} is not a model folder (no config.json); pass the folder "
                         "the run trained from, or a model name")
    other = None if args.compare_to is None else read_record(args.compare_to)  # before any hashing
    summary = summary_line(args.log)
    by_tag, sessions = pretrain_curve(args.composer_dir)
    check_consistent(summary, by_tag, args.composer_dir)
    window = min(args.window, summary["pretrain_steps"])  # recorded: a short run's means are over all its steps
    curve = {tag: [round(values[step], 4) for step in sorted(values)] for tag, values in by_tag.items()}
    summary.pop("out")
    results = {"task": args.task, "what": args.what, "command": args.command, **summary,
               "pretrain_sessions": sessions, "pretrain_s_complete": sessions == 1,
               "curve_per_step": curve, "curve_means": curve_means(curve, window), "window": window,
               "composer_hash": file_sha256(composer)[:16], "student_hash": student_hash(args.student),
               **run_metadata(seed=0, argv=argv)}
    if other is not None:
        results["compared_to"] = compare_curves(curve, other, args.compare_to, window)
    try:
        write_json_atomic(results, args.out)
    except OSError as error:
        raise SystemExit(f"error: cannot write --out {args.out}: {error}") from None
    print(f"{args.task}: {results['pretrain_steps']} steps, L_rec {results['final']['L_rec']}, spread "
          f"{results['final']['latent_spread']} -> {args.out}")
    return results


if __name__ == "__main__":
    main()
