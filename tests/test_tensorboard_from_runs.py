"""benchmarks/tensorboard_from_runs.py: a comparison's run files written back as one TensorBoard root, under the
tags the live runs log, with the values of the run files; refusals in one line."""

from __future__ import annotations

import json

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


def test_bad_run_files_are_refused_before_anything_is_written(tb, tmp_path):
    runs_dir, out = tmp_path / "runs", tmp_path / "tb"
    good = fake_run("grpo", 0, final={"q0": True})
    no_curve = {k: v for k, v in fake_run("opsd", 0, final={"q0": True}).items() if k != "curve"}
    write_runs(runs_dir, good, no_curve)
    with pytest.raises(SystemExit, match=r"^error: --runs-dir .*: opsd/seed_0\.json: no `curve` \(the training reward "
                                         r"per step\): not a run file that compare\.py wrote$"):
        tb.main(["--runs-dir", str(runs_dir), "--out", str(out)])
    broken = fake_run("opsd", 0, final={"q0": True})
    broken["evaluations"][1]["success"] = None
    write_runs(runs_dir, broken)
    with pytest.raises(SystemExit, match=r"^error: .*opsd/seed_0\.json: evaluations holds a point that is not "
                                         r"\(number, number\)"):
        tb.main(["--runs-dir", str(runs_dir), "--out", str(out)])
    assert not out.exists()  # the good run before the bad one was not written either
    (runs_dir / "opsd" / "seed_0.json").unlink()
    out.write_text("a file")
    with pytest.raises(SystemExit, match=r"^error: --out .* is a file; give a folder"):
        tb.main(["--runs-dir", str(runs_dir), "--out", str(out)])


def test_each_run_file_has_its_own_folder_and_mixed_runs_are_noted(tb, tmp_path, capsys):
    runs_dir, out = tmp_path / "runs", tmp_path / "tb"
    write_runs(runs_dir, fake_run("grpo", 0, final={"q0": True}, curve=(0.0, 0.25)))
    old = fake_run("grpo", 0, final={"q0": False}, curve=(0.5, 0.5), src="bbbb2222")  # a copy kept beside it
    (runs_dir / "grpo" / "seed_0_old.json").write_text(json.dumps(old))
    written = tb.main(["--runs-dir", str(runs_dir), "--out", str(out)])
    assert sorted(written) == ["grpo/seed_0", "grpo/seed_0_old"]
    assert scalars(out / "grpo" / "seed_0")[0]["by_rollouts/reward_mean"] == [(4, 0.0), (8, 0.25)]
    assert scalars(out / "grpo" / "seed_0_old")[0]["by_rollouts/reward_mean"] == [(4, 0.5), (8, 0.5)]
    assert len(list((out / "grpo" / "seed_0").glob("events.out.tfevents.*"))) == 1
    printed = capsys.readouterr().out
    assert ("note: these runs overlay, but compare.py --aggregate-only would not aggregate them as they are: refusing "
            "to aggregate runs from 2 src trees") in printed
