"""Two-process FSDP run of every method on the tiny model (gloo, CPU), for tests/test_fsdp.py.

    python tests/scripts/fsdp_methods.py --out DIR [--runs lopd:lora,grpo:full,...] [--steps 2] [--single]

Lightning refuses FSDP on CPU (``The strategy `fsdp` requires a GPU accelerator``) and torch's FSDP, given
no ``device_id``, refuses a CPU-only machine (``FSDP needs a non-CPU accelerator device``); torch's FSDP
itself runs on CPU with gloo when it is given ``device_id=cpu``. :class:`CPUFSDPStrategy` is Lightning's
FSDPStrategy with only that changed (and, being a subclass, past Lightning's GPU check): every other step
(the wrapping of each decoder layer, ``use_orig_params``, the sharded optimiser state, the launcher) is
Lightning's. For tests only: ``lopd fit`` refuses FSDP without CUDA.

State (measured): SFT with a LoRA student trains 2 steps. Gathering the weights with ``summon_full_params``
after a step fails (``Cannot manually unshard parameters during forward/backward``): every method runs its
backward inside ``training_step``, i.e. inside the root FSDP module's forward (Lightning's forward
redirection), so FSDP's post-backward final callback is never queued and its state stays FORWARD_BACKWARD.
``FSDP_NO_GATHER=1`` saves each rank's shard instead. Not yet run: the other methods, the full-parameter
student, a comparison with one process.

Lightning's launcher re-runs this script for rank 1; the runs follow one another in the same two processes.
Each rank writes ``DIR/<method>_<student>_rank_<r>.pt``: per step the batch, the loss, the logged grad norm
and the trainable weights after the step, gathered whole (``summon_full_params``). With ``--single``
each run trains one step in one process on ``DIR/<method>_<student>_combined.pt`` (both ranks' first
batches), the reference.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lopd_lightning.modules.lopd_callbacks import MemoryRefresh
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.modules import LOPDModule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_methods import METHODS, build_module as ddp_module, task_for  # noqa: E402

STUDENTS = ("lora", "full")
MAX_NORM = 1e9  #: the clip is on (its norm is compared) but never scales: the gradients are compared raw


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy wrapping with ``device_id=cpu`` (what torch's FSDP needs on a CPU-only
    machine); a subclass, so Lightning's check that FSDP runs on a GPU accelerator does not apply."""

    def _setup_model(self, model):
        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(
                module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs)
            self.kwargs.pop("auto_wrap_policy", None)  # wrapped: Lightning's _setup_model keeps it as it is
        return super()._setup_model(model)


def build_module(method: str, student: str):
    """The DDP test's module (tests/scripts/ddp_methods.py), LoRA or full-parameter, with the clip on."""
    return ddp_module(method, grad_clip=MAX_NORM, **({"lora": None} if student == "full" else {}))


def full_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


class Capture(Callback):
    def __init__(self):
        self.steps: list[dict] = []

    def _gathered(self, trainer, pl_module) -> dict[str, torch.Tensor]:
        """The trainable weights, whole on every rank (gathered from the shards under FSDP: a collective)."""
        def read():
            return {full_name(n): p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad}
        if isinstance(trainer.model, FullyShardedDataParallel) and not os.environ.get("FSDP_NO_GATHER"):
            with FullyShardedDataParallel.summon_full_params(trainer.model, writeback=False):
                return read()
        return read()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append({"batch": batch})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[-1].update(
            loss=float(trainer.callback_metrics["train/loss"]),
            grad_norm=float(trainer.callback_metrics["train/grad_norm"]),
            params=self._gathered(trainer, pl_module),
        )


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
            combined = torch.load(args.out / f"{method}_{student}_combined.pt", weights_only=False)
            module.make_batch = lambda task, examples, combined=combined: combined
            trainer = L.Trainer(max_steps=1, devices=1, callbacks=[capture], **common)
            trainer.fit(module, dm)
            torch.save(capture.steps, args.out / f"{method}_{student}_single.pt")
            continue
        strategy = CPUFSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), process_group_backend="gloo")
        callbacks = [MemoryRefresh(every_n_steps=1), capture] if method == "lopd" else [capture]
        trainer = L.Trainer(max_steps=args.steps, devices=2, strategy=strategy, callbacks=callbacks, **common)
        trainer.fit(module, dm)
        torch.save(capture.steps, args.out / f"{method}_{student}_rank_{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
