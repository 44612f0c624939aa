"""Pure tensor losses of LOPD and its baselines: log-probabilities, divergences, margin, PPO-clip, reduction.

Every function here takes tensors and keyword-only options and returns tensors; nothing holds a model,
logs, or reduces behind the caller's back. Divergences return one value per token, (B, T); reduce them
with :func:`masked_mean` (a global token mean, docs/METHOD.md section 5).

Conventions shared by every function below:

* Shapes: B rollouts, T (already aligned) token positions, V vocabulary entries, M kept entries.
* Compute dtype: half-precision inputs (bfloat16, float16) and float32 are computed in float32; float64
  inputs stay float64 (so tests can compare against float64 references). Results come out in the
  compute dtype.
* Temperature: logits are divided by ``temperature`` before the softmax, identically for student and
  teacher (``softmax(logits / temperature)``). No ``temperature ** 2`` factor is applied to the loss.
* Direction: ``KL(P || Q) = sum_v P(v) (log P(v) - log Q(v))``; terms with ``P(v) = 0`` count 0
  (the ``xlogy`` convention), so exactly-zero mass (``-inf`` logits) never produces NaN.

Map to the method (docs/METHOD.md):

* :func:`topk_tail_reverse_kl`: section 5, the top-M + tail reverse KL of LOPD (also SDPO, section 6).
* :func:`chunked_topk_tail_reverse_kl`: the same value from final hidden states and the LM head, chunk by
  chunk, so that no (N, V) tensor is ever alive (memory O(chunk x V)).
* :func:`privileged_margin`: section 5, the margin Delta(phi) of the composer objective.
* :func:`masked_mean`: section 5, the global token mean (sum over micro-batches and ranks / token count).
* :func:`generalized_jsd`: section 6, OPSD's generalized JSD (the GKD convention).
* :func:`ppo_clip_loss`: section 6, the GRPO policy loss.
* :func:`k3_kl`: section 6, the k3 KL estimator on sampled tokens (GRPO's KL to the reference, Skill-SD's
  self-distillation term).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

__all__ = [
    "DIVERGENCES",
    "GRPOLoss",
    "divergence",
    "grpo_loss",
    "chunked_topk_tail_reverse_kl",
    "generalized_jsd",
    "k3_kl",
    "masked_mean",
    "ppo_clip_fraction",
    "ppo_clip_loss",
    "privileged_margin",
    "token_logps",
    "topk_tail_logprobs",
    "topk_tail_reverse_kl",
]

#: Elements (rows x V) materialised at once in float32 by :func:`token_logps`: 2**24 floats = 64 MiB.
_TOKEN_LOGPS_CHUNK_ELEMENTS = 2**24


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_temperature(temperature: float) -> None:
    if not temperature > 0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")


def _check_pair(student_logits: Tensor, teacher_logits: Tensor) -> None:
    """Student and teacher logits must agree in vocabulary and in leading shape."""
    if student_logits.ndim == 0 or teacher_logits.ndim == 0:
        raise ValueError("student and teacher logits need a vocabulary dimension (..., V), got scalars")
    v_s, v_t = student_logits.shape[-1], teacher_logits.shape[-1]
    if v_s != v_t:
        raise ValueError(
            f"student vocabulary size {v_s} != teacher vocabulary size {v_t}; the teacher must score "
            "the student's vocabulary (same tokenizer, same lm_head size)"
        )
    if student_logits.shape[:-1] != teacher_logits.shape[:-1]:
        raise ValueError(
            f"student logits shape {tuple(student_logits.shape)} and teacher logits shape "
            f"{tuple(teacher_logits.shape)} differ in their leading (B, T) dimensions; align the "
            "teacher positions to the student's (keep the last T teacher logits)"
        )


def _log_softmax(logits: Tensor, temperature: float) -> Tensor:
    """log softmax(logits / temperature) in the compute dtype."""
    x = logits.to(_compute_dtype(logits.dtype))
    if temperature != 1.0:
        x = x / temperature
    return torch.log_softmax(x, dim=-1)


def _kl(p_logprobs: Tensor, q_logprobs: Tensor) -> Tensor:
    """KL(P || Q) over the last dimension from log-probabilities, with 0 log 0 = 0 (xlogy convention).

    Where ``P(v) = 0`` (log-prob ``-inf``) the term is 0 and its gradient is 0 (the log-ratio is
    replaced before it is multiplied, so no ``0 * nan`` appears in forward or backward). Where
    ``P(v) > 0`` and ``Q(v) = 0`` the result is ``+inf``, the true value.
    """
    support = p_logprobs > float("-inf")
    log_ratio = torch.where(support, p_logprobs - q_logprobs, torch.zeros_like(p_logprobs))
    return (p_logprobs.exp() * log_ratio).sum(dim=-1)


# --------------------------------------------------------------------------------------------------
# log-probabilities of the sampled tokens
# --------------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------------
# top-M support with a tail bucket
# --------------------------------------------------------------------------------------------------
def topk_tail_logprobs(logprobs: Tensor, index: Tensor) -> Tensor:
    """Restrict a distribution to the entries ``index`` plus one tail bucket holding the rest.

    Formula: ``out[..., :M] = logprobs.gather(-1, index)`` and
    ``out[..., M] = log sum_{v not in index} exp(logprobs[..., v])`` (= ``log(1 - sum_top p)`` for a
    normalised input), computed as a logsumexp over the complement (the indexed entries masked to
    ``-inf``), which stays accurate when the tail is far smaller than float epsilon, unlike
    ``log1p(-sum p)``.

    Tail floor: the tail bucket (and only it) is clamped below at ``log(torch.finfo(dtype).tiny)``
    (about -87.34 for float32/bfloat16, -708.4 for float64), also when the complement is empty or has
    exactly zero mass (M = V, or ``-inf`` log-probs). So the bucket is always finite and its gradient
    is never NaN; below the floor its gradient is 0. The floor adds at most ``tiny`` (about 1e-38)
    of spurious mass, which is below what a float32 probability can resolve.

    Args:
        logprobs: (..., V) float log-probabilities (normalised over V).
        index: (..., M) integer indices into V, distinct along the last dimension (duplicates would be
            counted twice in the kept entries and once in the tail).

    Returns:
        (..., M + 1) log-probabilities in ``logprobs.dtype``: the M kept entries, then the tail bucket.

    Raises:
        ValueError: ``index`` and ``logprobs`` differ in leading shape, or ``logprobs`` is not
            floating point.

    Source: LOPD paper, docs/METHOD.md section 5: top-M support with a tail bucket,
    p~(tail) = 1 - sum_{u in V^M} p(u) (also SDPO's top-k + tail distillation).
    """
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be floating point, got {logprobs.dtype}")
    if logprobs.shape[:-1] != index.shape[:-1]:
        raise ValueError(
            f"index shape {tuple(index.shape)} and logprobs shape {tuple(logprobs.shape)} differ "
            "in their leading dimensions"
        )
    index = index.long()
    top = logprobs.gather(-1, index)  # [..., M]
    rest = logprobs.scatter(-1, index, float("-inf"))  # [..., V], kept entries removed
    empty = torch.isneginf(rest).all(dim=-1, keepdim=True)  # [..., 1], no mass outside the index
    # Replace an all -inf row before the logsumexp: its backward would be exp(-inf - -inf) = nan.
    rest = torch.where(empty, torch.zeros_like(rest), rest)
    tail = torch.logsumexp(rest, dim=-1, keepdim=True)  # [..., 1]
    floor = math.log(torch.finfo(logprobs.dtype).tiny)
    tail = torch.where(empty, torch.full_like(tail, floor), tail).clamp(min=floor)
    return torch.cat([top, tail], dim=-1)


def topk_tail_reverse_kl(
    student_logits: Tensor, teacher_logits: Tensor, *, k: int = 20, temperature: float = 1.0, support: str = "teacher"
) -> Tensor:
    """Reverse KL between student and teacher restricted to the teacher's top-k plus a tail bucket.

    Formula: with ``p = softmax(logits / temperature)`` for each side and ``V^k`` the teacher's k most
    likely tokens at that position, ``p~(v) = p(v)`` for v in ``V^k`` and ``p~(tail) = 1 - sum_{V^k} p``
    (same support for both sides), the result is
    ``KL(p~_S || p~_T) = sum_{j in V^k + tail} p~_S(j) (log p~_S(j) - log p~_T(j))``.
    For ``k >= V`` this is the exact full-vocabulary reverse KL (no bucket is formed).

    Gradients flow to both ``student_logits`` and ``teacher_logits`` (detach the side that is held
    constant: the teacher for the student update, the student for the composer update). The top-k
    indices come from the detached teacher. The tail bucket uses the floor of
    :func:`topk_tail_logprobs` (``log(finfo.tiny)``), so it is finite even when the teacher puts all
    of its mass on the top-k.

    Memory: materialises the float32 log-softmax of both sides and one complement copy of each,
    (B, T, V) apiece; for long sequences with a large vocabulary call it on slices of T.

    Args:
        student_logits: (B, T, V) float logits of the student.
        teacher_logits: (B, T, V) float logits of the teacher, aligned to the student's positions.
        k: size M of the teacher's support, >= 1 (docs/METHOD.md: M = 20).
        temperature: > 0; both sides use ``softmax(logits / temperature)``.
        support: whose top-k forms ``V^k``: ``"teacher"`` (LOPD, docs/METHOD.md 5) or ``"student"`` (SDPO's
            implementation: the student's most likely tokens, detached).

    Returns:
        (B, T) float32 (float64 for float64 input) per-token KL, >= 0 up to rounding.

    Raises:
        ValueError: vocabulary sizes or leading shapes differ (the message names both), ``k`` < 1,
            the temperature is not > 0, or an unknown ``support``.

    Source: LOPD paper, docs/METHOD.md section 5: L_distill, the top-M + tail reverse KL
    KL(p~_S || p~_T); the same top-k + tail form as SDPO (Hubotter et al. 2026), with the support
    taken from the teacher.
    """
    _check_pair(student_logits, teacher_logits)
    _check_temperature(temperature)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if support not in ("teacher", "student"):
        raise ValueError(f"support must be 'teacher' or 'student', got {support!r}")
    student = _log_softmax(student_logits, temperature)  # [B, T, V]
    teacher = _log_softmax(teacher_logits, temperature)  # [B, T, V]
    if k >= student.shape[-1]:
        return _kl(student, teacher)
    index = (teacher if support == "teacher" else student).detach().topk(k, dim=-1).indices  # [B, T, k]
    return _kl(topk_tail_logprobs(student, index), topk_tail_logprobs(teacher, index))


def _chunk_topk_tail_reverse_kl(
    student_hidden: Tensor, teacher_hidden: Tensor, weight: Tensor, bias: Tensor | None, k: int, temperature: float
) -> Tensor:
    """One chunk of :func:`chunked_topk_tail_reverse_kl`: (c, d) hidden states -> (c,) KL."""
    student_logits = F.linear(student_hidden, weight, bias)  # [c, V]
    teacher_logits = F.linear(teacher_hidden, weight, bias)  # [c, V]
    return topk_tail_reverse_kl(student_logits, teacher_logits, k=k, temperature=temperature)


def chunked_topk_tail_reverse_kl(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    lm_head_weight: Tensor,
    *,
    k: int = 20,
    temperature: float = 1.0,
    chunk_size: int = 256,
    lm_head_bias: Tensor | None = None,
) -> Tensor:
    """:func:`topk_tail_reverse_kl` of ``hidden @ W.T (+ b)`` computed ``chunk_size`` rows at a time.

    Same value and gradients as
    ``topk_tail_reverse_kl(F.linear(student_hidden, W, b), F.linear(teacher_hidden, W, b), k=k,
    temperature=temperature)`` (up to float rounding of the matmul), but the (N, V) logits of the two
    sides are never materialised together: each chunk's logits, log-softmaxes and top-k + tail buckets
    are computed, reduced to (chunk,) KL values and freed; backward recomputes them one chunk at a time
    (``torch.utils.checkpoint``, non-reentrant). The extra peak memory is therefore O(chunk_size x V)
    (about 8 float32 (chunk, V) buffers at once: 400 MiB at chunk 256, V = 49,152, flat in N; the
    unchunked loss needs about 8 (N, V) buffers, 6 GiB at N = 4096; benchmarks/loss_memory.py) instead
    of O(N x V); the cost is one more forward of the two LM-head matmuls per chunk in backward.

    Gradients flow to ``student_hidden``, ``teacher_hidden``, ``lm_head_weight`` and ``lm_head_bias``,
    to whichever of them requires grad (detach the side held constant, as for the unchunked loss). The
    teacher's top-k indices come from its detached logits and are recomputed identically in backward.
    A final logit soft-cap (Gemma 2) is not applied: pass such models' logits to
    :func:`topk_tail_reverse_kl` instead.

    Args:
        student_hidden: (..., d) final hidden states of the student (after the final norm), e.g. packed
            (N, d) at the selected positions (:func:`lopd_lightning.lm.decoder_hidden_states` indexed by
            the assistant mask).
        teacher_hidden: (..., d) the teacher's, aligned to the student's rows.
        lm_head_weight: (V, d) the output head's weight (``model.get_output_embeddings().weight``).
        k: size M of the teacher's support, >= 1 (docs/METHOD.md: M = 20).
        temperature: > 0; both sides use ``softmax(logits / temperature)``.
        chunk_size: rows per chunk, >= 1; it need not divide N.
        lm_head_bias: (V,) the head's bias, or None (SmolLM2 and Llama heads have none).

    Returns:
        (...) float32 (float64 for float64 input) per-token KL, >= 0 up to rounding; the leading shape
        of ``student_hidden``.

    Raises:
        ValueError: the hidden states differ in shape, ``lm_head_weight`` is not (V, d) with the hidden
            size d, the bias is not (V,), ``k`` < 1, ``chunk_size`` < 1 or the temperature is not > 0.

    Source: LOPD paper, docs/METHOD.md section 5 (L_distill, as :func:`topk_tail_reverse_kl`); chunking of the
    LM head with recomputation as in chunked / fused linear cross-entropy kernels (e.g. Liger-Kernel's
    fused linear cross-entropy, torchtune's chunked cross-entropy).
    """
    if student_hidden.shape != teacher_hidden.shape:
        raise ValueError(
            f"student hidden shape {tuple(student_hidden.shape)} != teacher hidden shape "
            f"{tuple(teacher_hidden.shape)}; align the teacher rows to the student's"
        )
    if student_hidden.ndim == 0:
        raise ValueError("hidden states need a hidden dimension (..., d), got scalars")
    d = student_hidden.shape[-1]
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != d:
        raise ValueError(f"lm_head_weight must be (V, d={d}), got shape {tuple(lm_head_weight.shape)}")
    if lm_head_bias is not None and tuple(lm_head_bias.shape) != (lm_head_weight.shape[0],):
        raise ValueError(f"lm_head_bias must be (V={lm_head_weight.shape[0]},), got {tuple(lm_head_bias.shape)}")
    _check_temperature(temperature)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead = student_hidden.shape[:-1]
    student_rows = student_hidden.reshape(-1, d)  # [N, d]
    teacher_rows = teacher_hidden.reshape(-1, d)  # [N, d]
    n = student_rows.shape[0]
    cdtype = _compute_dtype(torch.promote_types(student_hidden.dtype, lm_head_weight.dtype))
    if n == 0:
        return torch.zeros(lead, dtype=cdtype, device=student_hidden.device)
    grad_needed = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (student_hidden, teacher_hidden, lm_head_weight, lm_head_bias)
    )
    parts = []
    for start in range(0, n, chunk_size):
        s, t = student_rows[start:start + chunk_size], teacher_rows[start:start + chunk_size]  # [c, d]
        args = (s, t, lm_head_weight, lm_head_bias, int(k), float(temperature))
        if grad_needed:
            parts.append(checkpoint(_chunk_topk_tail_reverse_kl, *args, use_reentrant=False))
        else:
            parts.append(_chunk_topk_tail_reverse_kl(*args))
    return torch.cat(parts).reshape(lead)


# --------------------------------------------------------------------------------------------------
# generalized Jensen-Shannon divergence
# --------------------------------------------------------------------------------------------------
def generalized_jsd(
    student_logits: Tensor, teacher_logits: Tensor, *, beta: float, temperature: float = 1.0
) -> Tensor:
    """Generalized Jensen-Shannon divergence between teacher and student (the GKD convention).

    Formula, with ``S = softmax(student / temperature)`` and ``T = softmax(teacher / temperature)``:

    * ``beta = 0``: ``KL(T || S)`` (forward KL), exactly.
    * ``beta = 1``: ``KL(S || T)`` (reverse KL), exactly.
    * otherwise: ``beta KL(T || M) + (1 - beta) KL(S || M)`` with ``M = beta T + (1 - beta) S`` mixed
      in probability space. The mixture enters through the log-ratios, each a logsumexp of
      log-probabilities plus log weights:
      ``log M/S = logaddexp(log(1 - beta), log beta + log T - log S)`` and
      ``log M/T = logaddexp(log beta, log(1 - beta) + log S - log T)``, which keeps the value accurate
      (relative to its size) as beta approaches 0 or 1.

    Note the convention is discontinuous at the endpoints: as beta -> 0 the interior value tends to
    ``beta KL(T || S)`` (-> 0), not to ``KL(T || S)``; as beta -> 1 it tends to
    ``(1 - beta) KL(S || T)``. The endpoints are the named KLs by definition (as in GKD and TRL);
    beta is never clamped. In the interior ``0 <= JSD <= h(beta) <= log 2`` (h the binary entropy).
    Zero-probability entries (``-inf`` logits, or underflow) contribute 0, never NaN.

    Args:
        student_logits: (B, T, V) float logits of the student.
        teacher_logits: (B, T, V) float logits of the teacher, aligned to the student's positions.
        beta: interpolation weight in [0, 1] (OPSD's scripts use 0.5).
        temperature: > 0; both sides use ``softmax(logits / temperature)``.

    Returns:
        (B, T) float32 (float64 for float64 input) per-token divergence, >= 0 up to rounding.

    Raises:
        ValueError: vocabulary sizes or leading shapes differ (the message names both), beta is
            outside [0, 1] or NaN, or the temperature is not > 0.

    Source: GKD, Agarwal et al. 2024 ("On-Policy Distillation of Language Models"), the generalized
    JSD (as in TRL's ``GKDTrainer.generalized_jsd_loss``); OPSD (Zhao et al. 2026), docs/METHOD.md section 6.
    """
    _check_pair(student_logits, teacher_logits)
    _check_temperature(temperature)
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    student = _log_softmax(student_logits, temperature)  # [B, T, V]
    teacher = _log_softmax(teacher_logits, temperature)  # [B, T, V]
    if beta == 0.0:
        return _kl(teacher, student)
    if beta == 1.0:
        return _kl(student, teacher)
    log_b = torch.tensor(math.log(beta), dtype=student.dtype, device=student.device)
    log_1mb = torch.tensor(math.log1p(-beta), dtype=student.dtype, device=student.device)
    zero = torch.zeros((), dtype=student.dtype, device=student.device)
    # -inf log-probs (zero mass) are replaced where they would be subtracted: inf - inf = nan.
    student_safe = torch.where(torch.isneginf(student), zero, student)
    teacher_safe = torch.where(torch.isneginf(teacher), zero, teacher)
    log_m_over_s = torch.logaddexp(log_1mb, log_b + teacher - student_safe)  # [B, T, V], >= log(1-b)
    log_m_over_t = torch.logaddexp(log_b, log_1mb + student - teacher_safe)  # [B, T, V], >= log(b)
    kl_student_mix = -(student.exp() * log_m_over_s).sum(dim=-1)  # KL(S || M)
    kl_teacher_mix = -(teacher.exp() * log_m_over_t).sum(dim=-1)  # KL(T || M)
    return beta * kl_teacher_mix + (1.0 - beta) * kl_student_mix


# --------------------------------------------------------------------------------------------------
# reduction, margin, PPO
# --------------------------------------------------------------------------------------------------
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


#: Below this |d| :func:`k3_kl` sums the Taylor series of ``exp(d) - d - 1``; above it ``expm1(d) - d``
#: loses at most about 2 * eps / |d| of relative precision (1.2e-5 in float32).
_K3_SERIES_BELOW = 1e-2


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) on tokens sampled from pi: ``exp(d) - d - 1``, ``d = ref - logp``.

    Evaluated without cancellation: ``d^2/2 + d^3/6 + d^4/24 + d^5/120`` for ``|d| < 1e-2`` and
    ``expm1(d) - d`` otherwise, so tiny differences give the tiny positive value (``d = 1e-6`` gives 5e-13;
    the naive float32 ``exp(d) - d - 1`` gives about -6e-8) and the result is never negative. Its gradient
    in ``logps`` is ``1 - exp(d)``; ``ref_logps`` is a constant (detached).

    Args:
        logps: (B, T) float, log pi(a | s) of the sampled tokens (differentiable).
        ref_logps: (B, T) float, log pi_ref(a | s) of the same tokens.

    Returns:
        (B, T) per-token estimate >= 0 in the compute dtype (float32 for half-precision inputs; float64
        stays float64); reduce with :func:`masked_mean`.

    Raises:
        ValueError: the shapes differ.

    Source: Schulman 2020, "Approximating KL divergence" (k3); used by GRPO, Shao et al. 2024
    (DeepSeekMath), Eq. 4, and by Skill-SD's self-distillation term (docs/METHOD.md section 6).
    """
    if logps.shape != ref_logps.shape:
        raise ValueError(f"logps shape {tuple(logps.shape)} and ref_logps shape {tuple(ref_logps.shape)} differ")
    dtype = _compute_dtype(logps.dtype)
    d = ref_logps.detach().to(dtype) - logps.to(dtype)
    series = d * d * (0.5 + d * (1.0 / 6.0 + d * (1.0 / 24.0 + d / 120.0)))
    return torch.where(d.abs() < _K3_SERIES_BELOW, series, torch.expm1(d) - d).clamp_min(0.0)


def privileged_margin(
    teacher_logps: Tensor, student_logps: Tensor, rewards: Tensor, mask: Tensor
) -> Tensor:
    """The margin Delta: how much more (or less) the teacher believes the sampled tokens, weighted by outcome.

    Formula, per rollout b with outcome weight ``A_b = 2 r_b - 1`` and privilege
    ``delta = teacher_logps - sg[student_logps]``:
    ``D_b = sum_t mask[b, t] A_b delta[b, t] / sum_t mask[b, t]``, then
    ``Delta = mean of D_b over the rollouts with at least one masked-in token`` (0 if there are none).

    Gradient flows to ``teacher_logps`` only (the student log-probs and the rewards are detached).

    Args:
        teacher_logps: (B, T) float, log pi_T(a | s, c_phi) of the sampled tokens.
        student_logps: (B, T) float, log pi_S(a | s) of the same tokens.
        rewards: (B,) float, trajectory rewards r(tau) in [0, 1].
        mask: (B, T) bool or {0, 1}, 1 on assistant tokens.

    Returns:
        () float, Delta(phi).

    Raises:
        ValueError: the (B, T) tensors differ in shape, or ``rewards`` is not (B,).

    Source: LOPD paper, docs/METHOD.md section 5: A(tau) = 2 r(tau) - 1,
    delta = log pi_T(a | s, c_phi) - sg[log pi_S(a | s)], Delta(phi) = mean over rollouts of
    [sum omega A delta / sum omega].
    """
    if teacher_logps.shape != student_logps.shape or teacher_logps.shape != mask.shape:
        raise ValueError(
            f"teacher_logps {tuple(teacher_logps.shape)}, student_logps {tuple(student_logps.shape)} "
            f"and mask {tuple(mask.shape)} must have the same (B, T) shape"
        )
    if teacher_logps.ndim != 2 or rewards.shape != teacher_logps.shape[:1]:
        raise ValueError(
            f"rewards must be (B,) = {tuple(teacher_logps.shape[:1])} for (B, T) log-probs, got "
            f"rewards {tuple(rewards.shape)} and log-probs {tuple(teacher_logps.shape)}"
        )
    weights = mask.to(teacher_logps.dtype)  # [B, T]
    outcome = (2.0 * rewards.detach().to(teacher_logps.dtype) - 1.0)[:, None]  # [B, 1]
    delta = teacher_logps - student_logps.detach()  # [B, T]
    per_token = torch.where(weights != 0, outcome * delta * weights, torch.zeros_like(delta))
    count = weights.sum(dim=-1)  # [B]
    per_rollout = per_token.sum(dim=-1) / count.clamp(min=1)  # [B]
    has_tokens = (count > 0).to(per_rollout.dtype)  # [B]
    return (per_rollout * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def _ppo_inputs(logps: Tensor, old_logps: Tensor, advantages: Tensor, eps_low: float, eps_high: float):
    if logps.shape != old_logps.shape:
        raise ValueError(
            f"logps shape {tuple(logps.shape)} and old_logps shape {tuple(old_logps.shape)} differ"
        )
    if logps.ndim != 2:
        raise ValueError(f"logps must be (B, T), got shape {tuple(logps.shape)}")
    if advantages.shape == logps.shape[:1]:
        advantages = advantages[:, None]  # [B, 1]
    elif advantages.shape != logps.shape:
        raise ValueError(
            f"advantages must be (B,) or (B, T) for logps {tuple(logps.shape)}, got "
            f"{tuple(advantages.shape)}"
        )
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if not eps_high >= 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    ratio = torch.exp(logps - old_logps.detach())  # [B, T]
    return ratio, advantages.detach().to(ratio.dtype)


def ppo_clip_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> Tensor:
    """Per-token PPO clipped surrogate loss (to be minimised).

    Formula: ``rho = exp(logps - old_logps)``,
    ``loss = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``. With ``A > 0`` the ratio is capped
    at ``1 + eps_high``; with ``A < 0`` it is floored at ``1 - eps_low``; a capped token has zero
    gradient. ``old_logps`` and ``advantages`` are detached.

    Args:
        logps: (B, T) float, log-probabilities of the sampled tokens under the current policy.
        old_logps: (B, T) float, the same under the policy that sampled them.
        advantages: (B,) float (one per rollout, broadcast over T) or (B, T).
        eps_low: lower clip range, in [0, 1).
        eps_high: upper clip range, >= 0 (DAPO's clip-higher uses eps_high > eps_low).

    Returns:
        (B, T) float per-token loss; reduce with :func:`masked_mean`.

    Raises:
        ValueError: shapes disagree, or an eps is out of range.

    Source: PPO, Schulman et al. 2017, Eq. 7 (L^CLIP); GRPO, Shao et al. 2024 (DeepSeekMath), with
    eps = 0.2 low and high (docs/METHOD.md section 6).
    """
    ratio, adv = _ppo_inputs(logps, old_logps, advantages, eps_low, eps_high)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -torch.minimum(ratio * adv, clipped * adv)


def ppo_clip_fraction(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> Tensor:
    """Per-token indicator that PPO's clip is active (the token gets no gradient from :func:`ppo_clip_loss`).

    Formula: ``1[(A > 0 and rho > 1 + eps_high) or (A < 0 and rho < 1 - eps_low)]`` with
    ``rho = exp(logps - old_logps)``. Reduce with :func:`masked_mean` to get the clip fraction.

    Args:
        logps: (B, T) float, current log-probabilities of the sampled tokens.
        old_logps: (B, T) float, log-probabilities under the sampling policy.
        advantages: (B,) or (B, T) float.
        eps_low: lower clip range, in [0, 1).
        eps_high: upper clip range, >= 0.

    Returns:
        (B, T) float in {0, 1}, no gradient.

    Raises:
        ValueError: shapes disagree, or an eps is out of range.

    Source: PPO, Schulman et al. 2017 (the clip of L^CLIP); the usual ``clipfrac`` diagnostic.
    """
    with torch.no_grad():
        ratio, adv = _ppo_inputs(logps, old_logps, advantages, eps_low, eps_high)
        high = (adv > 0) & (ratio > 1.0 + eps_high)
        low = (adv < 0) & (ratio < 1.0 - eps_low)
        return (high | low).to(ratio.dtype)


class GRPOLoss(NamedTuple):
    """The parts of :func:`grpo_loss`, each a () float.

    Attributes:
        loss: ``pg_loss + kl_coef * kl`` (what is minimised).
        pg_loss: the PPO-clip surrogate, global token mean.
        kl: the k3 KL estimate to the reference, global token mean (None without ``ref_logps``).
        clip_fraction: fraction of tokens whose ratio is clipped (no gradient), same denominator.
    """

    loss: Tensor
    pg_loss: Tensor
    kl: Tensor | None
    clip_fraction: Tensor


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    num_tokens: int | float | Tensor | None = None,
    ref_logps: Tensor | None = None,
    kl_coef: float = 0.0,
) -> GRPOLoss:
    """The GRPO objective of one optimisation pass: PPO-clip surrogate + ``kl_coef`` * k3 KL, global token means.

    Formula, with ``rho = exp(logps - old_logps)`` per token and ``A`` the rollout's advantage:
    ``pg = sum_mask -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) / num_tokens``,
    ``kl = sum_mask k3(ref - logp) / num_tokens`` (:func:`k3_kl`), ``loss = pg + kl_coef * kl``.

    Args:
        logps: (B, T) float, log pi_theta(a | s) of the sampled tokens (differentiable).
        old_logps: (B, T) float, the same under the sampling policy (detached).
        advantages: (B,) float, one per rollout (or (B, T)); detached.
        mask: (B, T) bool, the loss tokens (assistant tokens).
        eps_low, eps_high: PPO clip range below / above 1.
        num_tokens: the denominator of the global token mean (default ``mask.sum()``).
        ref_logps: (B, T) float, log pi_ref of the sampled tokens, or None (no KL).
        kl_coef: weight of the KL term (ignored without ``ref_logps``).

    Returns:
        :class:`GRPOLoss`.

    Raises:
        ValueError: shapes disagree or an eps is out of range (see :func:`ppo_clip_loss`).

    Source: GRPO, Shao et al. 2024 (DeepSeekMath), Eq. 3 with the token-level normalisation of the LOPD
    code base (a global token mean, docs/METHOD.md section 5); PPO, Schulman et al. 2017, Eq. 7.
    """
    per_token = ppo_clip_loss(logps, old_logps, advantages, eps_low=eps_low, eps_high=eps_high)  # [B, T]
    pg = masked_mean(per_token, mask, num_tokens=num_tokens)
    clipped = ppo_clip_fraction(logps, old_logps, advantages, eps_low=eps_low, eps_high=eps_high)  # [B, T]
    clip_fraction = masked_mean(clipped, mask, num_tokens=num_tokens)
    kl = None
    loss = pg
    if ref_logps is not None:
        kl = masked_mean(k3_kl(logps, ref_logps), mask, num_tokens=num_tokens)
        loss = pg + kl_coef * kl
    return GRPOLoss(loss, pg, kl, clip_fraction)


# --------------------------------------------------------------------------------------------------
# the distillation divergences by name (SDPO, OPSD, Skill-SD pick one; LOPD uses topk_reverse_kl)
# --------------------------------------------------------------------------------------------------
DivergenceName = Literal["topk_reverse_kl", "jsd", "forward_kl"]


def _topk_reverse_kl(student_logits: Tensor, teacher_logits: Tensor, *, top_k: int, temperature: float,
                     jsd_beta: float, support: str) -> Tensor:
    return topk_tail_reverse_kl(student_logits, teacher_logits, k=top_k, temperature=temperature, support=support)


def _jsd(student_logits: Tensor, teacher_logits: Tensor, *, top_k: int, temperature: float,
         jsd_beta: float, support: str) -> Tensor:
    return generalized_jsd(student_logits, teacher_logits, beta=jsd_beta, temperature=temperature)


def _forward_kl(student_logits: Tensor, teacher_logits: Tensor, *, top_k: int, temperature: float,
                jsd_beta: float, support: str) -> Tensor:
    return generalized_jsd(student_logits, teacher_logits, beta=0.0, temperature=temperature)


#: name -> per-token divergence ``fn(student_logits, teacher_logits, *, top_k, temperature, jsd_beta,
#: support) -> (...)``; every entry takes every option and ignores the ones it has no use for.
DIVERGENCES: dict[str, object] = {
    "topk_reverse_kl": _topk_reverse_kl,  # top-k + tail KL(p~_S || p~_T), docs/METHOD.md section 5
    "jsd": _jsd,  # generalized JSD, GKD convention (jsd_beta: 0 forward, 1 reverse), section 6
    "forward_kl": _forward_kl,  # full-vocabulary KL(T || S), the generalized JSD at beta 0
}


def divergence(
    name: str,
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    top_k: int = 20,
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
    support: str = "teacher",
) -> Tensor:
    """The per-token divergence ``name`` of :data:`DIVERGENCES` between student and teacher.

    Args:
        name: ``"topk_reverse_kl"`` (:func:`topk_tail_reverse_kl` with ``k = top_k`` and ``support``),
            ``"jsd"`` (:func:`generalized_jsd` with ``beta = jsd_beta``) or ``"forward_kl"`` (KL(T || S)
            over the full vocabulary).
        student_logits, teacher_logits: (..., V) float logits.
        top_k, temperature, jsd_beta, support: the options; each divergence reads the ones it needs.

    Returns:
        (...) float, one value per position.

    Raises:
        ValueError: an unknown ``name`` (the message lists the known ones), or an option out of range
            (from the divergence itself).
    """
    fn = DIVERGENCES.get(name)
    if fn is None:
        raise ValueError(f"unknown divergence {name!r}; choose one of {sorted(DIVERGENCES)}")
    return fn(student_logits, teacher_logits, top_k=top_k, temperature=temperature, jsd_beta=jsd_beta, support=support)  # type: ignore[operator]
