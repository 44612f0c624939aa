"""Chat templates -> token ids: prompts, observations, whole conversations, and teacher-forced batches.

A rollout is one trajectory of the student in a task: the prompt (system and user messages rendered by
the chat template with the generation prompt), then for each turn the student's reply (the tokens it
generated, its EOS included) and the environment's observation (tool results, the next user turn)
rendered as the template text that follows the reply's EOS up to and including the next generation
prompt. :func:`tokenize_conversation` builds exactly these token ids for a given conversation, so that
teacher-forced batches (:func:`batch_from_conversations`: SFT on reference solutions, composer warm
start) line up with sampled ones.

Message contents are data (:mod:`lopd_lightning.text`): a tool result, a system prompt or a reference reply
that spells a special token (``</s>``, ``<|im_end|>``, ``<|im_start|>``) is tokenised as that text, so only
the template's own markers are control tokens; for contents that spell none, the ids are those of
tokenising the rendered text. A reply that the model ended on another EOS id of its generation config is
laid out with the template's end-of-turn token (:func:`eos_token_ids`, ``generate_rollouts``).

Source of the token layout: huggingface/trl's self-distillation trainers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lopd_lightning.rollout.batch import RolloutBatch, _token_tensors
from lopd_lightning.tasks.base import Message
from lopd_lightning.text import encode_data, encode_rendered, special_token_strings, spells_special_token

log = logging.getLogger(__package__)

__all__ = [
    "ChatTemplateError",
    "PromptEncoding",
    "batch_from_conversations",
    "encode_observation",
    "encode_prompt",
    "eos_token_ids",
    "render_chat",
    "tokenize_conversation",
]

#: Stands in for the first user message's content when locating it in the rendered prompt.
_CONTENT_SENTINEL = "\u2063LOPD_FIRST_USER_CONTENT_9d41c7\u2063"
#: Stands in for message i's content when locating every content in a rendering (``{i}``: its index).
_MESSAGE_SENTINEL = "\u2063LOPD_MESSAGE_{i}_9d41c7\u2063"
_MESSAGE_SENTINEL_PATTERN = re.compile("\u2063LOPD_MESSAGE_([0-9]+)_9d41c7\u2063")
#: whether the warning about a template that rewrites message contents was given (once per process).
_WARNED_REWRITTEN_CONTENT = False

#: a character span ``[start, end)`` of a rendering that holds message ``index``'s content: (index, start, end).
ContentSpan = tuple[int, int, int]


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


def _content_spans(
    tokenizer: Any, messages: Sequence[Message], *, tools: list[dict] | None = None, add_generation_prompt: bool,
    rendered: str | None = None,
) -> list[ContentSpan] | None:
    """Where each message's content lies in the rendering of ``messages``: the data spans of :func:`encode_rendered`.

    The template is rendered once more with every string content replaced by a sentinel; the sentinels give
    the template's own text, and the contents put back in their places must give ``rendered`` again, as
    given or (templates that ``trim`` them) stripped.

    Args:
        rendered: ``render_chat(tokenizer, messages, ...)`` when the caller has it (else rendered here).

    Returns:
        ``(message index, start, end)`` character spans in the order they occur, or None when the template
        writes the contents otherwise (it changes them, or its own text depends on them).
    """
    if rendered is None:
        rendered = render_chat(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)
    marked = [dict(m) for m in messages]
    for i, m in enumerate(marked):
        if isinstance(m.get("content"), str):
            m["content"] = _MESSAGE_SENTINEL.format(i=i)
    parts = _MESSAGE_SENTINEL_PATTERN.split(
        render_chat(tokenizer, marked, tools=tools, add_generation_prompt=add_generation_prompt)
    )  # template text, message index, template text, ...
    for strip in (False, True):
        out, spans = parts[0], []
        for index, after in zip(parts[1::2], parts[2::2]):
            content = str(messages[int(index)]["content"])
            content = content.strip() if strip else content
            spans.append((int(index), len(out), len(out) + len(content)))
            out += content + after
        if out == rendered:
            return spans
    return None


def _data_spans(
    tokenizer: Any, messages: Sequence[Message], rendered: str, *, tools: list[dict] | None,
    add_generation_prompt: bool, first: int = 0,
) -> list[ContentSpan]:
    """:func:`_content_spans` of ``messages`` when a content from ``messages[first]`` on spells a special token
    (else none are needed: []); a template that rewrites contents gets [] and one warning (its contents are
    then tokenised as one text with the template, special-token strings included)."""
    global _WARNED_REWRITTEN_CONTENT
    if not any(isinstance(m.get("content"), str) and spells_special_token(tokenizer, m["content"])
               for m in messages[first:]):
        return []
    spans = _content_spans(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                          rendered=rendered)
    if spans is None:
        if not _WARNED_REWRITTEN_CONTENT:
            _WARNED_REWRITTEN_CONTENT = True
            log.warning("the chat template rewrites message contents, so a content that spells a special token "
                        "(e.g. %r) cannot be kept apart from the template's own markers and is tokenised as one",
                        special_token_strings(tokenizer)[0])
        return []
    return spans


def _encode_piece(tokenizer: Any, rendered: str, spans: Sequence[ContentSpan], start: int, end: int) -> list[int]:
    """:func:`encode_rendered` of ``rendered[start:end]`` with the contents in ``spans`` as data."""
    return encode_rendered(tokenizer, rendered[start:end], [(a - start, b - start) for _, a, b in spans])


def _eos(tokenizer: Any) -> tuple[str, int]:
    if tokenizer.eos_token is None or tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; rollouts need one to end assistant turns")
    return tokenizer.eos_token, int(tokenizer.eos_token_id)


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a reply: the tokenizer's EOS (the template's end-of-turn token) first, then the other
    ids of ``model.generation_config.eos_token_id`` (an int or a list: Qwen3, Llama 3 and Gemma 3 list
    several). The HF backend and Skill-SD's skill writing stop on any of them; the episode loop records a
    reply ended by one of the others with the template's token in its place
    (:func:`~lopd_lightning.rollout.generate_rollouts`).

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    ids = [_eos(tokenizer)[1]]
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in [config_eos] if isinstance(config_eos, int) else list(config_eos or []):
        if int(e) not in ids:
            ids.append(int(e))
    return ids


def encode_prompt(tokenizer: Any, messages: Sequence[Message], *, tools: list[dict] | None = None) -> PromptEncoding:
    """Render ``messages`` with the generation prompt and tokenize it in two pieces.

    The rendered text is split where the first user message's content starts; the text before and the
    text from there on are tokenized separately (``add_special_tokens=False``) and concatenated, so that
    ``context_position`` is a token boundary. Rollouts use this same split tokenization. Message contents
    are data: special-token strings in them stay text (:func:`~lopd_lightning.text.encode_rendered`).

    Raises:
        ValueError: no user message.
        ChatTemplateError: the template does not render the first user content where expected.
    """
    user_index = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if user_index is None:
        raise ValueError("the conversation has no user message; context_position needs one")
    text = render_chat(tokenizer, messages, tools=tools, add_generation_prompt=True)
    spans = _data_spans(tokenizer, messages, text, tools=tools, add_generation_prompt=True)
    cut = next((a for i, a, _ in spans if i == user_index), None)
    if cut is None:
        marked = [dict(m) for m in messages]
        marked[user_index]["content"] = _CONTENT_SENTINEL
        marked_text = render_chat(tokenizer, marked, tools=tools, add_generation_prompt=True)
        cut = marked_text.find(_CONTENT_SENTINEL)
        if cut < 0 or not text.startswith(marked_text[:cut]):
            raise ChatTemplateError(
                "cannot locate the first user message's content in the rendered prompt: the chat template "
                "changes the text before it depending on the content"
            )
    before = _encode_piece(tokenizer, text, spans, 0, cut)
    return PromptEncoding(input_ids=before + _encode_piece(tokenizer, text, spans, cut, len(text)),
                          context_position=len(before), text=text)


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

    The observation's contents are data: special-token strings in them stay text, only the template's own
    markers are special (:func:`~lopd_lightning.text.encode_rendered`).

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
    reply_index = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    spans = _data_spans(tokenizer, messages, rendered, tools=tools, add_generation_prompt=True, first=reply_index + 1)
    return ids + _encode_piece(tokenizer, rendered, spans, len(head) + len(eos_text), len(rendered)), rendered


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
    ids), and its EOS is the template's also where the rollout's reply ended on another EOS id (there the
    rollout's mask is 0). Every content is data: a reference reply that spells ``</s>`` is trained as that
    text, never as an EOS in mid-reply.

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
        reply_ids = encode_data(tokenizer, reply) + [eos_id]
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


def _pad_token_id(tokenizer: Any) -> int:
    """The id that pads a :class:`RolloutBatch`: the tokenizer's pad token, else its EOS."""
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _eos(tokenizer)[1])


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
    per_tools = _tools_per_conversation(tools, n)
    reward_t = torch.as_tensor(rewards, dtype=torch.float32).reshape(n)
    if n and not bool(((reward_t >= 0) & (reward_t <= 1)).all()):
        raise ValueError(f"rewards must be in [0, 1], got {reward_t.tolist()}")
    rows = [
        _teacher_forced_row(tokenizer, conv, conv_tools, ex_id, max_length)
        for conv, conv_tools, ex_id in zip(conversations, per_tools, example_ids)
    ]
    ids = [row[0] for row in rows]
    return RolloutBatch(
        **_token_tensors(ids, [row[1] for row in rows], [[0.0] * len(x) for x in ids], _pad_token_id(tokenizer)),
        rewards=reward_t,
        group_ids=torch.as_tensor(group_ids, dtype=torch.long).reshape(n),
        context_position=torch.tensor([row[2] for row in rows], dtype=torch.long),
        example_ids=list(example_ids),
        messages=[[dict(m) for m in c] for c in conversations],
        metadata=[row[3] for row in rows],
        pad_token_id=_pad_token_id(tokenizer),
    )


