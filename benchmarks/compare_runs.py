"""What one run of ``benchmarks/compare.py`` leaves behind, read back, and where it came from.

- **Provenance** (:func:`src_provenance`, :func:`generation_backend`): the ``src/`` tree a run ran on
  (``git rev-parse HEAD:src``, whether ``git status --porcelain src`` lists changes, and a content hash
  of every file under ``src/`` that git tracks or would track) and the generation backend.
- **The training curve** (:func:`reward_curve`): ``by_rollouts/reward_mean`` of the run's TensorBoard
  events (x = trajectories consumed), the last value kept where a resumed run logged a step again.
- **The held-out evaluations** (:func:`heldout_evaluations`): every ``<log_dir>/generations/val_step_<k>.jsonl``
  (one JSON line per greedy episode, written by ``lopd_lightning.modules.observability``: ``example_id``,
  ``reward``, ``success``...), as the success per question and the fraction solved after k steps.
- **Resuming** (:func:`resume_step`, :func:`resume_checkpoint`, :func:`checkpoint_step`, :func:`dry_run`): the
  checkpoint and step an interrupted run continues from (its ``last.ckpt``, when its ``run.yaml`` is the same
  config and its first attempt ran on the same ``src/``; not one saved before an evaluation that never
  finished), and the state of every run of a plan.
- **Run files** (:func:`run_file`, :func:`read_run_files`, :func:`select_runs`): each finished run's
  result, ``<runs-dir>/<method>/seed_<s>.json`` (committed as it is written). The aggregation refuses
  to mix runs of different ``src/`` trees, generation backends, budgets, held-out sets, start students,
  banks, pretrained composers or library versions (``provenance``, compare_provenance.py;
  :class:`MixedRuns`) unless it is told which ones to use. The composer check is per ``composer_path``: the runs
  that read one composer folder must agree on its hash, while runs of different folders (the experience plan's
  lopd_paper, with a composer of its own) read different composers by design.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from common import REPO_ROOT

REWARD_TAG = "by_rollouts/reward_mean"
#: the held-out metric every run is scored on (its validation tag)
VAL_METRIC = "val/success_rate"


class MixedRuns(ValueError):
    """Run files that must not be aggregated together (different code, backend, budget, held-out set, start
    student, bank, composer or library versions)."""


# ---------------------------------------------------------------------- provenance
def _git(args: list[str], root: Path) -> str | None:
    """stdout of ``git <args>`` in ``root``; None when git or the repository is unavailable."""
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def src_provenance(root: Path = REPO_ROOT) -> dict[str, Any]:
    """Which ``src/`` a run ran on.

    Returns:
        ``{"src_tree": git's tree hash of src/ at HEAD (None without git), "src_dirty": True when
        ``git status --porcelain src`` lists a change (None without git), "src_hash": the first 16 hex
        digits of a SHA-256 over the path and bytes of every file under src/ that git tracks or would
        track (without git: every file but caches)}``. ``src_hash`` identifies the code whether or not it
        was committed, so the aggregation compares it.
    """
    tree = _git(["rev-parse", "HEAD:src"], root)
    status = _git(["status", "--porcelain", "--", "src"], root)
    listed = _git(["ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "src"], root)
    if listed is not None:
        paths = sorted({p for p in listed.split("\0") if p})
    else:
        paths = sorted(str(p.relative_to(root)) for p in (root / "src").rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc"))
    digest = hashlib.sha256()
    for rel in paths:
        path = root / rel
        if path.is_file():  # a tracked file deleted in the working tree is not part of the code that ran
            digest.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return {
        "src_tree": tree.strip() if tree else None,
        "src_dirty": None if status is None else bool(status.strip()),
        "src_hash": digest.hexdigest()[:16],
    }


def describe_src(src: dict[str, Any]) -> str:
    """``"<src_hash> (tree <first 10 of src_tree>[, uncommitted changes])"`` for messages."""
    tree = (src.get("src_tree") or "unknown")[:10]
    return f"{src.get('src_hash')} (tree {tree}{', uncommitted changes' if src.get('src_dirty') else ''})"


def generation_backend(config: dict[str, Any]) -> str:
    """``model.init_args.generation_backend`` of a run config (the module's default ``"hf"`` when unset)."""
    return str(config.get("model", {}).get("init_args", {}).get("generation_backend") or "hf")


# ---------------------------------------------------------------------- what a run logged
def _event_time(path: Path) -> float:
    """The creation time in a TensorBoard event file's name (``events.out.tfevents.<time>.<host>...``)."""
    match = re.match(r"events\.out\.tfevents\.(\d+(?:\.\d+)?)", path.name)
    return float(match.group(1)) if match else 0.0


#: the method's own scalars kept in a run file beside the reward (LOPD's margin and dual variable)
METHOD_TAGS = ("by_rollouts/margin_delta", "by_rollouts/beta")


def reward_points(path: Path, tag: str = REWARD_TAG) -> list[tuple[int, float]]:
    """``(trajectories consumed, value)`` points of ``tag`` (default: the training reward) in one event file
    or folder, in logged order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return []
    return [(int(e.step), float(e.value)) for e in acc.Scalars(tag)]


def reward_curve(log_dir: Path, tag: str = REWARD_TAG) -> list[tuple[int, float]]:
    """The run's ``(trajectories consumed, training reward)`` curve (or ``tag``'s), sorted by x, one point
    per x.

    A resumed run writes a new event file and logs again the steps after its checkpoint; the files are
    read oldest first and a later value replaces an earlier one at the same x.
    """
    points: dict[int, float] = {}
    for events in sorted(Path(log_dir).glob("events.out.tfevents.*"), key=_event_time):
        points.update(reward_points(events, tag))
    return sorted(points.items())


def method_curves(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The :data:`METHOD_TAGS` a run logged, each as :func:`reward_curve` reads it (empty for GRPO)."""
    return {tag: curve for tag in METHOD_TAGS if (curve := reward_curve(log_dir, tag))}


