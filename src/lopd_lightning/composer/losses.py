"""The composer's pretraining losses and the diagnostics that tell a composer that carries its experience
from one that has collapsed to a constant prompt.

Map to the method (docs/METHOD.md):

* :func:`latent_nll`: section 5, the composer cold start L_init = -log pi_theta_bar(y* | s, c_phi) on a
  batch of solved tasks; on a batch of reconstruction prompts it is the autoencoding term L_rec
  (docs/METHOD.md section 3, "Deviation": the teacher reproduces an experience from its latents alone).
* :func:`pretraining_objective`: L_pre = w_task L_init + w_rec L_rec.
* :func:`latent_spread`: how much the latents differ across experiences (0: one constant prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lopd_lightning.losses import token_logps
from lopd_lightning.teacher.prefix_cache import PrefixStore, prefix_length

if TYPE_CHECKING:  # the teacher is only called here (the teacher package does not import this module)
    from lopd_lightning.composer.model import ComposerOutput
    from lopd_lightning.teacher import SelfTeacher

__all__ = ["latent_nll", "latent_spread", "pretraining_objective"]


def latent_nll(
    teacher: SelfTeacher,
    composer_output: ComposerOutput,
    input_ids: Tensor,
    attention_mask: Tensor,
    context_position: Tensor | Sequence[int],
    assistant_mask: Tensor,
    *,
    prefix_cache: bool | PrefixStore = False,
) -> Tensor:
    """The teacher's negative log-likelihood of the assistant tokens with the latents in its context.

    Args:
        teacher: the self-teacher (its mode gives theta_bar).
        composer_output: latents (B, L, d) and latent_mask (B, L) bool of each row's experiences.
        input_ids: (B, T) long, the conversations to predict (solved tasks: L_init; reconstruction prompts
            whose reply is the experience: L_rec).
        attention_mask: (B, T) {0, 1}.
        context_position: (B,) long, where the first user message's content starts (the latents go there).
        assistant_mask: (B, T) {0, 1}, 1 on the assistant tokens to predict (aligned with ``input_ids``).
        prefix_cache: compute the tokens before every row's context (:func:`~lopd_lightning.teacher.prefix_length`:
            the system prompt with its tool schemas, most of a tool-use prompt) in one pass without gradients and
            start the teacher's pass after them from their keys and values (:meth:`SelfTeacher.own_prefix`): the
            causal mask makes them independent of the latents, so the value and the latents' gradient are the
            same up to float rounding, and neither the pass with gradients nor its backward covers the prefix.
            Needs a plain full-attention cache and no activation checkpointing (a checkpointed layer reads no
            cache); False recomputes the whole sequence. A :class:`~lopd_lightning.teacher.prefix_cache.PrefixStore`
            (for a teacher whose weights stay constant: the pretraining's) keeps each row's prefix across calls
            instead of recomputing it.

    Returns:
        () float32: ``-sum(mask * logp) / sum(mask)`` over the predicted tokens ``input_ids[:, 1:]`` with
        ``mask = assistant_mask[:, 1:] * attention_mask[:, 1:]`` (nats per token); 0 (still attached to the
        graph) when no token is masked in. Gradients reach the latents (the composer) only.

    Source: the composer cold start of LOPD (docs/METHOD.md section 5); reconstruction as in the in-context
    autoencoder (Ge et al., ICLR 2024).
    """
    latents, latent_mask = composer_output[0], composer_output[1]
    mask = assistant_mask[:, 1:].bool() & attention_mask[:, 1:].bool()  # [B, T-1]
    positions = torch.cat([mask, mask.new_zeros(mask.shape[0], 1)], dim=1)  # logits that predict masked tokens
    prefix = None
    if isinstance(prefix_cache, PrefixStore):
        prefix = prefix_cache.prefix(teacher, input_ids, attention_mask, context_position)
    elif prefix_cache:
        n_prefix = prefix_length(attention_mask, context_position)
        prefix = teacher.own_prefix(input_ids, attention_mask, n_prefix) if n_prefix > 0 else None
    logits = teacher.logits_on_student_positions(
        input_ids, attention_mask, context_position, latents=latents, latent_mask=latent_mask, positions=positions,
        prefix=prefix,
    )  # [N, V]: the LM head runs on the N predicted tokens only
    logps = token_logps(logits[None], input_ids[:, 1:][mask][None])[0]
    loss = -logps.sum() / mask.sum().clamp(min=1).to(logps.dtype)
    if not loss.requires_grad and latents.requires_grad:  # no row had a latent: keep the graph for backward()
        loss = loss + 0.0 * latents.sum()
    return loss


def pretraining_objective(task_nll: Tensor, reconstruction_nll: Tensor, *, task_weight: float,
                          reconstruction_weight: float) -> Tensor:
    """L_pre = ``task_weight * task_nll + reconstruction_weight * reconstruction_nll``.

    Args:
        task_nll: () float, L_init (:func:`latent_nll` on solved tasks).
        reconstruction_nll: () float, L_rec (:func:`latent_nll` on reconstruction prompts).
        task_weight, reconstruction_weight: >= 0; (1, 0) is the paper's warm start.

    Returns:
        () float.
    """
    return task_weight * task_nll + reconstruction_weight * reconstruction_nll


def latent_spread(latents: Tensor, latent_mask: Tensor | None = None) -> Tensor:
    """How much the latents of different experiences differ: ``mean_i ||c_i - mean_j c_j|| / ||c_i||``.

    Args:
        latents: (N, K, d) float, the K latents of N experiences (one experience per row: slice a
            (B, J*K, d) :class:`ComposerOutput` into (B*J, K, d) first).
        latent_mask: (N,) bool, the rows to count (None: all).

    Returns:
        () float32 in [0, ...): 0 when every experience gets the same latents (collapse); nan with fewer
        than two rows.

    Raises:
        ValueError: ``latents`` is not (N, K, d) or the mask is not (N,).
    """
    if latents.dim() != 3:
        raise ValueError(f"latents must be (N, K, d), got {tuple(latents.shape)}")
    if latent_mask is not None:
        if latent_mask.shape != latents.shape[:1]:
            raise ValueError(f"latent_mask must be ({latents.shape[0]},), got {tuple(latent_mask.shape)}")
        latents = latents[latent_mask.bool()]
    if latents.shape[0] < 2:
        return latents.new_full((), float("nan"), dtype=torch.float32)
    flat = latents.detach().float().flatten(1)  # [N, K*d]
    centred = flat - flat.mean(dim=0, keepdim=True)
    return (centred.norm(dim=1) / flat.norm(dim=1).clamp_min(1e-12)).mean()
