"""The system message of the BFCL tasks: SmolLM2's tool-use system text with the tools' JSON schemas.

SmolLM2-135M-Instruct's packaged chat template does not render tools, so the tasks write them into the
system message themselves, inside ``<tools></tools>`` (:data:`DEFAULT_SYSTEM_PROMPT`, the system text of
SmolLM2's tool-use template); the call format it asks for is :mod:`lopd_lightning.tasks.bfcl.calls`'.
"""

from __future__ import annotations

import json
from typing import Any

from lopd_lightning.tasks.base import Message
from lopd_lightning.tasks.bfcl.data import to_json_schema

__all__ = ["DEFAULT_SYSTEM_PROMPT", "check_system_prompt", "tools_system_text", "with_system"]

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
