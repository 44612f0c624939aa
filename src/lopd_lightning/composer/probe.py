"""Is the composer alive? Whether the latents carry each row's experience, measured on a training batch.

A composer that collapsed to one input-independent prompt trains on without an error: its latents are the
same for every experience and the teacher does not care which experiences it gets. :func:`latent_probe`
measures both, every ``latent_probe_every_n_steps`` steps of LOPD (TensorBoard ``train/latent_*``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lopd_lightning.composer.losses import latent_spread

if TYPE_CHECKING:
    from lopd_lightning.modules.lopd import LOPDModule
    from lopd_lightning.rollout import RolloutBatch

__all__ = ["latent_probe"]


def latent_probe(module: LOPDModule, batch: RolloutBatch) -> dict[str, Tensor]:
    """Whether the latents carry each row's experiences: ``train/latent_spread`` (the latents' spread
    across the batch's distinct experiences, :func:`~lopd_lightning.composer.losses.latent_spread`; 0 for a
    composer that gives every input one prompt), ``train/latent_swap_effect`` (the mean over the
    student's tokens of |log pi_T(a | own experiences) - log pi_T(a | another task's)|, nats per token:
    0 when the teacher does not depend on which experiences it gets) and ``train/latent_own_minus_other``
    (the same difference signed). Rows of one group share their experiences, so "another task's" is the
    experiences of the next task in the batch (cyclically over the batch's distinct tasks). No gradient;
    each value is averaged over ranks (weighted by the ranks that could compute it: a rank with one task
    has no other task to swap in).

    Args:
        module: the LOPDModule (its composer, teacher and rank collectives).
        batch: (B rows) a training batch with its retrieved experiences.

    Returns:
        The three () float scalars, or {} when no rank had two tasks with experiences.
    """
    experiences = batch.experiences or [[] for _ in range(len(batch))]
    ids = list(dict.fromkeys(batch.example_ids))
    first = {example_id: i for i, example_id in reversed(list(enumerate(batch.example_ids)))}
    other_of = {example_id: ids[(n + 1) % len(ids)] for n, example_id in enumerate(ids)}  # one task: itself
    zero = torch.zeros((), device=module.device)
    spread, swap, signed, valid = zero, zero, zero, zero
    with torch.no_grad():
        composed = module.batch_latents(batch)
        k = module.composer.num_latents
        distinct = torch.tensor([first[e] for e in ids], device=composed.latents.device)
        per_experience = composed.latents[distinct].reshape(-1, k, composed.latents.shape[-1])
        present = composed.latent_mask[distinct].reshape(-1, k).any(dim=1)
        value = latent_spread(per_experience, present)
        usable = len(ids) > 1 and bool(torch.isfinite(value))
        if usable or module.sharded:  # a sharded strategy's forwards are collectives: every rank runs them
            original = batch.experiences
            batch.experiences = [experiences[first[other_of[e]]] for e in batch.example_ids]
            try:
                other = module.batch_latents(batch)
            finally:
                batch.experiences = original
            targets, mask = module.shifted(batch)
            logps = []
            for latents in (composed, other):  # the LM head in chunks where distill_chunk_size asks for it
                values = module.teacher.on_student_positions(
                    batch.input_ids, batch.attention_mask, batch.context_position, positions=module.unshift(mask),
                    output=module.lm_head.output, latents=latents.latents, latent_mask=latents.latent_mask)
                logps.append(module.lm_head.token_logps(values, targets[mask], side="teacher"))
            diff = logps[0] - logps[1]
            if usable and diff.numel() > 0:
                spread, swap, signed, valid = value, diff.abs().mean(), diff.mean(), zero + 1.0
    weight = module.global_mean(valid)
    if float(weight) == 0:
        return {}
    return {name: module.global_mean(v * valid) / weight for name, v in (
        ("train/latent_spread", spread), ("train/latent_swap_effect", swap), ("train/latent_own_minus_other", signed))}
