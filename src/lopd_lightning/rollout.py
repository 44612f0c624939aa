"""Rollouts: batched generation, the multi-turn episode loop, and :class:`RolloutBatch`.

A rollout is one trajectory of the student in a task: the prompt (system and user messages rendered by
the chat template with the generation prompt), then for each turn the student's reply (the tokens it
generated, its EOS included) and the environment's observation (tool results, the next user turn)
rendered as the template text that follows the reply's EOS up to and including the next generation
prompt. :func:`tokenize_conversation` builds exactly these token ids for a given conversation, so that
teacher-forced batches (SFT on reference solutions, composer warm start) line up with sampled ones.

Conventions of every :class:`RolloutBatch`:

- RIGHT padding: each sequence starts at index 0 and is followed by padding; ``attention_mask`` is 1 on
  the real tokens. (Generation inputs are left padded internally; the returned batch never is.)
- ``assistant_mask`` (docs/METHOD.md section 1, omega) is True exactly on the tokens the student generated,
  its EOS included, and False on the prompt, template tokens, tool output and padding (also when the pad
  id equals the EOS id: the mask is built from positions, never from token values).
- ``sampling_logps`` is ``log_softmax(z / temperature)[token]`` where ``z`` are the model's logits in
  float32 at that position (before top-k and top-p filtering), 0 off the assistant tokens: the
  "old log-probs" of PPO-clip (docs/METHOD.md section 6, GRPO).
- ``context_position`` is the index of the first token of the first user message's content: where a
  self-teacher inserts its privileged context (docs/METHOD.md section 4).

Source of the sampling scheme (seeds derived from step, example and sample): karpathy/nanochat
``scripts/chat_rl.py``; of the token layout: huggingface/trl's self-distillation trainers.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lopd_lightning.tasks.base import Episode, Example, Message, Task, turn_limit

log = logging.getLogger(__name__)

__all__ = [
    "ChatTemplateError",
    "PromptEncoding",
    "RolloutBatch",
    "RolloutStats",
    "batch_from_conversations",
    "collate_batches",
    "derive_seed",
    "encode_observation",
    "encode_prompt",
    "generate_rollouts",
    "render_chat",
    "tokenize_conversation",
    "warn_turn_limit",
]

#: Stands in for the first user message's content when locating it in the rendered prompt.
_CONTENT_SENTINEL = "\u2063LOPD_FIRST_USER_CONTENT_9d41c7\u2063"


# --------------------------------------------------------------------------------------------------
# The batch
# --------------------------------------------------------------------------------------------------


@dataclass
class RolloutStats:
    """Wall-clock accounting of one :func:`generate_rollouts` call (seconds; counts).

    Attributes:
        generate_seconds: time inside ``model.generate`` (prefill, decoding, sampling).
        env_seconds: time inside the task (``task.start``, ``Episode.step``, ``Episode.reward``).
        tokenize_seconds: time rendering chat templates and tokenizing prompts and observations.
        total_seconds: the whole call.
        generate_calls: number of ``model.generate`` calls (turns x chunks).
        generated_tokens: tokens the student generated (the sum of the assistant masks).
        rollouts: number of rollouts (rows).
    """

    generate_seconds: float = 0.0
    env_seconds: float = 0.0
    tokenize_seconds: float = 0.0
    total_seconds: float = 0.0
    generate_calls: int = 0
    generated_tokens: int = 0
    rollouts: int = 0

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
            False on prompt, template tokens, tool output and padding.
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
        experience_ids: per row, the ids of the retrieved experiences (filled by the DataModule), or None.
        experiences: per row, the retrieved experiences themselves (filled by the DataModule), or None.
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
    experience_ids: list[list[str]] | None = None
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
        for name in ("example_ids", "messages", "metadata", "experience_ids", "experiences"):
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

    def lengths(self) -> Tensor:
        """(B,) long, the number of real tokens per row."""
        return self.attention_mask.sum(dim=1)

    def select(self, indices: Sequence[int] | Tensor) -> RolloutBatch:
        """The rows ``indices`` (a list of ints, a long tensor or a (B,) bool tensor), in that order.

        Trailing columns that are padding in every selected row are dropped. Group ids are kept as they
        are (use :func:`collate_batches` to renumber); ``stats`` is shared with the parent batch.
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
            experience_ids=None if self.experience_ids is None else [self.experience_ids[i] for i in rows],
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


