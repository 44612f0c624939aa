"""Per-token log-probabilities of the sampled tokens, and the global token mean that reduces per-token losses.

Map to the method (docs/METHOD.md):

* :func:`token_logps`: log pi(a | s), the per-token policy log-probability of every loss (sections 5-6).
* :func:`masked_mean`: section 5, the global token mean (sum over micro-batches and ranks / token count).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lopd_lightning.losses._common import _check_temperature, _compute_dtype

#: Elements (rows x V) materialised at once in float32 by :func:`token_logps`: 2**24 floats = 64 MiB.
_TOKEN_LOGPS_CHUNK_ELEMENTS = 2**24


def _row_chunks(shape: torch.Size, chunk_rows: int):
    """Yield (b, t0, t1) covering a (B, T, V) tensor in blocks of at most ``chunk_rows`` positions."""
    batch, length = shape[0], shape[1]
    for b in range(batch):
        for t0 in range(0, length, chunk_rows):
            yield b, t0, min(t0 + chunk_rows, length)


class _TokenLogps(torch.autograd.Function):
    """log softmax(logits / tau)[token], chunked in forward and backward; saves only the input logits."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk_rows: int) -> Tensor:
        cdtype = _compute_dtype(logits.dtype)
        out = torch.empty(tokens.shape, dtype=cdtype, device=logits.device)  # [B, T]
        lse = torch.empty(tokens.shape, dtype=cdtype, device=logits.device)  # [B, T]
        for b, t0, t1 in _row_chunks(logits.shape, chunk_rows):
            x = logits[b, t0:t1].to(cdtype)  # [t, V], a float copy of one chunk only
            if temperature != 1.0:
                x = x / temperature
            lse[b, t0:t1] = torch.logsumexp(x, dim=-1)
            out[b, t0:t1] = x.gather(-1, tokens[b, t0:t1, None]).squeeze(-1) - lse[b, t0:t1]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, tokens, lse = ctx.saved_tensors
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        cdtype = lse.dtype
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [B, T, V]
        # d/dx_v log softmax(x / tau)[a] = (1[v = a] - p_v) / tau
        for b, t0, t1 in _row_chunks(logits.shape, chunk_rows):
            x = logits[b, t0:t1].to(cdtype)
            if temperature != 1.0:
                x = x / temperature
            g = grad_out[b, t0:t1, None].to(cdtype)  # [t, 1]
            gx = torch.exp(x - lse[b, t0:t1, None]).mul_(-g)  # [t, V]
            gx.scatter_add_(-1, tokens[b, t0:t1, None], g)
            if temperature != 1.0:
                gx.div_(temperature)
            grad[b, t0:t1] = gx.to(logits.dtype)
        return grad, None, None, None


