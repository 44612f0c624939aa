"""Causal-LM forward passes that compute the LM head only where a loss needs it.

A training sequence of T tokens usually has far fewer assistant tokens than T (BFCL live_simple with
SmolLM2: ~44 of ~450), while the LM head (d x V, V = 49,152) and the (B, T, V) logits dominate the
memory of a step. :func:`selected_logits` runs the decoder on the whole sequence and the head only on
the selected positions, returning packed (N, V) logits in the selected positions' row-major order;
:func:`selected_hidden_states` returns the final hidden states there instead (the head then runs chunk by
chunk: :mod:`lopd_lightning.losses.lm_head`). Also the model-input helpers every pass shares:
:func:`position_ids_from_mask`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "base_model",
    "decoder_hidden_states",
    "lm_head_logits",
    "position_ids_from_mask",
    "selected_hidden_states",
    "selected_logits",
    "unpack",
]

def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids that ignore padding: ``cumsum(mask) - 1``, 0 on leading pads.

    Used for every pass over a padded batch (the student's, the teacher's with its inserted context), so
    that left or right padding and inserted tokens never shift a token's position.

    Args:
        attention_mask: (B, T) {0, 1} or bool.

    Returns:
        (B, T) long: 0, 1, 2, ... over the real tokens of each row, whatever the padding side or holes.
    """
    mask = attention_mask.long()
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft ``PeftModel`` (its LoRA layers live there), or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_hidden_states(model: nn.Module, *, return_cache: bool = False, cache: Any = None, **model_kwargs: Any) -> Any:
    """(B, T, d) last hidden states (after the final norm) of a Hugging Face causal LM.

    Works on a peft ``PeftModel`` too: its LoRA layers live inside the base model, so the active adapter
    applies. ``model_kwargs`` are the usual ``input_ids`` / ``inputs_embeds``, ``attention_mask``,
    ``position_ids``.

    Args:
        return_cache: also return the decoder's key/value cache (a transformers ``Cache``; its tensors are
            part of the autograd graph): ``(hidden, cache)``.
        cache: a key/value cache of the tokens before these (``attention_mask`` then covers them too);
            the forward appends to it. Passed as ``cache`` or ``past_key_values``, whichever the installed
            transformers names it.
    """
    decoder = base_model(model).get_decoder()
    if return_cache or cache is not None:
        model_kwargs["use_cache"] = True
    else:
        model_kwargs.setdefault("use_cache", False)
    if cache is not None:
        model_kwargs[_cache_argument(decoder)] = cache
    out = decoder(**model_kwargs)
    if not return_cache:
        return out.last_hidden_state
    return out.last_hidden_state, (out["cache"] if "cache" in out else out["past_key_values"])


def _cache_argument(decoder: nn.Module) -> str:
    """The decoder's keyword for a key/value cache: ``cache`` (newer transformers 5.x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def lm_head_logits(model: nn.Module, hidden: Tensor) -> Tensor:
    """The model's output head on ``hidden`` (..., d) -> (..., V), with final logit soft-capping if any."""
    base = base_model(model)
    logits = base.get_output_embeddings()(hidden)
    cap = getattr(base.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def selected_logits(
    model: nn.Module, positions: Tensor | None = None, *, return_cache: bool = False, **model_kwargs: Any
) -> Any:
    """Logits of a causal LM, at all positions or only at ``positions``.

    Args:
        model: a Hugging Face causal LM (or a PeftModel around one).
        positions: (B, T) bool, the positions whose logits are wanted, or None for all.
        **model_kwargs: ``input_ids`` or ``inputs_embeds`` (B, T[, d]), ``attention_mask``, ``position_ids``.

    Returns:
        (B, T, V) when ``positions`` is None, else packed (N, V) with N = positions.sum(), in row-major
        order of ``positions`` (the order of ``tensor[positions]``). Same values as
        ``model(**model_kwargs).logits`` at those positions (with a ``cache``: as the whole sequence's
        at them). With ``return_cache``: ``(logits, cache)``, the cache as in :func:`decoder_hidden_states`.

    Raises:
        ValueError: ``positions`` is not (B, T) like the inputs.
    """
    hidden, cache = _hidden_and_cache(model, return_cache, model_kwargs)
    if positions is None:
        logits = lm_head_logits(model, hidden)
    else:
        if tuple(positions.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"positions has shape {tuple(positions.shape)}, the inputs {tuple(hidden.shape[:2])}")
        logits = lm_head_logits(model, hidden[positions.bool()])
    return (logits, cache) if return_cache else logits


def _hidden_and_cache(model: nn.Module, return_cache: bool, model_kwargs: dict[str, Any]) -> tuple[Tensor, Any]:
    if return_cache:
        return decoder_hidden_states(model, return_cache=True, **model_kwargs)
    return decoder_hidden_states(model, **model_kwargs), None


def unpack(values: Tensor, mask: Tensor) -> Tensor:
    """Scatter packed per-token values (N,) back to (B, T) at ``mask`` (zeros elsewhere); differentiable."""
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(mask.bool(), values)


# --------------------------------------------------------------------------------------------------
# hidden states instead of logits: the LM head is left to the caller (lopd_lightning.losses.lm_head)
# --------------------------------------------------------------------------------------------------
def selected_hidden_states(model: nn.Module, positions: Tensor, *, return_cache: bool = False, **model_kwargs: Any) -> Any:
    """Packed (N, d) final hidden states (after the final norm: what the LM head reads) at ``positions``.

    ``lm_head_logits(model, selected_hidden_states(model, positions, **kw))`` equals
    ``selected_logits(model, positions, **kw)``; the caller can instead apply the head chunk by chunk
    (:class:`lopd_lightning.losses.lm_head.LMHead`) so that no (N, V) tensor is alive.

    Args:
        model: a Hugging Face causal LM (or a PeftModel around one).
        positions: (B, T) bool, the wanted positions.
        **model_kwargs: as in :func:`selected_logits`.

    Returns:
        (N, d) with N = positions.sum(), row-major order of ``positions``; with ``return_cache``,
        ``(hidden, cache)`` as in :func:`decoder_hidden_states`.

    Raises:
        ValueError: ``positions`` is not (B, T) like the inputs.
    """
    hidden, cache = _hidden_and_cache(model, return_cache, model_kwargs)
    if tuple(positions.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, the inputs {tuple(hidden.shape[:2])}")
    selected = hidden[positions.bool()]
    return (selected, cache) if return_cache else selected
