"""benchmarks/step_cost.py end to end in quick mode: the tiny random model on the toy task, CPU, seconds."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import load_benchmark




@pytest.fixture(scope="module")
def step_cost():
    return load_benchmark("step_cost")


def test_step_cost_quick_writes_json(step_cost, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "sub" / "step_cost.json"
        argv = ["--quick", "--out", str(out)]
        report = step_cost.main(argv)
    finally:
        torch.set_num_threads(threads)

    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))
    for key in ("benchmark", "model", "task", "settings", "methods", "ratio_lopd_over_grpo",
                "ratio_excluding_generation", "floor", "distance_to_floor", "floor_explanation", "target",
                "versions", "hardware", "seed", "git_sha", "timestamp", "argv"):
        assert key in data, key
    assert data["benchmark"] == "step_cost" and data["model"] == "tiny" and data["task"] == "toy"
    assert data["argv"] == argv and data["seed"] == 0
    assert data["settings"]["lopd_layout"] == "4x1" and data["settings"]["grpo_layout"] == "1x4"

    lopd, grpo = data["methods"]["lopd"], data["methods"]["grpo"]
    assert {"generation", "retrieval", "teacher", "student_step", "backward", "composer_step", "memory_refresh",
            "other"} <= set(lopd["phases_median_s"])
    assert {"generation", "student_step", "other"} <= set(grpo["phases_median_s"])
    for method in (lopd, grpo):
        assert method["steps_measured"] == 1 and len(method["per_step"]) == 1 and len(method["warmup_steps"]) == 1
        assert all(v > 0 for v in method["phases_median_s"].values()), method["phases_median_s"]
        assert method["step_total_median_s"] > 0
        # generation happens in the DataModule before on_train_batch_start: it is inside the step total
        step = method["per_step"][0]
        assert step["step_total"] >= step["generation"] + step["student_step"] - 1e-3
        assert step["trajectories"] == 4
        assert method["peak_rss_mb_process"] > 0
    assert lopd["bank_size"] == 24  # the toy train split's reference solutions

    ratio = lopd["step_total_median_s"] / grpo["step_total_median_s"]
    assert data["ratio_lopd_over_grpo"] == pytest.approx(ratio, rel=1e-3)
    ex = lopd["step_excluding_generation_median_s"] / grpo["step_excluding_generation_median_s"]
    assert data["ratio_excluding_generation"] == pytest.approx(ex, rel=1e-3)

    floor = data["floor"]
    for unit in ("composer_path_s", "teacher_forward_unit_s", "composer_forward_s", "composer_fwd_bwd_s", "anchor_forward_s",
                 "student_update_warm_s", "lopd_update_warm_s"):
        assert floor[unit] > 0, unit
    assert floor["update_warm_ratio_to_floor"] == pytest.approx(
        floor["lopd_update_warm_s"] / (floor["student_update_warm_s"] + floor["composer_path_s"]), rel=1e-3)
    assert floor["floor_lopd_s"] == pytest.approx(grpo["step_total_median_s"] + floor["composer_path_s"], abs=1e-3)
    for name in ("generation", "retrieval", "teacher_and_update", "memory_refresh", "other", "step_total"):
        assert {"measured_s", "floor_s", "excess_s", "ratio"} <= set(data["distance_to_floor"][name])
    assert data["distance_to_floor"]["step_total"]["measured_s"] == pytest.approx(lopd["step_total_median_s"])


def test_step_cost_rejects_bad_layout(step_cost):
    with pytest.raises(SystemExit):
        step_cost.parse_args(["--trajectories", "6", "--grpo-group", "4"])
    with pytest.raises(SystemExit):
        step_cost.parse_args(["--grpo-group", "1"])
