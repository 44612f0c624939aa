"""BFCL v4 multi-turn: a live environment of BFCL's tool classes, scored as BFCL's multi-turn checker does.

An episode instantiates the entry's tool classes (``GorillaFileSystem``, ``TwitterAPI``, ``TradingBot``,
...; shipped by ``bfcl_eval`` in ``eval_checker/multi_turn_eval/func_source_code/``) fresh, loads the
entry's ``initial_config`` into them, and gives the first user turn. Each assistant reply is parsed with
:func:`~lopd_lightning.tasks.bfcl.calls.parse_tool_calls`:

- calls: each is run on the instances (function name -> public method of an involved class); the
  results come back as ``tool`` messages; the turn goes on;
- no calls (prose, ``[]``, or an unparseable reply): the assistant has ended its turn; the next user
  turn comes back, or the episode is done after the last one.

A turn also ends after ``max_steps_per_turn`` replies (the last reply's calls still run).

Scoring follows ``bfcl_eval/eval_checker/multi_turn_eval/multi_turn_checker.py`` (read, not imported).
When a turn ends, its ground-truth calls run on a second, parallel set of instances; the turn passes
when (a turn with no ground-truth calls always passes):

- the model made at least one call in the turn;
- state: every public attribute of every ground-truth instance equals the model instance's;
- response: the ground-truth calls' results (of this turn) all appear, as a multiset, among the results
  of every call the model made so far (all turns: a result fetched earlier counts).

``reward_mode="all_turns"`` (default, BFCL's accuracy): 1.0 when every turn passed, else 0.0.
``reward_mode="fraction"``: the fraction of turns passed (docs/METHOD.md's "fraction of sub-goals met").
Both are also in every step's ``info`` (``turns_passed``, ``fraction_passed``).

Differences from BFCL's inference loop and checker:

- BFCL allows 20 steps per turn and, when a turn runs past them, ends the whole entry as failed; here a
  turn that reaches ``max_steps_per_turn`` ends and is checked like any other.
- Calls are run by method lookup, not by ``eval`` of a call string, with the same results
  (:class:`~lopd_lightning.tasks.bfcl.environment.ToolEnvironment`); ``Class.method`` is accepted as
  a name for ``method`` of an involved class.
"""

from __future__ import annotations

from typing import Any, Literal

from lopd_lightning.tasks.base import Episode, Example, Message, StepResult, Task
from lopd_lightning.tasks.bfcl.calls import (
    ToolCall,
    format_tool_calls,
    parse_tool_calls,
    unparsed_reason,
)
from lopd_lightning.tasks.bfcl.data import (
    load_category,
    load_multi_turn_func_docs,
    to_json_schema,
)
from lopd_lightning.tasks.bfcl.environment import (
    ERROR_PREFIX,
    ToolEnvironment,
    missing_results,
    parse_ground_truth_call,
    state_differences,
)
from lopd_lightning.tasks.bfcl.prompt import (
    DEFAULT_SYSTEM_PROMPT,
    check_system_prompt,
    tools_system_text,
    with_system,
)

__all__ = [
    "CATEGORIES",
    "DEFAULT_MULTI_TURN_SYSTEM_PROMPT",
    "END_OF_TURN_REPLY",
    "BFCLMultiTurnEpisode",
    "BFCLMultiTurnTask",
    "RewardMode",
]

#: The single-turn system text plus how turns work here (``{tools}`` is replaced by the schemas).
DEFAULT_MULTI_TURN_SYSTEM_PROMPT = DEFAULT_SYSTEM_PROMPT + (
    "\n\nThe results of your tool calls come back to you. At each turn, keep calling tools until you have "
    "fulfilled the user's request as well as you can. When you have no more calls to make, reply with a "
    "short message without a <tool_call>: that ends your turn."
)

#: Multi-turn categories served; the others need holdout functions (miss_func) or are not Python tools.
CATEGORIES: tuple[str, ...] = ("multi_turn_base", "multi_turn_long_context", "multi_turn_miss_param")

#: The text reply that ends a turn in the reference replies.
END_OF_TURN_REPLY = "Done."

RewardMode = Literal["all_turns", "fraction"]


