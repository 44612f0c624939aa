"""Two-process FSDP2 run of the methods on the tiny model (gloo, CPU), for tests/test_fsdp2.py.

    python tests/scripts/fsdp2_methods.py --out DIR [--runs sft:lora,grpo:full,...] [--steps 2] [--single]

Lightning's ``ModelParallelStrategy`` (``data_parallel_size=2``, ``tensor_parallel_size=1``, gloo) with the
module's own ``configure_model`` (FSDP2's ``fully_shard`` of each decoder layer, the decoder with its LM head,
the root: :mod:`lopd_lightning.sharding`). It runs on CPU as it is: no subclass, no device override.

Lightning's launcher re-runs this script for rank 1; the runs follow one another in the same two processes.
Each rank writes ``DIR/<method>_<student>_rank_<r>.pt``: per step the batch, the loss, the logged grad norm,
the gradients the optimisers saw and the trainable weights after the step, each gathered whole
(``full_tensor``). With ``--single`` each run trains as many steps in one process, step k on
``DIR/<method>_<student>_combined.pt``'s k-th batch (both ranks' k-th batches together), the reference.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

from lightning.pytorch.strategies import ModelParallelStrategy

from lopd_lightning.lm import base_model
from lopd_lightning.modules import LOPDModule
from lopd_lightning.sharding import plain

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_methods import StepCapture, build_student_module, main_runs, replay_each  # noqa: E402


def build_module(method: str, student: str):
    """The DDP test's module (tests/scripts/ddp_methods.py), LoRA or full-parameter, with the clip on. A full
    student's teacher copy (``base``/``ema`` modes) gets the same biased LM head as the student (the DDP
    module replaces the head after the copy was made; the EMA pairs the two by name)."""
    module = build_student_module(method, student)
    shadow = getattr(getattr(module, "teacher", None), "shadow", None)
    if shadow is not None:
        shadow.lm_head = copy.deepcopy(base_model(module.backbone).lm_head).requires_grad_(False)
    return module


def whole(tensors) -> list:
    """Each tensor whole on every rank (a DTensor's ``full_tensor``: a collective), detached, cloned."""
    return [None if t is None else plain(t.detach()).clone() for t in tensors]


class Capture(StepCapture):
    def params(self, trainer, pl_module) -> list:
        return whole(pl_module.student_parameters())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps[-1]["student_grads"] = whole(p.grad for p in pl_module.student_parameters())
        if isinstance(pl_module, LOPDModule):
            self.steps[-1]["composer_grads"] = whole(p.grad for p in pl_module.composer.trainable_parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if isinstance(pl_module, LOPDModule):
            self.steps[-1].update(composer=whole(pl_module.composer.trainable_parameters()), beta=pl_module.beta)


def main() -> None:
    main_runs(build_module, Capture, replay=replay_each, strategy=lambda: ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"))


if __name__ == "__main__":
    main()
