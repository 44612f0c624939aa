"""Side-by-side comparison of the methods on one task at one budget of generated trajectories.

One command:

    python benchmarks/compare.py                        # every method, seeds 0 and 1, CPU settings
    python benchmarks/compare.py --methods lopd grpo --seeds 0 1 2 --budget 64
    python benchmarks/compare.py --config-dir configs/compare_tiny --budget 8 --in-process   # smoke test

For each method and seed it merges ``<config-dir>/common.yaml`` with ``<config-dir>/<method>.yaml`` and
the run's own settings (seed, number of steps = budget / trajectories per step, log folder), saves the
result as ``<root>/<method>/seed_<s>/run.yaml`` and runs ``lopd fit -c`` on it (a subprocess by
default, so that each run's peak memory is its own). Every run logs to TensorBoard under ``<root>``, so

    tensorboard --logdir runs/compare

overlays all methods and seeds (``by_rollouts/reward_mean``: training reward against trajectories
consumed). The first run also evaluates the start student on the held-out questions (``val_before``):
every method starts from the same student and validation is greedy, so it is the same for all.

Outputs (fixed paths, compared across versions): ``benchmarks/results/compare.json`` (keys documented
in :func:`summarise`), ``compare.png`` (reward against trajectories, mean and a band of one standard
deviation across seeds) and ``compare.md`` (a table).

The efficiency number (docs/METHOD.md section 7: LOPD passes GRPO's final reward after 20% of its budget):
each method's seed-mean reward curve is smoothed with a trailing mean over ``--smooth`` steps; GRPO's
final reward is its smoothed curve's last value; ``lopd_budget_fraction_to_grpo_final`` is the first
trajectory count at which LOPD's smoothed curve (from its first full window on) reaches it, divided by
GRPO's total, or null.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, run_metadata, write_json_atomic  # noqa: E402

from lopd_lightning.deprecation import rename_keys  # noqa: E402

METHODS = ("lopd", "grpo", "sdpo", "opsd", "skill_sd")
RESULTS = REPO_ROOT / "benchmarks" / "results"
REWARD_TAG = "by_rollouts/reward_mean"
VAL_METRIC = "val/success_rate"


# ---------------------------------------------------------------------- configs
def method_config(config_dir: Path, method: str) -> dict[str, Any]:
    """``common.yaml`` merged with ``<method>.yaml`` (the method's file wins), as a plain dict.

    Raises:
        FileNotFoundError: a config file is missing (the message names it and the available methods).
    """
    from omegaconf import OmegaConf

    common, own = config_dir / "common.yaml", config_dir / f"{method}.yaml"
    for path in (common, own):
        if not path.exists():
            known = sorted(p.stem for p in config_dir.glob("*.yaml") if p.stem != "common")
            raise FileNotFoundError(f"no config {path} (methods with a config in {config_dir}: {', '.join(known)})")
    merged = OmegaConf.merge(OmegaConf.load(common), OmegaConf.load(own))
    return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]


def trajectories_per_step(config: dict[str, Any]) -> int:
    """Trajectories one training step generates: examples per step x the group size."""
    data = config.get("data", {}).get("init_args", {})
    model = rename_keys(config.get("model", {}).get("init_args", {}), where="model.init_args")  # old configs too
    missing = [name for name, part in (("data.init_args.examples_per_step", data), ("model.init_args.group_size", model))
               if name.rsplit(".", 1)[1] not in part]
    if missing:  # the budget is counted in trajectories: both factors must be explicit, not class defaults
        raise ValueError(f"the comparison config must set {' and '.join(missing)} (trajectories per step)")
    return int(data["examples_per_step"]) * int(model["group_size"])


def run_config(
    config: dict[str, Any], *, method: str, seed: int, budget: int, root: Path, student: str | None, validate_before: bool
) -> dict[str, Any]:
    """The full config of one run: the method's config with the seed, steps, logger and summary set.

    Raises:
        ValueError: the budget is smaller than one step's trajectories.
    """
    import copy

    config = copy.deepcopy(config)
    per_step = trajectories_per_step(config)
    if budget < per_step:
        raise ValueError(f"--budget {budget} is smaller than one {method} step ({per_step} trajectories); raise --budget")
    steps = budget // per_step
    run_dir = root / method / f"seed_{seed}"
    config["seed_everything"] = seed
    trainer = config.setdefault("trainer", {})
    trainer["max_steps"] = steps
    trainer["val_check_interval"] = steps  # validation once, after the last step
    trainer["logger"] = {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(root), "name": method, "version": f"seed_{seed}"},
    }
    summary = {
        "class_path": "lopd_lightning.callbacks.RunSummary",
        "init_args": {"metric": VAL_METRIC, "json_path": str(run_dir / "summary.json")},
    }
    trainer["callbacks"] = [c for c in trainer.get("callbacks", []) or [] if "RunSummary" not in c["class_path"]] + [summary]
    init_args = config.setdefault("model", {}).setdefault("init_args", {})
    init_args["seed"] = seed
    init_args["validate_before_training"] = validate_before
    if student:
        init_args["model"] = student
    config.setdefault("data", {}).setdefault("init_args", {})["seed"] = seed
    return config


def write_config(config: dict[str, Any], path: Path) -> Path:
    from omegaconf import OmegaConf

    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config), path)
    return path


# ---------------------------------------------------------------------- running
def lopd_command() -> list[str]:
    """The ``lopd`` console script of this interpreter's environment (``python -m`` as a fallback)."""
    script = Path(sys.executable).parent / "lopd"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lopd_lightning.cli"]


def run_lopd(args: list[str], *, in_process: bool, threads: int | None, log_path: Path | None = None) -> float:
    """Run ``lopd <args>``; returns the wall seconds. A failed subprocess raises with its log's tail."""
    start = time.perf_counter()
    if in_process:
        from lopd_lightning.cli import main

        main(args)
        return time.perf_counter() - start
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path or os.devnull, "w") as out:
        proc = subprocess.run([*lopd_command(), *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:] if log_path else ""
        raise RuntimeError(f"`lopd {' '.join(args)}` failed with exit code {proc.returncode}; log {log_path}:\n{tail}")
    return time.perf_counter() - start


def prepare_bank(config: dict[str, Any], config_path: Path, *, in_process: bool, threads: int | None, log_dir: Path) -> None:
    """Build the LOPD bank from reference solutions when the configured folder holds none."""
    bank_path = config.get("model", {}).get("init_args", {}).get("bank_path")
    if not bank_path or (REPO_ROOT / bank_path / "meta.json").exists() or Path(bank_path, "meta.json").exists():
        return
    print(f"building the experience bank {bank_path} from reference solutions", flush=True)
    run_lopd(["build-memory", "-c", str(config_path), "--from-references"], in_process=in_process, threads=threads,
             log_path=log_dir / "build_memory.log")


def reward_curve(log_dir: Path) -> list[tuple[int, float]]:
    """``(trajectories consumed, training reward)`` points of one run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if REWARD_TAG not in acc.Tags().get("scalars", []):
        return []
    return [(int(e.step), float(e.value)) for e in acc.Scalars(REWARD_TAG)]


def finished_run(run_dir: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """The saved result of a finished run with exactly this config (None: not run, or a different config)."""
    import json

    from omegaconf import OmegaConf

    done, saved = run_dir / "result.json", run_dir / "run.yaml"
    if not (done.exists() and saved.exists()):
        return None
    if OmegaConf.to_container(OmegaConf.load(saved), resolve=True) != config:
        return None
    return json.loads(done.read_text())


def run_one(method: str, seed: int, config: dict[str, Any], *, root: Path, in_process: bool, threads: int | None,
            reuse: bool = False) -> dict[str, Any]:
    """Run one method and seed; returns its curve, summary and wall time (also saved as ``result.json``).

    With ``reuse``, a finished run with the same config is read back instead of run again (a stopped
    comparison resumes where it stopped).
    """
    import json

    run_dir = root / method / f"seed_{seed}"
    if reuse and (previous := finished_run(run_dir, config)) is not None:
        print(f"== {method} seed {seed}: reusing the finished run in {run_dir}", flush=True)
        return previous
    for stale in ("result.json", "summary.json"):
        (run_dir / stale).unlink(missing_ok=True)
    for events in run_dir.glob("events.out.tfevents.*"):  # a rerun must not mix in an earlier run's curve
        events.unlink()
    path = write_config(config, run_dir / "run.yaml")  # (LightningCLI saves its resolved config.yaml there)
    prepare_bank(config, path, in_process=in_process, threads=threads, log_dir=run_dir)
    print(f"== {method} seed {seed}: {config['trainer']['max_steps']} steps -> {run_dir}", flush=True)
    wall = run_lopd(["fit", "-c", str(path)], in_process=in_process, threads=threads, log_path=run_dir / "fit.log")
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = reward_curve(run_dir)
    print(f"   {wall:.0f} s, final reward {curve[-1][1] if curve else float('nan'):.3f}, "
          f"{VAL_METRIC} after {summary.get('after')}", flush=True)
    result = {"seed": seed, "curve": curve, "summary": summary, "wall_s": wall}
    write_json_atomic(result, run_dir / "result.json")
    return result


# ---------------------------------------------------------------------- results
def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (fewer at the start)."""
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def budget_fraction(lopd: dict[str, Any], grpo: dict[str, Any], window: int) -> float | None:
    """First trajectory count where LOPD's smoothed mean reward reaches GRPO's final smoothed reward,
    as a fraction of GRPO's total trajectories (None: never reached, or a method has no curve)."""
    if not lopd["rollouts"] or not grpo["rollouts"]:
        return None
    target = smooth(grpo["reward"], window)[-1]
    for i, (x, y) in enumerate(zip(lopd["rollouts"], smooth(lopd["reward"], window))):
        # only where a full window exists: one lucky early batch is not "reaching" GRPO's final reward
        if i >= min(window, len(lopd["reward"])) - 1 and y >= target - 1e-9:
            return x / grpo["rollouts"][-1]
    return None


def summarise(runs: dict[str, list[dict[str, Any]]], *, task: str, model: str, budget: int, smooth_window: int,
              val_before: float | None) -> dict[str, Any]:
    """The results JSON.

    Keys: ``methods`` -> name -> ``rollouts`` and ``reward`` (seed means at each logged step),
    ``reward_std`` (across seeds), ``val_before``, ``val_after`` (mean over seeds; ``val_after_std``,
    ``val_after_per_seed``), ``wall_s`` (mean fit wall seconds per run), ``peak_mem_mb`` (max over
    seeds of the run's peak RSS), ``seeds``, ``seconds_per_step`` (median by phase, first seed),
    ``final_reward`` / ``final_reward_std`` (smoothed last value); top level:
    ``lopd_budget_fraction_to_grpo_final``, ``grpo_final_reward`` (the smoothed target it refers to), ``task``, ``model``, ``budget_trajectories``, ``smooth_window``,
    ``val_metric`` and the run metadata (``git_sha``, ``versions``, ``hardware``...).
    """
    methods: dict[str, Any] = {}
    for name, seed_runs in runs.items():
        length = min(len(r["curve"]) for r in seed_runs)
        xs = [x for x, _ in seed_runs[0]["curve"][:length]]
        per_seed = [[y for _, y in r["curve"][:length]] for r in seed_runs]
        stats = [_mean_std([s[i] for s in per_seed]) for i in range(length)]
        finals = [smooth(s, smooth_window)[-1] for s in per_seed if s]
        afters = [r["summary"].get("after") for r in seed_runs]
        afters_known = [a for a in afters if a is not None]
        methods[name] = {
            "rollouts": xs,
            "reward": [m for m, _ in stats],
            "reward_std": [s for _, s in stats],
            "final_reward": _mean_std(finals)[0] if finals else None,
            "final_reward_std": _mean_std(finals)[1] if finals else None,
            "val_before": val_before,
            "val_after": _mean_std(afters_known)[0] if afters_known else None,
            "val_after_std": _mean_std(afters_known)[1] if afters_known else None,
            "val_after_per_seed": afters,
            "wall_s": statistics.fmean(r["wall_s"] for r in seed_runs),
            "peak_mem_mb": max(float(r["summary"].get("peak_rss_mb") or 0.0) for r in seed_runs),
            "seeds": [r["seed"] for r in seed_runs],
            "seconds_per_step": seed_runs[0]["summary"].get("seconds_per_step_median", {}),
        }
    fraction = grpo_final = None
    if "lopd" in methods and "grpo" in methods:
        fraction = budget_fraction(methods["lopd"], methods["grpo"], smooth_window)
        grpo_final = smooth(methods["grpo"]["reward"], smooth_window)[-1] if methods["grpo"]["reward"] else None
    return {
        "methods": methods,
        "lopd_budget_fraction_to_grpo_final": fraction,
        "grpo_final_reward": grpo_final,
        "task": task,
        "model": model,
        "budget_trajectories": budget,
        "smooth_window": smooth_window,
        "val_metric": VAL_METRIC,
        **run_metadata(seed=min((r["seed"] for rs in runs.values() for r in rs), default=0)),
        "seeds": sorted({r["seed"] for rs in runs.values() for r in rs}),
    }


def plot(results: dict[str, Any], path: Path) -> Path:
    """Training reward against trajectories consumed: seed mean and a +-1 std band per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, m in results["methods"].items():
        if not m["rollouts"]:
            continue
        lo = [a - b for a, b in zip(m["reward"], m["reward_std"])]
        hi = [a + b for a, b in zip(m["reward"], m["reward_std"])]
        (line,) = ax.plot(m["rollouts"], m["reward"], marker="o", ms=3, label=f"{name} (n={len(m['seeds'])})")
        ax.fill_between(m["rollouts"], lo, hi, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("trajectories consumed")
    ax.set_ylabel("training reward (mean over seeds)")
    ax.set_title(f"{results['task']}, {Path(str(results['model'])).name}: band = 1 std across seeds", fontsize=9)
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def table(results: dict[str, Any]) -> str:
    """The Markdown table of the results."""

    def fmt(mean: float | None, std: float | None = None) -> str:
        if mean is None:
            return "n/a"
        return f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f}"

    lines = [
        f"Task `{results['task']}`, student `{results['model']}`, budget {results['budget_trajectories']} "
        f"trajectories per run, git {results.get('git_sha')}. Mean ± std across seeds; final reward = trailing "
        f"mean over {results['smooth_window']} steps; held-out = `{results['val_metric']}` (greedy).",
        "",
        "| method | seeds | trajectories | final train reward | held-out before | held-out after | wall s / run | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in results["methods"].items():
        lines.append(
            f"| {name} | {','.join(map(str, m['seeds']))} | {m['rollouts'][-1] if m['rollouts'] else 0} | "
            f"{fmt(m['final_reward'], m['final_reward_std'])} | {fmt(m['val_before'])} | "
            f"{fmt(m['val_after'], m['val_after_std'])} | {m['wall_s']:.0f} | {m['peak_mem_mb']:.0f} |"
        )
    fraction, target = results["lopd_budget_fraction_to_grpo_final"], results.get("grpo_final_reward")
    if target is not None:
        lines += [
            "",
            f"LOPD's budget to reach GRPO's final training reward ({target:.3f}): "
            + ("not reached within the budget" if fraction is None else f"{fraction:.0%} of GRPO's budget")
            + " (paper: 20%)."
            + (" GRPO ended at reward 0, so this says nothing." if target <= 0 else ""),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help=f"methods to run (default: {' '.join(METHODS)})")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--budget", type=int, default=32, help="generated trajectories per run (default 32)")
    parser.add_argument("--config-dir", type=Path, default=REPO_ROOT / "configs" / "compare")
    parser.add_argument("--root", type=Path, default=REPO_ROOT / "runs" / "compare", help="TensorBoard root")
    parser.add_argument("--student", default=None, help="the start student for every method (default: the configs')")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where compare.{json,png,md} go")
    parser.add_argument("--smooth", type=int, default=3, help="trailing-mean window (steps) of the final reward")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--reuse", action="store_true", help="read back finished runs with the same config")
    parser.add_argument("--in-process", action="store_true", help="run fits in this process (tests; shared peak RSS)")
    args = parser.parse_args(argv)

    unknown = [m for m in args.methods if not (args.config_dir / f"{m}.yaml").exists()]
    if unknown:
        raise SystemExit(f"error: no config for {unknown} in {args.config_dir}")
    configs = {m: method_config(args.config_dir, m) for m in args.methods}
    for method, config in configs.items():  # every budget check before any run starts
        run_config(config, method=method, seed=0, budget=args.budget, root=args.root, student=args.student, validate_before=False)
    per_step = {m: trajectories_per_step(c) for m, c in configs.items()}
    if len({args.budget // n * n for n in per_step.values()}) > 1:
        print(f"warning: trajectories per step differ ({per_step}); runs use floor(budget / per step) steps", flush=True)

    runs: dict[str, list[dict[str, Any]]] = {}
    val_before = None
    first = True
    for seed in args.seeds:  # seed-major: a stopped comparison still has every method at the first seed
        for method in args.methods:
            config = run_config(configs[method], method=method, seed=seed, budget=args.budget, root=args.root,
                                student=args.student, validate_before=first)
            result = run_one(method, seed, config, root=args.root, in_process=args.in_process, threads=args.threads,
                             reuse=args.reuse)
            if first:
                val_before = result["summary"].get("before")
                first = False
            runs.setdefault(method, []).append(result)

    any_config = next(iter(configs.values()))
    results = summarise(
        runs,
        task=str(any_config["data"]["init_args"]["task"]),
        model=str(args.student or any_config["model"]["init_args"].get("model")),
        budget=args.budget,
        smooth_window=args.smooth,
        val_before=val_before,
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(results, args.out_dir / "compare.json")
    plot(results, args.out_dir / "compare.png")
    (args.out_dir / "compare.md").write_text(table(results))
    print(table(results), flush=True)
    print(f"results: {args.out_dir / 'compare.json'}, compare.png, compare.md; tensorboard --logdir {args.root}", flush=True)
    return results


if __name__ == "__main__":
    main()
