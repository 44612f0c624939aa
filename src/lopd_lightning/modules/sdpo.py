"""SDPOModule: Self-Distillation Policy Optimisation (Hubotter et al. 2026, docs/METHOD.md section 6).

"Reinforcement Learning via Self-Distillation": the student samples G > 1 rollouts per example; the
teacher is an exponential moving average (rate 0.05) of the student, *reprompted* with a successful
sibling rollout of the same example (and, optionally, the environment's feedback on the row's own
attempt). The student is distilled towards that teacher on its own tokens.

One training step (manual optimisation, one optimiser):

1. the DataModule's batch: G rollouts per example, contiguous groups (``batch.group_ids``);
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
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from torch import Tensor
from typing_extensions import override

from lopd_lightning.losses import generalized_jsd, token_logps, topk_tail_reverse_kl
from lopd_lightning.modules.base import OnPolicyModule
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


class SDPOModule(OnPolicyModule):
    """SDPO: the student distilled towards its EMA teacher reprompted with a successful sibling.

    Args (besides :class:`~lopd_lightning.modules.base.OnPolicyModule`'s):
        rollouts_per_example: G, rollouts per example (a group), >= 2 (SDPO needs siblings); default 4.
        teacher_ema_rate: EMA rate of the teacher, ``ema <- (1 - r) ema + r student`` after each
            student step (SDPO: 0.05).
        divergence: ``"topk_reverse_kl"`` (KL(p~_S || p~_T) on the teacher's top-k + a tail bucket;
            SDPO's default) or ``"jsd"`` (the generalized JSD with ``jsd_alpha``, full vocabulary).
        top_k_distill: k of ``"topk_reverse_kl"`` (SDPO: 20).
        topk_support: whose top-k is the support of ``"topk_reverse_kl"``: ``"student"`` (SDPO's
            implementation, default) or ``"teacher"`` (LOPD's).
        jsd_alpha: beta of :func:`~lopd_lightning.losses.generalized_jsd` for ``"jsd"`` (GKD convention:
            0 forward KL(T || S), 1 reverse KL(S || T)).
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
        ValueError: ``rollouts_per_example < 2``, an unknown divergence, ``top_k_distill < 1``,
            ``jsd_alpha`` outside [0, 1] or ``is_clip <= 0`` (before the model is loaded).

    Source: Hubotter et al. 2026, "Reinforcement Learning via Self-Distillation"; docs/METHOD.md section 6.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        rollouts_per_example: int = 4,
        teacher_ema_rate: float = 0.05,
        divergence: SDPODivergence = "topk_reverse_kl",
        top_k_distill: int = 20,
        topk_support: str = "student",
        jsd_alpha: float = 0.5,
        is_clip: float | None = 2.0,
        allow_self_demo: bool = False,
        include_feedback: bool = True,
        feedback_without_demo: bool = False,
        max_demo_chars: int = 4000,
        max_feedback_chars: int = 1000,
        distill_temperature: float = 1.0,
        **kwargs: Any,
    ):
        # checks that need no model run before the student is loaded
        if rollouts_per_example < 2:
            raise ValueError(
                f"SDPO needs sibling rollouts: rollouts_per_example must be >= 2, got {rollouts_per_example}; "
                f"set model.init_args.rollouts_per_example to 2 or more (SDPO default: 4)"
            )
        if divergence not in ("topk_reverse_kl", "jsd"):
            raise ValueError(f"divergence must be 'topk_reverse_kl' or 'jsd', got {divergence!r}")
        if top_k_distill < 1:
            raise ValueError(f"top_k_distill must be >= 1, got {top_k_distill}")
        if topk_support not in ("student", "teacher"):
            raise ValueError(f"topk_support must be 'student' or 'teacher', got {topk_support!r}")
        if not 0.0 <= jsd_alpha <= 1.0:
            raise ValueError(f"jsd_alpha must be in [0, 1], got {jsd_alpha}")
        if is_clip is not None and is_clip <= 0:
            raise ValueError(f"is_clip must be > 0 or None, got {is_clip}")
        if distill_temperature <= 0:
            raise ValueError(f"distill_temperature must be > 0, got {distill_temperature}")
        super().__init__(model, rollouts_per_example=rollouts_per_example, **kwargs)
        self.save_hyperparameters()
        if divergence == "topk_reverse_kl":
            self.check_top_k("top_k_distill", top_k_distill)
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

    def teacher_contexts(self, batch: RolloutBatch) -> tuple[list[str | None], Tensor, Tensor]:
        """Each row's privileged text for the teacher, and which rows have a demonstration / are kept.

        Row i's text is ``SDPO_DEMO_TEMPLATE`` with :func:`successful_sibling`'s rollout, then (with
        ``include_feedback`` and some feedback) ``SDPO_FEEDBACK_TEMPLATE``, then ``SDPO_CONTEXT_SUFFIX``.
        Rows without a demonstration get None (no context), unless ``feedback_without_demo`` and they
        have feedback.

        Returns:
            (texts: B entries, str or None; has_demo: (B,) bool; kept: (B,) bool, the rows in the loss),
            tensors on the batch's device.
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
        return texts, has_demo, kept

    # ------------------------------------------------------------------ the loss
    def divergence(self, student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
        """Per-token divergence (..., V) x 2 -> (...) of ``divergence`` at ``distill_temperature``."""
        hp = self.hparams
        if hp.divergence == "jsd":
            return generalized_jsd(student_logits, teacher_logits, beta=hp.jsd_alpha, temperature=hp.distill_temperature)
        return topk_tail_reverse_kl(
            student_logits, teacher_logits, k=hp.top_k_distill, temperature=hp.distill_temperature, support=hp.topk_support
        )

    def behaviour_logps(self, batch: RolloutBatch, current_logps: Tensor) -> Tensor:
        """log pi_old of the kept tokens, (N,) packed like ``current_logps``: the current student, detached.

        Override to use the sampling pass's log-probs (then the importance weight is not 1).
        """
        return current_logps.detach()

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        hp = self.hparams
        targets, mask = self.shifted(batch)  # [B, T-1]
        texts, has_demo, kept = self.teacher_contexts(batch)
        kept_mask = mask & kept[:, None]  # [B, T-1]
        num_tokens = self.num_loss_tokens(batch, kept_mask)

        with self.timed("teacher"):
            teacher_logits = None
            if bool(kept.any()) or self.sharded:  # sharded: every rank runs the pass
                context_ids = self.teacher.encode_text_context(texts, prefix="", suffix="")
                teacher_logits = self.teacher.logits_on_student_positions(
                    batch.input_ids,
                    batch.attention_mask,
                    batch.context_position,
                    context_ids=context_ids,
                    positions=self.unshift(kept_mask),
                ).detach()  # [N_kept, V]

        with self.timed("student_step"):
            student_logits = self.student_logits(batch, mask)  # [N, V], every assistant token
            if teacher_logits is not None:
                keep = kept[:, None].expand_as(mask)[mask]  # [N] bool, row-major like the packed logits
                student_kept = student_logits[keep]  # [N_kept, V]
                per_token = self.divergence(student_kept[None], teacher_logits[None])[0]  # [N_kept]
                if hp.is_clip is not None:
                    logps = token_logps(student_kept[None], targets[kept_mask][None], temperature=hp.distill_temperature)[0]
                    weight = (logps - self.behaviour_logps(batch, logps)).exp().clamp(max=hp.is_clip).detach()
                    per_token = per_token * weight
                loss = per_token.sum() / num_tokens
            else:  # no kept row here: a zero loss that still reaches every parameter (DDP)
                loss = student_logits.sum() * 0.0
            self.manual_backward(loss)
            norm = self.clip_and_step(optimizer, self.student_parameters(), hp.grad_clip)
        self.teacher.update_ema()

        groups = batch.group_ids.unique()
        success = batch.rewards >= hp.success_threshold
        no_success = sum(1 for g in groups.tolist() if not bool(success[batch.group_ids == g].any()))
        loss_global = self.global_mean(loss)
        self.log_rollout_metrics(
            batch,
            {
                "train/loss": loss_global,
                "train/distill": loss_global,
                "train/rows_with_demo": self.global_count(has_demo.sum()) / max(1, self.global_count(len(batch))),
                "train/rows_kept": self.global_count(kept.sum()) / max(1, self.global_count(len(batch))),
                "train/groups_without_success": self.global_count(no_success) / max(1, self.global_count(len(groups))),
                "train/grad_norm": norm,
            },
        )
        return loss.detach()
