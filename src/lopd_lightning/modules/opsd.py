"""OPSDModule: On-Policy Self-Distillation with a reference solution (Zhao et al. 2026, docs/METHOD.md section 6).

The teacher is the *frozen* initial model (``SelfTeacher`` mode ``"base"``) that reads the problem plus
the task's ground-truth reference solution; the student reads only the problem. The student is
distilled towards that teacher on its own rollouts with the generalized JSD (beta 0.5 in OPSD's
scripts) or the full-vocabulary forward KL (as the LOPD paper ran it).

One training step (manual optimisation, one optimiser):

1. the DataModule's batch: the student's rollouts (one per example by default);
2. :meth:`OPSDModule.reference_texts`: per row, the reference solution of its example, looked up through
   the DataModule (``datamodule.example(id)``, ``datamodule.task``); with ``privileged_context: retrieved``
   instead :meth:`OPSDModule.retrieved_texts`: the trace of the nearest experience of a bank (retrieved like
   LOPD's, top-1, when the rollouts are made);
3. the frozen teacher scores the student's assistant tokens with ``OPSD_REFERENCE_TEMPLATE`` (a retrieved
   trace: framed as every text context, ``DEFAULT_FRAMING_PREFIX`` + trace + ``DEFAULT_FRAMING_SUFFIX``,
   :meth:`~lopd_lightning.teacher.SelfTeacher.frame_text_context`; the strings LOPD's latents sit between)
   at the start of the first user message;
4. student step: global token mean of D(teacher, student) over the rows that have a context (rows
   without a reference, or that retrieved nothing, get no context and are dropped from the loss).

Steps 3-4 are the skeleton OPSD shares with SDPO
(:class:`~lopd_lightning.modules.self_distillation.SelfDistillationModule`); OPSD supplies the teacher's
context (:meth:`OPSDModule.teacher_contexts`) and no token weights.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from typing_extensions import override

from lopd_lightning.hints import choose_one_of
from lopd_lightning.memory.experience import Experience
from lopd_lightning.memory.module_bank import build_bank, check_embedder, retrieve_from
from lopd_lightning.modules.self_distillation import SelfDistillationModule, TeacherContexts
from lopd_lightning.rollout import RolloutBatch
from lopd_lightning.tasks import Example, Task
from lopd_lightning.teacher import SelfTeacher, resolve_framing

log = logging.getLogger(__name__)

OPSDDivergence = Literal["jsd", "forward_kl", "topk_reverse_kl"]
#: where the teacher's privileged text comes from (``privileged_context``).
PRIVILEGED_CONTEXTS = ("reference", "retrieved")

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
            :meth:`OPSDModule.teacher_context_ids` of them. None with ``privileged_context: retrieved`` (the
            teacher reads ``texts``, the framed traces).
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
        max_reference_chars: truncation of the reference text (not of a retrieved trace).
        distill_temperature: temperature of both distributions in the divergence (1.0).
        privileged_context: what the teacher reads: ``"reference"`` (the default: the task's reference
            solution, OPSD's) or ``"retrieved"`` (this project's switch for the experience-evidence
            comparison: the trace of the single nearest experience of the bank at ``bank_path``, retrieved as
            LOPD retrieves (top-1, same embedder, other tasks only unless ``allow_self_retrieval``), framed
            as every text context (:meth:`~lopd_lightning.teacher.SelfTeacher.frame_text_context`, as
            benchmarks/privileged_margin.py frames ``text_nearest``; the strings LOPD's latents sit between):
            ``DEFAULT_FRAMING_PREFIX`` + trace + ``DEFAULT_FRAMING_SUFFIX`` of :mod:`lopd_lightning.teacher.splice`,
            tokenised together; not truncated). A row that retrieves nothing gets no context.
        bank_path: folder of a saved ExperienceBank (``lopd build-memory``), read with ``privileged_context:
            retrieved`` (which needs it; ignored otherwise).
        embedder: the retrieval's embedder, as LOPD's: "minilm" (all-MiniLM-L6-v2, default), "backbone" or
            "hashing".
        allow_self_retrieval: let a task retrieve its own records (default False: its own solution would be
            the reference again).
        context_framing: the text around the teacher's context, as LOPD's option of that name (a name of
            :data:`~lopd_lightning.teacher.splice.FRAMINGS` or ``{prefix: ..., suffix: ...}``). None (the
            default): a retrieved trace in the ``short`` framing and a reference in ``OPSD_REFERENCE_TEMPLATE``
            (OPSD's). Set, both kinds of context are framed by it, so OPSD can read its text between the same
            strings as an LOPD run's latents (``configs/experience/opsd_reference.yaml`` and ``lopd_paper.yaml``:
            ``from_scratch``).

    ``group_size`` defaults to 1 (OPSD needs no groups).

    Raises:
        ValueError: an unknown divergence, ``jsd_beta`` outside [0, 1], ``distill_top_k < 1``, an unknown
            ``privileged_context`` or ``embedder``, ``privileged_context: retrieved`` without ``bank_path``, an
            empty bank (before the model is loaded).
        FileNotFoundError: ``bank_path`` holds no bank (before the model is loaded).

    Logged (besides the shared tags): ``train/loss``, ``train/rows_with_reference`` (the
    fraction of rows with a context: a reference, or a retrieved trace), ``train/grad_norm``;
    ``time/teacher``, ``time/student_step``.

    Source: Zhao et al. 2026 (OPSD); docs/METHOD.md section 6.
    """

    divergences = ("jsd", "forward_kl", "topk_reverse_kl")

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
        privileged_context: str = "reference",
        bank_path: str | None = None,
        embedder: str = "minilm",
        allow_self_retrieval: bool = False,
        context_framing: str | dict[str, str] | None = None,
        **kwargs: Any,
    ):
        check_privileged_context(privileged_context, bank_path, embedder)  # before the weights load
        framing = resolve_framing(context_framing)  # None: "short" (the retrieved traces'; references keep the template)
        super().__init__(
            model, group_size=group_size, divergence=divergence, jsd_beta=jsd_beta, distill_top_k=distill_top_k,
            distill_temperature=distill_temperature, **kwargs,
        )
        self.save_hyperparameters()
        self.teacher = SelfTeacher(self.backbone, self.tokenizer, mode="base", framing_prefix=framing[0],
                                   framing_suffix=framing[1])
        #: the bank the teacher's context is retrieved from (``privileged_context: retrieved``; else None).
        self.bank = None if privileged_context != "retrieved" else build_bank(
            bank_path, embedder, num_experiences=0, allow_self_retrieval=allow_self_retrieval, model=self.backbone,
            tokenizer=self.tokenizer,
        )

    # ------------------------------------------------------------------ the teacher's context
    @override
    def retrieve(self, task: Task, examples: list[Example]) -> list[list[Experience]] | None:
        """With a bank (``privileged_context: retrieved``), the nearest experience per example (none when no
        record of another task is there): :func:`~lopd_lightning.memory.module_bank.retrieve_from` with k = 1, as
        LOPD retrieves with J = 1; None without one (the batch gets no experiences)."""
        if self.bank is None:
            return None
        return retrieve_from(self.bank, examples, 1).experiences

    def retrieved_texts(self, batch: RolloutBatch) -> list[str | None]:
        """Per row, the trace of its nearest retrieved experience (``batch.experiences``; None: none)."""
        experiences = batch.experiences or [[] for _ in range(len(batch))]
        return [exps[0].trace if exps and exps[0].trace else None for exps in experiences]

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
        (``texts``); with ``privileged_context: retrieved``, :meth:`retrieved_texts` in the teacher's framing
        (``texts``: :meth:`~lopd_lightning.teacher.SelfTeacher.frame_text_context`; ``references`` None), and so
        are the reference texts when ``context_framing`` is set. The rows with a context are kept (the others get none)."""
        retrieved = self.hparams.privileged_context == "retrieved"
        texts = self.retrieved_texts(batch) if retrieved else self.reference_texts(batch)
        kept = torch.tensor([t is not None for t in texts], dtype=torch.bool, device=batch.input_ids.device)
        if retrieved or self.hparams.get("context_framing") is not None:  # the teacher's framing, not the template
            return OPSDContexts(texts=self.teacher.frame_text_context(texts), kept=kept)
        return OPSDContexts(texts=self.framed(texts), kept=kept, references=texts)

    @override
    def context_ids(self, contexts: TeacherContexts) -> list[list[int]]:
        """:meth:`teacher_context_ids` of the reference texts (contexts of another kind: the base's)."""
        if isinstance(contexts, OPSDContexts) and contexts.references is not None:
            return self.teacher_context_ids(contexts.references)
        return super().context_ids(contexts)

    @override
    def distillation_metrics(self, batch: RolloutBatch, contexts: TeacherContexts) -> dict[str, Tensor | float]:
        """``train/rows_with_reference``: the fraction of the rows (all ranks) with a context (a reference, or a
        retrieved trace)."""
        return {"train/rows_with_reference": self.row_fraction(contexts.kept, batch)}


def check_privileged_context(privileged_context: str, bank_path: str | None, embedder: str) -> None:
    """Refuse, in one line naming the config key, an unknown ``privileged_context`` or ``embedder`` and, for
    ``"retrieved"``, no ``bank_path`` or a bank that is missing or empty (its ``meta.json``; no model needed).

    Raises:
        ValueError: as above. FileNotFoundError: ``bank_path`` holds no bank.
    """
    if privileged_context not in PRIVILEGED_CONTEXTS:
        raise ValueError(f"model.init_args.privileged_context {privileged_context!r} is not a context; "
                         f"{choose_one_of(privileged_context, PRIVILEGED_CONTEXTS)}")
    check_embedder(embedder)  # checked whatever the context: a misspelt name is a mistake either way
    if privileged_context != "retrieved":
        return
    build = "build one with `lopd build-memory -c CONFIG --from-references` and set model.init_args.bank_path to its folder"
    if not bank_path:
        raise ValueError(f"model.init_args.privileged_context 'retrieved' needs a bank to retrieve from and "
                         f"model.init_args.bank_path is null; {build}")
    meta = Path(bank_path) / "meta.json"
    if not meta.exists():
        raise FileNotFoundError(f"model.init_args.bank_path {bank_path!r} holds no experience bank "
                                f"(privileged_context: retrieved reads it); {build}")
    if json.loads(meta.read_text(encoding="utf-8")).get("size") == 0:
        raise ValueError(f"the bank at model.init_args.bank_path {bank_path!r} is empty, so no row would get a "
                         f"context (privileged_context: retrieved); {build}")
