"""The statistics the experience comparison (issue 33) adds to benchmarks/compare_stats.py: the two-level paired
bootstrap against GRPO (questions, and within each resample each method's seeds) and the held-out budget
fraction (``lopd_heldout_budget_fraction_to_grpo_final``), against hand-derived values and a naive loop."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def stats():
    return load_benchmark("compare").compare_stats


@pytest.fixture(scope="module")
def report(stats):
    import compare_report  # on sys.path once compare.py is loaded

    return compare_report


# ---------------------------------------------------------------------- the two-level bootstrap
def naive_two_level(method, reference, q_idx, s_m, s_r):
    """The statistic of every resample by direct loops: per drawn question, the mean over the drawn seeds of
    the method's success minus the reference's, averaged over the drawn questions."""
    common = sorted(set.intersection(*(set(d) for d in (*method, *reference))))
    stats = []
    for b in range(len(q_idx)):
        total = 0.0
        for i in q_idx[b]:
            q = common[i]
            m = sum(float(method[s][q]) for s in s_m[b]) / len(s_m[b])
            r = sum(float(reference[s][q]) for s in s_r[b]) / len(s_r[b])
            total += m - r
        stats.append(total / len(q_idx[b]))
    return stats


def test_the_two_level_bootstrap_equals_a_naive_loop_over_the_same_draws(stats):
    rng = np.random.default_rng(3)
    questions = [f"q{i}" for i in range(12)]
    method = [{q: bool(rng.random() < 0.6) for q in questions} for _ in range(3)]
    reference = [{q: bool(rng.random() < 0.3) for q in questions} for _ in range(2)]
    method[1]["extra"] = True  # a question not every seed has is left out
    result = stats.two_level_paired(method, reference, n_boot=300, seed=7)
    q_idx, s_m, s_r = stats.two_level_draws(300, 12, 3, 2, seed=7)
    naive = naive_two_level(method, reference, q_idx, s_m, s_r)
    lo, hi = np.quantile(naive, [0.025, 0.975])
    assert result["ci"] == pytest.approx([lo, hi], abs=1e-12)
    point = sum(sum(d[q] for d in method) / 3 - sum(d[q] for d in reference) / 2 for q in questions) / 12
    assert result["mean_difference"] == pytest.approx(point) and result["n_questions"] == 12
    assert (result["method_seeds"], result["reference_seeds"]) == (3, 2)
    # the point estimate is the question-level comparison's (the mean of the seed-mean differences)
    seed_means = {q: sum(d[q] for d in method) / 3 for q in questions}
    grpo_means = {q: sum(d[q] for d in reference) / 2 for q in questions}
    assert stats.paired_differences(seed_means, grpo_means)["mean_difference"] == pytest.approx(point)


def test_seed_to_seed_variation_widens_the_interval_where_the_question_bootstrap_sees_none(stats):
    questions = [f"q{i}" for i in range(20)]
    solves_all, solves_none = {q: True for q in questions}, {q: False for q in questions}
    # the method's two seeds disagree completely, GRPO's one seed solves nothing. A resample draws seed A twice
    # (1/4: difference 1), B twice (1/4: 0) or one of each (1/2: 0.5), whatever the questions: the 2.5% and 97.5%
    # quantiles are 0 and 1
    two = stats.two_level_paired([solves_all, solves_none], [solves_none], n_boot=4000)
    assert two["mean_difference"] == 0.5 and two["ci"] == [0.0, 1.0] and two["excludes_zero"] is False
    # the question bootstrap on the seed means sees +0.5 on every question: [0.5, 0.5], "resolved"
    one = stats.paired_differences({q: 0.5 for q in questions}, {q: 0.0 for q in questions}, n_boot=4000)
    assert one["ci"] == [0.5, 0.5] and one["excludes_zero"] is True
    # seeds that agree: the seed level adds nothing; every question gains 1 -> [1, 1]
    same = stats.two_level_paired([solves_all] * 3, [solves_none] * 3, n_boot=500)
    assert same["ci"] == [1.0, 1.0] and same["excludes_zero"] is True
    # one seed each: the question bootstrap alone; differences +1, 0, 0, +1 -> a resample of all zeros or all
    # ones has probability 1/16 each (> 2.5%): [0, 1]
    a, b = {"q1": 1, "q2": 0, "q3": 1, "q4": 1}, {"q1": 0, "q2": 0, "q3": 1, "q4": 0}
    assert stats.two_level_paired([a], [b], n_boot=4000)["ci"] == [0.0, 1.0]
    with pytest.raises(ValueError, match="at least one seed"):
        stats.two_level_paired([], [b])
    with pytest.raises(ValueError, match="share no question"):
        stats.two_level_paired([{"a": 1}], [{"b": 0}])


# ---------------------------------------------------------------------- the held-out budget fraction
XS = [0, 4, 8, 12, 16, 20]


def curve(*per_seed):
    """A method's val_curve: per seed a held-out success at each of XS (the first at the start)."""
    mean = [sum(column) / len(column) for column in zip(*per_seed)]
    return {"val_curve": {"trajectories": XS, "mean": mean, "per_seed": [list(s) for s in per_seed]}}


