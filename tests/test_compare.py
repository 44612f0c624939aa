"""benchmarks/compare.py: every method end to end on the tiny model (a budget of a few trajectories),
the results JSON / PNG / table, the reuse of finished runs, and the efficiency number on hand-made curves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

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
        # the held-out curve: every val question greedily before the step and after it, per question
        assert m["val_curve"]["trajectories"] == [0, 4] and len(m["val_after_per_question"]) == 4
        run = json.loads((out / "compare_runs" / name / "seed_0.json").read_text())
        assert [e["step"] for e in run["evaluations"]] == [0, 1] and run["generation_backend"] == "hf"
        assert len(run["src"]["src_hash"]) == 16 and run["config"]["trainer"]["max_steps"] == 1
        # LOPD's margin and beta travel in its run file (x = trajectories), no other method has them
        expected = {"by_rollouts/margin_delta", "by_rollouts/beta"} if name == "lopd" else set()
        assert set(run["method_curves"]) == expected and all(x == 4 for c in run["method_curves"].values() for x, _ in c)
    assert data["val_examples"] == 4 and data["start_val_success"] is not None
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
    with pytest.raises(SystemExit, match="^error: --budget 2 is smaller than one grpo step"):
        compare.main(["--config-dir", str(TINY), "--budget", "2", "--methods", "grpo", "--root", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_trajectories_per_step_must_be_explicit(compare):
    with pytest.raises(ValueError, match="must set model.init_args.group_size"):
        compare.trajectories_per_step({"data": {"init_args": {"examples_per_step": 2}}, "model": {"init_args": {}}})
    assert compare.trajectories_per_step(
        {"data": {"init_args": {"examples_per_step": 2}}, "model": {"init_args": {"group_size": 4}}}) == 8


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


# ---------------------------------------------------------------------- issue 17: the evidence comparison
def fake_run(method, seed, *, final, start=None, curve=(0.0, 0.5), src="aaaa1111", backend="hf", budget=8):
    """A run file's content as compare.finished_result writes it: held-out evaluations at steps 0 and 2
    (trajectories 0 and 8), ``final`` question id -> success."""
    start = start or {q: False for q in final}
    evaluations = [
        {"step": step, "trajectories": 4 * step, "questions": len(per_q), "solved": sum(per_q.values()),
         "success": sum(per_q.values()) / len(per_q), "per_question": per_q}
        for step, per_q in ((0, start), (2, final))
    ]
    return {"method": method, "seed": seed, "run": f"seed_{seed}", "budget_trajectories": budget,
            "trajectories_per_step": 4, "steps": 2, "learning_rate": 1e-4,
            "src": {"src_tree": "t" + src, "src_dirty": False, "src_hash": src}, "generation_backend": backend,
            "task": "toy", "model": "tiny", "curve": [[4, curve[0]], [8, curve[1]]], "evaluations": evaluations,
            "summary": {"peak_rss_mb": 100.0, "seconds_per_step_median": {}}, "wall_s": 5.0, "attempts": []}


def write_runs(runs_dir, *runs):
    for run in runs:
        path = runs_dir / run["method"] / f"seed_{run['seed']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run))


def test_runs_that_finish_but_cannot_be_aggregated_warn_and_return_their_files(compare, tmp_path, monkeypatch, capsys):
    """A plan's runs done beside run files that must not be mixed with them (here another src tree; in the
    experience plan, ``--only`` runs on a rebuilt input before ``--same-input`` declares it): the runs succeeded,
    so the call says why they were not aggregated in one warning line and returns, instead of failing after them
    with the aggregation's error (exit status 1 for a run that finished)."""
    runs_dir = tmp_path / "runs_files"
    write_runs(runs_dir, fake_run("grpo", 1, final={"q0": True}, src="bbbb2222"))

    def finished(spec, config, *, result_path, **kw):
        write_runs(result_path.parent.parent, fake_run(spec.method, spec.seed, final={"q0": False}))

    monkeypatch.setattr(compare, "run_one", finished)
    out = tmp_path / "out"
    result = compare.main(["--config-dir", str(TINY), "--budget", "8", "--methods", "grpo", "--seeds", "0",
                           "--root", str(tmp_path / "runs"), "--out-dir", str(out), "--runs-dir", str(runs_dir)])
    assert result["run_files"] == [str(runs_dir / "grpo" / "seed_0.json")]
    assert result["aggregate_refused"].startswith("refusing to aggregate runs from 2 src trees (aaaa1111: "
                                                  "grpo/seed_0.json; bbbb2222: grpo/seed_1.json); aggregate one with --src-tree")
    warning = capsys.readouterr().out.strip().splitlines()[-1]
    assert warning == (f"warning: the runs are done (their files are in {runs_dir}) but not aggregated, and any earlier "
                       f"compare.* in {out} is not updated: {result['aggregate_refused']}; aggregate them with "
                       "--aggregate-only once that is resolved")
    assert not (out / "compare.json").exists()
    with pytest.raises(SystemExit, match="^error: refusing to aggregate runs from 2 src trees"):  # as before, alone
        compare.main(["--aggregate-only", "--out-dir", str(out), "--runs-dir", str(runs_dir)])


