"""The Task protocol: what a new task implements.

A task is a set of examples, the student's first messages for each, an environment that answers the
student's replies, and a reward in [0, 1]. Single-turn tasks implement one of :meth:`Task.score` (the
reward) and :meth:`Task.score_with_info` (the reward and why), and the base derives the other; multi-turn
tasks set ``multi_turn = True`` (and ``max_turns``), override :meth:`Task.start` and return their own
:class:`Episode`.

The rollout loop, per example: ``episode = task.start(example)``, then ``messages =
task.initial_messages(example)`` (in this order: a method's hooked task hands the messages its ``start`` built
to that ``initial_messages``); then, until the episode is done or ``max_turns`` replies were made, the student
replies to ``messages`` and ``result = episode.step(reply)`` answers with a :class:`StepResult` whose
``messages`` (tool results, the next user turn) are appended; at the end ``episode.reward()``, read
through :func:`episode_reward` (which checks it and names the task and example when it is not in
[0, 1]), is the trajectory's reward and ``result.info`` of the last step is kept with the trajectory
(its ``"error"`` is shown as the checker's verdict in the logged samples). README "Your own task: the
Task contract" lists every attribute and method.

Messages follow the chat-template convention of transformers: ``{"role": "system" | "user" |
"assistant" | "tool", "content": str}``.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Literal

Message = dict[str, Any]
Split = Literal["train", "val", "all"]
SPLITS: tuple[str, ...] = ("train", "val", "all")

#: Characters of a tool result kept in an experience's observation-lite trace.
TRACE_RESULT_CHARS = 200


@dataclass(frozen=True)
class Example:
    """One task instance.

    Attributes:
        id: unique, stable identifier (e.g. ``"HumanEval/3"``, ``"live_simple_12-3-1"``).
        text: the task as a user would state it; what the experience bank embeds and retrieves by.
        data: task-specific payload (tests, ground truth, tool schemas, initial environment config).
    """

    id: str
    text: str
    data: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass
class StepResult:
    """What the environment answers to one assistant reply.

    Attributes:
        messages: new messages to append after the reply (tool results, the user's next turn);
            empty when the episode is done.
        done: True when the episode has ended; :meth:`Episode.reward` is then final.
        info: free-form diagnostics (e.g. ``{"error": "..."}`` for a failed tool call).
    """

    messages: list[Message]
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


def check_reward(value: Any, *, task: str, example_id: str) -> float:
    """``value`` as a float in [0, 1], or a ValueError naming the task and the example.

    Args:
        value: a reward (any real number type).
        task: the task's name. example_id: the example's id.

    Returns:
        ``float(value)``.

    Raises:
        ValueError: ``value`` is not a real number, is NaN, or lies outside [0, 1].
    """
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"task {task!r} returned a reward of type {type(value).__name__} for example {example_id!r}; "
            "rewards must be numbers in [0, 1]"
        ) from None
    if not (0.0 <= reward <= 1.0) or math.isnan(reward):
        raise ValueError(
            f"task {task!r} returned reward {reward!r} for example {example_id!r}; rewards must be in [0, 1]"
        )
    return reward


def episode_reward(task: Any, example: Any, episode: Any) -> float:
    """The reward of ``episode`` (an episode of ``example`` that ``task.start`` made), checked.

    Every caller that reads a reward (the episode loop, the reference trajectory, ``lopd tasks verify``)
    reads it through this function, so a broken environment stops the run where it happens instead of
    poisoning the advantages.

    Returns:
        ``float(episode.reward())`` in [0, 1].

    Raises:
        ValueError: the reward is not a real number, is NaN or lies outside [0, 1]; the message names the
            task and the example (:func:`check_reward`).
    """
    name = str(getattr(task, "name", type(task).__name__))
    return check_reward(episode.reward(), task=name, example_id=str(getattr(example, "id", "<unknown example>")))


def replay_references(task: Any, example: Any, messages: list[Message]) -> tuple[list[Message], float]:
    """``task.reference_replies(example)`` replayed through a fresh episode (``task.start(example)``) after the
    first ``messages``, until the episode is done: (the whole conversation: ``messages``, each reply and the
    observations it got; the episode's reward through :func:`episode_reward`). ``messages`` is not changed."""
    conversation = [dict(m) for m in messages]
    episode = task.start(example)
    for reply in task.reference_replies(example):
        result = episode.step(reply)
        conversation.append({"role": "assistant", "content": reply})
        conversation.extend(result.messages)
        if result.done:
            break
    return conversation, episode_reward(task, example, episode)


class Episode(abc.ABC):
    """A live environment for one example. Created by :meth:`Task.start`.

    :meth:`reward` returns the value as the environment computes it; whoever reads it (the episode loop
    of :func:`lopd_lightning.rollout.generate_rollouts`, the reference trajectory, ``lopd tasks verify``)
    reads it through :func:`episode_reward`, which raises ValueError naming the task and the example for
    a value outside [0, 1] (or NaN), so a broken environment stops the run where it happens instead of
    poisoning the advantages. A subclass's methods are called as written: the base class wraps nothing.
    """

    @abc.abstractmethod
    def step(self, reply: str) -> StepResult:
        """Feed one assistant reply (decoded text, no special tokens); return the observation."""

    @abc.abstractmethod
    def reward(self) -> float:
        """The trajectory's reward in [0, 1]; callable at any time, final once ``done``."""


class SingleTurnEpisode(Episode):
    """One reply, scored by :meth:`Task.score_with_info`; done after the first step."""

    def __init__(self, task: Task, example: Example):
        self.task, self.example = task, example
        self._reward: Any = None
        self._done = False

    def step(self, reply: str) -> StepResult:
        """Score ``reply`` with :meth:`Task.score_with_info`; done. ``info`` carries the task's
        diagnostics (e.g. ``{"error": "..."}`` for a malformed reply). The score is checked where it is
        read (:func:`episode_reward`).

        Raises:
            RuntimeError: the episode is done.
        """
        if self._done:
            raise RuntimeError(f"episode of {self.example.id!r} is done; start a new one")
        self._reward, info = self.task.score_with_info(self.example, reply)
        self._done = True
        return StepResult(messages=[], done=True, info=dict(info))

    def reward(self) -> float:
        """The score of the reply as :meth:`Task.score_with_info` gave it (0.0 before the reply); read it
        through :func:`episode_reward`, which checks it."""
        return 0.0 if self._reward is None else self._reward


def _implementation(cls: type, name: str) -> Any:
    """The function ``name`` ("score" or "score_with_info") of the nearest class in ``cls``'s MRO that implements
    it itself (neither :class:`Task`'s default nor the derived copy :meth:`Task.__init_subclass__` puts on a
    class), or None when no class does."""
    default = vars(Task)[name]
    for klass in cls.__mro__:
        function = vars(klass).get(name)
        if function is not None and function is not default:
            return function
    return None


class Task(abc.ABC):
    """Base class of every task. Subclass it and implement the abstract methods.

    ``examples(split)`` must be deterministic: the same list in the same order on every call and
    machine (splits are fixed by a seeded permutation of the ids, documented by each task).
    """

    #: registry name (``get_task(name)``).
    name: str = "task"
    #: True when the environment answers with tool results or further user turns (the episode of
    #: :meth:`start` then takes several replies; without it an episode gets one reply).
    multi_turn: bool = False
    #: the most replies per episode (None: 8 when ``multi_turn``, else 1); ``model.init_args.max_turns``
    #: overrides it. An episode that has not said ``done`` by then is cut (``truncation="max_turns"``,
    #: with a warning naming these attributes once per task).
    max_turns: int | None = None

    #: fraction of :meth:`all_examples` held out as "val" (:func:`split_examples`).
    val_fraction: float = 0.25
    #: seed of the train/val permutation.
    seed: int = 0

    @abc.abstractmethod
    def all_examples(self) -> list[Example]:
        """Every example of the task in a fixed order (e.g. the data file's); cache it if loading is slow."""

    def examples(self, split: Split = "train") -> list[Example]:
        """The examples of ``split`` ("train", "val" or "all"), deterministic.

        Default: :func:`split_examples` of :meth:`all_examples` by ``val_fraction`` and ``seed``; override
        for a task with splits of its own.

        Raises:
            ValueError: unknown split.
        """
        self.check_split(split)
        return split_examples(self.all_examples(), split, val_fraction=self.val_fraction, seed=self.seed)

    @abc.abstractmethod
    def initial_messages(self, example: Example) -> list[Message]:
        """The student's first messages (system and/or user) for ``example``."""

    def tools(self, example: Example) -> list[dict[str, Any]] | None:
        """Tool schemas for the chat template to render (its ``tools=`` argument), or None.

        Return None when the task writes the tools into its own system message (the BFCL tasks do,
        because SmolLM2's packaged template does not render tools), so they are not shown twice.
        """
        return None

    @abc.abstractmethod
    def reference_solution(self, example: Example) -> str:
        """The ground truth written as the assistant would write it (OPSD's privileged context).

        For multi-turn tasks this is the replies of :meth:`reference_replies` joined by blank lines.
        """

    def example_category(self, example: Example) -> str | None:
        """The category ``example`` belongs to, for per-category breakdowns of held-out success
        (``benchmarks/compare.py``'s ``heldout_by_category``), or None (the default: no categories).

        ``hidden_rules`` returns the kind of its tool's hidden rule (``"none"`` for a plain tool).
        """
        return None

    def reference_replies(self, example: Example) -> list[str]:
        """The assistant replies that replay the ground truth through :meth:`start`'s episode.

        Single-turn tasks: ``[reference_solution(example)]``. Multi-turn tasks override this.
        """
        return [self.reference_solution(example)]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Keep :meth:`score` and :meth:`score_with_info` one computation: the one a class defines is the source,
        and the other is the base's, derived from it (a subclass of a ``score`` task that defines
        ``score_with_info`` gets a ``score`` that reads it, and the other way round). A derived method reads the
        nearest class of the MRO that implements the other one (:func:`_implementation`), so an override that
        calls ``super().score(...)`` or ``super().score_with_info(...)`` reaches its parent's computation.

        Raises:
            TypeError: the class defines both (the message says to keep one).
        """
        super().__init_subclass__(**kwargs)
        own = [name for name in ("score", "score_with_info") if name in vars(cls)]
        if len(own) == 2:
            raise TypeError(f"{cls.__name__} defines both score and score_with_info: a task implements one of them "
                            "(score_with_info to say why a reply failed) and the other is derived from it; drop one")
        if own == ["score"] and cls.score_with_info is not Task.score_with_info:
            cls.score_with_info = Task.score_with_info  # a base's score_with_info would ignore this score
        elif own == ["score_with_info"] and cls.score is not Task.score:
            cls.score = Task.score  # a base's score would ignore this score_with_info

    def score(self, example: Example, completion: str) -> float:
        """Reward in [0, 1] of one assistant reply (single-turn tasks). Never raises on bad text
        (empty or whitespace-only replies included: they score 0).

        A single-turn task implements exactly one of this and :meth:`score_with_info` (a class that defines
        both is refused: :meth:`__init_subclass__`); the base derives the other. Default: the reward of
        :meth:`score_with_info`. The rollout reads :meth:`score_with_info`; this is the plain reward, for
        callers that want only the number.

        The value is checked where it is read: :func:`episode_reward` (the episode loop, ``lopd tasks
        verify``) raises ValueError naming the task and the example if it is outside [0, 1]
        (:func:`check_reward`).

        Raises:
            NotImplementedError: the task implements neither (the message names the class, and says a
                multi-turn task uses ``start(example).step(...)`` instead).
        """
        source = _implementation(type(self), "score_with_info")
        if source is not None:
            return source(self, example, completion)[0]
        if self.multi_turn:
            raise NotImplementedError(f"{type(self).__name__} is multi-turn: use start(example).step(...)")
        raise NotImplementedError(
            f"{type(self).__name__} implements neither score(example, completion) nor score_with_info(example, "
            f"completion), one of which a single-turn task (multi_turn = False) must; a multi-turn task sets "
            f"multi_turn = True and overrides start(example)"
        )

    def score_with_info(self, example: Example, completion: str) -> tuple[float, dict[str, Any]]:
        """The reward of one reply and diagnostics for :class:`StepResult.info` (single-turn tasks): what a
        single-turn episode reads (:class:`SingleTurnEpisode`).

        Implement this instead of :meth:`score` to explain a low score, e.g. ``(0.0, {"error": "malformed tool
        call: ..."})``; the rollout records ``info["error"]`` with the trajectory. Default: ``(score(...), {})``.

        Raises:
            NotImplementedError: the task implements neither (:meth:`score`'s message).
        """
        source = _implementation(type(self), "score")
        if source is None:
            return Task.score(self, example, completion), {}  # raises: neither is implemented
        return source(self, example, completion), {}

    def start(self, example: Example) -> Episode:
        """A fresh environment for ``example``. Single-turn tasks get a :class:`SingleTurnEpisode`."""
        return SingleTurnEpisode(self, example)

    def experience_text(self, example: Example, messages: list[Message]) -> str:
        """The text of an experience for the bank: the task and an observation-lite trace.

        The trace keeps every assistant action whole and the first ``TRACE_RESULT_CHARS`` characters of
        each tool result; system and initial user messages are left out (the task text stands for
        them). Source: docs/METHOD.md section 2 ("observation-lite" trajectories).
        """
        n_initial = len(self.initial_messages(example))
        lines = []
        for message in messages[n_initial:]:
            role, content = message["role"], str(message.get("content") or "")
            if role == "tool":
                short = content if len(content) <= TRACE_RESULT_CHARS else content[:TRACE_RESULT_CHARS] + "..."
                lines.append(f"[result] {short}")
            elif role == "user":
                lines.append(f"[user] {content}")
            elif role == "assistant":
                lines.append(f"[action] {content}")
        return f"Task:\n{example.text}\n\nTrajectory:\n" + "\n".join(lines)

    def check_split(self, split: str) -> None:
        """Raise ValueError unless ``split`` is one of ``SPLITS``."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r} for task {self.name!r}; use one of {SPLITS}")


def split_examples(examples: list[Example], split: str, *, val_fraction: float, seed: int = 0) -> list[Example]:
    """Deterministic train/val split by a seeded permutation of the examples' order.

    Args:
        examples: all examples, in a fixed order (e.g. the dataset's file order).
        split: "train", "val" or "all".
        val_fraction: fraction in (0, 1) of the examples that go to "val" (rounded up, at least 1).
        seed: seed of the permutation; the same seed gives the same split on every machine.

    Returns:
        The split's examples, in the original order.

    Raises:
        ValueError: unknown split or val_fraction outside (0, 1).
    """
    import math
    import random

    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    if split == "all":
        return list(examples)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_val = min(len(examples), max(1, math.ceil(val_fraction * len(examples))))
    val = set(order[:n_val])
    return [ex for i, ex in enumerate(examples) if (i in val) == (split == "val")]


#: replies an episode gets when neither the method nor the task sets a limit
DEFAULT_MAX_TURNS = {True: 8, False: 1}


def turn_limit(task: Task, max_turns: int | None = None, *, given_by: str = "model.init_args.max_turns") -> tuple[int, str]:
    """``(limit, where it comes from)``: the most replies an episode of ``task`` gets.

    The rule every episode loop follows (:func:`lopd_lightning.rollout.generate_rollouts` and
    ``lopd tasks verify``): ``max_turns`` when given (the method's ``model.init_args.max_turns``), else
    the task's ``max_turns`` attribute, else 8 for a ``multi_turn`` task and 1 for the others.

    Args:
        given_by: how the source of an explicit ``max_turns`` is named in messages.

    Raises:
        ValueError: a limit below 1.
    """
    if max_turns is not None:
        limit, source = int(max_turns), given_by
    elif getattr(task, "max_turns", None):
        limit, source = int(task.max_turns), "the task's max_turns attribute"
    else:
        limit = DEFAULT_MAX_TURNS[bool(task.multi_turn)]
        source = f"the default for {'multi-turn' if task.multi_turn else 'single-turn'} tasks"
    if limit < 1:
        raise ValueError(f"max_turns must be >= 1, got {limit}")
    return limit, source
