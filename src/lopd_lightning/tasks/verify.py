"""Replaying a task's reference solutions through its own environment (``lopd tasks verify``).

Every reference must earn full marks: a reference that does not is a bug of the checker or of the
environment (or an error in the data that the checker must handle), never a reason to drop examples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lopd_lightning.tasks.base import Split, Task


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_task`.

    Attributes:
        n: examples replayed.
        n_full_marks: examples whose reward was exactly 1.0.
        failures: ``(example id, reward)`` of the others, in example order.
        errors: example id -> the exception that stopped its replay (those also count as failures,
            with reward 0.0).
    """

    n: int = 0
    n_full_marks: int = 0
    failures: list[tuple[str, float]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when every example earned full marks."""
        return self.n_full_marks == self.n


def verify_task(task: Task, *, limit: int | None = None, split: Split = "all") -> VerifyReport:
    """Replay ``task.reference_replies(example)`` for the examples of ``split`` and record the rewards.

    Each example gets a fresh episode (``task.start``); the replies are fed in order through
    ``episode.step`` until they run out or the episode is done; then ``episode.reward()`` is read.
    Works for single-turn tasks (one reply) and multi-turn ones.

    Args:
        task: any :class:`~lopd_lightning.tasks.base.Task`.
        limit: replay only the first ``limit`` examples of the split.
        split: "train", "val" or "all".

    Returns:
        A :class:`VerifyReport`. Exceptions raised while replaying one example are recorded in
        ``errors`` and do not stop the others.

    Raises:
        ValueError: unknown split (from ``task.examples``).
    """
    examples = task.examples(split)
    if limit is not None:
        examples = examples[:limit]
    report = VerifyReport()
    for example in examples:
        report.n += 1
        try:
            episode = task.start(example)
            for reply in task.reference_replies(example):
                if episode.step(reply).done:
                    break
            reward = float(episode.reward())
        except Exception as err:  # record and go on: the report lists every broken example
            report.errors[example.id] = f"{type(err).__name__}: {err}"
            reward = 0.0
        if reward == 1.0:
            report.n_full_marks += 1
        else:
            report.failures.append((example.id, reward))
    return report


__all__ = ["VerifyReport", "verify_task"]
