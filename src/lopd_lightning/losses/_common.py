"""Helpers shared by the loss modules: the compute dtype, argument checks, log-softmax, KL."""

from __future__ import annotations

import math

import torch
from torch import Tensor


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