def generation_files(log_dir: Path, split: str = "val") -> list[tuple[int, Path]]:
    """``(k, path)`` of every ``<log_dir>/generations/<split>_step_<k>.jsonl``, by step (empty without any)."""
    found = []
    for path in (Path(log_dir) / "generations").glob(f"{split}_step_*.jsonl"):
        match = re.fullmatch(rf"{re.escape(split)}_step_(\d+)\.jsonl", path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def heldout_evaluations(log_dir: Path, trajectories_per_step: int, split: str = "val") -> list[dict[str, Any]]:
    """Every greedy evaluation the run wrote to ``<log_dir>/generations/<split>_step_<k>.jsonl``, by step.

    Returns:
        one dict per file: ``step`` (k, training steps done), ``trajectories`` (k x trajectories per
        step), ``questions`` and ``solved`` (counts), ``success`` (their fraction) and ``per_question``
        (example id -> solved, bool, from each record's ``success``).
    """
    evaluations = []
    for step, path in generation_files(log_dir, split):
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        per_question = {str(r["example_id"]): bool(r["success"]) for r in records}
        solved = sum(per_question.values())
        evaluations.append({
            "step": step, "trajectories": step * trajectories_per_step, "questions": len(per_question),
            "solved": solved, "success": solved / len(per_question) if per_question else None,
            "per_question": per_question,
        })
    return evaluations


# ---------------------------------------------------------------------- resuming
def read_config(path: Path) -> dict[str, Any] | None:
    """A saved run config as a dict (None when the file is missing)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True) if path.exists() else None  # type: ignore[return-value]


def checkpoint_step(path: Path) -> int | None:
    """The ``global_step`` a Lightning checkpoint was saved at (None: missing or unreadable)."""
    import torch

    try:
        return int(torch.load(path, map_location="cpu", weights_only=False, mmap=True)["global_step"])
    except Exception as error:  # a checkpoint cut short by the interruption: start over, say so
        if path.exists():
            print(f"   cannot read {path} ({type(error).__name__}: {error}); starting the run over", flush=True)
        return None


#: ``<run>/checkpoints/<EVALUATED>.ckpt``: the state after the newest held-out evaluation (compare.run_config's
#: ``evaluated_checkpoint``), the checkpoint to resume from when ``last.ckpt`` precedes an unfinished evaluation.
EVALUATED = "evaluated"


def unfinished_evaluation(run_dir: Path, config: dict[str, Any], step: int) -> bool:
    """Whether the run evaluates after ``step`` (a multiple of ``trainer.val_check_interval``) and that evaluation
    wrote no ``generations/val_step_<step>.jsonl``: a ``last.ckpt`` saved at such a step precedes an evaluation
    the run was stopped in, and Lightning, resuming from it, skips that evaluation."""
    every = config.get("trainer", {}).get("val_check_interval")
    return (step > 0 and isinstance(every, int) and every > 0 and step % every == 0
            and not (Path(run_dir) / "generations" / f"val_step_{step}.jsonl").exists())


def resume_checkpoint(run_dir: Path, config: dict[str, Any], *, quiet: bool = False) -> tuple[Path, int] | None:
    """The checkpoint an interrupted run continues from and its step: ``last.ckpt``, unless it was saved before an
    evaluation that never finished (:func:`unfinished_evaluation`); then the one saved after the last finished
    evaluation (:data:`EVALUATED`), or None (start over: resuming would lose that held-out point)."""
    last = Path(run_dir) / "checkpoints" / "last.ckpt"
    step = checkpoint_step(last)
    if step is None or not unfinished_evaluation(run_dir, config, step):
        return None if step is None else (last, step)
    evaluated = Path(run_dir) / "checkpoints" / f"{EVALUATED}.ckpt"
    done = checkpoint_step(evaluated) if evaluated.exists() else None
    if not quiet:
        print(f"   {last} was saved at step {step}, before its held-out evaluation, which did not finish: "
              + (f"resuming from {evaluated} (step {done})" if done is not None else "starting over"), flush=True)
    return None if done is None else (evaluated, done)


def resume_step(run_dir: Path, config: dict[str, Any], src: dict[str, Any]) -> tuple[Path, int] | None:
    """The checkpoint and step an interrupted run of exactly this config continues from (:func:`resume_checkpoint`;
    None: start over).

    Raises:
        SystemExit: the interrupted run started on another ``src/`` tree (a run must not mix code).
    """
    last = run_dir / "checkpoints" / "last.ckpt"
    if not last.exists():
        return None
    if not same_config(read_config(run_dir / "run.yaml"), config):
        print(f"   {run_dir} holds a run of another config: starting over", flush=True)
        return None
    attempts = json.loads((run_dir / "attempts.json").read_text()) if (run_dir / "attempts.json").exists() else []
    if attempts and attempts[0]["src"]["src_hash"] != src["src_hash"]:
        raise SystemExit(f"error: the interrupted run in {run_dir} started on src {attempts[0]['src']['src_hash']}, this "
                         f"checkout's src is {src['src_hash']}: pass --rerun to start it again on this code")
    return resume_checkpoint(run_dir, config)


LOCK = ".compare.lock"


def hold_lock(folder: Path) -> int:
    """Lock ``<folder>/.compare.lock`` (``flock``, exclusive) for this process and the ``lopd`` commands it starts,
    which inherit the descriptor (compare.run_lopd): a fit whose compare.py was killed (a session's end; a kill by
    pid) still holds it, so a second compare.py on the same runs refuses instead of training beside it. Returns
    the descriptor (the lock is released when every process holding it has ended).

    Raises:
        SystemExit: another process holds it (one line, naming what the file says holds it).
    """
    import fcntl

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 500).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise SystemExit(f"error: {folder} is in use ({holder}): a compare.py, or a lopd command of one that was "
                         "stopped, still runs there; wait for it to end, or end that process") from None
    note_lock(fd, f"compare.py pid {os.getpid()}")
    return fd


def note_lock(fd: int, holder: str) -> None:
    """Write who holds the lock of :func:`hold_lock` (what a refused compare.py prints)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode(), 0)