def token_logps(
    logits: Tensor, tokens: Tensor, *, temperature: float = 1.0, chunk_rows: int | None = None
) -> Tensor:
    """Log-probabilities of the given tokens under ``softmax(logits / temperature)``.

    Positions are already aligned: ``logits[b, t]`` scores ``tokens[b, t]`` (the caller shifts). The
    log-softmax is computed block by block (``chunk_rows`` positions of one rollout at a time) in a
    custom autograd function that saves only the input ``logits`` (and a (B, T) log-normaliser), so no
    second (B, T, V) tensor is kept alive for backward, not even for bfloat16 input or a temperature
    other than 1. Double backward is not supported.

    Formula: ``logp[b, t] = x[b, t, a] - logsumexp_v x[b, t, v]`` with ``x = logits / temperature`` and
    ``a = tokens[b, t]``; gradient ``(1[v = a] - softmax(x)_v) / temperature``.

    Args:
        logits: (B, T, V) float (bfloat16, float16, float32 or float64); may be a non-contiguous view
            such as ``logits[:, :-1]``.
        tokens: (B, T) integer token ids in ``[0, V)``.
        temperature: sampling temperature, > 0. 1.0 leaves the logits unchanged.
        chunk_rows: positions per block; default ``max(1, 2**24 // V)`` (64 MiB of float32 per block).

    Returns:
        (B, T) float32 (float64 for float64 logits) log-probabilities, <= 0.

    Raises:
        ValueError: ``logits`` is not 3-D, ``tokens`` is not ``logits.shape[:-1]``, a token id is
            outside ``[0, V)`` (e.g. a ``-100`` ignore label; this check syncs with the device), the
            temperature is not > 0, or ``chunk_rows`` < 1.

    Source: the per-token policy log-probability log pi(a | s) used by every loss (docs/METHOD.md sections
    5-6); chunking as in memory-efficient log-prob kernels (e.g. torchtune's chunked cross-entropy).
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    if tuple(tokens.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"tokens shape {tuple(tokens.shape)} must equal logits shape[:-1] {tuple(logits.shape[:-1])}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor, got {tokens.dtype}")
    _check_temperature(temperature)
    vocab = logits.shape[-1]
    if chunk_rows is None:
        chunk_rows = max(1, _TOKEN_LOGPS_CHUNK_ELEMENTS // max(vocab, 1))
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    tokens = tokens.long()
    if tokens.numel():
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    return _TokenLogps.apply(logits, tokens, float(temperature), int(chunk_rows))


def masked_mean(values: Tensor, mask: Tensor, *, num_tokens: int | Tensor | None = None) -> Tensor:
    """Mean of ``values`` over the positions where ``mask`` is 1.

    Formula: ``sum(values * mask) / mask.sum()``, or ``/ num_tokens`` when given. Masked-out positions
    are excluded with ``where`` before the product, so a NaN or inf there (e.g. a divergence on padding)
    does not leak into the result or the gradient. When the denominator is 0 the result is 0 with a
    zero gradient (the denominator is clamped to at least 1; the numerator is then 0).

    Args:
        values: (B, T) float, per-token losses (any shape, equal to ``mask``'s).
        mask: (B, T) bool or {0, 1}, 1 on assistant tokens. Fractional values act as weights.
        num_tokens: divide by this count instead of ``mask.sum()``: the number of assistant tokens
            in the whole optimiser step (all micro-batches, all ranks), so that accumulation and
            data parallelism give the gradient of one large batch. An int or a 0-d tensor, >= 0.

    Returns:
        () float in ``values.dtype``. 0 when nothing is masked in.

    Raises:
        ValueError: ``values`` and ``mask`` differ in shape, or ``num_tokens`` < 0.

    Source: the global token mean of LOPD, Eq. 10 (docs/METHOD.md section 5).
    """
    if values.shape != mask.shape:
        raise ValueError(
            f"values shape {tuple(values.shape)} and mask shape {tuple(mask.shape)} differ"
        )
    weights = mask.to(values.dtype)
    total = torch.where(weights != 0, values * weights, torch.zeros_like(values)).sum()
    if num_tokens is None:
        count = weights.sum()
    elif isinstance(num_tokens, Tensor):
        count = num_tokens.detach().to(device=values.device, dtype=values.dtype)
    else:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        count = torch.tensor(float(num_tokens), dtype=values.dtype, device=values.device)
    return total / count.clamp(min=1)


def shifted_token_logps(logits: Tensor, input_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Log-probs of ``input_ids[:, 1:]`` from causal-LM ``logits`` (index t predicts token t+1).

    Args:
        logits: (B, T, V) float, e.g. the student's or
            :meth:`lopd_lightning.teacher.SelfTeacher.logits_on_student_positions`.
        input_ids: (B, T) long.
        temperature: divide the logits by it first.

    Returns:
        (B, T-1) float32: ``log p(input_ids[b, t+1] | input_ids[b, :t+1])``; pad positions hold the
        log-prob of the pad token (mask them).
    """
    return token_logps(logits[:, :-1], input_ids[:, 1:], temperature=temperature)
