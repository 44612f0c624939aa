"""BFCL's Python AST checker, rewritten: the verdict on a reply's calls, and the ground truth written as calls.

:func:`check_tool_calls` follows BFCL's Python AST checker
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

Function names with dots (``math.factorial``) are shown to the model as the data gives them. BFCL's
OpenAI-style handlers replace "." with "_" because those APIs forbid dots, so the checker accepts both
spellings: a call named ``math_factorial`` matches the expected ``math.factorial``.

:func:`reference_calls` writes the ground truth as the calls a correct reply makes (the tasks'
reference solutions).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from lopd_lightning.tasks.bfcl.calls import ToolCall

__all__ = [
    "CheckResult",
    "check_tool_calls",
    "expected_arguments",
    "find_function",
    "names_match",
    "reference_calls",
    "standardize_string",
]


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
