"""The plans of ``benchmarks/compare.py``: which runs, in which order, and each plan's defaults.

- ``grid``: ``--methods`` x ``--seeds``, seed-major (:func:`grid_plan`), 32 trajectories a run, on
  configs/compare.
- ``evidence`` (issue 17, BFCL live_simple): :func:`evidence_plan`, 192 trajectories a run, 3 held-out
  evaluations after the start, the start student of ``benchmarks/start_student.py``.
- ``experience`` (issue 33, hidden_rules): :func:`experience_plan`: LOPD, GRPO and OPSD at seed 0, then at
  seed 1, then at seed 2; then Skill-SD, lopd_frozen and lopd_m0 with two seeds each (the first 15 runs); then
  the two added later, seed by seed (lopd_paper 0, opsd_reference 0, lopd_paper 1, ...; 6 runs, so that the 15
  committed runs keep their places), from configs/experience, the in-context start student
  ``runs/hidden_rules/sft_student_in_context``; 280 trajectories a run and 10 held-out evaluations after the start, one every 10% of the budget
  (:func:`check_exact_evaluations`: 20% and 30% are measured points); run files in
  ``benchmarks/results/experience_runs``, results ``experience_compare.{json,png,md}`` with the task
  calibration's numbers (:func:`task_calibration`). Its learning-rate sweep covers LOPD, GRPO and OPSD;
  Skill-SD takes GRPO's rate (its module, ``SkillSDModule``, derives from ``GRPOModule``: GRPO plus a
  self-distillation term) and the LOPD ablations (lopd_frozen, lopd_m0) take LOPD's (:data:`EXPERIENCE_PARENTS`).
  The two added methods: ``lopd_paper`` (LOPD in its authors' setting: self-retrieval, K = 32, J = 3, its own
  pretrained composer at ``runs/experience/composer_paper``, a frozen bank) takes LOPD's rate, ``opsd_reference``
  (OPSD whose teacher reads the task's own reference solution as text, no bank: lopd_paper's fair twin) OPSD's.

Why 280 and not 256 trajectories: the issue asks for at least 256 and for held-out success at every 10% of
the budget; every method here takes 4 trajectories a step, and 10% of 256 is 25.6 trajectories, not a whole
number of steps. 280 = 70 steps of 4 is the smallest budget of at least 256 whose tenths are whole steps
(every 7 steps, 28 trajectories).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: every method with a config in configs/compare, in the order compare.json lists them.
ALL_METHODS = ("lopd", "grpo", "sdpo", "lopd_m0", "opsd", "skill_sd", "lopd_balanced", "lopd_m0_balanced")
#: seeds per method of the evidence plan (issue 17): LOPD and GRPO >= 3, SDPO and lopd_m0 >= 2, the rest >= 1;
#: last, the margin ablation again with the balanced weighting of Delta (lopd_balanced, lopd_m0_balanced).
EVIDENCE_SEEDS = {"lopd": 3, "grpo": 3, "sdpo": 2, "lopd_m0": 2, "opsd": 1, "skill_sd": 1, "lopd_balanced": 2,
                  "lopd_m0_balanced": 2}
EVIDENCE_BUDGET = 192
EVIDENCE_STUDENT = "runs/evidence/sft_student"  # benchmarks/start_student.py's output

#: the experience plan's methods in order (issue 33): the three-seed methods first, then the rest; last, the two
#: added after the first 15 runs were committed (:data:`EXPERIENCE_TAIL`), so that those keep their places.
EXPERIENCE_METHODS = ("lopd", "grpo", "opsd", "skill_sd", "lopd_frozen", "lopd_m0", "lopd_paper", "opsd_reference")
EXPERIENCE_SEEDS = {"lopd": 3, "grpo": 3, "opsd": 3, "skill_sd": 2, "lopd_frozen": 2, "lopd_m0": 2, "lopd_paper": 3,
                    "opsd_reference": 3}
#: run seed by seed after the rest (lopd_paper 0, opsd_reference 0, lopd_paper 1, ...): the fair twins, LOPD in its
#: authors' setting and OPSD on the task's own reference, so that a plan stopped part-way has pairs of them.
EXPERIENCE_TAIL = ("lopd_paper", "opsd_reference")
EXPERIENCE_BUDGET = 280
EXPERIENCE_EVALUATIONS = 10
EXPERIENCE_STUDENT = "runs/hidden_rules/sft_student_in_context"
#: whose swept learning rate each method takes: Skill-SD GRPO's (SkillSDModule derives from GRPOModule), the
#: LOPD ablations and lopd_paper LOPD's, opsd_reference OPSD's; LOPD, GRPO and OPSD are swept themselves.
EXPERIENCE_PARENTS = {"lopd": "lopd", "grpo": "grpo", "opsd": "opsd", "skill_sd": "grpo", "lopd_frozen": "lopd",
                      "lopd_m0": "lopd", "lopd_paper": "lopd", "opsd_reference": "opsd"}
#: issue 33's questions beyond GRPO: LOPD against OPSD with the same experience as text, the learned composer
#: against the frozen one, the margin against m = 0, and against Skill-SD; then the added methods: LOPD in its
#: authors' setting against its fair twin (OPSD on the task's own reference), against the cross-task OPSD and
#: against the project's LOPD, and the two OPSDs against each other (each method's "against GRPO" is
#: ``paired_vs_grpo``, for every method)
EXPERIENCE_CONTRASTS = (("lopd", "opsd"), ("lopd", "lopd_frozen"), ("lopd", "lopd_m0"), ("lopd", "skill_sd"),
                        ("lopd_paper", "opsd_reference"), ("lopd_paper", "opsd"), ("opsd_reference", "opsd"),
                        ("lopd_paper", "lopd"))
EXPERIENCE_OTHERS = ("lopd_frozen and lopd_m0 take LOPD's rate (an ablation of LOPD changes one thing); Skill-SD "
                     "takes GRPO's (SkillSDModule derives from GRPOModule: GRPO plus a self-distillation term); "
                     "lopd_paper (LOPD in its authors' setting) takes LOPD's and opsd_reference (OPSD on the task's "
                     "own reference) OPSD's")
#: the task calibration of issue 33, item 1 (benchmarks/task_calibration.py on the in-context start student, at the
#: runs' 96 new tokens).
CALIBRATION = "benchmarks/results/task_calibration_hidden_rules_in_context_96.json"
CALIBRATION_KEYS = ("n_heldout", "student_success", "student_solved", "text_nearest_success", "text_nearest_solved",
                    "difference", "difference_ci", "same_tool_rate", "same_tool_count")


@dataclass(frozen=True)
class Plan:
    """A plan's defaults (each a command-line flag overrides): folders relative to the repository root."""

    name: str
    config_dir: str = "configs/compare"
    root: str = "runs/compare"
    budget: int = 32
    evaluations: int = 3
    student: str | None = None
    results: str = "compare"  # <out-dir>/<results>.{json,png,md}
    runs_dir: str = "compare_runs"  # <out-dir>/<runs_dir>/<method>/seed_<s>.json
    sweep_file: str = "compare_lr_sweep.json"
    sweep_methods: tuple[str, ...] = ("lopd", "grpo")
    parents: dict[str, str] | None = None  # None: compare_sweep.learning_rates_for's evidence rule
    others: str | None = None  # the sweep file's "others" line (None: compare_sweep.OTHERS)
    seeds: dict[str, int] | None = None  # None: --methods x --seeds
    head: tuple[str, ...] = ()
    order: tuple[str, ...] = ALL_METHODS
    tail: tuple[str, ...] = ()  # run seed-major after the rest of ``order`` (seeded_plan)
    exact_evaluations: bool = False  # the evaluations must fall at exactly k / evaluations of the budget
    calibration: str | None = None
    #: a second checkpoint after every held-out evaluation, so that a run stopped during one resumes before it
    #: (compare.run_config); off for the grid and evidence plans, whose finished run files hold configs without it
    evaluated_checkpoint: bool = False
    student_hint: str = "python benchmarks/start_student.py"
    #: ``(method, reference)`` pairs compared beyond "each method against GRPO" (compare_stats.contrast)
    contrasts: tuple[tuple[str, str], ...] = ()


