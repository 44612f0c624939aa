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

from compare_runs import read_run_files  # noqa: E402


def write_run(run: dict[str, Any], folder: Path) -> dict[str, int]:
    """Write one run file's curves into ``folder`` as TensorBoard event files.

    Args:
        run: a run file's content (:func:`compare_runs.read_run_files`).
        folder: the run's folder under the root (created).

    Returns:
        Tag -> number of points written.
    """
    from torch.utils.tensorboard import SummaryWriter

    points: dict[str, list[tuple[int, float]]] = {"by_rollouts/reward_mean": [(int(x), float(y)) for x, y in run["curve"]]}
    evaluations = run.get("evaluations") or []
    points["by_rollouts/val_success_rate"] = [(int(e["trajectories"]), float(e["success"])) for e in evaluations]
    points["val/success_rate"] = [(int(e["step"]), float(e["success"])) for e in evaluations]
    for tag, curve in (run.get("method_curves") or {}).items():
        points[tag] = [(int(x), float(y)) for x, y in curve]
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
    """Write every run file in ``--runs-dir`` under ``--out``; returns ``"<method>/seed_<s>"`` -> tag -> points.

    Raises:
        SystemExit: no run file in ``--runs-dir``, or ``--out`` already holds event files for one of the runs
            (one ``error:`` line; nothing is written).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs-dir", type=Path, required=True, help="the run files (<method>/seed_<s>.json)")
    parser.add_argument("--out", type=Path, required=True, help="the TensorBoard root to write (one folder per run)")
    args = parser.parse_args(argv)
    runs = read_run_files(args.runs_dir)
    if not runs:
        raise SystemExit(f"error: --runs-dir {args.runs_dir}: no run files (<method>/seed_<s>.json) there; give the "
                         "folder compare.py wrote them to (e.g. benchmarks/results/experience_runs)")
    folders = {run["path"].removesuffix(".json"): args.out / run["method"] / f"seed_{run['seed']}" for run in runs}
    taken = [str(f) for f in folders.values() if any(f.glob("events.out.tfevents.*"))]
    if taken:
        more = f" and {len(taken) - 1} more" if len(taken) > 1 else ""
        raise SystemExit(f"error: --out {args.out}: {taken[0]}{more} already hold event files; give an empty folder, "
                         "so that no run's curves are written twice")
    written = {name: write_run(run, folders[name]) for name, run in zip(folders, runs, strict=True)}
    print(f"{len(written)} runs -> {args.out}; tensorboard --logdir {args.out}", flush=True)
    return written


if __name__ == "__main__":
    main()
