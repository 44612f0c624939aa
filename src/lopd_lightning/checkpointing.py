"""Activation checkpointing that recomputes each layer under the adapter state its forward ran with.

LOPD's one backward pass runs through passes made under different LoRA adapters on one backbone
(:func:`lopd_lightning.adapters.use_adapter`): the student's (adapter ``"student"``, or the base weights),
the composer's encoder (``"composer"``, only its LoRA trainable) and the teacher's (its mode's weights,
every backbone weight constant). Each context switches back on exit, before the backward. Activation
checkpointing recomputes a checkpointed segment in the backward; run under whatever is active then, the
recomputation would use the wrong adapter (a CheckpointError when the wrong adapter saves other tensors,
silently wrong gradients when it saves the same ones).

:func:`enable_activation_checkpointing` gives each decoder layer's ``torch.utils.checkpoint`` (non-reentrant)
its own ``context_fn``, :class:`ForwardStateRecompute`: at the forward it records the layer's state, every
peft LoRA layer's active adapter(s), disabled flag and scaling, every parameter's ``requires_grad`` flag
(it decides which tensors autograd saves) and every module's train flag, and restores it for the
recomputation only. torch's checkpoint restores the RNG (dropout masks), grad mode and autocast itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

__all__ = ["ForwardStateRecompute", "enable_activation_checkpointing"]


class _ForwardState:
    """What a module's forward depends on besides its inputs and weights, recorded for one checkpointed segment:
    per peft tuner layer its active adapter(s), disabled flag, scaling and merged adapters; per parameter its
    ``requires_grad`` flag (it decides what autograd records, hence which tensors a segment saves); per
    module its train flag (dropout, and whether a transformers layer checkpoints at all)."""

    __slots__ = ("flags", "training", "tuners")

    def __init__(self, scope: nn.Module) -> None:
        modules = list(scope.modules())
        self.tuners = [
            (m, _copied(m._active_adapter), m._disable_adapters, dict(getattr(m, "scaling", {})), tuple(m.merged_adapters))
            for m in modules if isinstance(m, BaseTunerLayer)
        ]
        self.flags = [(p, p.requires_grad) for p in scope.parameters()]
        self.training = [(m, m.training) for m in modules]

    def apply(self) -> None:
        for layer, active, disabled, scaling, merged in self.tuners:
            if tuple(layer.merged_adapters) != merged:
                raise RuntimeError(
                    f"adapters {list(merged)} -> {list(layer.merged_adapters)} were merged or unmerged between a "
                    "checkpointed forward and its backward: the recomputation would use other weights"
                )
            layer._active_adapter = _copied(active)
            layer._disable_adapters = disabled
            if scaling and layer.scaling != scaling:
                layer.scaling.update(scaling)
        for p, flag in self.flags:
            if p.requires_grad != flag:
                p.requires_grad_(flag)
        for m, flag in self.training:
            m.training = flag


def _copied(active: str | list[str]) -> str | list[str]:
    return active if isinstance(active, str) else list(active)


@contextmanager
def _recomputing_under(state: _ForwardState, scope: nn.Module) -> Iterator[None]:
    now = _ForwardState(scope)  # the state at backward time, put back after the recomputation
    try:
        state.apply()
        yield
    finally:
        now.apply()


class ForwardStateRecompute:
    """``context_fn`` of ``torch.utils.checkpoint.checkpoint`` (non-reentrant) for one checkpointed module.

    Called by ``checkpoint`` when the segment's forward starts, it records the module's
    :class:`_ForwardState` and returns ``(nullcontext(), recompute_context)``: the recomputation in the
    backward runs with that state (the adapter LOPD's context had selected, the flags it had set, the
    train flags), whatever is active at backward time, and the backward-time state is restored after it.
    torch's checkpoint itself restores the RNG (dropout masks, ``preserve_rng_state``), grad mode and
    autocast.

    Args:
        scope: the module the checkpoint recomputes (a decoder layer; or a whole decoder, for a model that
            checkpoints its layers from the decoder's forward): only its submodules and parameters are
            recorded, a few hundred attribute reads per decoder-layer call.
    """

    def __init__(self, scope: nn.Module) -> None:
        self.scope = scope

    def __call__(self) -> tuple[Any, Any]:
        return nullcontext(), _recomputing_under(_ForwardState(self.scope), self.scope)


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Turn on transformers' activation checkpointing (non-reentrant) with a :class:`ForwardStateRecompute`
    ``context_fn`` per checkpointed module, so that a backward after an adapter switch recomputes each
    segment under the adapter, flags and train mode its forward ran with.

    transformers checkpoints each decoder layer (``GradientCheckpointingLayer``, 5.x) by calling that
    layer's ``_gradient_checkpointing_func``, ``partial(torch.utils.checkpoint.checkpoint, **kwargs)`` with
    the ``gradient_checkpointing_kwargs`` (5.19) / ``activation_checkpointing_kwargs`` (5.24) given here.
    One shared ``context_fn`` in those kwargs could not tell which layer it recomputes (it would record the
    whole model at every layer call); so each layer gets its own partial with its own ``context_fn``.

    Args:
        model: a transformers ``PreTrainedModel`` (plain, before peft wraps it, or after: LoRA layers
            injected later are inside its layers and recorded at each forward).

    Returns:
        The number of modules whose checkpoint carries the context (0: the model checkpoints some other
        way, e.g. an old remote-code model; its recomputation would see the backward-time adapter).

    Raises:
        ValueError: the model does not support activation checkpointing (transformers' own check).
    """
    from torch.utils.checkpoint import checkpoint

    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24; the old name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(kwargs))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(kwargs))
    covered = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = partial(checkpoint, **kwargs, context_fn=ForwardStateRecompute(module))
            covered += 1
    return covered
