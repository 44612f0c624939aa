"""Tasks: the Task protocol and the shipped tasks (HumanEval, BFCL v4, a toy task, made-up facts, and tool use
with rules that only experience reveals: ``hidden_rules``).

``get_task(name, **options)`` builds a task by its registry name; a user's own task is any
:class:`Task` subclass, named in a config by its class path.
"""

from __future__ import annotations

import importlib
from typing import Any

from lopd_lightning.tasks.base import (
    SPLITS,
    Episode,
    Example,
    Message,
    SingleTurnEpisode,
    StepResult,
    Task,
    check_reward,
    episode_reward,
    replay_references,
    split_examples,
)

# name -> (module, class, fixed keyword options)
_REGISTRY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "humaneval": ("lopd_lightning.tasks.code", "HumanEvalTask", {}),
    "bfcl_simple_python": ("lopd_lightning.tasks.bfcl.single_turn", "BFCLTask", {"category": "simple_python"}),
    "bfcl_multiple": ("lopd_lightning.tasks.bfcl.single_turn", "BFCLTask", {"category": "multiple"}),
    "bfcl_parallel": ("lopd_lightning.tasks.bfcl.single_turn", "BFCLTask", {"category": "parallel"}),
    "bfcl_parallel_multiple": ("lopd_lightning.tasks.bfcl.single_turn", "BFCLTask", {"category": "parallel_multiple"}),
    "bfcl_live_simple": ("lopd_lightning.tasks.bfcl.single_turn", "BFCLTask", {"category": "live_simple"}),
    "bfcl_live_multiple": ("lopd_lightning.tasks.bfcl.single_turn", "BFCLTask", {"category": "live_multiple"}),
    "bfcl_multi_turn_base": ("lopd_lightning.tasks.bfcl.multi_turn", "BFCLMultiTurnTask", {"category": "multi_turn_base"}),
    "toy": ("lopd_lightning.tasks.toy", "ToyTask", {}),
    "facts": ("lopd_lightning.tasks.facts", "FactsTask", {}),
    "hidden_rules": ("lopd_lightning.tasks.hidden_rules.task", "HiddenRulesTask", {}),
    "hidden_rules_multi_turn": ("lopd_lightning.tasks.hidden_rules.multi_turn", "HiddenRulesMultiTurnTask", {}),
}

TASK_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def get_task(name: str, **options: Any) -> Task:
    """Build a task by registry name.

    Args:
        name: one of ``TASK_NAMES``.
        **options: keyword options of the task's constructor (e.g. ``val_fraction``, ``seed``).

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)} (or give a Task subclass)")
    module, cls, fixed = _REGISTRY[name]
    task_cls = getattr(importlib.import_module(module), cls)
    return task_cls(**fixed, **options)


__all__ = [
    "SPLITS",
    "TASK_NAMES",
    "Episode",
    "Example",
    "Message",
    "SingleTurnEpisode",
    "StepResult",
    "Task",
    "check_reward",
    "episode_reward",
    "get_task",
    "replay_references",
    "split_examples",
]