class BFCLMultiTurnTask(Task):
    """BFCL v4 multi-turn (``multi_turn_base`` by default) as a live multi-turn environment.

    ``Example.data``: ``question`` (user turns, each a list of messages), ``initial_config``,
    ``involved_classes``, ``functions`` (BFCL docs of the involved classes' methods), ``ground_truth``
    (per turn, BFCL's Python call strings) and ``category``. ``Example.text`` is the first user turn.
    ``train``/``val`` come from :func:`~lopd_lightning.tasks.base.split_examples`.

    Args:
        category: one of :data:`CATEGORIES`.
        val_fraction: fraction of the examples in "val".
        seed: seed of the train/val permutation.
        system_prompt: the system text with ``{tools}``; default :data:`DEFAULT_MULTI_TURN_SYSTEM_PROMPT`.
        max_steps_per_turn: assistant replies allowed per user turn before the turn is ended (>= 1).
            multi_turn_base's ground-truth turns hold up to 7 calls (long_context: 34), so a model
            that makes one call per reply needs up to 8 replies there.
        reward_mode: "all_turns" (BFCL's binary accuracy) or "fraction" (turns passed / turns).
        max_result_chars: characters of a tool result shown to the model (the checker sees all of it).

    Raises:
        ValueError: unknown category or reward mode, ``max_steps_per_turn < 1``, or a system prompt
            without ``{tools}``.
    """

    multi_turn = True
    #: replies per episode: the longest ground truth of multi_turn_base takes 14 replies (one call each),
    #: the shipped BFCL configs allow 32 (``model.init_args.max_turns`` overrides it)
    max_turns = 32

    def __init__(
        self,
        category: str = "multi_turn_base",
        *,
        val_fraction: float = 0.25,
        seed: int = 0,
        system_prompt: str | None = None,
        max_steps_per_turn: int = 10,
        reward_mode: RewardMode = "all_turns",
        max_result_chars: int = 2000,
    ):
        if category not in CATEGORIES:
            raise ValueError(f"unknown BFCL multi-turn category {category!r}; use one of {CATEGORIES}")
        if reward_mode not in ("all_turns", "fraction"):
            raise ValueError(f"reward_mode must be 'all_turns' or 'fraction', got {reward_mode!r}")
        if max_steps_per_turn < 1:
            raise ValueError(f"max_steps_per_turn must be >= 1, got {max_steps_per_turn}")
        self.category = category
        self.name = f"bfcl_{category}"
        self.val_fraction, self.seed = val_fraction, seed
        default = DEFAULT_MULTI_TURN_SYSTEM_PROMPT
        self.system_prompt = check_system_prompt(default if system_prompt is None else system_prompt)
        self.max_steps_per_turn = max_steps_per_turn
        self.reward_mode: RewardMode = reward_mode
        self.max_result_chars = max_result_chars
        self.long_context = category == "multi_turn_long_context"
        self._all: list[Example] | None = None
        self._docs: dict[str, list[dict[str, Any]]] = {}

    def all_examples(self) -> list[Example]:
        """Every entry of the category in the data file's order, joined with its ground truth."""
        if self._all is None:
            self._all = [self._example(entry) for entry in load_category(self.category)]
        return self._all

    def _example(self, entry: dict[str, Any]) -> Example:
        functions = []
        for class_name in entry["involved_classes"]:
            if class_name not in self._docs:
                self._docs[class_name] = load_multi_turn_func_docs(class_name)
            functions.extend(self._docs[class_name])
        first = entry["question"][0]
        text = "\n\n".join(str(m.get("content") or "") for m in first if m.get("role") == "user")
        data = {
            "question": entry["question"],
            "initial_config": entry["initial_config"],
            "involved_classes": entry["involved_classes"],
            "functions": functions,
            "ground_truth": entry["ground_truth"],
            "category": self.category,
        }
        return Example(id=entry["id"], text=text, data=data)

    def initial_messages(self, example: Example) -> list[Message]:
        system = tools_system_text(self.system_prompt, example.data["functions"])
        return with_system(system, example.data["question"][0])

    def tools(self, example: Example) -> None:
        """None: the schemas are already in the system message, in SmolLM2's ``<tools>`` format (see
        :meth:`tool_schemas`), so a chat template that renders tools must not show them a second time."""
        return None

    def tool_schemas(self, example: Example) -> list[dict[str, Any]]:
        """The involved classes' methods as JSON Schema tools (``{"type": "function", "function": ...}``)."""
        return [{"type": "function", "function": to_json_schema(f)} for f in example.data["functions"]]

    def ground_truth_calls(self, example: Example) -> list[list[ToolCall]]:
        """Per user turn, the ground-truth calls parsed from BFCL's call strings."""
        classes = example.data["involved_classes"]
        return [[parse_ground_truth_call(s, classes) for s in turn] for turn in example.data["ground_truth"]]

    def reference_replies(self, example: Example) -> list[str]:
        """Per user turn: one reply with all its ground-truth calls, then :data:`END_OF_TURN_REPLY`
        (only the latter for a turn without ground-truth calls)."""
        replies = []
        for calls in self.ground_truth_calls(example):
            if calls:
                replies.append(format_tool_calls(calls))
            replies.append(END_OF_TURN_REPLY)
        return replies

    def reference_solution(self, example: Example) -> str:
        return "\n\n".join(self.reference_replies(example))

    def start(self, example: Example) -> BFCLMultiTurnEpisode:
        return BFCLMultiTurnEpisode(self, example)


