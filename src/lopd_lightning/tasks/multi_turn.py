"""Deprecated: the BFCL multi-turn task and its environment moved to :mod:`lopd_lightning.tasks.bfcl`.

Each name still imports from here for one release, with a ``FutureWarning`` (once per name) naming its
new module; the task registry name ``bfcl_multi_turn_base`` is unchanged.
"""

from lopd_lightning.deprecation import moved_names

_MOVES = {
    **{name: f"lopd_lightning.tasks.bfcl.multi_turn:{name}" for name in (
        "CATEGORIES", "DEFAULT_MULTI_TURN_SYSTEM_PROMPT", "END_OF_TURN_REPLY", "BFCLMultiTurnEpisode",
        "BFCLMultiTurnTask", "RewardMode")},
    **{name: f"lopd_lightning.tasks.bfcl.environment:{name}" for name in (
        "ToolEnvironment", "missing_results", "parse_ground_truth_call", "state_differences")},
}

__getattr__ = moved_names(__name__, _MOVES)
