"""The statistics of ``benchmarks/compare.py``: curves over seeds, intervals, paired differences, compare.json.

- :func:`t_interval`: the 95% interval of a mean over seeds (Student's t; a bootstrap over 2-3 seeds has
  too few distinct resamples to mean anything).
- :func:`bootstrap_ci`: a percentile bootstrap interval of a mean (used over questions).
- :func:`paired_differences`: per-question held-out success of a method minus a reference's (GRPO's, or
  the method's own start) on the same questions, with a paired bootstrap over questions.
- :func:`two_level_paired`: the same per-question comparison with a two-level bootstrap (questions, and
  within each resample the seeds of each method independently), so that seed-to-seed variation is counted.
- :func:`budget_fraction` / :func:`budget_fraction_ci`: the trajectories LOPD needs to reach GRPO's final
  training reward, as a fraction of GRPO's budget, with a bootstrap over seeds;
  :func:`heldout_efficiency`: the same on the held-out success curve at the evaluation points.
- :func:`welch_interval` / :func:`contrast`: one method against another that is not GRPO (LOPD against OPSD,
  against its frozen-composer ablation): final training reward over seeds, final held-out success per question
  with the two-level bootstrap.
- :func:`summarise`: the ``compare.json`` document.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

#: 0.975 quantiles of Student's t by degrees of freedom (two-sided 95%); 1.96 beyond 30.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042}
VAL_AFTER_CI = "Student's t over seeds (mean +- t(0.975, n-1) x sd / sqrt(n)), clipped to [0, 1]; null for one seed"
PAIRED_CI = ("paired bootstrap over questions: per question, the method's final held-out success (mean over its "
             "seeds) minus GRPO's; questions resampled with replacement; 95% percentile interval")
PAIRED_START_CI = ("paired bootstrap over questions: per question, the method's final held-out success minus its "
                   "step-0 success (each a mean over its seeds); questions resampled with replacement; 95% "
                   "percentile interval (seed-to-seed variation not included)")
PAIRED_TWO_LEVEL_CI = ("two-level paired bootstrap: in each resample the questions are drawn with replacement and, "
                       "independently, each method's seeds are drawn with replacement (once per resample, a seed's "
                       "whole run); per question, the mean over the drawn seeds of the method's final held-out "
                       "success minus GRPO's, averaged over the drawn questions; 95% percentile interval")
CONTRAST_REWARD_CI = ("Welch's t over seeds: the difference of the two methods' mean final training rewards (each seed's "
                      "trailing mean) +- t(0.975, Welch-Satterthwaite df, not rounded) x "
                      "sqrt(var_a/n_a + var_b/n_b); null with fewer than two seeds a side")
#: evaluations in the trailing mean of the held-out budget fraction, LOPD's and GRPO's alike (heldout_efficiency).
HELDOUT_WINDOW = 2
TARGET_HELDOUT = f"mean of {HELDOUT_WINDOW} consecutive evaluations"
HELDOUT_FRACTION_CI = ("bootstrap over seeds: LOPD's and GRPO's seeds resampled with replacement, the held-out fraction "
                       "recomputed on the resampled seed means of the held-out success curve; 95% percentile "
                       "interval (a resample where LOPD never reaches the target counts as infinite)")
FRACTION_CI = ("bootstrap over seeds: LOPD's and GRPO's seeds resampled with replacement, the fraction recomputed "
               "on the resampled seed means; 95% percentile interval (a resample where LOPD never reaches the "
               "target counts as infinite)")


# ---------------------------------------------------------------------- intervals
def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def t_interval(values: list[float], *, lower: float = 0.0, upper: float = 1.0) -> tuple[float, float] | None:
    """The 95% Student's t interval of the mean of ``values``, clipped to ``[lower, upper]``.

    Returns None for fewer than two values (no spread to estimate).
    """
    n = len(values)
    if n < 2:
        return None
    mean, sd = mean_std(values)
    half = T_975.get(n - 1, 1.96) * sd / math.sqrt(n)
    return max(lower, mean - half), min(upper, mean + half)


def bootstrap_ci(values: list[float], *, n_boot: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of the mean of ``values`` (resampled with replacement).

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("bootstrap_ci needs at least one value")
    data = np.asarray(values, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(data), size=(n_boot, len(data)))
    means = data[idx].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return float(lo), float(hi)


def paired_differences(method: dict[str, float], reference: dict[str, float], *, n_boot: int = 10_000,
                       seed: int = 0) -> dict[str, Any]:
    """Per-question differences ``method[q] - reference[q]`` over the questions both have.

    Args:
        method, reference: question id -> final held-out success (0/1, or a mean over seeds).

    Returns:
        ``n_questions``, ``mean_difference``, ``ci`` (:func:`bootstrap_ci` over questions, a pair),
        ``won`` / ``lost`` / ``tied`` (questions where the difference is > 0, < 0, = 0) and
        ``excludes_zero`` (the interval lies entirely above or below 0: a difference the 65 questions
        resolve).

    Raises:
        ValueError: the two share no question.
    """
    common = sorted(set(method) & set(reference))
    if not common:
        raise ValueError("paired_differences: the method and the reference share no question")
    diffs = [float(method[q]) - float(reference[q]) for q in common]
    lo, hi = bootstrap_ci(diffs, n_boot=n_boot, seed=seed)
    return {
        "n_questions": len(common),
        "mean_difference": statistics.fmean(diffs),
        "ci": [lo, hi],
        "won": sum(d > 0 for d in diffs),
        "lost": sum(d < 0 for d in diffs),
        "tied": sum(d == 0 for d in diffs),
        "excludes_zero": bool(lo > 0 or hi < 0),
    }


def two_level_draws(n_boot: int, n_questions: int, n_method_seeds: int, n_reference_seeds: int,
                    seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The draws of :func:`two_level_paired`, in this order from ``numpy.random.default_rng(seed)``: question
    indices ``(n_boot, n_questions)``, the method's seed indices ``(n_boot, n_method_seeds)`` and the
    reference's ``(n_boot, n_reference_seeds)`` (each row one resample, with replacement)."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, n_questions, size=(n_boot, n_questions)),
            rng.integers(0, n_method_seeds, size=(n_boot, n_method_seeds)),
            rng.integers(0, n_reference_seeds, size=(n_boot, n_reference_seeds)))


def _seed_weights(picks: np.ndarray, n_seeds: int) -> np.ndarray:
    """``(n_boot, n_seeds)``: the share of each seed among a resample's drawn seeds."""
    return (picks[:, :, None] == np.arange(n_seeds)).sum(axis=1) / picks.shape[1]


