"""Causal-LM forward passes that compute the LM head only where a loss needs it.

A training sequence of T tokens usually has far fewer assistant tokens than T (BFCL live_simple with
SmolLM2: ~44 of ~450), while the LM head (d x V, V = 49,152) and the (B, T, V) logits dominate the
memory of a step. :func:`selected_logits` runs the decoder on the whole sequence and the head only on
the selected positions, returning packed (N, V) logits in the selected positions' row-major order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_hidden_states(model: nn.Module, **model_kwargs: Any) -> Tensor:
    """(B, T, d) last hidden states (after the final norm) of a Hugging Face causal LM.

    Works on a peft ``PeftModel`` too: its LoRA layers live inside the base model, so the active adapter
    applies. ``model_kwargs`` are the usual ``input_ids`` / ``inputs_embeds``, ``attention_mask``,
    ``position_ids``.
    """
    decoder = _base(model).get_decoder()
    model_kwargs.setdefault("use_cache", False)
    return decoder(**model_kwargs).last_hidden_state


def lm_head_logits(model: nn.Module, hidden: Tensor) -> Tensor:
    """The model's output head on ``hidden`` (..., d) -> (..., V), with final logit soft-capping if any."""
    base = _base(model)
    logits = base.get_output_embeddings()(hidden)
    cap = getattr(base.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def selected_logits(model: nn.Module, positions: Tensor | None = None, **model_kwargs: Any) -> Tensor:
    """Logits of a causal LM, at all positions or only at ``positions``.

    Args:
        model: a Hugging Face causal LM (or a PeftModel around one).
        positions: (B, T) bool, the positions whose logits are wanted, or None for all.
        **model_kwargs: ``input_ids`` or ``inputs_embeds`` (B, T[, d]), ``attention_mask``, ``position_ids``.

    Returns:
        (B, T, V) when ``positions`` is None, else packed (N, V) with N = positions.sum(), in row-major
        order of ``positions`` (the order of ``tensor[positions]``). Same values as
        ``model(**model_kwargs).logits`` at those positions.

    Raises:
        ValueError: ``positions`` is not (B, T) like the inputs.
    """
    hidden = decoder_hidden_states(model, **model_kwargs)
    if positions is None:
        return lm_head_logits(model, hidden)
    if tuple(positions.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, the inputs {tuple(hidden.shape[:2])}")
    return lm_head_logits(model, hidden[positions.bool()])


def unpack(values: Tensor, mask: Tensor) -> Tensor:
    """Scatter packed per-token values (N,) back to (B, T) at ``mask`` (zeros elsewhere); differentiable."""
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(mask.bool(), values)
