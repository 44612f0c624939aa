"""benchmarks/vs_trl.py: the settings both sides are given, the run order, the reward wrapper and the JSON's shape
(offline, no TRL), and one tiny end-to-end run of both sides that needs TRL (``make test-peer`` builds
``.venv-peer`` with the ``peer`` extra and runs this file; elsewhere that test is skipped)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import load_benchmark

HAS_TRL = importlib.util.find_spec("trl") is not None
needs_trl = pytest.mark.skipif(not HAS_TRL, reason="trl is not installed here: make test-peer runs this test")


@pytest.fixture(scope="module")
def vs_trl():
    return load_benchmark("vs_trl")


def test_quick_and_defaults(vs_trl):
    args = vs_trl.parse_args([])
    assert (args.student, args.task, args.max_new_tokens, args.method_list) == (
        "smollm2-135m-instruct", "bfcl_live_simple", 96, ["grpo", "sdpo", "lopd"])
    quick = vs_trl.parse_args(["--quick"])
    assert (quick.student, quick.task, quick.pairings, quick.steps, quick.warmup) == ("tiny", "toy", 1, 1, 1)


@pytest.mark.parametrize("argv, names", [
    (["--group", "1"], "--group"), (["--warmup", "0"], "--warmup"), (["--pairings", "0"], "--pairings"),
    (["--methods", "grpo,ppo"], "--methods"), (["--child", "trl", "lopd", "--child-out", "x"], "--child"),
    (["--child", "ours", "grpo"], "--child-out"), (["--student", "/no/such/folder"], "--student"),
])
def test_bad_input_one_line(vs_trl, capsys, argv, names):
    with pytest.raises(SystemExit):
        vs_trl.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert names in err, err


def test_run_order_alternates_and_places_lopd(vs_trl):
    order = vs_trl.run_order(2, ["grpo", "sdpo", "lopd"])
    assert order == [(0, "grpo", "ours"), (0, "grpo", "trl"), (0, "sdpo", "ours"), (0, "sdpo", "trl"),
                     (0, "lopd", "ours"), (1, "grpo", "trl"), (1, "grpo", "ours"), (1, "sdpo", "trl"),
                     (1, "sdpo", "ours"), (1, "lopd", "ours")]
    assert vs_trl.run_order(1, ["lopd"]) == [(0, "lopd", "ours")]


def test_child_argv_carries_the_settings(vs_trl, tmp_path):
    args = vs_trl.parse_args(["--quick", "--group", "3", "--tasks-per-step", "1"])
    cmd = vs_trl.child_argv(args, "trl", "sdpo", 5, tmp_path / "r.json")
    child = vs_trl.parse_args(cmd[2:])
    for key in ("student", "task", "steps", "warmup", "tasks_per_step", "group", "max_new_tokens", "threads"):
        assert getattr(child, key) == getattr(args, key), key
    assert child.child == ["trl", "sdpo"] and child.child_seed == 5


@pytest.mark.parametrize("method", ["grpo", "sdpo"])
def test_trl_config_matches_ours(vs_trl, method):
    args = vs_trl.parse_args(["--quick"])
    ours = vs_trl.our_module_kwargs(method, args)
    trl = vs_trl.trl_config_kwargs(method, args, seed=3, output_dir="/tmp/x")
    assert trl["per_device_train_batch_size"] == args.tasks_per_step * ours["group_size"]
    assert trl["num_generations"] == ours["group_size"] and trl["max_completion_length"] == ours["max_new_tokens"]
    for key in ("temperature", "top_p", "top_k", "learning_rate", "weight_decay"):
        assert trl[key] == ours[key], key
    assert trl["max_grad_norm"] == ours["grad_clip"] and trl["max_steps"] == args.warmup + args.steps
    assert (trl["bf16"], trl["fp16"], trl["gradient_checkpointing"], ours["gradient_checkpointing"]) == (False,) * 4
    assert ours["dtype"] == "float32" and trl["use_vllm"] is False and ours["generation_backend"] == "hf"
    assert (trl["beta"], trl["num_iterations"], trl["seed"], trl["shuffle_dataset"]) == (0.0, 1, 3, False)
    if method == "grpo":
        assert (trl["epsilon"], trl["epsilon_high"]) == (ours["clip_eps_low"], ours["clip_eps_high"])
        assert ours["kl_coef"] == 0.0 and ours["ppo_epochs"] == 1 and ours["advantage_eps"] == 1e-4
        assert trl["loss_type"] == "dapo" and trl["scale_rewards"] == "group"
        assert ours["logps_temperature"] == trl["temperature"]  # TRL divides the training logits by it
    else:
        assert trl["teacher_update_rate"] == ours["teacher_ema_rate"] and trl["teacher_model_kind"] == "ema"
        assert trl["distillation_topk"] == ours["distill_top_k"] and trl["distillation_add_tail"] is True
        assert trl["distillation_alpha"] == 1.0 and ours["divergence"] == "topk_reverse_kl"
        assert trl["distillation_is_clip"] == ours["is_clip"]
        assert trl["success_reward_threshold"] == ours["success_threshold"]
        assert trl["dont_reprompt_on_self_success"] is (not ours["allow_self_demo"])
        assert trl["include_environment_feedback"] is ours["include_feedback"] is False
        assert ours["distill_temperature"] == trl["temperature"] and trl["max_prompt_length"] is None


def test_trl_reprompt_is_this_projects_teacher_text(vs_trl):
    """TRL replaces the last user message by reprompt_template(prompt, solution, feedback); this project puts
    its context at the start of the first user message: for one user message the teacher reads the same text."""
    from lopd_lightning.modules.sdpo import SDPO_CONTEXT_SUFFIX, SDPO_DEMO_TEMPLATE

    kw = vs_trl.trl_config_kwargs("sdpo", vs_trl.parse_args(["--quick"]), seed=0, output_dir="/tmp/x")
    solution = kw["solution_template"].format(successful_previous_attempt='f(x=1)')
    trl_text = kw["reprompt_template"].format(prompt="Call f with 1.", solution=solution, feedback="")
    assert trl_text == SDPO_DEMO_TEMPLATE.format(demo="f(x=1)") + SDPO_CONTEXT_SUFFIX + "Call f with 1."


def test_our_kwargs_build_the_modules(vs_trl):
    from lopd_lightning.modules import GRPOModule, SDPOModule

    args = vs_trl.parse_args(["--quick"])
    for cls, method in ((GRPOModule, "grpo"), (SDPOModule, "sdpo")):
        module = cls("tiny", **vs_trl.our_module_kwargs(method, args))
        assert vs_trl.lora_read_back(module.backbone)["r"] == 16
        assert vs_trl.model_dtype(module.backbone) == "float32"


def test_task_reward_scores_with_the_checker(vs_trl):
    args = vs_trl.parse_args(["--quick", "--tasks-per-step", "2"])
    task, examples = vs_trl.step_examples(args, seed=0)
    assert len(examples) == 2 * (args.warmup + args.steps)
    reward = vs_trl.TaskReward(task, {ex.id: ex for ex in examples})
    good = [[{"role": "assistant", "content": task.reference_solution(ex)}] for ex in examples]
    bad = [[{"role": "assistant", "content": "no idea"}] for _ in examples]
    ids = [ex.id for ex in examples]
    assert reward(prompts=[None] * len(ids), completions=good, example_id=ids, completion_ids=[[1, 2]] * len(ids)) \
        == [1.0] * len(ids)
    assert max(reward(prompts=[None] * len(ids), completions=bad, example_id=ids)) < 1.0
    assert len(reward.calls) == 2 and reward.completion_tokens == [2 * len(ids), 0]


def test_prompt_tokens_equal_on_the_tiny_tokenizer(vs_trl):
    from lopd_lightning.models import tiny_tokenizer

    args = vs_trl.parse_args(["--quick"])
    task, examples = vs_trl.step_examples(args, seed=0)
    assert vs_trl.prompt_tokens_equal(task, tiny_tokenizer(), examples) == 1.0


def _fake_run(pairing, side, method, tps, rss):
    return {"pairing": pairing, "side": side, "method": method, "trajectories_per_s": tps, "peak_rss_mb": rss,
            "seed": pairing, "mean_reward_per_step": [0.0, 0.5], "settings": {"side": side}}


def test_summarize_shape_and_ratios(vs_trl):
    args = vs_trl.parse_args(["--pairings", "3"])
    runs = []
    for k, (ours, trl) in enumerate([(2.0, 1.0), (3.0, 2.0), (1.0, 1.0)]):
        runs += [_fake_run(k, "ours", "grpo", ours, 500 + k), _fake_run(k, "trl", "grpo", trl, 700)]
        runs += [_fake_run(k, "ours", "sdpo", ours, 600), _fake_run(k, "trl", "sdpo", 2 * trl, 800 + k)]
        runs.append(_fake_run(k, "ours", "lopd", 1.0, 900))
    s = vs_trl.summarize(runs, args)
    assert s["speedup_over_trl"]["grpo"]["per_pairing"] == [2.0, 1.5, 1.0]
    assert s["speedup_over_trl"]["grpo"]["median"] == 1.5 and s["speedup_over_trl"]["grpo"]["met"] is True
    assert s["speedup_over_trl"]["sdpo"]["median"] == 0.75 and "lopd" not in s["speedup_over_trl"]
    assert s["peak_rss_mb"]["grpo"] == {"ours": 502, "trl": 700, "ours_over_trl": round(502 / 700, 4)}
    assert s["peak_rss_mb"]["lopd"]["trl"] is None
    assert s["lopd_beside_trl_sdpo"]["lopd_over_trl_sdpo"] == round(1.0 / 2.0, 4)
    assert [c["seed"] for c in s["reward_curves"]["grpo"]["trl"]] == [0, 1, 2]
    assert s["settings_by_method"]["sdpo"] == {"ours": {"side": "ours"}, "trl": {"side": "trl"}}
    json.dumps(s)


class FakeLaunch:
    """Stands in for ``subprocess.run`` of a child: writes a result to its ``--child-out`` and counts the calls
    ``(seed, side, method)``; ``fail_at`` makes that call (0-based) exit 1 without a result, as a cut session or
    a crash would; ``silent`` makes every call exit 0 without one; ``during`` runs while the child "runs"."""

    def __init__(self, vs_trl, fail_at=None, silent=False, during=None):
        self.vs_trl, self.fail_at, self.silent, self.during, self.calls = vs_trl, fail_at, silent, during, []

    def __call__(self, cmd, env):
        child = self.vs_trl.parse_args(cmd[2:])
        self.calls.append((child.child_seed, *child.child))
        if self.during:
            self.during()
        if self.fail_at == len(self.calls) - 1:
            return type("Done", (), {"returncode": 1})()
        if not self.silent:
            side, method = child.child
            out = {"side": side, "method": method, "seed": child.child_seed, "peak_rss_mb": 100.0,
                   "trajectories_per_s": 1.0 + len(self.calls), "mean_reward_per_step": [0.0], "settings": {}}
            child.child_out.write_text(json.dumps(out))
        return type("Done", (), {"returncode": 0})()


def _calls(vs_trl, argv, **fake):
    launch = FakeLaunch(vs_trl, **fake)
    runs = vs_trl.run_children(vs_trl.parse_args(argv), {}, launch=launch)
    return launch.calls, runs


def test_runs_resume_from_kept_results(vs_trl, tmp_path, capsys):
    argv = ["--student", "tiny", "--pairings", "2", "--methods", "grpo,lopd", "--runs-dir", str(tmp_path / "runs")]
    expected = [(k, side, method) for k, method, side in vs_trl.run_order(2, ["grpo", "lopd"])]
    # a session cut at the fourth child (pairing 1's first GRPO side): pairing 0 is kept, nothing of pairing 1
    with pytest.raises(SystemExit, match="the trl grpo run of pairing 1 failed"):
        _calls(vs_trl, argv, fail_at=3)
    assert len(list((tmp_path / "runs").glob("p0_*.json"))) == 3 and not list((tmp_path / "runs").glob("p1_*"))
    # the next call reads pairing 0 back and runs only pairing 1, each child once
    calls, runs = _calls(vs_trl, argv)
    assert calls == expected[3:]
    assert [(r["pairing"], r["side"], r["method"], r["resumed"]) for r in runs] == [
        (k, side, method, k == 0) for k, side, method in expected]
    assert [r["trajectories_per_s"] for r in runs[:3]] == [2.0, 3.0, 4.0]  # the first call's, not run again
    assert len({r["call"] for r in runs[:3]}) == 1 and runs[0]["call"] != runs[3]["call"]
    # everything kept: nothing runs, also for a call with fewer methods; --no-resume runs everything
    assert _calls(vs_trl, argv)[0] == [] and _calls(vs_trl, [*argv, "--methods", "lopd"])[0] == []
    assert _calls(vs_trl, [*argv, "--no-resume"])[0] == expected


def test_a_pairing_cut_between_its_sides_runs_both_again(vs_trl, tmp_path, capsys):
    argv = ["--student", "tiny", "--pairings", "1", "--methods", "grpo", "--runs-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="the trl grpo run of pairing 0 failed"):
        _calls(vs_trl, argv, fail_at=1)
    capsys.readouterr()
    calls, runs = _calls(vs_trl, argv)
    assert calls == [(0, "ours", "grpo"), (0, "trl", "grpo")] and runs[0]["call"] == runs[1]["call"]
    assert "its other side is not kept from the same call" in capsys.readouterr().err


def test_kept_results_of_other_settings_stay_and_are_not_used(vs_trl, tmp_path, capsys, monkeypatch):
    argv = ["--student", "tiny", "--pairings", "1", "--methods", "lopd", "--runs-dir", str(tmp_path)]
    _calls(vs_trl, argv)
    capsys.readouterr()
    # other settings run again, beside the first result, and say what differs; the first is still used after
    assert len(_calls(vs_trl, [*argv, "--max-new-tokens", "9"])[0]) == 1
    assert "ran with another child_argv" in capsys.readouterr().err
    assert len(list(tmp_path.glob("p0_lopd_ours_*.json"))) == 2 and _calls(vs_trl, argv)[0] == []
    # another CPU capability or model: run again
    monkeypatch.setattr(vs_trl, "cpu_capability", lambda: "OTHER")
    assert len(_calls(vs_trl, argv)[0]) == 1 and "cpu_capability" in capsys.readouterr().err
    monkeypatch.setattr(vs_trl, "cpu_model", lambda: "another CPU")
    assert len(_calls(vs_trl, argv)[0]) == 1 and "ran with another cpu)" in capsys.readouterr().err
    # an unreadable or foreign kept file
    (kept,) = [q for q in tmp_path.glob("p0_lopd_ours_*.json") if "another CPU" in q.read_text()]
    for text in ("{not json", "[1, 2]", json.dumps({"resume": None})):
        kept.write_text(text)
        assert len(_calls(vs_trl, argv)[0]) == 1


def test_the_student_weights_are_in_the_key(vs_trl, tmp_path, monkeypatch, capsys):
    student = tmp_path / "student"
    student.mkdir()
    (student / "model.safetensors").write_bytes(b"weights 1")
    monkeypatch.chdir(tmp_path)  # a relative --student, resolved once (the hash reads the folder the child loads)
    argv = ["--student", "student", "--pairings", "1", "--methods", "lopd", "--runs-dir", str(tmp_path / "runs")]
    assert vs_trl.parse_args(argv).student == str(student.resolve())
    _calls(vs_trl, argv)
    (student / "model.safetensors").write_bytes(b"weights 2")
    capsys.readouterr()
    assert len(_calls(vs_trl, argv)[0]) == 1 and "ran with another student_hash" in capsys.readouterr().err
    # weights rewritten while a child runs: its result is not kept
    with pytest.raises(SystemExit, match="student_hash changed while it ran"):
        _calls(vs_trl, [*argv, "--seed", "7"], during=lambda: (student / "model.safetensors").write_bytes(b"weights 3"))
    assert not list((tmp_path / "runs").glob("p0_lopd_ours_*.running.json"))
    assert len(list((tmp_path / "runs").glob("p0_lopd_ours_*.json"))) == 2


def test_a_stale_running_file_is_not_taken_for_a_result(vs_trl, tmp_path):
    argv = ["--student", "tiny", "--pairings", "1", "--methods", "lopd", "--runs-dir", str(tmp_path)]
    args = vs_trl.parse_args(argv)
    fields = vs_trl.resume_fields(vs_trl.child_argv(args, "ours", "lopd", 0, tmp_path / "x"),
                                  vs_trl.machine_fields(args.student))
    stale = vs_trl.kept_path(tmp_path, 0, "lopd", "ours", fields).with_suffix(".running.json")
    stale.write_text(json.dumps({"trajectories_per_s": 99.0, "peak_rss_mb": 1.0}))  # a cut child's leftover
    with pytest.raises(SystemExit, match="the ours lopd run of pairing 0 failed"):
        _calls(vs_trl, argv, silent=True)


def test_runs_dir_that_is_a_file_is_refused(vs_trl, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--runs-dir", str(tmp_path / "f")])
    assert "--runs-dir" in capsys.readouterr().err.strip().splitlines()[-1]


def test_code_hash_follows_the_benchmark_files(vs_trl, tmp_path):
    for name in vs_trl.BENCHMARK_FILES:
        (tmp_path / "benchmarks").mkdir(exist_ok=True)
        (tmp_path / "benchmarks" / name).write_text(name)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text("x = 1\n")
    before = vs_trl.code_hash(tmp_path)
    (tmp_path / "benchmarks" / "step_cost.py").write_text("changed")
    after = vs_trl.code_hash(tmp_path)
    (tmp_path / "src" / "m.py").write_text("x = 2\n")
    assert len({before, after, vs_trl.code_hash(tmp_path)}) == 3


@pytest.mark.skipif(HAS_TRL, reason="trl is installed here: the refusal is for environments without it")
def test_refuses_without_trl(vs_trl, tmp_path):
    with pytest.raises(SystemExit, match="make bench-peer"):
        vs_trl.main(["--quick", "--methods", "grpo", "--out", str(tmp_path / "x.json")])


@needs_trl
def test_quick_end_to_end_both_sides(vs_trl, tmp_path):
    out = tmp_path / "vs_trl.json"
    argv = ["--quick", "--tasks-per-step", "1", "--group", "2", "--out", str(out)]
    report = vs_trl.main([*argv, "--runs-dir", str(tmp_path / "runs")])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))
    for key in ("benchmark", "student", "task", "settings", "speedup_over_trl", "peak_rss_mb", "trajectories_per_s",
                "lopd_beside_trl_sdpo", "reward_curves", "runs", "resumed_runs", "versions", "hardware", "seed", "git_sha", "argv"):
        assert key in data, key
    for method in ("grpo", "sdpo"):
        assert data["speedup_over_trl"][method]["median"] > 0
        assert data["peak_rss_mb"][method]["ours"] > 0 and data["peak_rss_mb"][method]["trl"] > 0
        trl = data["settings"]["read_back"][method]["trl"]
        assert (trl["bf16"], trl["gradient_checkpointing"], trl["beta"]) == (False, False, 0.0)
        assert trl["dtype_read_back"] == "float32" and trl["has_reference_model"] is False
        assert trl["lora_read_back"]["r"] == 16 and trl["torch_threads"] == 1
        assert trl["generation_config"]["top_k"] == 20 and trl["generation_config"]["max_new_tokens"] == 8
        ours = data["settings"]["read_back"][method]["ours"]
        assert ours["lora_read_back"]["target_modules"] == trl["lora_read_back"]["target_modules"]
        assert len(data["reward_curves"][method]["trl"][0]["mean_reward_per_step"]) == 2
    assert trl["trainer"] == "SDPOTrainer" and data["versions"]["trl"] == vs_trl.TRL_VERSION
    assert data["lopd_beside_trl_sdpo"]["lopd_trajectories_per_s"] > 0
    assert data["settings"]["prompt_tokens_equal"] == 1.0
