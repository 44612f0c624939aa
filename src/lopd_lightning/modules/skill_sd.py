"""SkillSDModule: GRPO plus self-distillation from a skill-conditioned self-teacher (Skill-SD, docs/METHOD.md 6).

Skill-SD (Wang et al. 2026) keeps a small library of natural-language *skills* that the policy model
itself writes from its own recent trajectories, in three kinds: success analysis (what made successful
attempts work), mistake analysis (what went wrong in failed ones) and workflow (a short procedure).
Per task one skill is chosen by a UCB1 bandit and shown to the TEACHER only; the student never sees it.

One training step:

1. make_batch: the student's rollouts (G per task, as GRPO), then one skill per task by UCB1, recorded in
   each row's ``metadata["skill_id"]`` / ``metadata["skill_text"]`` (None while the library is empty);
2. the teacher (a :class:`~lopd_lightning.teacher.SelfTeacher` on the shared backbone, default mode
   ``"base"``: the frozen initial weights) scores the student's tokens with the skill framed in its first
   user message (:meth:`~lopd_lightning.teacher.SelfTeacher.encode_text_context`);
3. ``ppo_epochs`` passes of the loss
   ``L = L_GRPO + sdl_coef * sum_tokens rho (exp(-l) - 1 + l) / num_tokens`` with
   ``l = log pi_S(a) - log pi_T(a | skill)`` on the sampled token (teacher constant) and
   ``rho = sg[pi_S(a) / pi_old(a)]`` (1 on the first pass);
4. after the update: the bandit's values (mean reward of the tasks trained under each skill), the
   trajectory buffer, the EMA teacher (mode ``"ema"``), and every ``skill_refresh_every`` steps the
   library: new skills summarised by the current student (greedy) from the buffer, capped at ``max_skills``.

Design choices of this implementation (the paper leaves them open or the LOPD code base differs):

- Bandit arms are the skills of the library, shared by all tasks (not one bandit per task): with small
  budgets a task is seen a few times only, so per-(task, skill) statistics would stay unplayed. The value
  of an arm is the mean over the tasks it was chosen for of the task's mean rollout reward; its count is
  the number of tasks it was chosen for. Choices inside one batch are sequential (the count is taken at
  selection, the value when the rewards arrive), so the tasks of one batch spread over unplayed arms.
  A new skill enters unplayed, so it is tried first. Each rank keeps its own library and bandit.
- Rows without a skill (an empty library at the start) have no privileged context; the SDL term is
  taken only on rows with a skill (a context-free teacher holds no privileged information), still divided
  by the step's total token count; ``train/skill_rows`` logs the fraction of rows with a skill. While no
  row has a skill the teacher pass is skipped and the loss is GRPO's.
- Eviction at the cap removes the played skill with the lowest value (oldest first on ties); skills
  added in the current refresh are never evicted by it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lopd_lightning.hints import choose_one_of
from lopd_lightning.lm import unpack
from lopd_lightning.losses import k3_kl, masked_mean, token_logps
from lopd_lightning.modules.grpo import GRPOModule, GRPOStepInputs
from lopd_lightning.rollout import RolloutBatch, encode_prompt
from lopd_lightning.rollout.chat import eos_token_ids
from lopd_lightning.sharding import generate_options
from lopd_lightning.tasks import Example, Task
from lopd_lightning.teacher import TEACHER_MODES, SelfTeacher

log = logging.getLogger(__name__)

__all__ = [
    "SKILL_CONTEXT_PREFIX",
    "SKILL_CONTEXT_SUFFIX",
    "SKILL_KINDS",
    "SKILL_PROMPTS",
    "SkillSDModule",
    "SkillSDStepInputs",
    "sdl_per_token",
    "ucb1_select",
]

#: The three kinds of skills, in the order a refresh writes them.
SKILL_KINDS: tuple[str, ...] = ("success", "mistake", "workflow")

#: Prompts with which the policy summarises skills from its trajectories; ``{trajectories}`` receives the
#: formatted records (see :meth:`SkillSDModule.skill_prompt`). Kept short: small students must follow them.
SKILL_PROMPTS: dict[str, str] = {
    "success": (
        "Below are attempts at tasks that succeeded.\n\n{trajectories}\n\n"
        "Success analysis: in at most three sentences, state what made these attempts succeed, "
        "as general advice for similar tasks."
    ),
    "mistake": (
        "Below are attempts at tasks that failed.\n\n{trajectories}\n\n"
        "Mistake analysis: in at most three sentences, state what went wrong and how to avoid it "
        "in similar tasks."
    ),
    "workflow": (
        "Below are attempts at tasks with their rewards (1 is best).\n\n{trajectories}\n\n"
        "Workflow: write a short step-by-step procedure for solving such tasks well."
    ),
}

#: Framing of a skill in the teacher's first user message (before the task text).
SKILL_CONTEXT_PREFIX = "A skill learned from past attempts at similar tasks:\n"
SKILL_CONTEXT_SUFFIX = "\n\nUse it to solve your task.\n\n"


def ucb1_select(counts: list[int], values: list[float], *, c: float = math.sqrt(2)) -> int:
    """The arm UCB1 plays: the first unplayed arm, else ``argmax_k values[k] + c sqrt(ln N / counts[k])``.

    Args:
        counts: n_k, times each arm was played (>= 0).
        values: Q_k, each arm's mean reward.
        c: exploration constant (UCB1: sqrt 2).

    Returns:
        The index of the chosen arm (the lowest index on ties).

    Raises:
        ValueError: no arms, or ``counts`` and ``values`` differ in length.

    Source: Auer, Cesa-Bianchi, Fischer 2002, UCB1 (N = sum_k n_k); Skill-SD's skill selection, c = sqrt 2.
    """
    if not counts or len(counts) != len(values):
        raise ValueError(f"need as many counts as values (>= 1), got {len(counts)} and {len(values)}")
    for k, n in enumerate(counts):
        if n <= 0:
            return k
    total = sum(counts)
    scores = [q + c * math.sqrt(math.log(total) / n) for q, n in zip(values, counts, strict=True)]
    return max(range(len(scores)), key=lambda k: (scores[k], -k))


def sdl_per_token(logps: Tensor, teacher_logps: Tensor, old_logps: Tensor) -> Tensor:
    """Skill-SD's per-token self-distillation loss ``rho (exp(-l) - 1 + l)``, ``l = logps - teacher_logps``.

    ``exp(-l) - 1 + l >= 0`` is the k3 estimate of KL(pi_S || pi_T) on a token sampled from pi_S
    (:func:`~lopd_lightning.losses.k3_kl`, evaluated without cancellation, never negative); its
    gradient in ``logps`` is ``rho (1 - exp(-l))``. ``rho = sg[exp(logps - old_logps)]`` reweights
    tokens sampled by an older policy (1 on the first pass).

    Args:
        logps: (B, T) float, log pi_S(a | s) of the sampled tokens (differentiable).
        teacher_logps: (B, T) float, log pi_T(a | s, skill) (constant: detached here).
        old_logps: (B, T) float, log pi_old(a | s) (detached).

    Returns:
        (B, T) float per-token loss; reduce with :func:`~lopd_lightning.losses.masked_mean`.

    Raises:
        ValueError: the shapes differ.

    Source: Skill-SD, Wang et al. 2026 (docs/METHOD.md section 6): GRPO + 0.001 * mean(rho (exp(-l) - 1 + l)).
    """
    if not logps.shape == teacher_logps.shape == old_logps.shape:
        raise ValueError(
            f"logps {tuple(logps.shape)}, teacher_logps {tuple(teacher_logps.shape)} and old_logps "
            f"{tuple(old_logps.shape)} must have the same shape"
        )
    rho = torch.exp(logps.detach() - old_logps.detach())
    return rho * k3_kl(logps, teacher_logps)  # exp(-l) - 1 + l is k3 with d = -l, evaluated stably


@dataclass
class SkillSDStepInputs(GRPOStepInputs):
    """GRPO's step inputs (:class:`~lopd_lightning.modules.grpo.GRPOStepInputs`) plus the skill teacher's.

    Attributes:
        teacher_logps: (B, T-1) float log pi_T(a | s, skill) of the batch's tokens on the loss tokens of
            rows with a skill (0 elsewhere), no gradient (:meth:`SkillSDModule.teacher_logps`).
        sdl_mask: (B, T-1) bool, the loss tokens of the rows with a skill (where the SDL term is taken).
    """

    teacher_logps: Tensor | None = None
    sdl_mask: Tensor | None = None


class SkillSDModule(GRPOModule):
    """Skill-SD: GRPO plus a self-distillation term towards the self-teacher that reads a UCB1-chosen skill.

    Besides :class:`~lopd_lightning.modules.grpo.GRPOModule`'s arguments (``--help`` lists both):

    Args:
        sdl_coef: weight of the self-distillation term (paper: 0.001).
        teacher_mode: ``"base"`` (default: the frozen initial weights, so the skill is the only thing the
            teacher adds over where the student started), ``"live"`` (the current student) or ``"ema"``.
        teacher_ema_rate: EMA rate of ``teacher_mode="ema"``.
        max_skills: cap of the skill library.
        skill_refresh_every: summarise new skills every this many training steps (0: never; the library
            then holds only what :meth:`add_skill` or a checkpoint put there).
        skill_max_new_tokens: token limit of a generated skill.
        skill_buffer_size: recent trajectories kept to summarise skills from.
        skill_examples: trajectories shown per summarisation prompt.
        skill_trajectory_chars: each trajectory's text is cut to this many characters in a prompt.
        ucb_c: UCB1 exploration constant (paper: sqrt 2).

    Logged (besides GRPO's): ``train/sdl`` (the SDL term before ``sdl_coef``), ``train/skill_rows``,
    ``train/num_skills``; timing ``time/teacher`` and ``time/skill_refresh``.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        sdl_coef: float = 0.001,
        teacher_mode: str = "base",
        teacher_ema_rate: float = 0.05,
        max_skills: int = 8,
        skill_refresh_every: int = 5,
        skill_max_new_tokens: int = 96,
        skill_buffer_size: int = 32,
        skill_examples: int = 2,
        skill_trajectory_chars: int = 600,
        ucb_c: float = math.sqrt(2),
        **kwargs: Any,
    ):
        if teacher_mode not in TEACHER_MODES:
            raise ValueError(f"model.init_args.teacher_mode {teacher_mode!r} is not a teacher mode; "
                             f"{choose_one_of(teacher_mode, TEACHER_MODES)}")
        if not sdl_coef >= 0:
            raise ValueError(f"sdl_coef must be >= 0, got {sdl_coef}")
        for key, value, low in (("max_skills", max_skills, 1), ("skill_refresh_every", skill_refresh_every, 0),
                                ("skill_max_new_tokens", skill_max_new_tokens, 1),
                                ("skill_buffer_size", skill_buffer_size, 1), ("skill_examples", skill_examples, 1),
                                ("skill_trajectory_chars", skill_trajectory_chars, 1)):
            if value < low:
                raise ValueError(f"model.init_args.{key} must be >= {low}, got {value}")
        if not ucb_c >= 0:
            raise ValueError(f"ucb_c must be >= 0, got {ucb_c}")
        super().__init__(model, **kwargs)
        self.save_hyperparameters()
        if teacher_mode == "base" and self.reference is not None:
            self.teacher = self.reference  # the same frozen base: no second copy for a full student
        else:
            self.teacher = SelfTeacher(self.backbone, self.tokenizer, mode=teacher_mode, ema_rate=teacher_ema_rate)
        #: the library: dicts {id, kind, text, step, count, reward_sum, reward_n}; count = UCB1 plays.
        self.skills: list[dict[str, Any]] = []
        self.next_skill_id = 0
        #: recent trajectories: dicts {task_text, trajectory, reward}.
        self.trajectory_buffer: deque[dict[str, Any]] = deque(maxlen=skill_buffer_size)

    # ------------------------------------------------------------------ the library and the bandit
    def add_skill(self, kind: str, text: str) -> dict[str, Any]:
        """Add a skill (unplayed) to the library and return its record; evicts at the cap (see module doc)."""
        if kind not in SKILL_KINDS:
            raise ValueError(f"unknown skill kind {kind!r}; kinds: {SKILL_KINDS}")
        record = {
            "id": self.next_skill_id,
            "kind": kind,
            "text": text,
            "step": int(self.global_step),
            "count": 0,
            "reward_sum": 0.0,
            "reward_n": 0,
        }
        self.next_skill_id += 1
        self.skills.append(record)
        return record

    def evict_skills(self, keep_ids: set[int] | None = None) -> None:
        """Drop skills until at most ``max_skills`` remain: the played one with the lowest value first
        (oldest on ties), then unplayed ones oldest first; ids in ``keep_ids`` are kept if possible."""
        keep_ids = keep_ids or set()
        while len(self.skills) > self.hparams.max_skills:
            candidates = [s for s in self.skills if s["id"] not in keep_ids] or list(self.skills)
            played = [s for s in candidates if s["reward_n"] > 0]
            pool = played or candidates
            victim = min(pool, key=lambda s: (self.skill_value(s), s["id"]))
            self.skills.remove(victim)

    @staticmethod
    def skill_value(skill: dict[str, Any]) -> float:
        """Q: the mean reward of the tasks trained under the skill (0 before any)."""
        return skill["reward_sum"] / skill["reward_n"] if skill["reward_n"] > 0 else 0.0

    def select_skills(self, num_tasks: int) -> list[dict[str, Any] | None]:
        """One skill per task by UCB1 over the library (None for all when it is empty); counts the plays."""
        if not self.skills:
            return [None] * num_tasks
        chosen = []
        for _ in range(num_tasks):
            counts = [s["count"] for s in self.skills]
            values = [self.skill_value(s) for s in self.skills]
            skill = self.skills[ucb1_select(counts, values, c=self.hparams.ucb_c)]
            skill["count"] += 1
            chosen.append(skill)
        return chosen

    @override
    def make_batch(self, task: Task, examples: list[Example]) -> RolloutBatch:
        """GRPO's rollouts, then one skill per task (UCB1) in each row's ``metadata["skill_id"|"skill_text"]``."""
        batch = super().make_batch(task, examples)
        with self.timed("skill_select"):
            skills = dict(zip([ex.id for ex in examples], self.select_skills(len(examples)), strict=True))
            for meta, example_id in zip(batch.metadata, batch.example_ids, strict=True):
                skill = skills[example_id]
                meta["skill_id"] = None if skill is None else skill["id"]
                meta["skill_text"] = None if skill is None else skill["text"]
        return batch

    # ------------------------------------------------------------------ teacher and loss
    def teacher_logps(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """The skill-conditioned teacher's log-probs of the batch's tokens.

        Returns:
            ((B, T-1) float log pi_T(a | s, skill) on the loss tokens of rows with a skill, 0 elsewhere,
            no gradient; (B,) bool, rows with a skill).
        """
        targets, mask = self.shifted(batch)
        texts = [meta.get("skill_text") or None for meta in batch.metadata]
        has_skill = torch.tensor([t is not None for t in texts], dtype=torch.bool, device=mask.device)
        rows_mask = mask & has_skill[:, None]
        if not bool(rows_mask.any()) and not self.sharded:  # sharded: every rank runs the pass
            return torch.zeros(mask.shape, device=mask.device), has_skill
        context_ids = self.teacher.encode_text_context(texts, prefix=SKILL_CONTEXT_PREFIX, suffix=SKILL_CONTEXT_SUFFIX)
        logits = self.teacher.logits_on_student_positions(
            batch.input_ids,
            batch.attention_mask,
            batch.context_position,
            context_ids=context_ids,
            positions=self.unshift(rows_mask),
        )  # [N, V]
        logps = token_logps(logits[None], targets[rows_mask][None], temperature=self.hparams.logps_temperature)[0]
        return unpack(logps.detach(), rows_mask), has_skill

    @override
    def step_inputs(self, batch: RolloutBatch) -> SkillSDStepInputs:
        """GRPO's inputs plus the teacher's log-probs and the SDL mask (:class:`SkillSDStepInputs`, the
        teacher pass timed as ``time/teacher``) and the metrics ``train/skill_rows``, ``train/num_skills``."""
        inputs = super().step_inputs(batch)
        with self.timed("teacher"):
            teacher_logps, has_skill = self.teacher_logps(batch)
        inputs = inputs.extend(SkillSDStepInputs, teacher_logps=teacher_logps, sdl_mask=inputs.mask & has_skill[:, None])
        inputs.metrics["train/skill_rows"] = self.global_mean(has_skill.float().mean())
        inputs.metrics["train/num_skills"] = float(len(self.skills))
        return inputs

    @override
    def loss_terms(self, logps: Tensor, old_logps: Tensor, inputs: SkillSDStepInputs) -> dict[str, Tensor]:
        """GRPO's terms (keyed by their logged tags), ``train/sdl`` (global token mean of
        :func:`sdl_per_token` over rows with a skill), and ``train/loss = GRPO loss + sdl_coef * sdl``."""
        terms = super().loss_terms(logps, old_logps, inputs)
        per_token = sdl_per_token(logps, inputs.teacher_logps, old_logps)
        sdl = masked_mean(per_token, inputs.sdl_mask, num_tokens=inputs.num_tokens)
        terms["train/sdl"] = sdl
        terms["train/loss"] = terms["train/loss"] + self.hparams.sdl_coef * sdl
        return terms

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.hparams.teacher_mode == "ema":
            self.teacher.update_ema()
        self.record_outcomes(batch)
        every = int(self.hparams.skill_refresh_every)
        if every > 0 and self.global_step % every == 0:
            start = time.perf_counter()
            self.refresh_skills()
            # after log_rollout_metrics: logged here (make_batch resets the step's timings)
            seconds = time.perf_counter() - start
            self.log("time/skill_refresh", seconds, on_step=True, on_epoch=False, batch_size=len(batch), logger=False)
            self.log_step_scalars({"time/skill_refresh": seconds})
        return loss

    # ------------------------------------------------------------------ outcomes, buffer, refresh
    def trajectory_text(self, messages: list[dict[str, Any]]) -> str:
        """The conversation after the initial messages (from the first assistant turn), one
        ``role: content`` line each, cut to ``skill_trajectory_chars``."""
        start = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        text = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages[start:])
        limit = self.hparams.skill_trajectory_chars
        return text if len(text) <= limit else text[:limit] + "..."

    def record_outcomes(self, batch: RolloutBatch) -> None:
        """Credit each task's mean reward to its skill's arm; push the rows into the trajectory buffer."""
        rewards = batch.rewards.float().tolist()
        per_task: dict[str, list[float]] = {}
        skill_of: dict[str, Any] = {}
        for meta, example_id, r in zip(batch.metadata, batch.example_ids, rewards, strict=True):
            per_task.setdefault(example_id, []).append(r)
            skill_of[example_id] = meta.get("skill_id")
        by_id = {s["id"]: s for s in self.skills}
        for example_id, rs in per_task.items():
            skill = by_id.get(skill_of[example_id])
            if skill is not None:
                skill["reward_sum"] += sum(rs) / len(rs)
                skill["reward_n"] += 1
        for meta, messages, r in zip(batch.metadata, batch.messages, rewards, strict=True):
            self.trajectory_buffer.append(
                {"task_text": str(meta.get("task_text", "")), "trajectory": self.trajectory_text(messages), "reward": r}
            )

    def skill_prompt(self, kind: str, records: list[dict[str, Any]]) -> str:
        """The summarisation prompt of ``kind`` (:data:`SKILL_PROMPTS`) filled with ``records``."""
        blocks = [
            f"Task: {r['task_text']}\nAttempt:\n{r['trajectory']}\nReward: {r['reward']:.2f}" for r in records
        ]
        return SKILL_PROMPTS[kind].format(trajectories="\n\n".join(blocks))

    def skill_records(self, kind: str) -> list[dict[str, Any]]:
        """The most recent ``skill_examples`` buffer records for ``kind``: successes (reward >=
        ``success_threshold``), failures, or any (workflow)."""
        threshold = self.hparams.success_threshold
        if kind == "success":
            pool = [r for r in self.trajectory_buffer if r["reward"] >= threshold]
        elif kind == "mistake":
            pool = [r for r in self.trajectory_buffer if r["reward"] < threshold]
        else:
            pool = list(self.trajectory_buffer)
        return pool[-self.hparams.skill_examples :]

    @torch.no_grad()
    def generate_text(self, prompts: list[str]) -> list[str]:
        """Greedy replies of the current student to single-user-message prompts (``skill_max_new_tokens``).

        Returns:
            One stripped string per prompt (special tokens removed).
        """
        if not prompts:
            return []
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        encoded = [encode_prompt(tok, [{"role": "user", "content": p}]).input_ids for p in prompts]
        length = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(encoded), length), pad, dtype=torch.long, device=self.device)
        attention = torch.zeros((len(encoded), length), dtype=torch.long, device=self.device)
        for i, ids in enumerate(encoded):  # left padding for batched generation
            input_ids[i, length - len(ids) :] = torch.tensor(ids, dtype=torch.long, device=self.device)
            attention[i, length - len(ids) :] = 1
        model = self.backbone
        was_training = model.training
        model.eval()
        try:
            with self.student_context(), self.whole_weights():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention,
                    do_sample=False,
                    max_new_tokens=int(self.hparams.skill_max_new_tokens),
                    pad_token_id=pad,
                    eos_token_id=eos_token_ids(model, tok),  # every EOS id of the generation config ends it
                    **generate_options(model),  # FSDP2: gathered above, no per-token sync between ranks
                )
        finally:
            model.train(was_training)
        return [t.strip() for t in tok.batch_decode(out[:, length:], skip_special_tokens=True)]

    def refresh_skills(self) -> list[dict[str, Any]]:
        """Summarise one skill per kind from the buffer with the current student (greedy), add them to
        the library (kinds without matching trajectories, or an empty generation, are skipped) and evict
        down to ``max_skills``. Returns the new skill records."""
        kinds, prompts = [], []
        for kind in SKILL_KINDS:
            records = self.skill_records(kind)
            if records:
                kinds.append(kind)
                prompts.append(self.skill_prompt(kind, records))
        added = [self.add_skill(kind, text) for kind, text in zip(kinds, self.generate_text(prompts), strict=True) if text]
        self.evict_skills({s["id"] for s in added})
        if added:
            log.info("skill refresh at step %d: %d new, %d in the library", self.global_step, len(added), len(self.skills))
        return added

    # ------------------------------------------------------------------ state
    @override
    def method_state(self) -> dict[str, Any]:
        return {
            "skills": [dict(s) for s in self.skills],
            "next_skill_id": self.next_skill_id,
            "trajectory_buffer": [dict(r) for r in self.trajectory_buffer],
        }

    @override
    def load_method_state(self, state: dict[str, Any]) -> None:
        self.skills = [dict(s) for s in state["skills"]]
        self.next_skill_id = int(state["next_skill_id"])
        self.trajectory_buffer = deque((dict(r) for r in state["trajectory_buffer"]), maxlen=self.hparams.skill_buffer_size)
