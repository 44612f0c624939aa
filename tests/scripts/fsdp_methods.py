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

import os
import sys
from pathlib import Path

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_methods import StepCapture, build_student_module, main_runs, replay_first  # noqa: E402


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


build_module = build_student_module  #: the DDP test's module, LoRA or full-parameter, with the clip on


def full_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


class Capture(StepCapture):
    def params(self, trainer, pl_module) -> dict[str, torch.Tensor]:
        """The trainable weights, whole on every rank (gathered from the shards under FSDP: a collective)."""
        def read():
            return {full_name(n): p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad}
        if isinstance(trainer.model, FullyShardedDataParallel) and not os.environ.get("FSDP_NO_GATHER"):
            with FullyShardedDataParallel.summon_full_params(trainer.model, writeback=False):
                return read()
        return read()


def main() -> None:
    main_runs(build_module, Capture, replay=replay_first, strategy=lambda: CPUFSDPStrategy(
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), process_group_backend="gloo"))


if __name__ == "__main__":
    main()
