"""Replaying a task's reference solutions through its own environment (``lopd tasks verify``).

Every reference must earn full marks: a reference that does not is a bug of the checker or of the
environment (or an error in the data that the checker must handle), never a reason to drop examples.

A replay gets the turn limit a training episode gets (:func:`~lopd_lightning.tasks.base.turn_limit`, the rule
:func:`lopd_lightning.rollout.generate_rollouts` applies): a reference that needs more replies than the limit
allows would be cut there by ``lopd fit``, so it is reported as a failure whose reason names the task's
``multi_turn`` / ``max_turns`` attributes and ``model.init_args.max_turns``. A failing replay keeps what
the checker said about its last reply (``StepResult.info``, e.g. the ``{"error": ...}`` of
:meth:`~lopd_lightning.tasks.base.Task.score_with_info`), and its reason shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lopd_lightning.tasks.base import Split, Task, episode_reward, turn_limit


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_task`.

    Attributes:
        n: examples replayed.
        n_full_marks: examples whose reward was exactly 1.0 and whose replay was not cut.
        failures: ``(example id, reward)`` of the others, in example order.
        errors: example id -> the exception that stopped its replay (those also count as failures,
            with reward 0.0).
        cut: example id -> ``(replies fed, replies of the reference)`` of the replays cut at the turn
            limit before the episode said ``done`` (failures, whatever their reward).
        info: example id -> the checker's diagnostics (``info`` of the last step, non-empty) of the
            failures.
        max_turns: the turn limit of the replays; ``limit_source``: where it came from (:func:`turn_limit`).
        multi_turn: the task's ``multi_turn`` attribute; ``task_name``: its name.
    """

    n: int = 0
    n_full_marks: int = 0
    failures: list[tuple[str, float]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    cut: dict[str, tuple[int, int]] = field(default_factory=dict)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_turns: int = 1
    limit_source: str = ""
    multi_turn: bool = False
    task_name: str = ""

    @property
    def ok(self) -> bool:
        """True when every example earned full marks."""
        return self.n_full_marks == self.n

    def reason(self, example_id: str) -> str | None:
        """Why the replay of ``example_id`` failed beyond its reward (an error; the turn limit and what the
        checker said, ``checker: error: ...``), or None."""
        if example_id in self.errors:
            return self.errors[example_id]
        reasons = []
        if example_id in self.cut:
            fed, total = self.cut[example_id]
            reasons.append(f"cut after {fed} of its {total} replies at max_turns={self.max_turns}")
        if self.info.get(example_id):
            reasons.append("checker: " + "; ".join(f"{k}: {v}" for k, v in self.info[example_id].items()))
        return "; ".join(reasons) or None

    def turn_limit_advice(self) -> str | None:
        """One line on the replays cut at the turn limit and the fix, naming ``multi_turn`` / ``max_turns``
        (None when none was cut)."""
        if not self.cut:
            return None
        longest = max(total for _, total in self.cut.values())
        head = (f"{len(self.cut)} of {self.n} replays were cut at max_turns={self.max_turns} ({self.limit_source}), "
                f"as lopd fit cuts its episodes; the longest reference takes {longest} replies")
        if not self.multi_turn:
            return (f"{head}: task {self.task_name!r} has multi_turn = False; a task whose episodes take several "
                    f"replies sets `multi_turn = True` and `max_turns = {longest}` on its Task class")
        return (f"{head}: raise the task's `max_turns` attribute to {longest} or set model.init_args.max_turns "
                f"(and check it with lopd tasks verify --max-turns {longest})")


def verify_task(
    task: Task, *, limit: int | None = None, split: Split = "all", max_turns: int | None = None
) -> VerifyReport:
    """Replay ``task.reference_replies(example)`` for the examples of ``split`` and record the rewards.

    Each example gets a fresh episode (``task.start``); the replies are fed in order through
    ``episode.step`` until they run out, the episode is done or the turn limit is reached (as in
    training, :func:`turn_limit`); then the reward is read with :func:`episode_reward` (a value outside
    [0, 1] is an error naming the task and the example). A replay stopped by the limit with
    replies left and the episode not done is a failure (``report.cut``), whatever its reward. A failure
    keeps the ``info`` of its last step (``report.info``: the checker's verdict). Works for single-turn
    tasks (one reply) and multi-turn ones.

    Args:
        task: any :class:`~lopd_lightning.tasks.base.Task`.
        limit: replay only the first ``limit`` examples of the split (>= 1).
        split: "train", "val" or "all".
        max_turns: the turn limit (``model.init_args.max_turns``); None: the task's, as in training.

    Returns:
        A :class:`VerifyReport`. Exceptions raised while replaying one example are recorded in
        ``errors`` and do not stop the others.

    Raises:
        ValueError: unknown split (from ``task.examples``), ``limit`` or ``max_turns`` below 1.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    turns, source = turn_limit(task, max_turns, given_by="--max-turns (model.init_args.max_turns)")
    examples = task.examples(split)
    if limit is not None:
        examples = examples[:limit]
    report = VerifyReport(max_turns=turns, limit_source=source, multi_turn=bool(task.multi_turn),
                          task_name=str(getattr(task, "name", type(task).__name__)))
    for example in examples:
        report.n += 1
        try:
            episode = task.start(example)
            replies = list(task.reference_replies(example))
            done, fed, info = False, 0, {}
            for reply in replies[:turns]:
                fed += 1
                result = episode.step(reply)
                info = dict(getattr(result, "info", None) or {})
                if result.done:
                    done = True
                    break
            if not done and fed == turns and len(replies) > turns:
                report.cut[example.id] = (fed, len(replies))
            reward = episode_reward(task, example, episode)
        except Exception as err:  # record and go on: the report lists every broken example
            report.errors[example.id] = f"{type(err).__name__}: {err}"
            reward = 0.0
        if reward == 1.0 and example.id not in report.cut:
            report.n_full_marks += 1
        else:
            report.failures.append((example.id, reward))
            if example.id not in report.errors and info:
                report.info[example.id] = info
    return report


__all__ = ["VerifyReport", "verify_task"]
