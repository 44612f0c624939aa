"""Reading the BFCL v4 data that the ``bfcl_eval`` package ships (shared by the single- and multi-turn tasks).

``bfcl_eval`` (2026.3.23) is installed with ``--no-deps``: its data files and multi-turn tool classes work,
but its checkers import API clients that are not installed, so lopd_lightning has its own checkers and
only reads files (and imports ``func_source_code`` classes) from the package. Nothing here downloads.

Layout read here (relative to the installed package):
    data/BFCL_v4_<category>.json                 JSON lines: id, question (turns of messages), function
                                                 (single-turn) or initial_config / involved_classes
                                                 (multi-turn)
    data/possible_answer/BFCL_v4_<category>.json JSON lines: id, ground_truth
    data/multi_turn_func_doc/<file>.json         JSON lines: the schemas of one tool class's methods
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

#: ``bfcl_eval``'s parameter types -> JSON Schema types, as BFCL's own OpenAI-style handlers map them
#: (``GORILLA_TO_OPENAPI``); unknown types become "string" there too.
_JSON_SCHEMA_TYPES = {
    "integer": "integer",
    "number": "number",
    "float": "number",
    "string": "string",
    "boolean": "boolean",
    "bool": "boolean",
    "array": "array",
    "list": "array",
    "tuple": "array",
    "dict": "object",
    "object": "object",
    "any": "string",
}

_INSTALL_HINT = "pip install --no-deps bfcl-eval==2026.3.23"


def bfcl_package_dir() -> Path:
    """The folder of the installed ``bfcl_eval`` package (not imported: only located).

    Raises:
        ModuleNotFoundError: ``bfcl_eval`` is not installed.
    """
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the BFCL tasks need the bfcl_eval package: {_INSTALL_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, in file order (blank lines skipped).

    Raises:
        FileNotFoundError: no such file.
    """
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_category(category: str) -> list[dict[str, Any]]:
    """The entries of ``BFCL_v4_<category>.json`` joined with their ground truth by id, in file order.

    Each entry is the data file's dict with a ``"ground_truth"`` key added from
    ``possible_answer/BFCL_v4_<category>.json``.

    Raises:
        ModuleNotFoundError: ``bfcl_eval`` is not installed.
        FileNotFoundError: the package has no such category (or no ground truth for it).
        ValueError: an entry has no ground truth.
    """
    data = bfcl_package_dir() / "data"
    entries = read_jsonl(data / f"BFCL_v4_{category}.json")
    answer_file = data / "possible_answer" / f"BFCL_v4_{category}.json"
    answers = {row["id"]: row["ground_truth"] for row in read_jsonl(answer_file)}
    for entry in entries:
        if entry["id"] not in answers:
            raise ValueError(f"BFCL entry {entry['id']!r} has no ground truth in possible_answer/")
        entry["ground_truth"] = answers[entry["id"]]
    return entries


def load_multi_turn_func_docs(class_name: str) -> list[dict[str, Any]]:
    """The function schemas (BFCL format) of one multi-turn tool class, e.g. ``"GorillaFileSystem"``.

    Raises:
        KeyError: unknown class.
    """
    from bfcl_eval.constants.executable_backend_config import (
        MULTI_TURN_FUNC_DOC_FILE_MAPPING,
    )

    file = MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]
    return read_jsonl(bfcl_package_dir() / "data" / "multi_turn_func_doc" / file)


def to_json_schema(function: dict[str, Any]) -> dict[str, Any]:
    """One BFCL function doc as a JSON Schema function: ``{"name", "description", "parameters"}``.

    Types are mapped as BFCL's OpenAI-style handlers map them ("dict" -> "object", "float" -> "number",
    "tuple" -> "array", "any" -> "string"), recursively through ``properties`` and ``items``. The name
    is kept as given (dots included). The ``response`` schema of multi-turn docs is dropped (it only
    lengthens the prompt). The input is not modified.
    """
    params = _convert(copy.deepcopy(function.get("parameters") or {"type": "dict", "properties": {}}))
    params["type"] = "object"
    params.setdefault("properties", {})
    return {"name": function["name"], "description": function.get("description", ""), "parameters": params}


def _convert(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    if isinstance(schema.get("type"), str):
        schema["type"] = _JSON_SCHEMA_TYPES.get(schema["type"], "string")
    if isinstance(schema.get("properties"), dict):
        schema["properties"] = {k: _convert(v) for k, v in schema["properties"].items()}
    if isinstance(schema.get("items"), dict):
        schema["items"] = _convert(schema["items"])
    return schema
