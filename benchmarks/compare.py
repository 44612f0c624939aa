"""Side-by-side comparison of the methods on one task at one budget of generated trajectories.

    python benchmarks/compare.py                        # the five methods, seeds 0 and 1, 32 trajectories a run
    python benchmarks/compare.py --methods lopd grpo --seeds 0 1 2 --budget 64
    python benchmarks/compare.py --plan evidence --sweep-lr 3e-5,1e-4,3e-4   # issue 17: the learning rates
    python benchmarks/compare.py --plan evidence         # issue 17: the grid, in its order, resumable
    python benchmarks/compare.py --plan evidence --generation-backend vllm --lopd .venv-vllm/bin/lopd
    python benchmarks/compare.py --aggregate-only        # compare.{json,png,md} from the run files there are
    python benchmarks/compare.py --plan experience --sweep-lr 3e-5,1e-4,3e-4 --lopd .venv-vllm/bin/lopd   # issue 33
    python benchmarks/compare.py --plan experience --lopd .venv-vllm/bin/lopd   # issue 33: 21 runs, resumable
    python benchmarks/compare.py --config-dir configs/compare_tiny --budget 8 --in-process   # smoke test

Each run merges ``<config-dir>/common.yaml`` with ``<config-dir>/<method>.yaml`` and its own settings
(seed, steps = budget / trajectories per step, learning rate, evaluations, checkpoints, log folder), saves
it as ``<root>/<method>/seed_<s>/run.yaml`` and runs ``lopd fit -c`` on it (a subprocess by default, so
that each run's peak memory is its own). Every run logs to TensorBoard under ``<root>``, so
``tensorboard --logdir runs/compare`` overlays every method and seed.

- **Held-out curve**: every run evaluates the student greedily on all the held-out questions of the
  config (``val_limit``) before its first step and at least ``--evaluations`` times evenly after it,
  the last at its end (:func:`evaluation_interval`); per question from ``<log_dir>/generations/val_step_<k>.jsonl``.
- **Resume**: a ``last.ckpt`` is saved every ``--checkpoint-every`` steps in the run folder; a run with
  no result file whose folder holds a checkpoint of the same config continues from it
  (``lopd fit ... --ckpt_path``). A finished run with the same config is read back, never run again (its run
  folders' paths compared as the plan's folders they name, in whichever checkout: compare_runs.same_config).
- **Provenance**: each finished run writes ``<runs-dir>/<method>/seed_<s>.json`` (default
  ``benchmarks/results/compare_runs``, to be committed at once) with the hash of the ``src/`` tree it ran
  on, its generation backend, its config, its curves, its per-question held-out results and ``provenance``
  (compare_provenance.py: the start student's weights hash, the pretrained composer's and the bank's hashes,
  the library versions of the interpreter that ran ``lopd``, taken when the run starts and checked again when
  it ends), and each attempt's start, step, src and machine (the CPU model, and the CPU capability of the torch
  that runs ``lopd``: a run resumed in another session may land on another kind of CPU; recorded, not
  refused). The aggregation reads every run file there and refuses to mix src trees, backends, budgets,
  held-out sets, start students, banks, composers or library versions unless ``--src-tree`` / ``--backend``
  / ``--budget`` / ``--student-hash`` / ``--bank-hash`` / ``--composer-hash`` / ``--versions`` choose
  (compare_runs.py; composers are compared among the runs of each ``composer_path``: lopd_paper reads a
  composer of its own); ``--same-input KIND:REBUILT=ORIGINAL`` counts a rebuilt student, bank or composer as the
  original (recorded in the results as ``same_inputs``). A plan or sweep refuses to start while a composer one
  of its runs reads is missing, naming the folder and the ``lopd pretrain-composer`` command that makes it.
- **Plans** (compare_plans.py): ``grid`` (``--methods`` x ``--seeds``, seed-major), ``evidence``
  (:func:`evidence_plan`: LOPD and GRPO seed 0, then their seeds 1-2, then SDPO, lopd_m0, OPSD, Skill-SD,
  lopd_balanced and lopd_m0_balanced; 192 trajectories a run; the start student of
  ``benchmarks/start_student.py``; learning rates from the sweep) or ``experience`` (issue 33, hidden_rules:
  :func:`experience_plan`, 21 runs from configs/experience (the first 15, then lopd_paper and opsd_reference),
  280 trajectories and a held-out evaluation at every 10% of them; its own run files, ``experience_runs``, and
  results, ``experience_compare.*``, which also carry ``task_calibration``). ``--seed-cap N`` runs at most N seeds a method of a fixed plan.
- **Learning-rate sweep** (``--sweep-lr``, compare_sweep.py): LOPD and GRPO (experience: and OPSD) at each
  rate, 64 trajectories, seed 0, judged on a dev slice of the train split (``data.init_args.dev_slice``),
  never on the held-out questions; writes ``compare_lr_sweep.json`` (experience: ``experience_lr_sweep.json``);
  the other methods take their parent's rate (compare_plans.py).

Outputs (``--out-dir``, default benchmarks/results): ``compare.json`` (keys: compare_stats.summarise),
``compare.png`` (training reward and held-out success against trajectories, bands over seeds) and
``compare.md`` (a table); ``experience_compare.*`` for the experience plan.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_plans  # noqa: E402,F401
import compare_provenance  # noqa: E402,F401
import compare_runs  # noqa: E402,F401  (the helpers, reachable as compare.compare_runs...)
import compare_stats  # noqa: E402,F401
import compare_sweep  # noqa: E402,F401
from common import REPO_ROOT, cpu_model, run_metadata, write_json_atomic  # noqa: E402
from compare_plans import (  # noqa: E402,F401  (re-exported: compare.evidence_plan, compare.ALL_METHODS...)
    ALL_METHODS,
    EVIDENCE_BUDGET,
    EVIDENCE_SEEDS,
    EVIDENCE_STUDENT,
    PLANS,
    check_exact_evaluations,
    evidence_plan,
    experience_plan,
    grid_plan,
    plan_runs,
    task_calibration,
)
from compare_args import parse_args  # noqa: E402
from compare_args import start_student as _student  # noqa: E402
from compare_provenance import (  # noqa: E402
    changed_files,
    cpu_capability_of,
    interpreter_of,
    missing_composers,
    run_provenance,
)
from compare_report import plot, table  # noqa: E402,F401  (plot and table: part of this script's interface)
from compare_runs import (  # noqa: E402
    VAL_METRIC,
    MixedRuns,
    checkpoint_step,  # noqa: F401  (used by the tests as compare.checkpoint_step)
    dry_run,
    generation_backend,
    heldout_evaluations,
    method_curves,
    read_run_files,
    resume_step,
    reward_curve,
    run_file,
    select_runs,
    src_provenance,
)
from compare_stats import (  # noqa: E402,F401  (re-exported for the tests)
    budget_fraction,
    heldout_by_category,
    smooth,
    summarise,
)
from compare_sweep import (  # noqa: E402
    learning_rates_for,
    parse_rates,
    rate_folder,
    sweep_document,
)

METHODS = ("lopd", "grpo", "sdpo", "opsd", "skill_sd")
RESULTS = REPO_ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class RunSpec:
    """One run: a method, a seed and what this run sets on top of the method's config.

    ``folder`` names the run folder under ``<root>/<method>`` (default ``seed_<seed>``); ``evaluations``
    counts the held-out evaluations after the start (the last at the final step); ``dev_slice``, when
    set, validates on that many train questions instead of the held-out split (the sweep).
    """

    method: str
    seed: int
    budget: int
    learning_rate: float | None = None
    folder: str = ""
    dev_slice: int | None = None
    evaluations: int = 3
    validate_before: bool = True

    @property
    def name(self) -> str:
        return self.folder or f"seed_{self.seed}"


# ---------------------------------------------------------------------- plans
def smooth_window(steps: int) -> int:
    """The default trailing-mean window (steps) of a run's final training reward: a quarter of its steps, at least 3."""
    return max(3, steps // 4)


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
    model = config.get("model", {}).get("init_args", {})
    missing = [name for name, part in (("data.init_args.examples_per_step", data), ("model.init_args.group_size", model))
               if name.rsplit(".", 1)[1] not in part]
    if missing:  # the budget is counted in trajectories: both factors must be explicit, not class defaults
        raise ValueError(f"the comparison config must set {' and '.join(missing)} (trajectories per step)")
    return int(data["examples_per_step"]) * int(model["group_size"])


def evaluation_interval(steps: int, evaluations: int) -> int:
    """Steps between held-out evaluations: the largest divisor of ``steps`` that is at most
    ``steps // evaluations``, so that at least ``evaluations`` fall evenly, the last at ``steps``
    (Lightning validates every N steps; 48 steps and 3 give every 16, 8 steps give every 2).

    Raises:
        ValueError: that spacing would make more than twice ``evaluations`` (e.g. a prime number of steps).
    """
    if steps <= evaluations:
        return 1
    interval = max(d for d in range(1, steps // evaluations + 1) if steps % d == 0)
    if steps // interval > 2 * evaluations:
        raise ValueError(f"{steps} steps cannot hold {evaluations} evenly spaced held-out evaluations ending at the last "
                         f"step (every {interval} steps would make {steps // interval}): choose a budget whose steps are "
                         f"a multiple of {evaluations} (or change --evaluations)")
    return interval


def _path(path: Path) -> str:
    """``path`` relative to the repository when inside it (runs read it from there), else absolute."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def run_config(config: dict[str, Any], spec: RunSpec, *, root: Path, student: str | None = None,
               backend: str | None = None, checkpoint_every: int = 4, dev_seed: int = 0,
               evaluated_checkpoint: bool = False) -> dict[str, Any]:
    """The full config of one run: the method's config with the seed, steps, evaluations, checkpoints,
    logger, summary, learning rate, student and backend set. ``evaluated_checkpoint`` (the experience plan)
    adds a second checkpoint, saved after every held-out evaluation (``checkpoints/evaluated.ckpt``): a run
    stopped during an evaluation whose step also saved ``last.ckpt`` resumes from it and runs that evaluation
    again (compare_runs.resume_checkpoint), where Lightning, resuming from ``last.ckpt``, would skip it.

    Raises:
        ValueError: the budget is smaller than one step's trajectories, or its steps do not hold the
            evaluations evenly (:func:`evaluation_interval`).
    """
    config = copy.deepcopy(config)
    per_step = trajectories_per_step(config)
    if spec.budget < per_step:
        raise ValueError(f"--budget {spec.budget} is smaller than one {spec.method} step ({per_step} trajectories); "
                         "raise --budget")
    steps = spec.budget // per_step
    run_dir = Path(root) / spec.method / spec.name
    config["seed_everything"] = spec.seed
    trainer = config.setdefault("trainer", {})
    trainer.update(max_steps=steps, val_check_interval=evaluation_interval(steps, spec.evaluations),
                   check_val_every_n_epoch=None, limit_val_batches=1.0, num_sanity_val_steps=0,
                   enable_checkpointing=True)
    trainer["logger"] = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                         "init_args": {"save_dir": _path(root), "name": spec.method, "version": spec.name}}
    summary = {"class_path": "lopd_lightning.callbacks.RunSummary",
               "init_args": {"metric": VAL_METRIC, "json_path": _path(run_dir / "summary.json")}}
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": _path(run_dir / "checkpoints"), "save_last": True, "save_top_k": 0,
                                "every_n_train_steps": checkpoint_every, "enable_version_counter": False}}
    evaluated = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",  # on_validation_end, overwritten
                 "init_args": {"dirpath": _path(run_dir / "checkpoints"), "filename": compare_runs.EVALUATED,
                               "save_top_k": 1, "every_n_epochs": 1, "save_on_train_epoch_end": False,
                               "enable_version_counter": False}}
    kept = [c for c in trainer.get("callbacks") or [] if not c["class_path"].endswith(("RunSummary", "ModelCheckpoint"))]
    trainer["callbacks"] = kept + [summary, checkpoint] + ([evaluated] if evaluated_checkpoint else [])
    init_args = config.setdefault("model", {}).setdefault("init_args", {})
    init_args.update(seed=spec.seed, validate_before_training=spec.validate_before, save_generations=True)
    for key, value in (("model", student), ("generation_backend", backend), ("learning_rate", spec.learning_rate)):
        if value is not None:
            init_args[key] = value
    data = config.setdefault("data", {}).setdefault("init_args", {})
    data["seed"] = spec.seed
    if spec.dev_slice is not None:  # validate on train questions kept out of training; the bank without them
        data.update(dev_slice=spec.dev_slice, dev_slice_seed=dev_seed, val_limit=None)
        if init_args.get("bank_path"):
            init_args["bank_path"] = _path(Path(root) / "bank")
    return config


def pretrain_command(config_dir: Path, method: str, folder: str) -> str:
    """The ``lopd pretrain-composer`` command that writes the composer ``method``'s config reads from ``folder``
    (as in the header of configs/experience/lopd.yaml: composer_path set to null for the stage that comes before
    the composer exists; it does not generate, so HF)."""
    where = _path(Path(config_dir))
    return (f"lopd pretrain-composer -c {where}/common.yaml -c {where}/{method}.yaml --model.init_args.composer_path=null "
            f"--model.init_args.generation_backend=hf --out {folder}")


def missing_composer_error(missing: list[str], configs: dict[str, dict[str, Any]], config_dir: Path,
                           order: tuple[str, ...] = ()) -> str:
    """The one ``error:`` line of a plan or sweep that would start while a composer its runs read is missing
    (``missing``: compare_provenance.missing_composers of the runs' configs): per folder, the methods that read it
    and the command that makes it, from the config of the first of ``configs`` (in ``order``, then by name) whose
    ``composer_path`` is that folder (lopd for runs/experience/composer, lopd_paper for its own composer_paper)."""
    names = sorted(configs, key=lambda m: (order.index(m) if m in order else len(order), m))
    parts = []
    for folder in missing:
        readers = [m for m in names if configs[m].get("model", {}).get("init_args", {}).get("composer_path") == folder]
        command = pretrain_command(config_dir, readers[0], folder) if readers else "lopd pretrain-composer --out " + folder
        parts.append(f"no pretrained composer in {folder} (read by {', '.join(readers) or 'the runs'}): pretrain it "
                     f"first with `{command}` (add --resume to continue a stopped pretraining)")
    return "error: " + "; ".join(parts)


def run_configs(args: argparse.Namespace, configs: dict[str, dict[str, Any]], specs: list[RunSpec], root: Path,
                student: str | None) -> list[dict[str, Any]]:
    """:func:`run_config` of every spec, with the command line's settings; a budget or evaluation count that does
    not fit (its ValueError) is refused in one ``error:`` line (SystemExit)."""
    try:
        return [run_config(configs[s.method], s, root=root, student=student, backend=args.generation_backend,
                           checkpoint_every=args.checkpoint_every, dev_seed=args.dev_seed,
                           evaluated_checkpoint=PLANS[args.plan].evaluated_checkpoint) for s in specs]
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


def write_config(config: dict[str, Any], path: Path) -> Path:
    from omegaconf import OmegaConf

    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config), path)
    return path


# ---------------------------------------------------------------------- running
#: the ``lopd`` executable of the runs when ``--lopd`` names one (e.g. ``.venv-vllm/bin/lopd``).
LOPD_EXECUTABLE: str | None = None
#: the descriptor of compare_runs.hold_lock while a plan or sweep runs (:func:`locked`); every lopd command inherits it.
LOCK_FD: int | None = None


@contextlib.contextmanager
def locked(folder: Path):
    """Hold compare_runs.hold_lock on ``folder`` (the runs' root) as :data:`LOCK_FD` until the block ends."""
    global LOCK_FD
    LOCK_FD = compare_runs.hold_lock(folder)
    try:
        yield
    finally:
        os.close(LOCK_FD)
        LOCK_FD = None


def lopd_command() -> list[str]:
    """``--lopd``, else the ``lopd`` console script of this interpreter's environment (``python -m`` as a
    fallback)."""
    if LOPD_EXECUTABLE:
        return [LOPD_EXECUTABLE]
    script = Path(sys.executable).parent / "lopd"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lopd_lightning.cli"]


def run_lopd(args: list[str], *, in_process: bool, threads: int | None, log_path: Path | None = None) -> float:
    """Run ``lopd <args>`` from the repository root; returns the wall seconds.

    Raises:
        RuntimeError: the command failed (a subprocess: with its log's tail).
    """
    start = time.perf_counter()
    if in_process:
        from lopd_lightning.cli import main

        with contextlib.chdir(REPO_ROOT):  # the configs' relative paths, as for the subprocess
            code = main(args)
        if code:
            raise RuntimeError(f"`lopd {' '.join(args)}` returned {code}")
        return time.perf_counter() - start
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path or os.devnull, "a") as out:  # appended: a resumed run's log follows the interrupted one
        held = () if LOCK_FD is None else (LOCK_FD,)  # the lock outlives this process while the command runs
        with subprocess.Popen([*lopd_command(), *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                              pass_fds=held) as proc:
            if held:
                compare_runs.note_lock(LOCK_FD, f"compare.py pid {os.getpid()}, lopd pid {proc.pid}: lopd {' '.join(args)}")
            try:
                proc.wait()
            except BaseException:  # as subprocess.run: the command does not outlive an exception here
                proc.kill()
                raise
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:] if log_path else ""
        raise RuntimeError(f"`lopd {' '.join(args)}` failed with exit code {proc.returncode}; log {log_path}:\n{tail}")
    return time.perf_counter() - start


def prepare_bank(config: dict[str, Any], config_path: Path, *, in_process: bool, threads: int | None, log_dir: Path) -> None:
    """Build the LOPD bank from the train split's reference solutions when the configured folder holds none."""
    bank_path = config.get("model", {}).get("init_args", {}).get("bank_path")
    if not bank_path or (REPO_ROOT / bank_path / "meta.json").exists() or Path(bank_path, "meta.json").exists():
        return
    print(f"building the experience bank {bank_path} from reference solutions", flush=True)
    run_lopd(["build-memory", "-c", str(config_path), "--from-references"], in_process=in_process, threads=threads,
             log_path=log_dir / "build_memory.log")


def finished_result(spec: RunSpec, config: dict[str, Any], run_dir: Path, attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """The result file's content of a finished run (:mod:`compare_runs` reads it back).

    Raises:
        RuntimeError: the run has no held-out evaluation at its last step.
    """
    per_step, steps = trajectories_per_step(config), int(config["trainer"]["max_steps"])
    evaluations = heldout_evaluations(run_dir, per_step)
    if not evaluations or evaluations[-1]["step"] != steps:
        last = evaluations[-1]["step"] if evaluations else None
        raise RuntimeError(f"{run_dir}: the last held-out evaluation is at step {last}, not at the run's last step "
                           f"{steps} (generations/val_step_{steps}.jsonl); run it again with --rerun")
    init_args = config["model"]["init_args"]
    return {
        "method": spec.method, "seed": spec.seed, "run": spec.name,
        "budget_trajectories": spec.budget, "trajectories_per_step": per_step, "steps": steps,
        "learning_rate": init_args.get("learning_rate"),
        "src": attempts[0]["src"], "generation_backend": generation_backend(config),
        "provenance": attempts[0].get("provenance"),
        "task": config["data"]["init_args"].get("task"), "model": init_args.get("model"),
        "curve": reward_curve(run_dir), "method_curves": method_curves(run_dir), "evaluations": evaluations,
        "summary": json.loads((run_dir / "summary.json").read_text()),
        # the attempts' seconds (an interrupted one's up to the checkpoint it was resumed from)
        "wall_s": sum(a.get("wall_s") or a.get("wall_s_to_checkpoint") or 0.0 for a in attempts), "attempts": attempts,
        "config": config,
        **run_metadata(seed=spec.seed),
    }


def run_one(spec: RunSpec, config: dict[str, Any], *, root: Path, result_path: Path, in_process: bool,
            threads: int | None, rerun: bool = False, window: int | None = None) -> dict[str, Any]:
    """Run (or resume, or read back) one run; returns its result, also written to ``result_path``.
    ``window``: the trailing-mean window (steps) of the train reward its progress line prints, the one
    its aggregate uses (default :func:`smooth_window` of its steps).

    Raises:
        SystemExit: ``result_path`` holds a finished run of another config (``rerun`` replaces it), an
            interrupted run started on other files or libraries (``provenance``), or a file the run read
            changed under it.
    """
    run_dir = Path(root) / spec.method / spec.name
    if result_path.exists() and not rerun:
        previous = json.loads(result_path.read_text())
        if compare_runs.same_config(previous.get("config"), config):
            print(f"== {spec.method} {spec.name}: finished, read back from {result_path}", flush=True)
            return previous
        raise SystemExit(f"error: {result_path} holds a finished {spec.method} {spec.name} run of another config; "
                         "pass --rerun to replace it, or --runs-dir to keep both")
    src = src_provenance()
    resume = None if rerun else resume_step(run_dir, config, src)
    start, last_ckpt = (None, None) if resume is None else (resume[1], resume[0])
    if start is None and run_dir.exists():
        shutil.rmtree(run_dir)  # a rerun must not mix in an earlier run's curve, evaluations or checkpoint
    saved = run_dir / "attempts.json"
    attempts = json.loads(saved.read_text()) if start is not None and saved.exists() else []
    if attempts and attempts[-1]["wall_s"] is None:  # the interrupted attempt: its time up to the checkpoint
        # (0 for one stopped before it wrote the checkpoint resumed from: an earlier attempt's, older than its start)
        attempts[-1]["wall_s_to_checkpoint"] = max(0.0, last_ckpt.stat().st_mtime - attempts[-1]["started_unix"])
    attempts.append({"start_step": start or 0, "src": src, "wall_s": None, "started_unix": time.time(),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     # the machine of this attempt (a run resumed in a later session may land on another kind),
                     # and the capability of the torch that runs lopd (its interpreter's, e.g. .venv-vllm's)
                     "cpu": cpu_model(),
                     "cpu_capability": cpu_capability_of(None if in_process else interpreter_of(lopd_command()))})
    path = write_config(config, run_dir / "run.yaml")  # (LightningCLI saves its resolved config.yaml there)
    write_json_atomic(attempts, run_dir / "attempts.json")
    prepare_bank(config, path, in_process=in_process, threads=threads, log_dir=run_dir)
    provenance = run_provenance(config, None if in_process else lopd_command())  # the files and libraries it reads
    first = attempts[0].get("provenance")
    if first is not None and first != provenance:  # a resumed run must not mix students, banks or libraries
        differ = ", ".join(f"{k} {first.get(k)} -> {v}" for k, v in provenance.items() if first.get(k) != v)
        raise SystemExit(f"error: the interrupted run in {run_dir} started with other files or libraries ({differ}); "
                         "pass --rerun to start it again")
    attempts[-1]["provenance"] = provenance
    write_json_atomic(attempts, run_dir / "attempts.json")
    steps = config["trainer"]["max_steps"]
    args = ["fit", "-c", str(path)]
    if start is not None:
        args += ["--ckpt_path", str(last_ckpt)]
    print(f"== {spec.method} {spec.name}: " + (f"resuming at step {start} of {steps}" if start is not None
                                               else f"{steps} steps") + f" -> {run_dir}", flush=True)
    attempts[-1]["wall_s"] = run_lopd(args, in_process=in_process, threads=threads, log_path=run_dir / "fit.log")
    write_json_atomic(attempts, run_dir / "attempts.json")
    if changed := changed_files(provenance, config):
        raise SystemExit(f"error: {', '.join(changed)}: a file {spec.method} {spec.name} read changed while it ran; "
                         "its result is not written (pass --rerun once the files stay put)")
    result = finished_result(spec, config, run_dir, attempts)
    write_json_atomic(result, result_path)
    last = result["evaluations"][-1]
    rewards = [reward for _, reward in result["curve"]]
    steps = min(len(rewards), window or smooth_window(len(rewards)))  # the aggregate's "final reward"
    final = smooth(rewards, steps)[-1] if rewards else float("nan")
    print(f"   {attempts[-1]['wall_s']:.0f} s, train reward {final:.3f} (mean of the last {steps} steps), "
          f"held-out {last['solved']}/{last['questions']} -> {result_path}", flush=True)
    return result


# ---------------------------------------------------------------------- the sweep, the plan, the aggregation
def run_sweep(args: argparse.Namespace, configs: dict[str, dict[str, Any]], student: str | None) -> dict[str, Any]:
    """The plan's swept methods (LOPD and GRPO; experience: and OPSD) at every ``--sweep-lr`` rate on the dev
    slice; writes ``<out-dir>/<the plan's sweep file>`` (``compare_lr_sweep.json``, ``experience_lr_sweep.json``)."""
    plan = PLANS[args.plan]
    try:
        rates = parse_rates(args.sweep_lr)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    root = args.root.parent / f"{args.root.name}_lr_sweep"
    seed = args.seeds[0] if args.seeds else 0
    specs = [RunSpec(m, seed, args.sweep_budget, learning_rate=rate, folder=rate_folder(rate), dev_slice=args.dev_questions,
                     evaluations=1, validate_before=(i == 0))  # the start's dev success is the same at every rate
             for m in plan.sweep_methods for i, rate in enumerate(rates)]
    full = run_configs(args, configs, specs, root, student)  # all checked first
    if args.dry_run:
        return dry_run(specs, full, root, [root / s.method / f"{s.name}.json" for s in specs])
    if missing := missing_composers(full):
        raise SystemExit(missing_composer_error(missing, configs, args.config_dir, plan.order))
    results: dict[str, dict[float, dict[str, Any]]] = {}
    with locked(root):
        for spec, config in zip(specs, full):
            result = run_one(spec, config, root=root, result_path=root / spec.method / f"{spec.name}.json",
                             in_process=args.in_process, threads=args.threads, rerun=args.rerun, window=args.smooth or 3)
            results.setdefault(spec.method, {})[spec.learning_rate] = result
    first = next(iter(results.values()))[rates[0]]
    extra = {"others": plan.others, "benchmark": plan.sweep_file.removesuffix(".json")} if plan.others else {}
    document = sweep_document(
        results, smooth_window=args.smooth or 3, learning_rates=rates, budget_trajectories=args.sweep_budget,
        dev_questions=args.dev_questions, dev_seed=args.dev_seed, task=first["task"], model=first["model"],
        src=first["src"], generation_backend=first["generation_backend"], provenance=first.get("provenance"), **extra,
        **run_metadata(seed=seed, argv=args.argv))
    path = write_json_atomic(document, args.out_dir / plan.sweep_file)
    for method, entry in document["methods"].items():
        line = ", ".join(f"{rate}: dev {r['dev_solved']}/{r['dev_questions']}" for rate, r in entry["runs"].items())
        print(f"{method}: {line} -> chosen {entry['chosen']:g}", flush=True)
    print(f"sweep: {path}; tensorboard --logdir {root}", flush=True)
    return document


def plan_specs(args: argparse.Namespace, configs: dict[str, dict[str, Any]]) -> list[RunSpec]:
    """The runs of ``--plan`` in order, with the learning rates of ``--lr-file`` (none: the configs').

    Raises:
        SystemExit: no sweep file, or it lacks a rate a method needs; a budget whose held-out evaluations
            cannot fall at every ``1 / --evaluations`` of it where the plan wants that (experience).
    """
    plan = PLANS[args.plan]
    try:
        runs = plan_runs(plan, methods=args.methods, seeds=args.seeds, seed_cap=args.seed_cap, only=args.only)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    rates: dict[str, float] = {}
    if args.lr_file is not None:
        try:
            rates = learning_rates_for(args.lr_file, sorted({m for m, _ in runs}), plan.parents, plan.name)
        except (FileNotFoundError, KeyError) as error:
            raise SystemExit(f"error: {error.args[0]}") from None
    if plan.exact_evaluations:
        for method in sorted({m for m, _ in runs}):
            try:
                check_exact_evaluations(method, args.budget, trajectories_per_step(configs[method]), args.evaluations)
            except ValueError as error:
                raise SystemExit(f"error: {error}") from None
    return [RunSpec(m, s, args.budget, learning_rate=rates.get(m), evaluations=args.evaluations) for m, s in runs]


def heldout_categories(run: dict[str, Any]) -> tuple[dict[str, str | None], str | None]:
    """The category (``Task.example_category``) of each question ``run``'s first held-out evaluation asked, read
    from its task with its config's ``data.init_args.task_options`` (any split: a dev slice's questions are
    train examples).

    Returns:
        ``(question id -> category (str, or None: not counted), None)``, or ``({}, why there is no breakdown)``:
        the run has no evaluation, the task does not override ``example_category``, a question is not an example of
        the task, or no question has a category.

    Raises:
        Whatever loading the task or ``example_category`` raises (``aggregate`` reports it as the reason).
    """
    from lopd_lightning.tasks import get_task
    from lopd_lightning.tasks.base import Task

    if not run.get("evaluations"):
        return {}, "the run has no held-out evaluation"
    options = (((run.get("config") or {}).get("data") or {}).get("init_args") or {}).get("task_options") or {}
    task = get_task(str(run["task"]), **options)
    if type(task).example_category is Task.example_category:
        return {}, "the task defines no example_category"
    asked = set(run["evaluations"][0]["per_question"])
    found = {e.id: e for e in task.examples("all") if e.id in asked}
    if missing := sorted(asked - set(found)):
        return {}, (f"{len(missing)} of {len(asked)} evaluated questions are not examples of task {run['task']!r} "
                    f"with task_options {options} (e.g. {missing[0]!r})")
    categories = {q: task.example_category(e) for q, e in found.items()}
    if all(c is None for c in categories.values()):
        return {}, "no evaluated question has a category"
    return {q: None if c is None else str(c) for q, c in categories.items()}, None


def aggregate(args: argparse.Namespace) -> dict[str, Any]:
    """``<results>.{json,png,md}`` (compare.*, or experience_compare.* for the experience plan) from every run
    file in ``--runs-dir`` (those of the ``--src-tree``, ``--backend``, ``--budget`` and provenance flags when
    given; after a plan, of the plan's budget); the experience plan's also carries ``task_calibration``.
    ``heldout_by_category``: held-out questions solved per ``Task.example_category`` at the first and last
    evaluation (:func:`compare_stats.heldout_by_category`); None, with ``heldout_by_category_reason`` saying why
    (:func:`heldout_categories`, or the error loading the task). ``provenance``: each method's first seed's
    inputs; ``provenance_by_run``: every run file's (``seed_<s>``), as the run recorded them.

    Raises:
        SystemExit: no run file, or runs that must not be mixed (one ``error:`` line).
    """
    plan = PLANS[args.plan]
    try:
        runs = select_runs(read_run_files(args.runs_dir), src_tree=args.src_tree, backend=args.backend,
                           budget=args.budget, student_hash=args.student_hash, bank_hash=args.bank_hash,
                           composer_hash=args.composer_hash, versions=args.versions,
                           same_inputs=args.same_inputs)
    except MixedRuns as error:
        raise SystemExit(f"error: {error}") from None
    if not runs:
        raise SystemExit(f"error: no run files in {args.runs_dir}: run a plan first")
    by_method: dict[str, list[dict[str, Any]]] = {}
    order = {m: i for i, m in enumerate(plan.order)}
    for run in sorted(runs, key=lambda r: (order.get(r["method"], len(order)), r["method"], r["seed"])):
        by_method.setdefault(run["method"], []).append(run)
    first = runs[0]
    results = summarise(by_method, task=str(first["task"]), model=str(first["model"]),
                        budget=int(first["budget_trajectories"]), n_boot=args.bootstrap, contrasts=plan.contrasts,
                        smooth_window=args.smooth or smooth_window(int(first["steps"])))
    results.update(val_metric=VAL_METRIC, generation_backend=first["generation_backend"], **first["src"],
                   learning_rates={m: rs[0]["learning_rate"] for m, rs in by_method.items()},
                   provenance={m: rs[0].get("provenance") for m, rs in by_method.items()},  # the first seed's
                   # every seed's, as its run recorded it (a declared rebuilt input keeps its own hashes here)
                   provenance_by_run={m: {Path(r["path"]).stem: r.get("provenance") for r in rs}
                                      for m, rs in by_method.items()},
                   # the rebuilt inputs declared the same as the original's (--same-input), None without
                   same_inputs=args.same_inputs or None,
                   run_files=[r["path"] for r in runs])
    try:
        categories, reason = heldout_categories(first)
        by_category = heldout_by_category(by_method, categories) if categories else None
    except Exception as error:  # an optional breakdown: the aggregate stands without it, and says why
        by_category, reason = None, f"task {first['task']!r} gave no categories: {type(error).__name__}: {error}"
    results.update(heldout_by_category=by_category, heldout_by_category_reason=reason)
    if plan.calibration and args.calibration is not None and str(args.calibration).lower() == "none":
        results.update(task_calibration=None, task_calibration_reason="not read (--calibration none)")
    elif plan.calibration:
        results.update(task_calibration(args.calibration or REPO_ROOT / plan.calibration, model=str(first["model"])))
    results.update(run_metadata(seed=min(results["seeds"]), argv=args.argv), seeds=results["seeds"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    names = [args.out_dir / f"{plan.results}.{ext}" for ext in ("json", "png", "md")]
    write_json_atomic(results, names[0])
    plot(results, names[1])
    names[2].write_text(table(results))
    print(table(results), flush=True)
    print(f"results: {', '.join(map(str, names))}; tensorboard --logdir {args.root}", flush=True)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sweep, or the plan then the aggregation, or only the aggregation (see the module docstring).

    Returns the results document (the sweep's document with ``--sweep-lr``; ``{"plan": [...]}`` with
    ``--dry-run``; ``{"run_files": [...], "aggregate_refused": reason}`` where the runs finished but the run
    files in ``--runs-dir`` must not be aggregated as they are, e.g. ``--only`` runs on a rebuilt input that
    needs ``--same-input``: a warning line, exit status 0, since the runs themselves succeeded).
    """
    global LOPD_EXECUTABLE
    args = parse_args(argv, description=__doc__.split("\n")[0], methods=METHODS, results=RESULTS)
    if args.aggregate_only:
        return aggregate(args)
    LOPD_EXECUTABLE = args.lopd and str(Path(args.lopd).resolve())
    if args.generation_backend == "vllm" and not args.lopd and importlib.util.find_spec("vllm") is None:
        raise SystemExit("error: --generation-backend vllm needs vLLM, which this environment lacks: pass "
                         "--lopd .venv-vllm/bin/lopd (`make test-vllm` makes that environment)")
    plan = PLANS[args.plan]
    methods = sorted({m for m, _ in plan_runs(plan, methods=args.methods, seeds=[0])})
    needed = list(plan.sweep_methods) if args.sweep_lr else methods
    unknown = [m for m in needed if not (args.config_dir / f"{m}.yaml").exists()]
    if unknown:
        raise SystemExit(f"error: no config for {unknown} in {args.config_dir}")
    configs = {m: method_config(args.config_dir, m) for m in needed}
    vllm = "vllm" in {args.generation_backend or generation_backend(c) for c in configs.values()}
    if vllm and not args.lopd and not args.dry_run and importlib.util.find_spec("vllm") is None:
        raise SystemExit(f"error: the configs in {args.config_dir} generate with vLLM (model.init_args.generation_backend),"
                         " which this environment lacks: pass --lopd .venv-vllm/bin/lopd (or --generation-backend hf)")
    student = _student(args)
    if args.sweep_lr:
        return run_sweep(args, configs, student)
    args.budget = args.budget or plan.budget
    specs = plan_specs(args, configs)
    full = run_configs(args, configs, specs, args.root, student)  # every check before any run starts
    per_step = {m: trajectories_per_step(c) for m, c in configs.items()}
    if len({args.budget // n * n for n in per_step.values()}) > 1:
        print(f"warning: trajectories per step differ ({per_step}); runs use floor(budget / per step) steps", flush=True)
    if args.dry_run:
        return dry_run(specs, full, args.root, [run_file(args.runs_dir, s.method, s.seed) for s in specs])
    if missing := missing_composers(full):
        raise SystemExit(missing_composer_error(missing, configs, args.config_dir, plan.order))
    with locked(args.root):  # one compare.py (and its lopd commands) at a time on these runs
        for spec, config in zip(specs, full):
            run_one(spec, config, root=args.root, result_path=run_file(args.runs_dir, spec.method, spec.seed),
                    in_process=args.in_process, threads=args.threads, rerun=args.rerun, window=args.smooth)
    try:
        return aggregate(args)
    except SystemExit as refused:  # the runs are done and their files written: a refused aggregate is not a failed run
        reason = str(refused).removeprefix("error: ")
        print(f"warning: the runs are done (their files are in {args.runs_dir}) but not aggregated, and any earlier "
              f"{PLANS[args.plan].results}.* in {args.out_dir} is not updated: {reason}; aggregate them with "
              "--aggregate-only once that is resolved", flush=True)
        return {"run_files": [str(run_file(args.runs_dir, s.method, s.seed)) for s in specs],
                "aggregate_refused": reason}


if __name__ == "__main__":
    main()
