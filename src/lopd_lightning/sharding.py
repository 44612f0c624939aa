"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under Lightning's ``ModelParallelStrategy``.

Lightning's ``FSDPStrategy`` (FSDP1) wraps the whole LightningModule and runs ``training_step`` inside the
root wrapper's forward; every method here calls backward inside ``training_step``, so FSDP1's post-backward
callback never runs (Lightning issues #19626, #19685; docs/scaling.md). FSDP2 has no wrapper forward: each
sharded module's parameters are DTensors, all-gathered by hooks around that module's own forward and
reduce-scattered by hooks in its backward. ``ModelParallelStrategy`` leaves the sharding to the module's
``configure_model``, which calls :func:`shard_model` on every causal LM the module holds:

- each decoder layer is one unit (its LoRA weights, frozen and trainable, go with it);
- the token embeddings and the LM head are one unit when they share the tied word embedding (FSDP2 needs tied
  parameters in one group), two otherwise, each gathered when it runs: the passes call the decoder and the LM
  head apart (:mod:`lopd_lightning.lm`), never the model's own forward, and LOPD's composer calls the
  embeddings alone; the decoder (its final norm) is one more unit;
- the model itself is the root, initialised at once (FSDP2 otherwise makes the first module to run forward
  the root, and a call to the decoder alone would then be refused).

Generation (HF ``generate``) runs a number of forwards that differs between ranks (each rank's batch stops at
its own EOS, and a rank's episodes may take more turns), while every forward of a sharded layer is a
collective: :func:`gathered` all-gathers the whole model once before an episode loop and keeps it whole until
the loop ends, so generation makes no collective (:func:`generate_options` tells ``generate`` so).

:func:`plain` turns a DTensor result (the grad norm ``clip_grad_norm_`` returns from DTensor gradients: the
norm of the whole gradient, all shards) into an ordinary tensor. Every other strategy never reaches this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["gathered", "generate_options", "is_fsdp2", "is_sharded_model", "local", "plain", "shard_model"]


def is_fsdp2(strategy: Any) -> bool:
    """True for Lightning's ``ModelParallelStrategy`` (or a subclass): the module shards itself with FSDP2."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy)


def _fsdp_module_class() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def is_sharded_model(model: nn.Module) -> bool:
    """True when ``model`` (or a submodule) was sharded with ``fully_shard``."""
    cls = _fsdp_module_class()
    return any(isinstance(m, cls) for m in model.modules())


def _inner(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def shard_model(model: nn.Module, mesh: Any) -> nn.Module:
    """Shard a Hugging Face causal LM (or a peft ``PeftModel`` around one) in place over ``mesh`` (1-D, the
    data-parallel mesh): each decoder layer, the embeddings with the LM head (one unit when tied), the decoder,
    then the root.
    Any other module (one without ``get_decoder``) is one unit, gathered in its ``forward`` and in each method
    its class names in ``fsdp_forward_methods``. A model already sharded is left as it is.

    Raises:
        ValueError: the model has no ``model.layers`` list of decoder layers (not a decoder-only LM).
    """
    from torch.distributed.fsdp import fully_shard

    if is_sharded_model(model):
        return model
    inner = _inner(model)
    if not hasattr(inner, "get_decoder"):  # not a causal LM (LOPD's compressor): one unit
        from torch.distributed.fsdp import register_fsdp_forward_method

        fully_shard(model, mesh=mesh)
        for name in getattr(model, "fsdp_forward_methods", ()):  # other methods that read its weights
            register_fsdp_forward_method(model, name)
        model._get_fsdp_state()._lazy_init()  # type: ignore[operator]
        return model
    decoder = inner.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"trainer.strategy ModelParallelStrategy (FSDP2): {type(inner).__name__} has no decoder "
                         "layer list (model.layers) to shard; use trainer.strategy=ddp")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    head = inner.get_output_embeddings()
    embed = decoder.get_input_embeddings()
    tied = head is not None and head.weight is embed.weight
    if tied:
        fully_shard([embed, head], mesh=mesh)
    else:
        fully_shard(embed, mesh=mesh)
        if head is not None and any(True for _ in head.parameters()):
            fully_shard(head, mesh=mesh)
    fully_shard(decoder, mesh=mesh)  # what is left of it: the final norm
    fully_shard(model, mesh=mesh)
    _keep_output_capture(model)
    # FSDP2 makes the first module to run forward the root; the passes call the decoder and the head apart
    # (and generate calls the transformers model under a PeftModel), so the root is fixed here
    model._get_fsdp_state()._lazy_init()  # type: ignore[operator]
    return model


def _keep_output_capture(model: nn.Module) -> None:
    """transformers (5.x) records ``output_hidden_states`` through hooks it finds by the model class's name;
    ``fully_shard`` gives each sharded module a new class (``FSDPLlamaModel``), so the new class gets the
    original's entry (else ``hidden_states`` come back None). Nothing to do for a transformers without it."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        return
    fsdp = _fsdp_module_class()
    for module in model.modules():
        cls = type(module)
        if not isinstance(module, fsdp) or str(cls) in _CAN_RECORD_REGISTRY:
            continue
        original = next((b for b in cls.__mro__[1:] if not issubclass(b, fsdp)), None)
        entry = dict.get(_CAN_RECORD_REGISTRY, str(original))
        if entry is not None:
            dict.__setitem__(_CAN_RECORD_REGISTRY, str(cls), entry)


@contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Inside, every sharded unit of ``model`` holds its whole parameters (one all-gather each on entry) and
    forwards make no collective: ranks may run different numbers of forwards (generation). Resharded on exit.
    Nothing happens for a model that is not sharded. For passes without gradients (rollouts, evaluation)."""
    cls = _fsdp_module_class()
    units = [m for m in model.modules() if isinstance(m, cls)]
    if not units:
        yield
        return
    root = units[0]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(unit is not root, recurse=False)  # FSDP2's defaults
            unit.reshard()


def generate_options(model: nn.Module) -> dict[str, Any]:
    """Extra keyword options of HF ``generate`` on ``model``: ``synced_gpus=False`` for an FSDP2-sharded model
    (run under :func:`gathered`: no forward makes a collective), which transformers would otherwise set to keep
    every rank's forwards in step, an all-reduce per token; ranks also make different numbers of ``generate``
    calls (turns, retries), which those all-reduces would mismatch. Empty for any other model."""
    return {"synced_gpus": False} if is_sharded_model(model) else {}


def local(value: Tensor) -> Tensor:
    """A DTensor's shard on this rank (``to_local``, differentiable), anything else unchanged."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def plain(value: Tensor) -> Tensor:
    """``value`` as an ordinary tensor: a DTensor's whole value (``full_tensor``), anything else unchanged."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value
