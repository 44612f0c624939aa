"""The figure and the table of ``benchmarks/compare.py``: ``compare.png`` and ``compare.md`` from compare.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _smoothed(m: dict[str, Any], window: int) -> tuple[list[float], list[float]]:
    """The seed mean and sample std (as the table's), at each step, of every seed's trailing-mean training reward."""
    from compare_stats import mean_std, smooth

    columns = [mean_std(list(c)) for c in zip(*(smooth(curve, window) for curve in m["reward_per_seed"]))]
    return [c[0] for c in columns], [c[1] for c in columns]


def _panel(ax, results: dict[str, Any], key: str) -> None:
    """One panel: per method, the seed mean of a curve against trajectories and a +-1 std band (training
    reward: the trailing mean over ``smooth_window`` steps, each step's mean faint behind it)."""
    window = int(results.get("smooth_window") or 1)
    for name, m in results["methods"].items():
        if key == "reward" and m.get("reward_per_seed"):
            xs = m["rollouts"]
            mean, std = _smoothed(m, window)
        elif key == "reward":
            xs, mean, std = m["rollouts"], m["reward"], m["reward_std"]
        elif m.get("val_curve"):
            xs, mean, std = m["val_curve"]["trajectories"], m["val_curve"]["mean"], m["val_curve"]["std"]
        else:
            continue
        if not xs:
            continue
        (line,) = ax.plot(xs, mean, marker="o" if key != "reward" else None, ms=3, label=f"{name} (n={len(m['seeds'])})")
        if key == "reward" and window > 1:
            ax.plot(xs, m["reward"], color=line.get_color(), alpha=0.2, lw=0.8)
        ax.fill_between(xs, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                        color=line.get_color(), alpha=0.15)
    ax.set_xlabel("trajectories consumed")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot(results: dict[str, Any], path: Path) -> Path:
    """Two panels against trajectories consumed: training reward, and greedy held-out success (every
    evaluation of the held-out curve); seed mean and a band of one standard deviation across seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    _panel(left, results, "reward")
    left.set_ylabel("training reward (mean over seeds)")
    left.set_title(f"training reward, trailing mean over {results.get('smooth_window')} steps (faint: each step)",
                   fontsize=9)
    _panel(right, results, "val")
    right.set_ylabel("held-out success, greedy (mean over seeds)")
    right.set_title(f"held-out success on {results.get('val_examples')} questions", fontsize=9)
    fig.suptitle(f"{results['task']}, {Path(str(results['model'])).name}: band = 1 std across seeds", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _fmt(mean: float | None, std: float | None = None) -> str:
    if mean is None:
        return "n/a"
    return f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f}"


def _interval(pair: list[float | None] | None) -> str:
    if not pair:
        return "n/a"
    return "[" + ", ".join("n/a" if v is None else f"{v:.3f}" for v in pair) + "]"


def _verdict(excludes_zero: bool) -> str:
    """How a difference's interval reads: ``"excludes 0"`` or ``"within noise"``."""
    return "excludes 0" if excludes_zero else "within noise"


def _paired(m: dict[str, Any], key: str = "paired_vs_grpo") -> str:
    p = m.get(key)
    if not p:
        return "-"
    if p["won"] == p["lost"] == 0:
        return f"no change ({p['n_questions']} questions tied)"
    return (f"{p['mean_difference']:+.3f} {_interval(p['ci'])} (+{p['won']} / -{p['lost']} of "
            f"{p['n_questions']}; {_verdict(p['excludes_zero'])})")


def _two_level(m: dict[str, Any]) -> str:
    return _two_level_text(m.get("paired_vs_grpo_two_level"))


def _two_level_text(p: dict[str, Any] | None) -> str:
    """One compare_stats.two_level_paired result: the difference, its interval, the seeds and the verdict."""
    if not p:
        return "-"
    return (f"{p['mean_difference']:+.3f} {_interval(p['ci'])} ({p['method_seeds']} vs {p['reference_seeds']} seeds; "
            f"{_verdict(p['excludes_zero'])})")


def _heldout_efficiency_line(results: dict[str, Any]) -> list[str]:
    key = "lopd_heldout_budget_fraction_to_grpo_final"
    if key not in results or results.get(f"{key}_reason") == "LOPD or GRPO has no run":
        return []
    target = results.get("grpo_final_heldout_target")
    return _fraction_line(results, key, "final held-out success", "not reached at any evaluation",
                          target=None if target is None else f"{target:.3f}, the mean of its last two evaluations, "
                          "LOPD's on the same trailing mean",
                          held=(results.get("lopd_final_heldout_level"), target))


def _calibration_line(results: dict[str, Any]) -> list[str]:
    if "task_calibration" not in results:
        return []
    c = results["task_calibration"]
    if c is None:
        return ["", f"Task calibration: none ({results.get('task_calibration_reason')})."]
    return ["", f"Task calibration ({c['n_heldout']} held-out tasks, greedy, {c.get('source')}): the start student alone "
            f"{c['student_success']:.3f} ({c['student_solved']}), with the retrieved trajectory as text "
            f"{c['text_nearest_success']:.3f} ({c['text_nearest_solved']}), difference {c['difference']:+.3f} "
            f"{_interval(c['difference_ci'])}; the retrieved trajectory is of the same tool for "
            f"{c['same_tool_rate']:.3f} of the tasks."]


def _contrast_lines(results: dict[str, Any]) -> list[str]:
    """One line per ``contrasts`` entry: final training reward (Welch's t over seeds) and final held-out success
    (two-level bootstrap), the method minus the reference."""
    lines = []
    for c in results.get("contrasts") or []:
        head = f"- {c['method']} vs {c['reference']}: "
        if c["reason"]:
            lines.append(head + f"not measured ({c['reason']}).")
            continue
        d, ci, why = c["final_reward_difference"], c["final_reward_difference_ci"], c["final_reward_difference_ci_reason"]
        if d is None:
            reward = f"n/a ({why})"
        elif ci is None:
            reward = f"{d:+.3f} (no interval: {why})"
        else:
            reward = f"{d:+.3f} {_interval(ci)} ({_verdict(ci[0] > 0 or ci[1] < 0)})"
        p = c["heldout_two_level"]
        heldout = f"n/a ({c['heldout_two_level_reason']})" if p is None else _two_level_text(p)
        lines.append(head + f"final training reward {reward}; final held-out success, two-level, {heldout}.")
    if not lines:
        return []
    return ["", "Method against method (method minus reference; training reward: Welch's t over seeds; held-out: "
            "two-level bootstrap over questions and seeds):", *lines]


def _fraction_line(results: dict[str, Any], key: str, label: str, not_reached: str, *, target: str | None,
                   note: str = "", held: tuple[float | None, float | None] = (None, None)) -> list[str]:
    """The line of one budget fraction (``key``: ``lopd_budget_fraction_to_grpo_final`` on training reward, or
    the held-out one): undefined with its reason, or the fraction with its interval over seeds. ``held``:
    (LOPD's final level, GRPO's final level) on the fraction's own trailing means; where LOPD crossed GRPO's
    level but ends below it, the line says so (the fraction counts the first crossing)."""
    undefined = results.get(f"{key}_reason")
    if undefined:
        return ["", f"LOPD's budget to reach GRPO's {label}: undefined ({undefined})."]
    fraction, reason = results[key], results.get(f"{key}_ci_reason")
    reached = not_reached if fraction is None else f"{fraction:.0%} of GRPO's budget"
    line = (f"LOPD's budget to reach GRPO's {label} ({target}): {reached}{note}; 95% bootstrap interval over "
            f"seeds {_interval(results.get(f'{key}_ci'))}" + (f" ({reason})" if reason else "") + ".")
    lopd_final, grpo_final = held
    if fraction is not None and lopd_final is not None and grpo_final is not None and lopd_final < grpo_final - 1e-9:
        line += (f" LOPD did not hold it: it ends at {lopd_final:.3f} on the mean it crossed on, below GRPO's "
                 f"{grpo_final:.3f} (the fraction counts the first crossing).")
    return ["", line]


def _efficiency_line(results: dict[str, Any]) -> list[str]:
    target = results.get("grpo_final_reward")
    if target is None:
        return []
    line = _fraction_line(results, "lopd_budget_fraction_to_grpo_final", "final training reward",
                          "not reached within the budget", target=f"{target:.3f}", note=" (paper: 20%)",
                          held=(results.get("lopd_final_reward"), target))
    if target <= 0 and not results.get("lopd_budget_fraction_to_grpo_final_reason"):
        line[-1] += " GRPO ended at reward 0, so this says nothing."
    return line


def _category_lines(results: dict[str, Any]) -> list[str]:
    """Held-out questions solved per category, start -> end (means over seeds), one row per method."""
    by = results.get("heldout_by_category")
    if not by or not by["methods"]:
        return []
    categories = list(by["categories"])

    def cell(text: str) -> str:  # a user's category or method name must not open a table cell
        return str(text).replace("|", "\\|")

    lines = ["", "Held-out solved per category (the task's `example_category`), first -> last evaluation, mean over seeds:",
             "", "| method | " + " | ".join(f"{cell(c)} ({by['categories'][c]})" for c in categories) + " |",
             "|---|" + "---|" * len(categories)]
    for name, cells in by["methods"].items():
        lines.append(f"| {cell(name)} | " + " | ".join(f"{round(cells[c]['start_solved'], 1):g} -> "  # a mean over 3 seeds:
                                                  f"{round(cells[c]['final_solved'], 1):g}"  # 4.3, not 4.33333
                                                  for c in categories) + " |")
    return lines


def table(results: dict[str, Any]) -> str:
    """The Markdown table of the results: per method the seeds, the final training reward, held-out
    success before and after (with its interval over seeds), the paired differences against the method's
    own start and against GRPO (over questions, and two-level: questions and seeds), wall time and peak memory;
    then the efficiency numbers (training reward and, where compare.json has it, held-out success), the
    contrasts (method against a reference other than GRPO), held-out success per category (tasks with
    ``example_category``) and, for the experience plan, the task calibration."""
    lines = [
        f"Task `{results['task']}`, student `{results['model']}`, budget {results['budget_trajectories']} "
        f"trajectories per run, {results.get('val_examples')} held-out questions (greedy, start "
        f"{_fmt(results.get('start_val_success'))}), src {results.get('src_hash')}, backend "
        f"{results.get('generation_backend')}. Mean ± std across seeds; final reward = trailing mean over "
        f"{results['smooth_window']} steps; held-out interval: Student's t over seeds; vs start / vs GRPO: "
        "per-question paired difference of final held-out success against the method's own start evaluation / "
        "against GRPO's, 95% bootstrap over questions (seed-to-seed variation not included); vs GRPO, two-level: "
        "the same difference, 95% bootstrap over questions and, within each resample, each method's seeds.",
        "",
        "| method | seeds | trajectories | final train reward | held-out before | held-out after [95% CI] "
        "| vs start (won / lost) | vs GRPO (won / lost) | vs GRPO, two-level | wall s / run | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in results["methods"].items():
        lines.append(
            f"| {name} | {','.join(map(str, m['seeds']))} | {m['rollouts'][-1] if m['rollouts'] else 0} | "
            f"{_fmt(m['final_reward'], m['final_reward_std'])} | {_fmt(m['val_before'])} | "
            f"{_fmt(m['val_after'], m['val_after_std'])} {_interval(m.get('val_after_ci'))} | {_paired(m, 'paired_vs_start')} | {_paired(m)} | "
            f"{_two_level(m)} | "
            f"{m['wall_s']:.0f} | {m['peak_mem_mb']:.0f} |"
        )
    return "\n".join(lines + _efficiency_line(results) + _heldout_efficiency_line(results)
                     + _contrast_lines(results) + _category_lines(results) + _calibration_line(results)) + "\n"
