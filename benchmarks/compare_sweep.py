"""The learning-rate sweep of ``benchmarks/compare.py --sweep-lr`` (issue 17): which rates, how one is chosen.

LOPD and GRPO each train at every rate of ``--sweep-lr`` (default budget 64 trajectories, one seed) from
the comparison's start student. Every run validates greedily on a **dev slice of the train split**
(``data.init_args.dev_slice``: the 32 train questions ``benchmarks/start_student.py`` set aside, drawn
with the same seed), which training never sees (LOPD's bank is built without them too); the held-out
questions play no part. The rule (:func:`choose_learning_rate`): the highest dev success after the last
step; ties go to the higher final training reward (trailing mean), then to the smaller rate. LOPD's
choice sets the student rate of LOPD and of its ablations (lopd_m0, lopd_balanced, lopd_m0_balanced: an
ablation changes one thing); GRPO's choice sets every other method's that the sweep did not itself sweep
(:func:`learning_rates_for`). The result is ``compare_lr_sweep.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from compare_stats import smooth

SWEEP_METHODS = ("lopd", "grpo")
SWEEP_BUDGET = 64
DEV_QUESTIONS = 32  # benchmarks/start_student.py --dev
RULE = ("highest greedy dev success after the last step (dev slice of the train split, never the held-out "
        "questions); ties: higher final training reward (trailing mean), then the smaller learning rate")
OTHERS = ("lopd_m0, lopd_balanced and lopd_m0_balanced take LOPD's rate (an ablation of LOPD changes one thing); "
          "SDPO, OPSD and Skill-SD take GRPO's rate for the student")


def parse_rates(text: str) -> list[float]:
    """``"1e-5,3e-5,1e-4"`` -> the rates, in the given order.

    Raises:
        ValueError: a value is not a positive number, or a rate is repeated.
    """
    try:
        rates = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        rates = []
    if not rates or any(not 0 < r < math.inf for r in rates) or len(set(rates)) != len(rates):
        raise ValueError(f"--sweep-lr takes distinct positive learning rates separated by commas, got {text!r}")
    return rates


def rate_folder(rate: float) -> str:
    """The run folder of a rate: ``lr_1e-05``."""
    return f"lr_{rate:g}"


def choose_learning_rate(candidates: dict[float, dict[str, Any]]) -> float:
    """The rate :data:`RULE` chooses.

    Args:
        candidates: rate -> ``{"dev_success": fraction, "train_reward": final smoothed reward or None}``.

    Raises:
        ValueError: no candidate.
    """
    if not candidates:
        raise ValueError("choose_learning_rate needs at least one candidate")

    def key(rate: float) -> tuple[float, float, float]:
        c = candidates[rate]
        reward = c.get("train_reward")
        return float(c["dev_success"]), -math.inf if reward is None else float(reward), -rate

    return max(candidates, key=key)


def sweep_entry(result: dict[str, Any], smooth_window: int) -> dict[str, Any]:
    """One rate's line in the sweep JSON, from a finished run's result (compare.finished_result)."""
    last = result["evaluations"][-1]
    rewards = [y for _, y in result["curve"]]
    return {
        "dev_success": last["success"],
        "dev_solved": last["solved"],
        "dev_questions": last["questions"],
        "dev_per_question": last["per_question"],
        "train_reward": smooth(rewards, smooth_window)[-1] if rewards else None,
        "wall_s": result["wall_s"],
    }


def sweep_document(results: dict[str, dict[float, dict[str, Any]]], *, smooth_window: int, others: str = OTHERS,
                   benchmark: str = "compare_lr_sweep", **settings: Any) -> dict[str, Any]:
    """The ``compare_lr_sweep.json`` document (``benchmark`` names it: ``experience_lr_sweep`` for the
    experience plan): per method the runs by rate, the start's dev success and the chosen rate; ``chosen``
    (method -> rate), the rule, ``others`` (which rate the methods not swept take), and ``settings``
    (budget, seed, dev slice...)."""
    methods: dict[str, Any] = {}
    for method, by_rate in results.items():
        runs = {rate: sweep_entry(result, smooth_window) for rate, result in by_rate.items()}
        starts = [r["evaluations"][0]["success"] for r in by_rate.values() if r["evaluations"][0]["step"] == 0]
        methods[method] = {
            "dev_start_success": starts[0] if starts else None,
            "runs": {f"{rate:g}": entry for rate, entry in runs.items()},
            "chosen": choose_learning_rate(runs),
        }
    return {"benchmark": benchmark, **settings, "rule": RULE, "others": others, "methods": methods,
            "chosen": {m: v["chosen"] for m, v in methods.items()}}


def learning_rates_for(path: Path, methods: list[str], parents: dict[str, str] | None = None,
                       plan: str = "evidence") -> dict[str, float]:
    """The student learning rate of each method from a sweep file: the rate chosen for its parent in
    ``parents`` (method -> swept method); else the rate the sweep chose for the method itself; else (the
    evidence plan's convention) LOPD's choice for its ablations (every method named ``lopd*``) and GRPO's for
    every other method. So a grid run of OPSD on the experience sweep takes OPSD's swept rate, not GRPO's.

    Raises:
        FileNotFoundError: no sweep file (the message gives the command that makes it, for ``plan``).
        KeyError: the file chose no rate for the parent a method needs.
    """
    if not Path(path).exists():
        raise FileNotFoundError(f"no learning-rate sweep at {path}: run `python benchmarks/compare.py --plan {plan} "
                                "--sweep-lr 3e-5,1e-4,3e-4` first (or pass --lr-file none to keep the configs' rates)")
    chosen = json.loads(Path(path).read_text())["chosen"]
    rates = {}
    for method in methods:
        # a swept method takes its own rate; lopd_m0 and the balanced ablations LOPD's; the rest GRPO's (evidence)
        source = (parents or {}).get(method) or (method if method in chosen else
                                                 "lopd" if method.startswith("lopd") else "grpo")
        if source not in chosen:
            raise KeyError(f"{path} chose no learning rate for {source} (needed by {method})")
        rates[method] = float(chosen[source])
    return rates