def two_level_paired(method: list[dict[str, Any]], reference: list[dict[str, Any]], *, n_boot: int = 10_000,
                     seed: int = 0) -> dict[str, Any]:
    """Per-question paired comparison of final held-out success, method minus reference, with a
    two-level bootstrap (:data:`PAIRED_TWO_LEVEL_CI`): resample the questions and, within each resample, the
    seeds of each method independently.

    Args:
        method, reference: one dict per seed, question id -> success (bool or 0/1) at the final evaluation.

    Returns:
        ``n_questions`` (those every seed of both has), ``method_seeds`` / ``reference_seeds`` (counts),
        ``mean_difference`` (mean over questions of the seed-mean differences: the point estimate of
        :func:`paired_differences`), ``ci`` (95% percentile interval, a pair) and ``excludes_zero``.

    Raises:
        ValueError: a side has no seed, or the seeds share no question.
    """
    if not method or not reference:
        raise ValueError("two_level_paired needs at least one seed of the method and one of the reference")
    common = sorted(set.intersection(*(set(d) for d in (*method, *reference))))
    if not common:
        raise ValueError("two_level_paired: the seeds of the method and the reference share no question")
    x_m = np.array([[float(d[q]) for q in common] for d in method])  # (seeds, questions)
    x_r = np.array([[float(d[q]) for q in common] for d in reference])
    q_idx, s_m, s_r = two_level_draws(n_boot, len(common), len(method), len(reference), seed)
    diff = _seed_weights(s_m, len(method)) @ x_m - _seed_weights(s_r, len(reference)) @ x_r  # (n_boot, questions)
    stats = np.take_along_axis(diff, q_idx, axis=1).mean(axis=1)
    lo, hi = (float(v) for v in np.quantile(stats, [0.025, 0.975]))
    return {"n_questions": len(common), "method_seeds": len(method), "reference_seeds": len(reference),
            "mean_difference": float(x_m.mean(axis=0).mean() - x_r.mean(axis=0).mean()), "ci": [lo, hi],
            "excludes_zero": bool(lo > 0 or hi < 0)}


def welch_interval(a: list[float], b: list[float]) -> tuple[float, float] | None:
    """The 95% interval of ``mean(a) - mean(b)`` for two independent samples with unequal variances (Welch's t,
    :data:`CONTRAST_REWARD_CI`): the Welch-Satterthwaite degrees of freedom, not rounded, and t's 0.975 quantile
    at them (``scipy.stats.t``; the bench extra).
    Returns None when a side has fewer than two values or a value is not finite; ``(d, d)`` when neither side
    varies."""
    if len(a) < 2 or len(b) < 2 or not all(math.isfinite(v) for v in (*a, *b)):
        return None
    diff = statistics.fmean(a) - statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return diff, diff
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    from scipy.stats import t  # the bench extra; imported here so that the rest of this module does not need it

    half = float(t.ppf(0.975, df)) * math.sqrt(va + vb)
    return diff - half, diff + half


