"""The verdict of the hidden-rules tasks on a reply's calls: the request satisfied and the hidden rule kept.

:func:`check_calls` compares the parsed calls with the example's expected calls (``Example.data["expected"]``)
and names what is wrong. The argument the hidden rule governs is compared exactly (after the rule's
transformation: the date's format, the unit, the prefix, the enum's spelling); the others as BFCL's checker
compares them (strings after :func:`~lopd_lightning.tasks.bfcl.checker.standardize_string`, so "Anna Smith"
matches "anna smith"; numbers by value, an int where a float is expected included). A broken rule is
reported as ``"hidden rule of <tool> (<kind>): <the rule in words>; got <value>"`` with ``rule`` set to the
kind, so logs and ``lopd tasks verify`` say which rule failed. A plain tool (kind
:data:`~lopd_lightning.tasks.hidden_rules.tools.PLAIN`, ``"none"``) governs no argument: every argument is
compared as BFCL compares it, and its failures never carry a ``rule``. Never raises on model output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lopd_lightning.tasks.bfcl.calls import ToolCall
from lopd_lightning.tasks.bfcl.checker import standardize_string
from lopd_lightning.tasks.hidden_rules.tools import AUTHENTICATE, PLAIN

__all__ = ["Verdict", "check_calls"]

#: Numbers closer than this are equal (Kelvin and Fahrenheit values carry two decimals at most).
NUMBER_TOLERANCE = 0.005


@dataclass(frozen=True)
class Verdict:
    """``valid``; else ``error`` (every problem found, joined by "; ") and ``rule`` (the broken rule's kind,
    None when only the request was not met)."""

    valid: bool
    error: str = ""
    rule: str | None = None


def _same(got: Any, want: Any, *, exact: bool) -> bool:
    """Equal values: numbers by value (booleans are not numbers), strings standardised unless ``exact``."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=0.0, abs_tol=NUMBER_TOLERANCE)
    if isinstance(want, str):
        if not isinstance(got, str):
            return False
        return got == want if exact else standardize_string(got) == standardize_string(want)
    return got == want


def _rule_problem(rule: dict[str, Any], detail: str) -> str:
    return f"hidden rule of {rule['tool']} ({rule['kind']}): {rule['description']}; {detail}"


def _check_authenticate(calls: list[ToolCall], rule: dict[str, Any], want: ToolCall) -> tuple[list[ToolCall], str]:
    """The calls left after the first ``authenticate``, and the rule's problem with it ("" when kept)."""
    if not calls or calls[0].name != AUTHENTICATE:
        where = "it is missing" if all(c.name != AUTHENTICATE for c in calls) else "it does not come first"
        return [c for c in calls if c.name != AUTHENTICATE], _rule_problem(rule, where)
    got = calls[0].arguments
    if set(got) != {"scope"} or not _same(got.get("scope"), want.arguments["scope"], exact=True):
        return calls[1:], _rule_problem(rule, f"got {AUTHENTICATE}({', '.join(f'{k}={v!r}' for k, v in got.items())})")
    return calls[1:], ""


def _check_arguments(call: ToolCall, want: ToolCall, rule: dict[str, Any]) -> tuple[list[str], bool]:
    """The problems of ``call``'s arguments and whether one of them broke the hidden rule."""
    governs = rule["tool"] == want.name and rule["kind"] not in ("call_first", PLAIN)
    governed = rule["argument"] if governs else None
    problems, broken = [], False
    for param in call.arguments:
        if param not in want.arguments:
            problems.append(f"unexpected parameter {param!r}")
    for param, value in want.arguments.items():
        if param not in call.arguments:
            if param == governed:
                problems.append(_rule_problem(rule, "it is missing"))
                broken = True
            else:
                problems.append(f"missing parameter {param!r}")
        elif not _same(call.arguments[param], value, exact=param == governed):
            got = call.arguments[param]
            if param == governed:
                problems.append(_rule_problem(rule, f"got {got!r}"))
                broken = True
            else:
                problems.append(f"invalid value for {param!r}: {got!r}")
    return problems, broken


def check_calls(calls: list[ToolCall] | None, expected: list[dict[str, Any]], rule: dict[str, Any]) -> Verdict:
    """The verdict on ``calls`` for one request.

    Args:
        calls: the parsed reply (None or ``[]``: no call).
        expected: the calls that satisfy the request and the rule, ``{"name", "arguments"}`` each; a
            ``call_first`` rule's :data:`~lopd_lightning.tasks.hidden_rules.tools.AUTHENTICATE` call first.
        rule: ``{"tool", "kind", "argument", "description"}`` of the action's hidden rule (kind ``"none"``,
            argument None: a plain tool, no rule).

    Returns:
        ``Verdict(True)`` when the calls are exactly the expected ones (names, order, arguments); else every
        problem found, and the rule's kind when it was broken (never for a plain tool).
    """
    if not calls:
        return Verdict(False, "no tool call")
    wanted = [ToolCall(c["name"], dict(c["arguments"])) for c in expected]
    action = wanted[-1]
    problems, broken = [], False
    rest = list(calls)
    if rule["kind"] == "call_first":
        rest, problem = _check_authenticate(rest, rule, wanted[0])
        if problem:
            problems.append(problem)
            broken = True
    matching = [c for c in rest if c.name == action.name]
    if not matching:
        names = ", ".join(repr(c.name) for c in calls)
        problems.append(f"no call to {action.name!r} (got {names})")
    else:
        extra = [c.name for c in rest if c is not matching[0]]
        if extra:
            problems.append(f"unexpected calls besides {action.name!r}: {', '.join(map(repr, extra))}")
        arg_problems, arg_broken = _check_arguments(matching[0], action, rule)
        problems.extend(arg_problems)
        broken = broken or arg_broken
    if not problems:
        return Verdict(True)
    return Verdict(False, "; ".join(problems), rule["kind"] if broken else None)