def collate_batches(batches: Sequence[RolloutBatch], *, renumber_groups: bool = True) -> RolloutBatch:
    """Concatenate batches row-wise and re-pad (right) to the longest sequence; result on CPU.

    Args:
        batches: one or more batches (any devices); padding uses the first batch's ``pad_token_id``.
        renumber_groups: renumber group ids 0, 1, ... in order of first appearance within each batch,
            distinct across batches (two batches that both start at group 0 stay apart). False keeps
            the ids as they are.

    Returns:
        A :class:`RolloutBatch`; ``experience_ids``/``experiences`` are concatenated when every batch has
        them, else None; ``stats`` are summed when every batch has them, else None.

    Raises:
        ValueError: no batches.
    """
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
        experience_ids=cat_list("experience_ids"),
        experiences=cat_list("experiences"),
        stats=stats,
        pad_token_id=pad,
    )


# --------------------------------------------------------------------------------------------------
# Chat templates -> token ids
# --------------------------------------------------------------------------------------------------


class ChatTemplateError(ValueError):
    """The chat template cannot be rendered turn by turn (it is not prefix-consistent)."""


@dataclass(frozen=True)
class PromptEncoding:
    """The tokenized prompt of a conversation.

    Attributes:
        input_ids: the prompt's token ids (rendered with the generation prompt).
        context_position: index in ``input_ids`` of the first token of the first user message's content.
        text: the rendered prompt (``apply_chat_template(..., add_generation_prompt=True)``).
    """

    input_ids: list[int]
    context_position: int
    text: str


def render_chat(tokenizer: Any, messages: Sequence[Message], *, tools: list[dict] | None = None,
                add_generation_prompt: bool) -> str:
    """``tokenizer.apply_chat_template`` as text (tools passed only when given)."""
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools is not None:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(list(messages), **kwargs)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _eos(tokenizer: Any) -> tuple[str, int]:
    if tokenizer.eos_token is None or tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; rollouts need one to end assistant turns")
    return tokenizer.eos_token, int(tokenizer.eos_token_id)


def encode_prompt(tokenizer: Any, messages: Sequence[Message], *, tools: list[dict] | None = None) -> PromptEncoding:
    """Render ``messages`` with the generation prompt and tokenize it in two pieces.

    The rendered text is split where the first user message's content starts; the text before and the
    text from there on are tokenized separately (``add_special_tokens=False``) and concatenated, so that
    ``context_position`` is a token boundary. Rollouts use this same split tokenization.

    Raises:
        ValueError: no user message.
        ChatTemplateError: the template does not render the first user content where expected.
    """
    user_index = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if user_index is None:
        raise ValueError("the conversation has no user message; context_position needs one")
    text = render_chat(tokenizer, messages, tools=tools, add_generation_prompt=True)
    marked = [dict(m) for m in messages]
    marked[user_index]["content"] = _CONTENT_SENTINEL
    marked_text = render_chat(tokenizer, marked, tools=tools, add_generation_prompt=True)
    cut = marked_text.find(_CONTENT_SENTINEL)
    if cut < 0 or not text.startswith(marked_text[:cut]):
        raise ChatTemplateError(
            "cannot locate the first user message's content in the rendered prompt: the chat template "
            "changes the text before it depending on the content"
        )
    before = _encode(tokenizer, text[:cut])
    return PromptEncoding(input_ids=before + _encode(tokenizer, text[cut:]), context_position=len(before), text=text)


def encode_observation(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    rendered_before_reply: str,
    reply: str,
    reply_has_eos: bool = True,
    tools: list[dict] | None = None,
) -> tuple[list[int], str]:
    """Token ids of what follows an assistant reply: template text + observation + next generation prompt.

    Args:
        messages: the conversation up to and including the observation messages after the reply (the
            reply is ``messages[k]`` for some k; everything after it is the observation; may be empty).
        rendered_before_reply: the rendered conversation before the reply, with the generation prompt.
        reply: the reply's content as it stands in ``messages``.
        reply_has_eos: True when the reply's tokens end with EOS (the template's EOS after the reply is
            then already in the sequence); False when generation stopped without it (stop string or
            token limit): the EOS id is prepended to the observation (mask 0).

    Returns:
        (ids, rendered): the observation's ids and the rendering of ``messages`` with the generation prompt
        (the ``rendered_before_reply`` of the next turn).

    Raises:
        ChatTemplateError: the rendering of ``messages`` does not start with ``rendered_before_reply +
            reply + eos`` (the template is not prefix-consistent, e.g. it rewrites earlier turns).
    """
    eos_text, eos_id = _eos(tokenizer)
    rendered = render_chat(tokenizer, messages, tools=tools, add_generation_prompt=True)
    head = rendered_before_reply + reply
    if not rendered.startswith(head + eos_text):
        expected = head + eos_text
        at = next((i for i, (a, b) in enumerate(zip(rendered, expected)) if a != b), min(len(rendered), len(expected)))
        raise ChatTemplateError(
            "the chat template is not prefix-consistent: rendering the conversation after an assistant reply "
            "does not start with the previous rendering + the reply + EOS "
            f"(first difference at character {at}: expected {expected[at:at + 40]!r}, got "
            f"{rendered[at:at + 40]!r}); multi-turn rollouts need a template that renders turns in order "
            "and closes assistant turns with the tokenizer's EOS"
        )
    # without a generated EOS, the template's EOS is added as its token (never tokenized with its
    # neighbours), so that the ids match teacher forcing of the same conversation
    ids = [] if reply_has_eos else [eos_id]
    return ids + _encode(tokenizer, rendered[len(head) + len(eos_text):]), rendered


