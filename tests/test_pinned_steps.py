"""Pinned step values: what each method's step computes, compared with committed numbers.

Nothing else pins the numbers a step produces: a change that moves a method's loss, reward, beta or Delta (or a
smoke config that trains nothing) would pass every other test. As torchtune pins its recipes' losses, these tests
pin, float32 on CPU with one torch thread:

* ``tests/pinned/step_values.json``: per method, the loss pieces of one fixed teacher-forced batch (no generation)
  through the method's own public functions (``tests/scripts/pin_steps.py``, ``teacher_forced_values``): GRPO's
  loss, pg_loss, KL and clip fraction at ratio 1 and at shifted old log-probs; Skill-SD's the same plus its SDL;
  SDPO's and OPSD's distillation loss, kept rows and tokens; SFT's NLL; LOPD's ``LOPDModule.losses`` (student
  distillation loss, composer loss, distill_c, Delta, anchor, rows with latents), at rtol 1e-5 / atol 1e-6.
* ``tests/pinned/fit_values.json``: per method, the logged values after each of 2 steps of a seeded tiny-model
  ``fit`` (``fit_method``): LOPD's train/loss, reward_mean, beta, margin_delta and composer_loss (configs/tiny.yaml's
  module and its shipped bank configs/tiny_bank/), the others' train/loss and train/reward_mean (GRPO: and the clip
  fraction; Skill-SD: and the SDL), at rtol 1e-4 / atol 1e-6.

Run to run on one CPU both sets are bitwise identical (measured: two runs of the script, ``cmp`` of their output).
Across CPUs they are not: the kernels torch dispatches to differ (AVX2 / AVX-512), and the values pinned on an Intel
Xeon came out up to 8e-8 away on an AMD EPYC (absolute; on distillation losses of 1e-5 to 2e-4, up to 1.2% relative:
a KL of two nearly equal distributions is a small difference of float32 log-probs near -10, whose rounding is about
1e-7). The absolute tolerance, 1e-6, is that rounding with room; the relative one checks the values above 0.1
(GRPO's losses, Delta's terms, beta, rewards) as tightly as before. The price: on the smallest pinned values (the
distillation losses, 6e-6 to 2e-4) a change smaller than 1e-6 passes (up to 15% of the SDPO fit loss).

Regenerate with ``python tests/scripts/pin_steps.py`` (``--check`` prints the largest differences and writes
nothing). Regenerating is legitimate only after a deliberate change to what a step computes: a loss, the tiny
model or tokenizer, the sampler or generation, the toy task, a default of a method, or the fixtures of the script;
the commit message and CHANGELOG.md then say which change moved which values. An unexplained diff is a regression
to find, not a number to refresh: do not regenerate to make these tests pass.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent / "scripts" / "pin_steps.py"
_spec = importlib.util.spec_from_file_location("_pin_steps", SCRIPT)
pin_steps = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = pin_steps
_spec.loader.exec_module(pin_steps)

STEP_RTOL, STEP_ATOL = 1e-5, 1e-6  # teacher-forced: bitwise identical run to run on one CPU; see the docstring
FIT_RTOL, FIT_ATOL = 1e-4, 1e-6  # two optimiser steps and sampling: the same

REGENERATE = ("a deliberate change? regenerate with `python tests/scripts/pin_steps.py` and say why in the commit "
              "message and CHANGELOG (see this module's docstring); otherwise this is a regression")


def pinned(path: Path) -> dict:
    return json.loads(path.read_text())


def assert_matches(got: dict[str, float], expected: dict[str, float], *, rtol: float, atol: float, where: str) -> None:
    assert sorted(got) == sorted(expected), (
        f"{where}: pinned keys {sorted(expected)}, computed {sorted(got)}; {REGENERATE}"
    )
    wrong = {
        key: (expected[key], got[key]) for key in expected
        if not math.isclose(got[key], expected[key], rel_tol=rtol, abs_tol=atol)
    }
    assert not wrong, f"{where}: (pinned, computed) {wrong}; {REGENERATE}"


def test_every_method_is_pinned():
    assert sorted(pinned(pin_steps.STEP_VALUES)) == sorted(pin_steps.TEACHER_FORCED)
    fit = pinned(pin_steps.FIT_VALUES)
    assert sorted(fit) == sorted(pin_steps.FIT_TAGS)
    assert all(len(steps) == pin_steps.FIT_STEPS for steps in fit.values())


def test_pinned_values_say_something():
    """The pinned runs train: no method's pins are all zeros (a smoke setup that trains nothing is no pin)."""
    step, fit = pinned(pin_steps.STEP_VALUES), pinned(pin_steps.FIT_VALUES)
    assert step["grpo"]["shifted_old/train/clip_fraction"] > 0 and step["grpo"]["ratio1/train/kl"] > 0
    assert step["skill_sd"]["ratio1/train/sdl"] > 0
    assert step["sdpo"]["loss"] > 0 and step["opsd"]["loss"] > 0 and step["sft"]["loss"] > 0
    lopd = step["lopd"]
    assert lopd["loss_student"] > 0 and lopd["anchor"] > 0 and lopd["delta"] != 0 and lopd["rows_with_latents"] > 0
    assert fit["lopd"][1]["train/beta"] != fit["lopd"][0]["train/beta"]  # the dual ascent moved beta
    assert all(s["train/margin_delta"] != 0 for s in fit["lopd"])
    assert abs(fit["grpo"][0]["train/loss"]) > 1e-3  # rewards varied within the group: a policy gradient
    assert all(s["train/sdl"] > 0 for s in fit["skill_sd"])
    for method in ("sdpo", "opsd", "sft"):
        assert all(s["train/loss"] > 0 for s in fit[method]), method
        assert fit[method][0]["train/loss"] != fit[method][1]["train/loss"], method  # the student moved


@pytest.mark.parametrize("method", sorted(pin_steps.TEACHER_FORCED))
def test_teacher_forced_step_values(method):
    torch.set_num_threads(1)
    got = pin_steps.TEACHER_FORCED[method]()
    assert_matches(got, pinned(pin_steps.STEP_VALUES)[method], rtol=STEP_RTOL, atol=STEP_ATOL,
                   where=f"{method} (teacher-forced)")


@pytest.mark.parametrize("method", sorted(pin_steps.FIT_TAGS))
def test_fit_step_values(method, tmp_path):
    got = pin_steps.fit_method(method, tmp_path)
    expected = pinned(pin_steps.FIT_VALUES)[method]
    assert len(got) == len(expected), f"{method}: {len(got)} steps logged, {len(expected)} pinned"
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_matches(g, e, rtol=FIT_RTOL, atol=FIT_ATOL, where=f"{method} (fit, step {i + 1})")
