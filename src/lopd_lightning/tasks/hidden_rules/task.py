"""Tool use with hidden rules: each API has a rule its documentation leaves out, that past calls reveal.

Why this task exists: on BFCL live_simple a past trajectory of *another* question carries little that a
student lacks, so LOPD (whose teacher is conditioned on retrieved past trajectories) cannot show its
mechanism there. Here, as in the paper's EnvScaler-like tool-use setting, each environment has rules of its
own: every tool's documentation (the JSON schema the student sees) leaves out one *hidden rule*, fixed per
tool by the seed, and the request is stated in natural terms ("book a flight ... on March 3, 2025"), so the
student must guess; a past successful trajectory on the same tool (another request) shows the rule (the
date written ``03/03/2025``). Experience carries what the docs leave out.

Rule kinds (:data:`~lopd_lightning.tasks.hidden_rules.tools.RULE_KINDS`), over 11 rule tools plus
``authenticate``:

- ``date_format``: the accepted format of a date (``book_flight.date``, ``rent_car.pickup_date``): one of
  DD/MM/YYYY, MM/DD/YYYY, YYYYMMDD, DD.MM.YYYY; the documented form is ISO (YYYY-MM-DD).
- ``unit``: ``set_thermostat.temperature`` in Kelvin, Fahrenheit or tenths of a degree (the request says
  Celsius), ``create_invoice.amount`` in cents or mills (the request says dollars),
  ``schedule_meeting.duration`` in minutes or seconds (the request says hours).
- ``id_prefix``: ``refund_order.order_id`` with ``ORD-``, ``SO-`` or ``#``; ``send_sms.phone`` with the
  country code (``+1`` and the digits, or ``+1-`` and the number as written).
- ``enum_spelling``: enum values the doc does not list: ``upgrade_seat.cabin`` in UPPER_SNAKE, CamelCase or
  the one-letter fare code; ``create_ticket.priority`` as P1-P4, SEV-1..SEV-4 or upper case.
- ``required_argument``: ``query_inventory.warehouse``, "optional" in the doc, must be given (a constant:
  ``CENTRAL``, ``WH-01`` or ``main-depot``).
- ``call_first``: ``transfer_funds`` needs ``authenticate(scope=...)`` first in the same reply (scope
  ``payments:write``, ``transfers`` or ``funds.move``).

Plain tools (:data:`~lopd_lightning.tasks.hidden_rules.tools.PLAIN_TOOLS`): 4 more tools whose documentation
is complete, so they have no hidden rule: ``get_weather(city, days, unit)`` (unit ``celsius`` or
``fahrenheit``, listed in the doc; the request says "the next three days"), ``add_calendar_note(date,
note)`` (the doc says YYYY-MM-DD; the request says "March 3, 2025"), ``lookup_contact(name, company,
field)`` (field ``email``, ``phone``, ``address`` or ``job_title``; the request says "postal address") and
``track_package(carrier, tracking_number)`` (carrier ``ups``, ``fedex``, ``dhl`` or ``usps``; the number
to copy exactly). Their kind is ``"none"`` (:data:`~lopd_lightning.tasks.hidden_rules.tools.PLAIN`), which
marks a plain tool and is not a rule kind. They exist for calibration: a student that learned the call
format from the documented forms alone (``references="format_only"``, whose replies are the correct ones
for plain tools) can solve them without experience, so the start student's success is not 0 by
construction, while experience still decides the rule tools. Requests are drawn round-robin over the 15
tools, the plain ones last, so about 4/15 of either split is plain: 52 of the 200 held-out requests (26%)
and 160 of the 600 train requests (27%) under the default sizes, whatever the seed.

The seed (default 0) fixes the rules (``random.Random(f"hidden_rules/{seed}/rules")``) and the requests.
Splits: "val" is the held-out split, ``n_heldout`` requests (default 200) drawn first from
``random.Random(f"hidden_rules/{seed}/val")``, round-robin over the tools, so it depends on the seed alone
(and its first k requests are the held-out split of ``n_heldout=k``); "train" is ``n_train`` requests (default
600) drawn after it from ``random.Random(f"hidden_rules/{seed}/train")``, never with the (tool, argument
values) of a held-out request. Same tools and rules in both; new arguments. For recipe choices take a dev
slice of train with the DataModule's ``dev_slice`` (``data.init_args.dev_slice: 50``), never the held-out
split.

Reward: 1.0 iff the parsed reply (BFCL's ``<tool_call>[...]</tool_call>`` format,
:mod:`lopd_lightning.tasks.bfcl.calls`) makes exactly the expected calls, the hidden rule kept
(:func:`~lopd_lightning.tasks.hidden_rules.checker.check_calls`); else 0.0, with ``info["error"]`` saying
what failed (``"hidden rule of book_flight (date_format): date must be written DD/MM/YYYY; got
'2025-03-03'"``) and ``info["rule"]`` the broken rule's kind (absent when no rule was broken: always so on
a plain tool). The system prompt is the BFCL tasks'
(:mod:`lopd_lightning.tasks.bfcl.prompt`), so their SFT recipe carries over.

Other rules on the same requests: ``rule_offset`` (default 0) moves every rule tool to another of its
variants: the variant is the seed's variant index + ``rule_offset``, modulo the tool's number of variants
(:func:`~lopd_lightning.tasks.hidden_rules.tools.draw_rules`); plain tools have one variant and are
unaffected. Requests, splits, ids, docs and prompts are the same for every offset; only the expected calls
(so the rewards, ``rule_table`` and the ``references="rules"`` replies) change. A tool's rule differs from the
seed's exactly when the offset is not a multiple of its number of variants: 4 for the ``date_format`` tools
(``book_flight``, ``rent_car``), 2 for ``create_invoice``, ``schedule_meeting`` and ``send_sms``, 3 for the
other six rule tools. So the offsets that change every rule tool's rule are those coprime to 6 (1, 5, 7,
11, ...: not a multiple of 2, 3 or 4); offset 2 keeps the 2-variant tools' rules, 3 the 3-variant tools', 4
the 2- and 4-variant tools'; offsets 1 to n - 1 give a tool with n variants each of its other rules once
(:func:`~lopd_lightning.tasks.hidden_rules.tools.offsets_changing`). A changed rule changes the expected
call of every request but one case: DD/MM/YYYY and MM/DD/YYYY agree on a day whose day and month are equal
(03/03/2025), so between those two rules such a request's call stays the same. Use: environments whose rules all differ
from seed 0's on seed 0's own requests (a meta-training set that never shows seed 0's rules:
``benchmarks/start_student.py --in-context-fraction``).

References: ``references="rules"`` (default) gives the replies that keep the rules (``lopd tasks verify``,
``lopd build-memory --from-references``, OPSD's privileged context); ``references="format_only"`` gives
replies in the call format with the documented forms (no ``authenticate``, the "optional" argument left
out), which score 0 on the rule tools and 1.0 on the plain ones: an SFT warm start on them teaches the call
format (and the plain tools), never the hidden rules.
"""