def contrast(name: str, reference: str, runs: dict[str, list[dict[str, Any]]], methods: dict[str, dict[str, Any]], *,
             n_boot: int = 10_000) -> dict[str, Any]:
    """``name`` against ``reference`` (neither need be GRPO): the answer to "did LOPD beat OPSD with the same
    experience as text", "did the learned composer beat the frozen one".

    Args:
        runs: method -> its seeds' run results (:func:`summarise`'s input).
        methods: method -> :func:`method_summary` (its ``final_reward_per_seed``).

    Returns:
        ``method``, ``reference``, ``reason`` (null, or which side has no run: then every number is null),
        ``final_reward_difference`` (the mean over seeds of each seed's final training reward,
        ``final_reward_per_seed``, method minus reference), ``final_reward_difference_ci`` (:func:`welch_interval`)
        with ``final_reward_difference_ci_reason``, and ``heldout_two_level`` (:func:`two_level_paired` of the
        final held-out success per question; null with ``heldout_two_level_reason`` where a seed of a side has
        no held-out evaluation or the two sides share no question).
    """
    out: dict[str, Any] = {"method": name, "reference": reference, "reason": None, "final_reward_difference": None,
                           "final_reward_difference_ci": None, "final_reward_difference_ci_reason": None,
                           "heldout_two_level": None, "heldout_two_level_reason": None}
    missing = [k for k in (name, reference) if not runs.get(k)]
    if missing:
        reason = f"{' and '.join(missing)} {'has' if len(missing) == 1 else 'have'} no run"
        return {**out, "reason": reason, "final_reward_difference_ci_reason": reason, "heldout_two_level_reason": reason}
    finals = [methods[k]["final_reward_per_seed"] for k in (name, reference)]
    if all(finals):
        out["final_reward_difference"] = statistics.fmean(finals[0]) - statistics.fmean(finals[1])
        ci = welch_interval(*finals)
        out["final_reward_difference_ci"] = list(ci) if ci else None
        if ci is None:
            out["final_reward_difference_ci_reason"] = (
                "a final training reward is not finite" if all(len(f) > 1 for f in finals) else
                f"fewer than two seeds a side, {len(finals[0])} against {len(finals[1])}")
    else:
        out["final_reward_difference_ci_reason"] = "a side has no training reward curve"
    per_question = [_final_per_question(runs[k]) for k in (name, reference)]
    if not all(per_question):
        out["heldout_two_level_reason"] = "a seed of a side has no held-out evaluation"
        return out
    try:
        out["heldout_two_level"] = two_level_paired(*per_question, n_boot=n_boot)
    except ValueError:  # no question every seed of both has
        out["heldout_two_level_reason"] = "the two sides' final evaluations share no question"
    return out


