"""The single-turn BFCL v4 tasks (Python categories): one reply of tool calls, scored by BFCL's AST rules.

The reply is read by :func:`~lopd_lightning.tasks.bfcl.calls.parse_tool_calls` and judged by
:func:`~lopd_lightning.tasks.bfcl.checker.check_tool_calls`; the system message is
:mod:`lopd_lightning.tasks.bfcl.prompt`'s.
"""

from __future__ import annotations

from typing import Any

from lopd_lightning.tasks.base import Example, Message, Task
from lopd_lightning.tasks.bfcl.calls import (
    format_tool_calls,
    parse_tool_calls,
    unparsed_reason,
)
from lopd_lightning.tasks.bfcl.checker import (
    CheckResult,
    check_tool_calls,
    reference_calls,
)
from lopd_lightning.tasks.bfcl.data import load_category, to_json_schema
from lopd_lightning.tasks.bfcl.prompt import (
    DEFAULT_SYSTEM_PROMPT,
    check_system_prompt,
    tools_system_text,
    with_system,
)

__all__ = ["CATEGORIES", "BFCLTask"]

#: Single-turn BFCL v4 categories this module serves (Python; Java/JavaScript are not supported).
CATEGORIES: tuple[str, ...] = (
    "simple_python",
    "multiple",
    "parallel",
    "parallel_multiple",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
)


class BFCLTask(Task):
    """A single-turn BFCL v4 category (Python): one reply of tool calls, scored by BFCL's AST rules.

    Examples come from ``bfcl_eval``'s ``BFCL_v4_<category>.json`` joined with
    ``possible_answer/BFCL_v4_<category>.json`` by id, in file order. ``Example.data`` holds
    ``question`` (the messages), ``functions`` (BFCL docs), ``ground_truth`` and ``category``.
    ``train``/``val`` come from :func:`~lopd_lightning.tasks.base.split_examples` (a seeded permutation).

    Reward: 1.0 when :func:`check_tool_calls` accepts the parsed reply, else 0.0 (BFCL's AST accuracy).

    Args:
        category: one of :data:`CATEGORIES` (e.g. "simple_python", "live_multiple").
        val_fraction: fraction of the examples in "val".
        seed: seed of the train/val permutation.
        system_prompt: the system text, with ``{tools}`` where the tool schemas go; default
            :data:`DEFAULT_SYSTEM_PROMPT` (SmolLM2's tool-use system text).

    Raises:
        ValueError: unknown category, or a system prompt without ``{tools}``.
    """

    multi_turn = False

    def __init__(
        self,
        category: str,
        *,
        val_fraction: float = 0.25,
        seed: int = 0,
        system_prompt: str | None = None,
    ):
        if category not in CATEGORIES:
            raise ValueError(f"unknown BFCL single-turn category {category!r}; use one of {CATEGORIES}")
        self.category = category
        self.name = f"bfcl_{category}"
        self.val_fraction, self.seed = val_fraction, seed
        self.system_prompt = check_system_prompt(DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt)
        self._all: list[Example] | None = None

    def all_examples(self) -> list[Example]:
        """Every entry of the category in the data file's order, joined with its ground truth."""
        if self._all is None:
            self._all = [self._example(entry) for entry in load_category(self.category)]
        return self._all

    def _example(self, entry: dict[str, Any]) -> Example:
        messages = [m for turn in entry["question"] for m in turn]
        text = "\n\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")
        data = {
            "question": messages,
            "functions": entry["function"],
            "ground_truth": entry["ground_truth"],
            "category": self.category,
        }
        return Example(id=entry["id"], text=text, data=data)

    def initial_messages(self, example: Example) -> list[Message]:
        system = tools_system_text(self.system_prompt, example.data["functions"])
        return with_system(system, example.data["question"])

    def tools(self, example: Example) -> None:
        """None: the schemas are already in the system message, in SmolLM2's ``<tools>`` format (see
        :meth:`tool_schemas`), so a chat template that renders tools must not show them a second time."""
        return None

    def tool_schemas(self, example: Example) -> list[dict[str, Any]]:
        """The functions as JSON Schema tools (``{"type": "function", "function": {...}}``)."""
        return [{"type": "function", "function": to_json_schema(f)} for f in example.data["functions"]]

    def reference_solution(self, example: Example) -> str:
        return format_tool_calls(reference_calls(example.data["ground_truth"], example.data["functions"]))

    def check(self, example: Example, completion: str) -> CheckResult:
        """The checker's verdict with its reason (for diagnostics); never raises."""
        try:
            calls = parse_tool_calls(completion)
            if calls is None:
                return CheckResult(False, unparsed_reason(completion))
            return check_tool_calls(
                calls,
                example.data["ground_truth"],
                example.data["functions"],
                category=self.category,
            )
        except Exception as err:  # a checker bug must not stop training; it shows up in verify
            return CheckResult(False, f"checker error: {type(err).__name__}: {err}")

    def score_with_info(self, example: Example, completion: str) -> tuple[float, dict[str, Any]]:
        """The reward and, when it is 0, ``{"error": the checker's reason}`` (e.g. "malformed tool call:
        ...", "function name 'f' not found (got 'g')", "wrong type for 'x': ...")."""
        verdict = self.check(example, completion)
        return (1.0, {}) if verdict.valid else (0.0, {"error": verdict.error})
