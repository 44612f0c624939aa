"""Sequence splicing: the student's sequence with a privileged context inserted, the teacher's input.

Row b's context goes at ``context_position[b]``, the start of its first user message's content:

    ... <|im_start|>user\\n  [framing_prefix] [c_phi: L placeholder positions] [framing_suffix]  {x} ...

(latents: the placeholders' input embeddings are replaced by the latent tokens), or a text context's
token ids (OPSD's reference solution, SDPO's successful sibling). A row without a context gets nothing
inserted. The steps, each a function here, in the order :meth:`SelfTeacher.insert_context` calls them:

1. :func:`check_splice_inputs`: shapes and positions;
2. :func:`latent_contexts` (or the text contexts as given): each row's context token ids;
3. :func:`fit_contexts`: cut contexts that would not fit the model's positions (never the student's tokens);
4. :func:`splice`: the teacher's ids, mask, positions and the map from student to teacher positions;
5. :func:`place_latents`: the latents at the placeholder slots of the token embeddings.

Map to the method (docs/METHOD.md): section 4, the teacher's input [s; c_phi].
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from lopd_lightning.hints import choose_one_of
from lopd_lightning.lm import position_ids_from_mask

log = logging.getLogger(__name__)

DEFAULT_FRAMING_PREFIX = "Here is a reference example of a different, already solved task:\n"
DEFAULT_FRAMING_SUFFIX = "\nNow complete your task.\n\n"

#: The framings a ``context_framing`` option names: (prefix, suffix) around a privileged context, text or latents.
#: ``short``: the project's first framing (every default). ``from_scratch``: the long anti-copying framing of the
#: LOPD authors' code, in this project's words (docs/METHOD.md section 4): the example is another task, already
#: finished; nothing of the current task has been done; every step must be taken from the start; the current
#: task begins now, from an untouched environment.
FRAMINGS: dict[str, tuple[str, str]] = {
    "short": (DEFAULT_FRAMING_PREFIX, DEFAULT_FRAMING_SUFFIX),
    "from_scratch": (
        "Below is a worked example from another task, one that has already been carried out to the end. It only "
        "shows how a task like this can be approached: its calls, arguments and results are not part of your "
        "task.\n<example>\n",
        "\n</example>\nThe example above is over. None of your own task has been done yet: no call has been made "
        "for it and no result exists. Work through every step of your task yourself, from the first one, using "
        "only what your request says. Your task starts now, in an environment nothing has touched.\n\n",
    ),
}


def resolve_framing(value: str | dict | None, *, key: str = "model.init_args.context_framing") -> tuple[str, str]:
    """The (prefix, suffix) of a ``context_framing`` value: a name of :data:`FRAMINGS`, or a mapping with the keys
    ``prefix`` and ``suffix`` (strings; either may be ""). None is ``short``.

    Raises:
        ValueError: an unknown name, a mapping with other keys or non-string values, or another type; the
            message names ``key``.
    """
    if value is None:
        return FRAMINGS["short"]
    if isinstance(value, str):
        if value not in FRAMINGS:
            raise ValueError(f"{key} {value!r} is not a framing; {choose_one_of(value, tuple(FRAMINGS))}, "
                             "or give {prefix: ..., suffix: ...}")
        return FRAMINGS[value]
    if isinstance(value, dict):
        keys = set(value)
        if keys != {"prefix", "suffix"} or not all(isinstance(value[k], str) for k in ("prefix", "suffix")):
            raise ValueError(f"{key} as a mapping needs exactly the string keys prefix and suffix, got "
                             f"{sorted(map(str, keys))}")
        return value["prefix"], value["suffix"]
    raise ValueError(f"{key} must be a framing name ({', '.join(FRAMINGS)}) or {{prefix: ..., suffix: ...}}, "
                     f"got {type(value).__name__}")


def frame_text(text: str | None, prefix: str = DEFAULT_FRAMING_PREFIX, suffix: str = DEFAULT_FRAMING_SUFFIX) -> str | None:
    """One text context framed: ``prefix + text + suffix``, or None for None or "" (no context). The one framing
    of text contexts (:meth:`SelfTeacher.frame_text_context` applies it per row; ``benchmarks/start_student.py``
    puts it before an SFT row's request, where the teacher inserts its contexts)."""
    return prefix + text + suffix if text else None


class TeacherInputs(NamedTuple):
    """The teacher's batch, the student's sequence with the context inserted. T' = T + max_b C_b.

    Attributes:
        input_ids: (B, T') long; the placeholder id at latent slots, pad id on padding.
        inputs_embeds: (B, T', d) or None (None for a text context or no context: feed ``input_ids``).
        attention_mask: (B, T') long {0, 1}.
        position_ids: (B, T') long, :func:`~lopd_lightning.lm.position_ids_from_mask` of ``attention_mask``.
        index_map: (B, T) long, the teacher position of each student position.
        context_mask: (B, T') bool, True on inserted tokens (framing text, placeholders, text contexts).
        latent_slots: (B, T') bool, True where a latent replaced the embedding; row-major order matches
            ``latents[latent_mask]``.
    """

    input_ids: Tensor
    inputs_embeds: Tensor | None
    attention_mask: Tensor
    position_ids: Tensor
    index_map: Tensor
    context_mask: Tensor
    latent_slots: Tensor

    def model_kwargs(self) -> dict[str, Tensor]:
        """Keyword arguments for a Hugging Face causal LM forward."""
        kwargs = {"attention_mask": self.attention_mask, "position_ids": self.position_ids}
        if self.inputs_embeds is not None:
            kwargs["inputs_embeds"] = self.inputs_embeds
        else:
            kwargs["input_ids"] = self.input_ids
        return kwargs


class Framing(NamedTuple):
    """The token ids around a row's latent slots: ``prefix_ids + [placeholder_id] * L + suffix_ids``."""

    prefix_ids: list[int]
    suffix_ids: list[int]
    placeholder_id: int

    def around(self, num_slots: int) -> list[int]:
        """The context of a row with ``num_slots`` latents ([] for none)."""
        return self.prefix_ids + [self.placeholder_id] * num_slots + self.suffix_ids if num_slots > 0 else []


def check_splice_inputs(
    input_ids: Tensor,
    attention_mask: Tensor,
    context_position: Tensor | Sequence[int],
    *,
    context_ids: Sequence[Sequence[int] | None] | None = None,
    latents: Tensor | None = None,
) -> Tensor:
    """``context_position`` as a (B,) long tensor on ``input_ids``' device, after checking the inputs.

    Raises:
        ValueError: both ``context_ids`` and ``latents``; ids and mask not the same (B, T); a position
            count other than B or a position outside [0, T]; ``latents`` not (B, L, d); B != len(context_ids).
    """
    if context_ids is not None and latents is not None:
        raise ValueError("give context_ids or latents, not both")
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"expected (B, T) ids and mask, got {tuple(input_ids.shape)}, {tuple(attention_mask.shape)}"
        )
    batch, length = input_ids.shape
    pos = torch.as_tensor(context_position, device=input_ids.device, dtype=torch.long).reshape(-1)
    if pos.shape[0] != batch:
        raise ValueError(f"context_position must have {batch} entries, got {pos.shape[0]}")
    if bool(((pos < 0) | (pos > length)).any()):
        raise ValueError(f"context_position must be in [0, {length}], got {pos.tolist()}")
    if latents is not None and (latents.dim() != 3 or latents.shape[0] != batch):
        raise ValueError(f"latents must be (B={batch}, L, d), got {tuple(latents.shape)}")
    if context_ids is not None and len(context_ids) != batch:
        raise ValueError(f"context_ids must have {batch} rows, got {len(context_ids)}")
    return pos


