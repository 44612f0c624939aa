"""Causal-LM forward passes that compute the LM head only where a loss needs it.

A training sequence of T tokens usually has far fewer assistant tokens than T (BFCL live_simple with
SmolLM2: ~44 of ~450), while the LM head (d x V, V = 49,152) and the (B, T, V) logits dominate the
memory of a step. :func:`selected_logits` runs the decoder on the whole sequence and the head only on
the selected positions, returning packed (N, V) logits in the selected positions' row-major order.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lopd_lightning.losses import chunked_topk_tail_reverse_kl, token_logps, topk_tail_reverse_kl


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
# hidden states instead of logits: the LM head recomputed chunk by chunk (peak memory O(chunk x V))
# --------------------------------------------------------------------------------------------------
#: (weight (V, d), bias (V,) or None) of an output head.
Head = tuple  # (Tensor, Tensor | None)


def selected_hidden_states(model: nn.Module, positions: Tensor, *, return_cache: bool = False, **model_kwargs: Any) -> Any:
    """Packed (N, d) final hidden states (after the final norm: what the LM head reads) at ``positions``.

    ``lm_head_logits(model, selected_hidden_states(model, positions, **kw))`` equals
    ``selected_logits(model, positions, **kw)``; the caller can instead apply the head chunk by chunk
    (:func:`chunked_head_kl`, :func:`chunked_token_logps`) so that no (N, V) tensor is alive.

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


def lm_head_parameters(model: nn.Module) -> Head:
    """(weight (V, d), bias or None) of the model's output head, for computing its logits chunk by chunk.

    Raises:
        ValueError: the head is not a plain ``nn.Linear`` (e.g. a LoRA adapter on ``lm_head``) or the
            model soft-caps its final logits (Gemma 2): the chunked losses apply ``hidden @ W.T + b`` only.
    """
    base = base_model(model)
    head = base.get_output_embeddings()
    if getattr(base.config, "final_logit_softcapping", None):
        raise ValueError("the model soft-caps its final logits; the chunked LM-head losses do not: "
                         "set distill_chunk_size to null")
    if not isinstance(head, nn.Linear):
        raise ValueError(f"the output head is a {type(head).__name__}, not an nn.Linear (a LoRA on lm_head?); "
                         "the chunked LM-head losses need its plain weight: set distill_chunk_size to null")
    return head.weight, head.bias


def constant_head(head: Head) -> Head:
    """The head with the tensors that require grad detached (the others are returned as they are)."""
    return tuple(t.detach() if t is not None and t.requires_grad else t for t in head)  # type: ignore[return-value]


def _two_head_kl_chunk(s: Tensor, t: Tensor, ws: Tensor, bs: Tensor | None, wt: Tensor, bt: Tensor | None,
                       k: int, temperature: float) -> Tensor:
    return topk_tail_reverse_kl(F.linear(s, ws, bs), F.linear(t, wt, bt), k=k, temperature=temperature)


def chunked_head_kl(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    student_head: Head,
    teacher_head: Head,
    *,
    k: int,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> Tensor:
    """Per-row top-k + tail reverse KL of the student's and the teacher's heads on (N, d) hidden states.

    Equals ``topk_tail_reverse_kl(F.linear(h_s, *student_head), F.linear(h_t, *teacher_head))`` with
    peak memory O(chunk_size x V). When both heads are the very same tensors this is
    :func:`lopd_lightning.losses.chunked_topk_tail_reverse_kl`; otherwise (a teacher head held constant
    while the student's trains, or the teacher's own frozen copy) each chunk runs under
    ``torch.utils.checkpoint`` with the two heads apart, so the gradient reaches each head only through
    its own side (pass the constant side through :func:`constant_head`).

    Returns:
        (N,) float32 (float64 for float64 input).
    """
    (ws, bs), (wt, bt) = student_head, teacher_head
    if ws is wt and bs is bt:
        return chunked_topk_tail_reverse_kl(
            student_hidden, teacher_hidden, ws, k=k, temperature=temperature, chunk_size=chunk_size, lm_head_bias=bs
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = student_hidden.shape[0]
    if teacher_hidden.shape != student_hidden.shape:
        raise ValueError(f"student hidden {tuple(student_hidden.shape)} != teacher hidden {tuple(teacher_hidden.shape)}")
    if n == 0:
        dtype = torch.float64 if torch.promote_types(student_hidden.dtype, ws.dtype) == torch.float64 else torch.float32
        return torch.zeros(0, dtype=dtype, device=student_hidden.device)
    grad_needed = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (student_hidden, teacher_hidden, ws, bs, wt, bt)
    )
    parts = []
    for start in range(0, n, chunk_size):
        args = (student_hidden[start:start + chunk_size], teacher_hidden[start:start + chunk_size],
                ws, bs, wt, bt, int(k), float(temperature))
        parts.append(checkpoint(_two_head_kl_chunk, *args, use_reentrant=False) if grad_needed
                     else _two_head_kl_chunk(*args))
    return torch.cat(parts)


def _token_logps_chunk(hidden: Tensor, tokens: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    return token_logps(F.linear(hidden, weight, bias)[None], tokens[None], temperature=temperature)[0]


def chunked_token_logps(
    hidden: Tensor,
    tokens: Tensor,
    head: Head,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> Tensor:
    """``token_logps(F.linear(hidden, *head)[None], tokens[None])[0]`` with peak memory O(chunk_size x V).

    Each chunk's logits are computed, reduced to (chunk,) log-probabilities and freed; with a gradient
    to record (``hidden`` or the head requires grad), backward recomputes them one chunk at a time
    (``torch.utils.checkpoint``, non-reentrant).

    Args:
        hidden: (N, d) final hidden states.
        tokens: (N,) integer ids in [0, V).
        head: (weight (V, d), bias or None); detach what must stay constant (:func:`constant_head`).
        temperature: > 0.
        chunk_size: rows per chunk, >= 1.

    Returns:
        (N,) float32 (float64 for float64 input) log-probabilities.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.ndim != 2 or tokens.shape != hidden.shape[:1]:
        raise ValueError(f"need (N, d) hidden and (N,) tokens, got {tuple(hidden.shape)} and {tuple(tokens.shape)}")
    weight, bias = head
    n = hidden.shape[0]
    if n == 0:
        dtype = torch.float64 if torch.promote_types(hidden.dtype, weight.dtype) == torch.float64 else torch.float32
        return torch.zeros(0, dtype=dtype, device=hidden.device)
    grad_needed = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    parts = []
    for start in range(0, n, chunk_size):
        args = (hidden[start:start + chunk_size], tokens[start:start + chunk_size], weight, bias, float(temperature))
        parts.append(checkpoint(_token_logps_chunk, *args, use_reentrant=False) if grad_needed
                     else _token_logps_chunk(*args))
    return torch.cat(parts)
