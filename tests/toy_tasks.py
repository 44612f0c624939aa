"""Toy tasks with rewards the tests control (imported by the test files and tests/scripts/)."""

from __future__ import annotations

from lopd_lightning.tasks import Example
from lopd_lightning.tasks.toy import ToyTask


class EvenToy(ToyTask):
    """Rewards we control: 1 for the even-numbered examples ("toy/0", "toy/2", ...), 0 for the others."""

    def score(self, example: Example, completion: str) -> float:
        return 1.0 if int(example.id.split("/")[1]) % 2 == 0 else 0.0


class ParityToy(ToyTask):
    """Reward 1 when the reply's character codes sum to an even number: rewards vary within a group."""

    def score(self, example: Example, completion: str) -> float:
        return 1.0 if sum(map(ord, completion)) % 2 == 0 else 0.0
