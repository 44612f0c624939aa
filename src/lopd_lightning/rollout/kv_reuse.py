"""Prefix reuse for :class:`~lopd_lightning.rollout.backends.HFGenerateBackend`: keys and values already
computed, found again by the token ids they were computed from.

Two wastes of re-prefilling every context from scratch are removed:

- across turns: the context of an episode's next turn is its previous context, the reply, the
  observation and the next generation prompt. The keys/values of the previous context and of the reply's
  tokens that were fed back (every reply token but the last sampled one) are kept in a
  :class:`PrefixStore`, so the next turn computes only the tokens after them;
- within a call: the G rollouts of a task start from identical prompts (GRPO's group); identical
  (cached prefix, prompt) pairs are prefilled once and the result is copied to every row that needs it.

Like vLLM's automatic prefix caching, a cached row is found by CONTENT, never by identity: the chained
hashes of its full 16-token blocks index it (:func:`_chain_hashes`), and a candidate is used only for the
common prefix its token ids verifiably share with the prompt (compared token by token, so a hash collision
costs a prefill, never a wrong cache). Keys and values of the same token ids at the same positions (the
prompt starts at position 0 either way) are the same numbers up to floating-point differences, so a hit is
exact; a prompt that shares nothing (a context truncated or rewritten, a new example) is prefilled whole.
Nothing here knows about weights: the backend clears the store whenever they may have changed.

Layout. Keys and values are ``(rows, kv_heads, columns, head_dim)`` per layer, as in transformers'
``DynamicLayer``. A stored :class:`_CachedBatch` (the rows of one call) also has ``valid`` ``(rows,
columns)`` (bool, CPU): the columns that hold the row's tokens, in order (the others are left padding,
or the padding ``generate`` fed after a row had ended). :func:`pack` gathers any rows' first ``c`` valid columns into a TIGHT left-padded layout (row i's
``c_i`` columns right-aligned, zeros before them): the layout ``generate`` itself builds from left-padded
prompts, so that its position ids (``cumsum(attention_mask) - 1``, transformers 5.19 and 5.24 alike) are
the tokens' true positions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

#: tokens per hashed block of the prefix index (vLLM's default block size).
BLOCK = 16

#: per layer, (keys, values), each (rows, kv_heads, columns, head_dim).
Layers = list[tuple[Tensor, Tensor]]


def _chain_hashes(ids: Sequence[int], limit: int | None = None) -> list[int]:
    """Hash of every full :data:`BLOCK`-token block of ``ids[:limit]``, each chained with the ones before it."""
    end = len(ids) if limit is None else min(limit, len(ids))
    out, h = [], 0
    for stop in range(BLOCK, end + 1, BLOCK):
        h = hash((h, tuple(ids[stop - BLOCK:stop])))
        out.append(h)
    return out


@dataclass
class _CachedBatch:
    """The rows computed by one ``generate`` call: their keys/values, valid columns and token ids (not to be
    confused with :data:`BLOCK`, the 16-token unit of the hash index)."""

    layers: Layers
    valid: Tensor  # (rows, columns) bool, CPU
    tokens: list[list[int]]

    def select(self, rows: list[int]) -> _CachedBatch:
        """The batch with only ``rows`` (new, smaller tensors: the dropped rows' memory is freed)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.layers[0][0].device)
        return _CachedBatch([(k.index_select(0, index), v.index_select(0, index)) for k, v in self.layers],
                      self.valid[rows], [self.tokens[r] for r in rows])


@dataclass(frozen=True)
class Hit:
    """A cached prefix of one prompt: row ``row`` of ``store.batches[batch]`` holds its first ``length`` tokens."""

    batch: int
    row: int
    length: int


@dataclass
class PrefixStore:
    """The cached rows of one session (see the module docstring); ``stamp`` is the weights they belong to.

    Memory: every row kept holds ``columns x layers x 2 x kv_heads x head_dim x dtype bytes`` (keys and
    values), ``columns`` its batch's width (its context so far plus padding); the store keeps the rows of
    every live episode of the session, whatever ``generation_batch_size`` the loop calls ``generate`` with.
    """

    batches: list[_CachedBatch] = field(default_factory=list)
    stamp: Any = None

    def __len__(self) -> int:
        return sum(len(b.tokens) for b in self.batches)

    def clear(self) -> None:
        """Forget every row."""
        self.batches = []

    def lookup(self, prompts: Sequence[Sequence[int]]) -> list[Hit | None]:
        """For each prompt, the cached row sharing its longest verified prefix, capped at ``len - 1`` tokens
        (the last token is always fed: its logits give the first reply token); None when there is none.

        The deepest full block of the prompt whose chained hash a row also has gives the candidates (the
        G rows of a group share their prompt's blocks); the one whose tokens go on matching longest past
        that block wins, and its whole prefix is then compared token by token (a hash collision gives None).
        """
        index: dict[int, list[tuple[int, int]]] = {}
        for b, batch in enumerate(self.batches):
            for r, tokens in enumerate(batch.tokens):
                for h in _chain_hashes(tokens):
                    index.setdefault(h, []).append((b, r))
        hits: list[Hit | None] = []
        for prompt in prompts:
            prompt = list(prompt)
            candidates, depth = [], 0
            for d, h in enumerate(_chain_hashes(prompt, len(prompt) - 1), start=1):
                if h not in index:
                    break
                candidates, depth = index[h], d
            best, best_length = None, 0
            for b, r in candidates:
                tokens, n = self.batches[b].tokens[r], depth * BLOCK
                limit = min(len(tokens), len(prompt) - 1)
                while n < limit and tokens[n] == prompt[n]:  # fewer than BLOCK steps: a full block would hash
                    n += 1
                if n > best_length:
                    best, best_length = (b, r), n
            verified = best is not None and self.batches[best[0]].tokens[best[1]][:best_length] == prompt[:best_length]
            hits.append(Hit(best[0], best[1], best_length) if verified else None)
        return hits

    def retain(self, contexts: Sequence[Sequence[int]]) -> None:
        """Keep only the rows that some context in ``contexts`` would reuse (the live episodes'); the others
        (finished episodes, superseded turns) are dropped and their memory freed."""
        rows = {(h.batch, h.row) for h in self.lookup(contexts) if h is not None}
        self.filter(lambda b, r: (b, r) in rows)

    def drop_superseded(self, hits: Sequence[Hit | None]) -> None:
        """Drop the rows that ``hits`` (a call's sources) reuse whole: the rows the call stores extend them.
        (A row only partly reused, a shared template prefix, may still be another episode's.)"""
        rows = {(h.batch, h.row) for h in hits
                if h is not None and h.length == len(self.batches[h.batch].tokens[h.row])}
        self.filter(lambda b, r: (b, r) not in rows)

    def filter(self, keep: Callable[[int, int], bool]) -> None:
        """Keep the rows (batch b, row r) with ``keep(b, r)``; a batch losing rows is rebuilt without them."""
        batches = []
        for b, batch in enumerate(self.batches):
            kept = [r for r in range(len(batch.tokens)) if keep(b, r)]
            if len(kept) == len(batch.tokens):
                batches.append(batch)
            elif kept:
                batches.append(batch.select(kept))
        self.batches = batches

    def add(self, layers: Layers, valid: Tensor, tokens: list[list[int]]) -> None:
        """Store the rows of one call (``layers`` are kept as they are, not copied)."""
        if tokens:
            self.batches.append(_CachedBatch(layers, valid, tokens))

    def sources(self, hits: Sequence[Hit | None]) -> tuple[Layers | None, Tensor]:
        """The cached prefixes of ``hits`` packed tight (see :func:`pack`): per layer ``(len(hits), kv_heads,
        W, head_dim)`` with W the longest hit, and their (len(hits), W) bool ``valid`` columns (CPU); (None,
        an empty ``valid``) when no hit has a token. The tensors are new: the rows they came from may be
        dropped at once (:meth:`drop_superseded`)."""
        width = max((h.length for h in hits if h is not None), default=0)
        valid = torch.zeros((len(hits), width), dtype=torch.bool)
        if width == 0:
            return None, valid
        out: Layers | None = None
        for b, batch in enumerate(self.batches):
            at = [j for j, h in enumerate(hits) if h is not None and h.batch == b]
            if not at:
                continue
            packed, packed_valid = pack(batch.layers, batch.valid, [hits[j].row for j in at],
                                        [hits[j].length for j in at], width)
            if len(at) == len(hits):  # every prefix from this batch (the usual turn): already in place
                return packed, packed_valid
            if out is None:
                out = [(k.new_zeros((len(hits), *k.shape[1:])), v.new_zeros((len(hits), *v.shape[1:])))
                       for k, v in packed]
            where = torch.tensor(at, dtype=torch.long, device=packed[0][0].device)
            for (ok, ov), (k, v) in zip(out, packed):
                ok.index_copy_(0, where, k)
                ov.index_copy_(0, where, v)
            del packed
            valid[at] = packed_valid
        return out, valid


def is_tight(valid: Tensor, counts: Sequence[int]) -> bool:
    """Whether ``valid`` (R, C) is already the layout :func:`pack` would build for ``rows = range(R)`` and
    ``counts``: C the largest count and row j's ``counts[j]`` columns right-aligned, nothing else."""
    width = max(counts, default=0)
    if valid.shape != (len(counts), width):
        return False
    expected = torch.arange(width)[None, :] >= width - torch.tensor(list(counts), dtype=torch.long)[:, None]
    return bool(torch.equal(valid.cpu(), expected))


def pack(layers: Layers, valid: Tensor, rows: Sequence[int], counts: Sequence[int],
         width: int | None = None) -> tuple[Layers, Tensor]:
    """Rows ``rows`` of ``layers`` with only their first ``counts[j]`` valid columns, right-aligned.

    Args:
        layers: per layer (keys, values), each (R, kv_heads, C, head_dim).
        valid: (R, C) bool: the columns holding each row's tokens, in order.
        rows: the source row of each output row (a row may repeat: the G copies of a shared prefill).
        counts: how many leading valid columns each output row takes (at most its valid count).
        width: output columns (default: the largest count).

    Returns:
        Per layer (len(rows), kv_heads, width, head_dim) (new tensors) with zeros left of each row's columns,
        and the (len(rows), width) bool ``valid`` columns of the result (CPU).

    Raises:
        RuntimeError: a row has fewer valid columns than asked (a bug of the caller, never silently reused).
    """
    width = max(counts, default=0) if width is None else width
    index = torch.zeros((len(rows), width), dtype=torch.long)
    out_valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for j, (r, c) in enumerate(zip(rows, counts)):
        if c:
            cols = valid[r].nonzero().squeeze(-1)[:c]
            if cols.numel() != c:
                raise RuntimeError(f"cached row {r} holds {cols.numel()} tokens, {c} asked")
            index[j, width - c:] = cols
            out_valid[j, width - c:] = True
    device = layers[0][0].device
    row_index = torch.tensor(list(rows), dtype=torch.long, device=device)[:, None]
    col_index, hole = index.to(device), ~out_valid.to(device)[:, None, :, None]
    out = []
    for k, v in layers:
        # advanced indices around a slice: (rows, width, heads, dim) -> (rows, heads, width, dim)
        k2 = k[row_index, :, col_index].transpose(1, 2).masked_fill(hole, 0).contiguous()
        v2 = v[row_index, :, col_index].transpose(1, 2).masked_fill(hole, 0).contiguous()
        out.append((k2, v2))
    return out, out_valid


def cache_layers(cache: Any) -> Layers:
    """The (keys, values) of every layer of a transformers ``DynamicCache``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def dynamic_cache(config: Any, layers: Layers | None) -> Any:
    """A transformers ``DynamicCache`` for ``config`` holding ``layers`` themselves, not a copy.

    ``DynamicCache(layers, config=config)`` would fill each layer through ``update``, a ``torch.cat`` onto an
    empty tensor: a second copy of every tensor while the first is alive. Here each ``DynamicLayer`` is
    initialised with ``lazy_initialization`` (its device and dtype, transformers 5.19 and 5.24 alike) and
    given the tensors as its ``keys`` and ``values``; the caller must not write to them afterwards.

    Raises:
        ReuseMismatch: the config's cache has another number of layers than ``layers``.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if layers:
        if len(cache.layers) != len(layers):
            raise ReuseMismatch(f"the model's cache has {len(cache.layers)} layers, {len(layers)} given")
        for layer, (keys, values) in zip(cache.layers, layers):
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
    return cache


class ReuseMismatch(RuntimeError):
    """transformers laid the cache out otherwise than this module expects: the call is redone without reuse."""


def weights_stamp(model: Any) -> tuple[Any, ...]:
    """A best-effort fingerprint of the weights: each parameter's storage and autograd version counter
    (``(data_ptr, _version)``, in ``model.parameters()`` order), then each peft adapter layer's state, as
    :func:`~lopd_lightning.adapters.tuner_states` reads it (active adapters, disabled flag, scaling, merged
    adapters; one call for the whole model).

    It sees in-place updates through the parameter itself (``p.add_(...)``, ``p.copy_(...)`` under
    ``no_grad``, ``load_state_dict``), a move (``.to()`` changes the storage), a parameter added or replaced
    by another tensor (unless that one took the freed memory of the old), and a switch, disabling, rescaling
    or merge of a peft adapter. It does NOT see writes through ``p.data`` (``p.data += ...``,
    ``p.data.copy_``), which bypass the counter, nor every optimiser:
    fused/foreach AdamW kernels may update without bumping it. The guarantee is the session's scope (nothing
    is kept beyond one :func:`~lopd_lightning.rollout.generate_rollouts` call) plus ``sync_weights``; this
    stamp only catches some changes made inside it. Compare stamps with ``==`` (they are not hashable:
    they hold lists and dicts). Cost: one pass over the parameters and one over the modules, per
    ``generate`` call of a session.
    """
    from lopd_lightning.adapters import tuner_states  # lazy: peft is imported only when a stamp is taken

    params = tuple((p.data_ptr(), int(getattr(p, "_version", 0))) for p in model.parameters())
    return params + tuple(tuner_states(model.modules()))


def unsupported(model: Any) -> str | None:
    """Why prefix reuse cannot run on ``model`` (None: it can): it needs a decoder-only transformers model
    whose ``DynamicCache`` has only full-attention ``DynamicLayer`` layers (no sliding window, linear
    attention or indexer layers, which cannot be packed column by column), no ``cache_implementation`` of
    its own, and a forward that takes ``position_ids`` and the cache (``cache`` or ``past_key_values``)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return "not a decoder-only transformers model"
    implementation = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    if implementation is not None:
        return f"generation_config.cache_implementation is {implementation!r}"
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        layers = DynamicCache(config=config).layers
    except Exception as err:  # noqa: BLE001 (any failure here only means: no reuse)
        return f"its DynamicCache cannot be built ({err})"
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if not layers or kinds:
        return f"its cache has layers other than full-attention DynamicLayer ({', '.join(kinds) or 'none'})"
    if cache_keyword(model) is None:
        return "its forward takes neither `cache` nor `past_key_values` with `position_ids`"
    return None


def _forward_parameters(model: Any) -> set[str]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model's own model
    return set(inspect.signature(base.forward).parameters)


def cache_keyword(model: Any) -> str | None:
    """The cache's keyword of ``model``'s forward and ``generate``: ``cache`` (transformers >= 5.2x) or
    ``past_key_values`` (5.19); None when the forward takes neither, or no ``position_ids``."""
    params = _forward_parameters(model)
    if "position_ids" not in params:
        return None
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def prefill(model: Any, sources: Layers | None, valid: Tensor, suffixes: list[list[int]],
            pad_id: int) -> tuple[Layers, Tensor]:
    """One forward pass that appends ``suffixes[j]`` to the cached prefix ``sources`` row j.

    Args:
        model: the causal LM (eval mode, under ``torch.no_grad``).
        sources: per layer (J, kv_heads, W, head_dim) packed prefixes (:meth:`PrefixStore.sources`), or None.
            CONSUMED: the list is emptied once the cache holds its tensors, so that each layer's prefix is
            freed as soon as the forward pass has appended to it (when the caller holds no other reference).
        valid: (J, W) bool, their valid columns.
        suffixes: J token lists (may be empty), left padded into S new columns after the W cached ones.

    Returns:
        Per layer (J, kv_heads, W + S, head_dim) and the (J, W + S) bool valid columns (CPU): row j's
        prefix, then a hole where its suffix is shorter than S, then its suffix. The position ids are passed
        explicitly, ``cumsum(mask) - 1`` (a model's default would count the holes), and the 2-D mask with
        holes is what transformers' ``create_causal_mask`` combines with causality column by column.

    Raises:
        ReuseMismatch: the cache came back with another shape.
    """
    width, new = valid.shape[1], max((len(s) for s in suffixes), default=0)
    if new == 0:
        return sources or [], valid
    ids = torch.full((len(suffixes), new), pad_id, dtype=torch.long)
    new_mask = torch.zeros((len(suffixes), new), dtype=torch.long)
    for j, s in enumerate(suffixes):
        if s:
            ids[j, new - len(s):] = torch.tensor(s, dtype=torch.long)
            new_mask[j, new - len(s):] = 1
    mask = torch.cat([valid.long(), new_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, width:]
    cache = dynamic_cache(model.config, sources)
    if sources is not None:
        sources.clear()  # the cache holds them now; each is freed once its layer's update replaced it
    device = next(model.parameters()).device
    extra = {"logits_to_keep": 1} if "logits_to_keep" in _forward_parameters(model) else {}
    model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
          use_cache=True, **{cache_keyword(model): cache}, **extra)
    layers = cache_layers(cache)
    if any(k.shape[0] != len(suffixes) or k.shape[2] != width + new for k, _ in layers):
        raise ReuseMismatch(f"prefill cache has shape {tuple(layers[0][0].shape)}, expected columns {width + new}")
    return layers, mask.bool()