from __future__ import annotations

import json
import random
from typing import Any, Literal

from lopd_lightning.tasks.base import Example, Message, Task
from lopd_lightning.tasks.bfcl.calls import ToolCall, format_tool_calls, parse_tool_calls, unparsed_reason
from lopd_lightning.tasks.bfcl.data import to_json_schema
from lopd_lightning.tasks.bfcl.prompt import DEFAULT_SYSTEM_PROMPT, check_system_prompt, tools_system_text
from lopd_lightning.tasks.hidden_rules.checker import Verdict, check_calls
from lopd_lightning.tasks.hidden_rules.tools import (
    AUTHENTICATE_DOC,
    TOOLS,
    ToolSpec,
    all_docs,
    draw_rules,
    expected_calls,
    format_only_calls,
)

__all__ = ["DEFAULT_N_HELDOUT", "DEFAULT_N_TRAIN", "HiddenRulesTask", "References"]

References = Literal["rules", "format_only"]
#: Requests of the held-out ("val") split by default (the calibration's held-out set).
DEFAULT_N_HELDOUT = 200
#: Requests of the train split by default.
DEFAULT_N_TRAIN = 600
#: Draws of a tool's request generator before the tool counts as exhausted (no new argument values left).
MAX_DRAWS = 2000


def _key(tool: str, args: dict[str, Any]) -> str:
    return json.dumps([tool, args], sort_keys=True)


