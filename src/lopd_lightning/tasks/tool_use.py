"""Function calling: the call format, BFCL's AST checker rewritten, and the single-turn BFCL v4 tasks.

Call format. SmolLM2-135M-Instruct's packaged chat template does not render tools, so the task writes the
tools into the system message itself, in the format SmolLM2 was trained on (the system text of its
tool-use template): the functions as JSON schemas inside ``<tools></tools>``, and calls as

    <tool_call>[{"name": "func", "arguments": {"arg": 1}}, {"name": "g", "arguments": {}}]</tool_call>

:func:`parse_tool_calls` reads that format (and a few tolerated variants, and Python call syntax as a
fallback); :func:`format_tool_calls` writes it.

Function names with dots (``math.factorial``) are shown to the model as the data gives them. BFCL's
OpenAI-style handlers replace "." with "_" because those APIs forbid dots, so the checker accepts both
spellings: a call named ``math_factorial`` matches the expected ``math.factorial``.

Checker. :func:`check_tool_calls` follows BFCL's Python AST checker
(``bfcl_eval/eval_checker/ast_eval/ast_checker.py``, read, not imported: it imports API clients):
names, required parameters, no unexpected parameters, types from the function schema (an int where a
float is expected is converted; one level of element type checks for arrays), values among the allowed
ground-truth values with BFCL's string standardisation (case, spaces and ``,./-_*^`` ignored), one level
of dict keys, lists of dicts, and optional parameters (``""`` among the allowed values) that may be left
out. Deviations, each needed for a correct answer to be accepted (BFCL marks every answer wrong there):

- parallel categories: the model's calls are matched to the ground truth by a full bipartite matching,
  where BFCL matches greedily in order (greedy can reject a correct set of calls);
- ground-truth parameters that the function's schema does not declare are optional (the model cannot
  know them; BFCL requires them and also rejects them as unexpected);
- an empty list of allowed values for an array parameter means "the empty list" (BFCL writes ``[]``
  where it means ``[[]]``; its checker accepts no value then);
- when the ground truth has exactly one parameter that the schema lacks and the schema requires exactly
  one parameter that the ground truth lacks, the ground truth's parameter is read under the schema's
  name (a renamed parameter in the data).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lopd_lightning.tasks._bfcl_data import load_category, to_json_schema
from lopd_lightning.tasks.base import Example, Message, Task

#: The system text of SmolLM2's tool-use template; ``{tools}`` is replaced by the JSON list of schemas.
DEFAULT_SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n\n"
    "You have access to the following tools:\n"
    "<tools>{tools}</tools>\n\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. "
    "If no function call is needed, please make the tool calls an empty list '[]'.\n"
    "<tool_call>[\n"
    '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
    "... (more tool calls as required)\n"
    "]</tool_call>"
)

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


# ---------------------------------------------------------------------------------------------------
# The call format
# ---------------------------------------------------------------------------------------------------


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
    if "<tool_call>" in text:
        return "malformed tool call: a <tool_call> block is neither JSON calls nor Python call syntax"
    if text.lstrip().startswith(("[", "{", "```")):
        return "malformed tool call: the reply is neither JSON calls nor Python call syntax"
    return "no tool call: the reply is prose"


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
    return ToolCall(name=name, arguments=args)


def _calls_from_python(text: str) -> list[ToolCall] | None:
    parsed = parse_python_calls(text, allow_positional=False)
    if parsed is None:
        return None
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


# ---------------------------------------------------------------------------------------------------
# The checker (BFCL's Python AST rules)
# ---------------------------------------------------------------------------------------------------


class CheckResult(NamedTuple):
    """The verdict of :func:`check_tool_calls`: ``valid`` and, when not, a one-line reason."""

    valid: bool
    error: str = ""


_PY_TYPES: dict[str, type] = {
    "string": str,
    "integer": int,
    "float": float,
    "number": float,
    "boolean": bool,
    "bool": bool,
    "array": list,
    "list": list,
    "tuple": list,
    "dict": dict,
    "object": dict,
    "any": str,
}
_NESTED_TYPES = ("array", "list", "tuple")
_STANDARDISE = re.compile(r"[ ,./\-_*^]")


def standardize_string(text: str) -> str:
    """BFCL's string standardisation: drop spaces and ``,./-_*^``, lower-case, ``'`` -> ``"``.

    So "April 1, 2024" and "april 1,2024" compare equal.
    """
    return _STANDARDISE.sub("", text).lower().replace("'", '"')


def names_match(called: str, expected: str) -> bool:
    """True when ``called`` is ``expected`` or its spelling with "." replaced by "_" (OpenAI style)."""
    return called == expected or called == expected.replace(".", "_")


def find_function(functions: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The BFCL function doc named ``name`` (exact, then with dots as underscores), or None."""
    for function in functions:
        if function["name"] == name:
            return function
    for function in functions:
        if names_match(name, function["name"]):
            return function
    return None


