"""The composer's objective during LOPD training: the privileged margin Delta, the latent anchor, their sum.

Map to the method (docs/METHOD.md):

* :func:`privileged_margin`: section 5, the margin Delta(phi) of the composer objective, on (B, T) log-probs.
* :func:`margin_delta`: the same Delta read through the LM head (:class:`~lopd_lightning.losses.lm_head.LMHead`)
  from the teacher's and the student's logits or hidden states at the loss tokens (what LOPDModule calls).
* :func:`has_both_outcomes`: whether a batch's balanced Delta is informative.
* :func:`anchor_loss`: section 5, the latent anchor mean((c_phi - sg[c_phi0])^2).
* :func:`composer_objective`: section 5, L_distill + beta (m - Delta) + lambda anchor.

The composer's pretraining losses are :mod:`lopd_lightning.composer.losses`; L_distill itself is
:func:`lopd_lightning.losses.lm_head.distillation_loss` (the student's loss too).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lopd_lightning.lm import unpack
from lopd_lightning.losses.lm_head import LMHead

__all__ = ["MARGIN_WEIGHTINGS", "anchor_loss", "composer_objective", "has_both_outcomes", "margin_delta",
           "privileged_margin"]

#: how :func:`privileged_margin` weighs the rollouts: ``paper`` (the default, the paper's mean) or ``balanced``
MARGIN_WEIGHTINGS = ("paper", "balanced")


def privileged_margin(
    teacher_logps: Tensor, student_logps: Tensor, rewards: Tensor, mask: Tensor, *, weighting: str = "paper"
) -> Tensor:
    """The margin Delta: how much more (or less) the teacher believes the sampled tokens, weighted by outcome.

    Formula, per rollout b with outcome weight ``A_b = 2 r_b - 1`` and privilege
    ``delta = teacher_logps - sg[student_logps]``:
    ``D_b = sum_t mask[b, t] A_b delta[b, t] / sum_t mask[b, t]``, then
    ``Delta = mean of D_b over the rollouts with at least one masked-in token`` (0 if there are none).

    ``weighting="balanced"`` (not in the paper) weighs successes and failures equally:
    ``Delta = (mean of D_b over A_b > 0) / 2 + (mean of D_b over A_b < 0) / 2``; a batch without both sides
    gives 0 and no gradient (it says nothing about separation), and rollouts with ``A_b = 0`` count in
    neither. With the paper's mean a teacher that lowers the probability of every sampled token by c earns
    Delta = c (1 - 2 s) > 0 whenever the success fraction s is below one half; the balanced mean gives it 0.

    Gradient flows to ``teacher_logps`` only (the student log-probs and the rewards are detached).

    Args:
        teacher_logps: (B, T) float, log pi_T(a | s, c_phi) of the sampled tokens.
        student_logps: (B, T) float, log pi_S(a | s) of the same tokens.
        rewards: (B,) float, trajectory rewards r(tau) in [0, 1].
        mask: (B, T) bool or {0, 1}, 1 on assistant tokens.
        weighting: ``"paper"`` or ``"balanced"`` (:data:`MARGIN_WEIGHTINGS`).

    Returns:
        () float, Delta(phi).

    Raises:
        ValueError: the (B, T) tensors differ in shape, ``rewards`` is not (B,), or an unknown ``weighting``.

    Source: LOPD paper, docs/METHOD.md section 5: A(tau) = 2 r(tau) - 1,
    delta = log pi_T(a | s, c_phi) - sg[log pi_S(a | s)], Delta(phi) = mean over rollouts of
    [sum omega A delta / sum omega].
    """
    if weighting not in MARGIN_WEIGHTINGS:
        raise ValueError(f"margin weighting must be one of {', '.join(MARGIN_WEIGHTINGS)}, got {weighting!r}")
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
    if weighting == "paper":
        return (per_rollout * has_tokens).sum() / has_tokens.sum().clamp(min=1)
    sides = [has_tokens * (outcome[:, 0] > 0).to(per_rollout.dtype), has_tokens * (outcome[:, 0] < 0).to(per_rollout.dtype)]
    if not all(bool(side.any()) for side in sides):
        return (per_rollout * 0.0).sum()  # one outcome only: no signal (and no gradient)
    return sum(0.5 * (per_rollout * side).sum() / side.sum() for side in sides)


def has_both_outcomes(rewards: Tensor, rows: Tensor) -> bool:
    """Whether ``rows`` (B,) bool hold a rollout with ``2 r - 1 > 0`` and one with ``2 r - 1 < 0``: the batches
    whose balanced Delta (:func:`privileged_margin` ``weighting="balanced"``) is informative."""
    outcome = 2.0 * rewards.detach() - 1.0
    return bool((rows & (outcome > 0)).any()) and bool((rows & (outcome < 0)).any())


def margin_delta(
    head: LMHead,
    student: Tensor,
    teacher: Tensor,
    tokens: Tensor,
    positions: Tensor,
    rewards: Tensor,
    *,
    rows: Tensor | None = None,
    weighting: str = "paper",
) -> Tensor:
    """The privileged margin Delta(phi) of the sampled tokens, differentiable in the teacher's values only.

    ``delta = log pi_T(a | s, c_phi) - sg[log pi_S(a | s)]`` per token, weighted by ``2 r - 1`` and
    averaged per rollout, then over rollouts (:func:`privileged_margin`).

    Args:
        head: the :class:`~lopd_lightning.losses.lm_head.LMHead` (full or chunked).
        student, teacher: (N, V) logits or (N, d) hidden states at the N loss tokens (the student's side
            is detached here).
        tokens: (N,) long, the sampled tokens those rows score.
        positions: (B, T) bool, where the N rows sit (row-major), the loss tokens omega.
        rewards: (B,) float, trajectory rewards in [0, 1].
        rows: (B,) bool, the rollouts that count (LOPD: those whose teacher saw latents; without them
            delta is 0 by construction in ``live`` mode), or None for all.
        weighting: ``"paper"`` (mean over rollouts) or ``"balanced"`` (successes and failures weighed equally;
            :data:`MARGIN_WEIGHTINGS`).

    Returns:
        () float32, Delta(phi) (0 when no rollout counts).

    Raises:
        ValueError: an unknown ``weighting`` (:func:`privileged_margin`).

    Source: LOPD paper, docs/METHOD.md section 5: delta, A(tau) = 2 r(tau) - 1, Delta(phi).
    """
    teacher_logps = head.token_logps(teacher, tokens, side="teacher")
    with torch.no_grad():
        student_logps = head.token_logps(student.detach(), tokens, side="student")
    mask = positions if rows is None else positions & rows[:, None]
    return privileged_margin(unpack(teacher_logps, positions), unpack(student_logps, positions), rewards, mask,
                             weighting=weighting)


def anchor_loss(latents: Tensor, anchor_latents: Tensor, latent_mask: Tensor) -> Tensor:
    """The latent anchor: the mean squared distance of c_phi to the warm-started composer's c_phi0.

    Formula: ``sum_{b, l, i} mask[b, l] (latents - sg[anchor_latents])[b, l, i]^2 / (d * sum mask)``,
    the mean over the kept latent tokens and their d coordinates (0 when no latent is kept).

    Args:
        latents: (B, L, d) float, c_phi (differentiable).
        anchor_latents: (B, L, d) float, c_phi0 of the frozen snapshot (detached).
        latent_mask: (B, L) bool, True on the latent tokens a teacher sees.

    Returns:
        () float in ``latents.dtype``.

    Source: LOPD paper, docs/METHOD.md section 5: lambda mean((c_phi - sg[c_phi0])^2) in the composer objective.
    """
    keep = latent_mask.unsqueeze(-1).to(latents.dtype)  # [B, L, 1]
    count = (keep.sum() * latents.shape[-1]).clamp_min(1)
    return (((latents - anchor_latents.detach()) ** 2) * keep).sum() / count


def composer_objective(
    distill: Tensor, delta: Tensor, anchor: Tensor, *, beta: float, margin: float, anchor_weight: float
) -> Tensor:
    """The composer's loss: ``L_distill(student detached) + beta (m - Delta) + lambda anchor``.

    Args:
        distill: () float, L_distill with the student detached (gradient to the teacher's latents).
        delta: () float, the margin Delta(phi) (:func:`privileged_margin`).
        anchor: () float, :func:`anchor_loss`.
        beta: the dual variable, >= 0 (:class:`lopd_lightning.losses.dual.DualAscent`).
        margin: m.
        anchor_weight: lambda.

    Returns:
        () float, what the composer's optimiser minimises.

    Source: LOPD paper, docs/METHOD.md section 5, the composer objective.
    """
    return distill + beta * (margin - delta) + anchor_weight * anchor