def draw_requests(seed: int, split: str, n: int, taken: set[str]) -> list[tuple[ToolSpec, Any]]:
    """``n`` requests round-robin over :data:`TOOLS`, none with the (tool, arguments) of ``taken`` or of
    another; ``taken`` gains their keys.

    Raises:
        ValueError: every tool ran out of new argument values before ``n`` requests were drawn.
    """
    rng = random.Random(f"hidden_rules/{seed}/{split}")
    out, exhausted, i = [], set(), 0
    while len(out) < n:
        if len(exhausted) == len(TOOLS):
            raise ValueError(f"hidden_rules: only {len(out)} distinct {split} requests could be drawn, {n} asked")
        spec = TOOLS[i % len(TOOLS)]
        i += 1
        if spec.name in exhausted:
            continue
        for _ in range(MAX_DRAWS):
            request = spec.draw(rng)
            key = _key(spec.name, request.args)
            if key not in taken:
                taken.add(key)
                out.append((spec, request))
                break
        else:
            exhausted.add(spec.name)
    return out


class HiddenRulesTask(Task):
    """Single-turn tool use whose tools have hidden rules (see the module docstring).

    ``Example``: id ``"hidden_rules/<split>/<i>"``, text the user's request, data ``tool``, ``args`` (the
    request's arguments in their meaning), ``rule`` (``{"tool", "kind", "argument", "variant", "description"}``;
    for a plain tool kind and variant ``"none"``, argument None), ``plain`` (the tool has no hidden rule),
    ``expected`` and ``format_only`` (calls as ``{"name", "arguments"}``; the same for a plain tool) and
    ``functions`` (the docs shown).

    Args:
        seed: fixes the rules and the requests (0).
        n_train: requests in "train" (600).
        n_heldout: requests in "val", the held-out split (200, at least 1).
        references: "rules" (the replies that keep the rules, full marks) or "format_only" (the documented
            forms, score 0 except on plain tools: an SFT warm start on the call format alone).
        show_tools: "task" (the request's tool and ``authenticate``) or "all" (the 15 tools and
            ``authenticate``, every task).
        system_prompt: the system text with ``{tools}``; default the BFCL tasks' (SmolLM2's tool-use text).
        rule_offset: an int >= 0 added to each rule tool's variant index, modulo its number of variants (0:
            the seed's rules; 1 changes every rule tool's rule; see the module docstring). Requests, ids,
            splits and prompts do not depend on it.

    Raises:
        ValueError: a size below 1, an unknown ``references`` or ``show_tools``, a system prompt without
            ``{tools}``, a ``rule_offset`` that is not an int >= 0, or more requests asked than the tools
            have distinct argument values.
    """

    name = "hidden_rules"
    multi_turn = False

    def __init__(self, *, seed: int = 0, n_train: int = DEFAULT_N_TRAIN, n_heldout: int = DEFAULT_N_HELDOUT,
                 references: References = "rules", show_tools: Literal["task", "all"] = "task",
                 system_prompt: str | None = None, rule_offset: int = 0):
        if isinstance(rule_offset, bool) or not isinstance(rule_offset, int) or rule_offset < 0:
            raise ValueError(f"rule_offset must be an int >= 0 (0: the seed's rules; 1 changes every rule tool's "
                             f"rule), got {rule_offset!r}")
        if n_train < 1 or n_heldout < 1:
            raise ValueError(f"n_train and n_heldout must be >= 1, got {n_train} and {n_heldout}")
        if references not in ("rules", "format_only"):
            raise ValueError(f"references must be 'rules' or 'format_only', got {references!r}")
        if show_tools not in ("task", "all"):
            raise ValueError(f"show_tools must be 'task' or 'all', got {show_tools!r}")
        self.seed, self.n_train, self.n_heldout = seed, n_train, n_heldout
        self.val_fraction = n_heldout / (n_train + n_heldout)
        self.references: References = references
        self.show_tools = show_tools
        self.system_prompt = check_system_prompt(DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt)
        self.rule_offset = rule_offset
        self.rules = draw_rules(seed, rule_offset)
        taken: set[str] = set()
        self._splits = {split: [self._example(split, i, spec, request.text, request.args)
                                for i, (spec, request) in enumerate(draw_requests(seed, split, n, taken))]
                        for split, n in (("val", n_heldout), ("train", n_train))}

    def _example(self, split: str, i: int, spec: ToolSpec, text: str, args: dict[str, Any]) -> Example:
        variant = self.rules[spec.name]
        functions = all_docs() if self.show_tools == "all" else [spec.doc, AUTHENTICATE_DOC]
        rule = {"tool": spec.name, "kind": spec.kind, "argument": spec.argument, "variant": variant.label,
                "description": variant.rule}
        data = {"tool": spec.name, "args": args, "rule": rule, "plain": spec.plain, "functions": functions,
                "expected": [_as_dict(c) for c in expected_calls(spec, variant, args)],
                "format_only": [_as_dict(c) for c in format_only_calls(spec, args)]}
        return Example(id=f"hidden_rules/{split}/{i}", text=text, data=data)

    def all_examples(self) -> list[Example]:
        """The train requests, then the held-out ones."""
        return self._splits["train"] + self._splits["val"]

    def examples(self, split: str = "train") -> list[Example]:
        """"train" (``n_train`` requests), "val" (the ``n_heldout`` held-out requests) or "all"."""
        self.check_split(split)
        return self.all_examples() if split == "all" else list(self._splits[split])

    def initial_messages(self, example: Example) -> list[Message]:
        return [{"role": "system", "content": tools_system_text(self.system_prompt, example.data["functions"])},
                {"role": "user", "content": example.text}]

    def tool_schemas(self, example: Example) -> list[dict[str, Any]]:
        """The tools shown, as JSON Schema tools (``{"type": "function", "function": {...}}``)."""
        return [{"type": "function", "function": to_json_schema(f)} for f in example.data["functions"]]

    def reference_solution(self, example: Example) -> str:
        """The reply that keeps the hidden rule (``references="rules"``) or the format-only reply."""
        key = "expected" if self.references == "rules" else "format_only"
        return self.format_calls(example.data[key])

    def example_category(self, example: Example) -> str:
        """The kind of the request's tool's hidden rule (:data:`~lopd_lightning.tasks.hidden_rules.tools.RULE_KINDS`),
        or ``"none"`` for a plain tool: the categories of held-out breakdowns."""
        return example.data["rule"]["kind"]

    def rule_reply(self, example: Example) -> str:
        """The reply that satisfies the request and keeps the hidden rule, whatever ``references`` says."""
        return self.format_calls(example.data["expected"])

    def format_only_reply(self, example: Example) -> str:
        """The reply in the call format with the documented forms (it breaks the rule: scores 0; on a plain
        tool it is the rule reply: scores 1.0)."""
        return self.format_calls(example.data["format_only"])

    @staticmethod
    def format_calls(calls: list[dict[str, Any]]) -> str:
        """``{"name", "arguments"}`` dicts as BFCL's ``<tool_call>[...]</tool_call>`` text."""
        return format_tool_calls([ToolCall(c["name"], dict(c["arguments"])) for c in calls])

    def check(self, example: Example, completion: str) -> Verdict:
        """The verdict on one reply (never raises: a checker bug is a verdict too)."""
        try:
            calls = parse_tool_calls(completion)
            if calls is None:
                return Verdict(False, unparsed_reason(completion))
            return check_calls(calls, example.data["expected"], example.data["rule"])
        except Exception as err:  # bad text must never stop training; verify shows checker bugs
            return Verdict(False, f"checker error: {type(err).__name__}: {err}")

    def score_with_info(self, example: Example, completion: str) -> tuple[float, dict[str, Any]]:
        """``(1.0, {})``, or ``(0.0, {"error": what failed})`` with ``"rule"`` (its kind) when the hidden
        rule was broken (never on a plain tool)."""
        verdict = self.check(example, completion)
        if verdict.valid:
            return 1.0, {}
        info: dict[str, Any] = {"error": verdict.error}
        if verdict.rule:
            info["rule"] = verdict.rule
        return 0.0, info

    def rule_table(self) -> dict[str, dict[str, str]]:
        """Tool -> ``{"kind", "argument", "variant", "description"}`` of its hidden rule under this seed and
        ``rule_offset`` (a plain tool: kind and variant ``"none"``, argument None)."""
        return {spec.name: {"kind": spec.kind, "argument": spec.argument, "variant": self.rules[spec.name].label,
                            "description": self.rules[spec.name].rule} for spec in TOOLS}


def _as_dict(call: ToolCall) -> dict[str, Any]:
    return {"name": call.name, "arguments": dict(call.arguments)}

