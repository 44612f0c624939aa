"""SelfDistillationModule: the training step that SDPO and OPSD share (docs/METHOD.md section 6).

Both distil the student, on its own rollouts, towards a self-teacher (a
:class:`~lopd_lightning.teacher.SelfTeacher` on the same backbone) that reads privileged text at the
start of the first user message. They differ only in that text (SDPO: a successful sibling's attempt;
OPSD: the reference solution), in the teacher's weights (SDPO: an EMA of the student; OPSD: the frozen
initial model) and in SDPO's per-token importance weight. One training step:

1. :meth:`SelfDistillationModule.teacher_contexts`: per row, the privileged text the teacher reads
   (None: no context) and which rows are kept in the loss (a :class:`TeacherContexts` record);
2. the teacher scores the kept rows' assistant tokens with that text inserted
   (:meth:`~lopd_lightning.teacher.SelfTeacher.logits_on_student_positions`), no gradient (``time/teacher``);
3. the student's logits on every assistant token; on the kept rows' tokens, the per-token divergence
   D(student, teacher) of :meth:`SelfDistillationModule.divergence` (the registry
   :func:`lopd_lightning.losses.divergence`), times :meth:`SelfDistillationModule.token_weights` when it
   gives weights;
4. the loss is the global token mean over the kept rows' tokens (docs/METHOD.md section 5), one guarded
   update of the student (``time/student_step``), then :meth:`SelfDistillationModule.after_update`.

A rank without a kept row (and under a sharded strategy every rank) still runs the teacher pass when any
row is kept there; with none it steps with a zero loss that reaches every parameter (DDP).

Logged: ``train/loss`` (the distillation loss), the method's
:meth:`~SelfDistillationModule.distillation_metrics`, ``train/grad_norm``, and the shared tags.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from typing_extensions import override

from lopd_lightning import losses
from lopd_lightning.modules.base import OnPolicyModule
from lopd_lightning.rollout import RolloutBatch
from lopd_lightning.teacher import SelfTeacher

log = logging.getLogger(__name__)

__all__ = ["SelfDistillationModule", "TeacherContexts"]


@dataclass(frozen=True)
class TeacherContexts:
    """What :meth:`SelfDistillationModule.teacher_contexts` returns for a batch of B rows.

    Attributes:
        texts: B entries: the privileged text row i's teacher reads at the start of the first user
            message, already framed (templates applied), or None for no context.
        kept: (B,) bool on the batch's device, the rows whose tokens enter the loss.
    """

    texts: list[str | None]
    kept: Tensor


class SelfDistillationModule(OnPolicyModule):
    """Distil the student towards a self-teacher that reads privileged text (see the module docstring).

    A subclass sets :attr:`teacher` (a :class:`~lopd_lightning.teacher.SelfTeacher`) after
    ``super().__init__`` and implements :meth:`teacher_contexts`; it may override :meth:`token_weights`,
    :meth:`distillation_metrics` and :meth:`after_update`. :attr:`divergences` lists the divergence
    names it accepts.

    Besides :class:`~lopd_lightning.modules.base.OnPolicyModule`'s arguments (``--help`` lists both):

    Args:
        divergence: a name of :data:`lopd_lightning.losses.DIVERGENCES` among :attr:`divergences`:
            ``"topk_reverse_kl"`` (top-k + tail KL(p~_S || p~_T)), ``"jsd"`` (generalized JSD, GKD
            convention, ``jsd_beta``) or ``"forward_kl"`` (full-vocabulary KL(T || S)).
        distill_top_k: k of ``"topk_reverse_kl"``.
        jsd_beta: beta of ``"jsd"`` in [0, 1] (0 forward KL(T || S), 1 reverse KL(S || T)).
        distill_temperature: temperature of both distributions in the divergence, > 0.
        topk_support: whose top-k is the support of ``"topk_reverse_kl"``: ``"teacher"`` (LOPD's) or
            ``"student"`` (SDPO's implementation).

    Raises:
        ValueError: a divergence not in :attr:`divergences`, ``distill_top_k < 1``, ``jsd_beta`` outside
            [0, 1], ``distill_temperature <= 0`` or an unknown ``topk_support`` (before the model loads);
            ``distill_top_k`` larger than the vocabulary (after).
    """

    #: the divergence names this method accepts (a subclass narrows it).
    divergences: tuple[str, ...] = tuple(losses.DIVERGENCES)
    #: the self-teacher (set by the subclass).
    teacher: SelfTeacher

    def __init__(
        self,
        model: str = "tiny",
        *,
        divergence: str = "topk_reverse_kl",
        distill_top_k: int = 20,
        jsd_beta: float = 0.5,
        distill_temperature: float = 1.0,
        topk_support: str = "teacher",
        **kwargs: Any,
    ):
        if divergence not in self.divergences:
            choices = ", ".join(repr(d) for d in self.divergences)
            raise ValueError(f"divergence must be one of {choices}, got {divergence!r}; set model.init_args.divergence")
        if distill_top_k < 1:
            raise ValueError(f"distill_top_k must be >= 1, got {distill_top_k}; set model.init_args.distill_top_k")
        if topk_support not in ("student", "teacher"):
            raise ValueError(f"topk_support must be 'student' or 'teacher', got {topk_support!r}; set "
                             "model.init_args.topk_support to student (SDPO's implementation) or teacher (LOPD's)")
        if not 0.0 <= jsd_beta <= 1.0:
            raise ValueError(f"jsd_beta must be in [0, 1], got {jsd_beta}; set model.init_args.jsd_beta")
        if not distill_temperature > 0:  # NaN too
            raise ValueError(f"distill_temperature must be > 0, got {distill_temperature}; set "
                             "model.init_args.distill_temperature to a positive value (1.0: the raw distributions)")
        super().__init__(model, **kwargs)
        self.save_hyperparameters()
        if divergence == "topk_reverse_kl":
            self.check_top_k("distill_top_k", distill_top_k)

    # ------------------------------------------------------------------ the hooks of a method
    def teacher_contexts(self, batch: RolloutBatch) -> TeacherContexts:
        """Per row, the privileged text the teacher reads, and the rows kept in the loss.

        Raises:
            NotImplementedError: the subclass does not implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement teacher_contexts(batch)")

    def token_weights(self, batch: RolloutBatch, student_logits: Tensor, targets: Tensor) -> Tensor | None:
        """Per-token weights of the divergence on the kept rows' tokens (default None: no weights).

        Args:
            student_logits: (N_kept, V) the student's logits at the kept rows' loss tokens, row-major.
            targets: (N_kept,) long, the tokens those positions predict.

        Returns:
            (N_kept,) float weights (no gradient) or None.
        """
        return None

    def distillation_metrics(self, batch: RolloutBatch, contexts: TeacherContexts) -> dict[str, Tensor | float]:
        """The method's own ``train/...`` values of the step (default: none); all-reduce through
        :meth:`global_count` / :meth:`global_mean` so every rank logs the same values."""
        return {}

    def after_update(self) -> None:
        """Called after the student's update of every step (default: nothing; SDPO moves its EMA teacher)."""

    def context_ids(self, contexts: TeacherContexts) -> list[list[int]]:
        """B lists of token ids, the teacher's context of each row ([] for None): default ``contexts.texts``
        tokenised as they are (OPSD: through its :meth:`~lopd_lightning.modules.opsd.OPSDModule.teacher_context_ids`)."""
        return self.teacher.encode_text_context(contexts.texts, prefix="", suffix="")

    def divergence(self, student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
        """Per-token divergence (..., V) x 2 -> (...) of the ``divergence`` setting at ``distill_temperature``
        (:func:`lopd_lightning.losses.divergence` with ``distill_top_k``, ``jsd_beta``, ``topk_support``)."""
        hp = self.hparams
        return losses.divergence(
            hp.divergence,
            student_logits,
            teacher_logits,
            top_k=hp.distill_top_k,
            temperature=hp.distill_temperature,
            jsd_beta=hp.jsd_beta,
            support=hp.topk_support,
        )

    # ------------------------------------------------------------------ the step
    def teacher_logits(self, batch: RolloutBatch, contexts: TeacherContexts, kept_mask: Tensor) -> Tensor | None:
        """(N_kept, V) the teacher's logits at the kept rows' loss tokens with their contexts inserted, no
        gradient; None when no row is kept on this rank (and the strategy is not sharded)."""
        if not (bool(contexts.kept.any()) or self.sharded):  # sharded: every rank runs the pass
            return None
        return self.teacher.logits_on_student_positions(
            batch.input_ids,
            batch.attention_mask,
            batch.context_position,
            context_ids=self.context_ids(contexts),
            positions=self.unshift(kept_mask),
        ).detach()

    def distillation_loss(
        self, batch: RolloutBatch, student_logits: Tensor, teacher_logits: Tensor | None, kept: Tensor, num_tokens: float
    ) -> Tensor:
        """() the global token mean over the kept rows' tokens of ``weights * divergence``.

        Args:
            student_logits: (N, V) the student's logits at every loss token (row-major).
            teacher_logits: (N_kept, V) :meth:`teacher_logits`, or None (a zero loss that still reaches
                every parameter, for DDP).
            kept: (B,) bool, the kept rows. num_tokens: the denominator (:meth:`num_loss_tokens`).
        """
        if teacher_logits is None:
            return student_logits.sum() * 0.0
        targets, mask = self.shifted(batch)
        keep = kept[:, None].expand_as(mask)[mask]  # [N] bool, row-major like the packed logits
        student_kept = student_logits[keep]  # [N_kept, V]
        per_token = self.divergence(student_kept[None], teacher_logits[None])[0]  # [N_kept]
        weights = self.token_weights(batch, student_kept, targets[mask & kept[:, None]])
        if weights is not None:
            per_token = per_token * weights
        return per_token.sum() / num_tokens

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        _, mask = self.shifted(batch)  # [B, T-1]
        contexts = self.teacher_contexts(batch)
        if not isinstance(contexts, TeacherContexts):
            raise TypeError(f"{type(self).__name__}.teacher_contexts must return a TeacherContexts record, got "
                            f"{type(contexts).__name__}")
        kept_mask = mask & contexts.kept[:, None]  # [B, T-1]
        num_tokens = self.num_loss_tokens(batch, kept_mask)
        with self.timed("teacher"):
            teacher_logits = self.teacher_logits(batch, contexts, kept_mask)
        with self.timed("student_step"):
            student_logits = self.student_forward(batch, mask).values  # [N, V], every assistant token
            loss = self.distillation_loss(batch, student_logits, teacher_logits, contexts.kept, num_tokens)
            self.manual_backward(loss)
            norm = self.clip_and_step(optimizer, self.student_parameters(), self.hparams.grad_clip)
        self.after_update()
        loss_global = self.global_mean(loss)
        metrics = {"train/loss": loss_global}
        metrics.update(self.distillation_metrics(batch, contexts))
        metrics["train/grad_norm"] = norm
        self.log_rollout_metrics(batch, metrics)
        return loss.detach()

    def row_fraction(self, rows: Tensor | int, batch: RolloutBatch) -> float:
        """``rows`` (a count, or a (B,) bool) over all ranks / the batch's rows over all ranks."""
        count = rows.sum() if isinstance(rows, Tensor) else rows
        return self.global_count(count) / max(1, self.global_count(len(batch)))

