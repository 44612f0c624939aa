"""benchmarks/compare.py --plan experience (issue 33, item 3): the configs (configs/experience), the 21 runs in
their order (the 15 committed first, then lopd_paper and opsd_reference), the held-out evaluations at every 10% of the budget, the learning rates of the sweep (LOPD, GRPO,
OPSD; the others their parent's), the provenance recorded for each run (compare_provenance.py) and the
aggregation's refusal to mix it, the task calibration in experience_compare.json, and a tiny end-to-end run."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

from helpers import load_benchmark
from test_compare import fake_run, write_runs

ROOT = Path(__file__).resolve().parent.parent
EXPERIENCE = ROOT / "configs" / "experience"
TINY = ROOT / "configs" / "experience_tiny"
METHODS = ("lopd", "grpo", "opsd", "skill_sd", "lopd_frozen", "lopd_m0", "lopd_paper", "opsd_reference")
#: the plan's first 15 runs, committed in benchmarks/results/experience_runs: they keep their places
FIRST_15 = [("lopd", 0), ("grpo", 0), ("opsd", 0), ("lopd", 1), ("grpo", 1), ("opsd", 1), ("lopd", 2), ("grpo", 2),
            ("opsd", 2), ("skill_sd", 0), ("skill_sd", 1), ("lopd_frozen", 0), ("lopd_frozen", 1), ("lopd_m0", 0),
            ("lopd_m0", 1)]
#: then the two added methods, seed by seed (the fair twins in pairs)
ORDER = FIRST_15 + [("lopd_paper", 0), ("opsd_reference", 0), ("lopd_paper", 1), ("opsd_reference", 1),
                    ("lopd_paper", 2), ("opsd_reference", 2)]
RESULTS = ROOT / "benchmarks" / "results"
#: the composer folders of the experience configs
COMPOSER, COMPOSER_PAPER = "runs/experience/composer", "runs/experience/composer_paper"


@pytest.fixture(scope="module")
def compare():
    return load_benchmark("compare")


# ---------------------------------------------------------------------- the plan
def test_the_experience_plan_lists_its_runs_in_order(compare, tmp_path, capsys):
    assert compare.experience_plan() == ORDER and len(ORDER) == 21
    committed = sorted((p.parent.name, int(p.stem.removeprefix("seed_")))
                       for p in (RESULTS / "experience_runs").glob("*/seed_*.json"))
    assert sorted(ORDER[:15]) == committed  # the committed runs come first, in their order
    (tmp_path / "experience_lr_sweep.json").write_text(json.dumps({"chosen": {"lopd": 3e-5, "grpo": 1e-5, "opsd": 1e-4}}))
    base = ["--plan", "experience", "--dry-run", "--out-dir", str(tmp_path), "--root", str(tmp_path / "runs")]
    rows = compare.main(base)["plan"]
    # LOPD's ablations and lopd_paper take LOPD's rate, Skill-SD GRPO's (SkillSDModule derives from GRPOModule),
    # opsd_reference OPSD's
    rates = {"lopd": 3e-5, "lopd_frozen": 3e-5, "lopd_m0": 3e-5, "grpo": 1e-5, "skill_sd": 1e-5, "opsd": 1e-4,
             "lopd_paper": 3e-5, "opsd_reference": 1e-4}
    assert [(r["method"], r["run"], r["budget"], r["steps"], r["learning_rate"], r["state"]) for r in rows] == [
        (m, f"seed_{s}", 280, 70, rates[m], "new") for m, s in ORDER]
    parents = compare.compare_plans.EXPERIENCE_PARENTS
    assert (parents["skill_sd"], parents["lopd_paper"], parents["opsd_reference"]) == ("grpo", "lopd", "opsd")
    others = compare.compare_plans.EXPERIENCE_OTHERS
    assert "lopd_paper (LOPD in its authors' setting) takes LOPD's" in others and "opsd_reference" in others
    rows = compare.main([*base, "--only", "opsd_reference:2", "lopd_paper:0"])["plan"]
    assert [(r["method"], r["run"], r["learning_rate"]) for r in rows] == [("lopd_paper", "seed_0", 3e-5),
                                                                          ("opsd_reference", "seed_2", 1e-4)]
    capped = compare.main([*base, "--seed-cap", "1"])["plan"]
    assert [r["method"] for r in capped] == list(METHODS)
    # --only: some of the plan's runs, in the plan's order, whatever order they are named in
    rows = compare.main([*base, "--only", "opsd:1", "grpo:1"])["plan"]
    assert [(r["method"], r["run"], r["learning_rate"]) for r in rows] == [("grpo", "seed_1", 1e-5), ("opsd", "seed_1", 1e-4)]
    with pytest.raises(SystemExit, match=r"--only skill_sd:2: not a run of the experience plan; its runs are lopd:0 grpo:0"):
        compare.main([*base, "--only", "grpo:1", "skill_sd:2"])
    with pytest.raises(SystemExit, match="with --seed-cap 1; its runs are lopd:0 grpo:0 opsd:0 skill_sd:0"):
        compare.main([*base, "--seed-cap", "1", "--only", "grpo:1"])
    for bad in ("grpo", "grpo:x", ":1", "grpo:-1", "grpo:\u00b2"):  # argparse: not METHOD:SEED with a seed >= 0
        with pytest.raises(SystemExit):
            compare.main([*base, "--only", bad])
        assert "is not METHOD:SEED with a seed >= 0 (e.g. grpo:1)" in capsys.readouterr().err
    for other in ("--aggregate-only", "--sweep-lr=3e-5"):  # --only picks runs to run: refused where none run
        with pytest.raises(SystemExit):
            compare.main([*base, other, "--only", "grpo:1"])
        assert f"--only picks runs of a plan to run; {other.split('=')[0]} runs none of them" in capsys.readouterr().err
    # a run-picking flag this command would ignore: refused in one line naming what to do instead
    for extra, says in ((["--methods", "grpo"], "--methods picks a grid's runs; the experience plan's runs are fixed: "
                                                "pick some of them with --only METHOD:SEED"),
                        (["--seeds", "2"], "--seeds picks a grid's runs; the experience plan's"),
                        (["--aggregate-only", "--seeds", "1"], "--seeds picks runs to run; --aggregate-only reads every "
                                                              "run file in --runs-dir: drop --seeds"),
                        (["--aggregate-only", "--seed-cap", "1"], "drop --seed-cap (--src-tree, --student-hash"),
                        (["--sweep-lr", "3e-5", "--methods", "grpo"], "the sweep runs the experience plan's swept "
                                                                     "methods (lopd grpo opsd): drop --methods"),
                        (["--sweep-lr", "3e-5", "--seeds", "3", "4"], "--seeds 3 4: the sweep runs one seed: give one"),
                        (["--sweep-lr", "3e-5", "--seed-cap", "1"], "the sweep runs one seed (--seeds N): drop --seed-cap"),
                        (["--plan", "grid", "--seed-cap", "1"], "a grid runs --seeds: drop --seed-cap")):
        with pytest.raises(SystemExit):
            compare.main([*base, *extra])
        last = capsys.readouterr().err.strip().splitlines()[-1]  # argparse's usage, then the one line
        assert says in last, (extra, last)
    swept = compare.parse_args(["--plan", "experience", "--sweep-lr", "3e-5", "--seeds", "4"], description="",
                               methods=compare.METHODS, results=tmp_path)
    assert swept.seeds == [4] and swept.methods == list(compare.METHODS)  # the sweep's seed is still taken
    # a grid on this sweep: OPSD takes the rate swept for it, not GRPO's (the evidence plan's fallback)
    grid = compare.main(["--plan", "grid", "--methods", "opsd", "skill_sd", "--seeds", "1", "--config-dir", str(EXPERIENCE),
                         "--budget", "280", "--evaluations", "10", "--dry-run", "--out-dir", str(tmp_path),
                         "--lr-file", str(tmp_path / "experience_lr_sweep.json"), "--root", str(tmp_path / "grid")])["plan"]
    assert [(r["method"], r["learning_rate"]) for r in grid] == [("opsd", 1e-4), ("skill_sd", 1e-5)]
    # the sweep: LOPD, GRPO and OPSD at each rate, 64 trajectories on the dev slice
    sweep = compare.main([*base, "--sweep-lr", "3e-5,1e-4,3e-4"])["plan"]
    assert [(r["method"], r["run"], r["steps"]) for r in sweep] == [
        (m, f"lr_{lr:g}", 16) for m in ("lopd", "grpo", "opsd") for lr in (3e-5, 1e-4, 3e-4)]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "runs_lr_sweep").exists()
    # 10% of 256 trajectories is not a whole number of 4-trajectory steps: refused, naming the budget that works
    with pytest.raises(SystemExit, match=r"--budget 256: grpo takes 4 trajectories a step, so 10 held-out evaluations .* "
                                         r"the smallest budget >= 256 that works is 280"):
        compare.main([*base, "--budget", "256"])
    with pytest.raises(SystemExit, match=r"no learning-rate sweep at .*experience_lr_sweep\.json: run `python "
                                         r"benchmarks/compare.py --plan experience --sweep-lr"):
        compare.main(["--plan", "experience", "--dry-run", "--out-dir", str(tmp_path / "elsewhere")])
    # the plan's own folders: run files, results, TensorBoard root, configs, evaluations
    args = compare.parse_args(["--plan", "experience"], description="", methods=compare.METHODS, results=tmp_path)
    assert (args.runs_dir, args.root, args.config_dir) == (tmp_path / "experience_runs", ROOT / "runs" / "experience", EXPERIENCE)
    assert args.evaluations == 10 and args.lr_file == tmp_path / "experience_lr_sweep.json"
    assert compare.PLANS["experience"].results == "experience_compare"


@pytest.mark.parametrize("method", METHODS)
def test_held_out_success_is_measured_at_every_tenth_of_the_budget(compare, tmp_path, method):
    config = compare.method_config(EXPERIENCE, method)
    run = compare.run_config(config, compare.RunSpec(method, 0, 280, evaluations=10), root=tmp_path,
                             student=compare.PLANS["experience"].student,
                             evaluated_checkpoint=compare.PLANS["experience"].evaluated_checkpoint)
    saves = [c["init_args"] for c in run["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint")]
    assert [s.get("every_n_train_steps") for s in saves] == [4, None] and saves[1]["filename"] == "evaluated"
    steps, every = run["trainer"]["max_steps"], run["trainer"]["val_check_interval"]
    per_step = compare.trajectories_per_step(run)
    points = [k * every * per_step for k in range(1, steps // every + 1)]
    assert points == [28 * k for k in range(1, 11)] and {56, 84} <= set(points)  # 20% and 30% are measured
    assert run["model"]["init_args"]["validate_before_training"]  # and the start


@pytest.mark.parametrize("evaluated", [True, False])
def test_a_run_stopped_during_an_evaluation_at_a_checkpoint_step_runs_that_evaluation_again(compare, tmp_path,
                                                                                         monkeypatch, evaluated):
    """6 steps, an evaluation every 2, last.ckpt every 4: stopped during the step-4 evaluation, after last.ckpt was
    saved at step 4. Lightning, resuming from that checkpoint, would skip the step-4 evaluation (the run file
    had evaluations [0, 2, 6]); the experience plan resumes from the checkpoint saved after the step-2
    evaluation instead, a plan without that checkpoint starts over."""
    import dataclasses

    from lopd_lightning.modules.evaluation import EvaluationMixin

    monkeypatch.setitem(compare.PLANS, "grid", dataclasses.replace(compare.PLANS["grid"], evaluated_checkpoint=evaluated))
    args = ["--config-dir", str(ROOT / "configs" / "compare_tiny"), "--budget", "24", "--evaluations", "3", "--methods",
            "grpo", "--seeds", "0", "--root", str(tmp_path / "runs"), "--out-dir", str(tmp_path), "--in-process",
            "--checkpoint-every", "4", "--bootstrap", "50"]
    real, stop = EvaluationMixin.validation_step, {"armed": True}

    def stopped_at_step_4(self, examples, batch_idx):
        if stop["armed"] and self.global_step == 4:
            raise RuntimeError("stopped during the step-4 evaluation")
        return real(self, examples, batch_idx)

    monkeypatch.setattr(EvaluationMixin, "validation_step", stopped_at_step_4)
    with pytest.raises(RuntimeError):
        compare.main(args)
    run_dir = tmp_path / "runs" / "grpo" / "seed_0"
    assert compare.checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 4
    assert not (run_dir / "generations" / "val_step_4.jsonl").exists()
    state = "resumable at step 2" if evaluated else "new (its last.ckpt cannot be resumed)"
    assert compare.main([*args, "--dry-run"])["plan"][0]["state"] == state
    stop["armed"] = False
    compare.main(args)
    result = json.loads((tmp_path / "compare_runs" / "grpo" / "seed_0.json").read_text())
    assert [e["step"] for e in result["evaluations"]] == [0, 2, 4, 6]
    assert [a["start_step"] for a in result["attempts"]] == ([0, 2] if evaluated else [0])
    assert [x for x, _ in result["curve"]] == [4 * k for k in range(1, 7)] and result["summary"]["steps"] == 6
    newest = max(run_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    resumed = [x for x, _ in compare.compare_runs.reward_points(newest)]
    assert resumed == ([12, 16, 20, 24] if evaluated else [4 * k for k in range(1, 7)])  # steps 3-6, each once


def test_an_attempt_stopped_before_its_first_checkpoint_adds_no_negative_time(compare, tmp_path, monkeypatch):
    """Stopped after its step-2 checkpoint, then stopped again before the resumed fit saved one (a session that
    ended while the engine loaded): that second attempt's time up to the checkpoint is 0, not the (negative)
    checkpoint time minus its start, which made the run's wall_s smaller than its first attempt's."""
    args = ["--config-dir", str(ROOT / "configs" / "compare_tiny"), "--budget", "12", "--methods", "grpo", "--seeds", "0",
            "--root", str(tmp_path / "runs"), "--out-dir", str(tmp_path), "--in-process", "--checkpoint-every", "1",
            "--bootstrap", "50"]
    real = compare.run_lopd

    def stopped_after_step_2(command, **kw):
        real([*command, "--trainer.max_steps=2"], **kw)
        raise KeyboardInterrupt("stopped")

    def stopped_at_once(command, **kw):
        raise KeyboardInterrupt("stopped before the first checkpoint")

    for stop in (stopped_after_step_2, stopped_at_once):
        monkeypatch.setattr(compare, "run_lopd", stop)
        with pytest.raises(KeyboardInterrupt):
            compare.main(args)
    monkeypatch.setattr(compare, "run_lopd", real)
    compare.main(args)
    result = json.loads((tmp_path / "compare_runs" / "grpo" / "seed_0.json").read_text())
    first, second, third = result["attempts"]
    assert [a["start_step"] for a in result["attempts"]] == [0, 2, 2]
    assert first["wall_s_to_checkpoint"] > 0 and second["wall_s_to_checkpoint"] == 0.0
    assert result["wall_s"] == pytest.approx(first["wall_s_to_checkpoint"] + third["wall_s"])


def test_a_missing_student_folder_is_refused_in_one_line_before_any_run(compare, tmp_path):
    """It was passed to the runs, whose `lopd fit` failed on it: a traceback with the log's tail, after the
    engine had started."""
    base = ["--config-dir", str(ROOT / "configs" / "compare_tiny"), "--budget", "4", "--methods", "grpo", "--seeds", "0",
            "--root", str(tmp_path / "runs"), "--out-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as refused:
        compare.main([*base, "--student", "runs/no_such_student"])
    assert str(refused.value) == (f"error: --student runs/no_such_student: no such folder (the runs read it from {ROOT}); "
                                  "give a model folder or one of tiny, smollm2-135m-instruct")
    assert not (tmp_path / "runs").exists()
    assert compare.main([*base, "--student", "runs/no_such_student", "--dry-run"])["plan"][0]["state"] == "new"
    assert compare._student(compare.parse_args(
        ["--student", "tiny"], description="", methods=compare.METHODS, results=tmp_path)) == "tiny"


def test_a_second_compare_py_refuses_while_the_fit_of_a_killed_one_still_runs(compare, tmp_path):
    """compare.py killed by its pid (a session's end) leaves its `lopd fit` running; a compare.py started again
    resumed the same run beside it (two fits on one run folder). The fit inherits compare.py's lock on the runs'
    root, so the second one refuses in one line naming both pids, and goes on once the fit has ended."""
    import contextlib
    import re
    import signal
    import subprocess
    import sys
    import time

    args = ["--config-dir", str(ROOT / "configs" / "compare_tiny"), "--budget", "4000", "--methods", "grpo", "--seeds",
            "0", "--root", str(tmp_path / "runs"), "--out-dir", str(tmp_path)]
    parent = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "compare.py"), *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    lock, deadline = tmp_path / "runs" / ".compare.lock", time.time() + 60
    try:
        fit_log = tmp_path / "runs" / "grpo" / "seed_0" / "fit.log"
        while not fit_log.exists() or "lopd pid" not in (lock.read_text() if lock.exists() else ""):
            assert time.time() < deadline and parent.poll() is None, "compare.py started no fit, or wrote no lock"
            time.sleep(0.1)
        fit = int(re.search(r"lopd pid (\d+)", lock.read_text()).group(1))
        parent.kill()  # SIGKILL, compare.py only
        parent.wait()
        os.kill(fit, 0)  # its fit lives on
        with pytest.raises(SystemExit, match=rf"^error: {re.escape(str(tmp_path / 'runs'))} is in use \(compare.py pid "
                                             rf"{parent.pid}, lopd pid {fit}: lopd fit -c .*run\.yaml\): a compare\.py"):
            compare.main(args)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)  # the processes this test started: compare.py and its fit
    while True:  # the lock goes with the fit
        try:
            os.close(compare.compare_runs.hold_lock(tmp_path / "runs"))
            break
        except SystemExit:
            assert time.time() < deadline
            time.sleep(0.1)


def test_bad_numbers_are_refused_in_one_line(compare, tmp_path, capsys):
    """--evaluations -1 (max() of an empty sequence), --budget -280 or a grid budget of 7 steps for 3 evaluations
    (run_config's ValueError) and --sweep-lr abc were tracebacks; --checkpoint-every 0 turned checkpoints off and
    --seed-cap 0 or --budget 0 ran nothing or the plan's default, silently."""
    base = ["--plan", "experience", "--dry-run", "--lr-file", "none", "--out-dir", str(tmp_path), "--root", str(tmp_path / "r")]
    for flag, value in (("--evaluations", "-1"), ("--budget", "0"), ("--checkpoint-every", "0"), ("--seed-cap", "0"),
                        ("--bootstrap", "many")):
        with pytest.raises(SystemExit) as refused:
            compare.main([*base, flag, value])
        assert refused.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"argument {flag}: {value!r} is not a whole "
                                                                         "number >= 1")
    grid = ["--config-dir", str(ROOT / "configs" / "compare_tiny"), "--methods", "grpo", "--seeds", "0", "--dry-run",
            "--out-dir", str(tmp_path), "--root", str(tmp_path / "r")]
    with pytest.raises(SystemExit, match=r"^error: 7 steps cannot hold 3 evenly spaced held-out evaluations"):
        compare.main([*grid, "--budget", "28"])
    with pytest.raises(SystemExit, match=r"^error: --budget 3 is smaller than one grpo step \(4 trajectories\)"):
        compare.main([*grid, "--budget", "3"])
    with pytest.raises(SystemExit, match=r"^error: --sweep-lr takes distinct positive learning rates separated by "
                                         r"commas, got 'abc'$"):
        compare.main([*base, "--sweep-lr", "abc"])


# ---------------------------------------------------------------------- the configs
def print_config(path: Path, capsys) -> dict:
    from lopd_lightning.cli.training import lightning_cli

    with pytest.raises(SystemExit) as exit_info:
        lightning_cli(["fit", "-c", str(path), "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("method", METHODS)
def test_every_experience_config_merges_parses_and_passes_the_fit_checks(compare, tmp_path, capsys, no_model_loading,
                                                                         method):
    from lopd_lightning.cli.checks import check_fit_config
    from lopd_lightning.cli.training import lightning_cli

    run = compare.run_config(compare.method_config(EXPERIENCE, method), compare.RunSpec(method, 0, 280, learning_rate=1e-4,
                             evaluations=10), root=tmp_path, student=compare.PLANS["experience"].student,
                             evaluated_checkpoint=True)
    path = compare.write_config(run, tmp_path / "run.yaml")
    printed = print_config(path, capsys)
    own = yaml.safe_load((EXPERIENCE / f"{method}.yaml").read_text())["model"]["class_path"]
    assert printed["model"]["class_path"] == own and printed["data"]["init_args"]["task"] == "hidden_rules"
    init = printed["model"]["init_args"]
    assert (init["generation_backend"], init["model"]) == ("vllm", "runs/hidden_rules/sft_student_in_context")
    check_fit_config(lightning_cli(["-c", str(path)], run=False, instantiate=False).config)  # lopd fit's own checks


def test_the_experience_configs_share_the_task_student_sampling_and_bank(compare):
    from lopd_lightning.tasks import get_task

    configs = {m: compare.method_config(EXPERIENCE, m) for m in METHODS}
    grid = compare.method_config(ROOT / "configs" / "compare", "grpo")["model"]["init_args"]
    for method, config in configs.items():
        init, data = config["model"]["init_args"], config["data"]["init_args"]
        assert compare.trajectories_per_step(config) == 4, method
        assert (data["task"], data["task_options"]) == ("hidden_rules", {"seed": 0, "references": "rules"})
        assert init["model"] == compare.PLANS["experience"].student and init["generation_backend"] == "vllm"
        for key in ("temperature", "top_p", "top_k", "max_new_tokens", "lora", "grad_clip"):
            assert init[key] == grid[key], (method, key)  # the sampling and limits of configs/compare
        reads = compare.compare_provenance.reads_bank(init, config["model"]["class_path"])
        assert reads == (method.startswith("lopd") or method == "opsd")
        if reads:
            assert (init["bank_path"], init["embedder"]) == ("runs/experience/bank", "minilm")
        # lopd_paper reads a composer of its own (its config's); the other LOPD runs share one
        own = COMPOSER_PAPER if method == "lopd_paper" else COMPOSER
        assert init.get("composer_path") == (own if method.startswith("lopd") else None), method
    heldout = get_task("hidden_rules", **configs["lopd"]["data"]["init_args"]["task_options"]).examples("val")
    assert configs["lopd"]["data"]["init_args"]["val_limit"] == len(heldout) == 200  # every held-out task (>= 150)
    assert configs["opsd"]["model"]["init_args"]["privileged_context"] == "retrieved"
    # the fair twin reads the task's own reference as text: no bank, so its provenance has no bank hash
    assert configs["opsd_reference"]["model"]["init_args"]["privileged_context"] == "reference"
    assert compare.compare_provenance.bank_hash(configs["opsd_reference"]) is None
    assert compare.compare_provenance.composer_hash(configs["opsd_reference"]["model"]["init_args"].get("composer_path")) is None
    lopd = configs["lopd"]
    for ablation, key, value in (("lopd_frozen", "freeze_composer", True), ("lopd_m0", "margin", 0.0)):
        other = configs[ablation]
        assert other["model"]["init_args"].pop(key) == value
        assert {k: v for k, v in lopd["model"]["init_args"].items() if k != key} == other["model"]["init_args"]
        assert {k: v for k, v in lopd.items() if k != "model"} == {k: v for k, v in other.items() if k != "model"}
    header = (EXPERIENCE / "lopd.yaml").read_text()
    assert "lopd build-memory -c configs/experience/common.yaml -c configs/experience/lopd.yaml" in header
    assert "lopd pretrain-composer -c configs/experience/common.yaml" in header and "--out runs/experience/composer" in header


# ---------------------------------------------------------------------- provenance
def test_the_files_a_run_reads_are_hashed_as_streams_and_cached(compare, tmp_path):
    prov = compare.compare_provenance
    student = tmp_path / "student"
    student.mkdir()
    weights = student / "model.safetensors"
    content = b"w" * (3 << 20) + b"end"  # more than one 1 MiB chunk
    weights.write_bytes(content)
    assert prov.student_hash(str(student)) == hashlib.sha256(content).hexdigest()[:16]
    stat = weights.stat()  # same size and mtime: the cached digest (the file is not read again)
    weights.write_bytes(b"x" * len(content))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert prov.student_hash(str(student)) == hashlib.sha256(content).hexdigest()[:16]
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new mtime: read again
    assert prov.student_hash(str(student)) == hashlib.sha256(b"x" * len(content)).hexdigest()[:16]
    assert prov.student_hash("tiny") is None  # a registry name: no folder

    bank = tmp_path / "bank"
    bank.mkdir()
    for name, text in (("meta.json", "{}"), ("experiences.jsonl", "a\n"), ("embeddings.npy", "e")):
        (bank / name).write_text(text)
    lopd = {"model": {"class_path": "lopd_lightning.modules.LOPDModule", "init_args": {"bank_path": str(bank)}}}
    opsd = {"model": {"class_path": "lopd_lightning.modules.OPSDModule",
                      "init_args": {"bank_path": str(bank), "privileged_context": "retrieved"}}}
    reference = {"model": {"class_path": "lopd_lightning.modules.OPSDModule", "init_args": {"bank_path": str(bank)}}}
    grpo = {"model": {"class_path": "lopd_lightning.modules.GRPOModule", "init_args": {}}}
    digest = hashlib.sha256()
    for name in ("embeddings.npy", "experiences.jsonl", "meta.json"):
        digest.update(name.encode() + b"\0" + hashlib.sha256((bank / name).read_bytes()).hexdigest().encode())
    assert prov.bank_hash(lopd) == prov.bank_hash(opsd) == digest.hexdigest()[:16]
    assert prov.bank_hash(reference) is None and prov.bank_hash(grpo) is None
    before = prov.file_provenance(lopd)
    (bank / "experiences.jsonl").write_text("a\nb\n")
    assert prov.changed_files(before, lopd) == [f"bank_hash {before['bank_hash']} -> {prov.bank_hash(lopd)}"]

    composer = tmp_path / "composer"
    lopd["model"]["init_args"]["composer_path"] = str(composer)
    assert prov.missing_composers([lopd, grpo]) == [str(composer)]
    with pytest.raises(FileNotFoundError, match="composer_path .* holds no composer.pt: pretrain it first"):
        prov.composer_hash(str(composer))
    composer.mkdir()
    (composer / "composer.pt").write_bytes(b"phi")
    (composer / "checkpoints").mkdir()  # what pretraining adds beside it is not part of the hash
    (composer / "checkpoints" / "last.ckpt").write_bytes(b"more")
    assert prov.composer_hash(str(composer)) == hashlib.sha256(b"phi").hexdigest()[:16]
    assert prov.missing_composers([lopd]) == [] and prov.composer_hash(None) is None

    versions = prov.library_versions()
    assert {"python", "torch", "transformers", "lightning", "peft"} <= set(versions)
    script = tmp_path / "lopd"
    script.write_text("#!/some/env/bin/python\nprint()\n")
    assert prov.interpreter_of([str(script)]) == "/some/env/bin/python"
    assert prov.interpreter_of(["/usr/bin/python3", "-m", "lopd_lightning.cli"]) == "/usr/bin/python3"
    record = prov.run_provenance(grpo)
    assert record["versions"] == versions and record["versions_key"] == prov.versions_key(versions)
    assert (record["student_hash"], record["bank_hash"], record["composer_hash"]) == (None, None, None)
    assert set(prov.library_versions(None, ("torch", "no_such_library"))) == {"python", "torch"}
    import torch

    assert prov.cpu_capability_of() == torch.backends.cpu.get_cpu_capability()
    assert prov.cpu_capability_of(str(tmp_path / "no_python")) is None  # never fails a run over it


def with_provenance(run, *, student="s1", bank=None, composer=None, transformers="5.24.0"):
    versions = {"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": transformers}
    key = hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:8]
    run["provenance"] = {"student_hash": student, "bank_hash": bank, "composer_hash": composer, "versions": versions,
                         "versions_key": key}
    return run


def runs_key(path: Path) -> str:
    return json.loads(path.read_text())["provenance"]["versions_key"]


def test_the_aggregation_refuses_to_mix_students_banks_composers_or_libraries(compare, tmp_path):
    final = {"q0": True, "q1": False, "q2": True, "q3": False}
    out, runs = tmp_path / "out", tmp_path / "out" / "experience_runs"
    base = ["--plan", "experience", "--aggregate-only", "--out-dir", str(out), "--bootstrap", "200", "--calibration", "none"]
    write_runs(runs, with_provenance(fake_run("lopd", 0, final=final), bank="b1", composer="c1"),
               with_provenance(fake_run("grpo", 0, final=final), student="s2"))
    with pytest.raises(SystemExit, match=r"^error: refusing to aggregate runs from 2 start students \(weights hash\) \(s1: "
                                         r"lopd/seed_0\.json; s2: grpo/seed_0\.json\); aggregate one with --student-hash HASH, or declare "
                                         r"a rebuilt one the original with --same-input student:REBUILT=ORIGINAL$"):
        compare.main(base)
    assert not (out / "experience_compare.json").exists()
    assert list(compare.main([*base, "--student-hash", "s2"])["methods"]) == ["grpo"]
    write_runs(runs, with_provenance(fake_run("grpo", 0, final=final)),  # GRPO reads no bank: not compared
               with_provenance(fake_run("opsd", 0, final=final), bank="b2"))
    with pytest.raises(SystemExit, match=r"2 experience banks \(bank hash\) \(b1: lopd/seed_0\.json; b2: opsd/seed_0\.json\); "
                                         "aggregate one with --bank-hash HASH, or declare a rebuilt one the original with "
                                         r"--same-input bank:REBUILT=ORIGINAL$"):
        compare.main(base)
    assert list(compare.main([*base, "--bank-hash", "b1"])["methods"]) == ["lopd", "grpo"]
    (runs / "opsd" / "seed_0.json").unlink()
    write_runs(runs, with_provenance(fake_run("lopd_frozen", 0, final=final), bank="b1", composer="c2"))
    with pytest.raises(SystemExit, match=r"2 pretrained composers \(composer hash\) \(c1: lopd/seed_0\.json; c2: "
                                         r"lopd_frozen/seed_0\.json\); aggregate one with --composer-hash HASH, or declare a "
                                         r"rebuilt one the original with --same-input composer:REBUILT=ORIGINAL$"):
        compare.main(base)
    (runs / "lopd_frozen" / "seed_0.json").unlink()
    older = with_provenance(fake_run("grpo", 1, final=final), transformers="5.19.0")
    write_runs(runs, older)
    groups = sorted([(older["provenance"]["versions_key"], "transformers 5.19.0", "grpo/seed_1.json"),
                     (runs_key(runs / "lopd" / "seed_0.json"), "transformers 5.24.0", "grpo/seed_0.json, lopd/seed_0.json")])
    listed = "; ".join(f"{key} ({libs}): {names}" for key, libs, names in groups)  # only the libraries that differ
    with pytest.raises(SystemExit) as refused:
        compare.main(base)
    assert str(refused.value) == f"error: refusing to aggregate runs from 2 library versions ({listed}); aggregate one " \
                                 "with --versions KEY"
    data = compare.main([*base, "--versions", older["provenance"]["versions_key"][:4]])
    assert data["methods"]["grpo"]["seeds"] == [1] and data["provenance"]["grpo"]["versions"]["transformers"] == "5.19.0"
    assert data["task_calibration"] is None and "--calibration none" in data["task_calibration_reason"]
    assert (out / "experience_compare.md").exists() and (out / "experience_compare.png").exists()


def test_a_rebuilt_input_declared_the_same_aggregates_under_the_original_and_is_recorded(compare, tmp_path):
    """A student and bank rebuilt on another CPU (other hashes, the same behaviour) are refused until the user
    declares them the same (--same-input); then they aggregate, the declaration is in the results, and each run
    file keeps the hash it recorded."""
    final = {"q0": True, "q1": False, "q2": True, "q3": False}
    out, runs = tmp_path / "out", tmp_path / "out" / "experience_runs"
    base = ["--plan", "experience", "--aggregate-only", "--out-dir", str(out), "--bootstrap", "200", "--calibration", "none"]
    write_runs(runs, with_provenance(fake_run("opsd", 0, final=final), student="s1", bank="b1"),
               with_provenance(fake_run("opsd", 1, final=final), student="s1x", bank="b1x"))
    with pytest.raises(SystemExit, match=r"2 start students \(weights hash\) \(s1: opsd/seed_0\.json; s1x: opsd/seed_1"):
        compare.main(base)
    with pytest.raises(SystemExit, match=r"2 experience banks"):  # the student alone is not enough
        compare.main([*base, "--same-input", "student:s1x=s1"])
    data = compare.main([*base, "--same-input", "student:s1x=s1", "--same-input", "bank:b1x=b1"])
    assert data["methods"]["opsd"]["seeds"] == [0, 1]
    assert data["same_inputs"] == {"student_hash": {"s1x": "s1"}, "bank_hash": {"b1x": "b1"}}
    assert json.loads((runs / "opsd" / "seed_1.json").read_text())["provenance"]["student_hash"] == "s1x"
    assert {r: p["student_hash"] for r, p in data["provenance_by_run"]["opsd"].items()} == {"seed_0": "s1", "seed_1": "s1x"}
    # the filters read a declared input as its original too
    declared = ["--same-input", "student:s1x=s1", "--same-input", "bank:b1x=b1"]
    assert compare.main([*base, *declared, "--student-hash", "s1"])["methods"]["opsd"]["seeds"] == [0, 1]
    assert compare.main(base + ["--student-hash", "s1x"])["methods"]["opsd"]["seeds"] == [1]  # undeclared: its own
    assert compare.main([*base, "--student-hash", "s1x", "--bank-hash", "b1x"])["same_inputs"] is None
    for bad, says in (("student:s1x", "give KIND:REBUILT=ORIGINAL"), ("teacher:a=b", "KIND one of student, bank, composer"),
                      ("bank:b1=b1", "two different hashes")):
        with pytest.raises(SystemExit, match=f"^error: --same-input {bad}: .*{says}"):
            compare.main([*base, "--same-input", bad])
    with pytest.raises(SystemExit, match=r"^error: --same-input: student s1x is declared the same as both s1 and s0; keep one$"):
        compare.main([*base, "--same-input", "student:s1x=s1", "--same-input", "student:s1x=s0"])


def test_a_student_loaded_by_name_is_not_mixed_with_a_student_folder(compare, tmp_path):
    """A named student (no folder: student_hash None) took no part in the check, so runs from the packaged
    SmolLM2 were aggregated with runs from the in-context student."""
    final = {"q0": True, "q1": False}
    runs = tmp_path / "experience_runs"
    named = with_provenance(fake_run("grpo", 0, final=final), student=None)
    named["model"] = "smollm2-135m-instruct"
    write_runs(runs, with_provenance(fake_run("lopd", 0, final=final)), named)
    base = ["--plan", "experience", "--aggregate-only", "--out-dir", str(tmp_path), "--bootstrap", "50", "--calibration", "none"]
    with pytest.raises(SystemExit, match=r"2 start students \(weights hash\) \(name smollm2-135m-instruct: "
                                         r"grpo/seed_0\.json; s1: lopd/seed_0\.json\)"):
        compare.main(base)
    assert list(compare.main([*base, "--student-hash", "name smollm2"])["methods"]) == ["grpo"]


def with_composer(run, folder):
    """``run`` with a config naming ``folder`` as its composer_path (the run files' own configs do)."""
    run["config"] = {"model": {"init_args": {"composer_path": folder}}}
    return run


def test_composers_are_compared_among_the_runs_of_each_composer_folder(compare, tmp_path):
    """lopd_paper reads a composer of its own (runs/experience/composer_paper): its runs aggregate beside the other
    LOPD runs, which read runs/experience/composer, while two composers in one folder are still refused, naming
    the folder, and a rebuilt one is still declared with --same-input."""
    final = {"q0": True, "q1": False, "q2": True, "q3": False}
    out, runs = tmp_path / "out", tmp_path / "out" / "experience_runs"
    base = ["--plan", "experience", "--aggregate-only", "--out-dir", str(out), "--bootstrap", "200", "--calibration", "none"]

    def lopd_run(method, seed, composer, folder):
        return with_composer(with_provenance(fake_run(method, seed, final=final), bank="b1", composer=composer), folder)

    write_runs(runs, lopd_run("lopd", 0, "c1", COMPOSER), lopd_run("lopd_paper", 0, "p1", COMPOSER_PAPER),
               with_provenance(fake_run("opsd_reference", 0, final=final)))  # no bank, no composer
    data = compare.main(base)
    assert list(data["methods"]) == ["lopd", "lopd_paper", "opsd_reference"]
    assert {m: p["composer_hash"] for m, p in data["provenance"].items()} == {"lopd": "c1", "lopd_paper": "p1",
                                                                            "opsd_reference": None}
    assert data["provenance"]["opsd_reference"]["bank_hash"] is None
    # the filter still picks by hash: a run of the other folder is left out, a run without a composer stays
    assert list(compare.main([*base, "--composer-hash", "c1"])["methods"]) == ["lopd", "opsd_reference"]

    def refused(folder, listed, kind="composer"):
        return (rf"^error: refusing to aggregate runs from 2 pretrained composers \(composer hash\) among the runs of "
                rf"composer_path {folder} \({listed}\); aggregate one with --composer-hash HASH, or declare a rebuilt one "
                rf"the original with --same-input {kind}:REBUILT=ORIGINAL$")

    write_runs(runs, lopd_run("lopd_frozen", 0, "c2", COMPOSER))  # one folder, two composers: refused as before
    with pytest.raises(SystemExit, match=refused(COMPOSER, r"c1: lopd/seed_0\.json; c2: lopd_frozen/seed_0\.json")):
        compare.main(base)
    declared = compare.main([*base, "--same-input", "composer:c2=c1"])
    assert list(declared["methods"]) == ["lopd", "lopd_frozen", "lopd_paper", "opsd_reference"]
    (runs / "lopd_frozen" / "seed_0.json").unlink()
    write_runs(runs, lopd_run("lopd_paper", 1, "p2", COMPOSER_PAPER))  # and in lopd_paper's own folder
    with pytest.raises(SystemExit, match=refused(COMPOSER_PAPER, r"p1: lopd_paper/seed_0\.json; p2: lopd_paper/seed_1\.json")):
        compare.main(base)
    write_runs(runs, lopd_run("lopd_paper", 1, "p1", "runs/experience/./composer_paper/"))  # the same folder, spelt otherwise
    assert compare.main(base)["methods"]["lopd_paper"]["seeds"] == [0, 1]
    # runs whose files hold no config (written before configs were recorded) form one group, as before
    assert compare.compare_runs.composer_folder(fake_run("lopd", 0, final=final)) is None


def test_the_added_contrasts_give_reasons_without_runs_and_numbers_with_them(compare, tmp_path):
    """The four contrasts of lopd_paper and opsd_reference are null with the side that has no run, and measured
    once both sides have runs; adding those runs changes no number of the other methods (LOPD's budget fractions
    key on lopd and grpo only) and the table lists the new methods."""
    out, runs = tmp_path / "out", tmp_path / "out" / "experience_runs"
    base = ["--plan", "experience", "--aggregate-only", "--out-dir", str(out), "--bootstrap", "200", "--calibration", "none"]
    finals = ({"q0": True, "q1": False, "q2": True, "q3": False}, {"q0": True, "q1": True, "q2": False, "q3": False})
    for method, curve in (("lopd", (0.1, 0.6)), ("grpo", (0.0, 0.3)), ("opsd", (0.2, 0.4))):
        write_runs(runs, *(with_provenance(fake_run(method, s, final=finals[s], curve=(curve[0], curve[1] + s / 10)))
                           for s in (0, 1)))
    before = compare.main(base)
    contrasts = compare.compare_plans.EXPERIENCE_CONTRASTS
    assert [(c["method"], c["reference"]) for c in before["contrasts"]] == list(contrasts)
    reasons = {(c["method"], c["reference"]): c["reason"] for c in before["contrasts"]}
    assert reasons == {("lopd", "opsd"): None, ("lopd", "lopd_frozen"): "lopd_frozen has no run",
                       ("lopd", "lopd_m0"): "lopd_m0 has no run", ("lopd", "skill_sd"): "skill_sd has no run",
                       ("lopd_paper", "opsd_reference"): "lopd_paper and opsd_reference have no run",
                       ("lopd_paper", "opsd"): "lopd_paper has no run", ("opsd_reference", "opsd"): "opsd_reference has no run",
                       ("lopd_paper", "lopd"): "lopd_paper has no run"}
    for c in before["contrasts"][4:]:
        assert (c["final_reward_difference"], c["final_reward_difference_ci"], c["heldout_two_level"]) == (None, None, None)
        assert c["heldout_two_level_reason"] == c["reason"]
    md = (out / "experience_compare.md").read_text()
    assert "- lopd_paper vs opsd_reference: not measured (lopd_paper and opsd_reference have no run)." in md

    for method, curve in (("lopd_paper", (0.1, 0.5)), ("opsd_reference", (0.3, 0.7))):
        write_runs(runs, *(with_provenance(fake_run(method, s, final=finals[1 - s], curve=(curve[0], curve[1] - s / 10)))
                           for s in (0, 1)))
    after = compare.main(base)
    assert list(after["methods"]) == ["lopd", "grpo", "opsd", "lopd_paper", "opsd_reference"]
    for c in after["contrasts"][4:]:
        assert c["reason"] is None and c["heldout_two_level"]["n_questions"] == 4, c
    twins = after["contrasts"][4]
    # each seed's final reward: the trailing mean of its two points (the window, 3 steps, is longer than the run)
    paper, reference = [(0.1 + 0.5) / 2, (0.1 + 0.4) / 2], [(0.3 + 0.7) / 2, (0.3 + 0.6) / 2]
    assert twins["final_reward_difference"] == pytest.approx(sum(paper) / 2 - sum(reference) / 2)
    assert after["contrasts"][:4] == before["contrasts"][:4]
    for name in ("lopd", "grpo", "opsd"):
        assert after["methods"][name] == before["methods"][name]
    fractions = [k for k in before if k.startswith(("lopd_", "grpo_"))]
    assert fractions and {k: after[k] for k in fractions} == {k: before[k] for k in fractions}
    assert after["methods"]["lopd_paper"]["paired_vs_grpo"] is not None  # each method against GRPO: paired_vs_grpo
    md = (out / "experience_compare.md").read_text()
    assert "| lopd_paper | 0,1 |" in md and "| opsd_reference | 0,1 |" in md
    assert "- lopd_paper vs opsd_reference: final training reward -0.200" in md


def test_the_committed_aggregate_is_rebuilt_with_its_numbers_and_the_added_contrasts(compare, tmp_path, monkeypatch):
    """experience_compare.json rebuilt from the committed run files with its own command line: every key as
    committed (but those that record when, where and with which checkout it was written), its contrasts as
    committed, and each contrast added since null with its reason while a side has no run file."""
    committed = json.loads((RESULTS / "experience_compare.json").read_text())
    monkeypatch.chdir(ROOT)  # its command line's paths are the repository's
    assert "--out-dir" not in committed["argv"]
    compare.main([*committed["argv"], "--out-dir", str(tmp_path)])
    rebuilt = json.loads((tmp_path / "experience_compare.json").read_text())
    recorded = {"timestamp", "git_sha", "argv", "hardware", "versions"}
    assert set(rebuilt) == set(committed)
    for key in set(committed) - recorded - {"contrasts"}:
        assert rebuilt[key] == committed[key], key
    n = len(committed["contrasts"])
    assert rebuilt["contrasts"][:n] == committed["contrasts"]
    with_runs = {p.parent.name for p in (RESULTS / "experience_runs").glob("*/seed_*.json")}
    added = compare.compare_plans.EXPERIENCE_CONTRASTS[n:]
    assert [(c["method"], c["reference"]) for c in rebuilt["contrasts"][n:]] == list(added)
    for c in rebuilt["contrasts"][n:]:
        missing = [m for m in (c["method"], c["reference"]) if m not in with_runs]
        assert bool(c["reason"]) == bool(missing) and (c["heldout_two_level"] is None) == bool(missing), c


def test_the_committed_runs_are_read_back_as_finished_where_the_plan_resumes(compare):
    """The committed runs ran in a worktree whose runs/ linked to this checkout's: their configs name the run
    folders as /work/main/runs/experience/..., a run here as runs/experience/...; the plan reads them back as
    finished (the same folders), so it resumes with the added runs."""
    rows = compare.main(["--plan", "experience", "--dry-run"])["plan"]
    assert [(r["method"], int(r["run"].removeprefix("seed_"))) for r in rows] == ORDER
    committed = {(p.parent.name, p.stem) for p in (RESULTS / "experience_runs").glob("*/seed_*.json")}
    for row in rows:
        assert (row["state"] == "finished") == ((row["method"], row["run"]) in committed), row
    same = compare.compare_runs.same_config
    config = {"trainer": {"logger": {"init_args": {"save_dir": "runs/experience", "name": "lopd"}}}, "seed": 1}
    absolute = {"trainer": {"logger": {"init_args": {"save_dir": str(ROOT / "runs" / "experience"), "name": "lopd"}}},
                "seed": 1}
    assert same(absolute, config) and same(config, config) and not same(None, config)
    assert not same({**absolute, "seed": 2}, config)  # any other difference is another config
    clone = {"trainer": {"logger": {"init_args": {"save_dir": "/elsewhere/runs/experience", "name": "lopd"}}}, "seed": 1}
    assert same(clone, config)  # the plan's folder in a clone elsewhere (CI checks out to another path)
    for other in ("/elsewhere/runs/other", "/elsewhere/experience", "runs/experience/lopd"):
        moved = {"trainer": {"logger": {"init_args": {"save_dir": other, "name": "lopd"}}}, "seed": 1}
        assert not same(moved, config), other


def test_the_plan_refuses_to_start_while_a_composer_its_runs_read_is_missing(compare, tmp_path):
    """Per composer folder: the methods that read it and the `lopd pretrain-composer` command of their config (lopd
    for the shared composer, lopd_paper for its own), before any run starts; with --only, only the runs named."""
    work = tmp_path / "work"
    configs = tiny_configs(tmp_path, work)
    base = ["--plan", "experience", "--config-dir", str(configs), "--student", "tiny", "--budget", "8", "--evaluations",
            "2", "--lr-file", "none", "--root", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out"), "--in-process"]
    shared, own = str(work / "composer"), str(work / "composer_paper")

    def refusal(folder, method, readers):
        return (f"no pretrained composer in {folder} (read by {readers}): pretrain it first with `lopd pretrain-composer "
                f"-c {configs}/common.yaml -c {configs}/{method}.yaml --model.init_args.composer_path=null "
                f"--model.init_args.generation_backend=hf --out {folder}` (add --resume to continue a stopped pretraining)")

    with pytest.raises(SystemExit) as refused:
        compare.main(base)
    assert str(refused.value) == ("error: " + refusal(shared, "lopd", "lopd, lopd_frozen, lopd_m0") + "; "
                                  + refusal(own, "lopd_paper", "lopd_paper"))
    (work / "composer").mkdir(parents=True)
    (work / "composer" / "composer.pt").write_bytes(b"phi")
    for only in (["lopd:0", "lopd_paper:0"], ["lopd_paper:1"]):  # the shared one is there: only lopd_paper's is missing
        with pytest.raises(SystemExit) as refused:
            compare.main([*base, "--only", *only])
        assert str(refused.value) == "error: " + refusal(own, "lopd_paper", "lopd_paper")
    (work / "composer" / "composer.pt").unlink()
    with pytest.raises(SystemExit) as refused:
        compare.main([*base, "--only", "lopd_frozen:0"])  # an ablation's composer is made with LOPD's config
    assert str(refused.value) == "error: " + refusal(shared, "lopd", "lopd, lopd_frozen, lopd_m0")
    assert not (tmp_path / "runs").exists()  # refused before any run
    # the experience configs: the commands of their headers
    real = {m: compare.method_config(EXPERIENCE, m) for m in METHODS}
    for method, folder in (("lopd", COMPOSER), ("lopd_paper", COMPOSER_PAPER)):
        line = compare.missing_composer_error([folder], real, EXPERIENCE, compare.PLANS["experience"].order)
        command = (f"lopd pretrain-composer -c configs/experience/common.yaml -c configs/experience/{method}.yaml "
                   f"--model.init_args.composer_path=null --model.init_args.generation_backend=hf --out {folder}")
        assert f"no pretrained composer in {folder} (read by {method}" in line and f"`{command}`" in line
        header = " ".join(line.lstrip("#").strip().rstrip("\\") for line in (EXPERIENCE / f"{method}.yaml").read_text()
                          .splitlines() if line.startswith("#"))
        assert command in " ".join(header.split()), method


def test_the_aggregation_reads_the_default_calibration_without_the_flag(compare, tmp_path):
    """--calibration left out meant --calibration none: str(None).lower() is "none"."""
    write_runs(tmp_path / "experience_runs", with_provenance(fake_run("lopd", 0, final={"q0": True, "q1": False})))
    data = compare.main(["--plan", "experience", "--aggregate-only", "--out-dir", str(tmp_path), "--bootstrap", "50"])
    assert data["task_calibration_reason"] is None and data["task_calibration"]["student_success"] == 0.135


def test_task_calibration_reads_the_three_numbers_or_says_why_not(compare, tmp_path):
    plans = compare.compare_plans
    real = plans.task_calibration(ROOT / plans.CALIBRATION, model="runs/hidden_rules/sft_student_in_context")
    c = real["task_calibration"]
    assert real["task_calibration_reason"] is None and c["n_heldout"] == 200 and c["same_student_as_runs"] is True
    # the default is the calibration at the runs' 96 new tokens (configs/experience/common.yaml's max_new_tokens)
    assert json.loads((ROOT / plans.CALIBRATION).read_text())["settings"]["max_new_tokens"] == 96
    assert (c["student_success"], c["text_nearest_success"]) == (0.135, 0.62)  # 27 and 124 of 200
    assert c["difference"] == pytest.approx(0.485) and c["difference_ci"] == [0.41, 0.555] and c["same_tool_rate"] == 0.995
    missing = plans.task_calibration(tmp_path / "none.json")
    assert missing["task_calibration"] is None and "no task calibration at" in missing["task_calibration_reason"]
    (tmp_path / "partial.json").write_text(json.dumps({"n_heldout": 3}))
    assert "lacks student_success" in plans.task_calibration(tmp_path / "partial.json")["task_calibration_reason"]


# ---------------------------------------------------------------------- end to end, tiny
def tiny_configs(tmp_path: Path, work: Path) -> Path:
    """configs/experience_tiny in ``tmp_path/configs``, its bank and composers under ``work``; with a tiny
    lopd_paper (the tiny LOPD in its authors' setting: self-retrieval, a base teacher, the long framing, the
    composer's KL per rollout and joint clipping, no MemoryRefresh, a composer of its own in ``work/composer_paper``)
    and opsd_reference (the task's own reference as text, no bank) where that folder has none."""
    configs = tmp_path / "configs"
    configs.mkdir()
    for path in TINY.glob("*.yaml"):  # the tiny configs, their bank and composer in this test's folder
        (configs / path.name).write_text(path.read_text().replace("runs/experience_tiny", str(work)))
    if not (configs / "lopd_paper.yaml").exists():
        paper = yaml.safe_load((configs / "lopd.yaml").read_text())
        paper["model"]["init_args"].update(
            composer_path=str(work / "composer_paper"), num_experiences=3, allow_self_retrieval=True,
            teacher_mode="base", context_framing="from_scratch", composer_kl_mean="rollout", composer_clip_joint=1.0,
            warm_start_reconstruction_weight=0.0, warm_start_self_retrieval=True)
        paper.pop("trainer")  # a frozen bank: no MemoryRefresh
        (configs / "lopd_paper.yaml").write_text(yaml.safe_dump(paper))
    if not (configs / "opsd_reference.yaml").exists():
        (configs / "opsd_reference.yaml").write_text(yaml.safe_dump({
            "model": {"class_path": "lopd_lightning.modules.OPSDModule",
                      "init_args": {"group_size": 1, "privileged_context": "reference", "context_framing": "from_scratch"}},
            "data": {"init_args": {"examples_per_step": 4}}}))
    return configs


def test_the_tiny_experience_plan_runs_every_method_and_records_provenance(compare, tmp_path):
    from lopd_lightning.cli import main as lopd

    work = tmp_path / "work"
    configs = tiny_configs(tmp_path, work)
    for method, folder in (("lopd", "composer"), ("lopd_paper", "composer_paper")):  # each composer from its config
        stage = ["-c", str(configs / "common.yaml"), "-c", str(configs / f"{method}.yaml"),
                 "--model.init_args.composer_path=null"]
        if method == "lopd":
            assert lopd(["build-memory", *stage, "--from-references"]) == 0
        assert lopd(["pretrain-composer", *stage, "--out", str(work / folder), "--steps", "1"]) == 0
    out, calibration = tmp_path / "out", ROOT / compare.compare_plans.CALIBRATION
    data = compare.main(["--plan", "experience", "--config-dir", str(configs), "--student", "tiny", "--budget", "8",
                         "--evaluations", "2", "--seed-cap", "1", "--lr-file", "none", "--root", str(tmp_path / "runs"),
                         "--out-dir", str(out), "--in-process", "--bootstrap", "200", "--calibration", str(calibration)])
    assert list(data["methods"]) == list(METHODS)
    saved = json.loads((out / "experience_compare.json").read_text())
    assert saved["task_calibration"]["student_success"] == 0.135 and saved["task_calibration"]["same_student_as_runs"] is False
    assert (out / "experience_compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Task calibration (200 held-out tasks" in (out / "experience_compare.md").read_text()
    # issue 33's questions beyond GRPO: LOPD against OPSD, the frozen composer, m = 0 and Skill-SD; then the added ones
    assert [(c["method"], c["reference"]) for c in saved["contrasts"]] == list(compare.compare_plans.EXPERIENCE_CONTRASTS)
    assert all(c["reason"] is None and c["heldout_two_level"]["n_questions"] == 4 for c in saved["contrasts"])
    assert "- lopd vs lopd_frozen: final training reward" in (out / "experience_compare.md").read_text()
    assert "- lopd_paper vs opsd_reference: final training reward" in (out / "experience_compare.md").read_text()
    for key in ("lopd_heldout_budget_fraction_to_grpo_final", "lopd_budget_fraction_to_grpo_final", "val_examples"):
        assert key in saved
    runs = {m: json.loads((out / "experience_runs" / m / "seed_0.json").read_text()) for m in METHODS}
    banks, composers = set(), set()
    for method, run in runs.items():
        assert [e["step"] for e in run["evaluations"]] == [0, 1, 2] and run["evaluations"][-1]["questions"] == 4
        assert (tmp_path / "runs" / method / "seed_0").is_dir()  # one TensorBoard root for every run
        p = run["provenance"]
        assert p["student_hash"] is None and p["versions"]["torch"] and p == run["attempts"][0]["provenance"]
        reads = method.startswith("lopd") or method == "opsd"
        assert (p["bank_hash"] is not None) == reads and (p["composer_hash"] is not None) == method.startswith("lopd")
        banks.add(p["bank_hash"])
        composers.add(p["composer_hash"])
        if method != "grpo":
            assert saved["methods"][method]["paired_vs_grpo_two_level"]["n_questions"] == 4
    assert len(banks - {None}) == 1  # one bank for every run that reads one (not opsd_reference: its own reference)
    # one composer per folder: lopd_paper's own, and the one every other LOPD run reads (aggregated together)
    expected = {folder: hashlib.sha256((work / folder / "composer.pt").read_bytes()).hexdigest()[:16]
                for folder in ("composer", "composer_paper")}
    for method, run in runs.items():
        if method.startswith("lopd"):
            assert run["provenance"]["composer_hash"] == expected["composer_paper" if method == "lopd_paper" else "composer"]
    assert composers - {None} == set(expected.values())


# ---------------------------------------------------------------------- held-out success per category
def test_heldout_by_category_counts_by_hand(compare):
    category_of = {"q0": "a", "q1": "a", "q2": "b", "q3": None}  # q3: no category; q4: not in category_of
    seed_0 = fake_run("m", 0, start={"q0": True, "q1": False, "q2": False, "q3": True, "q4": True},
                      final={"q0": True, "q1": True, "q2": False, "q3": True, "q4": True})
    seed_1 = fake_run("m", 1, final={"q0": False, "q1": True, "q2": True, "q3": True, "q4": True})
    middle = {**seed_1["evaluations"][0], "step": 1, "per_question": {"q0": True, "q1": True, "q2": True}}
    seed_1["evaluations"].insert(1, middle)  # three evaluations: the last one counts, not the second
    runs = {"m": [seed_0, seed_1], "no_evaluations": [fake_run("x", 0, final={"q0": True}),
                                                       {**fake_run("x", 1, final={"q0": True}), "evaluations": []}]}
    by = compare.heldout_by_category(runs, category_of)
    assert by["categories"] == {"a": 2, "b": 1}
    assert list(by["methods"]) == ["m"]  # a method with a seed without evaluations is left out
    # start: seed 0 solved q0 (a), seed 1 nothing; final: a: seed 0 q0 and q1 = 2, seed 1 q1 = 1; b: seed 1 q2
    assert by["methods"]["m"]["a"] == {"start_solved": 0.5, "final_solved": 1.5, "start_solved_per_seed": [1, 0],
                                       "final_solved_per_seed": [2, 1]}
    assert by["methods"]["m"]["b"] == {"start_solved": 0.0, "final_solved": 0.5, "start_solved_per_seed": [0, 0],
                                       "final_solved_per_seed": [0, 1]}
    table = compare.table({"task": "t", "model": "m", "budget_trajectories": 8, "smooth_window": 1,
                                          "methods": {}, "heldout_by_category": {
                                              "categories": {"x|y": 1}, "methods": {"m|n": {"x|y": {
                                                  "start_solved": 0, "final_solved": 1}}, "k": {"x|y": {
                                                  "start_solved": 27.0, "final_solved": 13 / 3}}}}})
    assert "| method | x\\|y (1) |" in table and "| m\\|n | 0 -> 1 |" in table  # a "|" in a name is escaped
    assert "| k | 27 -> 4.3 |" in table  # a mean over three seeds is written to one decimal


def test_the_aggregation_breaks_hidden_rules_down_by_rule_kind(compare, tmp_path):
    """On hidden_rules the experience aggregate counts held-out solves per rule kind ("none": plain tools), the
    kinds read from the task with the run's own task_options; a task without categories (toy), questions that
    are not the task's and a task that cannot be loaded give None and the reason."""
    from lopd_lightning.tasks import get_task

    options = {"seed": 0, "n_heldout": 150}  # not the defaults: the run's own options must be read (below)
    task = get_task("hidden_rules", **options)
    heldout = task.examples("val")[:12] + task.examples("train")[:3]  # a dev slice's questions are train ones
    kind = {e.id: e.data["rule"]["kind"] for e in heldout}
    start = {e.id: i % 4 == 1 for i, e in enumerate(heldout)}
    final = {e.id: i % 3 != 0 for i, e in enumerate(heldout)}
    run = with_provenance(fake_run("grpo", 0, start=start, final=final))
    run.update(task="hidden_rules", config={"data": {"init_args": {"task_options": options}}})
    runs_dir = tmp_path / "experience_runs"
    write_runs(runs_dir, run)
    base = ["--plan", "experience", "--aggregate-only", "--out-dir", str(tmp_path), "--bootstrap", "50", "--calibration", "none"]
    data = compare.main(base)
    assert data["heldout_by_category_reason"] is None
    assert data["heldout_by_category"]["categories"] == {k: list(kind.values()).count(k) for k in sorted(set(kind.values()))}
    for k in set(kind.values()):
        cells = data["heldout_by_category"]["methods"]["grpo"][k]
        assert cells["start_solved"] == sum(start[q] for q in kind if kind[q] == k)
        assert cells["final_solved"] == sum(final[q] for q in kind if kind[q] == k)
    assert "Held-out solved per category" in (tmp_path / "experience_compare.md").read_text()

    def reason_for(**changes):
        write_runs(runs_dir, with_provenance({**fake_run("grpo", 0, final={"q0": True}), **changes}))
        result = compare.main(base)
        assert result["heldout_by_category"] is None
        return result["heldout_by_category_reason"]

    assert reason_for() == "the task defines no example_category"  # toy
    assert reason_for(task="hidden_rules").startswith("1 of 1 evaluated questions are not examples of task "
                                                      "'hidden_rules' with task_options {} (e.g. 'q0')")
    assert reason_for(task="no_such_task").startswith("task 'no_such_task' gave no categories: ")
    beyond = "hidden_rules/val/170"  # a held-out question of the default 200, not of the run's 150
    assert beyond in {e.id for e in get_task("hidden_rules").examples("val")}
    assert reason_for(task="hidden_rules", evaluations=[{**run["evaluations"][0], "per_question": {beyond: True}}],
                      config=run["config"]).startswith(f"1 of 1 evaluated questions are not examples of task "
                                                       f"'hidden_rules' with task_options {options} (e.g. '{beyond}')")