def latent_contexts(
    latents: Tensor, latent_mask: Tensor | None, framing: Framing
) -> tuple[list[list[int]], list[int], Tensor]:
    """Each row's context ids for its latents: (contexts, number of slots per row, the bool latent mask).

    Args:
        latents: (B, L, d).
        latent_mask: (B, L) bool, the latents a row uses, or None (all).

    Raises:
        ValueError: ``latent_mask`` is not (B, L).
    """
    if latent_mask is None:
        latent_mask = torch.ones(latents.shape[:2], dtype=torch.bool, device=latents.device)
    if latent_mask.shape != latents.shape[:2]:
        raise ValueError(f"latent_mask must be {tuple(latents.shape[:2])}, got {tuple(latent_mask.shape)}")
    latent_mask = latent_mask.bool()
    num_slots = [int(n) for n in latent_mask.sum(dim=1).tolist()]
    return [framing.around(n) for n in num_slots], num_slots, latent_mask


def fit_contexts(
    contexts: list[list[int]],
    num_slots: list[int],
    latent_mask: Tensor | None,
    lengths: list[int],
    *,
    max_length: int,
    framing: Framing,
    cut_so_far: int = 0,
) -> tuple[list[list[int]], list[int], Tensor | None, int]:
    """Cut each row's privileged context so that the teacher's row fits ``max_length`` tokens.

    The student's own tokens (the question, the replies, the observations) are never cut: the
    retrieved or privileged context goes first. A text context (``latent_mask`` None) keeps its
    beginning and its end (its framing: what it is, and what to do next) and loses its middle; latents
    keep their first slots (the first experiences', in retrieval order) inside the framing, and a row
    with no room for the framing and one slot gets no context. Each cut is logged.

    Args:
        contexts, num_slots: per row, as :func:`latent_contexts` gives them (changed in place).
        latent_mask: (B, L) bool or None; cloned before a cut (the caller's mask is not changed).
        lengths: per row, the student's token count.
        max_length: the model's positions.
        cut_so_far: rows cut before this call (for the log line).

    Returns:
        (contexts, num_slots, latent_mask, the number of rows cut by this call).
    """
    framing_length = len(framing.prefix_ids) + len(framing.suffix_ids)
    cut = 0
    cloned = False
    for b, context in enumerate(contexts):
        room = int(max_length) - int(lengths[b])
        if len(context) <= room:
            continue
        cut += 1
        if latent_mask is None:  # a text context: keep its beginning and its end (the framing), cut the middle
            head = max(room, 0) // 2
            contexts[b] = context[:head] + context[len(context) - (max(room, 0) - head):] if room > 0 else []
        else:
            keep = max(room - framing_length, 0)
            num_slots[b] = keep
            contexts[b] = framing.around(keep)
            if not cloned:
                latent_mask, cloned = latent_mask.clone(), True  # the caller's mask is not changed
            on = latent_mask[b].nonzero(as_tuple=True)[0]
            latent_mask[b, on[keep:]] = False
        log.warning(
            "teacher row %d: %d context tokens do not fit the model's %d positions next to the student's %d "
            "tokens; the context is cut to %d (%d rows so far)",
            b, len(context), max_length, lengths[b], len(contexts[b]), cut_so_far + cut,
        )
    return contexts, num_slots, latent_mask, cut


