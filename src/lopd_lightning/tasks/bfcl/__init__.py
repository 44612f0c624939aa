"""BFCL v4 (the Berkeley Function-Calling Leaderboard) as tasks: function calling, single- and multi-turn.

One concern per module:

- :mod:`~lopd_lightning.tasks.bfcl.data`: reading the data files that the ``bfcl_eval`` package ships;
- :mod:`~lopd_lightning.tasks.bfcl.calls`: the call format (reading calls out of a reply, writing them);
- :mod:`~lopd_lightning.tasks.bfcl.checker`: BFCL's AST checker, rewritten, and the ground truth as calls;
- :mod:`~lopd_lightning.tasks.bfcl.prompt`: the system message with the tools' schemas;
- :mod:`~lopd_lightning.tasks.bfcl.single_turn`: :class:`BFCLTask`, the single-turn categories
  (registry names ``bfcl_simple_python``, ``bfcl_live_simple``, ...);
- :mod:`~lopd_lightning.tasks.bfcl.environment`: the multi-turn tool classes as a live environment;
- :mod:`~lopd_lightning.tasks.bfcl.multi_turn`: :class:`BFCLMultiTurnTask` (``bfcl_multi_turn_base``).

Each category list stays in its module (``single_turn.CATEGORIES``, ``multi_turn.CATEGORIES``).
"""

from lopd_lightning.tasks.bfcl.calls import (
    ToolCall,
    format_tool_calls,
    parse_python_calls,
    parse_tool_calls,
    unparsed_reason,
)
from lopd_lightning.tasks.bfcl.checker import (
    CheckResult,
    check_tool_calls,
    expected_arguments,
    find_function,
    names_match,
    reference_calls,
    standardize_string,
)
from lopd_lightning.tasks.bfcl.environment import (
    ToolEnvironment,
    missing_results,
    parse_ground_truth_call,
    state_differences,
)
from lopd_lightning.tasks.bfcl.multi_turn import (
    DEFAULT_MULTI_TURN_SYSTEM_PROMPT,
    END_OF_TURN_REPLY,
    BFCLMultiTurnEpisode,
    BFCLMultiTurnTask,
)
from lopd_lightning.tasks.bfcl.prompt import (
    DEFAULT_SYSTEM_PROMPT,
    check_system_prompt,
    tools_system_text,
    with_system,
)
from lopd_lightning.tasks.bfcl.single_turn import BFCLTask

__all__ = [
    "DEFAULT_MULTI_TURN_SYSTEM_PROMPT",
    "DEFAULT_SYSTEM_PROMPT",
    "END_OF_TURN_REPLY",
    "BFCLMultiTurnEpisode",
    "BFCLMultiTurnTask",
    "BFCLTask",
    "CheckResult",
    "ToolCall",
    "ToolEnvironment",
    "check_system_prompt",
    "check_tool_calls",
    "expected_arguments",
    "find_function",
    "format_tool_calls",
    "missing_results",
    "names_match",
    "parse_ground_truth_call",
    "parse_python_calls",
    "parse_tool_calls",
    "reference_calls",
    "standardize_string",
    "state_differences",
    "tools_system_text",
    "unparsed_reason",
    "with_system",
]