def tokenize_conversation(
    tokenizer: Any, messages: Sequence[Message], *, tools: list[dict] | None = None
) -> tuple[list[int], list[int], int]:
    """Token ids, assistant mask and context position of a conversation, as rollouts lay them out.

    Layout: the prompt (messages before the first assistant message, rendered with the generation
    prompt, see :func:`encode_prompt`); then per assistant message its content's tokens + EOS (mask 1);
    then the template text after that EOS up to and including the next generation prompt, covering any
    observation messages (mask 0). A conversation that ends with an assistant message ends with its EOS;
    one that ends with observations ends with the next generation prompt.

    The prompt and observation ids equal those of :func:`generate_rollouts`; a reply's ids equal the
    generated ones whenever re-tokenizing the decoded reply gives the same ids (rollouts keep the sampled
    ids).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template and an EOS token.
        messages: ``{"role", "content"}`` dicts with a user message before the first assistant message.
        tools: JSON schemas passed to the template, or None.

    Returns:
        (input_ids, assistant_mask, context_position): two lists of equal length (ids; 0/1) and an int.

    Raises:
        ValueError: no user message before the first assistant message, or no EOS token.
        ChatTemplateError: the template is not prefix-consistent.
    """
    _, eos_id = _eos(tokenizer)
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    prompt = encode_prompt(tokenizer, messages[:first], tools=tools)
    ids, mask = list(prompt.input_ids), [0] * len(prompt.input_ids)
    rendered = prompt.text
    i = first
    while i < len(messages):
        reply = str(messages[i].get("content") or "")
        reply_ids = _encode(tokenizer, reply) + [eos_id]
        ids += reply_ids
        mask += [1] * len(reply_ids)
        j = next((k for k in range(i + 1, len(messages)) if messages[k].get("role") == "assistant"), len(messages))
        if j == i + 1 == len(messages):
            break
        obs_ids, rendered = encode_observation(
            tokenizer, messages[:j], rendered_before_reply=rendered, reply=reply, tools=tools
        )
        ids += obs_ids
        mask += [0] * len(obs_ids)
        i = j
    return ids, mask, prompt.context_position


def batch_from_conversations(
    tokenizer: Any,
    conversations: Sequence[Sequence[Message]],
    *,
    rewards: Sequence[float] | Tensor,
    group_ids: Sequence[int] | Tensor,
    example_ids: Sequence[str],
    tools: list[dict] | Sequence[list[dict] | None] | None = None,
    max_length: int | None = None,
) -> RolloutBatch:
    """A teacher-forced :class:`RolloutBatch` from finished conversations (SFT, composer warm start).

    Args:
        conversations: B conversations laid out by :func:`tokenize_conversation`.
        rewards: (B,) rewards in [0, 1].
        group_ids: (B,) group ids.
        example_ids: B example ids.
        tools: one list of tool schemas for all conversations, or a per-conversation sequence of lists
            (or None entries), or None.
        max_length: keep at most this many tokens per row (right truncation; ``metadata["truncated"]``).

    Returns:
        A right-padded batch on CPU with ``sampling_logps`` all 0 and ``stats`` None.

    Raises:
        ValueError: lengths disagree, a reward is outside [0, 1], or ``max_length`` cuts off a row's
            context position.
        ChatTemplateError: see :func:`tokenize_conversation`.
    """
    n = len(conversations)
    if not (len(rewards) == len(group_ids) == len(example_ids) == n):
        raise ValueError(
            f"batch_from_conversations: {n} conversations but {len(rewards)} rewards, "
            f"{len(group_ids)} group ids and {len(example_ids)} example ids"
        )
    if tools is not None and len(tools) and isinstance(tools[0], dict):
        per_tools: list[Any] = [tools] * n
    elif tools is None:
        per_tools = [None] * n
    else:
        if len(tools) != n:
            raise ValueError(f"tools: {len(tools)} entries for {n} conversations")
        per_tools = list(tools)
    reward_t = torch.as_tensor(rewards, dtype=torch.float32).reshape(n)
    if n and not bool(((reward_t >= 0) & (reward_t <= 1)).all()):
        raise ValueError(f"rewards must be in [0, 1], got {reward_t.tolist()}")
    all_ids, all_mask, ctx, metadata = [], [], [], []
    for conv, conv_tools, ex_id in zip(conversations, per_tools, example_ids):
        ids, mask, pos = tokenize_conversation(tokenizer, conv, tools=conv_tools)
        truncated = max_length is not None and len(ids) > max_length
        if truncated:
            if pos >= max_length:
                raise ValueError(f"max_length={max_length} cuts off the context position {pos} of {ex_id!r}")
            ids, mask = ids[:max_length], mask[:max_length]
        all_ids.append(ids)
        all_mask.append(mask)
        ctx.append(pos)
        metadata.append({
            "turns": sum(1 for m in conv if m.get("role") == "assistant"),
            "truncated": truncated,
            "truncation": "max_length" if truncated else None,
            "errors": [],
        })
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _eos(tokenizer)[1]
    input_ids = _pad_right(all_ids, pad, torch.long)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=_pad_right([[1] * len(x) for x in all_ids], 0, torch.long, input_ids.shape[1]),
        assistant_mask=_pad_right(all_mask, False, torch.bool, input_ids.shape[1]),
        rewards=reward_t,
        group_ids=torch.as_tensor(group_ids, dtype=torch.long).reshape(n),
        sampling_logps=torch.zeros(input_ids.shape, dtype=torch.float32),
        context_position=torch.tensor(ctx, dtype=torch.long),
        example_ids=list(example_ids),
        messages=[[dict(m) for m in c] for c in conversations],
        metadata=metadata,
        pad_token_id=int(pad),
    )


