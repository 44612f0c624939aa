"""Generation behind one interface: a :class:`GenerationBackend` turns token-id prompts into sampled replies.

The episode loop (:func:`~lopd_lightning.rollout.generate_rollouts`) owns everything about the task: chat
templates, turns, observations, truncation and rewards. Each turn it hands the backend the token ids of
the live contexts, one :class:`SamplingSettings` for the whole call and one seed per context, and gets
one :class:`Completion` per context back. :class:`HFGenerateBackend` (transformers' ``model.generate`` on
the live student, reusing the keys/values of prefixes it computed earlier in the session:
:mod:`~lopd_lightning.rollout.kv_reuse`) is the first implementation; a vLLM backend implements the same
two methods with ``LLM.generate([TokensPrompt(prompt_token_ids=ids), ...], [SamplingParams(seed=s,
temperature=..., top_k=..., top_p=..., max_tokens=..., stop=..., logprobs=0), ...])`` and ``sync_weights``
loading the student's weights into the engine, as TRL's and verl's rollout workers do.

The contract (what every backend guarantees; tests/test_rollout.py checks it for the HF backend and
drives the loop with a scripted one):

1. Prompts untouched. ``prompts[i]`` is the whole context (template, earlier replies, observations,
   next generation prompt); the backend adds no BOS, template or special token, never re-tokenizes,
   and continues right after the last id. Completions come back in the order of ``prompts``.
2. Distribution. Each token is drawn from ``softmax(top_p(top_k(z / temperature)))``, ``z`` the model's
   logits in float32: top-k keeps the k largest, then top-p keeps the smallest most-likely prefix whose
   mass reaches ``top_p`` (transformers' ``TopPLogitsWarper`` rule); ``None`` turns either off. No other
   processing (no repetition penalty, min-p, bad words). ``greedy=True`` takes ``argmax z`` instead.
3. Reproducibility. ``seeds[i]`` alone fixes the random stream of prompt i: the same prompt, settings,
   seed, weights, software and device give the same completion, whatever else is in the call and in
   which order. The global torch RNG is neither used nor reseeded. (The loop derives one seed per
   rollout and turn with :func:`~lopd_lightning.rollout.sampling.derive_seed`.)
4. Log-probs. ``Completion.logps[j] = log_softmax(z_j / temperature)[token_ids[j]]`` in float32: at the
   sampling temperature, BEFORE top-k/top-p filtering (also when greedy), for every returned token
   (an engine that reports log-probs of other logits, raw or filtered, must convert or recompute).
   They become :attr:`RolloutBatch.sampling_logps`, a record of the behaviour policy. (The vLLM
   backend deviates, as its engine reports them: after top-k/top-p, renormalised, and at temperature 1
   for greedy requests; see :mod:`lopd_lightning.rollout.vllm_backend`. No loss reads them.) The "old
   log-probs" of the PPO ratio (docs/METHOD.md section 6) are NOT these: the trainer recomputes them
   with its own forward pass of the student, so the backend's numerics (kernels, precision, weight-sync
   lag) never enter a loss.
5. Ends. ``token_ids`` stop at the first of: an EOS token (any id of
   :func:`~lopd_lightning.rollout.chat.eos_token_ids`, included as sampled; ``finish_reason="eos"``; the
   episode loop puts the template's own end-of-turn token in the place of another id), the token whose
   decoded text completes one of ``settings.stop_strings`` (included, no EOS after it; ``"stop_string"``),
   or ``max_new_tokens`` tokens (``"length"``). Nothing follows the end.
6. Weights. ``generate`` samples from the weights of the last ``sync_weights(model)`` call (the HF
   backend samples from the live model, so its ``sync_weights`` only drops the key/value cache of an
   open session). ``generate_rollouts`` never syncs: whoever owns the training loop calls
   ``sync_weights`` after each optimizer step, before the next rollouts.
7. Sessions. ``generate_rollouts`` opens ``backend.session()`` (a :class:`GenerationSession`) around its
   turns, calls ``retain(contexts)`` with the live contexts before each turn, and closes it when it
   returns or raises. A backend may keep state between the ``generate`` calls of a session, never
   beyond it, and its completions are the same inside a session as outside (up to floating-point
   differences): a session only saves work. The default session keeps nothing; the HF backend's keeps
   the key/value cache of the contexts so far (prefix reuse: :class:`HFGenerateBackend`).
"""

