"""The call format of the BFCL tasks: reading tool calls out of a reply, and writing them.

SmolLM2-135M-Instruct's packaged chat template does not render tools, so the BFCL tasks write the tools
into the system message themselves (:mod:`lopd_lightning.tasks.bfcl.prompt`), in the format SmolLM2 was
trained on (the system text of its tool-use template): the functions as JSON schemas inside
``<tools></tools>``, and calls as

    <tool_call>[{"name": "func", "arguments": {"arg": 1}}, {"name": "g", "arguments": {}}]</tool_call>

:func:`parse_tool_calls` reads that format (and a few tolerated variants, and Python call syntax as a
fallback); :func:`format_tool_calls` writes it. Function names with dots (``math.factorial``) are kept as
written; the checker (:mod:`lopd_lightning.tasks.bfcl.checker`) decides which spellings match.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from lopd_lightning.text import has_lone_surrogate

__all__ = ["ToolCall", "format_tool_calls", "parse_python_calls", "parse_tool_calls", "unparsed_reason"]


@dataclass
class ToolCall:
    """One function call.

    Attributes:
        name: the function's name as written by the caller (dots allowed).
        arguments: keyword arguments, JSON values (str, int, float, bool, None, list, dict).
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


def format_tool_calls(calls: list[ToolCall]) -> str:
    """The canonical text of ``calls``: ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``.

    Raises:
        TypeError: an argument is not JSON-serialisable.
    """
    payload = [{"name": c.name, "arguments": c.arguments} for c in calls]
    return "<tool_call>" + json.dumps(payload, ensure_ascii=False) + "</tool_call>"


def parse_tool_calls(text: str) -> list[ToolCall] | None:
    """The function calls in an assistant reply, or None when it holds nothing parseable as calls.

    Read, in order:
        1. ``<tool_call>...</tool_call>`` blocks (several allowed; the last may lack its closing tag;
           empty blocks are skipped).
           Each holds a JSON list of ``{"name", "arguments"}`` objects, a single object, or several
           objects one after another; ``"arguments"`` may also be a JSON string (OpenAI style), and
           ``"parameters"`` is read as ``"arguments"``. A block that is not JSON is read as Python.
        2. Without tags: the whole reply (code fences stripped) as such JSON (e.g. a bare list).
        3. Without tags: the whole reply as Python call syntax, ``f(a=1)`` or ``[f(a=1), m.g(b="x")]``,
           keyword arguments with literal values only (``true``/``false``/``null`` read as JSON's).

    A call whose name, argument names or values hold a lone UTF-16 surrogate (a JSON escape such as
    ``"\\ud800"``, or Python's) is malformed: such text is not Unicode, no tool, tokenizer or UTF-8 file
    takes it.

    Returns:
        The calls (``[]`` for an explicit empty list: "no call"), or None when the reply is prose or
        malformed (any unreadable block makes the whole reply None). Never raises.
    """
    try:
        return _parse(text)
    except Exception:  # malformed text of any kind (deep nesting, odd types) is "no calls", never a crash
        return None


def unparsed_reason(text: Any) -> str:
    """Why :func:`parse_tool_calls` read no calls from ``text`` (for diagnostics; never raises)."""
    if not isinstance(text, str):
        return f"malformed reply: not text but {type(text).__name__}"
    if not text.strip():
        return "empty reply: no tool call"
    try:
        _parse(text)
    except _LoneSurrogate:
        return "malformed tool call: a name or value holds a lone UTF-16 surrogate (not valid Unicode)"
    except Exception:  # any other failure is told below
        pass
    if "<tool_call>" in text:
        return "malformed tool call: a <tool_call> block is neither JSON calls nor Python call syntax"
    if text.lstrip().startswith(("[", "{", "```")):
        return "malformed tool call: the reply is neither JSON calls nor Python call syntax"
    return "no tool call: the reply is prose"


class _LoneSurrogate(ValueError):
    """A call holds a lone UTF-16 surrogate (see :func:`parse_tool_calls`)."""


