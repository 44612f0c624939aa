"""The records of the experience bank and the result of a retrieval (docs/METHOD.md section 2).

An :class:`Experience` is one entry (task text x_i, observation-lite trace tau_i, reward); a
:class:`SearchResult` is the top-k of a batch of queries, padded where fewer were found
(:data:`MISSING_SCORE`). :class:`~lopd_lightning.memory.bank.ExperienceBank` stores the former and
returns the latter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["MISSING_SCORE", "Experience", "SearchResult"]

#: Missing entries of ``SearchResult.scores``.
MISSING_SCORE = -1.0


@dataclass(frozen=True)
class Experience:
    """One record of the bank (frozen: the bank hands out the same objects in search results).

    Attributes:
        task_id: identifies the task; records of the querying task are excluded from its retrieval.
        task_text: the task prompt x_i (what is embedded by default).
        trace: the observation-lite trajectory tau_i (actions and short results), as text.
        reward: r(tau_i), usually in [0, 1]; must be finite.
        step: the training step (or any monotone clock) at which it was added; defines age for eviction.
    """

    task_id: str
    task_text: str
    trace: str
    reward: float
    step: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain ``{task_id, task_text, trace, reward, step}`` (str, str, str, float, int)."""
        return {
            "task_id": str(self.task_id),
            "task_text": str(self.task_text),
            "trace": str(self.trace),
            "reward": float(self.reward),
            "step": int(self.step),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Experience:
        """Inverse of :meth:`to_dict` (extra keys, such as ``id``, are ignored)."""
        return cls(
            task_id=str(data["task_id"]),
            task_text=str(data["task_text"]),
            trace=str(data["trace"]),
            reward=float(data["reward"]),
            step=int(data.get("step", 0)),
        )


@dataclass
class SearchResult:
    """Top-k retrieval for a batch of B queries.

    Attributes:
        indices: (B, k) int64, positions in ``bank.records`` at search time, best first; -1 where missing.
            Positions change when the bank evicts; use ``ids`` to refer to records across time.
        ids: (B, k) int64, stable record ids (``bank.ids``), -1 where missing.
        scores: (B, k) float32 cosine similarities, best first; -1.0 where missing (not a mask: a found
            record can also score -1.0).
        experiences: B lists of the found :class:`Experience` records, best first (length ``num_found[b]``).
        num_found: (B,) int64, how many of the k slots are filled.
    """

    indices: np.ndarray
    ids: np.ndarray
    scores: np.ndarray
    experiences: list[list[Experience]] = field(default_factory=list)
    num_found: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @classmethod
    def empty(cls, batch: int, k: int) -> SearchResult:
        """``batch`` rows of ``k`` missing slots: indices and ids -1 (int64), scores :data:`MISSING_SCORE`
        (float32), no experiences, ``num_found`` 0."""
        return cls(
            indices=np.full((batch, k), -1, dtype=np.int64),
            ids=np.full((batch, k), -1, dtype=np.int64),
            scores=np.full((batch, k), MISSING_SCORE, dtype=np.float32),
            experiences=[[] for _ in range(batch)],
            num_found=np.zeros(batch, dtype=np.int64),
        )