from __future__ import annotations

import abc
import contextlib
import copy
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

import torch
from torch import Tensor

from lopd_lightning.rollout.chat import _eos, eos_token_ids
from lopd_lightning.rollout.kv_reuse import (
    Hit,
    Layers,
    PrefixStore,
    ReuseMismatch,
    cache_keyword,
    cache_layers,
    dynamic_cache,
    is_tight,
    pack,
    prefill,
    unsupported,
    weights_stamp,
)
from lopd_lightning.rollout.sampling import _SeededSampler
from lopd_lightning.sharding import generate_options

log = logging.getLogger(__package__)  # "lopd_lightning.rollout": one logger name for the whole package

__all__ = [
    "Completion", "FinishReason", "GenerationBackend", "GenerationSession", "HFGenerateBackend", "SamplingSettings",
]

#: why a reply ended: an EOS token, a stop string, or ``max_new_tokens``.
FinishReason = Literal["eos", "stop_string", "length"]
_FINISH_REASONS = ("eos", "stop_string", "length")


@dataclass(frozen=True)
class SamplingSettings:
    """How every reply of one :func:`~lopd_lightning.rollout.generate_rollouts` call is sampled.

    Attributes:
        temperature: > 0; logits are divided by it (also for the log-probs when ``greedy``).
        top_k: keep the k most likely tokens; None = off (0 is stored as None).
        top_p: nucleus mass in (0, 1]; None = off (1 is stored as None).
        max_new_tokens: >= 1, the most tokens of one reply.
        greedy: take the argmax instead of sampling (evaluation).
        stop_strings: strings that end a reply (kept in it, no EOS after); a list is stored as a tuple.

    Raises:
        ValueError: a value outside its range.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int = 256
    greedy: bool = False
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (use greedy=True for argmax)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "top_k", self.top_k or None)
        object.__setattr__(self, "top_p", None if self.top_p is None or self.top_p >= 1.0 else self.top_p)
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings or ()))


@dataclass(frozen=True)
class Completion:
    """One reply of a backend to one prompt (see the module's contract).

    Attributes:
        token_ids: the new tokens, the EOS or the stop string's last token included.
        logps: per token, ``log_softmax(logits / temperature)`` at it (float, before top-k/top-p).
        finish_reason: ``"eos"``, ``"stop_string"`` or ``"length"``.

    Raises:
        ValueError: ``token_ids`` and ``logps`` differ in length, or an unknown finish reason.
    """

    token_ids: list[int]
    logps: list[float]
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logps):
            raise ValueError(f"Completion: {len(self.token_ids)} token ids but {len(self.logps)} log-probs")
        if self.finish_reason not in _FINISH_REASONS:
            raise ValueError(f"Completion.finish_reason must be one of {_FINISH_REASONS}, got {self.finish_reason!r}")


class GenerationBackend(abc.ABC):
    """What the episode loop needs from a generator: sample replies, and take new weights.

    Subclass it to plug in another engine (vLLM, a server); see the module's contract for what
    :meth:`generate` must guarantee.
    """

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], settings: SamplingSettings,
                 seeds: Sequence[int]) -> list[Completion]:
        """One reply per prompt, in order.

        Args:
            prompts: N token-id sequences (whole contexts, unpadded, possibly of different lengths).
            settings: the sampling distribution and limits, the same for all prompts.
            seeds: N seeds; ``seeds[i]`` alone fixes prompt i's random stream.

        Returns:
            N :class:`Completion`.
        """

    #: whether :meth:`sync_weights` copies weights into an engine of its own (timed as ``time/weight_sync``);
    #: False for a backend that samples from the live model.
    copies_weights: bool = True

    @abc.abstractmethod
    def sync_weights(self, model: Any) -> None:
        """Sample from ``model``'s current weights from now on (the trainer calls it after each update)."""

    def session(self) -> GenerationSession:
        """The scope of one episode loop: :func:`~lopd_lightning.rollout.generate_rollouts` opens it around
        its turns (``with backend.session() as s``) and calls ``s.retain(contexts)`` before each turn. A
        backend may keep state between the ``generate`` calls of a session (the HF backend: the key/value
        cache of the contexts so far), never beyond it. The default keeps nothing."""
        return GenerationSession()


class GenerationSession:
    """What a backend keeps between the ``generate`` calls of one episode loop (this base: nothing).

    ``generate`` must give the same completions inside a session as outside it (up to floating-point
    differences); a session only saves work.
    """

    def retain(self, contexts: Sequence[Sequence[int]]) -> None:
        """The contexts the next turn continues (the live episodes'); state kept for others may be dropped."""

    def close(self) -> None:
        """End the session: drop what it kept."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HFGenerateBackend(GenerationBackend):
    """Generation with transformers' ``model.generate`` on the live model (batched, left padded, KV cache).

    ``generate`` runs greedy search while a logits processor (:class:`~lopd_lightning.rollout.sampling.
    _SeededSampler`, last in the list) draws each row's token with that row's ``torch.Generator`` and
    records its log-prob, so no (B, S, V) ``output_logits`` are kept. The model is put in eval mode for
    the call (its mode is restored) and its generation config is copied, never changed; the config's
    processors that would alter the distribution (repetition penalty, ...) are reset.

    Prefix reuse (``reuse_prefixes``, on by default; :mod:`~lopd_lightning.rollout.kv_reuse`): a call
    looks up, for each prompt, the longest prefix whose keys and values this session already holds;
    identical (cached prefix, prompt) pairs (the G rollouts of a task at their first turn) become one job;
    one forward pass appends each job's uncached tokens but the last to its cached prefix, and the result
    is gathered into G rows. ``model.generate`` then gets the left-padded prompts as always, with a
    ``DynamicCache`` (per layer (B, kv_heads, L - 1, head_dim), L the longest prompt) holding every prompt
    but its last token, right-aligned: it computes that token alone, with the position ids it derives from
    the attention mask (``cumsum - 1``, the tokens' true positions), and decodes as before. So each turn of
    an episode reads only its new tokens (the previous reply's last token, which was never fed back, the
    observation and the next generation prompt), and a group's prompt is read once, not G times. A call
    with nothing to reuse or share (a first turn with G = 1) runs the reference computation, ``generate``
    prefilling the whole prompts, into an empty ``DynamicCache`` that a session then keeps.

    What is cached and when it is dropped: after a call made inside a :meth:`session`, each row's prompt
    and the reply tokens ``generate`` fed back, in the session's :class:`~lopd_lightning.rollout.kv_reuse.
    PrefixStore` (per layer (B, kv_heads, columns, head_dim), with the mask of each row's columns). The
    store exists only while a session is open: :func:`~lopd_lightning.rollout.generate_rollouts` opens one
    around its turns and closes it (dropping everything) when it returns or raises, so no cache outlives
    the call that made it, whatever is done to the weights between calls; one call samples from one set of
    weights. Inside a session it is also dropped by :meth:`sync_weights` and, best effort, whenever
    :func:`~lopd_lightning.rollout.kv_reuse.weights_stamp` changed: a parameter's storage or autograd
    version counter (``p.add_``, ``load_state_dict``, ``.to()``), or a peft adapter layer's
    state (:func:`~lopd_lightning.adapters.tuner_states`: active or disabled adapters, scaling, merged adapters).
    Writes through ``p.data`` and fused optimiser kernels may not bump the counter: the
    guarantee is the session's scope plus ``sync_weights``, not the stamp. The rows of finished episodes
    go at the next turn (``GenerationSession.retain``: only rows a live context extends are kept), and a
    turn's source rows as soon as they are copied out for its prefill; their tensors are rebuilt without
    them (``index_select``). Outside a session nothing is kept between calls (the shared prefill within a
    call still runs).

    Memory: the store holds the rows of EVERY live episode of the session, not only those of the current
    ``generate`` call: with ``generation_batch_size`` the loop calls ``generate`` in chunks, and the rows of
    the other chunks wait in the store for their next turn, so ``generation_batch_size`` bounds the
    activations of one call but not the cache held. That is about ``rows x tokens x layers x 2 x kv_heads x
    head_dim x dtype bytes`` (keys and values; rows: the live episodes, tokens: their context so far plus
    padding to their call's longest). Besides the store, a call holds about its own cache (the copied-out
    prefixes are freed layer by layer as the prefill extends them, and ``generate`` gets the prefill's
    tensors without a copy), twice that only while shared or holed rows are gathered (:func:`~lopd_lightning.
    rollout.kv_reuse.pack`).

    A prompt that extends no cached row (a new example, a truncated or rewritten context) is prefilled
    whole; a cache transformers returns in another shape than expected turns reuse off for the backend
    (warned once) and the call is redone without it (or, when ``generate`` prefilled the prompts whole, its
    completions are kept and only its rows are not stored).

    Args:
        model: a transformers causal LM (on any device).
        tokenizer: its tokenizer (EOS required; pad falls back to EOS; decodes for stop strings).
        use_cache: generate with the key-value cache (the default); False recomputes the whole context for
            every new token (benchmarks/rollouts.py measures the difference). Same tokens up to
            floating-point differences between the two computations.
        reuse_prefixes: prefix reuse (above); False prefills every context whole in every call (the
            reference path), and keeps no cache between calls. True keeps the keys/values of every live
            episode for the session (see Memory above: not bounded by ``generation_batch_size``). Needs
            ``use_cache``; a model whose cache is not made of full-attention layers (sliding window,
            linear attention: :func:`~lopd_lightning.rollout.kv_reuse.unsupported`) runs the reference
            path, said in the log (once per backend). Same tokens up to floating-point
            differences.

    Attributes:
        prefill_stats: ``prompt_tokens`` handed to ``generate`` and ``prefilled_tokens`` the model read to
            prefill them (the uncached ones; a job shared by G rows counts once), summed over calls.

    Raises:
        ValueError: the tokenizer has no EOS token.
    """

    copies_weights = False  # samples from the live model: sync_weights only drops cached keys/values

    def __init__(self, model: Any, tokenizer: Any, *, use_cache: bool = True, reuse_prefixes: bool = True):
        self.model, self.tokenizer, self.use_cache = model, tokenizer, bool(use_cache)
        self.reuse_prefixes = bool(reuse_prefixes)
        _, eos_id = _eos(tokenizer)
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
        self._config: tuple[SamplingSettings, Any] | None = None
        self._reuse: bool | None = None  # whether the model supports prefix reuse (decided on first use)
        self._store: PrefixStore | None = None  # the open session's cached rows
        self.prefill_stats = {"prompt_tokens": 0, "prefilled_tokens": 0}

    def sync_weights(self, model: Any) -> None:
        """``generate`` runs the live model itself: only the open session's cached keys/values are dropped."""
        if self._store is not None:
            self._store.clear()

    def session(self) -> GenerationSession:
        """A session whose :class:`~lopd_lightning.rollout.kv_reuse.PrefixStore` lets each turn reuse the
        keys/values of the turns before it (see the class docstring); nested sessions share the outer one's."""
        return _PrefixSession(self)

    def generate(self, prompts: Sequence[Sequence[int]], settings: SamplingSettings,
                 seeds: Sequence[int]) -> list[Completion]:
        """One ``model.generate`` call on the left-padded prompts (see :meth:`GenerationBackend.generate`),
        after the prefill of their uncached tokens when prefixes are reused (the class docstring).

        Raises:
            ValueError: ``prompts`` and ``seeds`` differ in length, or a prompt is empty (there is no last
                token to continue from; with or without prefix reuse).
            RuntimeError: another logits processor changed the sampled tokens.
        """
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        empty = [i for i, p in enumerate(prompts) if len(p) == 0]
        if empty:
            raise ValueError(f"prompts {empty} are empty: a prompt needs at least one token to continue from")
        input_ids, attention = self._left_padded(prompts)
        self.prefill_stats["prompt_tokens"] += sum(len(p) for p in prompts)
        if self._reuse_ready():
            try:
                return self._generate_reusing(prompts, settings, seeds, input_ids, attention)
            except ReuseMismatch as err:
                self._turn_reuse_off(f"{err}; the call is redone without it")
        return self._generate_whole(input_ids, attention, settings, seeds)[0]

    def _generate_whole(self, input_ids: Tensor, attention: Tensor, settings: SamplingSettings,
                        seeds: Sequence[int], cache: Any = None) -> tuple[list[Completion], int]:
        """:meth:`generate` as ``generate`` prefills the whole prompts itself (the reference path; with an
        empty ``cache``, the same computation, whose keys/values the cache then holds); also the
        sequences' length (prompt width + new tokens)."""
        sequences, sampler = self._run(input_ids, attention, settings, seeds, cache=cache)
        self.prefill_stats["prefilled_tokens"] += int(attention.sum())
        return self._completions(sequences[:, input_ids.shape[1]:].cpu(), sampler, settings), sequences.shape[1]

    def _turn_reuse_off(self, why: str) -> None:
        """Switch prefix reuse off for this backend (warned) and drop the open session's rows."""
        log.warning("HFGenerateBackend: prefix reuse turned off (%s)", why)
        self._reuse = False
        if self._store is not None:
            self._store.clear()

    def _generate_reusing(self, prompts: Sequence[Sequence[int]], settings: SamplingSettings, seeds: Sequence[int],
                          input_ids: Tensor, attention: Tensor) -> list[Completion]:
        """:meth:`generate` with prefix reuse: look up, prefill the uncached tokens once per job, generate, store."""
        from transformers import DynamicCache

        store = self._store if self._store is not None else PrefixStore()
        stamp = weights_stamp(self.model)
        if store.stamp != stamp:  # the weights changed since the rows were computed
            store.clear()
            store.stamp = stamp
        hits = store.lookup(prompts)
        jobs: dict[tuple[Hit | None, tuple[int, ...]], int] = {}
        job_of = [jobs.setdefault((hit, tuple(p)), len(jobs)) for hit, p in zip(hits, prompts)]
        cache = DynamicCache(config=self.model.config)
        if len(jobs) == len(prompts) and not any(hits):  # nothing to reuse or share: generate prefills it all
            if self._store is None:
                return self._generate_whole(input_ids, attention, settings, seeds)[0]
            completions, length = self._generate_whole(input_ids, attention, settings, seeds, cache=cache)
            try:
                self._keep_rows(store, prompts, cache, input_ids.shape[1], length, completions)
            except ReuseMismatch as err:  # the completions are the reference ones: keep them, store nothing
                self._turn_reuse_off(f"{err}; the call's rows are not stored")
            return completions
        past = self._prefill_rows(store, hits, job_of, prompts)
        cache = dynamic_cache(self.model.config, past)  # holds ``past`` itself, no copy
        del past
        sequences, sampler = self._run(input_ids, attention, settings, seeds, cache=cache)
        completions = self._completions(sequences[:, input_ids.shape[1]:].cpu(), sampler, settings)
        return self._keep_rows(store, prompts, cache, input_ids.shape[1], sequences.shape[1], completions)

    def _prefill_rows(self, store: PrefixStore, hits: list[Hit | None], job_of: list[int],
                      prompts: Sequence[Sequence[int]]) -> Layers | None:
        """Every prompt but its last token as keys/values, per layer (B, kv_heads, L - 1, head_dim) packed
        tight (L the longest prompt): each job's cached prefix, plus its uncached tokens read in one forward
        pass, copied to the job's rows. None when there is nothing to hold (every prompt one token long).

        Memory: the cached prefixes are copied out (``sources``), then the rows this call will replace are
        dropped from the store at once, and each layer's prefix is freed as the forward pass extends it; the
        result is gathered again (:func:`pack`) only when jobs are shared or its layout is not yet tight.
        """
        leaders = [job_of.index(j) for j in range(max(job_of) + 1)]  # the first row of each job
        suffixes = [list(prompts[i][hits[i].length if hits[i] else 0:-1]) for i in leaders]
        counts = [len(p) - 1 for p in prompts]
        self.prefill_stats["prefilled_tokens"] += sum(map(len, suffixes)) + len(prompts)
        with self._evaluating():
            sources, valid = store.sources([hits[i] for i in leaders])
            store.drop_superseded(hits)  # copied into ``sources``: the rows this call stores will extend them
            layers, valid = prefill(self.model, sources, valid, suffixes, self.pad_id)
            del sources
            if not layers:
                return None
            if job_of == list(range(len(prompts))) and is_tight(valid, counts):
                return layers  # one job per row, already right-aligned: no second copy
            return pack(layers, valid, job_of, counts)[0]

    def _keep_rows(self, store: PrefixStore, prompts: Sequence[Sequence[int]], cache: Any, width: int, length: int,
                   completions: list[Completion]) -> list[Completion]:
        """Check the cache ``generate`` left (per layer (B, kv_heads, ``length - 1``, head_dim): the
        ``width``-column left-padded prompts, then every new token but the last, which was never fed) and,
        in a session, store its rows: each prompt and its reply's fed tokens.

        Raises:
            ReuseMismatch: the cache has another shape (nothing is stored; after a prefill of this module the
                completions may be wrong and the call is redone without reuse).
        """
        layers = cache_layers(cache)
        columns = length - 1
        if not layers or any(k.shape[0] != len(prompts) or k.shape[2] != columns for k, _ in layers):
            shape = tuple(layers[0][0].shape) if layers else "(no layers)"
            raise ReuseMismatch(f"generate left a cache of shape {shape}, expected {len(prompts)} rows and "
                                f"{columns} columns")
        if self._store is store:  # in a session: the next turn starts from these rows
            valid = torch.zeros((len(prompts), columns), dtype=torch.bool)
            tokens = []
            for i, (prompt, completion) in enumerate(zip(prompts, completions)):
                fed = completion.token_ids[:columns - width]
                valid[i, width - len(prompt):width + len(fed)] = True
                tokens.append(list(prompt) + fed)
            store.add(layers, valid, tokens)
        return completions

    def _reuse_ready(self) -> bool:
        """Whether this call reuses prefixes: switched on, with the cache, on a model that supports it."""
        if not (self.reuse_prefixes and self.use_cache):
            return False
        if self._reuse is None:
            why = unsupported(self.model)
            if why is not None:
                log.info("HFGenerateBackend: no prefix reuse for %s: %s", type(self.model).__name__, why)
            self._reuse = why is None
        return self._reuse

    def _left_padded(self, prompts: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """(B, L) input ids (pad on the left) and attention mask of ``prompts``, L the longest, on CPU."""
        length = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), length), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), length), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, length - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            attention[i, length - len(prompt):] = 1
        return input_ids, attention

    def _run(self, input_ids: Tensor, attention: Tensor, settings: SamplingSettings, seeds: Sequence[int],
             cache: Any = None) -> tuple[Tensor, _SeededSampler]:
        """``model.generate`` with the seeded sampler (and ``cache``, the prompts' keys/values but the last
        token's): the (B, L + new) sequences and the sampler that drew the new tokens."""
        # lazy, as it always was: importing transformers is slow
        from transformers import LogitsProcessorList

        device = next(self.model.parameters()).device
        sampler = _SeededSampler(list(seeds), device=device, temperature=settings.temperature, top_k=settings.top_k,
                                 top_p=settings.top_p, greedy=settings.greedy)
        extra: dict[str, Any] = {"tokenizer": self.tokenizer} if settings.stop_strings else {}  # stop strings need it
        extra.update(generate_options(self.model))  # FSDP2: the caller gathered the weights; no per-token sync
        if cache is not None:
            extra[cache_keyword(self.model)] = cache
        with self._evaluating():
            out = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device),
                generation_config=self._generation_config(settings),
                logits_processor=LogitsProcessorList([sampler]), **extra,
            )
        return (out if isinstance(out, Tensor) else out.sequences), sampler

    @contextlib.contextmanager
    def _evaluating(self) -> Iterator[None]:
        """Eval mode (restored after) and no autograd."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def _completions(self, new: Tensor, sampler: _SeededSampler, settings: SamplingSettings) -> list[Completion]:
        """Cut each generated row (B, S) at its end and pair it with the sampler's log-probs."""
        tokens = torch.stack(sampler.tokens, dim=1).cpu()
        logps = torch.stack(sampler.logps, dim=1).float().cpu()
        if new.shape != tokens.shape:
            raise RuntimeError(f"generate returned {new.shape[1]} new tokens but sampled {tokens.shape[1]}")
        stop_strings = list(settings.stop_strings) or None
        completions = []
        for i in range(new.shape[0]):
            row = new[i].tolist()
            n, reason = _reply_length(self.tokenizer, row, set(self.eos_ids), stop_strings)
            if row[:n] != tokens[i, :n].tolist():
                raise RuntimeError(
                    "generate did not keep the sampled tokens: another logits processor runs after the sampler"
                )
            completions.append(Completion(token_ids=row[:n], logps=logps[i, :n].tolist(), finish_reason=reason))
        return completions

    def _generation_config(self, settings: SamplingSettings) -> Any:
        """A copy of ``model.generation_config`` for ``settings`` (built once per settings; the model's is kept)."""
        if self._config is None or self._config[0] != settings:
            self._config = (settings, _generation_config(
                self.model, max_new_tokens=settings.max_new_tokens, eos_ids=self.eos_ids, pad_id=self.pad_id,
                stop_strings=list(settings.stop_strings) or None, use_cache=self.use_cache,
            ))
        return self._config[1]


class _PrefixSession(GenerationSession):
    """:meth:`HFGenerateBackend.session`: the backend's :class:`PrefixStore` from ``__enter__`` to ``close``
    (a session opened inside another one keeps the outer one's store and leaves it to it)."""

    def __init__(self, backend: HFGenerateBackend):
        self.backend, self.owner = backend, False

    def __enter__(self) -> Self:
        if self.backend._store is None:
            self.backend._store, self.owner = PrefixStore(), True
        return self

    def retain(self, contexts: Sequence[Sequence[int]]) -> None:
        """Drop the cached rows no context in ``contexts`` extends (finished episodes); a no-op in a nested
        session (the store is the outer session's, whose contexts this one does not know)."""
        if self.owner and self.backend._store is not None:
            self.backend._store.retain(contexts)

    def close(self) -> None:
        """Drop the store (when this session made it)."""
        if self.owner:
            self.backend._store, self.owner = None, False


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
    """A copy of ``model.generation_config`` for :class:`HFGenerateBackend` (the model's is never changed)."""
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
