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


def _layout(tmp_path: Path, recorded: dict[str, str], versions: dict[str, str | None] | None = None) -> tuple[Path, Path]:
    """``(here, checkout)``: a copy of the script and what it reads (a plan run file recording ``recorded`` and the
    ``src`` tree of the checkout, the start student's record with ``versions``, default this interpreter's), and a
    git checkout whose ``src`` links to the project's and whose ``runs`` is ``here/runs``."""
    here, checkout = tmp_path / "here", tmp_path / "checkout"
    results = here / "benchmarks" / "results"
    (results / "experience_runs" / "lopd").mkdir(parents=True)
    for name in ("experience_prereqs.sh", "compare_provenance.py", "common.py", "compare_args.py", "compare_plans.py",
                 "compare_runs.py", "compare_sweep.py", "compare_stats.py"):
        shutil.copy2(REPO / "benchmarks" / name, here / "benchmarks" / name)
    (here / "runs").mkdir()
    checkout.mkdir()
    (checkout / "src").symlink_to(REPO / "src")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "src"], ["commit", "-q", "-m", "src"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    tree = subprocess.run([*git, "rev-parse", "HEAD:src"], check=True, capture_output=True, text=True).stdout.strip()
    (checkout / "runs").symlink_to(here / "runs")  # after the commit: runs/ is not part of the checkout's tree
    run = {"src": {"src_tree": tree}, "provenance": {f"{k}_hash": v for k, v in recorded.items()}}
    (results / "experience_runs" / "lopd" / "seed_1.json").write_text(json.dumps(run))
    if versions is None:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from common import package_versions

        versions = package_versions()
    (results / "start_student_hidden_rules_in_context_rebuilt.json").write_text(json.dumps({"versions": versions}))
    return here, checkout


def _student(here: Path, content: bytes) -> str:
    """Write a stand-in student's weights; returns the hash the runs record (``student_hash``)."""
    folder = here / "runs" / "hidden_rules" / "sft_student_in_context"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(content)
    return hashlib.sha256(content).hexdigest()[:16]


def _run(here: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, **extra}
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


def test_a_declared_rebuild_goes_on_and_only_the_declared_pair_does(tmp_path):
    recorded = hashlib.sha256(b"weights").hexdigest()[:16]
    here, checkout = _layout(tmp_path, {"student": recorded, "bank": "0" * 16})
    rebuilt = _student(here, b"rebuilt weights")
    bank = here / "runs" / "experience" / "bank"
    bank.mkdir(parents=True)
    (bank / "meta.json").write_text("{}")  # built already: the step only checks its hash

    # declared: the student step passes and the script goes on to the bank, which it checks as usual
    # (with another rebuild's declaration beside it, as compare.py takes several for one kind)
    done = _run(here, str(checkout), "student", "bank", "--same-input", f"student:{'1' * 16}={recorded}",
                "--same-input", f"student:{rebuilt}={recorded}")
    assert f"student: {rebuilt}, declared the plan's {recorded} (--same-input student:{rebuilt}={recorded})" in done.stdout
    assert done.returncode == 1
    assert done.stdout.strip().splitlines()[-1].startswith("error: the rebuilt bank hashes ")

    # a declaration of another rebuilt hash, or for another kind, does not cover this one
    for declaration in (f"student:{'1' * 16}={recorded}", f"bank:{rebuilt}={recorded}"):
        bad = _run(here, str(checkout), "--same-input", declaration, "student", "bank")
        assert bad.returncode == 1
        assert bad.stdout.strip().splitlines()[-1].startswith(
            f"error: the rebuilt student hashes {rebuilt}, the plan's runs recorded {recorded}")
        assert bad.stdout.rstrip().endswith(f"--same-input student:{rebuilt}={recorded})")
        assert "bank:" not in bad.stdout


def test_bad_input_is_one_line(tmp_path):
    here, checkout = _layout(tmp_path, {"student": "0" * 16})
    usage = _run(here)
    assert usage.returncode == 2 and "usage: benchmarks/experience_prereqs.sh CHECKOUT" in usage.stderr

    def last_line(*args: str, **env: str) -> str:
        done = _run(here, *args, **env)
        assert done.returncode == 1, done.stdout + done.stderr
        return done.stdout.strip().splitlines()[-1]

    # a typo'd step is refused before any step runs (a build can take an hour)
    assert last_line(str(checkout), "student", "studnet") == (
        "error: unknown step 'studnet': use student, bank, composer or composer_paper (or --same-input "
        "KIND:REBUILT=ORIGINAL)")
    assert last_line(str(checkout), "student", "--same-input") == (
        "error: --same-input needs KIND:REBUILT=ORIGINAL, for example --same-input student:66976bd00baa61a7=3761f00976a961fa")
    # a malformed declaration: compare.py's own refusal (compare_args.same_inputs), before any step
    for value in ("studnet:" + "1" * 16 + "=" + "2" * 16, "student:" + "1" * 16, "student:" + "1" * 16 * 2):
        done = _run(here, str(checkout), "--same-input", value, "student")
        assert done.returncode == 1 and "student:" not in done.stdout, done.stdout + done.stderr
        assert done.stderr.strip().splitlines() == [
            f"error: --same-input {value}: give KIND:REBUILT=ORIGINAL with KIND one of student, bank, composer and two "
            "different hashes (e.g. student:66976bd00baa61a7=3761f00976a961fa)"]
    two = _run(here, str(checkout), "--same-input", "student:" + "1" * 16 + "=" + "2" * 16, "--same-input",
               "student:" + "1" * 16 + "=" + "3" * 16, "student")
    assert two.returncode == 1 and "declared the same as both" in two.stderr.strip().splitlines()[-1]
    missing = tmp_path / "nowhere"
    assert last_line(str(missing)) == f"error: CHECKOUT {missing} is not a folder: git worktree add --detach {missing} 151c2ab (the plan's commit)"
    for python in ("/bin/true_not_there", str(tmp_path)):
        assert last_line(str(checkout), "student", PYTHON=python) == (
            f"error: PYTHON={python} is not a Python interpreter: run make install, or set PYTHON")

    (checkout / "runs").unlink()
    (checkout / "runs").mkdir()  # a checkout with runs/ of its own: the plan's files would land elsewhere
    assert last_line(str(checkout), "student") == (
        f"error: {checkout}/runs is not {here}/runs: move {checkout}/runs away, then ln -s {here}/runs {checkout}/runs")


def test_another_src_tree_or_other_libraries_are_refused_before_any_step(tmp_path):
    here, checkout = _layout(tmp_path, {"student": "0" * 16})
    run_file = here / "benchmarks" / "results" / "experience_runs" / "lopd" / "seed_1.json"
    run = json.loads(run_file.read_text())
    tree = run["src"]["src_tree"]
    run["src"]["src_tree"] = "f" * 40
    run_file.write_text(json.dumps(run))
    line = _run(here, str(checkout), "student").stdout.strip().splitlines()[-1]
    assert line == (f"error: {checkout}'s src/ is tree {tree}, the plan's runs had {'f' * 40}: check out the plan's "
                    "commit (151c2ab)")

    here, checkout = _layout(tmp_path / "versions", {"student": "0" * 16}, versions={"transformers": "0.0.1"})
    done = _run(here, str(checkout), "student")
    assert done.returncode == 1
    assert "error: PYTHON's libraries differ from the start student's (have, built with): transformers " in done.stderr
    assert " / 0.0.1: install those versions" in done.stderr


def _composer(here: Path, folder: str, content: bytes) -> str:
    """Write a stand-in pretrained composer (built already: the step only checks it); returns its composer_hash."""
    (here / "runs" / "experience" / folder).mkdir(parents=True)
    (here / "runs" / "experience" / folder / "composer.pt").write_bytes(content)
    return hashlib.sha256(content).hexdigest()[:16]


def _paper_run(here: Path, seed: int, composer: str | None, tree: str) -> None:
    """A committed lopd_paper run file recording ``composer`` and the src tree ``tree``."""
    folder = here / "benchmarks" / "results" / "experience_runs" / "lopd_paper"
    folder.mkdir(parents=True, exist_ok=True)
    run = {"src": {"src_tree": tree}, "git_sha": "abc1234", "provenance": {"composer_hash": composer}}
    (folder / f"seed_{seed}.json").write_text(json.dumps(run))


def test_composer_paper_reports_its_hash_until_a_lopd_paper_run_records_one(tmp_path):
    """lopd_paper's own composer (runs/experience/composer_paper): checked against nothing while no committed
    lopd_paper run recorded a composer (the hash it built is reported, and the src tree it built on, which need
    not be the plan's), then against that run's hash and src tree; the shared composer's check is unchanged."""
    here, checkout = _layout(tmp_path, {"composer": "0" * 16})
    built = _composer(here, "composer_paper", b"paper phi")
    run_file = here / "benchmarks" / "results" / "experience_runs" / "lopd" / "seed_1.json"
    plan = json.loads(run_file.read_text())
    tree = plan["src"]["src_tree"]
    run_file.write_text(json.dumps({**plan, "src": {"src_tree": "f" * 40}}))  # the plan's runs: another src tree
    done = _run(here, str(checkout), "composer_paper")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines() == [
        f"composer_paper: no committed lopd_paper run yet; building on {checkout}'s src/ tree {tree} (the lopd_paper "
        "runs must run on it)",
        f"composer_paper: {built} (no committed lopd_paper run records a composer_hash yet: those runs will record this one)"]
    bad = _run(here, str(checkout), "composer", "composer_paper")  # the shared composer still needs the plan's tree
    assert bad.returncode == 1 and bad.stdout.strip().splitlines()[-1].startswith(f"error: {checkout}'s src/ is tree {tree}, "
                                                                                  f"the plan's runs had {'f' * 40}")
    run_file.write_text(json.dumps(plan))

    _paper_run(here, 0, None, "e" * 40)  # a run without a composer hash is not the reference
    _paper_run(here, 1, built, tree)
    done = _run(here, str(checkout), "composer_paper")
    assert done.returncode == 0 and done.stdout.strip().splitlines() == [f"composer_paper: {built}, as the plan's runs recorded"]
    _paper_run(here, 1, "1" * 16, tree)  # another composer recorded: stops, and a declaration of it goes on
    bad = _run(here, str(checkout), "composer_paper")
    assert bad.returncode == 1
    assert bad.stdout.strip().splitlines()[-1].startswith(f"error: the rebuilt composer_paper hashes {built}, the plan's "
                                                          f"runs recorded {'1' * 16} (remove runs/experience/composer_paper")
    assert bad.stdout.rstrip().endswith(f"--same-input composer:{built}={'1' * 16})")
    declared = _run(here, str(checkout), "composer_paper", "--same-input", f"composer:{built}={'1' * 16}")
    assert declared.returncode == 0
    assert declared.stdout.strip() == f"composer_paper: {built}, declared the plan's {'1' * 16} (--same-input composer:{built}={'1' * 16})"
    _paper_run(here, 1, built, "d" * 40)  # the lopd_paper runs ran on another src tree: refused before any step
    bad = _run(here, str(checkout), "composer_paper")
    assert bad.stdout.strip().splitlines()[-1] == (
        f"error: {checkout}'s src/ is tree {tree}, the lopd_paper runs had {'d' * 40} "
        "(benchmarks/results/experience_runs/lopd_paper/seed_1.json): check out their commit, abc1234")