# ---------------------------------------------------------------------- the budget fraction
def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (fewer at the start)."""
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def budget_fraction(lopd: dict[str, Any], grpo: dict[str, Any], window: int, reach_window: int | None = None) -> float | None:
    """First trajectory count where LOPD's smoothed mean reward (trailing mean over ``reach_window`` steps,
    default ``window``) reaches GRPO's final smoothed reward (over ``window`` steps), as a fraction of GRPO's
    total trajectories (None: never reached, or a method has no curve). A short ``reach_window`` keeps
    early fractions possible: with ``window`` alone nothing below ``window`` steps could count.

    Source: the efficiency claim of docs/METHOD.md section 7 (LOPD passes GRPO's final reward after 20%
    of its budget). ``lopd`` and ``grpo`` hold ``rollouts`` (x) and ``reward`` (seed means)."""
    if not lopd["rollouts"] or not grpo["rollouts"]:
        return None
    target = smooth(grpo["reward"], window)[-1]
    reach = reach_window or window
    for i, (x, y) in enumerate(zip(lopd["rollouts"], smooth(lopd["reward"], reach))):
        # only where a full window exists: one lucky early batch is not "reaching" GRPO's final reward
        if i >= min(reach, len(lopd["reward"])) - 1 and y >= target - 1e-9:
            return x / grpo["rollouts"][-1]
    return None


def _seed_mean(curves: list[list[float]]) -> list[float]:
    return [statistics.fmean(column) for column in zip(*curves)]


def budget_fraction_ci(lopd: dict[str, Any], grpo: dict[str, Any], window: int, *, n_boot: int = 2000,
                       seed: int = 0, reach_window: int | None = None,
                       quantity: str = "smoothed mean training reward", target: str = "final smoothed reward",
                       ) -> dict[str, Any]:
    """The 95% bootstrap interval over seeds of :func:`budget_fraction` (:data:`FRACTION_CI`).

    Args:
        lopd, grpo: ``rollouts`` (x) and ``per_seed`` (one reward curve per seed, over those x).
        quantity, target: what the curves and GRPO's final value are called in the reasons (the held-out
            version: ``"mean held-out success"`` and ``"final held-out success"``).

    Returns:
        ``{"ci": [lo, hi] or None, "reason": None or why the interval (or its upper end) is null,
        "never_reached_share": the share of resamples where LOPD never reaches the target}``.
    """
    point = budget_fraction({"rollouts": lopd["rollouts"], "reward": _seed_mean(lopd["per_seed"])},
                            {"rollouts": grpo["rollouts"], "reward": _seed_mean(grpo["per_seed"])}, window,
                            reach_window)
    if point is None:
        level = smooth(_seed_mean(grpo["per_seed"]), window)[-1] if grpo["rollouts"] else None
        reached = "GRPO has no curve" if level is None else f"GRPO's {target} ({level:.3f})"
        return {"ci": None, "never_reached_share": 1.0,
                "reason": f"LOPD's {quantity} never reaches {reached} within "
                          f"{lopd['rollouts'][-1] if lopd['rollouts'] else 0} trajectories"}
    rng = np.random.default_rng(seed)
    fractions = []
    for _ in range(n_boot):
        pick_l = rng.integers(0, len(lopd["per_seed"]), size=len(lopd["per_seed"]))
        pick_g = rng.integers(0, len(grpo["per_seed"]), size=len(grpo["per_seed"]))
        f = budget_fraction({"rollouts": lopd["rollouts"], "reward": _seed_mean([lopd["per_seed"][i] for i in pick_l])},
                            {"rollouts": grpo["rollouts"], "reward": _seed_mean([grpo["per_seed"][i] for i in pick_g])},
                            window, reach_window)
        fractions.append(math.inf if f is None else f)
    lo, hi = (float(v) for v in np.quantile(fractions, [0.025, 0.975], method="inverted_cdf"))
    never = sum(math.isinf(f) for f in fractions) / n_boot
    reason = None
    if math.isinf(hi):
        reason = f"in {never:.0%} of the resamples over seeds LOPD never reaches GRPO's {target}: no upper end"
    if math.isinf(lo):
        return {"ci": None, "never_reached_share": never, "reason": reason}
    return {"ci": [lo, None if math.isinf(hi) else hi], "never_reached_share": never, "reason": reason}


# ---------------------------------------------------------------------- compare.json
def aligned(curves: list[list[tuple[int, float]]]) -> tuple[list[int], list[list[float]]]:
    """The x values every curve has (sorted) and each curve's y at them: ``(xs, per_curve)``."""
    if not curves:
        return [], []
    maps = [dict((int(x), float(y)) for x, y in c) for c in curves]
    xs = sorted(set.intersection(*(set(m) for m in maps)))
    return xs, [[m[x] for x in xs] for m in maps]


def _band(xs: list[int], per_seed: list[list[float]]) -> dict[str, Any]:
    stats = [mean_std([s[i] for s in per_seed]) for i in range(len(xs))]
    return {"trajectories": xs, "mean": [m for m, _ in stats], "std": [s for _, s in stats], "per_seed": per_seed}