# --------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------


def derive_seed(seed: int, step: int, example_id: str, sample_index: int, turn: int) -> int:
    """The 63-bit seed of one rollout's turn: a hash (BLAKE2b) of its coordinates.

    It depends on nothing else (not on batch composition, order or device), so a rollout's random
    stream is the same wherever it is generated.
    """
    key = f"{seed}|{step}|{example_id}|{sample_index}|{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def _sample_rows(z: Tensor, generators: list[torch.Generator], top_k: int | None, top_p: float | None) -> Tensor:
    """One token per row from ``softmax(top_p(top_k(z)))``, row i drawn with ``generators[i]``.

    Top-k keeps the k largest logits (``torch.topk``; among exactly tied logits at the k-th place, the
    one topk returns); top-p then keeps the smallest most-likely prefix of the renormalised top-k
    distribution whose mass reaches ``top_p`` (transformers' ``TopPLogitsWarper`` rule: a token is
    dropped when the tokens more likely than it already hold ``top_p``; the first is always kept).

    Args:
        z: (B, V) float, logits divided by the temperature.

    Returns:
        (B,) long token ids.
    """
    vocab = z.shape[-1]
    use_top_p = top_p is not None and top_p < 1.0
    if top_k is not None and 0 < top_k < vocab:
        values, index = torch.topk(z, top_k, dim=-1)  # sorted, most likely first
    elif use_top_p:
        values, index = torch.sort(z, dim=-1, descending=True)
    else:
        values, index = z, None
    if use_top_p:
        probs = values.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        drop = before >= top_p
        drop[..., 0] = False
        values = values.masked_fill(drop, float("-inf"))
    probs = values.softmax(dim=-1)
    choice = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])
    return choice if index is None else index.gather(-1, choice[:, None]).squeeze(-1)


class _SeededSampler:
    """A logits processor that samples itself, one ``torch.Generator`` per row.

    ``model.generate`` runs greedy search (``do_sample=False``); this processor, last in the list, draws
    each row's token from ``softmax(top_p(top_k(z / temperature)))`` with that row's generator, records
    ``log_softmax(z / temperature)`` at the drawn token, and returns logits that are -inf except at the
    drawn token, so greedy search picks it. Recording the log-prob here avoids keeping the (B, S, V)
    logits that ``output_logits=True`` would store.
    """

    def __init__(self, seeds: list[int], *, device: torch.device, temperature: float, top_k: int | None,
                 top_p: float | None, greedy: bool):
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.temperature, self.top_k, self.top_p, self.greedy = temperature, top_k, top_p, greedy
        self.tokens: list[Tensor] = []
        self.logps: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        z = scores.float() / self.temperature  # (B, V)
        logp = torch.log_softmax(z, dim=-1)
        if self.greedy:
            tok = z.argmax(dim=-1)
        else:
            tok = _sample_rows(z, self.generators, self.top_k, self.top_p)
        self.tokens.append(tok)
        self.logps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, tok[:, None], 0.0)