GRPO = curve([0.1, 0.1, 0.2, 0.3, 0.4, 0.5], [0.1, 0.1, 0.2, 0.3, 0.4, 0.5])  # final 0.5
KEY = "lopd_heldout_budget_fraction_to_grpo_final"


def test_the_held_out_fraction_by_hand(stats):
    # on a trailing mean of 2 evaluations after the start, both sides: GRPO's target is (0.4 + 0.5) / 2 = 0.45;
    # LOPD's seed mean after the start [0.3, 0.4, 0.5, 0.55, 0.55] has trailing means -, 0.35, 0.45, ... : reached
    # at 12 of GRPO's 20 trajectories (its first single evaluation at 0.5 is also at 12)
    lopd = curve([0.1, 0.3, 0.5, 0.5, 0.6, 0.6], [0.1, 0.3, 0.3, 0.5, 0.5, 0.5])
    out = stats.heldout_efficiency({"lopd": lopd, "grpo": GRPO}, (0.1, 4), n_boot=2000)
    assert out[KEY] == pytest.approx(0.6) and out[f"{KEY}_reason"] is None and out["grpo_final_heldout_success"] == 0.5
    assert out["grpo_final_heldout_target"] == pytest.approx(0.45)
    # resampling LOPD's seeds (GRPO's agree): seed 1 twice (1/4 of resamples), [0.3, 0.3, 0.5, 0.5, 0.5] after the
    # start, has trailing means 0.3 at 8, 0.4 at 12, 0.5 at 16 -> 0.8; seed 0 twice, [0.3, 0.5, 0.5, 0.6, 0.6]:
    # 0.4 at 8, 0.5 at 12 -> 0.6; one of each (the point estimate) -> 0.6
    assert out[f"{KEY}_ci"] == [0.6, 0.8] and out["lopd_heldout_budget_fraction_never_reached_share"] == 0.0
    assert "held-out fraction" in out[f"{KEY}_ci_method"]
    # the start point does not count: a LOPD that starts at GRPO's final level is not "there" before training
    starts_high = curve([0.5, 0.4, 0.4, 0.5, 0.5, 0.5])
    assert stats.heldout_efficiency({"lopd": starts_high, "grpo": GRPO}, (0.1, 2), n_boot=200)[KEY] == pytest.approx(0.6)


def test_one_lucky_evaluation_does_not_reach_the_held_out_target(stats):
    # a single evaluation at 0.5 between 0.2s crosses GRPO's final 0.5, but the trailing mean of two does not
    # reach GRPO's 0.45 until 0.4 and 0.5 at the end: 20 of 20, not 8 of 20
    lucky = curve([0.1, 0.2, 0.5, 0.2, 0.4, 0.5])
    out = stats.heldout_efficiency({"lopd": lucky, "grpo": GRPO}, (0.1, 2), n_boot=200)
    assert out[KEY] == pytest.approx(1.0)


def test_a_held_out_crossing_lopd_does_not_hold_is_said_so(stats, report):
    # LOPD's trailing means of two after the start: 0.5 at 8 (reaches GRPO's 0.45: 8 of 20), then 0.35, 0.1, 0.0
    fell = curve([0.1, 0.5, 0.5, 0.2, 0.0, 0.0])
    out = stats.heldout_efficiency({"lopd": fell, "grpo": GRPO}, (0.1, 2), n_boot=200)
    assert out[KEY] == pytest.approx(0.4) and out["lopd_final_heldout_level"] == pytest.approx(0.0)
    line = report._heldout_efficiency_line(out)[-1]
    assert line.endswith("LOPD did not hold it: it ends at 0.000 on the mean it crossed on, below GRPO's 0.450 (the "
                         "fraction counts the first crossing).")
    held = stats.heldout_efficiency({"lopd": curve([0.1, 0.5, 0.5, 0.5, 0.5, 0.5]), "grpo": GRPO}, (0.1, 2), n_boot=200)
    assert held["lopd_final_heldout_level"] == pytest.approx(0.5) and "did not hold" not in \
        report._heldout_efficiency_line(held)[-1]


