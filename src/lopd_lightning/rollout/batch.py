"""The batch every method trains on: :class:`RolloutBatch` (token ids, masks, rewards) and :class:`RolloutStats`.

Conventions of every :class:`RolloutBatch`:

- RIGHT padding: each sequence starts at index 0 and is followed by padding; ``attention_mask`` is 1 on
  the real tokens. (Generation inputs are left padded inside the backend; a batch never is.)
- ``assistant_mask`` (docs/METHOD.md section 1, omega) is True exactly on the tokens the student generated,
  its EOS included, and False on the prompt, template tokens, tool output and padding (also when the pad
  id equals the EOS id: the mask is built from positions, never from token values). A reply that ended on
  another EOS id of the generation config holds the template's end-of-turn token there instead, with mask 0
  (the ids are the template's rendering; the policy did not sample that token).
- ``sampling_logps`` is ``log_softmax(z / temperature)[token]`` where ``z`` are the model's logits in
  float32 at that position (before top-k and top-p filtering), 0 off the assistant tokens: what the
  generation backend reported (:mod:`lopd_lightning.rollout.backends`). The "old log-probs" of the PPO
  ratio (docs/METHOD.md section 6) are not these: the trainer recomputes them with the student.
- ``context_position`` is the index of the first token of the first user message's content: where a
  self-teacher inserts its privileged context (docs/METHOD.md section 4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lopd_lightning.tasks.base import Message

__all__ = ["RolloutBatch", "RolloutStats"]


@dataclass
class RolloutStats:
    """Wall-clock accounting of one :func:`~lopd_lightning.rollout.generate_rollouts` call (seconds; counts).

    Attributes:
        generate_seconds: time inside the generation backend's ``generate`` (prefill, decoding, sampling).
        env_seconds: time inside the task (``task.start``, ``Episode.step``, the reward).
        tokenize_seconds: time rendering chat templates and tokenizing prompts and observations.
        total_seconds: the whole call.
        generate_calls: number of ``generate`` calls of the backend (turns x chunks).
        generated_tokens: tokens the student generated (the sum of the assistant masks).
        rollouts: number of rollouts (rows).
        secondary_eos: replies that ended on an EOS id other than the template's end-of-turn token (a
            second id of ``generation_config.eos_token_id``); that token is recorded as the template's, mask 0.
        lone_surrogates: replies, observation messages and step infos in which lone UTF-16 surrogates
            (invalid Unicode, model-written) were replaced with U+FFFD.
    """

    generate_seconds: float = 0.0
    env_seconds: float = 0.0
    tokenize_seconds: float = 0.0
    total_seconds: float = 0.0
    generate_calls: int = 0
    generated_tokens: int = 0
    rollouts: int = 0
    secondary_eos: int = 0
    lone_surrogates: int = 0

    def __add__(self, other: RolloutStats) -> RolloutStats:
        return RolloutStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)}
        )

    def as_dict(self) -> dict[str, float]:
        """The fields as a flat dict (for logging)."""
        return dataclasses.asdict(self)


@dataclass
class RolloutBatch:
    """A batch of trajectories as token ids, masks and rewards, RIGHT padded (sequences start at 0).

    Attributes:
        input_ids: (B, T) long; padding holds ``pad_token_id``.
        attention_mask: (B, T) long, 1 on real tokens (a prefix of each row), 0 on padding.
        assistant_mask: (B, T) bool, True exactly on tokens the student generated (its EOS included);
            False on prompt, template tokens, tool output and padding (and on the template's end-of-turn
            token that replaces a secondary EOS id: :class:`RolloutStats` ``secondary_eos``).
        rewards: (B,) float32, trajectory rewards in [0, 1].
        group_ids: (B,) long; rollouts of the same example share an id and are contiguous.
        sampling_logps: (B, T) float32, log-prob of each generated token under the sampling distribution
            ``log_softmax(logits / temperature)`` (before top-k/top-p filtering); 0 off the assistant
            tokens and in teacher-forced batches.
        context_position: (B,) long, index in ``input_ids`` of the first token of the first user
            message's content (where a self-teacher inserts privileged context).
        example_ids: B example ids.
        messages: B conversations (``{"role", "content"}`` dicts; assistant contents are the decoded replies).
        metadata: B dicts per episode: ``turns`` (assistant replies), ``truncated`` (bool), ``truncation``
            (None, "max_turns", "context" or "max_length"), ``errors`` (environment error strings), ``info``
            (the ``StepResult.info`` of the episode's last step: the checker's diagnostics) and
            rollout details (``reply_tokens``, ``stop_reasons``, ``example_index``, ``sample_index``).
        experiences: per row, the retrieved experiences (set by a method with an experience bank after
            the rollouts, e.g. LOPD's retrieval), or None.
        stats: timing of the call that made the batch (None for teacher-forced batches).
        pad_token_id: the id used for padding ``input_ids``.

    Raises:
        ValueError: fields disagree in batch size or sequence length.
    """

    input_ids: Tensor
    attention_mask: Tensor
    assistant_mask: Tensor
    rewards: Tensor
    group_ids: Tensor
    sampling_logps: Tensor
    context_position: Tensor
    example_ids: list[str]
    messages: list[list[Message]]
    metadata: list[dict[str, Any]]
    experiences: list[Any] | None = None
    stats: RolloutStats | None = None
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        b, t = self.input_ids.shape
        for name in ("attention_mask", "assistant_mask", "sampling_logps"):
            if tuple(getattr(self, name).shape) != (b, t):
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected {(b, t)}")
        for name in ("rewards", "group_ids", "context_position"):
            if tuple(getattr(self, name).shape) != (b,):
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected {(b,)}")
        for name in ("example_ids", "messages", "metadata", "experiences"):
            value = getattr(self, name)
            if value is not None and len(value) != b:
                raise ValueError(f"RolloutBatch.{name} has {len(value)} entries, expected {b}")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> RolloutBatch:
        """A copy with every tensor on ``device`` (lists are shared, not copied)."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return dataclasses.replace(self, **moved)

    def num_assistant_tokens(self) -> int:
        """The number of assistant (trained) tokens, ``assistant_mask.sum()``."""
        return int(self.assistant_mask.sum().item())

    def reply_lengths(self) -> tuple[Tensor, Tensor]:
        """Every generated reply of the batch (all turns of all rows, in order), from ``metadata``'s
        ``reply_tokens`` and ``stop_reasons``.

        Returns:
            ``(tokens, cut)``: (R,) float32 tokens per reply, and (R,) float32 1.0 where the reply ended
            at the token limit (stop reason ``"length"``), else 0.0; both on the CPU, and empty (R = 0)
            for a batch whose metadata has no replies (teacher-forced).

        Raises:
            ValueError: a row's ``reply_tokens`` and ``stop_reasons`` differ in length.
        """
        tokens = [float(n) for m in self.metadata for n in m.get("reply_tokens") or []]
        cut = [float(r == "length") for m in self.metadata for r in m.get("stop_reasons") or []]
        if len(cut) != len(tokens):
            raise ValueError(f"RolloutBatch.metadata holds {len(tokens)} reply_tokens but {len(cut)} stop_reasons")
        return torch.tensor(tokens, dtype=torch.float32), torch.tensor(cut, dtype=torch.float32)

    def lengths(self) -> Tensor:
        """(B,) long, the number of real tokens per row."""
        return self.attention_mask.sum(dim=1)

    def select(self, indices: Sequence[int] | Tensor) -> RolloutBatch:
        """The rows ``indices`` (a list of ints, a long tensor or a (B,) bool tensor), in that order.

        Trailing columns that are padding in every selected row are dropped. Group ids are kept as they
        are; ``stats`` is shared with the parent batch.
        """
        idx = torch.as_tensor(indices)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        idx = idx.long().cpu()
        rows = idx.tolist()
        t = int(self.attention_mask[idx.to(self.attention_mask.device)].sum(dim=1).max().item()) if rows else 0
        dev = self.input_ids.device

        def take(x: Tensor, two_d: bool) -> Tensor:
            out = x[idx.to(dev)]
            return out[:, :t] if two_d else out

        return dataclasses.replace(
            self,
            input_ids=take(self.input_ids, True),
            attention_mask=take(self.attention_mask, True),
            assistant_mask=take(self.assistant_mask, True),
            sampling_logps=take(self.sampling_logps, True),
            rewards=take(self.rewards, False),
            group_ids=take(self.group_ids, False),
            context_position=take(self.context_position, False),
            example_ids=[self.example_ids[i] for i in rows],
            messages=[self.messages[i] for i in rows],
            metadata=[self.metadata[i] for i in rows],
            experiences=None if self.experiences is None else [self.experiences[i] for i in rows],
        )


def _pad_right(rows: Sequence[Sequence[Any]], value: Any, dtype: torch.dtype, length: int | None = None) -> Tensor:
    """(B, T) tensor of ``rows`` right padded with ``value`` to ``length`` (default: the longest row)."""
    t = max((len(r) for r in rows), default=0) if length is None else length
    out = torch.full((len(rows), t), value, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(list(r), dtype=dtype)
    return out


def _token_tensors(
    ids: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], logps: Sequence[Sequence[float]], pad_id: int
) -> dict[str, Tensor]:
    """The four (B, T) tensors of a :class:`RolloutBatch` from per-row lists, right padded to the longest row.

    Returns:
        ``input_ids`` (long, padded with ``pad_id``), ``attention_mask`` (long), ``assistant_mask`` (bool)
        and ``sampling_logps`` (float32, 0 on padding), as keyword arguments of :class:`RolloutBatch`.
    """
    input_ids = _pad_right(ids, pad_id, torch.long)
    t = input_ids.shape[1]
    return {
        "input_ids": input_ids,
        "attention_mask": _pad_right([[1] * len(row) for row in ids], 0, torch.long, t),
        "assistant_mask": _pad_right(masks, False, torch.bool, t),
        "sampling_logps": _pad_right(logps, 0.0, torch.float32, t),
    }
