"""GRPOModule: Group Relative Policy Optimisation, the RL baseline (docs/METHOD.md section 6).

One training step (manual optimisation, one optimiser):

1. the DataModule's batch: G = ``group_size`` rollouts per task, contiguous groups;
2. group-relative advantages A_i = (R_i - mean_G R) / (std_G R + eps), one per rollout;
3. optionally the frozen reference's log-probs (the base weights) for a k3 KL penalty;
4. ``ppo_epochs`` passes over the batch: per-token PPO-clip surrogate with ratio exp(logp - logp_old),
   the old log-probs being the first pass's (detached), a global token mean; one optimiser update per
   pass, and ``trainer.global_step`` advances once per batch whatever the number of passes.

No teacher. The loss itself is the pure function :func:`~lopd_lightning.losses.grpo_loss`, which subclasses reuse
(:class:`~lopd_lightning.modules.skill_sd.SkillSDModule` adds its self-distillation term).

Sources: GRPO, Shao et al. 2024 (DeepSeekMath), section 4.1 (group-relative outcome advantages, the
k3 KL estimator to a reference); PPO, Schulman et al. 2017, Eq. 7 (the clipped surrogate).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lopd_lightning.advantages import group_advantages
from lopd_lightning.lm import unpack
from lopd_lightning.losses import grpo_loss, token_logps
from lopd_lightning.modules.base import OnPolicyModule
from lopd_lightning.modules.optimization import clip_grads
from lopd_lightning.rollout import RolloutBatch
from lopd_lightning.teacher import SelfTeacher

log = logging.getLogger(__name__)


@dataclass
class GRPOStepInputs:
    """What every PPO pass of one GRPO step needs, computed once by :meth:`GRPOModule.step_inputs`.

    A subclass that needs more (Skill-SD's teacher log-probs) subclasses this record with its extra
    fields and builds it with :meth:`extend`.

    Attributes:
        mask: (B, T-1) bool, the loss tokens (shifted coordinates: position t predicts token t+1).
        advantages: (B,) float, the group-relative advantages (docs/METHOD.md section 6).
        num_tokens: the denominator of the global token mean (:meth:`OnPolicyModule.num_loss_tokens`).
        ref_logps: (B, T-1) float log-probs of the batch's tokens under the frozen reference on the loss
            tokens (0 elsewhere), or None without a reference (``kl_coef == 0``).
        metrics: ``train/...`` scalars logged once for the step, besides the loss terms.
    """

    mask: Tensor
    advantages: Tensor
    num_tokens: float
    ref_logps: Tensor | None = None
    metrics: dict[str, Tensor | float] = field(default_factory=dict)

    def extend(self, cls: type[GRPOStepInputs], **extra: Any) -> Any:
        """This record's values as a ``cls`` (a subclass of this record) with its ``extra`` fields."""
        return cls(**{f.name: getattr(self, f.name) for f in fields(self)}, **extra)


__all__ = ["GRPOModule", "GRPOStepInputs"]


class GRPOModule(OnPolicyModule):
    """GRPO: group-relative advantages, PPO-clip, optional k3 KL to the frozen base (docs/METHOD.md section 6).

    Besides :class:`~lopd_lightning.modules.base.OnPolicyModule`'s arguments (``--help`` lists both):

    Args:
        group_size: the group size G, >= 2 (paper: 4).
        clip_eps_low, clip_eps_high: PPO clip range below and above 1 (paper: 0.2 each; DAPO's
            clip-higher uses a larger ``clip_eps_high``).
        kl_coef: weight of the k3 KL to the reference (0: no reference, no extra forward). The reference
            is the frozen base: with a LoRA student the same backbone with its adapters disabled; with a
            full student one frozen deepcopy of the initial backbone (a second copy in memory; a warning
            is logged), made only when ``kl_coef > 0``.
        ppo_epochs: optimisation passes over one batch of rollouts (1: on-policy, the ratio is 1).
            The old log-probs are the first pass's, detached (no extra forward). Each pass is one
            optimiser update; ``trainer.global_step`` advances once per batch.
        advantage_eps: eps added to the group std.
        logps_temperature: temperature of the training log-probs (1.0: the raw policy; set it to the
            sampling temperature to score tokens under the sampling distribution).

    Raises:
        ValueError: ``group_size`` < 2 or another option out of range, before the model loads.

    Logged (besides the shared tags): ``train/loss``, ``train/pg_loss``, ``train/kl`` (with a
    reference), ``train/clip_fraction``, ``train/advantage_abs_mean``, ``train/zero_std_groups``
    (fraction of groups whose rewards are all equal: no signal), ``train/grad_norm``; loss values are
    those of the last pass. Timings ``time/reference`` and ``time/student_step``.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        group_size: int = 4,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        kl_coef: float = 0.0,
        ppo_epochs: int = 1,
        advantage_eps: float = 1e-4,
        logps_temperature: float = 1.0,
        **kwargs: Any,
    ):
        # checks that need no model run before the student is loaded
        if group_size < 2:
            raise ValueError(
                f"{type(self).__name__} needs group_size >= 2 (advantages compare the rollouts of "
                f"one task), got {group_size}; set model.init_args.group_size to 2 or more "
                "(docs/METHOD.md: G = 4)"
            )
        if not 0.0 <= clip_eps_low < 1.0:
            raise ValueError(f"model.init_args.clip_eps_low must be in [0, 1) (the ratio's lower clip is 1 - it), "
                             f"got {clip_eps_low}")
        if not clip_eps_high >= 0.0:
            raise ValueError(f"model.init_args.clip_eps_high must be >= 0, got {clip_eps_high}")
        if not kl_coef >= 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        if ppo_epochs < 1:
            raise ValueError(f"ppo_epochs must be >= 1, got {ppo_epochs}")
        if not logps_temperature > 0:
            raise ValueError(f"logps_temperature must be > 0, got {logps_temperature}")
        if not advantage_eps >= 0:
            raise ValueError(f"advantage_eps must be >= 0, got {advantage_eps}")
        super().__init__(model, group_size=group_size, **kwargs)
        self.save_hyperparameters()
        #: the frozen base as a context-free SelfTeacher in "base" mode (None when kl_coef == 0).
        self.reference: SelfTeacher | None = None
        if kl_coef > 0:
            if not self.is_lora_student:
                log.warning("kl_coef > 0 with a full-parameter student: the reference is a frozen deepcopy of the "
                            "initial backbone (a second full copy of the weights in memory)")
            self.reference = SelfTeacher(self.backbone, self.tokenizer, mode="base")

    # ------------------------------------------------------------------ per-step inputs and loss
    def reference_logps(self, batch: RolloutBatch) -> Tensor:
        """(B, T-1) log pi_ref of the batch's tokens on the loss tokens (0 elsewhere), no gradient.

        Raises:
            RuntimeError: the module has no reference (``kl_coef == 0``).
        """
        if self.reference is None:
            raise RuntimeError("no reference model: set kl_coef > 0")
        targets, mask = self.shifted(batch)
        logits = self.reference.logits_on_student_positions(
            batch.input_ids, batch.attention_mask, batch.context_position, positions=self.unshift(mask)
        )  # [N, V], no grad
        logps = token_logps(logits[None], targets[mask][None], temperature=self.hparams.logps_temperature)[0]
        return unpack(logps.detach(), mask)

    def step_inputs(self, batch: RolloutBatch) -> GRPOStepInputs:
        """What every pass of this step needs, computed once (:class:`GRPOStepInputs`): the loss mask, the
        group-relative advantages, the token-mean denominator, the reference log-probs (with ``kl_coef >
        0``, timed as ``time/reference``) and the metrics ``train/advantage_abs_mean`` and
        ``train/zero_std_groups``.

        Subclasses extend it (call ``super()``, then :meth:`GRPOStepInputs.extend`) with what their
        :meth:`loss_terms` reads.
        """
        _, mask = self.shifted(batch)
        g = int(self.hparams.group_size)
        rewards = batch.rewards.float()
        advantages = group_advantages(rewards, group_size=g, eps=self.hparams.advantage_eps)  # [B]
        grouped = rewards.view(-1, g)
        zero_std = (grouped == grouped[:, :1]).all(dim=-1).float().mean()
        ref_logps = None
        if self.reference is not None and self.hparams.kl_coef > 0:
            with self.timed("reference"):
                ref_logps = self.reference_logps(batch)
        return GRPOStepInputs(
            mask=mask,
            advantages=advantages,
            num_tokens=self.num_loss_tokens(batch),
            ref_logps=ref_logps,
            metrics={
                "train/advantage_abs_mean": self.global_mean(advantages.abs().mean()),
                "train/zero_std_groups": self.global_mean(zero_std),
            },
        )

    def loss_terms(self, logps: Tensor, old_logps: Tensor, inputs: GRPOStepInputs) -> dict[str, Tensor]:
        """The loss of one pass and its parts, keyed by the TensorBoard tag they are logged under:
        ``train/loss`` (the value minimised), ``train/pg_loss``, ``train/clip_fraction`` and ``train/kl``
        (with a reference). The dict is the logged metrics; subclasses add their terms to it.

        Args:
            logps: (B, T-1) log-probs of the batch's tokens under the current student (differentiable).
            old_logps: (B, T-1) the same under the sampling policy (the first pass's, detached).
            inputs: :meth:`step_inputs`.
        """
        hp = self.hparams
        out = grpo_loss(
            logps,
            old_logps,
            inputs.advantages.to(logps.device),
            inputs.mask,
            eps_low=hp.clip_eps_low,
            eps_high=hp.clip_eps_high,
            num_tokens=inputs.num_tokens,
            ref_logps=inputs.ref_logps,
            kl_coef=hp.kl_coef,
        )
        terms = {"train/loss": out.loss, "train/pg_loss": out.pg_loss, "train/clip_fraction": out.clip_fraction}
        if out.kl is not None:
            terms["train/kl"] = out.kl
        return terms

    # ------------------------------------------------------------------ training
    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        params = self.student_parameters()
        inputs = self.step_inputs(batch)
        epochs = int(self.hparams.ppo_epochs)
        old_logps: Tensor | None = None
        terms: dict[str, Tensor] = {}
        norm = torch.zeros(())
        max_norm = self.hparams.grad_clip if self.hparams.grad_clip > 0 else float("inf")  # passes before the last
        for epoch in range(epochs):
            with self.timed("student_step"):
                logps = self.student_logps(batch, temperature=self.hparams.logps_temperature)  # [B, T-1]
                if old_logps is None:
                    old_logps = logps.detach()  # the sampling policy's: pass 1's ratio is exactly 1
                terms = self.loss_terms(logps, old_logps, inputs)
                self.manual_backward(terms["train/loss"])
                if epoch == epochs - 1:
                    # the one LightningOptimizer step of this batch: global_step advances once
                    norm = self.clip_and_step(optimizer, params, self.hparams.grad_clip)
                else:
                    self.step_uncounted(optimizer, lambda: clip_grads(params, max_norm))
        metrics = {k: self.global_mean(v) for k, v in terms.items()}
        metrics.update(inputs.metrics)
        metrics["train/grad_norm"] = norm
        self.log_rollout_metrics(batch, metrics)
        return terms["train/loss"].detach()