class BFCLMultiTurnEpisode(Episode):
    """One live BFCL multi-turn entry; see the module docstring for the protocol and the scoring.

    Attributes:
        turn: index of the current user turn (== number of turns when done).
        done: True after the last turn ended.
        turn_passed: per ended turn, whether it passed the checks.
        turn_errors: per ended turn, why it failed ("" when it passed).
    """

    def __init__(self, task: BFCLMultiTurnTask, example: Example):
        self.task, self.example = task, example
        data = example.data
        self._turns: list[list[Message]] = data["question"]
        self._truth_calls = task.ground_truth_calls(example)
        if len(self._truth_calls) != len(self._turns):
            raise ValueError(f"{example.id}: {len(self._turns)} user turns but {len(self._truth_calls)} truth turns")
        classes, config = data["involved_classes"], data["initial_config"]
        self.model_env = ToolEnvironment(classes, config, long_context=task.long_context)
        self.truth_env = ToolEnvironment(classes, config, long_context=task.long_context)
        self.turn = 0
        self.done = False
        self.turn_passed: list[bool] = []
        self.turn_errors: list[str] = []
        self._steps = 0  # replies in the current turn
        self._called = False  # a call was made in the current turn
        self._model_results: list[str] = []  # every model call's result, all turns

    @property
    def fraction_passed(self) -> float:
        """Turns passed / turns in the entry (turns not yet ended count as not passed)."""
        return sum(self.turn_passed) / len(self._turns)

    def step(self, reply: str) -> StepResult:
        """Run the reply's calls, or end the turn; see the module docstring.

        Returns:
            ``messages``: one ``{"role": "tool", "name", "content"}`` per call (results cut to
            ``max_result_chars``), then the next user turn's messages when the turn ended; empty when
            done. ``info``: ``turn`` (index of the turn the reply belongs to), ``n_calls``, ``parsed``
            (the reply read as calls, ``[]`` included), ``turn_ended``, ``turn_passed`` and ``error``
            (why it failed) when the turn ended, ``forced_end_of_turn`` when ``max_steps_per_turn`` ended
            it, and always ``turns_passed`` and ``fraction_passed``. ``tool_errors``: per call that
            failed (unknown function, wrong arguments, the tool raised), ``"name: Error during
            execution: ..."``; the episode goes on with that text as the call's result. ``error``: all
            that went wrong in this step, joined by "; " (a malformed tool call, the tool errors, why
            the ended turn failed); absent when nothing did.

        Raises:
            RuntimeError: the episode is done.
        """
        if self.done:
            raise RuntimeError(f"episode of {self.example.id!r} is done; start a new one")
        calls = parse_tool_calls(reply)
        turn = self.turn
        self._steps += 1
        messages: list[Message] = []
        info: dict[str, Any] = {"turn": turn, "n_calls": len(calls or []), "parsed": calls is not None}
        errors: list[str] = []
        if calls is None and unparsed_reason(reply).startswith("malformed"):
            errors.append(unparsed_reason(reply))  # a malformed call ends the turn, like prose
        if calls:
            self._called = True
            tool_errors = []
            for call in calls:
                result = self.model_env.execute(call)
                self._model_results.append(result)
                if result.startswith(ERROR_PREFIX):
                    tool_errors.append(f"{call.name}: {result}")
                messages.append({"role": "tool", "name": call.name, "content": self._shown(result)})
            if tool_errors:
                info["tool_errors"] = tool_errors
                errors.extend(tool_errors)
            if self._steps < self.task.max_steps_per_turn:
                if errors:
                    info["error"] = "; ".join(errors)[:1000]
                return StepResult(messages=messages, done=False, info=self._info(info))
            info["forced_end_of_turn"] = True
        messages.extend(self._end_turn())
        info["turn_ended"] = True
        info["turn_passed"] = self.turn_passed[-1]
        if self.turn_errors[-1]:
            errors.append(self.turn_errors[-1])
        if errors:
            info["error"] = "; ".join(errors)[:1000]
        return StepResult(messages=[] if self.done else messages, done=self.done, info=self._info(info))

    def reward(self) -> float:
        """``"all_turns"``: 1.0 once every turn passed, else 0.0; ``"fraction"``: :attr:`fraction_passed`."""
        if self.task.reward_mode == "fraction":
            return self.fraction_passed
        return 1.0 if self.done and all(self.turn_passed) else 0.0

    def _shown(self, result: str) -> str:
        limit = self.task.max_result_chars
        return result if len(result) <= limit else result[:limit] + "... [truncated]"

    def _info(self, info: dict[str, Any]) -> dict[str, Any]:
        info["turns_passed"] = sum(self.turn_passed)
        info["fraction_passed"] = self.fraction_passed
        return info

    def _end_turn(self) -> list[Message]:
        """Check the ending turn, move to the next; its user messages (none when done)."""
        truth_calls = self._truth_calls[self.turn]
        truth_results = [self.truth_env.execute(call) for call in truth_calls]
        error = ""
        if truth_calls:  # BFCL checks nothing in a turn whose ground truth is empty
            if not self._called:
                error = "no function call in a turn that needs calls"
            elif diffs := state_differences(self.model_env, self.truth_env):
                error = f"state differs: {', '.join(diffs)}"
            elif missing := missing_results(self._model_results, truth_results):
                error = f"missing results: {missing}"[:500]
        self.turn_passed.append(not error)
        self.turn_errors.append(error)
        self.turn += 1
        self._steps, self._called = 0, False
        if self.turn >= len(self._turns):
            self.done = True
            return []
        return [dict(m) for m in self._turns[self.turn]]
