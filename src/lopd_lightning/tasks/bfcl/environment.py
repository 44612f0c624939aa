"""BFCL's multi-turn tool classes as a live environment, and the checks of a turn's end state.

:class:`ToolEnvironment` holds fresh instances of an entry's tool classes (``GorillaFileSystem``,
``TwitterAPI``, ``TradingBot``, ...; shipped by ``bfcl_eval`` in
``eval_checker/multi_turn_eval/func_source_code/``) loaded with the entry's ``initial_config``, and runs
calls on them. Differences from BFCL's inference loop: calls are run by method lookup
(``method(**arguments)``), not by ``eval`` of a call string, with the same results: a ``str`` as is, a
``dict`` as JSON (else ``str``), anything else ``str(result)``, an exception as
``"Error during execution: <message>"`` (:data:`ERROR_PREFIX`); ``Class.method`` is accepted as a name
for ``method`` of an involved class. The ground truth is run the same way, its Python call strings
parsed with ``ast`` (:func:`parse_ground_truth_call`; positional arguments named from the method's
signature).

:func:`state_differences` and :func:`missing_results` are the state and response checks of
``bfcl_eval/eval_checker/multi_turn_eval/multi_turn_checker.py`` (read, not imported).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
from typing import Any

from lopd_lightning.tasks.bfcl.calls import ToolCall, parse_python_calls

__all__ = ["ERROR_PREFIX", "ToolEnvironment", "missing_results", "parse_ground_truth_call", "state_differences"]

#: Method names BFCL refuses to run (its execution guard).
_FORBIDDEN = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})

#: How a failed call's result starts (BFCL's wording).
ERROR_PREFIX = "Error during execution: "


def _tool_class(class_name: str) -> type:
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    return getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)


def _stateless(class_name: str) -> bool:
    from bfcl_eval.constants.executable_backend_config import STATELESS_CLASSES

    return class_name in STATELESS_CLASSES


class ToolEnvironment:
    """Fresh instances of BFCL tool classes, loaded with an entry's config, that run calls.

    Args:
        involved_classes: class names, e.g. ``["TwitterAPI", "GorillaFileSystem"]``.
        initial_config: per class, the scenario given to ``_load_scenario`` (deep-copied here).
        long_context: BFCL's long-context variant of the scenarios.

    Raises:
        KeyError: unknown class name.
    """

    def __init__(self, involved_classes: list[str], initial_config: dict[str, Any], *, long_context: bool = False):
        self.instances: dict[str, Any] = {}
        self.methods: dict[str, Any] = {}
        for class_name in involved_classes:
            instance = _tool_class(class_name)()
            if not _stateless(class_name):
                instance._load_scenario(copy.deepcopy(initial_config.get(class_name, {})), long_context=long_context)
            self.instances[class_name] = instance
            for method_name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not method_name.startswith("_"):
                    self.methods[method_name] = method  # a later class wins, as in BFCL

    def resolve(self, name: str) -> str | None:
        """The method name that ``name`` (``method`` or ``Class.method``) refers to, or None."""
        if name in self.methods:
            return name
        prefix, _, short = name.rpartition(".")
        if prefix in self.instances and short in self.methods:
            return short
        return None

    def execute(self, call: ToolCall) -> str:
        """Run one call; its result as BFCL writes it (str; dict as JSON; errors as text). Never raises."""
        try:
            method_name = self.resolve(call.name)
            if method_name in _FORBIDDEN:
                raise PermissionError(f"Function call {method_name} is not allowed.")
            if method_name is None:
                raise NameError(f"name {call.name!r} is not defined")
            result = self.methods[method_name](**call.arguments)
        except Exception as err:  # a tool raising is an observation for the model, never a crash
            return f"{ERROR_PREFIX}{err}"
        if isinstance(result, str):
            return result
        if isinstance(result, dict):
            try:
                return json.dumps(result)
            except Exception:
                return str(result)
        return str(result)

    def state(self) -> dict[str, dict[str, Any]]:
        """Per class, the public attributes (what the state check compares)."""
        return {
            name: {k: v for k, v in vars(instance).items() if not k.startswith("_")}
            for name, instance in self.instances.items()
        }


def state_differences(model: ToolEnvironment, truth: ToolEnvironment) -> list[str]:
    """``"Class.attribute"`` for every public attribute of a ground-truth instance that the model's
    instance does not equal (BFCL's ``state_checker``); empty when the states agree."""
    out = []
    for class_name, truth_instance in truth.instances.items():
        model_instance = model.instances[class_name]
        for attr, value in vars(truth_instance).items():
            if not attr.startswith("_") and getattr(model_instance, attr, _MISSING) != value:
                out.append(f"{class_name}.{attr}")
    return out


_MISSING = object()


def missing_results(model_results: list[str], truth_results: list[str]) -> list[str]:
    """The ground-truth results not found among the model's, as a multiset, order free
    (BFCL's ``response_checker``)."""
    pool, missing = list(model_results), []
    for item in truth_results:
        if item in pool:
            pool.remove(item)
        else:
            missing.append(item)
    return missing


def parse_ground_truth_call(source: str, involved_classes: list[str]) -> ToolCall:
    """One BFCL ground-truth call string (``"cd(folder='document')"``, ``"sort('a.pdf')"``) as a call.

    Positional arguments are named from the signature of the method in the involved classes (the
    last class that has it, as BFCL's name mapping). Arguments are JSON values (tuples -> lists).

    Raises:
        ValueError: not a single call with literal arguments, unknown method, too many positional
            arguments, or arguments that do not survive a JSON round trip.
    """
    parsed = parse_python_calls(source, allow_positional=True)
    if parsed is None or len(parsed) != 1:
        raise ValueError(f"ground-truth call {source!r} is not one call with literal arguments")
    name, args, kwargs = parsed[0]
    if args:
        method = None
        for class_name in involved_classes:
            method = getattr(_tool_class(class_name), name, None) or method
        if method is None:
            raise ValueError(f"ground-truth call {source!r}: no method {name!r} in {involved_classes}")
        names = [p for p in inspect.signature(method).parameters if p != "self"]
        if len(args) > len(names):
            raise ValueError(f"ground-truth call {source!r}: too many positional arguments")
        kwargs = {**dict(zip(names, args)), **kwargs}
    if json.loads(json.dumps(kwargs)) != kwargs:
        raise ValueError(f"ground-truth call {source!r}: arguments do not round-trip through JSON")
    return ToolCall(name=name, arguments=kwargs)
