"""Group-relative advantages for GRPO-style baselines.

Rollouts of the same task form a group of ``group_size`` consecutive entries; each reward is compared
with its group's mean and scaled by its group's standard deviation. A pure tensor function: rewards in,
advantages out (docs/METHOD.md section 6).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_advantages"]


def group_advantages(rewards: Tensor, *, group_size: int, eps: float = 1e-4) -> Tensor:
    """Group-normalised advantages ``(r - mean_G r) / (std_G r + eps)``.

    Groups are contiguous: rollouts ``[g * G, (g + 1) * G)`` belong to task g (G = ``group_size``).
    The standard deviation is Bessel-corrected, as ``torch.std`` (divide by G - 1). A group whose rewards
    are all equal gets exact zeros (not ``0 / eps`` rounding noise from an inexact mean). With one high
    reward among G - 1 equal ones the advantage is at most ``(G - 1) / sqrt(G)`` in size (2.47 for
    G = 8), however small the spread.

    Args:
        rewards: (N,) float (or integer/bool, converted to float32) rewards, N = number of groups * G.
        group_size: G, rollouts per task, >= 2.
        eps: added to each group's std, >= 0.

    Returns:
        (N,) float32 (float64 for float64 rewards) advantages, one per rollout.

    Raises:
        ValueError: ``rewards`` is not 1-D; ``group_size`` < 2 (group-relative methods need two or
            more rollouts per task); N is not divisible by ``group_size`` (the message names both); a
            reward is NaN or infinite (the message names its index); ``eps`` < 0.

    Source: GRPO, Shao et al. 2024 (DeepSeekMath), section 4.1.2, outcome supervision:
    A_i = (r_i - mean(r)) / std(r); docs/METHOD.md section 6 (G = 4, + eps).
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {group_size!r}")
    if group_size < 2:
        raise ValueError(
            f"group-relative methods need group_size >= 2 (several rollouts per task), got {group_size}"
        )
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(
            f"the number of rewards N={n} is not divisible by group_size={group_size}; groups are "
            "contiguous runs of group_size rollouts of the same task"
        )
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.detach().to(dtype)
    bad = (~torch.isfinite(r)).nonzero().flatten()
    if bad.numel():
        first = int(bad[0])
        raise ValueError(
            f"reward at index {first} is {r[first].item()} (non-finite rewards at indices "
            f"{bad.tolist()[:10]}); rewards must be finite"
        )
    grouped = r.view(-1, group_size)  # [N / G, G]
    mean = grouped.mean(dim=-1, keepdim=True)  # [N / G, 1]
    std = grouped.std(dim=-1, keepdim=True)  # [N / G, 1], Bessel-corrected
    constant = (grouped == grouped[:, :1]).all(dim=-1, keepdim=True)  # [N / G, 1]
    advantages = (grouped - mean) / (std + eps)
    advantages = torch.where(constant, torch.zeros_like(advantages), advantages)
    return advantages.view(n)
