"""The ranges of the methods' numeric options, checked before the student's weights load.

:func:`check_option_ranges` runs in :class:`~lopd_lightning.modules.base.OnPolicyModule`'s constructor on the
hyperparameters of the whole constructor chain (Lightning's ``save_hyperparameters`` collects a subclass's
arguments too), so one table covers the shared options and each method's own: a value out of range is one
line naming ``model.init_args.<key>``, the range and what the value means, where it was a traceback from
deep inside a step (a negative ``max_new_tokens``) or a run that silently did something else (a negative
``max_demo_chars`` cuts the last characters off every demonstration). Options a method checks itself, with
a message of its own (``group_size``, ``temperature``, LOPD's ``num_latents``...), are not repeated here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["OPTION_RANGES", "Range", "check_option_ranges"]


@dataclass(frozen=True)
class Range:
    """A closed or open interval of a numeric option; ``None`` bounds are unbounded.

    Attributes:
        low, high: the bounds.
        low_open, high_open: the bound itself is outside.
        nullable: null (None) is allowed.
        note: what the edge values mean, appended to the message (``"0: no clipping"``).
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    nullable: bool = False
    note: str = ""

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return not (self.high is not None and (value > self.high or (self.high_open and value == self.high)))

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {self.high:g}"
        else:
            text = "a finite number"
        return f"{text}{' or null' if self.nullable else ''}{f' ({self.note})' if self.note else ''}"


_COUNT = Range(low=1)
_OPTIONAL_COUNT = Range(low=1, nullable=True)
_NON_NEGATIVE = Range(low=0)

#: option name -> its range, for every method that has the option (checked where it is among the hyperparameters)
OPTION_RANGES: dict[str, Range] = {
    # every method (OnPolicyModule)
    "weight_decay": _NON_NEGATIVE,
    "grad_clip": Range(low=0, note="0: no clipping"),
    "top_p": Range(low=0, high=1, low_open=True, note="1: no nucleus cut"),
    "max_new_tokens": _COUNT,
    "max_turns": Range(low=1, nullable=True, note="null: the rollout default"),
    "max_prompt_tokens": Range(low=1, nullable=True, note="null: no limit"),
    "val_max_new_tokens": Range(low=1, nullable=True, note="null: max_new_tokens"),
    "success_threshold": Range(),
    # the self-distillation methods (SDPO, OPSD, Skill-SD) and LOPD
    "distill_temperature": Range(low=0, low_open=True),
    "teacher_ema_rate": Range(low=0, high=1, note="the student's share in each EMA update"),
    "max_demo_chars": _NON_NEGATIVE,
    "max_feedback_chars": _NON_NEGATIVE,
    "max_reference_chars": _NON_NEGATIVE,
    # LOPD
    "composer_depth": _COUNT,
    "composer_clip_compressor": Range(low=0, note="0: no clipping"),
    "composer_clip_lora": Range(low=0, note="0: no clipping"),
    "margin": Range(low=0, note="the privileged margin m; 0: the m = 0 ablation"),
    "anchor_weight": _NON_NEGATIVE,
    "bank_capacity": Range(low=1, nullable=True, note="null: unbounded"),
    "max_experience_tokens": _COUNT,
    "warm_start_steps": Range(low=0, note="0: no warm start"),
}


def check_option_ranges(hparams: Mapping[str, Any], ranges: Mapping[str, Range] = OPTION_RANGES) -> None:
    """Refuse the first option of ``hparams`` whose value is outside its range in ``ranges``.

    Args:
        hparams: option name -> value (a module's ``hparams``; names not in ``ranges`` are not checked; a value
            that is not a number, or null where null is not allowed, is refused like one out of range).

    Raises:
        ValueError: ``model.init_args.<key> must be <range>, got <value>``.
    """
    for key, rule in ranges.items():
        if key not in hparams:
            continue
        value = hparams[key]
        if value is None and rule.nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not rule.holds(float(value)):
            raise ValueError(f"model.init_args.{key} must be {rule.describe()}, got {value!r}")