PLANS = {
    "grid": Plan("grid"),
    "evidence": Plan("evidence", budget=EVIDENCE_BUDGET, student=EVIDENCE_STUDENT, seeds=EVIDENCE_SEEDS,
                     head=("lopd", "grpo")),
    "experience": Plan(
        "experience", config_dir="configs/experience", root="runs/experience", budget=EXPERIENCE_BUDGET,
        evaluations=EXPERIENCE_EVALUATIONS, student=EXPERIENCE_STUDENT, results="experience_compare",
        runs_dir="experience_runs", sweep_file="experience_lr_sweep.json", sweep_methods=("lopd", "grpo", "opsd"),
        parents=EXPERIENCE_PARENTS, others=EXPERIENCE_OTHERS, seeds=EXPERIENCE_SEEDS, head=("lopd", "grpo", "opsd"),
        order=EXPERIENCE_METHODS, tail=EXPERIENCE_TAIL, exact_evaluations=True, calibration=CALIBRATION,
        evaluated_checkpoint=True,
        contrasts=EXPERIENCE_CONTRASTS,
        student_hint="python benchmarks/start_student.py --task hidden_rules --task-options "
                     "'{\"references\": \"format_only\"}' --in-context-fraction 0.5 --steps 36 --out "
                     f"{EXPERIENCE_STUDENT}"),
}


