"""One TensorBoard root from a comparison's committed run files, for runs whose folders are gone.

``benchmarks/compare.py`` runs every method under one TensorBoard root (``runs/compare``,
``runs/experience``), so ``tensorboard --logdir`` overlays them, but those folders are not committed: a
machine that loses ``runs/`` loses them. What each run recorded for the comparison is committed, in its run
file (``<runs-dir>/<method>/seed_<s>.json``, :func:`compare.finished_result`). This script writes those
records back as TensorBoard scalars, under the tags the live runs log them with, one run folder each
(``<out>/<method>/seed_<s>``), so every run of a comparison overlays again, lost folders included:

- ``by_rollouts/reward_mean``: the training reward per step (the run file's ``curve``; x = trajectories);
- ``by_rollouts/val_success_rate`` (x = trajectories) and ``val/success_rate`` (x = optimizer step): held-out
  success at each greedy evaluation (``evaluations``);
- the method's own curves (``method_curves``, e.g. LOPD's ``by_rollouts/margin_delta`` and ``by_rollouts/beta``);
- a text entry ``run/provenance`` with the run's src hash, inputs' hashes, learning rate and library versions.

The other tags a live run logs (losses, timings, reply lengths) are not in the run files and are not invented.

    python benchmarks/tensorboard_from_runs.py --runs-dir benchmarks/results/experience_runs --out runs/experience_tb
    tensorboard --logdir runs/experience_tb
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_runs import REWARD_TAG, VAL_METRIC, MixedRuns, read_run_files, select_runs  # noqa: E402

#: the live runs' tag of the held-out metric against trajectories (``log_by_rollouts``: ``val_success_rate``)
VAL_BY_ROLLOUTS = "by_rollouts/" + VAL_METRIC.replace("/", "_")


def run_points(run: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """One run file's curves as TensorBoard points: tag -> [(x, value)], x in trajectories (``by_rollouts/*``)
    or optimizer steps (``val/success_rate``).

    Raises:
        ValueError: the run file lacks ``curve``, or a point is not a number (a file not written by compare.py,
            or edited).
    """
    def numbers(pairs: Any, what: str) -> list[tuple[int, float]]:
        try:
            return [(int(x), float(y)) for x, y in pairs]
        except (TypeError, ValueError) as error:
            raise ValueError(f"{what} holds a point that is not (number, number): {error}") from None

    if "curve" not in run:
        raise ValueError("no `curve` (the training reward per step): not a run file that compare.py wrote")
    evaluations = run.get("evaluations") or []
    try:
        val = [(e["trajectories"], e["success"]) for e in evaluations]
        steps = [(e["step"], e["success"]) for e in evaluations]
    except (KeyError, TypeError) as error:
        raise ValueError(f"an evaluation lacks {error} (trajectories, step, success)") from None
    points = {REWARD_TAG: numbers(run["curve"], "curve"), VAL_BY_ROLLOUTS: numbers(val, "evaluations"),
              VAL_METRIC: numbers(steps, "evaluations")}
    for tag, curve in (run.get("method_curves") or {}).items():
        points[tag] = numbers(curve, f"method_curves[{tag!r}]")
    return points


def write_run(run: dict[str, Any], points: dict[str, list[tuple[int, float]]], folder: Path) -> dict[str, int]:
    """Write one run's points (:func:`run_points`) and its provenance into ``folder`` as TensorBoard event files.

    Returns:
        Tag -> number of points written.
    """
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder))
    try:
        for tag, curve in points.items():
            for x, y in curve:
                writer.add_scalar(tag, y, global_step=x)
        provenance = {"run_file": run.get("path"), "src": run.get("src"), "learning_rate": run.get("learning_rate"),
                      "generation_backend": run.get("generation_backend"), "provenance": run.get("provenance")}
        writer.add_text("run/provenance", "    " + json.dumps(provenance, indent=2).replace("\n", "\n    "), 0)
    finally:
        writer.close()
    return {tag: len(curve) for tag, curve in points.items()}


def main(argv: list[str] | None = None) -> dict[str, dict[str, int]]:
    """Write every run file in ``--runs-dir`` under ``--out`` (``<out>/<method>/<file name>``, e.g.
    ``grpo/seed_0``); returns that name -> tag -> points. Every run file is read and checked before anything is
    written. Runs that ``compare.py --aggregate-only`` would refuse to mix (another start student, bank,
    composer, src tree...) are written all the same, with one ``note:`` line that says so.

    Raises:
        SystemExit: no run file in ``--runs-dir``, a run file that is not one compare.py wrote, an ``--out`` that
            is a file, or run folders under ``--out`` that already hold event files (one ``error:`` line;
            nothing is written).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs-dir", type=Path, required=True, help="the run files (<method>/seed_<s>.json)")
    parser.add_argument("--out", type=Path, required=True, help="the TensorBoard root to write (one folder per run)")
    args = parser.parse_args(argv)
    try:
        runs = read_run_files(args.runs_dir)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: --runs-dir {args.runs_dir}: a run file could not be read: {error}") from None
    if not runs:
        raise SystemExit(f"error: --runs-dir {args.runs_dir}: no run files (<method>/seed_<s>.json) there; give the "
                         "folder compare.py wrote them to (e.g. benchmarks/results/experience_runs)")
    points = {}
    for run in runs:
        try:
            points[run["path"]] = run_points(run)
        except ValueError as error:
            raise SystemExit(f"error: --runs-dir {args.runs_dir}: {run['path']}: {error}") from None
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"error: --out {args.out} is a file; give a folder (it is created if missing)")
    names = {run["path"]: run["path"].removesuffix(".json") for run in runs}  # <method>/seed_<s>
    folders = {path: args.out / name for path, name in names.items()}
    taken = [str(f) for f in folders.values() if any(f.glob("events.out.tfevents.*"))]
    if taken:
        more = f" and {len(taken) - 1} more" if len(taken) > 1 else ""
        raise SystemExit(f"error: --out {args.out}: {taken[0]}{more} already hold event files; give an empty folder, "
                         "so that no run's curves are written twice")
    try:
        select_runs(runs)
    except MixedRuns as mixed:
        print(f"note: these runs overlay, but compare.py --aggregate-only would not aggregate them as they are: {mixed}",
              flush=True)
    written = {names[run["path"]]: write_run(run, points[run["path"]], folders[run["path"]]) for run in runs}
    print(f"{len(written)} runs -> {args.out}; tensorboard --logdir {args.out}", flush=True)
    return written


if __name__ == "__main__":
    main()
