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

Steps 3-4 are the skeleton OPSD shares with SDPO
(:class:`~lopd_lightning.modules.self_distillation.SelfDistillationModule`); OPSD supplies the teacher's
context (:meth:`OPSDModule.teacher_contexts`) and no token weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor
from typing_extensions import override

from lopd_lightning.deprecation import fold_renamed
from lopd_lightning.modules.self_distillation import SelfDistillationModule, TeacherContexts
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


@dataclass(frozen=True)
class OPSDContexts(TeacherContexts):
    """OPSD's teacher contexts: :class:`~lopd_lightning.modules.self_distillation.TeacherContexts` plus the
    reference texts before framing.

    Attributes:
        references: B entries, :meth:`OPSDModule.reference_texts` (None: no reference); the teacher reads
            :meth:`OPSDModule.teacher_context_ids` of them.
    """

    references: list[str | None] | None = None


class OPSDModule(SelfDistillationModule):
    """OPSD: the student distilled towards the frozen initial model that sees the reference solution.

    Besides :class:`~lopd_lightning.modules.self_distillation.SelfDistillationModule`'s arguments, whose
    ``divergence``, ``distill_top_k``, ``jsd_beta`` and ``distill_temperature`` it takes (``--help`` lists both):

    Args:
        divergence: ``"jsd"`` (generalized JSD, full vocabulary, ``jsd_beta``; OPSD's scripts),
            ``"forward_kl"`` (full-vocabulary KL(T || S): the generalized JSD at beta 0; the LOPD
            paper's runs of OPSD) or ``"topk_reverse_kl"`` (top-k + tail KL(p~_S || p~_T)).
        jsd_beta: beta of :func:`~lopd_lightning.losses.generalized_jsd` for ``"jsd"`` (GKD convention:
            0 forward KL(T || S), 1 reverse KL(S || T)); 0.5 in OPSD's scripts.
        distill_top_k: k of ``"topk_reverse_kl"``.
        max_reference_chars: truncation of the reference text.
        distill_temperature: temperature of both distributions in the divergence (1.0).
        rollouts_per_example: deprecated spelling of ``group_size`` (removed in the release after next;
            a FutureWarning; the two names with different values are an error).
        top_k_distill: deprecated spelling of ``distill_top_k`` (likewise).

    ``group_size`` defaults to 1 (OPSD needs no groups).

    Raises:
        ValueError: an unknown divergence, ``jsd_beta`` outside [0, 1], ``distill_top_k < 1`` (before the
            model is loaded).

    Logged (besides the shared tags): ``train/loss``, ``train/distill``, ``train/rows_with_reference``,
    ``train/grad_norm``; ``time/teacher``, ``time/student_step``.

    Source: Zhao et al. 2026 (OPSD); docs/METHOD.md section 6.
    """

    divergences = ("jsd", "forward_kl", "topk_reverse_kl")
    RENAMED_ARGUMENTS: ClassVar[dict[str, str]] = {"rollouts_per_example": "group_size", "top_k_distill": "distill_top_k"}

    def __init__(
        self,
        model: str = "tiny",
        *,
        group_size: int = 1,
        divergence: OPSDDivergence = "jsd",
        jsd_beta: float = 0.5,
        distill_top_k: int = 20,
        max_reference_chars: int = 4000,
        distill_temperature: float = 1.0,
        rollouts_per_example: int | None = None,
        top_k_distill: int | None = None,
        **kwargs: Any,
    ):
        name = type(self).__name__
        group_size = fold_renamed(name, "rollouts_per_example", rollouts_per_example, "group_size", group_size, 1)
        distill_top_k = fold_renamed(name, "top_k_distill", top_k_distill, "distill_top_k", distill_top_k, 20)
        super().__init__(
            model, group_size=group_size, divergence=divergence, jsd_beta=jsd_beta, distill_top_k=distill_top_k,
            distill_temperature=distill_temperature, **kwargs,
        )
        self.save_hyperparameters()
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
        """Token ids of ``OPSD_REFERENCE_TEMPLATE`` per row ([] for None): what the teacher reads for the
        reference texts ``texts`` (:meth:`reference_texts`). Override it to change what the teacher reads;
        :meth:`context_ids` calls it."""
        return self.teacher.encode_text_context(self.framed(texts), prefix="", suffix="")

    @staticmethod
    def framed(texts: list[str | None]) -> list[str | None]:
        """Each reference text in ``OPSD_REFERENCE_TEMPLATE`` (None stays None)."""
        return [OPSD_REFERENCE_TEMPLATE.format(reference=t) if t is not None else None for t in texts]

    @override
    def teacher_contexts(self, batch: RolloutBatch) -> OPSDContexts:
        """Per row, :meth:`reference_texts` (``references``) and them framed in ``OPSD_REFERENCE_TEMPLATE``
        (``texts``); the rows with a reference are kept (the others get no context)."""
        texts = self.reference_texts(batch)
        kept = torch.tensor([t is not None for t in texts], dtype=torch.bool, device=batch.input_ids.device)
        return OPSDContexts(texts=self.framed(texts), kept=kept, references=texts)

    @override
    def context_ids(self, contexts: TeacherContexts) -> list[list[int]]:
        """:meth:`teacher_context_ids` of the reference texts (contexts of another kind: the base's)."""
        if isinstance(contexts, OPSDContexts) and contexts.references is not None:
            return self.teacher_context_ids(contexts.references)
        return super().context_ids(contexts)

    @override
    def distillation_metrics(self, batch: RolloutBatch, contexts: TeacherContexts) -> dict[str, Tensor | float]:
        """``train/rows_with_reference``: the fraction of the rows (all ranks) with a reference."""
        return {"train/rows_with_reference": self.row_fraction(contexts.kept, batch)}
