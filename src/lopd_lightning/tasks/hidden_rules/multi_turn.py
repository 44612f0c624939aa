"""Hidden rules, multi-turn: the API answers a failed call with an error that states the broken rule, and the
agent retries.

The requests, tools, rules, splits and checker are :class:`~lopd_lightning.tasks.hidden_rules.task.HiddenRulesTask`'s.
An episode takes up to ``max_attempts`` replies (default 3): a reply whose calls pass the checker ends it with
reward 1.0; any other reply gets back one ``tool`` message, ``"Error: <what failed>"`` (for a broken rule
``"hidden rule of book_flight (date_format): date must be written DD/MM/YYYY; got '2025-03-03'"``), and the
agent may try again; after the last attempt the episode ends with reward 0.0. A failure on a plain tool (no
hidden rule) is answered the same way with what was wrong in the request (``"Error: invalid value for
'unit': 'kelvin'"``), never a rule. So an agent without experience
can still succeed, one attempt later than an agent that knew the rule, and the trajectory of such a
success shows the rule (in the error and in the corrected call) to whoever retrieves it.

References: ``references="rules"`` replays one reply (the rule kept: full marks at the first attempt);
``references="format_only"`` replays the documented-forms reply alone (on a plain tool it succeeds; else
the episode answers with the error and waits: an SFT warm start trains on that one reply, never on a corrected call that would carry the rule).
"""

from __future__ import annotations

from typing import Any

from lopd_lightning.tasks.base import Episode, Example, StepResult
from lopd_lightning.tasks.bfcl.prompt import DEFAULT_SYSTEM_PROMPT
from lopd_lightning.tasks.hidden_rules.task import HiddenRulesTask

__all__ = ["DEFAULT_RETRY_SYSTEM_PROMPT", "HiddenRulesEpisode", "HiddenRulesMultiTurnTask"]

#: The single-turn system text plus how retries work (``{tools}`` is replaced by the schemas).
DEFAULT_RETRY_SYSTEM_PROMPT = DEFAULT_SYSTEM_PROMPT + (
    "\n\nIf your calls fail, the error comes back to you: correct the calls and reply with all of them again."
)


class HiddenRulesMultiTurnTask(HiddenRulesTask):
    """:class:`HiddenRulesTask` with retries: each failed reply is answered with its error (module docstring).

    Args:
        max_attempts: replies per episode (>= 1; 1 is the single-turn task with an error message nobody
            reads). The task's ``max_turns`` is set to it.
        system_prompt: default :data:`DEFAULT_RETRY_SYSTEM_PROMPT`.
        **options: :class:`HiddenRulesTask`'s (``seed``, ``n_train``, ``n_heldout``, ``references``,
            ``show_tools``, ``rule_offset``).

    Raises:
        ValueError: ``max_attempts < 1``, or an option :class:`HiddenRulesTask` refuses.
    """

    name = "hidden_rules_multi_turn"
    multi_turn = True
    max_turns = 3

    def __init__(self, *, max_attempts: int = 3, system_prompt: str | None = None, **options: Any):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        super().__init__(system_prompt=DEFAULT_RETRY_SYSTEM_PROMPT if system_prompt is None else system_prompt,
                         **options)
        self.max_attempts = self.max_turns = max_attempts

    def reference_replies(self, example: Example) -> list[str]:
        """One reply: the rule kept (``references="rules"``) or the documented forms (``"format_only"``)."""
        return [self.reference_solution(example)]

    def start(self, example: Example) -> HiddenRulesEpisode:
        return HiddenRulesEpisode(self, example)


class HiddenRulesEpisode(Episode):
    """Up to ``task.max_attempts`` replies; reward 1.0 once a reply passes the checker.

    Attributes:
        attempts: replies so far. solved: a reply passed. done: the episode has ended.
    """

    def __init__(self, task: HiddenRulesMultiTurnTask, example: Example):
        self.task, self.example = task, example
        self.attempts, self.solved, self.done = 0, False, False

    def step(self, reply: str) -> StepResult:
        """Check the reply; answer a failure with ``{"role": "tool", "content": "Error: ..."}`` while attempts
        are left.

        Returns:
            ``info``: ``attempt`` (1-based); on a failure ``error`` (what failed) and ``rule`` (the broken
            rule's kind) when the hidden rule was broken (never on a plain tool).

        Raises:
            RuntimeError: the episode is done.
        """
        if self.done:
            raise RuntimeError(f"episode of {self.example.id!r} is done; start a new one")
        self.attempts += 1
        verdict = self.task.check(self.example, reply)
        info: dict[str, Any] = {"attempt": self.attempts}
        if verdict.valid:
            self.solved = self.done = True
            return StepResult(messages=[], done=True, info=info)
        info["error"] = verdict.error
        if verdict.rule:
            info["rule"] = verdict.rule
        if self.attempts >= self.task.max_attempts:
            self.done = True
            return StepResult(messages=[], done=True, info=info)
        return StepResult(messages=[{"role": "tool", "content": f"Error: {verdict.error}"}], done=False, info=info)

    def reward(self) -> float:
        """1.0 when a reply passed the checker, else 0.0."""
        return 1.0 if self.solved else 0.0