def expected_arguments(function: dict[str, Any], allowed: dict[str, list]) -> dict[str, list]:
    """The ground truth's allowed values per parameter, reconciled with the function's schema.

    Applies the data repairs listed in the module docstring: a renamed parameter is read under the
    schema's name; parameters the schema does not declare are dropped (so they are optional); an empty
    allowed list of an array parameter becomes ``[[]]``. ``allowed`` is not modified.
    """
    params = function.get("parameters") or {}
    props, required = params.get("properties") or {}, params.get("required") or []
    allowed = dict(allowed)
    unknown = [p for p in allowed if p not in props]
    missing = [p for p in required if p not in allowed]
    if len(unknown) == 1 and len(missing) == 1:
        allowed[missing[0]] = allowed.pop(unknown[0])
    out = {}
    for param, values in allowed.items():
        if param not in props:
            continue
        if isinstance(values, list) and not values and props[param].get("type") in _NESTED_TYPES:
            values = [[]]
        out[param] = values if isinstance(values, list) else [values]
    return out


def check_tool_calls(
    calls: list[ToolCall] | None,
    ground_truth: list[dict[str, dict[str, list]]],
    functions: list[dict[str, Any]],
    *,
    category: str,
) -> CheckResult:
    """BFCL's AST verdict on a model's calls for one single-turn entry.

    Args:
        calls: the parsed calls (None or ``[]``: no calls, invalid).
        ground_truth: BFCL's possible answer: one ``{function_name: {param: [allowed values]}}`` per
            expected call; ``""`` among the allowed values marks an optional parameter.
        functions: the entry's function docs (BFCL format: types "integer", "float", "string",
            "boolean", "array", "tuple", "dict", "any").
        category: the BFCL category; "parallel" in it -> order-free matching of all calls; else
            "multiple" in it, or anything else -> exactly one call, checked against the one expected.

    Returns:
        ``CheckResult(valid, error)``. Never raises on model output.
    """
    if not calls:
        return CheckResult(False, "no function call")
    if len(calls) != len(ground_truth):
        return CheckResult(False, f"wrong number of functions: {len(calls)} for {len(ground_truth)} expected")
    if "parallel" in category:
        return _check_parallel(calls, ground_truth, functions)
    return _check_one(calls[0], ground_truth[0], functions)


def _check_parallel(calls: list[ToolCall], ground_truth: list[dict], functions: list[dict]) -> CheckResult:
    """Every expected call matched to a distinct model call (bipartite matching, Kuhn's algorithm)."""
    ok = [[_check_one(call, expected, functions).valid for call in calls] for expected in ground_truth]
    match_of_call: dict[int, int] = {}

    def augment(i: int, seen: set[int]) -> bool:
        for j, good in enumerate(ok[i]):
            if good and j not in seen:
                seen.add(j)
                if j not in match_of_call or augment(match_of_call[j], seen):
                    match_of_call[j] = i
                    return True
        return False

    for i in range(len(ground_truth)):
        if not augment(i, set()):
            name = next(iter(ground_truth[i]))
            return CheckResult(False, f"no model call matches expected call {i} ({name})")
    return CheckResult(True)


def _check_one(call: ToolCall, expected: dict[str, dict[str, list]], functions: list[dict]) -> CheckResult:
    """BFCL's ``simple_function_checker`` for one call against one expected ``{name: {param: allowed}}``."""
    (expected_name, allowed_raw), = expected.items()
    function = find_function(functions, expected_name)
    if function is None:
        return CheckResult(False, f"no schema for expected function {expected_name!r}")
    if not names_match(call.name, function["name"]):
        return CheckResult(False, f"function name {function['name']!r} not found (got {call.name!r})")
    params = function.get("parameters") or {}
    props, required = params.get("properties") or {}, params.get("required") or []
    allowed = expected_arguments(function, allowed_raw)
    args = call.arguments
    for param in required:
        if param not in args:
            return CheckResult(False, f"missing required parameter {param!r}")
    for param, value in args.items():
        if param not in props or param not in allowed:
            return CheckResult(False, f"unexpected parameter {param!r}")
        verdict = _check_value(param, value, allowed[param], props[param])
        if not verdict.valid:
            return verdict
    for param, values in allowed.items():
        if param not in args and "" not in values:
            return CheckResult(False, f"parameter {param!r} not provided and not optional")
    return CheckResult(True)


