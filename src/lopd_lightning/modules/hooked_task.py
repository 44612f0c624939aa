"""The task as a method sees it: a :class:`~lopd_lightning.tasks.Task` seen through the module's hooks.

:func:`~lopd_lightning.rollout.generate_rollouts` knows only the Task interface. A method lets its user
adapt it to a task through two public hooks of
:class:`~lopd_lightning.modules.base.OnPolicyModule` (README "Your own task"):

- ``build_messages(task, example)``: the student's first messages for an example;
- ``score_trajectory(task, example, messages, reward)``: the reward in [0, 1] of a finished trajectory,
  given the whole conversation and what the task's own episode returned.

:class:`ModuleHookedTask` is the one place where those hooks enter the rollout loop: its
``initial_messages`` is ``hooks.build_messages`` and its episodes' ``reward`` is ``hooks.score_trajectory``
of the task's own (checked) reward. ``build_messages`` runs once per episode: the messages ``start`` builds are
the ones the next ``initial_messages`` of that example returns (the rollout loop asks for them right after
``start``), so a hook that draws (say, few-shot examples at random) prompts the student with the conversation
that ``score_trajectory`` later receives. Everything else is the wrapped task's. Training rollouts and
validation episodes both run on it (:meth:`OnPolicyModule.make_batch`,
:meth:`OnPolicyModule.evaluate_examples`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lopd_lightning.tasks import Episode, Example, Message, StepResult, Task, episode_reward

__all__ = ["ModuleHookedEpisode", "ModuleHookedTask", "TrajectoryHooks"]


@runtime_checkable
class TrajectoryHooks(Protocol):
    """The two hooks a :class:`ModuleHookedTask` calls (every ``OnPolicyModule`` implements them)."""

    def build_messages(self, task: Task, example: Example) -> list[Message]:
        """The student's first messages for ``example``."""
        ...

    def score_trajectory(self, task: Task, example: Example, messages: list[Message], reward: float) -> float:
        """The reward in [0, 1] of a finished trajectory (``reward``: what the task's episode returned)."""
        ...


class ModuleHookedEpisode(Episode):
    """An episode of the wrapped task whose reward goes through ``hooks.score_trajectory``.

    Args:
        hooks: the module (``score_trajectory`` scores the recorded conversation).
        task, example: the wrapped task and the episode's example.
        inner: the wrapped task's own episode (``task.start(example)``), which answers every reply.
        messages: the first messages of the recorded conversation (``hooks.build_messages``' for it).

    Attributes:
        messages: the whole conversation so far (first messages, replies, observations), what
            ``score_trajectory`` receives.
    """

    def __init__(self, hooks: TrajectoryHooks, task: Task, example: Example, inner: Episode, messages: list[Message]):
        self.hooks, self.task, self.example, self.inner = hooks, task, example, inner
        self.messages: list[Message] = [dict(m) for m in messages]

    def step(self, reply: str) -> StepResult:
        """The wrapped episode's answer to ``reply``; the reply and the answer's messages are recorded."""
        result = self.inner.step(reply)
        self.messages.append({"role": "assistant", "content": reply})
        self.messages.extend(result.messages)
        return result

    def reward(self) -> float:
        """``hooks.score_trajectory`` of the conversation and of the wrapped episode's reward, read through
        :func:`~lopd_lightning.tasks.episode_reward` (ValueError when the task's reward is outside [0, 1])."""
        inner_reward = episode_reward(self.task, self.example, self.inner)
        return self.hooks.score_trajectory(self.task, self.example, self.messages, inner_reward)


class ModuleHookedTask(Task):
    """``task`` whose first messages and rewards come from ``hooks`` (see the module docstring).

    Args:
        task: the task to wrap; its name, ``multi_turn``, ``max_turns``, examples, tools, references and
            experience text are passed through unchanged.
        hooks: an object with ``build_messages`` and ``score_trajectory`` (:class:`TrajectoryHooks`).
    """

    def __init__(self, task: Task, hooks: TrajectoryHooks):
        self.task, self.hooks = task, hooks
        self.name, self.multi_turn = task.name, task.multi_turn
        # a task's own turn limit, read by generate_rollouts when the method sets none
        self.max_turns = getattr(task, "max_turns", None)
        self._started: tuple[str, list[Message]] | None = None  # the last start's (example id, first messages)

    def all_examples(self) -> list[Example]:
        return self.task.all_examples()

    def examples(self, split: Any = "train") -> list[Example]:
        return self.task.examples(split)

    def initial_messages(self, example: Example) -> list[Message]:
        """``hooks.build_messages(task, example)``: the messages the last :meth:`start` of this example built (a
        copy, handed out once), else a new call."""
        started, self._started = self._started, None
        if started is not None and started[0] == example.id:
            return [dict(m) for m in started[1]]
        return self.hooks.build_messages(self.task, example)

    def tools(self, example: Example) -> list[dict[str, Any]] | None:
        return self.task.tools(example)

    def reference_solution(self, example: Example) -> str:
        return self.task.reference_solution(example)

    def reference_replies(self, example: Example) -> list[str]:
        return self.task.reference_replies(example)

    def start(self, example: Example) -> ModuleHookedEpisode:
        """A :class:`ModuleHookedEpisode` around ``task.start(example)``, its conversation starting with
        ``hooks.build_messages(task, example)`` (kept for the next :meth:`initial_messages` of this example)."""
        messages = list(self.hooks.build_messages(self.task, example))
        self._started = (example.id, messages)
        return ModuleHookedEpisode(self.hooks, self.task, example, self.task.start(example), messages)

    def experience_text(self, example: Example, messages: list[Message]) -> str:
        return self.task.experience_text(example, messages)
