"""Benchmarks: eval_base end to end with a tiny random model on the toy task, and the shared metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark




@pytest.fixture(scope="module")
def eval_base():
    return load_benchmark("eval_base")


def test_eval_base_tiny_toy_writes_json(eval_base, tmp_path):
    out = tmp_path / "sub" / "eval_base.json"
    argv = ["--model", "tiny", "--tasks", "toy", "--limit", "2", "--out", str(out), "--device", "cpu"]
    report = eval_base.main(argv)

    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))  # what is returned is what is written
    assert not list(out.parent.glob("*.tmp"))  # the atomic write left no temporary file
    assert data["benchmark"] == "eval_base" and data["model"] == "tiny" and data["complete"] is True
    for key in ("versions", "hardware", "seed", "git_sha", "timestamp", "argv", "settings", "wall_seconds"):
        assert key in data, key
    assert data["argv"] == argv and data["seed"] == 0
    assert {"python", "torch", "transformers", "lightning", "peft", "faiss"} <= set(data["versions"])
    assert {"platform", "cpu", "cpu_count", "cpu_capability", "gpu"} <= set(data["hardware"])
    assert data["settings"]["decoding"] == "greedy" and data["settings"]["generation_batch_size"] == 8

    assert list(data["tasks"]) == ["toy"]
    toy = data["tasks"]["toy"]
    for key in ("n", "metric", "seconds_total", "seconds_per_example", "mean_generated_tokens", "truncated",
                "truncated_replies", "max_new_tokens", "per_example"):
        assert key in toy, key
    assert toy["n"] == 2 and toy["metric"] == "accuracy" and 0.0 <= toy["accuracy"] <= 1.0
    assert len(toy["per_example"]) == 2
    assert toy["planned_n"] == 8 and toy["reduced_by"] == "--limit"  # the toy val split holds 8
    assert toy["max_new_tokens"] == 16 and 0 < toy["mean_generated_tokens"] <= 16
    cut = sum("length" in e["stop_reasons"] for e in toy["per_example"])
    assert toy["truncated"] == toy["truncated_replies"] == cut


def test_eval_base_merge_replaces_only_the_tasks_it_runs(eval_base, tmp_path):
    """--merge keeps the other tasks of the file with the run that made them; another model is refused."""
    out = tmp_path / "eval_base.json"
    first = eval_base.main(["--model", "tiny", "--tasks", "toy", "--limit", "1", "--out", str(out), "--device", "cpu"])
    assert first["tasks"]["toy"]["run"]["argv"] == first["argv"]
    data = json.loads(out.read_text())
    older = {k: v for k, v in data["tasks"]["toy"].items() if k != "run"}  # as written before runs were per task
    data["tasks"]["older"] = older
    out.write_text(json.dumps(data))
    argv = ["--model", "tiny", "--tasks", "toy", "--limit", "2", "--out", str(out), "--device", "cpu", "--merge"]
    eval_base.main(argv)
    merged = json.loads(out.read_text())
    assert list(merged["tasks"]) == ["older", "toy"] and merged["complete"] is True
    assert merged["tasks"]["older"] == {"run": {"settings": first["settings"], "git_sha": first["git_sha"],
                                                "timestamp": first["timestamp"], "argv": first["argv"]}, **older}
    assert merged["tasks"]["toy"]["n"] == 2 and merged["tasks"]["toy"]["run"]["argv"] == argv == merged["argv"]
    data["model"] = "other"
    out.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="holds model 'other'"):
        eval_base.main(argv)
    assert json.loads(out.read_text()) == data  # nothing lost


def test_eval_base_rejects_unknown_task(eval_base):
    with pytest.raises(SystemExit):
        eval_base.parse_args(["--tasks", "nope"])


def test_write_json_atomic_replaces(tmp_path):
    common = load_benchmark("common")
    path = tmp_path / "r.json"
    common.write_json_atomic({"a": 1}, path)
    common.write_json_atomic({"a": 2}, path)
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_cpu_capability_reports_the_kernels_that_run():
    """hardware.cpu_capability names the instruction set ATen's kernels dispatch to: ATEN_CPU_CAPABILITY=default
    (the baseline x86-64 kernels) must read back as DEFAULT, so a result run under a lowered capability says so.
    A fresh interpreter: torch reads the variable once."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    code = "import common; print(common.cpu_capability())"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1] / "benchmarks", env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "DEFAULT"


def test_git_sha_is_dirty_for_changes_outside_the_results_folder_only(tmp_path):
    """A result written into benchmarks/results/ (new or again) leaves the sha clean; an untracked or changed
    file anywhere else makes it -dirty."""
    import subprocess

    common = load_benchmark("common")

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "src.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results" / "old.json").write_text("{}\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    sha = common.git_sha(tmp_path)
    assert sha is not None and len(sha) == 40
    (tmp_path / "benchmarks" / "results" / "new.json").write_text("{}\n")  # a first write
    (tmp_path / "benchmarks" / "results" / "old.json").write_text('{"a": 1}\n')  # written again
    assert common.git_sha(tmp_path) == sha
    (tmp_path / "scratch.py").write_text("y = 2\n")  # an untracked file elsewhere
    assert common.git_sha(tmp_path) == f"{sha}-dirty"
    (tmp_path / "scratch.py").unlink()
    (tmp_path / "src.py").write_text("x = 2\n")  # a changed tracked file
    assert common.git_sha(tmp_path) == f"{sha}-dirty"