def _check_value(param: str, value: Any, allowed: list, schema: dict[str, Any]) -> CheckResult:
    type_name = schema.get("type")
    expected = _PY_TYPES.get(type_name, str)
    nested = None
    if type_name in _NESTED_TYPES:
        nested = _PY_TYPES.get((schema.get("items") or {}).get("type"))
    if expected is float and type(value) is int:  # Python's int -> float promotion
        value = float(value)
    valid, is_variable = _type_check(value, allowed, expected, nested)
    if not valid:
        return CheckResult(False, f"wrong type for {param!r}: expected {type_name}, got {type(value).__name__}")
    if not is_variable:
        if expected is dict:
            ok = _dict_ok(value, allowed)
        elif expected is list and nested is dict:
            ok = _list_of_dicts_ok(value, allowed)
        elif expected is str:
            ok = standardize_string(value) in [standardize_string(a) for a in allowed if type(a) is str]
        elif expected is list:
            ok = _standardize_list(value) in [_standardize_list(a) for a in allowed if isinstance(a, (list, str))]
        else:
            ok = value in allowed
    else:  # the ground truth writes the value in another type (e.g. a variable name): compare as is
        ok = value in allowed
    return CheckResult(True) if ok else CheckResult(False, f"invalid value for {param!r}: {value!r}")


def _answer_type(allowed: list) -> type | None:
    """The type of the first allowed value that is not the optional marker ``""``."""
    for answer in allowed:
        if not (type(answer) is str and answer == ""):
            return type(answer)
    return None


def _type_check(value: Any, allowed: list, expected: type, nested: type | None) -> tuple[bool, bool]:
    """BFCL's ``type_checker``: ``(valid, is_variable)``.

    ``is_variable``: the ground truth writes this parameter in another type than the schema's (BFCL's
    encoding of a variable); a value of that other type is accepted and compared as is. Arrays get one
    level of element checks: some allowed value must be a list whose element type (or the schema's item
    type) every element has; an allowed value that is not a list (e.g. ``""``) passes the element check.
    """
    answer_type = _answer_type(allowed)
    is_variable = answer_type is not None and answer_type is not expected
    if type(value) is expected:
        if nested is None:
            return True, is_variable
        for answer in allowed:
            if type(answer) is not list or all(_type_check(item, answer, nested, None)[0] for item in value):
                return True, is_variable
        return False, False
    if answer_type is not None and type(value) is answer_type:
        return True, True
    return False, False


def _standardize_list(values: list | str) -> list:
    return [standardize_string(v) if type(v) is str else v for v in values]


def _standardize_options(options: Any) -> list:
    options = options if isinstance(options, list) else [options]
    return [standardize_string(o) if type(o) is str else o for o in options]


def _dict_ok(value: dict, allowed: list) -> bool:
    """BFCL's ``dict_checker``: one level of keys; every key allowed, every omitted key optional."""
    for answer in allowed:
        if not isinstance(answer, dict):  # "" (the parameter is optional) or a malformed answer
            continue
        good = True
        for key, item in value.items():
            if key not in answer:
                good = False
                break
            if (standardize_string(item) if type(item) is str else item) not in _standardize_options(answer[key]):
                good = False
                break
        if good and all(key in value or "" in _as_list(options) for key, options in answer.items()):
            return True
    return False


def _list_of_dicts_ok(value: list, allowed: list) -> bool:
    """BFCL's ``list_dict_checker``: same length as an allowed list, each dict as ``dict_checker``."""
    for answer in allowed:
        if not isinstance(answer, (list, str)) or len(value) != len(answer):
            continue
        if all(isinstance(v, dict) and isinstance(a, dict) and _dict_ok(v, [a]) for v, a in zip(value, answer)):
            return True
    return False


def _as_list(options: Any) -> list:
    return options if isinstance(options, list) else [options]