#: generation-config fields reset to a neutral value so that the sampling distribution is the model's.
_NEUTRAL_GENERATION = {
    "do_sample": False, "num_beams": 1, "num_return_sequences": 1, "temperature": 1.0, "top_k": 50,
    "top_p": 1.0, "typical_p": 1.0, "min_p": None, "top_h": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "min_length": 0, "guidance_scale": 1.0,
    "remove_invalid_values": False, "output_scores": False, "output_logits": False,
    "return_dict_in_generate": False, "max_length": None, "stop_strings": None,
}
#: fields that alter the distribution and cannot be reset (None is filled in from the model's config).
_ALTERING_GENERATION = (
    "min_new_tokens", "bad_words_ids", "sequence_bias", "forced_bos_token_id", "forced_eos_token_id",
    "suppress_tokens", "begin_suppress_tokens", "exponential_decay_length_penalty", "watermarking_config",
)


def _generation_config(model: Any, *, max_new_tokens: int, eos_ids: list[int], pad_id: int,
                       stop_strings: list[str] | None, use_cache: bool = True) -> Any:
    """A copy of ``model.generation_config`` for :func:`generate_rollouts` (the model's is never changed)."""
    cfg = copy.deepcopy(model.generation_config)
    for name, value in _NEUTRAL_GENERATION.items():
        setattr(cfg, name, value)
    altering = [n for n in _ALTERING_GENERATION if getattr(cfg, n, None) is not None]
    if altering:
        log.warning(
            "model.generation_config sets %s: sampling_logps follow the processed logits, not the model's", altering
        )
    cfg.max_new_tokens = max_new_tokens
    cfg.eos_token_id = eos_ids
    cfg.pad_token_id = pad_id
    cfg.stop_strings = stop_strings
    cfg.use_cache = bool(use_cache)
    return cfg


def _reply_length(tokenizer: Any, ids: list[int], eos_ids: set[int], stop_strings: list[str] | None) -> tuple[int, str]:
    """Length of the reply in the generated row ``ids`` and why it ended ("eos", "stop_string", "length")."""
    n_eos = next((i + 1 for i, t in enumerate(ids) if t in eos_ids), None)
    if n_eos is not None:
        ids = ids[:n_eos]
    if stop_strings:
        def hit(n: int) -> bool:
            text = tokenizer.decode(ids[:n], skip_special_tokens=False)
            return any(s in text for s in stop_strings)

        if ids and hit(len(ids)):
            lo, hi = 1, len(ids)  # the smallest n with hit(n): where generate's stop-string check fired
            while lo < hi:
                mid = (lo + hi) // 2
                if hit(mid):
                    hi = mid
                else:
                    lo = mid + 1
            if n_eos is None or lo < n_eos:
                return lo, "stop_string"
    if n_eos is not None:
        return n_eos, "eos"
    return len(ids), "length"


# --------------------------------------------------------------------------------------------------
# The episode loop
# --------------------------------------------------------------------------------------------------


@dataclass
class _Rollout:
    example: Example
    example_index: int
    sample_index: int
    episode: Episode
    tools: list[dict] | None
    messages: list[Message]
    ids: list[int]
    mask: list[int]
    logps: list[float]
    context_position: int
    rendered: str
    turns: int = 0
    done: bool = False
    truncation: str | None = None
    errors: list[str] = field(default_factory=list)
    reply_tokens: list[int] = field(default_factory=list)
    stop_reasons: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    finished: bool = False


#: names of the tasks whose turn-limit warning was given (once per task and process).
_TURN_LIMIT_WARNED: set[str] = set()


def warn_turn_limit(task: Task, rollouts: Sequence[Any], max_turns: int, limit_source: str) -> bool:
    """Warn once per task (by name) when episodes were cut at the turn limit before they said ``done``.

    The line names the task's ``multi_turn`` / ``max_turns`` attributes and the config key
    ``model.init_args.max_turns``: a task that needs two replies but declares neither is otherwise cut
    after one reply without a word (its episodes are recorded with ``truncation="max_turns"``).

    Returns:
        True when the warning was given by this call.
    """
    cut = [r for r in rollouts if r.truncation == "max_turns"]
    name = str(getattr(task, "name", type(task).__name__))
    if not cut or name in _TURN_LIMIT_WARNED:
        return False
    _TURN_LIMIT_WARNED.add(name)
    first = cut[0]
    replies = f"{first.turns} repl{'y' if first.turns == 1 else 'ies'}"
    if not task.multi_turn:
        log.warning(
            "task %r has multi_turn = False, but its episode of example %r asked for another turn "
            "(StepResult.done = False) after %s: %d of %d episodes were cut at max_turns=%d (from %s; "
            "truncation='max_turns'). A task whose episodes take several replies sets `multi_turn = True` "
            "and `max_turns` on its Task class (or set model.init_args.max_turns)",
            name, first.example.id, replies, len(cut), len(rollouts), max_turns, limit_source,
        )
    else:
        log.warning(
            "task %r: %d of %d episodes were cut at max_turns=%d (from %s) before they ended "
            "(StepResult.done = False; truncation='max_turns'); if its episodes need more replies, raise the "
            "task's `max_turns` attribute or model.init_args.max_turns (warned once per task)",
            name, len(cut), len(rollouts), max_turns, limit_source,
        )
    return True


