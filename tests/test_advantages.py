"""Tests for lopd_lightning.advantages.group_advantages."""

from __future__ import annotations

import math

import pytest
import torch

from lopd_lightning.advantages import group_advantages


def test_hand_value_pair():
    # [0, 1], G = 2: mean 0.5, Bessel std sqrt((0.25 + 0.25) / 1) = 0.707107,
    # A = +-0.5 / (0.707107 + 1e-4) = +-0.707007.
    out = group_advantages(torch.tensor([0.0, 1.0]), group_size=2)
    expected = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert expected == pytest.approx(0.707007, abs=1e-6)
    torch.testing.assert_close(out, torch.tensor([-expected, expected]))


def test_groups_are_contiguous():
    # [0, 1, 5, 5, 2, 4], G = 2: groups (0, 1), (5, 5), (2, 4).
    # (0, 1) and (2, 4) both have centred values +-d and Bessel std d * sqrt 2:
    # A = +-d / (d sqrt 2 + 1e-4); the constant group (5, 5) gives exact zeros.
    out = group_advantages(torch.tensor([0.0, 1.0, 5.0, 5.0, 2.0, 4.0]), group_size=2)
    a1 = 0.5 / (0.5 * math.sqrt(2) + 1e-4)
    a2 = 1.0 / (1.0 * math.sqrt(2) + 1e-4)
    torch.testing.assert_close(out, torch.tensor([-a1, a1, 0.0, 0.0, -a2, a2]))


def test_one_outlier_is_bounded():
    # [0.35] * 7 + [0.95], G = 8: mean 0.425, centred [-0.075] * 7 + [0.525],
    # Bessel std sqrt((7 * 0.075^2 + 0.525^2) / 7) = sqrt(0.315 / 7) = sqrt(0.045) = 0.212132,
    # A = -0.075 / 0.212232 = -0.353386 (x7) and 0.525 / 0.212232 = 2.473703; |A| < 3.
    out = group_advantages(torch.tensor([0.35] * 7 + [0.95]), group_size=8)
    std = math.sqrt(0.045)
    expected = torch.tensor([-0.075 / (std + 1e-4)] * 7 + [0.525 / (std + 1e-4)])
    assert torch.isfinite(out).all() and out.abs().max() < 3
    torch.testing.assert_close(out, expected)
    assert out[-1].item() == pytest.approx(2.473703, abs=1e-4)


def test_tiny_spread_stays_bounded():
    # however small the spread, one outlier among 8 is bounded by (G - 1) / sqrt(G) = 2.4749
    out = group_advantages(torch.tensor([0.35] * 7 + [0.35 + 1e-6]), group_size=8)
    assert torch.isfinite(out).all() and out.abs().max() <= 7 / math.sqrt(8) + 1e-4


def test_constant_group_is_exact_zero():
    # 0.1 is not exactly representable: an inexact mean would leave ~1e-8 / 1e-4 noise
    for value in (0.1, 0.35, 1.0, 0.0):
        out = group_advantages(torch.full((8,), value), group_size=4)
        assert torch.equal(out, torch.zeros(8))


def test_float64_and_integer_rewards():
    rewards64 = torch.tensor([0.0, 1.0], dtype=torch.float64)
    assert group_advantages(rewards64, group_size=2).dtype == torch.float64
    out = group_advantages(torch.tensor([0, 1, 1, 1]), group_size=2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[2:], torch.zeros(2))


def test_nan_reward_raises_naming_index():
    rewards = torch.tensor([0.0, 1.0, 0.5, float("nan")])
    with pytest.raises(ValueError, match="index 3"):
        group_advantages(rewards, group_size=2)


def test_non_divisible_raises():
    with pytest.raises(ValueError, match=r"N=5.*group_size=2"):
        group_advantages(torch.zeros(5), group_size=2)


def test_group_size_one_raises():
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.zeros(4), group_size=1)


def test_not_1d_raises():
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), group_size=2)
