"""The checks of :class:`~lopd_lightning.modules.lopd.LOPDModule`'s options that need no model: they run in its
constructor before the student's weights load, and name the config key (``model.init_args.<key>``)."""

from __future__ import annotations

from typing import Any

from lopd_lightning.adapters import as_lora_config, check_lora_config
from lopd_lightning.composer.model import check_composer_options
from lopd_lightning.composer.objective import MARGIN_WEIGHTINGS
from lopd_lightning.hints import choose_one_of
from lopd_lightning.losses.dual import DualAscent
from lopd_lightning.memory.module_bank import check_bank_options
from lopd_lightning.teacher.weights import TEACHER_MODES

__all__ = ["COMPOSER_KL_MEANS", "check_lopd_options"]

#: ``composer_kl_mean`` values: how the composer's distillation term averages its per-token KL.
COMPOSER_KL_MEANS = ("token", "rollout")


def check_lopd_options(
    *, num_latents: int, num_experiences: int, distill_top_k: int, embedder: str, bank_path: str | None,
    bank_capacity: int | None, distill_chunk_size: Any, composer_lora: Any, beta_init: float, dual_lr: float,
    margin_weighting: str, composer_architecture: str, composer_path: str | None, composer_output_gain: float | str,
    warm_start_weights: tuple[float, float], warm_start_lr: float, warm_start_batch_size: int,
    warm_start_reconstruction_noise: float, warm_start_lr_schedule: str, latent_probe_every_n_steps: int,
    composer_kl_mean: str = "token", composer_clip_joint: float | None = None, teacher_mode: str = "live",
) -> None:
    """Refuse the options that are wrong whatever the model, naming the config key (before any weight loads).

    Raises:
        ValueError: an unknown ``margin_weighting``, K < 1, J < 0, M < 1, a negative ``beta_init`` or ``dual_lr``,
            an unknown embedder, a missing or too small bank, a ``distill_chunk_size`` that is not null or an
            int >= 1, a composer LoRA that the shared backbone cannot honour, a negative
            ``latent_probe_every_n_steps``, a ``composer_kl_mean`` other than token or rollout, a
            ``composer_clip_joint`` that is not null or a number > 0, a ``teacher_mode`` other than live, base or
            ema, or a composer or pretraining option
            :func:`~lopd_lightning.composer.model.check_composer_options` refuses.
        FileNotFoundError: ``bank_path`` holds no bank, or ``composer_path`` no composer.
    """
    if margin_weighting not in MARGIN_WEIGHTINGS:
        raise ValueError(f"model.init_args.margin_weighting {margin_weighting!r} is not a weighting; "
                         f"{choose_one_of(margin_weighting, MARGIN_WEIGHTINGS)}")
    check_composer_options(composer_architecture, composer_output_gain, composer_path, warm_start_weights,
                           warm_start_lr=warm_start_lr, warm_start_batch_size=warm_start_batch_size,
                           warm_start_reconstruction_noise=warm_start_reconstruction_noise,
                           warm_start_lr_schedule=warm_start_lr_schedule)
    if teacher_mode not in TEACHER_MODES:
        raise ValueError(f"model.init_args.teacher_mode {teacher_mode!r} is not a teacher mode; "
                         f"{choose_one_of(teacher_mode, TEACHER_MODES)}")
    if composer_kl_mean not in COMPOSER_KL_MEANS:
        raise ValueError(f"model.init_args.composer_kl_mean {composer_kl_mean!r} is not a mean; "
                         f"{choose_one_of(composer_kl_mean, COMPOSER_KL_MEANS)}")
    joint = composer_clip_joint
    if joint is not None and (isinstance(joint, bool) or not isinstance(joint, (int, float)) or not joint > 0):
        raise ValueError(f"model.init_args.composer_clip_joint must be null (separate clips) or a number > 0 (the "
                         f"authors' code: 1.0), got {composer_clip_joint!r}")
    if latent_probe_every_n_steps < 0:
        raise ValueError(f"model.init_args.latent_probe_every_n_steps must be >= 0 (0: never), got "
                         f"{latent_probe_every_n_steps}")
    if num_latents < 1:
        raise ValueError(f"model.init_args.num_latents must be >= 1 (latent tokens per experience), got {num_latents}")
    if num_experiences < 0:
        raise ValueError(f"model.init_args.num_experiences must be >= 0 (experiences per task), got {num_experiences}")
    if distill_top_k < 1:
        raise ValueError(f"model.init_args.distill_top_k must be >= 1, got {distill_top_k}")
    DualAscent.check(beta_init, dual_lr)
    check_bank_options(embedder, bank_path, num_experiences, capacity=bank_capacity)
    chunk = distill_chunk_size
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"model.init_args.distill_chunk_size must be null or an int >= 1, got {distill_chunk_size!r}")
    check_lora_config(as_lora_config(composer_lora, key="composer_lora"), "composer_lora")  # target_modules later
