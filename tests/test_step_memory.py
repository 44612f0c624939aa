"""benchmarks/step_memory.py: the live-bytes tracker against hand-counted storages, and a quick end-to-end run."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from helpers import load_benchmark


@pytest.fixture(scope="module")
def step_memory():
    return load_benchmark("step_memory")


def test_live_bytes_counts_new_storages_until_freed(step_memory):
    tracker = step_memory.LiveBytes()
    with tracker:
        tracker.set_phase("a")
        x = torch.zeros(1000)  # 4000 B
        y = torch.zeros(500, dtype=torch.float64)  # 4000 B -> 8000
        view = x[10:]  # a view: no new storage
        x.add_(1)  # in place: no new storage
        del x  # the view keeps the storage alive
        gc.collect()
        tracker.set_phase("b")
        z = torch.ones(250)  # 1000 B -> 9000, the peak, in phase b
        del view
        gc.collect()  # x's storage freed -> 5000
        w = torch.ones(100, dtype=torch.int8)  # 100 B -> 5100
    assert tracker.peak == 9000 and tracker.peak_phase == "b"
    assert tracker.current == 5100
    assert tracker.peak_by_phase == {"a": 8000, "b": 9000}
    del y, z, w


def test_live_bytes_ignores_views_and_in_place_results_of_older_storages(step_memory):
    weight = torch.randn(8, 4)  # made before the tracking: a parameter's storage
    state = torch.zeros(8, 4)  # optimiser state, updated in place
    tracker = step_memory.LiveBytes()
    with tracker:
        transposed = weight.t()  # a view of an older storage: 0 B
        state.add_(1.0)  # in place on an older storage: 0 B
        torch.mul(weight, 2.0, out=state)  # out= into an older storage: 0 B
        y = torch.nn.functional.linear(torch.ones(3, 4), weight)  # the input (48 B) and the output (96 B)
    assert tracker.peak == 3 * 4 * 4 + 3 * 8 * 4
    del transposed, y


def test_resident_bytes_counts_parameters_grads_and_state_once(step_memory):
    model = torch.nn.Linear(10, 4)  # 40 + 4 floats
    opt = torch.optim.Adam(model.parameters())
    assert step_memory.resident_bytes(model, [opt]) == 44 * 4
    model(torch.randn(3, 10)).sum().backward()
    opt.step()  # grads (44) + exp_avg, exp_avg_sq (2 x 44) + two 0-d steps (4 B each as float32)
    assert step_memory.resident_bytes(model, [opt]) == 4 * 44 * 4 + 2 * 4


@pytest.mark.parametrize(("argv", "says"), [
    (["--cases", "lopd:maybe"], "method:on|off"),
    (["--cases", ","], "--cases is empty"),
    (["--trajectories", "3"], "multiple of 4"),
    (["--warmup", "-1"], "--warmup >= 0"),
    (["--quick"], "--quick needs --out"),
    (["--model", "/no/such/folder"], "no such folder"),
])
def test_bad_input_names_the_option(step_memory, capsys, argv, says):
    with pytest.raises(SystemExit):
        step_memory.parse_args(argv)
    err = capsys.readouterr().err
    assert says in err.splitlines()[-1]


@pytest.mark.slow
def test_a_failing_case_is_one_line(step_memory, tmp_path):
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    with pytest.raises(SystemExit) as exc:
        step_memory.main(["--model", str(empty), "--cases", "grpo:off", "--threads", "1", "--out", str(tmp_path / "x.json")])
    message = str(exc.value)
    assert message.startswith("error: case grpo:off failed: ") and "\n" not in message
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_step_memory_quick_writes_json(step_memory, tmp_path):
    out = tmp_path / "step_memory.json"
    report = step_memory.main(["--quick", "--threads", "1", "--cases", "grpo:off,lopd:on", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))
    assert data["benchmark"] == "step_memory" and data["model"] == "tiny"
    cases = {(c["method"], c["gradient_checkpointing"]): c for c in data["cases"]}
    assert set(cases) == {("grpo", False), ("lopd", True)}
    for c in cases.values():
        assert c["trajectories"] == 4 and c["rss_peak_mb"] > 0 and c["live_peak_mb"] > 0
        assert c["live_peak_phase"] in c["live_peak_by_phase_mb"]
        assert max(c["live_peak_by_phase_mb"].values()) == pytest.approx(c["live_peak_mb"], abs=0.1)
        assert "generation" in c["live_peak_by_phase_mb"] and "student_step" in c["live_peak_by_phase_mb"]
        assert c["rss_peak_mb"] >= c["rss_start_mb"] > c["resident_mb"] > 0  # VmHWM reset at the step's start
    assert {"teacher", "backward", "composer_step"} <= set(cases[("lopd", True)]["live_peak_by_phase_mb"])
    assert data["ratio_lopd_over_grpo"] == {}  # no pair with the same checkpointing
    assert isinstance(data["settings"]["allocator_env"], dict)


def test_allocator_env_names_only_allocator_settings(step_memory, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    monkeypatch.setenv("LD_PRELOAD", "libjemalloc.so.2")
    monkeypatch.setenv("NOT_AN_ALLOCATOR_SETTING", "1")
    env = step_memory.allocator_env()
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072" and env["LD_PRELOAD"] == "libjemalloc.so.2"
    assert "NOT_AN_ALLOCATOR_SETTING" not in env
