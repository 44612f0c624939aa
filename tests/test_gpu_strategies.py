"""Sharded strategies on GPUs: FSDP (every method) and DeepSpeed ZeRO-2 (single-optimiser methods).

These need CUDA devices and run only where they exist (CI here has none: they are reported as skipped,
with the reason). DDP itself is tested on CPU in tests/test_ddp.py. Each test trains 2 steps of a tiny
model through the shipped trainer config, in a subprocess (Lightning launches one process per GPU).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
pytestmark = pytest.mark.gpu


def _fit(tmp_path: Path, method_args: list[str], trainer_config: str) -> None:
    args = [
        sys.executable, "-m", "lopd_lightning.cli", "fit", "-c", str(ROOT / "configs" / "tiny.yaml"),
        "-c", str(ROOT / "configs" / "trainer" / trainer_config), "--trainer.devices=2", "--trainer.max_steps=2",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false", "--trainer.precision=32",
        *method_args,
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]


@TWO_GPUS
def test_fsdp_lopd_two_gpus(tmp_path):
    _fit(tmp_path, [], "fsdp.yaml")


@TWO_GPUS
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_grpo_two_gpus(tmp_path):
    _fit(tmp_path, ["--model=lopd_lightning.modules.GRPOModule", "--model.init_args.model=tiny",
                    "--model.init_args.group_size=2", "--trainer.callbacks=[]"], "deepspeed.yaml")
