"""benchmarks/tensorboard_from_runs.py: a comparison's run files written back as one TensorBoard root, under the
tags the live runs log, with the values of the run files; refusals in one line."""

from __future__ import annotations

import pytest

from helpers import load_benchmark
from test_compare import fake_run, write_runs


@pytest.fixture(scope="module")
def tb():
    return load_benchmark("tensorboard_from_runs")


def scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(s.step, pytest.approx(s.value)) for s in events.Scalars(tag)] for tag in events.Tags()["scalars"]}, \
        events.Tags()["tensors"]


def test_every_run_file_becomes_a_run_folder_with_its_curves(tb, tmp_path):
    runs_dir, out = tmp_path / "runs", tmp_path / "tb"
    lopd = fake_run("lopd", 1, start={"q0": True, "q1": False}, final={"q0": True, "q1": True}, curve=(0.25, 0.75))
    lopd["method_curves"] = {"by_rollouts/margin_delta": [[4, 0.5], [8, -0.125]]}
    write_runs(runs_dir, lopd, fake_run("grpo", 0, final={"q0": False, "q1": True}))
    written = tb.main(["--runs-dir", str(runs_dir), "--out", str(out)])
    assert sorted(written) == ["grpo/seed_0", "lopd/seed_1"]
    values, texts = scalars(out / "lopd" / "seed_1")
    # fake_run: training reward at 4 and 8 trajectories, evaluations at steps 0 and 2 (trajectories 0 and 8)
    assert values == {"by_rollouts/reward_mean": [(4, 0.25), (8, 0.75)],
                      "by_rollouts/val_success_rate": [(0, 0.5), (8, 1.0)],
                      "val/success_rate": [(0, 0.5), (2, 1.0)],
                      "by_rollouts/margin_delta": [(4, 0.5), (8, -0.125)]}
    assert "run/provenance/text_summary" in texts
    grpo, _ = scalars(out / "grpo" / "seed_0")
    assert grpo["by_rollouts/val_success_rate"] == [(0, 0.0), (8, 0.5)] and "by_rollouts/margin_delta" not in grpo


def test_refusals_name_the_flag_and_write_nothing(tb, tmp_path):
    with pytest.raises(SystemExit, match=r"^error: --runs-dir .*: no run files \(<method>/seed_<s>\.json\) there"):
        tb.main(["--runs-dir", str(tmp_path / "nothing"), "--out", str(tmp_path / "tb")])
    runs_dir, out = tmp_path / "runs", tmp_path / "tb"
    write_runs(runs_dir, fake_run("grpo", 0, final={"q0": True}), fake_run("grpo", 1, final={"q0": True}))
    tb.main(["--runs-dir", str(runs_dir), "--out", str(out)])
    before = sorted(p.name for p in out.rglob("events.out.tfevents.*"))
    with pytest.raises(SystemExit, match=r"^error: --out .*: .*grpo/seed_0 and 1 more already hold event files; give an "
                                         r"empty folder, so that no run's curves are written twice$"):
        tb.main(["--runs-dir", str(runs_dir), "--out", str(out)])
    assert sorted(p.name for p in out.rglob("events.out.tfevents.*")) == before
