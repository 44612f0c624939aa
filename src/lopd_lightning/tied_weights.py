"""LoRA layers on tied weights: found, refused when they cannot be kept apart, untied before a merge.

A model with tied word embeddings (``tie_word_embeddings: true``, SmolLM2 and the tiny test model) holds one
matrix W as both its token embeddings and its output head. A LoRA on ``embed_tokens`` or ``lm_head`` trains
an update of one of the two uses of W: unmerged, the embeddings read ``W + dE`` and the head ``W + dH`` (or
W). Merged into W, every update lands in both uses, under a config that still says tied: another model.

So before a merge the LoRA-wrapped layers whose base weight is tied get their own copy of it
(:func:`untie_lora_weights`) and the config says ``tie_word_embeddings: false``; the merged model then has
separate embeddings and head, each with its own update, and is saved and loaded as such. Only the word
embeddings' tie is declared by the config; a LoRA on a weight tied in any other way (shared by two layers of
the architecture) could not be saved apart, and :func:`check_tied_lora` refuses it before training.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

__all__ = ["check_tied_lora", "tied_lora_weights", "untie_lora_weights"]


def _inner(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (or ``model`` itself)."""
    return model.base_model.model if hasattr(model, "peft_config") else model


def _weight(module: nn.Module | None) -> Any:
    """The weight a (possibly LoRA-wrapped) layer computes with, or None."""
    if module is None:
        return None
    if isinstance(module, BaseTunerLayer):
        module = module.get_base_layer()
    return getattr(module, "weight", None)


def tied_lora_weights(model: nn.Module, adapter: str) -> dict[str, list[str]]:
    """The layers of LoRA ``adapter`` whose base weight is also held elsewhere in the model.

    Args:
        model: a ``PeftModel`` (or a transformers model with LoRA layers injected).
        adapter: the LoRA adapter (the student's, ``"student"``).

    Returns:
        ``{layer name: [the other parameter names holding its weight]}`` (names as in the transformers model,
        e.g. ``{"lm_head": ["model.embed_tokens.base_layer.weight"]}``); empty when no such layer.
    """
    inner = _inner(model)
    holders: dict[int, list[str]] = defaultdict(list)
    for name, module in inner.named_modules(remove_duplicate=False):
        for leaf, param in module.named_parameters(recurse=False):
            holders[id(param)].append(f"{name}.{leaf}" if name else leaf)
    out: dict[str, list[str]] = {}
    for name, module in inner.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if adapter not in getattr(module, "lora_A", {}) and adapter not in getattr(module, "lora_embedding_A", {}):
            continue
        weight = _weight(module)
        own = f"{name}.base_layer.weight"
        others = sorted({h for h in holders.get(id(weight), []) if h != own})
        if others:
            out[name] = others
    return out


def _word_embeddings_tie(inner: nn.Module, weight: Any) -> bool:
    """Whether ``weight`` is tied only as the word embeddings and the output head, by ``tie_word_embeddings``."""
    configs = [inner.config]
    if hasattr(inner.config, "get_text_config"):
        configs.append(inner.config.get_text_config())
    declared = any(getattr(c, "tie_word_embeddings", False) for c in configs)
    embeddings = _weight(inner.get_input_embeddings())
    head = _weight(inner.get_output_embeddings())
    return declared and weight is embeddings and weight is head


def check_tied_lora(model: nn.Module, adapter: str, key: str = "lora") -> None:
    """Refuse a LoRA on a weight that is tied other than as the word embeddings (which a merge unties).

    Args:
        model: the backbone with LoRA ``adapter`` (a ``PeftModel``).
        key: the LoRA config's name under ``model.init_args``, for the message.

    Raises:
        ValueError: a layer of ``adapter`` computes with a weight that another layer also holds, and the
            config's ``tie_word_embeddings`` does not declare that tie (the merged student could not be saved
            with the two apart); one line naming ``model.init_args.<key>.target_modules`` and the fix.
    """
    inner = _inner(model)
    for name, others in tied_lora_weights(model, adapter).items():
        if not _word_embeddings_tie(inner, _weight(inner.get_submodule(name))):
            raise ValueError(
                f"model.init_args.{key}.target_modules: {name!r} shares its weight with {others} (tied weights other "
                f"than the word embeddings), which a merged student cannot keep apart; remove it from target_modules"
            )


def untie_lora_weights(model: nn.Module, adapter: str) -> list[str]:
    """Give every layer of LoRA ``adapter`` whose base weight is tied a copy of its own, before a merge.

    In place, on a model about to be merged (a copy: :func:`lopd_lightning.adapters.merged_student`, or a
    freshly loaded adapter: :func:`lopd_lightning.models.load_student`). The copies keep the weight's values,
    dtype, device and ``requires_grad``; the config (and its text config) then says
    ``tie_word_embeddings: false``, so the merged model is saved with its own ``lm_head.weight`` and loads
    untied. Costs one (V, d) matrix per untied layer.

    Returns:
        The untied layers' names (empty: nothing tied, nothing changed).

    Raises:
        ValueError: a tie other than the word embeddings' (:func:`check_tied_lora`).
    """
    check_tied_lora(model, adapter)
    inner = _inner(model)
    names = sorted(tied_lora_weights(model, adapter))
    for name in names:
        base = inner.get_submodule(name).get_base_layer()
        base.weight = nn.Parameter(base.weight.detach().clone(), requires_grad=base.weight.requires_grad)
    if names:
        for config in {id(c): c for c in (inner.config, getattr(inner.config, "get_text_config", lambda: None)())
                       if c is not None}.values():
            config.tie_word_embeddings = False
    return names
