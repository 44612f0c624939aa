"""A task whose answer exists only in its experience: made-up access codes (the latent-capacity probe).

Fact i says ``"The access code of project <Name> is <code>."``; the question is ``"What is the access code
of project <Name>?"`` and the reward is 1 when the reply contains the code. Names are three random
syllables, codes ``code_length`` random lowercase letters, both from ``random.Random(seed)``, so no model can
know a code without being told: given the fact (as text, or as the latents of a composer that carries
it) the answer is a copy; without it, a guess. The bank's experience of a fact is the fact itself
(:meth:`FactsTask.experience_text`). Splits are fixed: the first ``num_examples - num_heldout`` facts are
"train", the rest "val". ``benchmarks/latent_capacity.py`` and the composer's tests use it to measure how
much of an experience the latents carry.
"""

from __future__ import annotations

import random
import string

from lopd_lightning.tasks.base import Example, Message, Task

#: the syllables of the projects' names
SYLLABLES: tuple[str, ...] = ("ba", "ce", "di", "fo", "gu", "ka", "le", "mi", "no", "pu", "ra", "se", "ti", "vo", "za",
                              "lo", "ne", "ri", "to", "mu")


def fact_text(name: str, code: str) -> str:
    """The experience: ``"The access code of project {name} is {code}."``."""
    return f"The access code of project {name} is {code}."


def question_text(name: str | None) -> str:
    """The task: ``"What is the access code of project {name}?"`` (``"What is the access code?"`` for None)."""
    return f"What is the access code of project {name}?" if name is not None else "What is the access code?"


class FactsTask(Task):
    """Made-up facts, one question each; the code is only in the fact.

    Example ``i`` has id ``"facts/i"``, text :func:`question_text`, and data ``{"name", "code", "fact"}``.

    Args:
        num_examples: facts in "all" (64 in the capacity benchmark).
        num_heldout: the last facts, held out as "val" (16).
        code_length: letters per code (5).
        seed: seed of the names and codes.
        ask_by_name: the question names the project (True); False asks every fact the same question, so
            nothing but the experience tells the facts apart (a composer cannot learn a train fact's code
            from its question).

    Raises:
        ValueError: ``num_heldout`` not in [1, num_examples - 1], or ``code_length < 1``.
    """

    name = "facts"

    def __init__(self, *, num_examples: int = 64, num_heldout: int = 16, code_length: int = 5, seed: int = 0,
                 ask_by_name: bool = True):
        if not 1 <= num_heldout < num_examples:
            raise ValueError(f"num_heldout must be in [1, num_examples - 1], got {num_heldout} of {num_examples}")
        if code_length < 1:
            raise ValueError(f"code_length must be >= 1, got {code_length}")
        self.num_examples, self.num_heldout, self.code_length, self.seed = num_examples, num_heldout, code_length, seed
        self.val_fraction = num_heldout / num_examples
        rng = random.Random(seed)
        names: set[str] = set()
        self._all: list[Example] = []
        while len(self._all) < num_examples:
            name = "".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize()
            if name in names:
                continue
            names.add(name)
            code = "".join(rng.choice(string.ascii_lowercase) for _ in range(code_length))
            i = len(self._all)
            self._all.append(Example(id=f"facts/{i}", text=question_text(name if ask_by_name else None),
                                     data={"name": name, "code": code, "fact": fact_text(name, code)}))

    def all_examples(self) -> list[Example]:
        return self._all

    def examples(self, split: str = "train") -> list[Example]:
        """The first ``num_examples - num_heldout`` facts ("train"), the rest ("val"), or all."""
        self.check_split(split)
        cut = self.num_examples - self.num_heldout
        return {"train": self._all[:cut], "val": self._all[cut:], "all": self._all}[split]

    def initial_messages(self, example: Example) -> list[Message]:
        return [{"role": "user", "content": example.text}]

    def reference_solution(self, example: Example) -> str:
        return example.data["code"]

    def score(self, example: Example, completion: str) -> float:
        return 1.0 if example.data["code"] in completion.lower() else 0.0

    def experience_text(self, example: Example, messages: list[Message]) -> str:
        """The fact itself (what a solved fact teaches), whatever the trajectory said."""
        return example.data["fact"]
