"""Deprecated names of :mod:`lopd_lightning.rollout`, kept for one release (each warns once, FutureWarning)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lopd_lightning.deprecation import warn_once
from lopd_lightning.rollout.batch import RolloutBatch

__all__ = ["collate_batches"]


def collate_batches(batches: Sequence[RolloutBatch], *, renumber_groups: bool = True) -> RolloutBatch:
    """Deprecated: concatenate batches row-wise and re-pad (right) to the longest sequence; result on CPU.

    Args:
        batches: one or more batches (any devices); padding uses the first batch's ``pad_token_id``.
        renumber_groups: renumber group ids 0, 1, ... in order of first appearance within each batch,
            distinct across batches (two batches that both start at group 0 stay apart). False keeps
            the ids as they are.

    Returns:
        A :class:`RolloutBatch`; ``experiences`` are concatenated when every batch has them, else None;
        ``stats`` are summed when every batch has them, else None.

    Raises:
        ValueError: no batches.
    """
    warn_once(
        "lopd_lightning.rollout.collate_batches",
        "collate_batches is deprecated and will be removed; nothing in lopd_lightning uses it "
        "(tests/test_rollout.py keeps a copy of its logic)",
    )
    if not batches:
        raise ValueError("collate_batches needs at least one batch")
    batches = [b.to("cpu") for b in batches]
    pad = batches[0].pad_token_id
    t = max(b.input_ids.shape[1] for b in batches)

    def cat2(name: str, value: Any) -> Tensor:
        parts = []
        for b in batches:
            x = getattr(b, name)
            if x.shape[1] < t:
                fill = torch.full((x.shape[0], t - x.shape[1]), value, dtype=x.dtype)
                x = torch.cat([x, fill], dim=1)
            parts.append(x)
        return torch.cat(parts, dim=0)

    groups = []
    offset = 0
    for b in batches:
        g = b.group_ids
        if renumber_groups:
            mapping: dict[int, int] = {}
            for gid in g.tolist():
                mapping.setdefault(gid, len(mapping))
            g = torch.tensor([mapping[x] + offset for x in g.tolist()], dtype=torch.long)
            offset += len(mapping)
        groups.append(g)

    def cat_list(name: str) -> list[Any] | None:
        if any(getattr(b, name) is None for b in batches):
            return None
        return [x for b in batches for x in getattr(b, name)]

    stats = None
    if all(b.stats is not None for b in batches):
        stats = batches[0].stats
        for b in batches[1:]:
            stats = stats + b.stats
    return RolloutBatch(
        input_ids=cat2("input_ids", pad),
        attention_mask=cat2("attention_mask", 0),
        assistant_mask=cat2("assistant_mask", False),
        sampling_logps=cat2("sampling_logps", 0.0),
        rewards=torch.cat([b.rewards for b in batches]),
        group_ids=torch.cat(groups),
        context_position=torch.cat([b.context_position for b in batches]),
        example_ids=[x for b in batches for x in b.example_ids],
        messages=[x for b in batches for x in b.messages],
        metadata=[x for b in batches for x in b.metadata],
        experiences=cat_list("experiences"),
        stats=stats,
        pad_token_id=pad,
    )