# ---------------------------------------------------------------------- the runs of a plan
def _seed_major(seeds: dict[str, int], methods: tuple[str, ...]) -> list[tuple[str, int]]:
    """``methods`` all at seed 0, then at seed 1, ... (each up to its own count of ``seeds``)."""
    return [(m, s) for s in range(max((seeds.get(m, 0) for m in methods), default=0)) for m in methods
            if s < seeds.get(m, 0)]


def seeded_plan(seeds: dict[str, int], head: tuple[str, ...], order: tuple[str, ...],
                tail: tuple[str, ...] = ()) -> list[tuple[str, int]]:
    """``(method, seed)``: the ``head`` methods seed-major (all at seed 0, then at seed 1, ...), then every other
    method of ``order`` with its seeds, so that a plan stopped part-way has answered the main question first; then
    the ``tail`` methods seed-major (methods added to a plan after its first runs: those keep their places)."""
    middle = [(m, s) for m in order if m not in head and m not in tail for s in range(seeds.get(m, 0))]
    return _seed_major(seeds, head) + middle + _seed_major(seeds, tail)


def evidence_plan(seeds: dict[str, int] | None = None) -> list[tuple[str, int]]:
    """``(method, seed)`` in the evidence order of issue 17: LOPD and GRPO seed 0, then their further
    seeds (LOPD 1, GRPO 1, LOPD 2, ...), then SDPO, lopd_m0, OPSD and Skill-SD with their seeds, then the
    margin ablation with the balanced weighting (lopd_balanced, lopd_m0_balanced), so that a plan stopped
    part-way has already answered the main question (LOPD against GRPO)."""
    return seeded_plan(dict(EVIDENCE_SEEDS if seeds is None else seeds), ("lopd", "grpo"), ALL_METHODS)


def experience_plan(seeds: dict[str, int] | None = None) -> list[tuple[str, int]]:
    """``(method, seed)`` in the order of issue 33: LOPD, GRPO and OPSD at seed 0, 1 and 2 (seed-major), then
    Skill-SD, lopd_frozen and lopd_m0 at seeds 0 and 1 (the first 15 runs), then lopd_paper and opsd_reference at
    seeds 0, 1 and 2 (seed-major): 21 runs."""
    plan = PLANS["experience"]
    return seeded_plan(dict(EXPERIENCE_SEEDS if seeds is None else seeds), plan.head, plan.order, plan.tail)


