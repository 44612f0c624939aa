"""Record a finished ``lopd pretrain-composer`` run as a result file: its curve, its final numbers and the hashes
that the runs loading it record.

``lopd pretrain-composer --out DIR`` leaves ``DIR/composer.pt``, ``DIR/tensorboard/version_*/events.*`` (the
``pretrain/*`` tags, one value per step) and, in the command's own log, a last line of the form
``composer: N steps on M bank trajectories (S s); L_init a, L_rec b, latent spread c -> DIR``. This script
reads all three; it runs nothing.

Output keys: ``task``, ``what``, ``command`` (as given), ``pretrain_steps``, ``bank_trajectories``,
``pretrain_s`` (seconds, from the log line), ``final`` (``L_init``, ``L_rec``: nats per token;
``latent_spread``), ``curve_per_step`` (every ``pretrain/*`` tag, steps in order; a resumed run's later
events replace the earlier ones of the same step), ``curve_means`` (means of the first and the last
``--window`` steps of each tag), ``composer_hash`` and ``student_hash`` (first 16 hex of the SHA-256 of
``composer.pt`` and of the student's weights: ``compare_provenance``'s, the values the comparison's run
files record), and ``common.run_metadata``.

Usage::

    python benchmarks/composer_pretrain_record.py --composer-dir runs/experience/composer \\
        --log runs/exp33/composer.log --student runs/hidden_rules/sft_student_in_context --task hidden_rules \\
        --command "lopd pretrain-composer -c ..." --out benchmarks/results/composer_pretrain_hidden_rules.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import run_metadata  # noqa: E402
from compare_provenance import file_sha256, student_hash  # noqa: E402

#: the last line `lopd pretrain-composer` prints (composer/pretrain.py's summary).
SUMMARY = re.compile(r"composer: (?P<steps>\d+) steps on (?P<bank>\d+) bank trajectories \((?P<seconds>[\d.]+) s\); "
                     r"L_init (?P<L_init>[-\d.naif]+), L_rec (?P<L_rec>[-\d.naif]+), "
                     r"latent spread (?P<latent_spread>[-\d.naif]+)")


def summary_line(log: Path) -> dict[str, Any]:
    """The numbers of the last summary line of ``log``.

    Raises:
        SystemExit: the log holds no summary line (the run did not finish).
    """
    matches = [m for m in (SUMMARY.search(line) for line in log.read_text(errors="replace").splitlines()) if m]
    if not matches:
        raise SystemExit(f"error: --log {log} holds no 'composer: N steps ...' line: the pretraining has not finished")
    m = matches[-1]
    return {"pretrain_steps": int(m["steps"]), "bank_trajectories": int(m["bank"]), "pretrain_s": float(m["seconds"]),
            "final": {k: float(m[k]) for k in ("L_init", "L_rec", "latent_spread")}}


def pretrain_curve(folder: Path) -> dict[str, list[float]]:
    """``{tag without 'pretrain/': [value per step]}`` from every events file under ``folder/tensorboard``, in
    step order; where two files hold the same step (a resumed run), the later file's value is kept.

    Raises:
        SystemExit: no ``pretrain/*`` scalar is found.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    by_tag: dict[str, dict[int, float]] = {}
    for path in sorted((folder / "tensorboard").glob("**/events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            if tag.startswith("pretrain/"):
                by_tag.setdefault(tag.removeprefix("pretrain/"), {}).update({e.step: e.value for e in events.Scalars(tag)})
    if not by_tag:
        raise SystemExit(f"error: no pretrain/* scalars under {folder / 'tensorboard'}")
    return {tag: [round(values[step], 4) for step in sorted(values)] for tag, values in by_tag.items()}


def curve_means(curve: dict[str, list[float]], window: int) -> dict[str, dict[str, float]]:
    """Per tag, the mean of the first and of the last ``window`` values."""
    return {tag: {"first": round(sum(v[:window]) / len(v[:window]), 4), "last": round(sum(v[-window:]) / len(v[-window:]), 4)}
            for tag, v in curve.items() if v}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--composer-dir", type=Path, required=True, help="the --out folder of lopd pretrain-composer")
    parser.add_argument("--log", type=Path, required=True, help="the command's output (its last line is the summary)")
    parser.add_argument("--student", required=True, help="model.init_args.model of the run (a folder)")
    parser.add_argument("--task", required=True)
    parser.add_argument("--command", required=True, help="the command that ran, recorded as given")
    parser.add_argument("--what", default="", help="one line on what the run is for")
    parser.add_argument("--window", type=int, default=10, help="steps averaged at each end of the curve")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error(f"--window must be >= 1, got {args.window}")
    composer = args.composer_dir / "composer.pt"
    if not composer.is_file():
        parser.error(f"--composer-dir {args.composer_dir} holds no composer.pt: the pretraining has not finished")
    if not args.log.is_file():
        parser.error(f"--log {args.log} is not a file")
    curve = pretrain_curve(args.composer_dir)
    results = {"task": args.task, "what": args.what, "command": args.command, **summary_line(args.log),
               "curve_per_step": curve, "curve_means": curve_means(curve, args.window), "window": args.window,
               "composer_hash": file_sha256(composer)[:16], "student_hash": student_hash(args.student),
               **run_metadata(seed=0, argv=argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{args.task}: {results['pretrain_steps']} steps, L_rec {results['final']['L_rec']}, spread "
          f"{results['final']['latent_spread']} -> {args.out}")
    return results


if __name__ == "__main__":
    main()
