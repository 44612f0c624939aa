"""One CUDA device: every method trains on the GPU, and the losses agree with the CPU's.

Marked ``gpu`` and skipped without CUDA (CI here has none; ``benchmarks/gpu_readiness.py run`` runs them on a
borrowed GPU machine with ``pytest -m gpu``). The tiny model trains in float32 so the GPU's numbers can be
compared with the CPU's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ddp_methods  # noqa: E402
from helpers import quiet_trainer  # noqa: E402

from lopd_lightning.data import OnPolicyDataModule  # noqa: E402
from lopd_lightning.losses import topk_tail_reverse_kl  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("method", ddp_methods.METHODS)
def test_every_method_trains_two_steps_on_one_gpu(tmp_path, method):
    module = ddp_methods.build_module(method)
    data = OnPolicyDataModule(ddp_methods.task_for(method), examples_per_step=2, val_limit=4, val_batch_size=4)
    trainer = quiet_trainer(tmp_path, max_steps=2, accelerator="gpu")
    trainer.fit(module, data)
    assert module.global_step == 2 and module.device.type == "cuda"
    assert torch.isfinite(torch.as_tensor(float(trainer.callback_metrics["train/loss"])))
    assert all(p.device.type == "cuda" for p in module.student_parameters())


def test_topk_tail_reverse_kl_on_the_gpu_equals_the_cpu():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 7, 300, generator=g), torch.randn(2, 7, 300, generator=g)
    cpu = topk_tail_reverse_kl(student, teacher, top_k=20)
    gpu = topk_tail_reverse_kl(student.cuda(), teacher.cuda(), top_k=20).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-6)