def heldout_summary(seed_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Held-out keys of one method from its runs' ``evaluations`` (:func:`compare_runs.heldout_evaluations`):
    ``val_before`` (mean over seeds of the step-0 evaluation), ``val_after`` (of the last one), its std,
    ``val_after_per_seed``, ``val_after_ci`` (:func:`t_interval`) with ``val_after_ci_reason`` when null,
    ``val_curve`` (``trajectories``, ``mean``, ``std``, ``per_seed``), ``val_after_per_question`` and
    ``val_before_per_question`` (question id -> success, mean over seeds; the latter None unless every
    seed has a step-0 evaluation)."""
    evaluations = [r["evaluations"] for r in seed_runs]
    afters = [e[-1]["success"] for e in evaluations]
    starts = [e[0] for e in evaluations if e[0]["step"] == 0]
    befores = [ev["success"] for ev in starts]
    every_start = len(starts) == len(evaluations)  # per question, before and after average the same seeds
    xs, per_seed = aligned([[(ev["trajectories"], ev["success"]) for ev in e] for e in evaluations])
    questions = sorted(set.intersection(*(set(e[-1]["per_question"]) for e in evaluations)))
    ci = t_interval(afters)
    return {
        "val_before": statistics.fmean(befores) if befores else None,
        "val_after": statistics.fmean(afters),
        "val_after_std": mean_std(afters)[1],
        "val_after_per_seed": afters,
        "val_after_ci": list(ci) if ci else None,
        "val_after_ci_reason": None if ci else "one seed: no interval over seeds",
        "val_curve": _band(xs, per_seed),
        "val_after_per_question": {q: statistics.fmean(float(e[-1]["per_question"][q]) for e in evaluations)
                                   for q in questions},
        "val_before_per_question": {q: statistics.fmean(float(ev["per_question"][q]) for ev in starts)
                                    for q in questions if all(q in ev["per_question"] for ev in starts)}
                                   if starts and every_start else None,
    }


def _final_per_question(seed_runs: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Each seed's per-question success at its last held-out evaluation (None: a seed has no evaluations)."""
    if not seed_runs or not all(r.get("evaluations") for r in seed_runs):
        return None
    return [r["evaluations"][-1]["per_question"] for r in seed_runs]


def heldout_by_category(runs: dict[str, list[dict[str, Any]]], category_of: dict[str, str | None]) -> dict[str, Any]:
    """Held-out questions solved per category at each method's first and last evaluation.

    Args:
        runs: method -> its seeds' run files (each with ``evaluations[i].per_question``: question id -> solved).
        category_of: question id -> category (``Task.example_category``); None or a missing id: not counted.

    Returns:
        ``{"categories": {category: number of questions in category_of}, "methods": {method: {category:
        {"start_solved", "final_solved" (means over seeds), "start_solved_per_seed", "final_solved_per_seed"}}}}``,
        start = each seed's first evaluation, final = its last; a question a seed did not evaluate counts as
        not solved. A method any of whose seeds has no evaluation is left out. Categories are sorted by name.
    """
    counts: dict[str, int] = {}
    for category in category_of.values():
        if category is not None:
            counts[category] = counts.get(category, 0) + 1
    categories = sorted(counts)

    def solved(per_question: dict[str, bool]) -> dict[str, int]:
        out = dict.fromkeys(categories, 0)
        for question, ok in per_question.items():
            category = category_of.get(question)
            if ok and category is not None:
                out[category] += 1
        return out

    methods: dict[str, Any] = {}
    for name, seed_runs in runs.items():
        finals = _final_per_question(seed_runs)  # None: a seed has no evaluation (the method is left out)
        if finals is None:
            continue
        start = [solved(r["evaluations"][0]["per_question"]) for r in seed_runs]
        final = [solved(per_question) for per_question in finals]
        methods[name] = {c: {"start_solved": sum(s[c] for s in start) / len(start),
                             "final_solved": sum(f[c] for f in final) / len(final),
                             "start_solved_per_seed": [s[c] for s in start],
                             "final_solved_per_seed": [f[c] for f in final]} for c in categories}
    return {"categories": {c: counts[c] for c in categories}, "methods": methods}


def method_summary(seed_runs: list[dict[str, Any]], smooth_window: int, val_before: float | None) -> dict[str, Any]:
    """One method's entry of compare.json (:func:`summarise` lists the keys)."""
    xs, per_seed = aligned([r["curve"] for r in seed_runs])
    band = _band(xs, per_seed)
    finals = [smooth(s, smooth_window)[-1] for s in per_seed if s]
    if all(r.get("evaluations") for r in seed_runs):
        heldout = heldout_summary(seed_runs)
    else:  # runs without generations files: the RunSummary's numbers
        afters = [r["summary"].get("after") for r in seed_runs]
        known = [a for a in afters if a is not None]
        ci = t_interval(known)
        heldout = {"val_before": val_before, "val_after": mean_std(known)[0] if known else None,
                   "val_after_std": mean_std(known)[1] if known else None, "val_after_per_seed": afters,
                   "val_after_ci": list(ci) if ci else None,
                   "val_after_ci_reason": None if ci else "fewer than two seeds with a held-out result",
                   "val_curve": None, "val_after_per_question": None, "val_before_per_question": None}
    return {
        "rollouts": xs,
        "reward": band["mean"],
        "reward_std": band["std"],
        "reward_per_seed": per_seed,
        "final_reward": mean_std(finals)[0] if finals else None,
        "final_reward_std": mean_std(finals)[1] if finals else None,
        "final_reward_per_seed": finals,
        **heldout,
        "wall_s": statistics.fmean(r["wall_s"] for r in seed_runs),
        "peak_mem_mb": max(float(r["summary"].get("peak_rss_mb") or 0.0) for r in seed_runs),
        "seeds": [r["seed"] for r in seed_runs],
        "seconds_per_step": seed_runs[0]["summary"].get("seconds_per_step_median", {}),
    }


def start_train_reward(methods: dict[str, Any], window: int) -> tuple[float | None, int]:
    """The start student's training reward: the mean, over every run of every method (they all start from
    the same student) with at least ``window`` steps, of its first ``window`` steps' rewards; and the number
    of runs it pools (0: None).

    An estimate with caveats: those steps already include ``window - 1`` updates; every run weighs the same
    whatever its layout (GRPO's one question a step is far noisier than LOPD's four); and the level moves
    as runs of other methods are added. No interval is attached."""
    firsts = [statistics.fmean(curve[:window]) for m in methods.values() for curve in m.get("reward_per_seed") or []
              if len(curve) >= window]
    return (statistics.fmean(firsts) if firsts else None), len(firsts)


def grpo_improvement(reward: list[float], window: int, start: tuple[float | None, int]) -> str | None:
    """Why the budget fraction is undefined when GRPO's smoothed training reward ends no higher than the
    start student's level (the level every method begins at, not something GRPO reached); None when GRPO
    improved.

    Args:
        reward: GRPO's training reward per step (the mean over its seeds).
        window: the trailing-mean window (steps) of the final reward.
        start: :func:`start_train_reward` ``(level, runs)`` (GRPO's own runs are among them, so the level
            exists whenever GRPO's curve is longer than the window).
    """
    if not reward:
        return None
    if len(reward) <= window:
        return (f"GRPO's training-reward curve has {len(reward)} steps, not more than the {window}-step window: "
                "no start and end to compare")
    curve = smooth(reward, window)
    level, runs = start
    where = (f"the start student's ({level:.3f}: the mean of the first {window} steps over {runs} runs of "
             "every method, all starting from the same student)")
    final = curve[-1]
    if final > level + 1e-9:
        return None
    return (f"GRPO's final smoothed training reward ({final:.3f}) is not above {where}: GRPO did not improve, so "
            "reaching its final reward would measure the start student, not LOPD's efficiency")


def _efficiency(methods: dict[str, Any], smooth_window: int, n_boot: int) -> dict[str, Any]:
    """``lopd_budget_fraction_to_grpo_final`` (+ ``_reason``, ``_ci``, ``_ci_reason``, ``_ci_method``),
    ``lopd_budget_fraction_never_reached_share``, ``grpo_final_reward`` (over ``smooth_window`` steps),
    ``lopd_final_reward`` (LOPD's last trailing mean over ``reach_window`` steps, the mean its crossing is judged
    on: the fraction counts the first crossing, which LOPD may not hold to the end),
    ``reach_window`` (the trailing mean, min(3, smooth_window) steps, on which LOPD "reaches" it) and
    ``start_train_reward`` / ``start_train_reward_runs`` (:func:`start_train_reward`). The fraction is
    undefined, with the reason, when GRPO's final reward does not pass the start student's."""
    out: dict[str, Any] = {"lopd_budget_fraction_to_grpo_final": None, "lopd_budget_fraction_to_grpo_final_ci": None,
                           "lopd_budget_fraction_to_grpo_final_reason": None,
                           "lopd_budget_fraction_to_grpo_final_ci_reason": "LOPD or GRPO has no run",
                           "lopd_budget_fraction_to_grpo_final_ci_method": FRACTION_CI, "grpo_final_reward": None,
                           "lopd_budget_fraction_never_reached_share": None, "lopd_final_reward": None,
                           "reach_window": min(3, smooth_window), "start_train_reward": None,
                           "start_train_reward_runs": 0}
    if "lopd" not in methods or "grpo" not in methods:
        return out
    lopd, grpo = methods["lopd"], methods["grpo"]
    out["grpo_final_reward"] = smooth(grpo["reward"], smooth_window)[-1] if grpo["reward"] else None
    reach = out["reach_window"]  # LOPD "reaches" on a 3-step trailing mean; GRPO's final uses the long window
    # LOPD's level at the end on the mean its crossing is judged on: below GRPO's final, the crossing was not held
    out["lopd_final_reward"] = smooth(lopd["reward"], reach)[-1] if lopd["reward"] else None
    start = start_train_reward(methods, smooth_window)
    out["start_train_reward"], out["start_train_reward_runs"] = start
    improved = grpo_improvement(grpo["reward"], smooth_window, start)
    if improved is not None:  # GRPO ended no higher than it began: reaching its final reward measures the start
        out.update(lopd_budget_fraction_to_grpo_final_reason=improved, lopd_budget_fraction_to_grpo_final_ci_reason=improved,
                   lopd_budget_fraction_never_reached_share=None)
        return out
    out["lopd_budget_fraction_to_grpo_final"] = budget_fraction(lopd, grpo, smooth_window, reach)
    ci = budget_fraction_ci({"rollouts": lopd["rollouts"], "per_seed": lopd["reward_per_seed"]},
                            {"rollouts": grpo["rollouts"], "per_seed": grpo["reward_per_seed"]}, smooth_window,
                            n_boot=max(1, n_boot // 5), reach_window=reach)
    out["lopd_budget_fraction_to_grpo_final_ci"] = ci["ci"]
    out["lopd_budget_fraction_to_grpo_final_ci_reason"] = ci["reason"]
    out["lopd_budget_fraction_never_reached_share"] = ci["never_reached_share"]
    return out


def heldout_efficiency(methods: dict[str, Any], start: tuple[float | None, int], n_boot: int) -> dict[str, Any]:
    """``lopd_heldout_budget_fraction_to_grpo_final`` (+ ``_reason``, ``_ci``, ``_ci_reason``, ``_ci_method``),
    ``lopd_heldout_budget_fraction_never_reached_share``, ``grpo_final_heldout_success`` (GRPO's last evaluation)
    and ``grpo_final_heldout_target`` (the mean of its last two, the level LOPD must reach; LOPD's own final one on
    that mean: ``lopd_final_heldout_level``): the definition of
    :func:`_efficiency` on the held-out success curve (``val_curve``) at the evaluation points after the start,
    on a trailing mean of :data:`HELDOUT_WINDOW` evaluations on both sides: the first evaluation where the mean
    of LOPD's last two seed-mean held-out successes reaches GRPO's final one (the mean of its last two
    evaluations), as a fraction of GRPO's trajectories; the interval resamples seeds (:data:`HELDOUT_FRACTION_CI`).
    One evaluation alone would let the first of ten noisy points that crosses the target count, which
    favours LOPD (the first crossing of a noisy curve comes early) against a single final point of GRPO's.

    Args:
        methods: :func:`method_summary` entries by name.
        start: ``(the mean step-0 held-out success over every run, the number of runs)``; GRPO's final held-out
            success must be above it, else the fraction is undefined (null, with the reason).
    """
    key = "lopd_heldout_budget_fraction_to_grpo_final"
    out: dict[str, Any] = {key: None, f"{key}_reason": "LOPD or GRPO has no run", f"{key}_ci": None,
                           f"{key}_ci_reason": "LOPD or GRPO has no run", f"{key}_ci_method": HELDOUT_FRACTION_CI,
                           "lopd_heldout_budget_fraction_never_reached_share": None, "grpo_final_heldout_success": None,
                           "grpo_final_heldout_target": None, "lopd_final_heldout_level": None}
    if "lopd" not in methods or "grpo" not in methods:
        return out
    curves = {}
    for name in ("lopd", "grpo"):
        curve = methods[name].get("val_curve") or {}
        after = [i for i, x in enumerate(curve.get("trajectories") or []) if x > 0]
        curves[name] = {"rollouts": [curve["trajectories"][i] for i in after], "reward": [curve["mean"][i] for i in after],
                        "per_seed": [[s[i] for i in after] for s in curve.get("per_seed") or []]}
    if not curves["lopd"]["rollouts"] or not curves["grpo"]["rollouts"]:
        reason = "LOPD or GRPO has no held-out evaluation after the start"
        return {**out, f"{key}_reason": reason, f"{key}_ci_reason": reason}
    out["grpo_final_heldout_success"] = curves["grpo"]["reward"][-1]
    final, (level, runs) = smooth(curves["grpo"]["reward"], HELDOUT_WINDOW)[-1], start
    out["grpo_final_heldout_target"] = final
    out["lopd_final_heldout_level"] = smooth(curves["lopd"]["reward"], HELDOUT_WINDOW)[-1]  # the same trailing mean
    if level is None or final <= level + 1e-9:
        reason = ("no step-0 held-out evaluation to compare GRPO's final held-out success with" if level is None else
                  f"GRPO's final held-out success ({final:.3f}, {TARGET_HELDOUT}) is not above the start student's ({level:.3f}: the mean "
                  f"step-0 held-out success over {runs} runs of every method, all starting from the same student): "
                  "GRPO did not improve, so reaching its final held-out success would measure the start student, "
                  "not LOPD's efficiency")
        return {**out, f"{key}_reason": reason, f"{key}_ci_reason": reason}
    w = HELDOUT_WINDOW
    ci = budget_fraction_ci(curves["lopd"], curves["grpo"], w, n_boot=max(1, n_boot // 5), reach_window=w,
                            quantity=f"mean held-out success ({TARGET_HELDOUT})",
                            target=f"final held-out success ({TARGET_HELDOUT})")
    return {**out, key: budget_fraction(curves["lopd"], curves["grpo"], w, w), f"{key}_reason": None,
            f"{key}_ci": ci["ci"], f"{key}_ci_reason": ci["reason"],
            "lopd_heldout_budget_fraction_never_reached_share": ci["never_reached_share"]}


def summarise(runs: dict[str, list[dict[str, Any]]], *, task: str, model: str, budget: int, smooth_window: int,
              val_before: float | None = None, n_boot: int = 10_000,
              contrasts: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """The compare.json document (without the run metadata, which compare.py adds).

    Per method (``methods.<name>``): ``rollouts`` and ``reward`` (seed means at each logged step),
    ``reward_std`` and ``reward_per_seed``, ``final_reward`` / ``final_reward_std`` (trailing mean over
    ``smooth_window`` steps) and ``final_reward_per_seed``, ``val_before``, ``val_after`` (mean over seeds of the last held-out
    evaluation) with ``val_after_std``, ``val_after_per_seed`` and ``val_after_ci`` (:data:`VAL_AFTER_CI`),
    ``val_curve`` (held-out success against trajectories: ``trajectories``, ``mean``, ``std``,
    ``per_seed``), ``val_after_per_question``, ``val_before_per_question``, ``paired_vs_grpo``
    (:func:`paired_differences`; not for GRPO itself), ``paired_vs_start`` (the same against the method's
    own step-0 evaluation: did it move held-out success at all), ``wall_s`` (mean over seeds, every attempt), ``peak_mem_mb``, ``seeds``,
    ``seconds_per_step``, ``paired_vs_grpo_two_level`` (:func:`two_level_paired` against GRPO's seeds,
    beside ``paired_vs_grpo``; not for GRPO). Top level: ``val_examples``, ``start_val_success`` (mean over
    runs of the step-0 evaluation), the efficiency keys of :func:`_efficiency` and of
    :func:`heldout_efficiency`, ``contrasts`` (:func:`contrast` for each ``(method, reference)`` pair of
    ``contrasts``, in that order; empty for a plan without them), ``task``, ``model``,
    ``budget_trajectories``, ``smooth_window``, ``intervals`` (how each interval is made) and ``seeds``.
    """
    methods = {name: method_summary(seed_runs, smooth_window, val_before) for name, seed_runs in runs.items()}
    grpo_q = methods.get("grpo", {}).get("val_after_per_question")
    for name, m in methods.items():
        m["paired_vs_grpo"] = (paired_differences(m["val_after_per_question"], grpo_q, n_boot=n_boot)
                               if name != "grpo" and grpo_q and m["val_after_per_question"] else None)
        m["paired_vs_start"] = (paired_differences(m["val_after_per_question"], m["val_before_per_question"], n_boot=n_boot)
                                if m["val_after_per_question"] and m["val_before_per_question"] else None)
        m["paired_vs_grpo_two_level"] = (
            two_level_paired(*(_final_per_question(runs[k]) for k in (name, "grpo")), n_boot=n_boot)
            if m["paired_vs_grpo"] and _final_per_question(runs[name]) and _final_per_question(runs["grpo"]) else None)
    all_runs = [r for rs in runs.values() for r in rs]
    starts = [r["evaluations"][0]["success"] for r in all_runs if r.get("evaluations") and r["evaluations"][0]["step"] == 0]
    finals = [r["evaluations"][-1]["questions"] for r in all_runs if r.get("evaluations")]
    return {
        "methods": methods,
        "val_examples": max(finals) if finals else None,
        "start_val_success": statistics.fmean(starts) if starts else val_before,
        "start_val_success_range": [min(starts), max(starts)] if starts else None,
        **_efficiency(methods, smooth_window, n_boot),
        **heldout_efficiency(methods, (statistics.fmean(starts) if starts else None, len(starts)), n_boot),
        "contrasts": [contrast(a, b, runs, methods, n_boot=n_boot) for a, b in contrasts],
        "task": task,
        "model": model,
        "budget_trajectories": budget,
        "smooth_window": smooth_window,
        "intervals": {"val_after_ci": VAL_AFTER_CI, "paired_vs_grpo.ci": PAIRED_CI, "paired_vs_start.ci": PAIRED_START_CI,
                      "paired_vs_grpo_two_level.ci": PAIRED_TWO_LEVEL_CI,
                      "contrasts.heldout_two_level.ci": PAIRED_TWO_LEVEL_CI.replace("GRPO's", "the reference's"),
                      "contrasts.final_reward_difference_ci": CONTRAST_REWARD_CI,
                      "lopd_budget_fraction_to_grpo_final_ci": FRACTION_CI,
                      "lopd_heldout_budget_fraction_to_grpo_final_ci": HELDOUT_FRACTION_CI, "bootstrap_resamples": n_boot},
        "seeds": sorted({r["seed"] for r in all_runs}),
    }