def test_the_held_out_fraction_is_null_with_the_reason_where_undefined(stats):
    never = curve([0.1, 0.2, 0.2, 0.2, 0.2, 0.2], [0.1, 0.2, 0.3, 0.3, 0.3, 0.4])
    out = stats.heldout_efficiency({"lopd": never, "grpo": GRPO}, (0.1, 4), n_boot=200)
    assert out[KEY] is None and out[f"{KEY}_reason"] is None and out[f"{KEY}_ci"] is None  # defined, not reached
    assert out[f"{KEY}_ci_reason"] == ("LOPD's mean held-out success (mean of 2 consecutive evaluations) never reaches "
                                       "GRPO's final held-out success (mean of 2 consecutive evaluations) (0.450) "
                                       "within 20 trajectories")
    flat = curve([0.2, 0.1, 0.2, 0.2, 0.2, 0.2])  # GRPO ends at 0.2, the start of every run averages 0.2
    out = stats.heldout_efficiency({"lopd": never, "grpo": flat}, (0.2, 3), n_boot=200)
    assert out[KEY] is None and out[f"{KEY}_ci"] is None and out["grpo_final_heldout_success"] == 0.2
    assert out[f"{KEY}_reason"].startswith("GRPO's final held-out success (0.200, mean of 2 consecutive evaluations) "
                                           "is not above the start student's (0.200: the mean step-0 held-out success "
                                           "over 3 runs")
    assert out[f"{KEY}_ci_reason"] == out[f"{KEY}_reason"]
    assert stats.heldout_efficiency({"grpo": GRPO}, (0.1, 2), n_boot=10)[f"{KEY}_reason"] == "LOPD or GRPO has no run"
    assert "no step-0" in stats.heldout_efficiency({"lopd": never, "grpo": GRPO}, (None, 0), n_boot=10)[f"{KEY}_reason"]


def fake(method, seed, finals, successes):
    """A run file's content with held-out evaluations at XS (per-question at the end: ``finals``)."""
    questions = sorted(finals)
    evaluations = [{"step": x // 4, "trajectories": x, "questions": len(questions),
                    "solved": round(s * len(questions)), "success": s,
                    "per_question": dict(finals) if x == XS[-1] else {q: False for q in questions}}
                   for x, s in zip(XS, successes)]
    return {"method": method, "seed": seed, "curve": [[x, 0.5] for x in XS[1:]], "evaluations": evaluations,
            "wall_s": 1.0, "summary": {"peak_rss_mb": 1.0, "seconds_per_step_median": {}}}


def test_summarise_reports_both_beside_the_existing_keys(stats):
    qs = [f"q{i}" for i in range(10)]
    runs = {"lopd": [fake("lopd", s, {q: i < 6 for i, q in enumerate(qs)}, [0.0, 0.3, 0.5, 0.6, 0.6, 0.6]) for s in (0, 1)],
            "grpo": [fake("grpo", s, {q: i < 5 for i, q in enumerate(qs)}, [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]) for s in (0, 1)]}
    data = stats.summarise(runs, task="t", model="m", budget=20, smooth_window=1, n_boot=500)
    lopd = data["methods"]["lopd"]
    assert lopd["paired_vs_grpo"]["mean_difference"] == pytest.approx(0.1)
    two = lopd["paired_vs_grpo_two_level"]
    assert two["mean_difference"] == pytest.approx(0.1) and (two["method_seeds"], two["reference_seeds"]) == (2, 2)
    assert data["methods"]["grpo"]["paired_vs_grpo_two_level"] is None
    # GRPO's target (0.4 + 0.5) / 2 = 0.45; LOPD's trailing means after the start: -, 0.4 at 8, 0.55 at 12
    assert data[KEY] == pytest.approx(12 / 20) and data[f"{KEY}_ci"] == [0.6, 0.6]  # identical seeds
    assert "two-level" in data["intervals"]["paired_vs_grpo_two_level.ci"]
    assert KEY + "_ci" in data["intervals"]


# ---------------------------------------------------------------------- method against method (contrasts)
def naive_t975(df):
    """t's 0.975 quantile by integrating its density (trapezoids of 1e-4) from 0 until 0.475 is reached."""
    import math

    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    x = np.arange(0.0, 40.0, 1e-4)
    density = c * (1 + x**2 / df) ** (-(df + 1) / 2)
    area = np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2 * 1e-4)])
    return float(x[np.searchsorted(area, 0.475)])