def dry_run(specs: list[Any], configs: list[dict[str, Any]], root: Path, results: list[Path]) -> dict[str, Any]:
    """Print each run of a plan (``compare.RunSpec``, its config, its result file) and its state
    (``finished``, ``resumable at step k``, ``new``); run nothing. Returns ``{"plan": [one dict a run]}``."""
    rows = []
    for spec, config, result_path in zip(specs, configs, results):
        run_dir = Path(root) / spec.method / spec.name
        last = run_dir / "checkpoints" / "last.ckpt"
        if result_path.exists():
            same = same_config(json.loads(result_path.read_text()).get("config"), config)
            state = "finished" if same else "another config finished (--rerun replaces it)"
        elif last.exists() and same_config(read_config(run_dir / "run.yaml"), config):
            resume = resume_checkpoint(run_dir, config, quiet=True)
            state = "new (its last.ckpt cannot be resumed)" if resume is None else \
                f"resumable at step {resume[1]}"
        else:
            state = "new"
        rows.append({"method": spec.method, "run": spec.name, "budget": spec.budget,
                     "steps": config["trainer"]["max_steps"],
                     "learning_rate": config["model"]["init_args"].get("learning_rate"), "state": state})
        print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    return {"plan": rows}


# ---------------------------------------------------------------------- run files
def run_file(runs_dir: Path, method: str, seed: int) -> Path:
    """Where a finished run's result goes: ``<runs_dir>/<method>/seed_<seed>.json``."""
    return Path(runs_dir) / method / f"seed_{seed}.json"