def grid_plan(methods: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """``(method, seed)`` seed-major: a stopped grid still has every method at the first seed."""
    return [(m, s) for s in seeds for m in methods]


def plan_runs(plan: Plan, *, methods: list[str], seeds: list[int], seed_cap: int | None = None,
              only: list[tuple[str, int]] | None = None) -> list[tuple[str, int]]:
    """The ``(method, seed)`` runs of ``plan``: a fixed plan's (at most ``seed_cap`` seeds a method when given:
    smoke tests, a first pass), or the grid of ``methods`` x ``seeds``; with ``only``, just those of them, in
    the plan's order (a run that the rest of the plan waits on can go first).

    Raises:
        ValueError: a pair of ``only`` that is not one of the plan's runs (the message lists them).
    """
    if plan.seeds is None:
        runs = grid_plan(methods, seeds)
    else:
        counts = {m: min(n, seed_cap) if seed_cap is not None else n for m, n in plan.seeds.items()}
        runs = seeded_plan(counts, plan.head, plan.order, plan.tail)
    if only is None:
        return runs
    if unknown := [f"{m}:{s}" for m, s in only if (m, s) not in runs]:
        capped = seed_cap is not None and plan.seeds is not None and all(
            (m, s) in seeded_plan(dict(plan.seeds), plan.head, plan.order, plan.tail) for m, s in only
            if (m, s) not in runs)
        raise ValueError(f"--only {' '.join(unknown)}: not a run of the {plan.name} plan"
                         + (f" with --seed-cap {seed_cap}" if capped else "")
                         + f"; its runs are {' '.join(f'{m}:{s}' for m, s in runs)}")
    return [run for run in runs if run in only]


def check_exact_evaluations(method: str, budget: int, per_step: int, evaluations: int) -> None:
    """Refuse a budget whose ``evaluations`` held-out evaluations cannot fall at exactly every
    ``1 / evaluations`` of it (the experience plan: at 10%, 20%, ... of the budget).

    Raises:
        ValueError: ``budget`` is not a whole number of steps of ``per_step`` trajectories, or its steps are not
            a multiple of ``evaluations``; the message names the smallest budget >= ``budget`` that works.
    """
    steps, unit = budget // per_step, per_step * evaluations
    if budget % per_step == 0 and steps % evaluations == 0:
        return
    fits = -(-budget // unit) * unit
    raise ValueError(f"--budget {budget}: {method} takes {per_step} trajectories a step, so {evaluations} held-out "
                     f"evaluations at every {100 // evaluations}% of the budget need a multiple of {unit} trajectories; "
                     f"the smallest budget >= {budget} that works is {fits} (or change --evaluations)")


# ---------------------------------------------------------------------- the task calibration (issue 33, item 1)
def task_calibration(path: Path, model: str | None = None) -> dict[str, Any]:
    """``{"task_calibration": ..., "task_calibration_reason": ...}`` for the results document: the item-1 numbers
    of ``benchmarks/task_calibration.py``'s JSON at ``path``, or None with the reason (no file, or a key missing).

    The numbers: the start student's greedy held-out success alone (``student_success``, ``student_solved``),
    with the retrieved trajectory as text (``text_nearest_success``, ``text_nearest_solved``), their paired
    difference with its question-bootstrap interval (``difference``, ``difference_ci``), and how often the
    retrieved trajectory is of the same tool (``same_tool_rate``, ``same_tool_count``); besides ``n_heldout``,
    ``met`` (the issue's targets), ``student``, ``same_student_as_runs`` (the calibration's student is ``model``,
    the runs' start student; None when ``model`` is not given), ``max_new_tokens`` and ``source``.
    """
    path = Path(path)
    if not path.exists():
        return {"task_calibration": None,
                "task_calibration_reason": f"no task calibration at {path}: run benchmarks/task_calibration.py first"}
    data = json.loads(path.read_text(encoding="utf-8"))
    missing = [k for k in CALIBRATION_KEYS if k not in data]
    if missing:
        return {"task_calibration": None, "task_calibration_reason": f"{path} lacks {', '.join(missing)}"}
    numbers = {k: data[k] for k in CALIBRATION_KEYS}
    student = data.get("student")
    numbers.update(met=data.get("met"), student=student,
                   same_student_as_runs=None if model is None else str(student) == str(model),
                   max_new_tokens=(data.get("settings") or {}).get("max_new_tokens"), source=str(path.name))
    return {"task_calibration": numbers, "task_calibration_reason": None}