# ---------------------------------------------------------------------------------------------------
# Reference solutions
# ---------------------------------------------------------------------------------------------------

_OMIT = object()


def reference_calls(ground_truth: list[dict[str, dict[str, list]]], functions: list[dict]) -> list[ToolCall]:
    """The ground truth as calls: each argument's first allowed value.

    An optional argument whose first allowed value is ``""`` (BFCL's "may be omitted") is left out; a
    required argument takes its first value that is not ``""`` (or ``""`` when that is all there is).
    Dict values are written from their first allowed dict, key by key in the same way, lists of dicts
    element-wise. Names are written as the data gives them.

    Raises:
        ValueError: an expected function has no schema among ``functions``.
    """
    calls = []
    for expected in ground_truth:
        (name, allowed_raw), = expected.items()
        function = find_function(functions, name)
        if function is None:
            raise ValueError(f"no schema for expected function {name!r}")
        params = function.get("parameters") or {}
        props, required = params.get("properties") or {}, set(params.get("required") or [])
        args = {}
        for param, allowed in expected_arguments(function, allowed_raw).items():
            value = _first_allowed(allowed, required=param in required)
            if value is not _OMIT:
                args[param] = _written(value, props[param])
        calls.append(ToolCall(name=name, arguments=args))
    return calls


def _first_allowed(allowed: list, *, required: bool) -> Any:
    if not allowed:
        return _OMIT
    if not required:
        return _OMIT if (type(allowed[0]) is str and allowed[0] == "") else allowed[0]
    return next((a for a in allowed if not (type(a) is str and a == "")), "")


def _written(value: Any, schema: dict[str, Any]) -> Any:
    """An allowed value as the model writes it: dict specs ``{key: [allowed]}`` become plain dicts."""
    type_name = schema.get("type")
    if _PY_TYPES.get(type_name) is dict and isinstance(value, dict):
        return _written_dict(value)
    if type_name in _NESTED_TYPES and isinstance(value, list):
        if _PY_TYPES.get((schema.get("items") or {}).get("type")) is dict:
            return [_written_dict(v) if isinstance(v, dict) else v for v in value]
    return value


def _written_dict(spec: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, options in spec.items():
        value = _first_allowed(_as_list(options), required=False)
        if value is not _OMIT:
            out[key] = value
    return out


# ---------------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------------


def tools_system_text(system_prompt: str, functions: list[dict[str, Any]]) -> str:
    """``system_prompt`` with ``{tools}`` replaced by the JSON list of the functions' JSON schemas."""
    schemas = json.dumps([to_json_schema(f) for f in functions], ensure_ascii=False)
    return system_prompt.replace("{tools}", schemas)


def with_system(system_text: str, messages: list[Message]) -> list[Message]:
    """``[system] + messages`` (copies); a leading system message of the data is appended to ours
    after a blank line, as BFCL does for prompting models."""
    messages = [dict(m) for m in messages]
    if messages and messages[0].get("role") == "system":
        first = messages.pop(0)
        system_text = f"{system_text}\n\n{first.get('content') or ''}"
    return [{"role": "system", "content": system_text}, *messages]


def check_system_prompt(system_prompt: str) -> str:
    """Return ``system_prompt``; raise ValueError unless it holds the ``{tools}`` placeholder."""
    if "{tools}" not in system_prompt:
        raise ValueError("system_prompt must contain the placeholder '{tools}' (where the tool schemas go)")
    return system_prompt


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

    def score(self, example: Example, completion: str) -> float:
        return 1.0 if self.check(example, completion).valid else 0.0

    def score_with_info(self, example: Example, completion: str) -> tuple[float, dict[str, Any]]:
        """The reward and, when it is 0, ``{"error": the checker's reason}`` (e.g. "malformed tool call:
        ...", "function name 'f' not found (got 'g')", "wrong type for 'x': ...")."""
        verdict = self.check(example, completion)
        return (1.0, {}) if verdict.valid else (0.0, {"error": verdict.error})


__all__ = [
    "CATEGORIES",
    "DEFAULT_SYSTEM_PROMPT",
    "BFCLTask",
    "CheckResult",
    "ToolCall",
    "check_tool_calls",
    "expected_arguments",
    "format_tool_calls",
    "names_match",
    "parse_python_calls",
    "parse_tool_calls",
    "reference_calls",
    "standardize_string",
    "unparsed_reason",
]
