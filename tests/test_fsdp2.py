"""FSDP2 (``fully_shard`` under Lightning's ModelParallelStrategy) on 2 CPU processes over gloo, every method.

tests/scripts/fsdp2_methods.py trains 2 steps of each method (SFT, GRPO, SDPO, OPSD, Skill-SD, LOPD with its two
optimisers), with a LoRA and with a full-parameter student, under ``ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=1, process_group_backend="gloo")`` and the module's own ``configure_model``
(:mod:`lopd_lightning.sharding`); then one process trains the same number of steps on both ranks' batches of
each step together (the reference, as in tests/test_ddp.py). Checked, per method and student:

- the whole weights after each step (DTensors gathered with ``full_tensor``) are bitwise equal on both ranks;
- the gradients the optimisers saw equal the one-process gradients with tests/test_ddp.py's tolerance (rtol 2e-4,
  atol 1e-7: float sums in another order), at both steps; LOPD's composer gradients and beta too;
- the weights after each step equal the one-process weights within atol 2e-5: 2% of one AdamW step (lr 1e-3).
  Adam moves every coordinate with a gradient by about lr in its first steps whatever the gradient's size, so
  a rounding-level gradient difference on a coordinate whose gradient is near Adam's eps (1e-8) moves it by a
  fraction of lr; measured at most 7.5e-6 (LOPD, full student);
- the logged grad norm (``clip_grad_norm_`` on DTensor gradients) is the whole gradient's: equal on both ranks
  and to the one-process norm (rel 1e-5).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_ddp import collate_batches

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_methods.py"
METHODS = ["sft", "grpo", "sdpo", "opsd", "skill_sd", "lopd"]
RUNS = [f"{m}:{s}" for m in METHODS for s in ("lora", "full")]
WEIGHT_ATOL = 2e-5


def _run(args: list[str], out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--runs", ",".join(RUNS), *args],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory) -> dict[str, tuple[list, list]]:
    """{"method:student": (per-rank captures of the 2-step FSDP2 run, the one-process captures)}."""
    out = tmp_path_factory.mktemp("fsdp2")
    _run(["--steps", "2"], out)
    runs = {}
    for run in RUNS:
        name = run.replace(":", "_")
        ranks = [torch.load(out / f"{name}_rank_{r}.pt", weights_only=False) for r in (0, 1)]
        combined = [collate_batches([ranks[0][k]["batch"], ranks[1][k]["batch"]]) for k in range(2)]
        torch.save(combined, out / f"{name}_combined.pt")
        runs[run] = ranks
    _run(["--single", "--steps", "2"], out)
    return {run: (ranks, torch.load(out / f"{run.replace(':', '_')}_single.pt", weights_only=False))
            for run, ranks in runs.items()}


def _close(a: list, b: list, **tol) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, **tol)


@pytest.mark.parametrize("run", RUNS)
def test_fsdp2_weights_are_equal_on_every_rank(run, fsdp2_runs):
    ranks, _ = fsdp2_runs[run]
    for step in range(2):
        _close(ranks[0][step]["params"], ranks[1][step]["params"], rtol=0, atol=0)
        _close(ranks[0][step]["student_grads"], ranks[1][step]["student_grads"], rtol=0, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(ranks[0][0]["params"], ranks[0][1]["params"], strict=True))


@pytest.mark.parametrize("run", RUNS)
def test_fsdp2_equals_one_process_on_both_ranks_batches(run, fsdp2_runs):
    ranks, single = fsdp2_runs[run]
    assert sum(float(g.abs().sum()) for g in single[0]["student_grads"] if g is not None) > 0
    for step in range(2):
        names = ("student_grads", "composer_grads") if run.startswith("lopd") else ("student_grads",)
        for name in names:
            _close(ranks[0][step][name], single[step][name], rtol=2e-4, atol=1e-7)
        _close(ranks[0][step]["params"], single[step]["params"], rtol=0, atol=WEIGHT_ATOL)
        if run.startswith("lopd"):
            _close(ranks[0][step]["composer"], single[step]["composer"], rtol=0, atol=WEIGHT_ATOL)
            assert ranks[0][step]["beta"] == ranks[1][step]["beta"] == pytest.approx(single[step]["beta"], rel=1e-4)


@pytest.mark.parametrize("run", RUNS)
def test_fsdp2_grad_norm_is_the_whole_gradients(run, fsdp2_runs):
    ranks, single = fsdp2_runs[run]
    for step in range(2):
        assert ranks[0][step]["grad_norm"] == ranks[1][step]["grad_norm"]
        # the gradients' own tolerance (rtol 2e-4): float32 reductions in another order differ by about 1e-5 on some
        # CPUs (1.4e-5 seen on an AVX-512 Xeon); a norm over one rank's shard only would be off by tens of percent
        assert ranks[0][step]["grad_norm"] == pytest.approx(single[step]["grad_norm"], rel=2e-4)
        assert ranks[0][step]["grad_norm"] > 0


def test_fsdp2_trainer_config_builds_its_strategy_and_passes_the_checks():
    """configs/trainer/fsdp2.yaml names ModelParallelStrategy with one data-parallel dimension; lopd fit's
    strategy check lets it through (it is not FSDP1 or DeepSpeed: it runs on CPU and with LOPD)."""
    import yaml
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lopd_lightning.cli.checks import check_strategy
    from lopd_lightning.cli.errors import import_class
    from lopd_lightning.modules import LOPDModule, SFTModule

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "trainer" / "fsdp2.yaml").read_text())
    node = config["trainer"]["strategy"]
    strategy = import_class(node["class_path"])(**node["init_args"])
    assert isinstance(strategy, ModelParallelStrategy)
    assert node["init_args"] == {"data_parallel_size": 2, "tensor_parallel_size": 1}
    for method in (LOPDModule, SFTModule):
        check_strategy(method, node, cuda=False)
