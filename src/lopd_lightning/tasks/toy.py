"""A tiny procedural task for tests and smoke runs: repeat a word, or add two digits.

Examples are a pure function of ``seed`` (no files). The reward is 1 when the reply contains the answer
as a whole word (case-insensitive), else 0. With ``multi_turn=True`` an episode has two steps: the first
reply, whatever it says, gets a ``tool`` observation with a hint; the second reply is scored.
"""

from __future__ import annotations

import random
import re

from lopd_lightning.tasks.base import Episode, Example, Message, StepResult, Task

#: the words of the "repeat" examples.
WORDS: tuple[str, ...] = (
    "apple", "river", "cloud", "stone", "tiger", "lemon", "piano", "candle", "forest", "rocket",
    "garden", "silver", "window", "planet", "butter", "castle", "dragon", "pencil", "jungle", "mirror",
)
#: the first reply that the reference replays in multi-turn mode.
HINT_REQUEST = "Can I get a hint?"


def contains_answer(reply: str, answer: str) -> bool:
    """True when ``answer`` occurs in ``reply`` as a whole word (case-insensitive)."""
    return re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", reply, flags=re.IGNORECASE) is not None


class ToyTask(Task):
    """Repeat-a-word and add-two-digits prompts; single-turn, or two-step with a hint (``multi_turn``).

    Example ``i`` (id ``"toy/i"``) is a "repeat" example for even ``i`` ("Repeat the word: <w>") and an
    "add" example for odd ``i`` ("What is a+b? Answer with the number only."), drawn from
    ``random.Random(seed)``. The val split is :func:`~lopd_lightning.tasks.base.split_examples` with ``val_fraction`` and ``seed``.

    Args:
        num_examples: number of examples in "all".
        val_fraction: fraction in (0, 1) of the examples in "val".
        seed: seed of the examples and of the split.
        multi_turn: two-step episodes (a hint observation after the first reply; the second is scored).
        system_prompt: an optional system message before the user message.

    Raises:
        ValueError: ``num_examples < 2``.
    """

    name = "toy"

    def __init__(
        self,
        *,
        num_examples: int = 32,
        val_fraction: float = 0.25,
        seed: int = 0,
        multi_turn: bool = False,
        system_prompt: str | None = None,
    ):
        if num_examples < 2:
            raise ValueError(f"num_examples must be >= 2, got {num_examples}")
        self.num_examples, self.val_fraction, self.seed = num_examples, val_fraction, seed
        self.multi_turn = multi_turn
        #: replies per episode (read by ``generate_rollouts`` when ``max_turns`` is None).
        self.max_turns = 2 if multi_turn else 1
        self.system_prompt = system_prompt
        rng = random.Random(seed)
        self._all: list[Example] = []
        for i in range(num_examples):
            if i % 2 == 0:
                word = rng.choice(WORDS)
                text, answer, kind = f"Repeat the word: {word}", word, "repeat"
            else:
                a, b = rng.randint(0, 9), rng.randint(0, 9)
                text, answer, kind = f"What is {a}+{b}? Answer with the number only.", str(a + b), "add"
            self._all.append(Example(id=f"toy/{i}", text=text, data={"kind": kind, "answer": answer}))

    def all_examples(self) -> list[Example]:
        """The ``num_examples`` generated examples, in order."""
        return self._all

    def initial_messages(self, example: Example) -> list[Message]:
        messages: list[Message] = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": example.text})
        return messages

    def score(self, example: Example, completion: str) -> float:
        return 1.0 if contains_answer(completion, example.data["answer"]) else 0.0

    def reference_replies(self, example: Example) -> list[str]:
        answer = example.data["answer"]
        return [HINT_REQUEST, answer] if self.multi_turn else [answer]

    def reference_solution(self, example: Example) -> str:
        return "\n\n".join(self.reference_replies(example))

    def hint(self, example: Example) -> str:
        """The tool observation of multi-turn episodes."""
        answer = example.data["answer"]
        return f"hint: the answer has {len(answer)} characters and starts with {answer[0]!r}"

    def start(self, example: Example) -> Episode:
        return _HintEpisode(self, example) if self.multi_turn else super().start(example)


class _HintEpisode(Episode):
    """Two steps: any first reply gets a ``tool`` hint; the second reply is scored and ends the episode."""

    def __init__(self, task: ToyTask, example: Example):
        self.task, self.example = task, example
        self.steps = 0
        self._reward = 0.0

    def step(self, reply: str) -> StepResult:
        if self.steps >= 2:
            raise RuntimeError(f"episode of {self.example.id!r} is done; start a new one")
        self.steps += 1
        if self.steps == 1:
            return StepResult(messages=[{"role": "tool", "content": self.task.hint(self.example)}], done=False)
        self._reward = self.task.score(self.example, reply)
        return StepResult(messages=[], done=True)

    def reward(self) -> float:
        return self._reward
