"""Tool use with hidden rules: a procedurally generated task family where experience carries what the docs leave out.

One concern per module:

- :mod:`~lopd_lightning.tasks.hidden_rules.tools`: the tools (BFCL-format docs), their hidden rules' variants
  and the request generators; 11 rule tools and 4 plain tools (kind ``"none"``: complete docs, no rule);
- :mod:`~lopd_lightning.tasks.hidden_rules.checker`: the verdict on a reply's calls, naming the broken rule;
- :mod:`~lopd_lightning.tasks.hidden_rules.task`: :class:`HiddenRulesTask` (registry name ``hidden_rules``),
  whose module docstring gives the rule kinds, the splits and the seed;
- :mod:`~lopd_lightning.tasks.hidden_rules.multi_turn`: :class:`HiddenRulesMultiTurnTask`
  (``hidden_rules_multi_turn``): a failed reply is answered with its error, and the agent retries.
"""

from lopd_lightning.tasks.hidden_rules.checker import Verdict, check_calls
from lopd_lightning.tasks.hidden_rules.multi_turn import HiddenRulesEpisode, HiddenRulesMultiTurnTask
from lopd_lightning.tasks.hidden_rules.task import DEFAULT_N_HELDOUT, DEFAULT_N_TRAIN, HiddenRulesTask
from lopd_lightning.tasks.hidden_rules.tools import (
    PLAIN,
    PLAIN_TOOLS,
    RULE_KINDS,
    RULE_TOOLS,
    TOOLS,
    ToolSpec,
    Variant,
    draw_rules,
    offsets_changing,
)

__all__ = [
    "DEFAULT_N_HELDOUT",
    "DEFAULT_N_TRAIN",
    "PLAIN",
    "PLAIN_TOOLS",
    "RULE_KINDS",
    "RULE_TOOLS",
    "TOOLS",
    "HiddenRulesEpisode",
    "HiddenRulesMultiTurnTask",
    "HiddenRulesTask",
    "ToolSpec",
    "Variant",
    "Verdict",
    "check_calls",
    "draw_rules",
    "offsets_changing",
]