def test_the_evidence_plan_runs_lopd_and_grpo_first_then_the_rest(compare, tmp_path):
    assert compare.evidence_plan() == [
        ("lopd", 0), ("grpo", 0), ("lopd", 1), ("grpo", 1), ("lopd", 2), ("grpo", 2),
        ("sdpo", 0), ("sdpo", 1), ("lopd_m0", 0), ("lopd_m0", 1), ("opsd", 0), ("skill_sd", 0),
        ("lopd_balanced", 0), ("lopd_balanced", 1), ("lopd_m0_balanced", 0), ("lopd_m0_balanced", 1),
    ]
    sweep = tmp_path / "compare_lr_sweep.json"
    sweep.write_text(json.dumps({"chosen": {"lopd": 3e-5, "grpo": 1e-5}}))
    # the real configs: 192 trajectories = 48 steps of 4, evaluations every 16 steps; nothing runs
    plan = compare.main(["--plan", "evidence", "--dry-run", "--out-dir", str(tmp_path), "--root", str(tmp_path / "runs")])
    rows = [(r["method"], r["run"], r["budget"], r["steps"], r["learning_rate"], r["state"]) for r in plan["plan"]]
    rates = {m: 3e-5 for m in ("lopd", "lopd_m0", "lopd_balanced", "lopd_m0_balanced")}  # LOPD's ablations: LOPD's rate
    assert rows == [(m, f"seed_{s}", 192, 48, rates.get(m, 1e-5), "new") for m, s in compare.evidence_plan()]
    # the sweep's plan: LOPD and GRPO at each rate, 64 trajectories = 16 steps, judged at the end only
    sweep_plan = compare.main(["--plan", "evidence", "--dry-run", "--sweep-lr", "1e-5,3e-5,1e-4", "--out-dir",
                               str(tmp_path), "--root", str(tmp_path / "runs")])["plan"]
    assert [(r["method"], r["run"], r["steps"], r["learning_rate"]) for r in sweep_plan] == [
        (m, f"lr_{lr:g}", 16, lr) for m in ("lopd", "grpo") for lr in (1e-5, 3e-5, 1e-4)]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "runs_lr_sweep").exists()
    # vLLM rollouts: the fits run with an environment that has vLLM (--lopd), or the plan stops before any run
    vllm = ["--plan", "evidence", "--dry-run", "--out-dir", str(tmp_path), "--root", str(tmp_path / "runs"),
            "--generation-backend", "vllm"]
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(SystemExit, match="needs vLLM, which this environment lacks: pass --lopd .venv-vllm/bin/lopd"):
            compare.main(vllm)
    assert len(compare.main([*vllm, "--lopd", str(tmp_path / "lopd")])["plan"]) == 16
    assert compare.lopd_command() == [str(tmp_path / "lopd")]
    compare.LOPD_EXECUTABLE = None
    # without a sweep file, the evidence plan stops with one line naming the command that makes it
    with pytest.raises(SystemExit, match="no learning-rate sweep at .*--sweep-lr 3e-5,1e-4,3e-4"):
        compare.main(["--plan", "evidence", "--dry-run", "--out-dir", str(tmp_path / "elsewhere")])