def _check_unicode(name: str, arguments: Any) -> None:
    """Raise :class:`_LoneSurrogate` when ``name`` or any string in ``arguments`` (keys, nested values) holds a
    lone surrogate."""
    stack = [name, arguments]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if has_lone_surrogate(value):
                raise _LoneSurrogate(f"lone surrogate in {value!r}")
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)


def _parse(text: str) -> list[ToolCall] | None:
    if not isinstance(text, str):
        return None
    if "<tool_call>" in text:
        calls: list[ToolCall] = []
        blocks = [_strip_fences(segment.split("</tool_call>", 1)[0]) for segment in text.split("<tool_call>")[1:]]
        blocks = [block for block in blocks if block]  # an empty block (e.g. a dangling tag) is skipped
        if not blocks:
            return None
        for block in blocks:
            block_calls = _calls_from_json_text(block)
            if block_calls is None:
                block_calls = _calls_from_python(block)
            if block_calls is None:
                return None
            calls.extend(block_calls)
        return calls
    body = _strip_fences(text)
    if not body:
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return _calls_from_python(body)
    return _calls_from_json_values([value])


def _strip_fences(text: str) -> str:
    text = text.strip()
    match = re.fullmatch(r"```[a-zA-Z]*\s*(.*?)\s*```", text, flags=re.DOTALL)
    return match.group(1).strip() if match else text


def _calls_from_json_text(block: str) -> list[ToolCall] | None:
    """JSON values one after another (separated by whitespace or commas) -> calls; None if not JSON."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(block) and (block[i].isspace() or block[i] == ","):
            i += 1
        if i == len(block):
            break
        try:
            value, i = decoder.raw_decode(block, i)
        except ValueError:
            return None
        values.append(value)
    if not values:
        return None
    return _calls_from_json_values(values)


def _calls_from_json_values(values: list[Any]) -> list[ToolCall] | None:
    calls = []
    for value in values:
        items = value if isinstance(value, list) else [value]
        for item in items:
            call = _call_from_json(item)
            if call is None:
                return None
            calls.append(call)
    return calls


def _call_from_json(item: Any) -> ToolCall | None:
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("function"), dict):  # OpenAI: {"type": "function", "function": {...}}
        item = item["function"]
    name = item.get("name", item.get("function"))
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    _check_unicode(name, args)
    return ToolCall(name=name, arguments=args)


def _calls_from_python(text: str) -> list[ToolCall] | None:
    parsed = parse_python_calls(text, allow_positional=False)
    if parsed is None:
        return None
    for name, _, kwargs in parsed:
        _check_unicode(name, kwargs)
    return [ToolCall(name=name, arguments=kwargs) for name, _, kwargs in parsed]


def parse_python_calls(text: str, *, allow_positional: bool = False) -> list[tuple[str, list, dict]] | None:
    """Python call syntax -> ``[(name, positional_args, keyword_args)]``, literal values only.

    ``text`` is one expression: a call ``f(a=1)`` or a list/tuple of calls; names may be dotted
    (``math.factorial``). Tuples are read as lists (JSON has no tuples); ``true``, ``false`` and ``null``
    are read as ``True``, ``False`` and ``None``.

    Returns:
        The calls, or None for anything else (non-literal values, ``**kwargs``, positional arguments when
        ``allow_positional`` is False, syntax errors). Never raises.
    """
    try:
        node = ast.parse(text.strip().strip("'"), mode="eval").body
        nodes = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
        calls = []
        for call in nodes:
            if not isinstance(call, ast.Call):
                return None
            name = _dotted_name(call.func)
            if name is None or (call.args and not allow_positional):
                return None
            if any(kw.arg is None for kw in call.keywords):
                return None
            args = [_literal(a) for a in call.args]
            kwargs = {kw.arg: _literal(kw.value) for kw in call.keywords}
            calls.append((name, args, kwargs))
        return calls
    except Exception:
        return None


def _dotted_name(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.AST) -> Any:
    """A JSON-compatible literal value of an AST node; ValueError for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("unary sign on a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("dict unpacking")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")
