"""OPSDModule: On-Policy Self-Distillation with a reference solution (Zhao et al. 2026, docs/METHOD.md section 6).

The teacher is the *frozen* initial model (``SelfTeacher`` mode ``"base"``) that reads the problem plus
the task's ground-truth reference solution; the student reads only the problem. The student is
distilled towards that teacher on its own rollouts with the generalized JSD (beta 0.5 in OPSD's
scripts) or the full-vocabulary forward KL (as the LOPD paper ran it).

One training step (manual optimisation, one optimiser):

1. the DataModule's batch: the student's rollouts (one per example by default);
2. :meth:`OPSDModule.reference_texts`: per row, the reference solution of its example, looked up through
   the DataModule (``datamodule.example(id)``, ``datamodule.task``);
3. the frozen teacher scores the student's assistant tokens with ``OPSD_REFERENCE_TEMPLATE`` at the start
   of the first user message;
4. student step: global token mean of D(teacher, student) over the rows that have a reference (rows
   without one get no context and are dropped from the loss).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from torch import Tensor
from typing_extensions import override

from lopd_lightning.losses import generalized_jsd, topk_tail_reverse_kl
from lopd_lightning.modules.base import OnPolicyModule
from lopd_lightning.rollout import RolloutBatch
from lopd_lightning.tasks import Example, Task
from lopd_lightning.teacher import SelfTeacher

log = logging.getLogger(__name__)

OPSDDivergence = Literal["jsd", "forward_kl", "topk_reverse_kl"]

#: The teacher's privileged text (``{reference}``: :meth:`OPSDModule.reference_text`), before the task.
OPSD_REFERENCE_TEMPLATE = (
    "Here is a reference solution to this task:\n{reference}\n\n"
    "After understanding the reference solution, solve the task yourself.\n\n"
)


class OPSDModule(OnPolicyModule):
    """OPSD: the student distilled towards the frozen initial model that sees the reference solution.

    Args (besides :class:`~lopd_lightning.modules.base.OnPolicyModule`'s):
        divergence: ``"jsd"`` (generalized JSD, full vocabulary, ``jsd_beta``; OPSD's scripts),
            ``"forward_kl"`` (full-vocabulary KL(T || S): the generalized JSD at beta 0; the LOPD
            paper's runs of OPSD) or ``"topk_reverse_kl"`` (top-k + tail KL(p~_S || p~_T)).
        jsd_beta: beta of :func:`~lopd_lightning.losses.generalized_jsd` for ``"jsd"`` (GKD convention:
            0 forward KL(T || S), 1 reverse KL(S || T)); 0.5 in OPSD's scripts.
        top_k_distill: k of ``"topk_reverse_kl"``.
        max_reference_chars: truncation of the reference text.
        distill_temperature: temperature of both distributions in the divergence (1.0).

    ``rollouts_per_example`` defaults to 1 (OPSD needs no groups).

    Raises:
        ValueError: an unknown divergence, ``jsd_beta`` outside [0, 1], ``top_k_distill < 1`` (before the
            model is loaded).

    Source: Zhao et al. 2026 (OPSD); docs/METHOD.md section 6.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        rollouts_per_example: int = 1,
        divergence: OPSDDivergence = "jsd",
        jsd_beta: float = 0.5,
        top_k_distill: int = 20,
        max_reference_chars: int = 4000,
        distill_temperature: float = 1.0,
        **kwargs: Any,
    ):
        if divergence not in ("jsd", "forward_kl", "topk_reverse_kl"):
            raise ValueError(f"divergence must be 'jsd', 'forward_kl' or 'topk_reverse_kl', got {divergence!r}")
        if not 0.0 <= jsd_beta <= 1.0:
            raise ValueError(f"jsd_beta must be in [0, 1], got {jsd_beta}")
        if top_k_distill < 1:
            raise ValueError(f"top_k_distill must be >= 1, got {top_k_distill}")
        if distill_temperature <= 0:
            raise ValueError(f"distill_temperature must be > 0, got {distill_temperature}")
        super().__init__(model, rollouts_per_example=rollouts_per_example, **kwargs)
        self.save_hyperparameters()
        if divergence == "topk_reverse_kl":
            self.check_top_k("top_k_distill", top_k_distill)
        self.teacher = SelfTeacher(self.backbone, self.tokenizer, mode="base")

    # ------------------------------------------------------------------ the teacher's context
    def reference_text(self, task: Task, example: Example) -> str | None:
        """The ground truth of ``example``: ``task.reference_solution``, else its reference replies joined
        by blank lines; None when the task has none (empty, or not implemented). Truncated to
        ``max_reference_chars``.
        """
        try:
            text = task.reference_solution(example) or ""
        except NotImplementedError:
            text = ""
        if not text.strip():
            try:
                text = "\n\n".join(r for r in task.reference_replies(example) if r)
            except NotImplementedError:
                text = ""
        return text[: self.hparams.max_reference_chars] if text.strip() else None

    def reference_texts(self, batch: RolloutBatch) -> list[str | None]:
        """Per row, :meth:`reference_text` of its example, found through the DataModule by ``example_ids``
        (an id the DataModule does not know gives None)."""
        dm = self.trainer.datamodule
        out: list[str | None] = []
        for example_id in batch.example_ids:
            try:
                example = dm.example(example_id)
            except KeyError:
                out.append(None)
                continue
            out.append(self.reference_text(dm.task, example))
        return out

    def teacher_context_ids(self, texts: list[str | None]) -> list[list[int]]:
        """Token ids of ``OPSD_REFERENCE_TEMPLATE`` per row ([] for None)."""
        framed = [OPSD_REFERENCE_TEMPLATE.format(reference=t) if t is not None else None for t in texts]
        return self.teacher.encode_text_context(framed, prefix="", suffix="")

    # ------------------------------------------------------------------ the loss
    def divergence(self, student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
        """Per-token divergence (..., V) x 2 -> (...) of ``divergence`` at ``distill_temperature``."""
        hp = self.hparams
        tau = hp.distill_temperature
        if hp.divergence == "jsd":
            return generalized_jsd(student_logits, teacher_logits, beta=hp.jsd_beta, temperature=tau)
        if hp.divergence == "forward_kl":
            return generalized_jsd(student_logits, teacher_logits, beta=0.0, temperature=tau)
        return topk_tail_reverse_kl(student_logits, teacher_logits, k=hp.top_k_distill, temperature=tau)

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        hp = self.hparams
        _, mask = self.shifted(batch)  # [B, T-1]
        texts = self.reference_texts(batch)
        kept = torch.tensor([t is not None for t in texts], dtype=torch.bool, device=mask.device)  # [B]
        kept_mask = mask & kept[:, None]
        num_tokens = self.num_loss_tokens(batch, kept_mask)

        with self.timed("teacher"):
            teacher_logits = None
            if bool(kept.any()) or self.sharded:  # sharded: every rank runs the pass
                teacher_logits = self.teacher.logits_on_student_positions(
                    batch.input_ids,
                    batch.attention_mask,
                    batch.context_position,
                    context_ids=self.teacher_context_ids(texts),
                    positions=self.unshift(kept_mask),
                ).detach()  # [N_kept, V]

        with self.timed("student_step"):
            student_logits = self.student_logits(batch, mask)  # [N, V]
            if teacher_logits is not None:
                keep = kept[:, None].expand_as(mask)[mask]  # [N] bool
                per_token = self.divergence(student_logits[keep][None], teacher_logits[None])[0]  # [N_kept]
                loss = per_token.sum() / num_tokens
            else:  # no row with a reference here: a zero loss that still reaches every parameter (DDP)
                loss = student_logits.sum() * 0.0
            self.manual_backward(loss)
            norm = self.clip_and_step(optimizer, self.student_parameters(), hp.grad_clip)

        loss_global = self.global_mean(loss)
        self.log_rollout_metrics(
            batch,
            {
                "train/loss": loss_global,
                "train/distill": loss_global,
                "train/rows_with_reference": self.global_count(kept.sum()) / max(1, self.global_count(len(batch))),
                "train/grad_norm": norm,
            },
        )
        return loss.detach()
