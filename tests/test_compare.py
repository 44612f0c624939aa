"""benchmarks/compare.py: every method end to end on the tiny model (a budget of a few trajectories),
the results JSON / PNG / table, the reuse of finished runs, and the efficiency number on hand-made curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lopd_lightning import deprecation
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "compare_tiny"


@pytest.fixture(scope="module")
def compare():
    return load_benchmark("compare")


def test_every_method_runs_and_the_results_are_written(compare, tmp_path):
    out = tmp_path / "results"
    args = ["--config-dir", str(TINY), "--budget", "4", "--seeds", "0", "--root", str(tmp_path / "runs"),
            "--out-dir", str(out), "--in-process"]
    results = compare.main(args)
    data = json.loads((out / "compare.json").read_text())
    assert set(data["methods"]) == {"lopd", "grpo", "sdpo", "opsd", "skill_sd"}
    for name, m in data["methods"].items():
        assert m["rollouts"] == [4], name  # one step of 4 trajectories, counted by the module
        assert len(m["reward"]) == len(m["reward_std"]) == 1 and 0.0 <= m["reward"][0] <= 1.0
        assert m["seeds"] == [0]
        assert m["val_before"] is not None and m["val_after"] is not None
        assert m["wall_s"] > 0 and m["peak_mem_mb"] > 0
        assert (tmp_path / "runs" / name / "seed_0" / "run.yaml").exists()
    for key in ("lopd_budget_fraction_to_grpo_final", "task", "model", "git_sha", "versions", "hardware"):
        assert key in data
    assert data["task"] == "toy" and data["model"] == "tiny"
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "compare.md").read_text()
    assert table.count("\n| ") == 1 + 5  # header and one row per method
    assert results["methods"].keys() == data["methods"].keys()

    # a second call with --reuse reads the finished runs back instead of training again
    again = compare.main([*args, "--reuse"])
    for name, m in data["methods"].items():
        assert again["methods"][name]["reward"] == m["reward"]
        assert again["methods"][name]["wall_s"] == m["wall_s"]  # read back, not measured again


def test_budget_smaller_than_one_step_fails_before_any_run(compare, tmp_path):
    with pytest.raises(ValueError, match="--budget 2 is smaller than one grpo step"):
        compare.main(["--config-dir", str(TINY), "--budget", "2", "--methods", "grpo", "--root", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_trajectories_per_step_must_be_explicit(compare):
    with pytest.raises(ValueError, match="must set model.init_args.group_size"):
        compare.trajectories_per_step({"data": {"init_args": {"examples_per_step": 2}}, "model": {"init_args": {}}})
    assert compare.trajectories_per_step(
        {"data": {"init_args": {"examples_per_step": 2}}, "model": {"init_args": {"group_size": 4}}}) == 8
    # a config of an earlier release (the group size's former name) still counts, with a warning
    deprecation._warned.discard("model.init_args.rollouts_per_example")
    with pytest.warns(FutureWarning, match="model.init_args.rollouts_per_example is deprecated"):
        assert compare.trajectories_per_step(
            {"data": {"init_args": {"examples_per_step": 2}}, "model": {"init_args": {"rollouts_per_example": 4}}}) == 8


def test_unknown_method_is_named(compare, tmp_path):
    with pytest.raises(SystemExit, match="no config for \\['ppo'\\]"):
        compare.main(["--config-dir", str(TINY), "--methods", "ppo", "--root", str(tmp_path)])


def test_budget_fraction_on_hand_made_curves(compare):
    grpo = {"rollouts": [4, 8, 12, 16, 20], "reward": [0.0, 0.25, 0.25, 0.5, 0.5]}
    # GRPO's final smoothed reward (window 2): (0.5 + 0.5) / 2 = 0.5
    lopd = {"rollouts": [4, 8, 12, 16, 20], "reward": [0.25, 0.5, 0.75, 0.75, 1.0]}
    # LOPD smoothed: 0.25, 0.375, 0.625 -> first >= 0.5 at 12 trajectories: 12 / 20
    assert compare.budget_fraction(lopd, grpo, 2) == pytest.approx(0.6)
    # one lucky first batch is not a full window: LOPD [0.75, 0, 0.25, 0.25, 0.25] never holds 0.5
    lucky = {"rollouts": [4, 8, 12, 16, 20], "reward": [0.75, 0.0, 0.25, 0.25, 0.25]}
    assert compare.budget_fraction(lucky, grpo, 2) is None
    never = {"rollouts": [4, 8], "reward": [0.0, 0.25]}
    assert compare.budget_fraction(never, grpo, 2) is None
    assert compare.smooth([1.0, 0.0, 1.0], 2) == [1.0, 0.5, 0.5]


def test_summary_averages_seeds(compare):
    def run(seed, rewards, after):
        return {"seed": seed, "curve": list(zip([4, 8], rewards)), "wall_s": 10.0 + seed,
                "summary": {"after": after, "peak_rss_mb": 100.0 * (seed + 1), "seconds_per_step_median": {}}}

    runs = {"grpo": [run(0, [0.0, 0.5], 0.25), run(1, [0.5, 1.0], 0.75)]}
    result = compare.summarise(runs, task="toy", model="tiny", budget=8, smooth_window=1, val_before=0.1)
    m = result["methods"]["grpo"]
    assert m["rollouts"] == [4, 8]
    assert m["reward"] == pytest.approx([0.25, 0.75])
    assert m["reward_std"] == pytest.approx([0.5 ** 0.5 * 0.5, 0.5 ** 0.5 * 0.5])  # sample std of two points
    assert m["val_after"] == pytest.approx(0.5) and m["val_before"] == 0.1
    assert m["wall_s"] == pytest.approx(10.5) and m["peak_mem_mb"] == 200.0
    assert m["final_reward"] == pytest.approx(0.75)