def test_a_run_config_evaluates_every_held_out_question_at_the_start_between_and_the_end(compare, tmp_path):
    config = compare.method_config(ROOT / "configs" / "compare", "grpo")
    spec = compare.RunSpec("grpo", 1, 192, learning_rate=3e-5)
    run = compare.run_config(config, spec, root=tmp_path, student="runs/evidence/sft_student", backend="vllm")
    trainer, init = run["trainer"], run["model"]["init_args"]
    assert (trainer["max_steps"], trainer["val_check_interval"], trainer["limit_val_batches"]) == (48, 16, 1.0)
    assert run["data"]["init_args"]["val_limit"] == 65 and init["validate_before_training"] and init["save_generations"]
    assert (init["learning_rate"], init["generation_backend"], init["model"], init["seed"]) == (3e-5, "vllm", "runs/evidence/sft_student", 1)
    checkpoint = next(c for c in trainer["callbacks"] if c["class_path"].endswith("ModelCheckpoint"))
    assert checkpoint["init_args"]["save_last"] and checkpoint["init_args"]["dirpath"] == str(tmp_path / "grpo" / "seed_1" / "checkpoints")
    assert [compare.evaluation_interval(n, 3) for n in (2, 3, 8, 16, 48, 50)] == [1, 1, 2, 4, 16, 10]
    with pytest.raises(ValueError, match=r"47 steps cannot hold 3 evenly spaced held-out evaluations .*every 1 steps would make 47"):
        compare.run_config(config, compare.RunSpec("grpo", 0, 188), root=tmp_path)
    # the sweep's runs validate on the dev slice of the train split, with a bank of their own
    lopd = compare.method_config(ROOT / "configs" / "compare", "lopd")
    dev = compare.run_config(lopd, compare.RunSpec("lopd", 0, 64, dev_slice=32, evaluations=1), root=tmp_path)
    assert {"dev_slice": 32, "dev_slice_seed": 0, "val_limit": None}.items() <= dev["data"]["init_args"].items()
    assert dev["model"]["init_args"]["bank_path"] == str(tmp_path / "bank") and dev["trainer"]["val_check_interval"] == 16


def test_lopd_pretrained_is_the_grids_lopd_with_the_projects_pretrained_composer(compare):
    folder = ROOT / "configs" / "compare"
    grid, pretrained = (compare.method_config(folder, m) for m in ("lopd", "lopd_pretrained"))
    papers = {k: grid["model"]["init_args"].pop(k) for k in ("composer_architecture", "composer_output_gain",
                                                            "warm_start_lr", "warm_start_reconstruction_weight",
                                                            "warm_start_self_retrieval")}
    assert papers["composer_architecture"] == "perceiver"  # the grid's: the paper's composer
    ours = pretrained["model"]["init_args"]
    assert ours.pop("composer_path") == "runs/compare/composer" and not set(papers) & set(ours)  # the module's defaults
    for init in (grid["model"]["init_args"], ours):
        init.pop("warm_start_steps"), init.pop("warm_start_batch_size")
    assert pretrained == grid


@pytest.mark.parametrize("folder", ["compare", "compare_tiny"])
def test_lopd_m0_is_lopd_with_margin_zero(compare, folder):
    lopd, m0 = (compare.method_config(ROOT / "configs" / folder, m) for m in ("lopd", "lopd_m0"))
    assert m0["model"]["init_args"].pop("margin") == 0.0
    lopd["model"]["init_args"].pop("margin", None)
    assert m0 == lopd


@pytest.mark.parametrize("folder", ["compare", "compare_tiny"])
@pytest.mark.parametrize("method", ["lopd", "lopd_m0"])
def test_the_balanced_ablations_change_only_the_margin_weighting(compare, folder, method):
    paper, balanced = (compare.method_config(ROOT / "configs" / folder, m) for m in (method, f"{method}_balanced"))
    assert balanced["model"]["init_args"].pop("margin_weighting") == "balanced"
    assert paper["model"]["init_args"].get("margin_weighting", "paper") == "paper" and balanced == paper


def test_paired_differences_against_a_hand_computed_example(compare):
    stats = compare.compare_stats
    method = {"q1": 1.0, "q2": 0.0, "q3": 1.0, "q4": 1.0, "extra": 1.0}
    grpo = {"q1": 0.0, "q2": 0.0, "q3": 1.0, "q4": 0.0}
    p = stats.paired_differences(method, grpo, n_boot=4000)
    # differences on the 4 shared questions: +1, 0, 0, +1 -> mean 0.5, won 2, lost 0, tied 2; a resample of
    # 4 is all zeros (mean 0) or all ones (mean 1) with probability 1/16 each (> 2.5%): the interval is [0, 1]
    assert (p["n_questions"], p["mean_difference"], p["won"], p["lost"], p["tied"]) == (4, 0.5, 2, 0, 2)
    assert p["ci"] == [0.0, 1.0] and p["excludes_zero"] is False
    # seed means per question, and a difference 40 questions resolve
    many_m = {f"q{i}": (1.0 if i < 30 else 0.5) for i in range(40)}
    many_g = {f"q{i}": (0.0 if i < 20 else 0.5) for i in range(40)}
    q = stats.paired_differences(many_m, many_g)
    assert q["mean_difference"] == pytest.approx((20 * 1.0 + 10 * 0.5) / 40) and (q["won"], q["lost"]) == (30, 0)
    assert 0 < q["ci"][0] < q["mean_difference"] < q["ci"][1] and q["excludes_zero"] is True
    with pytest.raises(ValueError, match="share no question"):
        stats.paired_differences({"a": 1.0}, {"b": 0.0})