def read_run_files(runs_dir: Path) -> list[dict[str, Any]]:
    """Every run file under ``runs_dir`` (``<method>/seed_<s>.json``), each with ``path`` added."""
    runs = []
    for path in sorted(Path(runs_dir).glob("*/seed_*.json")):
        run = json.loads(path.read_text(encoding="utf-8"))
        run["path"] = f"{path.parent.name}/{path.name}"
        runs.append(run)
    return runs


def _heldout_set(run: dict[str, Any]) -> str:
    """The held-out questions of a run's last evaluation, as a short fingerprint (``"none"`` without one)."""
    evaluations = run.get("evaluations") or []
    if not evaluations:
        return "none"
    ids = sorted(evaluations[-1]["per_question"])
    return f"{len(ids)} questions {hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:8]}"


def _provenance(key: str):
    """How to read ``provenance.<key>`` of a run file (None: the run has none, or predates provenance)."""
    return lambda r: (r.get("provenance") or {}).get(key)


def _student(run: dict[str, Any]) -> str | None:
    """The start student's weights hash, or for a student loaded by name (no folder to hash: ``tiny``, the
    packaged SmolLM2) ``"name <model>"``, so that it is not mixed with a folder's; None without provenance."""
    if not run.get("provenance"):
        return None
    return run["provenance"].get("student_hash") or f"name {run.get('model')}"


#: what must agree across aggregated runs: name, how to read it from a run, the flag that chooses one, and the
#: keyword of :func:`select_runs` that filters on it. A provenance value of None (GRPO reads no bank and no
#: composer; a run file written before provenance was recorded) takes no part in the check.
UNIFORM = (
    ("src trees", lambda r: r["src"]["src_hash"], "--src-tree HASH", "src_tree"),
    ("generation backends", lambda r: r["generation_backend"], "--backend NAME", "backend"),
    ("budgets (trajectories per run)", lambda r: str(r["budget_trajectories"]), "--budget N", "budget"),
    ("held-out sets", _heldout_set, None, None),
    ("start students (weights hash)", _student, "--student-hash HASH", "student_hash"),
    ("experience banks (bank hash)", _provenance("bank_hash"), "--bank-hash HASH", "bank_hash"),
    ("pretrained composers (composer hash)", _provenance("composer_hash"), "--composer-hash HASH", "composer_hash"),
    ("library versions", _provenance("versions_key"), "--versions KEY", "versions"),
)
PROVENANCE_FILTERS = ("student_hash", "bank_hash", "composer_hash", "versions")


#: ``--same-input`` kinds -> the provenance key they rename.
SAME_INPUT_KINDS = {"student": "student_hash", "bank": "bank_hash", "composer": "composer_hash"}
#: the other way round: a provenance key's ``--same-input`` KIND
SAME_INPUT_KIND_OF = {key: kind for kind, key in SAME_INPUT_KINDS.items()}


