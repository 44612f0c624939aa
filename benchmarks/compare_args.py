"""The command line of ``benchmarks/compare.py``: its flags, each plan's defaults, and the start student."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import REPO_ROOT
from compare_plans import EVIDENCE_BUDGET, EVIDENCE_STUDENT, PLANS, Plan
from compare_runs import SAME_INPUT_KINDS
from compare_sweep import DEV_QUESTIONS, SWEEP_BUDGET


def positive(text: str) -> int:
    """An argparse type: a whole number >= 1 (a budget, a count of evaluations or resamples, a step interval)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def parse_args(argv: list[str] | None, *, description: str, methods: tuple[str, ...], results: Path) -> argparse.Namespace:
    """compare.py's arguments, with the plan's defaults filled in (compare_plans.PLANS) and the folders made
    absolute (the runs start from the repository root). ``methods``: the grid's default methods; ``results``:
    the default ``--out-dir``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--plan", choices=tuple(PLANS), default="grid", help="grid: --methods x --seeds; evidence: issue 17's "
                   "runs in order (see evidence_plan); experience: issue 33's (see experience_plan)")
    p.add_argument("--methods", nargs="+", default=None, help=f"grid methods (default: {' '.join(methods)}); a fixed plan's "
                   "runs are its own (pick some with --only)")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="grid seeds (default: 0 1); with --sweep-lr, the "
                   "sweep's one seed (default 0), the only use a fixed plan has for it")
    p.add_argument("--seed-cap", type=positive, default=None, help="at most N seeds a method of a fixed plan (smoke tests)")
    p.add_argument("--only", nargs="+", type=method_seed, default=None, metavar="METHOD:SEED",
                   help="run only these runs of the plan, in its order (e.g. grpo:1 opsd:1 while another run's input, "
                        "such as a composer, is still missing); each must be one of the plan's runs")
    p.add_argument("--budget", type=positive, default=None, help="trajectories per run (default: the plan's: 32 for a grid, "
                   f"{EVIDENCE_BUDGET} evidence, {PLANS['experience'].budget} experience)")
    p.add_argument("--config-dir", type=Path, default=None, help="default: the plan's (configs/compare, configs/experience)")
    p.add_argument("--root", type=Path, default=None, help="TensorBoard root and run folders (default: runs/compare; "
                   "experience: runs/experience)")
    p.add_argument("--student", default=None, help=f"the start student (default: the configs'; evidence: {EVIDENCE_STUDENT}; "
                   f"experience: {PLANS['experience'].student})")
    p.add_argument("--generation-backend", choices=("hf", "vllm"), default=None,
                   help="model.init_args.generation_backend of every run (default: the configs')")
    p.add_argument("--lopd", default=None, help="the lopd executable the runs use (e.g. .venv-vllm/bin/lopd for vllm)")
    p.add_argument("--out-dir", type=Path, default=results, help="where the results and the sweep go")
    p.add_argument("--runs-dir", type=Path, default=None, help="the run files (default: <out-dir>/compare_runs; "
                   "experience: <out-dir>/experience_runs)")
    p.add_argument("--evaluations", type=positive, default=None, help="held-out evaluations after the start, the last at the "
                   f"end (default 3; experience: {PLANS['experience'].evaluations}, one every 10%% of the budget)")
    p.add_argument("--checkpoint-every", type=positive, default=4, help="steps between saves of last.ckpt")
    p.add_argument("--lr-file", default=None, help="the sweep's choices (evidence / experience default: "
                   "<out-dir>/compare_lr_sweep.json / experience_lr_sweep.json; 'none': the configs' rates)")
    p.add_argument("--sweep-lr", default=None, help="run the learning-rate sweep at these rates (e.g. 1e-5,3e-5,1e-4) and stop")
    p.add_argument("--sweep-budget", type=positive, default=SWEEP_BUDGET, help="trajectories per sweep run")
    p.add_argument("--dev-questions", type=positive, default=DEV_QUESTIONS, help="the sweep's dev slice of the train split")
    p.add_argument("--dev-seed", type=int, default=0, help="seed of the dev slice (0: start_student.py's)")
    p.add_argument("--aggregate-only", action="store_true", help="only aggregate the run files there are")
    p.add_argument("--src-tree", default=None, help="aggregate only runs of this src hash (or tree hash) prefix")
    p.add_argument("--backend", default=None, help="aggregate only runs of this generation backend")
    for flag, what in (("student-hash", "start student weights"), ("bank-hash", "bank"), ("composer-hash", "composer"),
                       ("versions", "library versions (provenance.versions_key)")):
        p.add_argument(f"--{flag}", default=None, help=f"aggregate only runs of this {what} hash prefix")
    p.add_argument("--same-input", action="append", default=[], metavar="KIND:REBUILT=ORIGINAL",
                   help="aggregate runs on a rebuilt student, bank or composer (KIND) as if on the original's hash "
                        "(repeatable; the declaration is recorded in the results, its evidence belongs in "
                        "benchmarks/README.md)")
    p.add_argument("--calibration", type=Path, default=None, help="the task calibration JSON (experience default: "
                   f"{PLANS['experience'].calibration})")
    p.add_argument("--smooth", type=positive, default=None, help="trailing-mean window (steps) of the final reward "
                   "(default: a quarter of a run's steps, at least 3; the sweep: 3)")
    p.add_argument("--bootstrap", type=positive, default=10_000, help="bootstrap resamples")
    p.add_argument("--threads", type=positive, default=None, help="OMP_NUM_THREADS of each run")
    p.add_argument("--rerun", action="store_true", help="run again even when a finished or interrupted run exists")
    p.add_argument("--reuse", action="store_true", help="(the default now: finished runs are read back)")
    p.add_argument("--dry-run", action="store_true", help="print the runs of the plan and their state; run nothing")
    p.add_argument("--in-process", action="store_true", help="run fits in this process (tests; shared peak RSS)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    plan = PLANS[args.plan]
    if message := ignored_flag(args, plan):
        p.error(message)
    args.methods = list(methods) if args.methods is None else args.methods
    args.seeds = [0, 1] if args.seeds is None else args.seeds
    args.config_dir = args.config_dir or REPO_ROOT / plan.config_dir
    args.root = args.root or REPO_ROOT / plan.root
    args.evaluations = args.evaluations or plan.evaluations
    for name in ("config_dir", "root", "out_dir"):  # absolute: runs start from the repository root
        setattr(args, name, getattr(args, name).resolve())
    args.runs_dir = (args.runs_dir or args.out_dir / plan.runs_dir).resolve()
    if args.lr_file is None and plan.seeds is not None:
        args.lr_file = args.out_dir / plan.sweep_file
    args.lr_file = None if str(args.lr_file).lower() == "none" else args.lr_file and Path(args.lr_file).resolve()
    args.same_inputs = same_inputs(args.same_input)
    return args


def ignored_flag(args: argparse.Namespace, plan: Plan) -> str | None:
    """The refusal of a run-picking flag that this command would ignore without a word (None: none given).

    ``--only`` picks a plan's runs to run, ``--methods`` / ``--seeds`` a grid's, ``--seed-cap`` caps a fixed plan's
    seeds; the sweep runs the plan's swept methods at one seed; the aggregation reads every run file (its filters
    are the hash flags).
    """
    if args.only is not None and (args.sweep_lr or args.aggregate_only):
        return (f"--only picks runs of a plan to run; {'--sweep-lr' if args.sweep_lr else '--aggregate-only'} runs "
                "none of them: drop --only")
    given = [flag for flag, value in (("--methods", args.methods), ("--seeds", args.seeds),
                                      ("--seed-cap", args.seed_cap)) if value is not None]
    if not given:
        return None
    if args.aggregate_only:
        return (f"{given[0]} picks runs to run; --aggregate-only reads every run file in --runs-dir: drop {given[0]} "
                "(--src-tree, --student-hash, --bank-hash, --composer-hash and --versions choose which)")
    if args.sweep_lr:
        if args.methods is not None:
            return (f"--methods: the sweep runs the {plan.name} plan's swept methods "
                    f"({' '.join(plan.sweep_methods)}): drop --methods")
        if args.seed_cap is not None:
            return "--seed-cap caps a plan's seeds; the sweep runs one seed (--seeds N): drop --seed-cap"
        if len(args.seeds) > 1:
            return f"--seeds {' '.join(map(str, args.seeds))}: the sweep runs one seed: give one"
        return None
    if plan.seeds is None and args.seed_cap is not None:
        return "--seed-cap caps a fixed plan's seeds (--plan evidence, experience); a grid runs --seeds: drop --seed-cap"
    if plan.seeds is not None and (args.methods is not None or args.seeds is not None):
        flag = "--methods" if args.methods is not None else "--seeds"
        return (f"{flag} picks a grid's runs; the {plan.name} plan's runs are fixed: pick some of them with --only "
                "METHOD:SEED, or at most N seeds a method with --seed-cap N")
    return None


def method_seed(text: str) -> tuple[str, int]:
    """``--only``'s ``METHOD:SEED`` as ``(method, seed)``.

    Raises:
        argparse.ArgumentTypeError: not of that form (one line, with an example).
    """
    method, _, seed = text.partition(":")
    try:
        number = int(seed) if seed.isascii() else -1
    except ValueError:
        number = -1
    if not method or number < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not METHOD:SEED with a seed >= 0 (e.g. grpo:1)")
    return method, number


def same_inputs(declared: list[str]) -> dict[str, dict[str, str]]:
    """``--same-input KIND:REBUILT=ORIGINAL`` values as ``{provenance key: {rebuilt hash: original hash}}``
    (compare_runs.select_runs's ``same_inputs``).

    Raises:
        SystemExit: a value not of that form, an unknown KIND, or one rebuilt hash declared the same as two.
    """
    renames: dict[str, dict[str, str]] = {}
    for value in declared:
        kind, _, pair = value.partition(":")
        rebuilt, _, original = pair.partition("=")
        if kind not in SAME_INPUT_KINDS or not rebuilt or not original or rebuilt == original:
            raise SystemExit(f"error: --same-input {value}: give KIND:REBUILT=ORIGINAL with KIND one of "
                             f"{', '.join(SAME_INPUT_KINDS)} and two different hashes (e.g. "
                             "student:66976bd00baa61a7=3761f00976a961fa)")
        known = renames.setdefault(SAME_INPUT_KINDS[kind], {})
        if known.get(rebuilt, original) != original:
            raise SystemExit(f"error: --same-input: {kind} {rebuilt} is declared the same as both {known[rebuilt]} "
                             f"and {original}; keep one")
        known[rebuilt] = original
    return renames


#: the students ``lopd`` loads by name rather than from a folder (lopd_lightning.models.load_student).
NAMED_STUDENTS = ("tiny", "smollm2-135m-instruct")


def start_student(args: argparse.Namespace) -> str | None:
    """``--student`` (a folder, read from the repository root as the runs read it, or a named student), or the
    fixed plan's start student (which must exist). Refused in one line, before any run starts, when it is not
    there (outside ``--dry-run``)."""
    plan = PLANS[args.plan]
    if args.student is not None:
        if args.student not in NAMED_STUDENTS and not args.dry_run and not (REPO_ROOT / args.student).is_dir():
            raise SystemExit(f"error: --student {args.student}: no such folder (the runs read it from {REPO_ROOT}); "
                             f"give a model folder or one of {', '.join(NAMED_STUDENTS)}")
        return args.student
    if plan.student is None:
        return args.student
    if not (REPO_ROOT / plan.student).exists() and not args.dry_run:
        raise SystemExit(f"error: the {plan.name} plan starts from {plan.student}, which does not exist: run "
                         f"`{plan.student_hint}` first (or pass --student)")
    return plan.student