def _tools_per_conversation(tools: list[dict] | Sequence[list[dict] | None] | None, n: int) -> list[Any]:
    """``tools`` of :func:`batch_from_conversations` as one entry per conversation (ValueError on a bad count)."""
    if tools is not None and len(tools) and isinstance(tools[0], dict):
        return [tools] * n
    if tools is None:
        return [None] * n
    if len(tools) != n:
        raise ValueError(f"tools: {len(tools)} entries for {n} conversations")
    return list(tools)


def _teacher_forced_row(
    tokenizer: Any, conversation: Sequence[Message], tools: list[dict] | None, example_id: str, max_length: int | None
) -> tuple[list[int], list[int], int, dict[str, Any]]:
    """(ids, assistant mask, context position, metadata) of one conversation, cut at ``max_length``."""
    ids, mask, pos = tokenize_conversation(tokenizer, conversation, tools=tools)
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        if pos >= max_length:
            raise ValueError(f"max_length={max_length} cuts off the context position {pos} of {example_id!r}")
        ids, mask = ids[:max_length], mask[:max_length]
    metadata = {
        "turns": sum(1 for m in conversation if m.get("role") == "assistant"),
        "truncated": truncated,
        "truncation": "max_length" if truncated else None,
        "errors": [],
    }
    return ids, mask, pos, metadata