def test_welch_interval_matches_hand_derived_values(stats):
    # equal variances and sizes: a 0.5, 0.6, 0.7 and b 0.1, 0.2, 0.3 have var 0.01 each, se^2 = 2 x 0.01/3, and the
    # Welch df is exactly 4 (t 2.776): 0.4 +- 2.776 x 0.081650 = [0.17334, 0.62666]
    assert stats.welch_interval([0.5, 0.6, 0.7], [0.1, 0.2, 0.3]) == pytest.approx((0.17334, 0.62666), abs=1e-4)
    # a: mean 0.6, var 0.01 (/3); b: mean 0.3, var 0.02 (/2); se^2 = 0.01/3 + 0.01 = 0.013333;
    # df = 0.013333^2 / ((0.01/3)^2 / 2 + 0.01^2 / 1) = 1.6842, not rounded (rounding down to 1 gave t 12.706)
    df = (0.04 / 3) ** 2 / ((0.01 / 3) ** 2 / 2 + 0.01**2)
    half = naive_t975(df) * (0.04 / 3) ** 0.5
    lo, hi = stats.welch_interval([0.5, 0.7, 0.6], [0.2, 0.4])
    assert (lo, hi) == pytest.approx((0.3 - half, 0.3 + half), abs=2e-3)  # t 5.18, half 0.598
    assert stats.welch_interval([0.5, 0.5], [0.25, 0.25]) == (0.25, 0.25)  # neither side varies
    assert stats.welch_interval([0.5], [0.1, 0.2]) is None
    assert stats.welch_interval([0.5, float("nan")], [0.1, 0.2]) is None


def contrast_run(method, seed, rewards, final):
    """A finished run's result (compare.finished_result's keys that compare_stats reads): a training reward per
    step of 4 trajectories, held-out evaluations at step 0 (nothing solved) and at the end (``final``)."""
    steps = len(rewards)
    evaluations = [{"step": step, "trajectories": 4 * step, "questions": len(per_q), "solved": sum(per_q.values()),
                    "success": sum(per_q.values()) / len(per_q), "per_question": per_q}
                   for step, per_q in ((0, {k: False for k in final}), (steps, final))]
    return {"method": method, "seed": seed, "curve": [[4 * (i + 1), r] for i, r in enumerate(rewards)],
            "evaluations": evaluations, "wall_s": 1.0, "summary": {"peak_rss_mb": 1.0}}


def test_a_contrast_compares_two_methods_on_training_reward_and_held_out_success(stats):
    q = [f"q{i}" for i in range(6)]
    lopd = [contrast_run("lopd", s, [0.0, 0.5, r], {k: i < 4 for i, k in enumerate(q)}) for s, r in enumerate([0.6, 0.8, 0.7])]
    opsd = [contrast_run("opsd", s, [0.0, 0.1, r], {k: i < 1 for i, k in enumerate(q)}) for s, r in enumerate([0.2, 0.4])]
    runs = {"lopd": lopd, "opsd": opsd}
    methods = {name: stats.method_summary(r, 2, None) for name, r in runs.items()}
    c = stats.contrast("lopd", "opsd", runs, methods, n_boot=500)
    # final reward per seed = mean of the last 2 steps: lopd 0.55, 0.65, 0.60; opsd 0.15, 0.25
    assert methods["lopd"]["final_reward_per_seed"] == pytest.approx([0.55, 0.65, 0.60])
    assert c["reason"] is None and c["final_reward_difference"] == pytest.approx(0.60 - 0.20)
    a, b = [0.55, 0.65, 0.60], [0.15, 0.25]
    assert c["final_reward_difference_ci"] == pytest.approx(list(stats.welch_interval(a, b)))
    assert c["final_reward_difference_ci"][0] > 0  # 0.4 +- t(2.47 df) 4.11 x 0.0707: [0.10, 0.70]
    h = c["heldout_two_level"]  # every seed solves the same questions: 4/6 against 1/6, whatever is resampled
    assert (h["method_seeds"], h["reference_seeds"], h["n_questions"]) == (3, 2, 6)
    assert h["mean_difference"] == pytest.approx(0.5) and h["excludes_zero"]
    missing = stats.contrast("lopd", "lopd_frozen", runs, methods)
    assert missing["reason"] == "lopd_frozen has no run" and missing["heldout_two_level"] is None
    assert missing["final_reward_difference"] is None
    one = stats.contrast("lopd", "opsd", {"lopd": lopd, "opsd": opsd[:1]},
                         {**methods, "opsd": stats.method_summary(opsd[:1], 2, None)}, n_boot=50)
    assert one["final_reward_difference_ci"] is None
    assert one["final_reward_difference_ci_reason"] == "fewer than two seeds a side, 3 against 1"
    doc = stats.summarise(runs, task="t", model="m", budget=12, smooth_window=2, n_boot=50,
                          contrasts=(("lopd", "opsd"), ("lopd", "lopd_frozen")))
    assert [(c["method"], c["reference"]) for c in doc["contrasts"]] == [("lopd", "opsd"), ("lopd", "lopd_frozen")]
    assert doc["contrasts"][0]["final_reward_difference"] == pytest.approx(0.4)
    apart = [contrast_run("opsd", 0, [0.1, 0.2], {"other": True})]  # no question in common
    cut = stats.contrast("lopd", "opsd", {"lopd": lopd, "opsd": apart},
                         {**methods, "opsd": stats.method_summary(apart, 2, None)}, n_boot=50)
    assert cut["heldout_two_level"] is None
    assert cut["heldout_two_level_reason"] == "the two sides' final evaluations share no question"
