"""Pure tensor losses of LOPD and its baselines: log-probabilities, divergences, PPO-clip, reduction.

Every function here takes tensors and keyword-only options and returns tensors; nothing logs or reduces
behind the caller's back (:class:`LMHead` holds references to the two LM heads, :class:`DualAscent` beta). Divergences return one value per token, (B, T); reduce them
with :func:`masked_mean` (a global token mean, docs/METHOD.md section 5). The LM head applied to final
hidden states, in full or chunk by chunk, is :mod:`lopd_lightning.losses.lm_head`.

Conventions shared by every function below:

* Shapes: B rollouts, T (already aligned) token positions, V vocabulary entries, M kept entries.
* Compute dtype: half-precision inputs (bfloat16, float16) and float32 are computed in float32; float64
  inputs stay float64 (so tests can compare against float64 references). Results come out in the
  compute dtype.
* Temperature: logits are divided by ``temperature`` before the softmax, identically for student and
  teacher (``softmax(logits / temperature)``). No ``temperature ** 2`` factor is applied to the loss.
* Direction: ``KL(P || Q) = sum_v P(v) (log P(v) - log Q(v))``; terms with ``P(v) = 0`` count 0
  (the ``xlogy`` convention), so exactly-zero mass (``-inf`` logits) never produces NaN.
* The top-k support of a divergence is the keyword ``top_k``.

One concern per module, every public name re-exported here:

* ``tokens``: :func:`token_logps` (log pi(a | s), sections 5-6) and :func:`masked_mean` (section 5, the
  global token mean: sum over micro-batches and ranks / token count).
* ``divergences``: :func:`topk_tail_logprobs` and :func:`topk_tail_reverse_kl` (section 5, the top-M +
  tail reverse KL of LOPD, also SDPO's), :func:`generalized_jsd` (section 6, OPSD's generalized JSD, the
  GKD convention), :data:`DIVERGENCES` / :func:`divergence` (the divergences by name).
* ``policy``: :func:`ppo_clip_loss` / :func:`ppo_clip_fraction` (section 6, the GRPO policy loss),
  :func:`k3_kl` (section 6, the k3 KL estimator: GRPO's KL to the reference, Skill-SD's self-distillation
  term), :func:`grpo_loss` / :class:`GRPOLoss` (section 6, GRPO's objective).
* ``lm_head``: :class:`LMHead`, the LM head applied to (N, V) logits or to (N, d) hidden states chunk by
  chunk (``distill_chunk_size``), behind :func:`distillation_loss` (section 5, L_distill).
* ``dual``: :class:`DualAscent`, the dual variable beta and its update (section 5).

The composer's own terms (the margin Delta(phi), the latent anchor, the composer objective) are in
:mod:`lopd_lightning.composer.objective`.
"""

from __future__ import annotations

from lopd_lightning.losses.divergences import (
    DIVERGENCES,
    DivergenceName,
    divergence,
    generalized_jsd,
    topk_tail_logprobs,
    topk_tail_reverse_kl,
)
from lopd_lightning.losses.policy import GRPOLoss, grpo_loss, k3_kl, ppo_clip_fraction, ppo_clip_loss
from lopd_lightning.losses.dual import DualAscent
from lopd_lightning.losses.lm_head import LMHead, chunked_topk_tail_reverse_kl, distillation_loss
from lopd_lightning.losses.tokens import masked_mean, shifted_token_logps, token_logps

__all__ = [
    "DIVERGENCES",
    "DualAscent",
    "LMHead",
    "chunked_topk_tail_reverse_kl",
    "distillation_loss",
    "DivergenceName",
    "GRPOLoss",
    "divergence",
    "generalized_jsd",
    "grpo_loss",
    "k3_kl",
    "masked_mean",
    "ppo_clip_fraction",
    "ppo_clip_loss",
    "shifted_token_logps",
    "token_logps",
    "topk_tail_logprobs",
    "topk_tail_reverse_kl",
]