def generate_rollouts(
    model: Any,
    tokenizer: Any,
    task: Task,
    examples: Sequence[Example],
    *,
    num_rollouts_per_example: int = 1,
    temperature: float = 0.7,
    top_p: float | None = 0.95,
    top_k: int | None = 20,
    max_new_tokens: int = 256,
    max_turns: int | None = None,
    max_prompt_tokens: int | None = None,
    seed: int = 0,
    step: int = 0,
    greedy: bool = False,
    stop_strings: Sequence[str] | None = None,
    generation_batch_size: int | None = None,
    use_cache: bool = True,
) -> RolloutBatch:
    """Sample rollouts of ``model`` in ``task``: batched generation (KV cache) and the multi-turn loop.

    Each example gets ``num_rollouts_per_example`` rollouts (rows ``[ex0 s0, ex0 s1, ..., ex1 s0, ...]``,
    group id = the example's index in ``examples``). All live episodes advance together: each turn, the
    active rollouts' contexts are left padded and sent to ``model.generate`` (in chunks of
    ``generation_batch_size``); each reply (sampled tokens up to and including EOS, or up to a stop
    string, or ``max_new_tokens``) is decoded and fed to ``episode.step``; the observation is appended
    (:func:`encode_observation`); a finished episode leaves the batch. An episode also ends, with
    ``metadata["truncated"] = True``, after ``max_turns`` replies ("max_turns") or when its context is
    longer than ``max_prompt_tokens`` or ``context + max_new_tokens`` exceeds the model's
    ``max_position_embeddings`` before a turn ("context"). The reward is ``episode.reward()`` at the end.

    Sampling: ``softmax(top_p(top_k(logits / temperature)))`` (transformers' order and top-p rule; top-k
    keeps exactly k tokens, see :func:`_sample_rows`), drawn by a logits processor of this module while
    ``generate`` runs greedy search (so the log-probs need no (B, S, V) ``output_logits``), one
    ``torch.Generator`` per rollout and turn seeded by :func:`derive_seed` (seed, step, example id, sample
    index, turn), where the sample index counts the example's rollouts in this call (an example listed
    twice gets sample indices 0..2G-1). ``greedy=True`` takes the argmax. ``sampling_logps`` are
    ``log_softmax(logits / temperature)`` at the chosen tokens in both cases. The model's generation
    config is copied, never changed; its processors that would alter the distribution (repetition
    penalty, ...) are reset.

    Reproducibility guarantee: the same arguments, weights, software and device give identical batches.
    The random numbers a rollout consumes depend only on (seed, step, example id, sample index, turn), not
    on the other examples, their order or ``generation_batch_size``; the tokens are therefore independent
    of batch composition up to floating-point differences of the logits between batch shapes (padding,
    batch size), which can flip a sample only at near-ties. The global torch RNG is not used or changed.

    Args:
        model: a transformers causal LM; put in eval mode during generation, previous mode restored.
        tokenizer: its tokenizer (chat template, EOS; pad falls back to EOS).
        task: the task; ``task.start(example)`` makes each episode.
        examples: the examples to roll out.
        num_rollouts_per_example: G rollouts per example.
        temperature: > 0; the sampling temperature.
        top_p: nucleus mass in (0, 1], None or 1 = off.
        top_k: top-k, None or 0 = off.
        max_new_tokens: limit per turn.
        max_turns: replies per episode; None = ``task.max_turns`` if the task has it, else 8 for
            multi-turn tasks and 1 otherwise. Episodes cut there before they said ``done`` are recorded
            with ``truncation="max_turns"``, and :func:`warn_turn_limit` warns once per task.
        max_prompt_tokens: longest context sent to generate (None = only the model's limit).
        seed, step: seed coordinates (the trainer passes the global step).
        greedy: argmax decoding (evaluation).
        stop_strings: extra strings that end a reply (transformers' ``stop_strings``); the reply keeps
            the stop string and has no EOS, so the template's EOS follows it with mask 0.
        generation_batch_size: most rows per ``generate`` call (None = all active rows).
        use_cache: generate with the key-value cache (the default); False recomputes the whole context for
            every new token (benchmarks/rollouts.py measures the difference). Same tokens up to floating-point
            differences between the two computations.

    Returns:
        A right-padded :class:`RolloutBatch` on CPU with ``stats``.

    Raises:
        ValueError: bad sampling arguments, or a reward outside [0, 1] (naming task and example).
        ChatTemplateError: the chat template is not prefix-consistent (multi-turn).
        RuntimeError: an episode's ``step`` raised (chained, naming task and example).
    """
    t_start = time.perf_counter()
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature} (use greedy=True for argmax)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if num_rollouts_per_example < 1 or max_new_tokens < 1:
        raise ValueError("num_rollouts_per_example and max_new_tokens must be >= 1")
    if generation_batch_size is not None and generation_batch_size < 1:
        raise ValueError(f"generation_batch_size must be >= 1, got {generation_batch_size}")
    max_turns, limit_source = turn_limit(task, max_turns, given_by="the max_turns argument (model.init_args.max_turns)")
    stop_list = list(stop_strings) if stop_strings else None

    _, eos_id = _eos(tokenizer)
    eos_ids = [eos_id]
    cfg_eos = model.generation_config.eos_token_id
    for e in ([cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos or [])):
        if e not in eos_ids:
            eos_ids.append(int(e))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    gen_cfg = _generation_config(
        model, max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id, stop_strings=stop_list,
        use_cache=use_cache,
    )
    device = next(model.parameters()).device
    max_positions = getattr(model.config, "max_position_embeddings", None)
    stats = RolloutStats()

    # ---- start the episodes
    rollouts: list[_Rollout] = []
    seen: dict[str, int] = {}
    for ex_index, example in enumerate(examples):
        base = seen.get(example.id, 0)
        seen[example.id] = base + num_rollouts_per_example
        for k in range(num_rollouts_per_example):
            t0 = time.perf_counter()
            episode = task.start(example)
            stats.env_seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            messages = [dict(m) for m in task.initial_messages(example)]
            tools = task.tools(example)
            prompt = encode_prompt(tokenizer, messages, tools=tools)
            stats.tokenize_seconds += time.perf_counter() - t0
            rollouts.append(_Rollout(
                example=example, example_index=ex_index, sample_index=base + k, episode=episode, tools=tools,
                messages=messages, ids=list(prompt.input_ids), mask=[0] * len(prompt.input_ids),
                logps=[0.0] * len(prompt.input_ids), context_position=prompt.context_position, rendered=prompt.text,
            ))

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            while True:
                active = []
                for r in rollouts:
                    if r.finished:
                        continue
                    too_long = (max_prompt_tokens is not None and len(r.ids) > max_prompt_tokens) or (
                        max_positions is not None and len(r.ids) + max_new_tokens > max_positions
                    )
                    if too_long:
                        r.truncation, r.finished = "context", True
                    else:
                        active.append(r)
                if not active:
                    break
                order = active
                size = generation_batch_size or len(active)
                if generation_batch_size is not None:  # similar lengths together: less padding
                    order = sorted(active, key=lambda r: -len(r.ids))
                for start in range(0, len(order), size):
                    chunk = order[start:start + size]
                    replies = _generate_chunk(
                        model, tokenizer, gen_cfg, chunk, device=device, pad_id=pad_id, eos_ids=set(eos_ids),
                        seeds=[derive_seed(seed, step, r.example.id, r.sample_index, r.turns) for r in chunk],
                        temperature=temperature, top_k=top_k or None, top_p=top_p, greedy=greedy,
                        stop_strings=stop_list, stats=stats,
                    )
                    for r, (reply_ids, reply_logps, reason) in zip(chunk, replies):
                        _advance(r, reply_ids, reply_logps, reason, tokenizer, task, max_turns, stats)
    finally:
        model.train(was_training)

    warn_turn_limit(task, rollouts, max_turns, limit_source)

    # ---- rewards and the batch
    rewards = []
    for r in rollouts:
        t0 = time.perf_counter()
        value = float(r.episode.reward())
        stats.env_seconds += time.perf_counter() - t0
        if not (0.0 <= value <= 1.0):  # also rejects NaN
            raise ValueError(
                f"task {task.name!r} returned reward {value} for example {r.example.id!r}; rewards must be in [0, 1]"
            )
        rewards.append(value)
    input_ids = _pad_right([r.ids for r in rollouts], pad_id, torch.long)
    t = input_ids.shape[1]
    batch = RolloutBatch(
        input_ids=input_ids,
        attention_mask=_pad_right([[1] * len(r.ids) for r in rollouts], 0, torch.long, t),
        assistant_mask=_pad_right([r.mask for r in rollouts], False, torch.bool, t),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor([r.example_index for r in rollouts], dtype=torch.long),
        sampling_logps=_pad_right([r.logps for r in rollouts], 0.0, torch.float32, t),
        context_position=torch.tensor([r.context_position for r in rollouts], dtype=torch.long),
        example_ids=[r.example.id for r in rollouts],
        messages=[r.messages for r in rollouts],
        metadata=[{
            "turns": r.turns,
            "done": r.done,
            "truncated": r.truncation is not None,
            "truncation": r.truncation,
            "errors": r.errors,
            "info": r.info,
            "reply_tokens": r.reply_tokens,
            "stop_reasons": r.stop_reasons,
            "example_index": r.example_index,
            "sample_index": r.sample_index,
        } for r in rollouts],
        stats=stats,
        pad_token_id=int(pad_id),
    )
    stats.generated_tokens = batch.num_assistant_tokens()
    stats.rollouts = len(batch)
    stats.total_seconds = time.perf_counter() - t_start
    return batch


