"""The key/value prefix cache: the teacher's pass starts after the tokens it shares with the student.

The tokens before every row's inserted context (the beginning of the student's prompt, up to the first
user message's content: for BFCL the system prompt with the tool schemas, most of the prompt) are the
same in the student's and the teacher's sequences, and the causal mask makes their states independent
of the context. Their keys and values (:class:`TeacherPrefix`) can therefore be computed once, by the
student's own forward when it runs with the teacher's weights (``live`` mode without dropout), or by
one no-grad teacher pass (:func:`prefix_from_model`), and the teacher's pass then runs on the rest only
(:func:`after_prefix`), forward and backward: the same logits and gradients up to float rounding.

Map to the method (docs/METHOD.md): section 4, the teacher's pass (an exact shortcut, not a method change).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lopd_lightning.lm import base_model, decoder_hidden_states, position_ids_from_mask
from lopd_lightning.teacher.splice import TeacherInputs

__all__ = ["PrefixStore", "TeacherPrefix", "after_prefix", "check_prefix_read", "has_dropout", "prefix_from_model",
           "prefix_length", "supports_prefix_cache"]


class TeacherPrefix(NamedTuple):
    """The keys and values of the first ``length`` tokens of every row: the part of the teacher's sequence
    before any inserted context, i.e. the beginning of the student's prompt, up to the first user
    message's content (for BFCL: the system prompt with the tool schemas, most of the prompt).

    The teacher's pass can start after it (:meth:`SelfTeacher.logits_on_student_positions` with
    ``prefix=``): the causal attention makes these tokens' states independent of the context, so their
    keys and values are the same whoever computes them with the teacher's weights, and no gradient to the
    latents flows through them. Build it with :meth:`from_cache` (the student's forward in ``live`` mode:
    the same weights) or :meth:`SelfTeacher.own_prefix`.

    Attributes:
        key_values: per decoder layer, (keys, values), each (B, kv_heads, length, head_dim), constants.
        length: the number of prefix tokens, the same for every row.
    """

    key_values: tuple[tuple[Tensor, Tensor], ...]
    length: int

    @classmethod
    def from_cache(cls, cache, length: int) -> TeacherPrefix:
        """The first ``length`` positions of a transformers key/value cache (``DynamicCache``), detached.

        Raises:
            ValueError: ``length`` is negative or longer than the cache, or a layer is not a plain
                full-attention dynamic layer (sliding-window or linear-attention layers keep other state).
        """
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        if not layers:
            raise ValueError(f"expected a transformers DynamicCache with layers, got {type(cache).__name__}")
        pairs = []
        for i, layer in enumerate(layers):
            if type(layer) is not DynamicLayer:
                raise ValueError(
                    f"cache layer {i} is a {type(layer).__name__}; a teacher prefix needs full-attention "
                    f"DynamicLayer caches (set teacher_prefix_cache to false for this model)"
                )
            if not 0 <= length <= layer.keys.shape[-2]:
                raise ValueError(f"prefix length {length} outside [0, {layer.keys.shape[-2]}] cached positions")
            pairs.append((layer.keys[..., :length, :].detach(), layer.values[..., :length, :].detach()))
        return cls(tuple(pairs), int(length))

    def cache(self):
        """A fresh ``DynamicCache`` holding the prefix (a forward appends to its cache, so one per pass)."""
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=self.key_values)


def prefix_length(attention_mask: Tensor, context_position: Tensor | Sequence[int]) -> int:
    """The number of leading tokens that every row's teacher sequence shares with its student sequence.

    ``min_b context_position[b]`` for a right-padded batch (rollout batches are), 0 for a left-padded
    one (:meth:`SelfTeacher.insert_context` shifts left-padded rows by different amounts). One length for
    the batch: rows whose context starts later (or that get none) recompute their tokens after it.

    Args:
        attention_mask: (B, T) {0, 1}.
        context_position: (B,) where each row's context is inserted.
    """
    if attention_mask.numel() == 0 or bool((attention_mask[:, 0] == 0).any()):
        return 0
    pos = torch.as_tensor(context_position).reshape(-1)
    return int(pos.min()) if pos.numel() else 0


#: config fields of transformers models that add randomness in train mode (dropout rates, MoE router jitter).
_RANDOM_CONFIG_FIELDS = (
    "attention_dropout", "hidden_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop",
    "embd_pdrop", "attn_pdrop", "dropout", "activation_dropout", "router_jitter_noise",
)


def has_dropout(model: nn.Module) -> bool:
    """True when a forward of ``model`` in train mode may differ from an eval-mode one: an ``nn.Dropout``
    with p > 0 (LoRA dropout included) or a config rate > 0 among ``_RANDOM_CONFIG_FIELDS`` (the model's
    config and its text config)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    base = base_model(model)
    config = getattr(base, "config", None)
    configs = [config]
    if config is not None and hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    for cfg in configs:
        for name in _RANDOM_CONFIG_FIELDS:
            value = getattr(cfg, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return True
    return False


def supports_prefix_cache(model: nn.Module) -> bool:
    """True when the model's key/value cache is plain full attention in every layer (``DynamicLayer``),
    which :class:`TeacherPrefix` needs; False for sliding-window or linear-attention layers."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    base = base_model(model)
    try:
        layers = DynamicCache(config=base.config).layers
    except Exception:  # an architecture whose cache transformers cannot build from the config alone
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def prefix_from_model(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, length: int) -> TeacherPrefix:
    """The keys and values ``model`` computes for the first ``length`` tokens of each row, no gradient.

    Run it under the teacher's weights (:meth:`SelfTeacher.teacher_scope`; :meth:`SelfTeacher.own_prefix`
    does).

    Args:
        input_ids, attention_mask: (B, T) the student's batch, right padded.
        length: the prefix length in [1, T], e.g. :func:`prefix_length`.

    Raises:
        ValueError: ``length`` outside [1, T].
    """
    if not 0 < length <= input_ids.shape[1]:
        raise ValueError(f"prefix length must be in [1, {input_ids.shape[1]}], got {length}")
    mask = attention_mask[:, :length]
    with torch.no_grad():
        _, cache = decoder_hidden_states(
            model, return_cache=True, input_ids=input_ids[:, :length], attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
        )
    return TeacherPrefix.from_cache(cache, length)


def after_prefix(
    prefix: TeacherPrefix, inputs: TeacherInputs, teacher_positions: Tensor, batch: int
) -> tuple[dict[str, Any], Tensor]:
    """The model arguments and the (B, T' - n) positions of a teacher pass that starts after ``prefix``.

    Every input but the attention mask (which covers the prefix too) loses its first n columns, and the
    keyword ``cache`` holds a fresh cache of the prefix.

    Raises:
        ValueError: the prefix is not shared by every teacher row (a context inserted before it, or a
            left-padded batch), a wanted position falls inside it, or it holds another number of rows.
    """
    n = prefix.length
    steps = torch.arange(n, device=inputs.index_map.device)
    if inputs.index_map.shape[1] < n or not bool((inputs.index_map[:, :n] == steps).all()):
        raise ValueError(
            f"the prefix ({n} tokens) is not shared by the teacher's rows: a context is inserted "
            f"before it or the batch is left padded (see teacher.prefix_length)"
        )
    if bool(teacher_positions[:, :n].any()):
        raise ValueError(f"positions fall inside the {n}-token prefix, whose logits are not computed")
    if any(k.shape[0] != batch for k, _ in prefix.key_values):
        raise ValueError(f"the prefix holds {prefix.key_values[0][0].shape[0]} rows, the batch {batch}")
    kwargs: dict[str, Any] = {k: (v if k == "attention_mask" else v[:, n:]) for k, v in inputs.model_kwargs().items()}
    kwargs["cache"] = prefix.cache()
    return kwargs, teacher_positions[:, n:]


def check_prefix_read(cache: Any, prefix: TeacherPrefix, total: int) -> None:
    """Raise RuntimeError unless the pass extended the prefix's cache to all ``total`` teacher positions
    (a decoder that ignored an unrecognised cache argument would silently compute a wrong pass)."""
    if cache.get_seq_length() != total:
        raise RuntimeError(
            f"the teacher's pass did not extend the {prefix.length}-token prefix cache "
            f"({cache.get_seq_length()} of {total} positions); set "
            f"teacher_prefix_cache to false and report the transformers version"
        )


class PrefixStore:
    """The teacher's prefixes kept across batches, for a teacher whose weights do not change (the composer's
    pretraining: the teacher is the student, or its base, and neither trains there).

    Each row's own shared prefix (its tokens before its context position: on a tool-use task the system
    prompt with the tool schemas, which a few requests share: hidden_rules has 15 for 600 train requests) is
    computed once, without gradients, and kept by its token ids; a batch's :class:`TeacherPrefix` of length
    n = the shortest row's is the rows' kept keys and values cut to n and stacked. The same values as
    :func:`prefix_from_model` on the batch (the causal mask: a token's state depends on the tokens before it
    only), up to float rounding, without its pass.

    Args:
        capacity: the most prefixes kept (least recently used dropped first); each holds
            2 x layers x kv_heads x length x head_dim floats (SmolLM2-135M, 400 tokens: 18 MB).

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int = 64):
        if capacity < 1:
            raise ValueError(f"a prefix store needs capacity >= 1, got {capacity}")
        from collections import OrderedDict

        self.capacity = int(capacity)
        self._kept: OrderedDict[tuple[int, ...], TeacherPrefix] = OrderedDict()
        #: rows served from the store, and rows whose prefix had to be computed
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._kept)

    def prefix(self, teacher, input_ids: Tensor, attention_mask: Tensor,
               context_position: Tensor | Sequence[int]) -> TeacherPrefix | None:
        """The batch's :class:`TeacherPrefix` of :func:`prefix_length` tokens (None when that is 0).

        Args:
            teacher: the :class:`~lopd_lightning.teacher.SelfTeacher` whose weights (constant while this store
                is used) compute a missing row's prefix (:meth:`~lopd_lightning.teacher.SelfTeacher.own_prefix`).
            input_ids, attention_mask: (B, T), right padded. context_position: (B,).
        """
        length = prefix_length(attention_mask, context_position)
        if length == 0:
            return None
        positions = [int(p) for p in torch.as_tensor(context_position).reshape(-1).tolist()]
        rows = []
        for b, own in enumerate(positions):
            key = tuple(int(t) for t in input_ids[b, :own].tolist())
            kept = self._kept.get(key)
            if kept is None:
                self.misses += 1
                kept = teacher.own_prefix(input_ids[b : b + 1, :own], attention_mask[b : b + 1, :own], own)
                self._kept[key] = kept
                while len(self._kept) > self.capacity:
                    self._kept.popitem(last=False)
            else:
                self.hits += 1
                self._kept.move_to_end(key)
            rows.append(kept)
        pairs = tuple(
            (torch.cat([r.key_values[i][0][..., :length, :] for r in rows]),
             torch.cat([r.key_values[i][1][..., :length, :] for r in rows]))
            for i in range(len(rows[0].key_values))
        )
        return TeacherPrefix(pairs, length)
