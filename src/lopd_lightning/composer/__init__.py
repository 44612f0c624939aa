"""The composer: the trainable latent context c_phi, its pretraining, its losses and its objective during LOPD
training (docs/METHOD.md 3 and 5).

* :mod:`.model`: :class:`LatentComposer` (LoRA encoder Enc_psi + a compressor Comp_chi), its parameter groups
  and clip norms, saving and loading.
* :mod:`.compressors`: the compressors, :class:`MemoryTokens` (default), the paper's :class:`PerceiverResampler`
  and the pointer :class:`TokenPointer`.
* :mod:`.losses`: :func:`latent_nll` (L_init and the reconstruction term L_rec), :func:`latent_spread`.
* :mod:`.objective`: the composer's objective in LOPD, :func:`composer_objective` = L_distill + beta (m - Delta)
  + lambda :func:`anchor_loss`, with the privileged margin Delta (:func:`privileged_margin`, :func:`margin_delta`
  through the LM head; ``margin_weighting``: :data:`MARGIN_WEIGHTINGS`).
* :mod:`.pretrain`: the pretraining stage (the paper's warm start) run by Lightning
  (:class:`ComposerPretraining`, :func:`pretrain_composer`; ``lopd pretrain-composer``).
* :mod:`.probe`: whether the latents carry each row's experience, measured during training.
"""

from lopd_lightning.composer.compressors import MemoryTokens, PerceiverResampler, TokenPointer
from lopd_lightning.composer.losses import latent_nll, latent_spread, pretraining_objective
from lopd_lightning.composer.model import (
    ARCHITECTURES,
    ClipNorms,
    ComposerOutput,
    ExperienceBatch,
    LatentComposer,
    clip_composer_grads,
    composer_parameter_groups,
    experience_prompt,
    load_composer,
    save_composer,
)
from lopd_lightning.composer.objective import (
    MARGIN_WEIGHTINGS,
    anchor_loss,
    composer_objective,
    has_both_outcomes,
    margin_delta,
    privileged_margin,
)

__all__ = [
    "ARCHITECTURES",
    "ClipNorms",
    "ComposerOutput",
    "ExperienceBatch",
    "LatentComposer",
    "MARGIN_WEIGHTINGS",
    "MemoryTokens",
    "PerceiverResampler",
    "TokenPointer",
    "anchor_loss",
    "clip_composer_grads",
    "composer_objective",
    "composer_parameter_groups",
    "experience_prompt",
    "has_both_outcomes",
    "latent_nll",
    "latent_spread",
    "load_composer",
    "margin_delta",
    "pretraining_objective",
    "privileged_margin",
    "save_composer",
]
