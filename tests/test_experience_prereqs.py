"""benchmarks/experience_prereqs.sh: the experience plan's inputs are checked against the hashes the plan's runs
recorded, and bad input stops it with one line.

The script runs from a copy of the benchmark folder (its ``here``) with a fake plan run file, so that the real
``runs/`` is never touched; the steps' outputs exist already, so nothing is built (the builds are the project's
own commands, tested elsewhere).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "experience_prereqs.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _layout(tmp_path: Path, recorded: dict[str, str]) -> tuple[Path, Path]:
    """``(here, checkout)``: a copy of the script and what it reads, a plan run file recording ``recorded``, and a
    checkout whose ``src`` is the project's and whose ``runs`` is ``here/runs``."""
    here, checkout = tmp_path / "here", tmp_path / "checkout"
    (here / "benchmarks" / "results" / "experience_runs" / "lopd").mkdir(parents=True)
    for name in ("experience_prereqs.sh", "compare_provenance.py", "common.py"):
        shutil.copy2(REPO / "benchmarks" / name, here / "benchmarks" / name)
    run = {"provenance": {f"{k}_hash": v for k, v in recorded.items()}}
    (here / "benchmarks" / "results" / "experience_runs" / "lopd" / "seed_1.json").write_text(json.dumps(run))
    (here / "runs").mkdir()
    checkout.mkdir()
    (checkout / "src").symlink_to(REPO / "src")
    (checkout / "runs").symlink_to(here / "runs")
    return here, checkout


def _student(here: Path, content: bytes) -> str:
    """Write a stand-in student's weights; returns the hash the runs record (``student_hash``)."""
    folder = here / "runs" / "hidden_rules" / "sft_student_in_context"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(content)
    return hashlib.sha256(content).hexdigest()[:16]


def _run(here: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(here / "benchmarks" / "experience_prereqs.sh"), *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_a_matching_student_passes_and_a_different_one_stops(tmp_path):
    here, checkout = _layout(tmp_path, {"student": hashlib.sha256(b"weights").hexdigest()[:16]})
    recorded = _student(here, b"weights")
    ok = _run(here, str(checkout), "student")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"student: {recorded}, as the plan's runs recorded" in ok.stdout

    (here / "runs" / "hidden_rules" / "sft_student_in_context" / "model.safetensors").write_bytes(b"other weights")
    bad = _run(here, str(checkout), "student", "bank")
    assert bad.returncode == 1
    got = hashlib.sha256(b"other weights").hexdigest()[:16]
    assert f"error: the rebuilt student hashes {got}, the plan's runs recorded {recorded}" in bad.stdout
    assert "bank:" not in bad.stdout  # stopped before the next step


def test_bad_input_is_one_line(tmp_path):
    here, checkout = _layout(tmp_path, {"student": "0" * 16})
    usage = _run(here)
    assert usage.returncode != 0 and "usage: benchmarks/experience_prereqs.sh CHECKOUT" in usage.stderr

    unknown = _run(here, str(checkout), "studnet")
    assert unknown.returncode == 1
    assert unknown.stdout.strip().splitlines()[-1] == "error: unknown step 'studnet': use student, bank or composer"

    (checkout / "runs").unlink()
    (checkout / "runs").mkdir()  # a checkout with runs/ of its own: the plan's files would land elsewhere
    unlinked = _run(here, str(checkout), "student")
    assert unlinked.returncode == 1
    assert unlinked.stdout.strip() == f"error: {checkout}/runs is not {here}/runs: ln -sfn {here}/runs {checkout}/runs"