def test_bootstrap_and_t_intervals_on_constructed_examples(compare):
    stats = compare.compare_stats
    assert stats.bootstrap_ci([0.25] * 10) == (0.25, 0.25)
    values = [1.0] * 200 + [0.0] * 200  # mean 0.5, standard error 0.025: a 95% interval about 0.098 wide
    lo, hi = stats.bootstrap_ci(values, n_boot=4000)
    assert isinstance(lo, float) and lo < 0.5 < hi and hi - lo == pytest.approx(0.098, abs=0.01)
    small = stats.bootstrap_ci([1.0] * 5 + [0.0] * 5, n_boot=4000)
    assert small[1] - small[0] > hi - lo  # fewer questions, a wider interval
    # t over 3 seeds: mean 0.4, sd 0.2, half width t(0.975, 2) 4.303 x 0.2 / sqrt(3) = 0.497; clipped at 0
    t = stats.t_interval([0.2, 0.4, 0.6])
    assert t[0] == 0.0 and t[1] == pytest.approx(0.4 + 4.303 * 0.2 / 3 ** 0.5)
    assert stats.t_interval([0.5]) is None


def test_the_held_out_curve_is_read_from_the_generations_files(compare, tmp_path):
    runs = compare.compare_runs
    folder = tmp_path / "generations"
    folder.mkdir()
    answers = {0: [0, 0, 1], 8: [1, 0, 1], 16: [1, 1, 1]}  # step -> success of toy/0, toy/1, toy/2
    for step, successes in answers.items():
        lines = [json.dumps({"step": step, "split": "val", "example_id": f"toy/{i}", "reward": float(s), "success": bool(s),
                             "messages": []}) for i, s in enumerate(successes)]
        (folder / f"val_step_{step}.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "test_step_16.jsonl").write_text(json.dumps({"example_id": "toy/9", "success": True}) + "\n")
    evaluations = runs.heldout_evaluations(tmp_path, trajectories_per_step=4)
    assert [(e["step"], e["trajectories"], e["solved"], e["questions"]) for e in evaluations] == [(0, 0, 1, 3), (8, 32, 2, 3), (16, 64, 3, 3)]
    assert evaluations[1]["per_question"] == {"toy/0": True, "toy/1": False, "toy/2": True}
    assert evaluations[1]["success"] == pytest.approx(2 / 3)
    # two seeds -> the method's held-out curve (mean and std over seeds) and its per-question final success
    other = [dict(e, success=0.0, per_question={q: False for q in e["per_question"]}) for e in evaluations]
    seed_runs = [{"evaluations": evaluations}, {"evaluations": other}]
    h = compare.compare_stats.heldout_summary(seed_runs)
    assert h["val_curve"]["trajectories"] == [0, 32, 64]
    assert h["val_curve"]["mean"] == pytest.approx([1 / 6, 1 / 3, 0.5])
    assert h["val_after_per_question"] == {"toy/0": 0.5, "toy/1": 0.5, "toy/2": 0.5}
    assert (h["val_before"], h["val_after"]) == (pytest.approx(1 / 6), 0.5)


def test_aggregation_refuses_to_mix_src_trees_or_backends_unless_told(compare, tmp_path):
    final = {"q0": True, "q1": False, "q2": True, "q3": False}
    out = tmp_path / "out"
    base = ["--aggregate-only", "--out-dir", str(out), "--bootstrap", "500"]
    write_runs(out / "compare_runs", fake_run("lopd", 0, final=final), fake_run("grpo", 0, final=final, src="bbbb2222"))
    with pytest.raises(SystemExit, match=r"^error: refusing to aggregate runs from 2 src trees \(aaaa1111: lopd/seed_0\.json; "
                                         r"bbbb2222: grpo/seed_0\.json\); aggregate one with --src-tree HASH$"):
        compare.main(base)
    assert not (out / "compare.json").exists()
    only = compare.main([*base, "--src-tree", "bbbb"])
    assert list(only["methods"]) == ["grpo"] and only["src_hash"] == "bbbb2222"
    write_runs(out / "compare_runs", fake_run("grpo", 0, final=final), fake_run("grpo", 1, final=final, backend="vllm"))
    with pytest.raises(SystemExit, match=r"2 generation backends \(hf: grpo/seed_0\.json, lopd/seed_0\.json; vllm: grpo/seed_1\.json\); "
                                         "aggregate one with --backend NAME"):
        compare.main(base)
    assert compare.main([*base, "--backend", "vllm"])["generation_backend"] == "vllm"
    write_runs(out / "compare_runs", fake_run("grpo", 1, final=final, budget=16))  # nor budgets, nor held-out sets
    with pytest.raises(SystemExit, match=r"2 budgets \(trajectories per run\) \(16: grpo/seed_1\.json; 8: .*--budget N"):
        compare.main(base)
    assert compare.main([*base, "--budget", "8"])["methods"]["grpo"]["seeds"] == [0]
    write_runs(out / "compare_runs", fake_run("grpo", 1, final={"other": True}))
    with pytest.raises(SystemExit, match="2 held-out sets .*rerun the runs that differ"):
        compare.main(base)
    with pytest.raises(SystemExit, match="no run file matches --src-tree cccc"):
        compare.main([*base, "--src-tree", "cccc"])


def test_aggregation_of_run_files_writes_the_issue_17_keys(compare, tmp_path):
    out = tmp_path / "out"
    questions = [f"q{i}" for i in range(8)]
    grpo = {q: i < 2 for i, q in enumerate(questions)}
    lopd = {q: i < 6 for i, q in enumerate(questions)}
    write_runs(out / "compare_runs", *(fake_run("grpo", s, final=grpo, curve=(0.0, 0.5)) for s in (0, 1, 2)),
               *(fake_run("lopd", s, final=lopd, curve=(0.5, 0.75), start={q: i < 1 for i, q in enumerate(questions)})
                 for s in (0, 1, 2)), fake_run("sdpo", 0, final=grpo, start=grpo))
    data = compare.main(["--aggregate-only", "--out-dir", str(out), "--bootstrap", "1000", "--smooth", "1"])
    assert json.loads((out / "compare.json").read_text())["val_examples"] == data["val_examples"] == 8
    assert list(data["methods"]) == ["lopd", "grpo", "sdpo"]  # the plan's order
    assert data["start_val_success"] == pytest.approx((3 * 1 / 8 + 3 * 0 + 2 / 8) / 7)
    lopd_m, sdpo_m = data["methods"]["lopd"], data["methods"]["sdpo"]
    assert lopd_m["val_after"] == 0.75 and lopd_m["val_after_ci"] == [0.75, 0.75]  # identical seeds: no spread
    assert sdpo_m["val_after_ci"] is None and "one seed" in sdpo_m["val_after_ci_reason"]
    assert lopd_m["val_curve"]["trajectories"] == [0, 8] and lopd_m["val_curve"]["mean"] == [0.125, 0.75]
    paired = lopd_m["paired_vs_grpo"]
    assert (paired["mean_difference"], paired["won"], paired["lost"], paired["tied"]) == (0.5, 4, 0, 4)
    assert data["methods"]["grpo"]["paired_vs_grpo"] is None and sdpo_m["paired_vs_grpo"]["mean_difference"] == 0.0
    # against its own start: LOPD began with q0 and ends with q0-q5 (5 gained), GRPO began with none (2 gained)
    since = lopd_m["paired_vs_start"]
    assert (since["mean_difference"], since["won"], since["lost"], since["tied"]) == (5 / 8, 5, 0, 3)
    assert since["excludes_zero"] and data["methods"]["grpo"]["paired_vs_start"]["mean_difference"] == 2 / 8
    assert lopd_m["val_before_per_question"] == {q: float(i < 1) for i, q in enumerate(questions)}
    assert "step-0 success" in data["intervals"]["paired_vs_start.ci"]
    assert "no change (8 questions tied)" in (out / "compare.md").read_text()  # SDPO's run began where it ended
    # LOPD's reward (0.5 at 4 trajectories) reaches GRPO's final reward (0.5) after 4 of its 8 trajectories
    assert data["lopd_budget_fraction_to_grpo_final"] == 0.5 and data["lopd_budget_fraction_to_grpo_final_ci"] == [0.5, 0.5]
    assert "Student's t" in data["intervals"]["val_after_ci"] and "bootstrap over questions" in data["intervals"]["paired_vs_grpo.ci"]
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "+0.500 [" in (out / "compare.md").read_text() and "+0.625 [" in (out / "compare.md").read_text()


def test_budget_fraction_reaches_on_a_short_window_and_compares_with_grpos_long_one(compare):
    xs = [4 * (i + 1) for i in range(8)]
    lopd, grpo = {"rollouts": xs, "reward": [1.0] * 8}, {"rollouts": xs, "reward": [0.0] * 4 + [0.5] * 4}
    # GRPO's final over 4 steps is 0.5; LOPD reaches it at its first step on a 1-step window (4 of 32)...
    assert compare.budget_fraction(lopd, grpo, 4, 1) == pytest.approx(4 / 32)
    # ...but only after 4 steps (16 of 32) if it also had to fill the 4-step window: a floor of a quarter
    assert compare.budget_fraction(lopd, grpo, 4) == pytest.approx(16 / 32)
    assert "not more than the 4-step window" in compare.compare_stats.grpo_improvement([0.0, 0.5, 0.5], 4, (0.0, 1))


def test_a_training_reward_crossing_lopd_does_not_hold_is_said_so(compare, tmp_path):
    """The fraction counts LOPD's first crossing of GRPO's final reward; a LOPD that crossed it and ended below
    (issue 33: 26% of the budget, then down to 0.03 against GRPO's 0.22) has its own final reward in the
    results and a sentence in the table, not a fraction alone that reads as reaching GRPO."""
    questions = [f"q{i}" for i in range(4)]
    out = tmp_path / "fell"
    write_runs(out / "compare_runs", fake_run("grpo", 0, final={q: True for q in questions}, curve=(0.0, 0.5)),
               fake_run("lopd", 0, final={q: False for q in questions}, curve=(0.75, 0.0)))
    data = compare.main(["--aggregate-only", "--out-dir", str(out), "--bootstrap", "200", "--smooth", "1"])
    # the start level is the first step over both runs, (0 + 0.75) / 2 = 0.375, below GRPO's final 0.5: defined
    assert data["lopd_budget_fraction_to_grpo_final"] == 0.5 and data["lopd_final_reward"] == 0.0
    assert ("LOPD did not hold it: it ends at 0.000 on the mean it crossed on, below GRPO's 0.500 (the fraction "
            "counts the first crossing).") in (out / "compare.md").read_text()
    write_runs(out / "compare_runs", fake_run("lopd", 0, final={q: False for q in questions}, curve=(0.75, 0.5)))
    data = compare.main(["--aggregate-only", "--out-dir", str(out), "--bootstrap", "200", "--smooth", "1"])
    assert data["lopd_final_reward"] == 0.5 and "did not hold" not in (out / "compare.md").read_text()  # held: no note
    # held is judged on the mean the crossing is (3 steps), not GRPO's long window: a LOPD that crosses late and
    # stays above has no note, although its 4-step final (0.45) is below GRPO's 0.5
    xs = [4 * (i + 1) for i in range(8)]
    late = {"rollouts": xs, "reward": [0.0] * 5 + [0.6] * 3, "reward_per_seed": [[0.0] * 5 + [0.6] * 3]}
    grpo = {"rollouts": xs, "reward": [0.0] * 4 + [0.5] * 4, "reward_per_seed": [[0.0] * 4 + [0.5] * 4]}
    stats = compare.compare_stats._efficiency({"lopd": late, "grpo": grpo}, 4, 50)
    assert stats["lopd_budget_fraction_to_grpo_final"] == 1.0 and stats["lopd_final_reward"] == pytest.approx(0.6)
    import compare_report  # on sys.path once compare.py is loaded

    assert "LOPD's budget to reach GRPO's final training reward (0.500): 100%" in compare_report._efficiency_line(stats)[-1]
    assert "did not hold" not in compare_report._efficiency_line(stats)[-1]


def test_budget_fraction_is_undefined_when_grpo_did_not_improve(compare, tmp_path):
    stats = compare.compare_stats
    start = stats.start_train_reward({"grpo": {"reward_per_seed": [[0.5, 0.25, 0.25, 0.5, 0.0]]}}, 2)  # (0.5 + 0.25) / 2
    reason = stats.grpo_improvement([0.5, 0.25, 0.25, 0.5, 0.0], 2, start)  # final 0.25
    assert reason.startswith("GRPO's final smoothed training reward (0.250) is not above the start student's (0.375: "
                             "the mean of the first 2 steps over 1 runs")
    assert stats.grpo_improvement([0.0, 0.25, 0.5, 0.75], 2, (0.125, 1)) is None
    # in compare.json: the fraction, its interval and the line in compare.md say why there is no number
    questions = [f"q{i}" for i in range(4)]
    out = tmp_path / "flat"
    write_runs(out / "compare_runs", fake_run("grpo", 0, final={q: True for q in questions}, curve=(0.5, 0.25)),
               fake_run("lopd", 0, final={q: True for q in questions}, curve=(0.5, 0.5)))
    data = compare.main(["--aggregate-only", "--out-dir", str(out), "--bootstrap", "200", "--smooth", "1"])
    assert data["lopd_budget_fraction_to_grpo_final"] is None and data["lopd_budget_fraction_to_grpo_final_ci"] is None
    assert "GRPO did not improve" in data["lopd_budget_fraction_to_grpo_final_reason"]
    assert "LOPD's budget to reach GRPO's final training reward: undefined (GRPO's final" in (out / "compare.md").read_text()


def test_grpo_must_improve_on_the_start_student_every_method_shares(compare):
    stats = compare.compare_stats
    # GRPO's seed rose from 0 to 0.5 but LOPD's began at 1.0: the start student's level, pooled over both runs'
    # first 2 steps, is (0 + 1) / 2 = 0.5, which GRPO's final 0.5 does not pass
    methods = {"grpo": {"reward_per_seed": [[0.0, 0.0, 0.5, 0.5]]}, "lopd": {"reward_per_seed": [[1.0, 1.0, 0.75, 0.75]]}}
    assert stats.start_train_reward(methods, 2) == (0.5, 2)
    assert stats.grpo_improvement([0.0, 0.0, 0.5, 0.5], 2, (0.0, 1)) is None  # against its own first window it "improved"
    reason = stats.grpo_improvement([0.0, 0.0, 0.5, 0.5], 2, stats.start_train_reward(methods, 2))
    assert reason.startswith("GRPO's final smoothed training reward (0.500) is not above the start student's (0.500: "
                             "the mean of the first 2 steps over 2 runs of every method, all starting from the same student)")
    # four runs (one exactly the window long), a curve shorter than the window left out: (0.25 + 0.75 + 0.5 + 0.5) / 4
    methods["sdpo"] = {"reward_per_seed": [[0.5, 0.5, 0.5], [1.0]]}
    methods["opsd"] = {"reward_per_seed": [[0.0, 1.0]]}
    methods["lopd"]["reward_per_seed"] = [[0.5, 1.0, 0.0]]
    methods["grpo"]["reward_per_seed"] = [[0.0, 0.5, 1.0]]
    assert stats.start_train_reward(methods, 2) == (pytest.approx(0.5), 4)
    assert stats.grpo_improvement([0.0, 0.5, 1.0], 2, stats.start_train_reward(methods, 2)) is None  # 0.75 > 0.5


def test_budget_fraction_ci_is_null_with_a_reason_when_lopd_never_reaches_grpo(compare):
    stats = compare.compare_stats
    grpo = {"rollouts": [4, 8], "per_seed": [[0.5, 1.0], [0.5, 1.0]]}  # final reward 1.0 (window 1)
    never = stats.budget_fraction_ci({"rollouts": [4, 8], "per_seed": [[0.0, 0.25], [0.0, 0.5]]}, grpo, 1, n_boot=200)
    assert never["ci"] is None and "never reaches GRPO's final smoothed reward (1.000)" in never["reason"]
    # seed means [0.5, 1.0] reach it at 8 of 8 trajectories; resampling the seeds: at 4 (both the second
    # seed, 1 in 4) or at 8
    half = stats.budget_fraction_ci({"rollouts": [4, 8], "per_seed": [[0.0, 1.0], [1.0, 1.0]]}, grpo, 1, n_boot=400)
    assert half["ci"] == [0.5, 1.0] and half["never_reached_share"] == 0.0 and half["reason"] is None
    # against a final reward of 0.5, one LOPD seed never gets there: a quarter of the resamples never reach it
    low = {"rollouts": [4, 8], "per_seed": [[0.25, 0.5], [0.25, 0.5]]}
    mixed = stats.budget_fraction_ci({"rollouts": [4, 8], "per_seed": [[0.0, 0.0], [1.0, 1.0]]}, low, 1, n_boot=400)
    assert mixed["ci"] == [0.5, None] and "never reaches" in mixed["reason"] and 0.1 < mixed["never_reached_share"] < 0.4


def test_an_interrupted_run_resumes_from_its_checkpoint(compare, tmp_path, monkeypatch):
    def args(name):
        return ["--config-dir", str(TINY), "--budget", "12", "--methods", "grpo", "--seeds", "0", "--root",
                str(tmp_path / name / "runs"), "--out-dir", str(tmp_path / name), "--in-process", "--checkpoint-every", "1",
                "--bootstrap", "200"]

    real = compare.run_lopd

    def killed_after_step_2(command, **kw):  # the first fit stops after its step-2 checkpoint, the process "dies"
        real([*command, "--trainer.max_steps=2"], **kw)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(compare, "run_lopd", killed_after_step_2)
    with pytest.raises(KeyboardInterrupt):
        compare.main(args("resumed"))
    run_dir = tmp_path / "resumed" / "runs" / "grpo" / "seed_0"
    assert compare.checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 2
    assert not (tmp_path / "resumed" / "compare_runs" / "grpo" / "seed_0.json").exists()
    assert compare.main([*args("resumed"), "--dry-run"])["plan"][0]["state"] == "resumable at step 2"
    monkeypatch.setattr(compare, "run_lopd", real)
    resumed = compare.main(args("resumed"))
    result = json.loads((tmp_path / "resumed" / "compare_runs" / "grpo" / "seed_0.json").read_text())
    assert [a["start_step"] for a in result["attempts"]] == [0, 2]  # continued at step 2, not from 0
    first, second = result["attempts"]
    assert first["cpu_capability"] == second["cpu_capability"] == compare.compare_provenance.cpu_capability_of() is not None
    assert first["cpu"] == second["cpu"] == compare.cpu_model()
    assert first["wall_s"] is None and result["wall_s"] == pytest.approx(first["wall_s_to_checkpoint"] + second["wall_s"])
    assert compare.checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 3 and result["summary"]["steps"] == 3
    newest = max(run_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    assert [x for x, _ in compare.compare_runs.reward_points(newest)] == [12]  # the resumed fit trained step 3 only
    assert [x for x, _ in result["curve"]] == [4, 8, 12] and [e["step"] for e in result["evaluations"]] == [0, 1, 2, 3]
    # the same as a run that was never interrupted
    straight = compare.main(args("straight"))
    again = json.loads((tmp_path / "straight" / "compare_runs" / "grpo" / "seed_0.json").read_text())
    assert again["curve"] == result["curve"]
    assert [e["per_question"] for e in again["evaluations"]] == [e["per_question"] for e in result["evaluations"]]
    assert straight["methods"]["grpo"]["val_curve"] == resumed["methods"]["grpo"]["val_curve"]


def test_the_sweep_chooses_on_the_dev_slice(compare, tmp_path):
    sweep = compare.compare_sweep
    assert sweep.choose_learning_rate({1e-5: {"dev_success": 0.3, "train_reward": 0.9},
                                       3e-5: {"dev_success": 0.4, "train_reward": 0.1},
                                       1e-4: {"dev_success": 0.4, "train_reward": 0.3}}) == 1e-4  # tie -> train reward
    assert sweep.choose_learning_rate({1e-5: {"dev_success": 0.4, "train_reward": None},
                                       3e-5: {"dev_success": 0.4, "train_reward": None}}) == 1e-5  # then the smaller rate
    with pytest.raises(ValueError, match="distinct positive learning rates"):
        sweep.parse_rates("1e-5,-1")
    # end to end on the tiny model: LOPD and GRPO at two rates, one step each, judged on 8 train questions
    out = tmp_path / "out"
    doc = compare.main(["--config-dir", str(TINY), "--sweep-lr", "1e-3,1e-2", "--sweep-budget", "4", "--dev-questions", "8",
                        "--seeds", "0", "--root", str(tmp_path / "runs"), "--out-dir", str(out), "--in-process"])
    saved = json.loads((out / "compare_lr_sweep.json").read_text())
    assert saved["chosen"] == doc["chosen"] and set(saved["chosen"]) == {"lopd", "grpo"}
    assert saved["learning_rates"] == [1e-3, 1e-2] and saved["dev_questions"] == 8 and saved["rule"] == sweep.RULE
    from lopd_lightning.tasks import get_task

    train, heldout = ({ex.id for ex in get_task("toy").examples(s)} for s in ("train", "val"))
    for method in ("lopd", "grpo"):
        runs = saved["methods"][method]["runs"]
        assert set(runs) == {"0.001", "0.01"} and saved["methods"][method]["dev_start_success"] is not None
        for entry in runs.values():
            assert entry["dev_questions"] == 8 and set(entry["dev_per_question"]) <= train  # never a held-out question
            assert not set(entry["dev_per_question"]) & heldout
    assert (tmp_path / "runs_lr_sweep" / "lopd" / "lr_0.001" / "run.yaml").exists()
    rates = sweep.learning_rates_for(out / "compare_lr_sweep.json", ["lopd", "lopd_m0", "lopd_m0_balanced", "grpo", "sdpo", "opsd"])
    assert rates == {"lopd": doc["chosen"]["lopd"], "lopd_m0": doc["chosen"]["lopd"], "lopd_m0_balanced": doc["chosen"]["lopd"],
                     "grpo": doc["chosen"]["grpo"], "sdpo": doc["chosen"]["grpo"], "opsd": doc["chosen"]["grpo"]}
