"""The distillation divergences between a student's and a teacher's next-token distributions.

Map to the method (docs/METHOD.md):

* :func:`topk_tail_logprobs`: section 5, the top-M support with a tail bucket p~.
* :func:`topk_tail_reverse_kl`: section 5, the top-M + tail reverse KL of LOPD (also SDPO, section 6).
  (The same KL from final hidden states, the LM head applied chunk by chunk: :mod:`lopd_lightning.losses.lm_head`.)
* :func:`generalized_jsd`: section 6, OPSD's generalized JSD (the GKD convention).
* :data:`DIVERGENCES`, :func:`divergence`: the divergences by name (SDPO, OPSD and Skill-SD pick one).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from lopd_lightning.losses._common import _check_pair, _check_temperature, _kl, _log_softmax


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
    student_logits: Tensor, teacher_logits: Tensor, *, top_k: int = 20, temperature: float = 1.0, support: str = "teacher"
) -> Tensor:
    """Reverse KL between student and teacher restricted to the teacher's top-k plus a tail bucket.

    Formula: with ``p = softmax(logits / temperature)`` for each side and ``V^k`` the teacher's k =
    ``top_k`` most likely tokens at that position, ``p~(v) = p(v)`` for v in ``V^k`` and
    ``p~(tail) = 1 - sum_{V^k} p`` (same support for both sides), the result is
    ``KL(p~_S || p~_T) = sum_{j in V^k + tail} p~_S(j) (log p~_S(j) - log p~_T(j))``.
    For ``top_k >= V`` this is the exact full-vocabulary reverse KL (no bucket is formed).

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
        top_k: size M of the teacher's support, >= 1 (docs/METHOD.md: M = 20).
        temperature: > 0; both sides use ``softmax(logits / temperature)``.
        support: whose top-k forms ``V^k``: ``"teacher"`` (LOPD, docs/METHOD.md 5) or ``"student"`` (SDPO's
            implementation: the student's most likely tokens, detached).

    Returns:
        (B, T) float32 (float64 for float64 input) per-token KL, >= 0 up to rounding.

    Raises:
        ValueError: vocabulary sizes or leading shapes differ (the message names both), ``top_k`` < 1,
            the temperature is not > 0, or an unknown ``support``.

    Source: LOPD paper, docs/METHOD.md section 5: L_distill, the top-M + tail reverse KL
    KL(p~_S || p~_T); the same top-k + tail form as SDPO (Hubotter et al. 2026), with the support
    taken from the teacher.
    """
    _check_pair(student_logits, teacher_logits)
    _check_temperature(temperature)
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if support not in ("teacher", "student"):
        raise ValueError(f"support must be 'teacher' or 'student', got {support!r}")
    student = _log_softmax(student_logits, temperature)  # [B, T, V]
    teacher = _log_softmax(teacher_logits, temperature)  # [B, T, V]
    if top_k >= student.shape[-1]:
        return _kl(student, teacher)
    index = (teacher if support == "teacher" else student).detach().topk(top_k, dim=-1).indices  # [B, T, k]
    return _kl(topk_tail_logprobs(student, index), topk_tail_logprobs(teacher, index))


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
# the distillation divergences by name (SDPO, OPSD, Skill-SD pick one; LOPD uses topk_reverse_kl)
# --------------------------------------------------------------------------------------------------
DivergenceName = Literal["topk_reverse_kl", "jsd", "forward_kl"]


def _topk_reverse_kl(student_logits: Tensor, teacher_logits: Tensor, *, top_k: int, temperature: float,
                     jsd_beta: float, support: str) -> Tensor:
    return topk_tail_reverse_kl(student_logits, teacher_logits, top_k=top_k, temperature=temperature, support=support)


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
        name: ``"topk_reverse_kl"`` (:func:`topk_tail_reverse_kl` with ``top_k`` and ``support``),
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