def splice(
    input_ids: Tensor,
    attention_mask: Tensor,
    context_position: Tensor,
    contexts: list[list[int]],
    *,
    pad_id: int,
    slots: tuple[int, list[int]] | None = None,
) -> TeacherInputs:
    """The student's rows with ``contexts[b]`` inserted at ``context_position[b]``; ``inputs_embeds`` None.

    Rows are padded to T' = T + max_b C_b on the side the batch is padded on (left when some row starts
    with a pad, else right), so padding stays contiguous; positions come from the mask either way.

    Args:
        input_ids, attention_mask: (B, T), left or right padded.
        context_position: (B,) long in [0, T] (:func:`check_splice_inputs`).
        contexts: per row, the token ids to insert ([] for none).
        pad_id: the id written on padding.
        slots: for latent contexts, (the index of the first slot in a context, the slots per row):
            marks ``latent_slots``; None for text contexts.
    """
    batch, length = input_ids.shape
    device = input_ids.device
    pos = context_position
    ctx_len = torch.tensor([len(c) for c in contexts], dtype=torch.long, device=device)  # [B]
    max_ctx = int(ctx_len.max()) if batch else 0
    left_padded = bool((attention_mask[:, 0] == 0).any()) if length else False
    offset = (max_ctx - ctx_len) if left_padded else torch.zeros_like(ctx_len)  # [B]
    steps = torch.arange(length, device=device)
    index_map = offset[:, None] + steps[None, :] + ctx_len[:, None] * (steps[None, :] >= pos[:, None])  # [B, T]

    total = length + max_ctx
    teacher_ids = torch.full((batch, total), pad_id, dtype=torch.long, device=device)
    teacher_mask = torch.zeros((batch, total), dtype=torch.long, device=device)
    teacher_ids.scatter_(1, index_map, input_ids.long())
    teacher_mask.scatter_(1, index_map, attention_mask.long())
    context_mask = torch.zeros((batch, total), dtype=torch.bool, device=device)
    latent_slots = torch.zeros((batch, total), dtype=torch.bool, device=device)
    if max_ctx > 0:
        ctx = torch.full((batch, max_ctx), pad_id, dtype=torch.long, device=device)
        for b, c in enumerate(contexts):
            if c:
                ctx[b, : len(c)] = torch.tensor(c, dtype=torch.long, device=device)
        i = torch.arange(max_ctx, device=device)
        valid = i[None, :] < ctx_len[:, None]  # [B, Cmax]
        ctx_pos = offset[:, None] + pos[:, None] + i[None, :]  # [B, Cmax]
        rows, cols = valid.nonzero(as_tuple=True)
        where = ctx_pos[rows, cols]
        teacher_ids[rows, where] = ctx[rows, cols]
        teacher_mask[rows, where] = 1
        context_mask[rows, where] = True
        if slots is not None:
            start, per_row = slots
            count = torch.tensor(per_row, dtype=torch.long, device=device)
            is_slot = (i[None, :] >= start) & (i[None, :] < start + count[:, None])  # [B, Cmax]
            s_rows, s_cols = is_slot.nonzero(as_tuple=True)
            latent_slots[s_rows, ctx_pos[s_rows, s_cols]] = True
    position_ids = position_ids_from_mask(teacher_mask)
    return TeacherInputs(teacher_ids, None, teacher_mask, position_ids, index_map, context_mask, latent_slots)


def place_latents(token_embeds: Tensor, latents: Tensor, latent_mask: Tensor, latent_slots: Tensor) -> Tensor:
    """``token_embeds`` (B, T', d) with ``latents[latent_mask]`` at ``latent_slots``, row-major.

    Built out of place (``index_put`` on a zero canvas, then ``torch.where``), so the result is
    differentiable in ``latents`` and the token embeddings stay constants.
    """
    device = token_embeds.device
    values = latents.to(device=device, dtype=token_embeds.dtype)[latent_mask.to(device)]  # [N, d]
    s_rows, s_pos = latent_slots.nonzero(as_tuple=True)  # row-major: same order as values
    canvas = token_embeds.new_zeros(token_embeds.shape).index_put((s_rows, s_pos), values)
    return torch.where(latent_slots[..., None], canvas, token_embeds)


def student_to_teacher_positions(inputs: TeacherInputs, positions: Tensor) -> Tensor:
    """(B, T) bool student positions -> (B, T') bool positions of the same tokens in the teacher's rows."""
    out = torch.zeros(inputs.attention_mask.shape, dtype=torch.bool, device=positions.device)
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(inputs.index_map)
    out[rows[positions.bool()], inputs.index_map[positions.bool()]] = True
    return out
