"""Deprecated: the single-turn BFCL task and its call format and checker moved to :mod:`lopd_lightning.tasks.bfcl`.

Each name still imports from here for one release, with a ``FutureWarning`` (once per name) naming its
new module; the task registry names (``bfcl_simple_python``, ...) are unchanged.
"""

from lopd_lightning.deprecation import moved_names

_MOVES = {
    "BFCLTask": "lopd_lightning.tasks.bfcl.single_turn:BFCLTask",
    "CATEGORIES": "lopd_lightning.tasks.bfcl.single_turn:CATEGORIES",
    "DEFAULT_SYSTEM_PROMPT": "lopd_lightning.tasks.bfcl.prompt:DEFAULT_SYSTEM_PROMPT",
    "check_system_prompt": "lopd_lightning.tasks.bfcl.prompt:check_system_prompt",
    "tools_system_text": "lopd_lightning.tasks.bfcl.prompt:tools_system_text",
    "with_system": "lopd_lightning.tasks.bfcl.prompt:with_system",
    **{name: f"lopd_lightning.tasks.bfcl.calls:{name}" for name in (
        "ToolCall", "format_tool_calls", "parse_python_calls", "parse_tool_calls", "unparsed_reason")},
    **{name: f"lopd_lightning.tasks.bfcl.checker:{name}" for name in (
        "CheckResult", "check_tool_calls", "expected_arguments", "find_function", "names_match", "reference_calls",
        "standardize_string")},
}

__getattr__ = moved_names(__name__, _MOVES)
