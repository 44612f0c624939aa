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
peft LoRA layer's active adapter(s), disabled flag, scaling and merged adapters, every parameter's
``requires_grad`` flag (it decides which tensors autograd saves) and every module's train flag, and restores it for each
recomputation only (a retained graph's second backward recomputes again). torch's checkpoint restores the
RNG (dropout masks), grad mode and autocast itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from copy import copy
from functools import partial
from typing import Any

import torch
from torch import nn

from lopd_lightning.adapters import tuner_layers, tuner_states

__all__ = ["ForwardStateRecompute", "enable_activation_checkpointing", "layers_checkpointed_in_eval", "recorded_forwards"]

#: bumped by torch's global module and parameter registration hooks (installed by the first
#: :class:`ForwardStateRecompute`): a peft adapter added, copied or injected registers modules and
#: parameters, so a :class:`_Layout` built at another value may miss some and is rebuilt. A removal
#: (peft's ``delete_adapter``) registers nothing: the layout keeps the removed modules, whose flags it then
#: records and sets to no effect, until the next registration.
_registrations = 0
_watching = False


def _registered(*_: Any) -> None:
    global _registrations
    _registrations += 1


def _watch_registrations() -> None:
    global _watching
    if not _watching:
        nn.modules.module.register_module_module_registration_hook(_registered)
        nn.modules.module.register_module_parameter_registration_hook(_registered)
        _watching = True


class _Layout:
    """A checkpointed module's peft tuner layers, parameters and modules, listed once per model layout."""

    __slots__ = ("modules", "params", "tuners", "version")

    def __init__(self, scope: nn.Module) -> None:
        self.version = _registrations
        self.modules = list(scope.modules())
        self.tuners = tuner_layers(scope)
        self.params = list(scope.parameters())


class _ForwardState:
    """What a module's forward depends on besides its inputs and weights, recorded for one checkpointed segment:
    per peft tuner layer its active adapter(s), disabled flag, scaling and merged adapters; per parameter its
    ``requires_grad`` flag (it decides what autograd records, hence which tensors a segment saves); per
    module its train flag (dropout, and whether a transformers layer checkpoints at all)."""

    __slots__ = ("flags", "layout", "training", "tuners")

    def __init__(self, layout: _Layout) -> None:
        self.layout = layout
        self.tuners = tuner_states(layout.tuners)
        self.flags = [p.requires_grad for p in layout.params]
        self.training = [m.training for m in layout.modules]

    def apply(self) -> None:
        for layer, (active, disabled, scaling, merged) in zip(self.layout.tuners, self.tuners, strict=True):
            if tuple(layer.merged_adapters) != merged:
                raise RuntimeError(
                    f"adapters {list(merged)} -> {list(layer.merged_adapters)} were merged or unmerged between a "
                    "checkpointed forward and its backward: the recomputation would use other weights"
                )
            if layer._active_adapter != active:
                layer._active_adapter = copy(active)  # a name, or a list the layer may change
            if layer._disable_adapters != disabled:
                layer._disable_adapters = disabled
            if scaling and layer.scaling != scaling:
                layer.scaling.update(scaling)
        for p, flag in zip(self.layout.params, self.flags, strict=True):  # set only what differs: a
            if p.requires_grad != flag:  # module's __setattr__ costs more than the comparison
                p.requires_grad_(flag)
        for m, flag in zip(self.layout.modules, self.training, strict=True):
            if m.training != flag:
                m.training = flag


class _Recompute:
    """The recompute context of one checkpointed forward. torch enters it once per recomputation: once per
    backward through the segment (``retain_graph=True`` and a second backward, or ``autograd.grad`` then
    ``backward``, recompute it again). Each entry records the state of that moment, applies the forward's,
    and its exit puts the recorded one back, also when the recomputation raises."""

    __slots__ = ("owner", "saved", "state")

    def __init__(self, owner: ForwardStateRecompute, state: _ForwardState) -> None:
        self.owner, self.state, self.saved = owner, state, []

    def __enter__(self) -> None:
        now = _ForwardState(self.owner.layout())
        try:
            self.state.apply()
        except BaseException:
            now.apply()
            raise
        self.saved.append(now)

    def __exit__(self, *exc: object) -> bool:
        self.saved.pop().apply()
        return False


class ForwardStateRecompute:
    """``context_fn`` of ``torch.utils.checkpoint.checkpoint`` (non-reentrant) for one checkpointed module.

    Called by ``checkpoint`` when the segment's forward starts, it records the module's
    :class:`_ForwardState` and returns ``(nullcontext(), recompute_context)``: each recomputation in the
    backward runs with that state (the adapter LOPD's context had selected, the flags it had set, the
    train flags), whatever is active at backward time, and the backward-time state is restored after it.
    torch's checkpoint itself restores the RNG (dropout masks, ``preserve_rng_state``), grad mode and
    autocast. Without grad mode it records nothing: ``checkpoint`` then saves nothing and never recomputes
    (transformers 5.19 checkpoints a layer in train mode under ``no_grad`` too).

    The module's tuner layers, parameters and modules are listed once and listed again only after a module
    or parameter was registered anywhere (an adapter added, copied or injected); a recording then reads
    their flags: on the tiny model's decoder layer with two LoRA adapters on all seven projections (104
    modules, 37 parameters, CPU) about 10 µs per forward, and 30-60 µs per recomputation (it records the
    backward-time state, applies the forward's, restores; setting only the flags that differ).

    Args:
        scope: the module the checkpoint recomputes (a decoder layer): only its submodules and parameters
            are recorded.

    Attributes:
        forwards: the checkpointed forwards (with grad mode) that recorded a state.
    """

    def __init__(self, scope: nn.Module) -> None:
        _watch_registrations()
        self.scope = scope
        self.forwards = 0
        self._layout: _Layout | None = None

    def layout(self) -> _Layout:
        """The scope's tuner layers, parameters and modules, listed again after a registration."""
        if self._layout is None or self._layout.version != _registrations:
            self._layout = _Layout(self.scope)
        return self._layout

    def __call__(self) -> tuple[Any, Any]:
        if not torch.is_grad_enabled():  # checkpoint saves nothing, so nothing is recomputed
            return nullcontext(), nullcontext()
        self.forwards += 1
        return nullcontext(), _Recompute(self, _ForwardState(self.layout()))


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
        The number of ``GradientCheckpointingLayer`` modules whose checkpoint carries the context (0: the
        model checkpoints some other way, e.g. an old remote-code model checkpointing its layers from the
        decoder's forward; its recomputation would see the backward-time adapter).

    Raises:
        ValueError: the model does not support activation checkpointing (transformers' own check).
    """
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24; the old name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(kwargs))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(kwargs))
    covered = 0
    for module in model.modules():
        if (isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing is True
                and hasattr(module, "_gradient_checkpointing_func")):
            module._gradient_checkpointing_func = partial(checkpoint, **kwargs, context_fn=ForwardStateRecompute(module))
            covered += 1
    return covered


@contextmanager
def layers_checkpointed_in_eval(model: nn.Module) -> Iterator[int]:
    """Checkpoint the decoder layers of an eval-mode pass with gradients (LOPD's teacher: constant weights,
    no dropout, a graph kept only for the latents' gradient).

    transformers checkpoints a ``GradientCheckpointingLayer`` only when that layer's own train flag is set.
    Inside, each such layer of ``model`` whose checkpointing is on (:func:`enable_activation_checkpointing`)
    and whose flag is off gets it set, and only it: its submodules (dropout, attention) keep their eval
    flags, so the pass computes what it computes in eval mode, while each layer keeps only its input for
    the backward and is recomputed there (under the state :class:`ForwardStateRecompute` recorded, these
    flags included). This assumes a decoder layer reads its own train flag only for that decision, as
    transformers' layers do (their dropouts are submodules or read their attention module's flag). A
    checkpointed layer drops a key/value cache it is given, so use it for passes without one. Each flag is
    restored on exit.

    Yields:
        The number of layers whose flag was set (0: the model has no checkpointed layer in eval mode).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules()
              if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing is True and not m.training]
    for layer in layers:
        layer.training = True
    try:
        yield len(layers)
    finally:
        for layer in layers:
            layer.training = False


def recorded_forwards(model: nn.Module) -> int:
    """How many checkpointed forwards of ``model``'s layers recorded their state so far (0 after a training
    pass: no layer went through the checkpoint that carries the context)."""
    total = 0
    for module in model.modules():
        fn = getattr(module, "_gradient_checkpointing_func", None)
        context = fn.keywords.get("context_fn") if isinstance(fn, partial) else None
        if isinstance(context, ForwardStateRecompute):
            total += context.forwards
    return total
