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

import argparse
import copy
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy

from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.lm import base_model
from lopd_lightning.modules import LOPDModule
from lopd_lightning.modules.lopd_callbacks import MemoryRefresh
from lopd_lightning.sharding import plain

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_methods import METHODS, build_module as ddp_module, task_for  # noqa: E402

STUDENTS = ("lora", "full")
MAX_NORM = 1e9  #: the clip is on (its norm is compared) but never scales: the gradients are compared raw


def build_module(method: str, student: str):
    """The DDP test's module (tests/scripts/ddp_methods.py), LoRA or full-parameter, with the clip on. A full
    student's teacher copy (``base``/``ema`` modes) gets the same biased LM head as the student (the DDP
    module replaces the head after the copy was made; the EMA pairs the two by name)."""
    module = ddp_module(method, grad_clip=MAX_NORM, **({"lora": None} if student == "full" else {}))
    shadow = getattr(getattr(module, "teacher", None), "shadow", None)
    if shadow is not None:
        shadow.lm_head = copy.deepcopy(base_model(module.backbone).lm_head).requires_grad_(False)
    return module


def whole(tensors) -> list:
    """Each tensor whole on every rank (a DTensor's ``full_tensor``: a collective), detached, cloned."""
    return [None if t is None else plain(t.detach()).clone() for t in tensors]


class Capture(Callback):
    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append({"batch": batch})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps[-1]["student_grads"] = whole(p.grad for p in pl_module.student_parameters())
        if isinstance(pl_module, LOPDModule):
            self.steps[-1]["composer_grads"] = whole(p.grad for p in pl_module.composer.trainable_parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[-1].update(
            loss=float(trainer.callback_metrics["train/loss"]),
            grad_norm=float(trainer.callback_metrics["train/grad_norm"]),
            params=whole(pl_module.student_parameters()),
        )
        if isinstance(pl_module, LOPDModule):
            self.steps[-1].update(composer=whole(pl_module.composer.trainable_parameters()), beta=pl_module.beta)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", default=",".join(f"{m}:{s}" for m in METHODS for s in STUDENTS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--single", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for run in args.runs.split(","):
        method, student = run.split(":")
        module = build_module(method, student)
        capture = Capture()
        dm = OnPolicyDataModule(task_for(method), examples_per_step=2, val_limit=4, val_batch_size=4)
        common = dict(accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(args.out))
        if args.single:
            combined = list(torch.load(args.out / f"{method}_{student}_combined.pt", weights_only=False))
            module.make_batch = lambda task, examples, combined=combined: combined.pop(0)
            trainer = L.Trainer(max_steps=args.steps, devices=1, callbacks=[capture], **common)
            trainer.fit(module, dm)
            torch.save(capture.steps, args.out / f"{method}_{student}_single.pt")
            continue
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")
        callbacks = [MemoryRefresh(every_n_steps=1), capture] if method == "lopd" else [capture]
        trainer = L.Trainer(max_steps=args.steps, devices=2, strategy=strategy, callbacks=callbacks, **common)
        trainer.fit(module, dm)
        torch.save(capture.steps, args.out / f"{method}_{student}_rank_{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