def _read_as(read, key: str | None, same_inputs: dict[str, dict[str, str]] | None):
    """``read``, with a rebuilt input's hash read as the one it was declared the same as (``same_inputs[key]``:
    ``{rebuilt: original}``); the run file itself keeps the hash it recorded."""
    renames = (same_inputs or {}).get(key or "") or {}
    if not renames:
        return read

    def read_as_declared(run: dict[str, Any]) -> Any:
        value = read(run)
        return renames.get(value, value)

    return read_as_declared


def _matches(run: dict[str, Any], name: str, wanted: Any, same_inputs: dict[str, dict[str, str]] | None = None) -> bool:
    """Whether ``run`` passes the filter ``name`` (a :data:`UNIFORM` keyword) set to ``wanted`` (None: no filter),
    a declared rebuilt input read as its original (:func:`_read_as`)."""
    if wanted is None:
        return True
    if name == "src_tree":
        return run["src"]["src_hash"].startswith(wanted) or (run["src"].get("src_tree") or "").startswith(wanted)
    if name == "backend":
        return run["generation_backend"] == wanted
    if name == "budget":
        return int(run["budget_trajectories"]) == int(wanted)
    value = _read_as(next(read for _, read, _, key in UNIFORM if key == name), name, same_inputs)(run)
    return value is None or str(value).startswith(str(wanted))  # a run without one is not filtered out


def composer_folder(run: dict[str, Any]) -> str | None:
    """The ``model.init_args.composer_path`` a run's config names (normalised), or None (no composer, or a run file
    without its config): the runs of one folder must have read one composer (:func:`select_runs`)."""
    init = ((run.get("config") or {}).get("model") or {}).get("init_args") or {}
    return os.path.normpath(str(init["composer_path"])) if init.get("composer_path") else None


#: checks of :data:`UNIFORM` made within groups of runs rather than over all of them: the provenance key, and how a
#: run's group is read (runs of different groups may differ in that key; None is one group of its own).
PER_GROUP = {"composer_hash": ("composer_path", composer_folder)}


#: the keys of the config values compare.run_config writes as paths (compare._path: relative inside the repository,
#: absolute outside it, so a checkout whose runs/ links elsewhere writes them absolute): the logger's folder, the
#: summary's file and the checkpoints' folder.
PATH_KEYS = ("save_dir", "json_path", "dirpath")


def _same_location(recorded: str, planned: str, root: Path) -> bool:
    """Whether two run-folder paths name one run folder: the same place once resolved against ``root``, or a
    relative ``planned`` path that ``recorded`` ends with (the same folder of the plan in the checkout the run
    was recorded in, e.g. ``/work/main/runs/experience/lopd`` for ``runs/experience/lopd`` in a clone elsewhere)."""
    if (Path(root) / recorded).resolve() == (Path(root) / planned).resolve():
        return True
    tail = Path(planned).parts
    return not Path(planned).is_absolute() and Path(recorded).parts[-len(tail):] == tail


def _same_paths(recorded: Any, config: Any, root: Path) -> bool:
    """``recorded == config`` with each :data:`PATH_KEYS` value compared by :func:`_same_location`."""
    if isinstance(recorded, dict) and isinstance(config, dict):
        return recorded.keys() == config.keys() and all(
            _same_location(recorded[k], v, root) if k in PATH_KEYS and isinstance(v, str)
            and isinstance(recorded[k], str) else _same_paths(recorded[k], v, root) for k, v in config.items())
    if isinstance(recorded, list) and isinstance(config, list):
        return len(recorded) == len(config) and all(_same_paths(r, c, root) for r, c in zip(recorded, config))
    return recorded == config


def same_config(recorded: dict[str, Any] | None, config: dict[str, Any], root: Path = REPO_ROOT) -> bool:
    """Whether a finished run's recorded config is ``config``, the run folders' paths compared as the folders of
    the plan they name (:func:`_same_location`): the experience plan's first 15 runs ran in a worktree whose
    ``runs/`` linked to another checkout's, so their files record ``/work/main/runs/experience/...`` where a run
    in any clone writes ``runs/experience/...``."""
    if recorded is None:
        return False
    return recorded == config or _same_paths(recorded, config, root)