def _generate_chunk(
    model: Any, tokenizer: Any, gen_cfg: Any, chunk: list[_Rollout], *, device: torch.device, pad_id: int,
    eos_ids: set[int], seeds: list[int], temperature: float, top_k: int | None, top_p: float | None,
    greedy: bool, stop_strings: list[str] | None, stats: RolloutStats,
) -> list[tuple[list[int], list[float], str]]:
    """One ``model.generate`` call on left-padded contexts; per row (reply ids, their logps, stop reason)."""
    from transformers import LogitsProcessorList

    length = max(len(r.ids) for r in chunk)
    input_ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(chunk), length), dtype=torch.long)
    for i, r in enumerate(chunk):
        input_ids[i, length - len(r.ids):] = torch.tensor(r.ids, dtype=torch.long)
        attention[i, length - len(r.ids):] = 1
    sampler = _SeededSampler(seeds, device=device, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy)
    extra: dict[str, Any] = {"tokenizer": tokenizer} if stop_strings else {}  # stop strings need it
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention.to(device), generation_config=gen_cfg,
        logits_processor=LogitsProcessorList([sampler]), **extra,
    )
    stats.generate_seconds += time.perf_counter() - t0
    stats.generate_calls += 1
    sequences = out if isinstance(out, Tensor) else out.sequences
    new = sequences[:, length:].cpu()
    tokens = torch.stack(sampler.tokens, dim=1).cpu()
    logps = torch.stack(sampler.logps, dim=1).float().cpu()
    if new.shape != tokens.shape:
        raise RuntimeError(f"generate returned {new.shape[1]} new tokens but sampled {tokens.shape[1]}")
    results = []
    for i in range(len(chunk)):
        row = new[i].tolist()
        n, reason = _reply_length(tokenizer, row, eos_ids, stop_strings)
        if row[:n] != tokens[i, :n].tolist():
            raise RuntimeError(
                "generate did not keep the sampled tokens: another logits processor runs after the sampler"
            )
        results.append((row[:n], logps[i, :n].tolist(), reason))
    return results


