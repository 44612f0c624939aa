"""SDPOModule: Self-Distillation Policy Optimisation (Hubotter et al. 2026, docs/METHOD.md section 6).

"Reinforcement Learning via Self-Distillation": the student samples G > 1 rollouts per example; the
teacher is an exponential moving average (rate 0.05) of the student, *reprompted* with a successful
sibling rollout of the same example (and, optionally, the environment's feedback on the row's own
attempt). The student is distilled towards that teacher on its own tokens.

One training step (manual optimisation, one optimiser):

1. the DataModule's batch: G = ``group_size`` rollouts per example, contiguous groups (``batch.group_ids``);
2. :meth:`SDPOModule.teacher_contexts`: per row, the text of a successful sibling (reward >=
   ``success_threshold``, never the row itself unless ``allow_self_demo``), chosen deterministically
   (the first success of the group in batch order, other than the row), plus the row's feedback;
3. the EMA teacher scores the student's assistant tokens with that text at the start of the first user
   message (:meth:`~lopd_lightning.teacher.SelfTeacher.logits_on_student_positions`, ``context_ids``);
4. student step: global token mean, over the *kept* rows' assistant tokens, of
   ``w * D(student || teacher)`` with D the top-k + tail reverse KL (or the generalized JSD) and w the
   clipped importance ratio; rows without a demonstration are dropped (their teacher saw nothing
   privileged, so it would only pull the student towards the lagging EMA of itself);
5. the EMA teacher moves towards the updated student: ``ema <- 0.95 ema + 0.05 student``.

Steps 3-4 are the skeleton SDPO shares with OPSD
(:class:`~lopd_lightning.modules.self_distillation.SelfDistillationModule`); SDPO supplies the teacher's
context (:meth:`SDPOModule.teacher_contexts`), the importance weight (:meth:`SDPOModule.token_weights`)
and the EMA update (:meth:`SDPOModule.after_update`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from typing_extensions import override

from lopd_lightning.losses import token_logps
from lopd_lightning.modules.self_distillation import SelfDistillationModule, TeacherContexts
from lopd_lightning.rollout import RolloutBatch
from lopd_lightning.tasks import Message
from lopd_lightning.teacher import SelfTeacher

log = logging.getLogger(__name__)

SDPODivergence = Literal["topk_reverse_kl", "jsd"]

#: The teacher's privileged text: a successful sibling's attempt (``{demo}``: :meth:`SDPOModule.demo_text`).
SDPO_DEMO_TEMPLATE = "A correct solution to this task from an earlier attempt:\n{demo}\n\n"
#: The environment's feedback on the row's own attempt (``{feedback}``: :meth:`SDPOModule.feedback_text`).
SDPO_FEEDBACK_TEMPLATE = "Feedback from the environment on your earlier attempt:\n{feedback}\n\n"
#: After the privileged text, before the task itself (the first user message's content).
SDPO_CONTEXT_SUFFIX = "Now solve the task yourself.\n\n"


def successful_sibling(
    rewards: Tensor, group_ids: Tensor, *, success_threshold: float, allow_self: bool = False
) -> list[int | None]:
    """Per row, the index of the successful rollout of the same group that demonstrates the task.

    Deterministic: the first row of the group in batch order with ``reward >= success_threshold``,
    other than the row itself. A row that is its group's only success gets itself when ``allow_self``,
    else None (no demonstration). Failing rows never serve as demonstrations.

    Args:
        rewards: (B,) float, trajectory rewards.
        group_ids: (B,) long, rows of the same example share an id.
        success_threshold: a reward >= this is a success.
        allow_self: let a row that is its group's only success demonstrate to itself.

    Returns:
        B entries: a row index in [0, B) or None.

    Source: SDPO (Hubotter et al. 2026): the teacher is reprompted with a successful sibling.
    """
    rewards, groups = rewards.detach().cpu().tolist(), group_ids.detach().cpu().tolist()
    successes: dict[int, list[int]] = {}
    for i, (r, g) in enumerate(zip(rewards, groups, strict=True)):
        if r >= success_threshold:
            successes.setdefault(g, []).append(i)
    out: list[int | None] = []
    for i, g in enumerate(groups):
        others = [j for j in successes.get(g, []) if j != i]
        if others:
            out.append(others[0])
        elif allow_self and i in successes.get(g, []):
            out.append(i)
        else:
            out.append(None)
    return out


@dataclass(frozen=True)
class SDPOContexts(TeacherContexts):
    """SDPO's teacher contexts: :class:`~lopd_lightning.modules.self_distillation.TeacherContexts` plus
    which rows have a demonstration.

    Attributes:
        has_demo: (B,) bool on the batch's device, rows with a successful sibling in their context.
    """

    has_demo: Tensor | None = None


class SDPOModule(SelfDistillationModule):
    """SDPO: the student distilled towards its EMA teacher reprompted with a successful sibling.

    Besides :class:`~lopd_lightning.modules.self_distillation.SelfDistillationModule`'s arguments, whose
    ``divergence``, ``distill_top_k``, ``jsd_beta``, ``distill_temperature`` and ``topk_support`` it takes
    (``--help`` lists both):

    Args:
        group_size: G, rollouts per example (a group), >= 2 (SDPO needs siblings); default 4.
        teacher_ema_rate: EMA rate of the teacher, ``ema <- (1 - r) ema + r student`` after each
            student step (SDPO: 0.05).
        divergence: ``"topk_reverse_kl"`` (KL(p~_S || p~_T) on a top-k + a tail bucket; SDPO's default)
            or ``"jsd"`` (the generalized JSD with ``jsd_beta``, full vocabulary).
        distill_top_k: k of ``"topk_reverse_kl"`` (SDPO: 20).
        topk_support: whose top-k is the support of ``"topk_reverse_kl"``: ``"student"`` (SDPO's
            implementation, default) or ``"teacher"`` (LOPD's).
        jsd_beta: beta of :func:`~lopd_lightning.losses.generalized_jsd` for ``"jsd"`` (GKD convention:
            0 forward KL(T || S), 1 reverse KL(S || T)); SDPO's code calls it alpha.
        is_clip: clip of the per-token importance weight ``min(pi_S / pi_old, is_clip)`` (detached);
            None disables the weight. ``pi_old`` is :meth:`behaviour_logps`: the current student's
            log-probs at ``distill_temperature``, detached. With one update per batch (this module),
            pi_old = pi_S and the weight is exactly 1 (for ``is_clip >= 1``); it matters only for an
            override of :meth:`behaviour_logps`. ``batch.sampling_logps`` is not used: it is taken at the
            sampling temperature, not the distillation temperature.
        allow_self_demo: a row that is its group's only success is reprompted with its own rollout
            (default False: it gets no demonstration and is dropped from the loss).
        include_feedback: add the environment's feedback on the row's own attempt (its observations
            after the first reply and ``metadata["errors"]``) to the teacher's context.
        feedback_without_demo: keep rows with feedback but no demonstration (feedback-only context).
            Default False: rows without a successful sibling are dropped, whatever their feedback.
        max_demo_chars, max_feedback_chars: truncation of the demonstration and the feedback text.
        distill_temperature: temperature of both distributions in the divergence (1.0).

    Raises:
        ValueError: ``group_size < 2``, an unknown divergence, ``distill_top_k < 1``, ``jsd_beta``
            outside [0, 1] or ``is_clip <= 0`` (before the model is loaded).

    Logged (besides the shared tags): ``train/loss``, ``train/rows_with_demo``,
    ``train/rows_kept``, ``train/groups_without_success``, ``train/grad_norm``; ``time/teacher``,
    ``time/student_step``.

    Source: Hubotter et al. 2026, "Reinforcement Learning via Self-Distillation"; docs/METHOD.md section 6.
    """

    divergences = ("topk_reverse_kl", "jsd")

    def __init__(
        self,
        model: str = "tiny",
        *,
        group_size: int = 4,
        teacher_ema_rate: float = 0.05,
        divergence: SDPODivergence = "topk_reverse_kl",
        distill_top_k: int = 20,
        topk_support: str = "student",
        jsd_beta: float = 0.5,
        is_clip: float | None = 2.0,
        allow_self_demo: bool = False,
        include_feedback: bool = True,
        feedback_without_demo: bool = False,
        max_demo_chars: int = 4000,
        max_feedback_chars: int = 1000,
        distill_temperature: float = 1.0,
        **kwargs: Any,
    ):
        # checks that need no model run before the student is loaded (the divergence's: the base's)
        if group_size < 2:
            raise ValueError(
                f"SDPO needs sibling rollouts: group_size must be >= 2, got {group_size}; "
                f"set model.init_args.group_size to 2 or more (SDPO default: 4)"
            )
        if is_clip is not None and is_clip <= 0:
            raise ValueError(f"is_clip must be > 0 or None, got {is_clip}")
        super().__init__(
            model, group_size=group_size, divergence=divergence, distill_top_k=distill_top_k, topk_support=topk_support,
            jsd_beta=jsd_beta, distill_temperature=distill_temperature, **kwargs,
        )
        self.save_hyperparameters()
        self.teacher = SelfTeacher(self.backbone, self.tokenizer, mode="ema", ema_rate=teacher_ema_rate)

    # ------------------------------------------------------------------ the teacher's context
    def demo_text(self, messages: list[Message]) -> str:
        """The demonstration a successful sibling gives: its conversation from its first reply on.

        Single-turn: the reply itself. Multi-turn: ``[action] reply`` / ``[result] observation`` lines.
        Truncated to ``max_demo_chars``.
        """
        start = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        rest = messages[start:]
        if len(rest) == 1:
            text = str(rest[0].get("content") or "")
        else:
            lines = []
            for m in rest:
                content = str(m.get("content") or "")
                lines.append(f"[action] {content}" if m.get("role") == "assistant" else f"[result] {content}")
            text = "\n".join(lines)
        return text[: self.hparams.max_demo_chars]

    def feedback_text(self, messages: list[Message], metadata: dict[str, Any]) -> str:
        """The environment's feedback on a row's own attempt ("" when none).

        The observations after the first reply (tool results, further user turns) and the episode's
        ``metadata["errors"]`` (e.g. failed tool calls or tests), one per line, truncated to
        ``max_feedback_chars``.
        """
        start = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        lines = [str(m.get("content") or "") for m in messages[start:] if m.get("role") != "assistant"]
        lines += [f"error: {e}" for e in metadata.get("errors", []) or []]
        return "\n".join(line for line in lines if line)[: self.hparams.max_feedback_chars]

    @override
    def teacher_contexts(self, batch: RolloutBatch) -> SDPOContexts:
        """Each row's privileged text for the teacher, and which rows have a demonstration / are kept.

        Row i's text is ``SDPO_DEMO_TEMPLATE`` with :func:`successful_sibling`'s rollout, then (with
        ``include_feedback`` and some feedback) ``SDPO_FEEDBACK_TEMPLATE``, then ``SDPO_CONTEXT_SUFFIX``.
        Rows without a demonstration get None (no context), unless ``feedback_without_demo`` and they
        have feedback.

        Returns:
            :class:`SDPOContexts`: ``texts`` (B entries, str or None), ``kept`` ((B,) bool, the rows in the
            loss) and ``has_demo`` ((B,) bool), tensors on the batch's device.
        """
        hp = self.hparams
        siblings = successful_sibling(
            batch.rewards, batch.group_ids, success_threshold=hp.success_threshold, allow_self=hp.allow_self_demo
        )
        texts: list[str | None] = []
        for i, sibling in enumerate(siblings):
            parts = []
            if sibling is not None:
                parts.append(SDPO_DEMO_TEMPLATE.format(demo=self.demo_text(batch.messages[sibling])))
            if hp.include_feedback and (sibling is not None or hp.feedback_without_demo):
                feedback = self.feedback_text(batch.messages[i], batch.metadata[i])
                if feedback:
                    parts.append(SDPO_FEEDBACK_TEMPLATE.format(feedback=feedback))
            texts.append("".join(parts) + SDPO_CONTEXT_SUFFIX if parts else None)
        device = batch.input_ids.device
        has_demo = torch.tensor([s is not None for s in siblings], dtype=torch.bool, device=device)
        kept = torch.tensor([t is not None for t in texts], dtype=torch.bool, device=device)
        return SDPOContexts(texts=texts, kept=kept, has_demo=has_demo)

    # ------------------------------------------------------------------ the loss
    def behaviour_logps(self, batch: RolloutBatch, current_logps: Tensor) -> Tensor:
        """log pi_old of the kept tokens, (N,) packed like ``current_logps``: the current student, detached.

        Override to use the sampling pass's log-probs (then the importance weight is not 1).
        """
        return current_logps.detach()

    @override
    def token_weights(self, batch: RolloutBatch, student_logits: Tensor, targets: Tensor) -> Tensor | None:
        """The clipped importance ratio ``min(pi_S / pi_old, is_clip)`` per kept token, detached (None when
        ``is_clip`` is None); log-probs at ``distill_temperature``, pi_old from :meth:`behaviour_logps`."""
        hp = self.hparams
        if hp.is_clip is None:
            return None
        logps = token_logps(student_logits[None], targets[None], temperature=hp.distill_temperature)[0]
        return (logps - self.behaviour_logps(batch, logps)).exp().clamp(max=hp.is_clip).detach()

    @override
    def after_update(self) -> None:
        """The EMA teacher moves towards the updated student."""
        self.teacher.update_ema()

    @override
    def distillation_metrics(self, batch: RolloutBatch, contexts: SDPOContexts) -> dict[str, Tensor | float]:
        """``train/rows_with_demo``, ``train/rows_kept`` (fractions of the rows, all ranks) and
        ``train/groups_without_success`` (fraction of the groups without a success)."""
        groups = batch.group_ids.unique()
        success = batch.rewards >= self.hparams.success_threshold
        no_success = sum(1 for g in groups.tolist() if not bool(success[batch.group_ids == g].any()))
        return {
            "train/rows_with_demo": self.row_fraction(contexts.has_demo, batch),
            "train/rows_kept": self.row_fraction(contexts.kept, batch),
            "train/groups_without_success": self.global_count(no_success) / max(1, self.global_count(len(groups))),
        }