def _run_name(run: dict[str, Any]) -> str:
    return run.get("path") or f"{run['method']}/seed_{run['seed']}"


def _versions_labels(groups: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """``"<key> (torch 2.13.0, transformers 5.24.0)"`` per versions group, naming only the libraries that differ."""
    versions = {key: runs[0]["provenance"]["versions"] or {} for key, runs in groups.items()}
    differ = sorted({lib for v in versions.values() for lib in v
                     if len({str(w.get(lib)) for w in versions.values()}) > 1})
    return {key: f"{key} ({', '.join(f'{lib} {v.get(lib)}' for lib in differ)})" for key, v in versions.items()}


def select_runs(runs: list[dict[str, Any]], *, src_tree: str | None = None, backend: str | None = None,
                budget: int | None = None, student_hash: str | None = None, bank_hash: str | None = None,
                composer_hash: str | None = None, versions: str | None = None,
                same_inputs: dict[str, dict[str, str]] | None = None) -> list[dict[str, Any]]:
    """The runs to aggregate: those of ``src_tree`` (a prefix of the run's ``src_hash`` or ``src_tree``),
    ``backend``, ``budget`` and the provenance prefixes (``student_hash``, ``bank_hash``, ``composer_hash``,
    ``versions``: a run's ``provenance.versions_key``; a run without the value passes) where given, checked
    to share one src tree, backend, budget, held-out set, start student, bank, composer and library versions
    (:data:`UNIFORM`; runs without a bank or composer are left out of those two checks; the composer is checked
    among the runs of each ``composer_path``, :data:`PER_GROUP`: runs of two composer folders read two composers by
    design, runs of one folder must have read one). ``same_inputs``
    (``{"student_hash": {rebuilt: original}, ...}``, compare.py's ``--same-input``): inputs rebuilt on another
    machine that the user declares the same as the plan's (their evidence in benchmarks/README.md) take part in
    the check, and in the filters, under the original's hash.

    Raises:
        MixedRuns: the selected runs differ in one of those (one line naming the values, the runs of each and
            the flag that picks one), or nothing is left after the filters.
    """
    filters = {"src_tree": src_tree, "backend": backend, "budget": budget, "student_hash": student_hash,
               "bank_hash": bank_hash, "composer_hash": composer_hash, "versions": versions}
    chosen = [r for r in runs if all(_matches(r, name, wanted, same_inputs) for name, wanted in filters.items())]
    if runs and not chosen:
        given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in filters.items() if v is not None)
        raise MixedRuns(f"no run file matches {given}; the run files "
                        f"have src trees {sorted({r['src']['src_hash'] for r in runs})}, backends "
                        f"{sorted({r['generation_backend'] for r in runs})}, budgets {sorted({r['budget_trajectories'] for r in runs})}")
    for what, read, flag, key in UNIFORM:
        value = _read_as(read, key, same_inputs)
        group_name, group_of = PER_GROUP.get(key or "", (None, lambda r: None))
        parts: dict[str | None, list[dict[str, Any]]] = {}
        for r in chosen:
            parts.setdefault(group_of(r), []).append(r)
        for part, members in sorted(parts.items(), key=lambda item: str(item[0])):
            groups: dict[str, list[dict[str, Any]]] = {}
            for r in members:
                if value(r) is not None:
                    groups.setdefault(value(r), []).append(r)
            if len(groups) > 1:
                labels = _versions_labels(groups) if what == "library versions" else {k: k for k in groups}
                listed = "; ".join(f"{labels[k]}: {', '.join(map(_run_name, v))}" for k, v in sorted(groups.items()))
                how = f"aggregate one with {flag}" if flag else "rerun the runs that differ"
                kind = SAME_INPUT_KIND_OF.get(key)
                if kind is not None:  # a rebuild of the same input on another machine (benchmarks/README.md)
                    how += f", or declare a rebuilt one the original with --same-input {kind}:REBUILT=ORIGINAL"
                among = f" among the runs of {group_name} {part}" if part is not None else ""
                raise MixedRuns(f"refusing to aggregate runs from {len(groups)} {what}{among} ({listed}); {how}")
    return chosen