def _advance(r: _Rollout, reply_ids: list[int], reply_logps: list[float], reason: str, tokenizer: Any,
             task: Task, max_turns: int, stats: RolloutStats) -> None:
    """Append one reply to a rollout, step its episode, append the observation; finish it if over."""
    t0 = time.perf_counter()
    r.ids += reply_ids
    r.mask += [1] * len(reply_ids)
    r.logps += reply_logps
    r.turns += 1
    r.reply_tokens.append(len(reply_ids))
    r.stop_reasons.append(reason)
    text = tokenizer.decode(reply_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    r.messages.append({"role": "assistant", "content": text})
    stats.tokenize_seconds += time.perf_counter() - t0

    t0 = time.perf_counter()
    try:
        result = r.episode.step(text)
    except Exception as err:
        raise RuntimeError(f"task {task.name!r}: episode.step failed for example {r.example.id!r}: {err}") from err
    stats.env_seconds += time.perf_counter() - t0
    r.info = dict(result.info)
    if result.info.get("error"):
        r.errors.append(str(result.info["error"]))

    r.done = bool(result.done)
    if not r.done and r.turns >= max_turns:
        r.truncation = "max_turns"
    r.finished = r.done or r.truncation is not None
    if result.messages or not r.finished:
        # observation tokens (or, with none, the template text up to the next generation prompt)
        t0 = time.perf_counter()
        r.messages.extend(dict(m) for m in result.messages)
        obs_ids, r.rendered = encode_observation(
            tokenizer, r.messages, rendered_before_reply=r.rendered, reply=text,
            reply_has_eos=reason == "eos", tools=r.tools,
        )
        r.ids += obs_ids
        r.mask += [0] * len(obs_ids)
        r.logps += [0.0] * len(obs_ids)
        stats.tokenize_seconds += time.perf_counter() - t0
