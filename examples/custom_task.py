"""Your own task with LOPD: a small Task, and an LOPDModule subclass that overrides the public hooks.

Run it (two LOPD steps on a tiny random model, CPU, seconds):

    python examples/custom_task.py

What it shows:

- :class:`ReverseWordTask`, a new task in one short class: examples, the first messages, a reward
  (``score``) and the reference solution (used by ``lopd tasks verify``-style replays, SFT and
  ``lopd build-memory --from-references``).
- :class:`ReverseWordLOPD`, LOPD adapted to it by overriding the three documented hooks of
  :class:`~lopd_lightning.modules.base.OnPolicyModule` (no underscore method is touched):

  * ``build_messages(task, example)``: how an example becomes the student's messages (here: a system
    prompt in front of the task's user message);
  * ``score_trajectory(task, example, messages, reward)``: how a finished trajectory is scored (here: a
    shaped reward, 0.8 x the task's reward + 0.2 x brevity);
  * ``experience_from_trajectory(task, example, messages, reward)``: what a trajectory leaves in the
    experience bank (here: just the final answer; nothing for an empty reply).

The same classes work from YAML (subclass mode), with ``examples/`` on ``PYTHONPATH``:

    # PYTHONPATH=examples lopd fit -c configs/tiny.yaml -c my_task.yaml
    model:
      class_path: custom_task.ReverseWordLOPD
    data:
      class_path: lopd_lightning.data.OnPolicyDataModule
      init_args:
        task: {class_path: custom_task.ReverseWordTask, init_args: {val_fraction: 0.25}}
"""

from __future__ import annotations

from typing import Any

import lightning as L

from lopd_lightning.modules.lopd_callbacks import MarginSchedule, MemoryRefresh
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.memory import Experience
from lopd_lightning.modules import LOPDModule
from lopd_lightning.tasks import Example, Message, Task

WORDS = ("apple", "river", "cloud", "stone", "tiger", "lemon", "piano", "candle", "forest", "rocket", "garden", "silver")

#: the system prompt that :meth:`ReverseWordLOPD.build_messages` puts in front of every task.
SYSTEM_PROMPT = "You reverse words. Reply with the reversed word only."


class ReverseWordTask(Task):
    """Spell a word backwards; reward 1 when the reply contains the reversed word (case-insensitive).

    Args:
        words: the vocabulary; example ``i`` (id ``"reverse/i"``) reverses ``words[i]``.
        val_fraction: fraction of the examples held out for validation (seeded split).
        seed: seed of the split.
    """

    name = "reverse_word"

    def __init__(self, words: tuple[str, ...] = WORDS, *, val_fraction: float = 0.25, seed: int = 0):
        self.val_fraction, self.seed = val_fraction, seed
        self._all = [
            Example(id=f"reverse/{i}", text=f"Spell the word {w} backwards.", data={"word": w, "answer": w[::-1]})
            for i, w in enumerate(words)
        ]

    def all_examples(self) -> list[Example]:
        return self._all

    def initial_messages(self, example: Example) -> list[Message]:
        return [{"role": "user", "content": example.text}]

    def score(self, example: Example, completion: str) -> float:
        return 1.0 if example.data["answer"] in completion.lower() else 0.0

    def reference_solution(self, example: Example) -> str:
        return example.data["answer"]


def last_reply(messages: list[Message]) -> str:
    """The content of the last assistant message ("" when there is none)."""
    replies = [m for m in messages if m.get("role") == "assistant"]
    return str(replies[-1].get("content") or "").strip() if replies else ""


def shaped_reward(answer: str, reply: str, task_reward: float) -> float:
    """0.8 x the task's reward + 0.2 x brevity, with brevity = min(1, len(answer) / len(reply)) and 0 for an
    empty reply. In [0, 1]; 1 only for a correct reply no longer than the answer."""
    brevity = min(1.0, len(answer) / len(reply)) if reply else 0.0
    return 0.8 * float(task_reward) + 0.2 * brevity


class ReverseWordLOPD(LOPDModule):
    """LOPD with a system prompt, a shaped reward and answer-only experiences (the public hooks)."""

    def build_messages(self, task: Task, example: Example) -> list[Message]:
        """A system prompt, then the task's own first messages."""
        return [{"role": "system", "content": SYSTEM_PROMPT}, *task.initial_messages(example)]

    def score_trajectory(self, task: Task, example: Example, messages: list[Message], reward: float) -> float:
        """Prefer short answers: see :func:`shaped_reward`."""
        return shaped_reward(example.data["answer"], last_reply(messages), reward)

    def experience_from_trajectory(
        self, task: Task, example: Example, messages: list[Message], reward: float
    ) -> Experience | None:
        """Keep only the final answer as the trace; an empty reply leaves nothing in the bank."""
        reply = last_reply(messages)
        if not reply:
            return None
        return Experience(
            task_id=example.id, task_text=example.text, trace=f"[answer] {reply}", reward=float(reward),
            step=int(self.global_step),
        )


def build(**module_options: Any) -> tuple[ReverseWordLOPD, OnPolicyDataModule]:
    """A tiny ReverseWordLOPD (random Llama, LoRA student, hashing embedder) and its DataModule."""
    options: dict[str, Any] = dict(
        lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
        group_size=2,
        max_new_tokens=8,
        num_latents=4,
        num_experiences=2,
        composer_depth=2,
        max_experience_tokens=64,
        embedder="hashing",
        distill_top_k=8,
        learning_rate=1e-3,
        composer_lr=1e-3,
    )
    options.update(module_options)
    module = ReverseWordLOPD("tiny", **options)
    datamodule = OnPolicyDataModule(ReverseWordTask(), examples_per_step=2, val_limit=2, val_batch_size=2)
    return module, datamodule


def train(module: LOPDModule, datamodule: OnPolicyDataModule, *, max_steps: int = 2, callbacks=(), **trainer_options):
    """Fit for ``max_steps`` LOPD steps on CPU; returns the Trainer."""
    options: dict[str, Any] = dict(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
    )
    options.update(trainer_options)
    trainer = L.Trainer(callbacks=list(callbacks), **options)
    trainer.fit(module, datamodule)
    return trainer


def main() -> None:
    module, datamodule = build()
    # min_reward 0: every trajectory is offered to experience_from_trajectory, which decides
    callbacks = [MarginSchedule(), MemoryRefresh(every_n_steps=1, min_reward=0.0)]
    trainer = train(module, datamodule, callbacks=callbacks)
    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
    print(f"{trainer.global_step} steps; bank size {len(module.bank)}; {metrics}")


if __name__ == "__main__":
    main()
