"""The policy-gradient losses of the baselines: PPO-clip, its clip fraction, the k3 KL estimate and GRPO's loss.

Map to the method (docs/METHOD.md):

* :func:`ppo_clip_loss`, :func:`ppo_clip_fraction`: section 6, the GRPO policy loss and its clip diagnostic.
* :func:`k3_kl`: section 6, the k3 KL estimator on sampled tokens (GRPO's KL to the reference, Skill-SD's
  self-distillation term).
* :func:`grpo_loss`: section 6, GRPO's objective of one optimisation pass (global token means).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lopd_lightning.losses._common import _compute_dtype
from lopd_lightning.losses.tokens import masked_mean

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
