"""The episode loop: rollouts of the student in a task, turn by turn, on top of a generation backend.

:func:`generate_rollouts` starts ``group_size`` episodes per example (rows ``[ex0 s0, ex0 s1, ..., ex1 s0,
...]``, group id = the example's index in ``examples``; GRPO's G, docs/METHOD.md section 6). All live
episodes advance together, one turn at a time:

1. start: ``task.start(example)`` makes each episode; its prompt is encoded (:func:`encode_prompt`).
2. turn: the contexts of the live episodes go to the backend (:class:`GenerationBackend`, in chunks of
   ``generation_batch_size``) with one seed per rollout and turn (:func:`derive_seed`: seed, step,
   example id, sample index, turn; the sample index counts the example's rollouts in this call, so an
   example listed twice gets sample indices 0..2G-1). The whole loop runs inside one
   ``backend.session()``, told the live contexts before each turn (``retain``): the HF backend keeps the
   keys/values of each context there and reads only a turn's new tokens, and drops everything when the
   call ends (:class:`HFGenerateBackend`).
3. advance: each reply is appended (assistant mask 1, its log-probs; a reply ended on another EOS id of the
   generation config gets the template's end-of-turn token there, mask 0), decoded and fed to
   ``episode.step``; the observation follows (:func:`encode_observation`, mask 0). Lone UTF-16 surrogates
   in the reply, the observation and the step's info (model-written text that is not Unicode) become
   U+FFFD first, so a bad reply ends in a reward, never in an exception. An episode finishes
   when it says ``done``, after ``max_turns`` replies (``truncation="max_turns"``), or before a turn
   when its context is longer than ``max_prompt_tokens`` or ``context + max_new_tokens`` exceeds the
   model's ``max_position_embeddings`` (``truncation="context"``).
4. score: the reward of every episode, read through :func:`lopd_lightning.tasks.episode_reward`.
5. assemble: the right-padded :class:`RolloutBatch`.

Reproducibility: the same arguments, weights, software and device give identical batches. The random
numbers a rollout consumes depend only on its seed coordinates, not on the other examples, their order
or ``generation_batch_size``; its tokens are therefore independent of batch composition up to
floating-point differences of the logits between batch shapes (padding, batch size), which can flip a
sample only at near-ties.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lopd_lightning.rollout.backends import (
    Completion,
    GenerationBackend,
    GenerationSession,
    HFGenerateBackend,
    SamplingSettings,
)
from lopd_lightning.rollout.batch import RolloutBatch, RolloutStats, _token_tensors
from lopd_lightning.rollout.chat import _eos, _pad_token_id, encode_observation, encode_prompt
from lopd_lightning.rollout.sampling import derive_seed
from lopd_lightning.tasks.base import (
    Episode,
    Example,
    Message,
    Task,
    episode_reward,
    turn_limit,
)
from lopd_lightning.text import encodable, has_lone_surrogate

log = logging.getLogger(__package__)  # "lopd_lightning.rollout": one logger name for the whole package

__all__ = ["generate_rollouts", "warn_turn_limit"]


@dataclass
class _Rollout:
    """One episode in progress: its token ids, masks and log-probs so far, and how it went."""

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
    group_size: int = 1,
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
    reuse_prefixes: bool = True,
    backend: GenerationBackend | None = None,
) -> RolloutBatch:
    """Sample ``group_size`` rollouts per example of the student in ``task`` (the module's steps 1-5).

    Sampling and ``sampling_logps`` follow the backend contract (:mod:`lopd_lightning.rollout.backends`).

    Args:
        model: the student, a transformers causal LM (eval mode while it generates, its mode restored);
            with ``backend`` given, only its ``config.max_position_embeddings`` is read (None: no limit).
        tokenizer: its tokenizer (chat template, EOS; pad falls back to EOS).
        task: the task; ``task.start(example)`` makes each episode.
        examples: the examples to roll out.
        group_size: G rollouts per example.
        temperature: > 0; the sampling temperature. top_p: nucleus mass in (0, 1], None or 1 = off.
        top_k: top-k, None or 0 = off. max_new_tokens: limit per turn.
        max_turns: replies per episode; None = ``task.max_turns`` if the task has it, else 8 for
            multi-turn tasks and 1 otherwise. Episodes cut there before they said ``done`` are recorded
            with ``truncation="max_turns"``, and :func:`warn_turn_limit` warns once per task.
        max_prompt_tokens: longest context sent to the backend (None = only the model's limit).
        seed, step: seed coordinates (the trainer passes the global step).
        greedy: argmax decoding (evaluation).
        stop_strings: extra strings that end a reply; the reply keeps the stop string and has no EOS,
            so the template's EOS follows it with mask 0.
        generation_batch_size: most rows per backend call (None = all active rows; else the longest
            contexts go first, for less padding). It bounds one call's activations, not the key/value cache
            of prefix reuse: the HF backend's session keeps the rows of every live episode across chunks,
            about ``rows x tokens x layers x 2 x kv_heads x head_dim x dtype bytes``.
        use_cache: the default backend's key-value cache (:class:`HFGenerateBackend`); ignored with ``backend``.
        reuse_prefixes: the default backend's prefix reuse (keys/values kept across the turns of this call and
            one prefill per group; False: every context prefilled whole every turn); ignored with ``backend``.
            While this call runs it holds the keys/values of every live episode (all chunks of
            ``generation_batch_size``): ``rows x tokens x layers x 2 x kv_heads x head_dim x dtype bytes``.
        backend: the generator (None: ``HFGenerateBackend(model, tokenizer, use_cache=use_cache,
            reuse_prefixes=reuse_prefixes)``). Its :meth:`~GenerationBackend.session` is open while the
            episodes play (whatever it keeps between turns is dropped when this call returns or raises).

    Returns:
        A right-padded :class:`RolloutBatch` on CPU with ``stats``; the same arguments, weights, software
        and device give identical batches.

    Raises:
        ValueError: bad sampling arguments, or a reward outside [0, 1] (naming task and example).
        ChatTemplateError: the chat template is not prefix-consistent (multi-turn).
        RuntimeError: an episode's ``step`` raised (chained, naming task and example), or the backend
            returned another number of completions than prompts.
    """
    t_start = time.perf_counter()
    settings = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
                                greedy=greedy, stop_strings=tuple(stop_strings or ()))
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if generation_batch_size is not None and generation_batch_size < 1:
        raise ValueError(f"generation_batch_size must be >= 1, got {generation_batch_size}")
    max_turns, limit_source = turn_limit(task, max_turns, given_by="the max_turns argument (model.init_args.max_turns)")
    if backend is None:
        backend = HFGenerateBackend(model, tokenizer, use_cache=use_cache, reuse_prefixes=reuse_prefixes)
    loop = _EpisodeLoop(
        backend=backend, tokenizer=tokenizer, task=task, settings=settings, seed=seed, step=step, max_turns=max_turns,
        max_prompt_tokens=max_prompt_tokens, generation_batch_size=generation_batch_size,
        max_positions=getattr(getattr(model, "config", None), "max_position_embeddings", None),
    )
    # what the backend keeps between turns lives only in this call (a backend without ``session``, one that
    # does not subclass GenerationBackend, keeps nothing)
    with backend.session() if hasattr(backend, "session") else GenerationSession() as session:
        loop.start(examples, group_size)
        while active := loop.active():
            session.retain([r.ids for r in active])  # finished episodes' cached rows can go
            loop.play_turn(active)
    warn_turn_limit(task, loop.rollouts, max_turns, limit_source)
    return loop.finish(t_start)


@dataclass
class _EpisodeLoop:
    """The state of one :func:`generate_rollouts` call: its settings, the rollouts and the timing."""

    backend: GenerationBackend
    tokenizer: Any
    task: Task
    settings: SamplingSettings
    seed: int
    step: int
    max_turns: int
    max_prompt_tokens: int | None
    generation_batch_size: int | None
    max_positions: int | None
    rollouts: list[_Rollout] = field(default_factory=list)
    stats: RolloutStats = field(default_factory=RolloutStats)

    def start(self, examples: Sequence[Example], group_size: int) -> None:
        """Step 1: ``group_size`` episodes per example, each with its encoded prompt (mask 0)."""
        seen: dict[str, int] = {}
        for ex_index, example in enumerate(examples):
            base = seen.get(example.id, 0)
            seen[example.id] = base + group_size
            for k in range(group_size):
                t0 = time.perf_counter()
                episode = self.task.start(example)
                self.stats.env_seconds += time.perf_counter() - t0
                t0 = time.perf_counter()
                messages = [dict(m) for m in self.task.initial_messages(example)]
                tools = self.task.tools(example)
                prompt = encode_prompt(self.tokenizer, messages, tools=tools)
                self.stats.tokenize_seconds += time.perf_counter() - t0
                n = len(prompt.input_ids)
                self.rollouts.append(_Rollout(
                    example=example, example_index=ex_index, sample_index=base + k, episode=episode, tools=tools,
                    messages=messages, ids=list(prompt.input_ids), mask=[0] * n, logps=[0.0] * n,
                    context_position=prompt.context_position, rendered=prompt.text,
                ))

    def active(self) -> list[_Rollout]:
        """The rollouts that get another turn; a context too long for one finishes ("context")."""
        out = []
        for r in self.rollouts:
            if r.finished:
                continue
            too_long = (self.max_prompt_tokens is not None and len(r.ids) > self.max_prompt_tokens) or (
                self.max_positions is not None and len(r.ids) + self.settings.max_new_tokens > self.max_positions
            )
            if too_long:
                r.truncation, r.finished = "context", True
            else:
                out.append(r)
        return out

    def play_turn(self, active: list[_Rollout]) -> None:
        """Step 2: one reply for every active rollout, chunk by chunk, each chunk advanced when it returns."""
        order, size = active, self.generation_batch_size or len(active)
        if self.generation_batch_size is not None:  # similar lengths together: less padding
            order = sorted(active, key=lambda r: -len(r.ids))
        for start in range(0, len(order), size):
            chunk = order[start:start + size]
            seeds = [derive_seed(self.seed, self.step, r.example.id, r.sample_index, r.turns) for r in chunk]
            t0 = time.perf_counter()
            completions = self.backend.generate([r.ids for r in chunk], self.settings, seeds)
            self.stats.generate_seconds += time.perf_counter() - t0
            self.stats.generate_calls += 1
            if len(completions) != len(chunk):
                raise RuntimeError(
                    f"{type(self.backend).__name__}.generate returned {len(completions)} completions "
                    f"for {len(chunk)} prompts"
                )
            for r, completion in zip(chunk, completions):
                self.advance(r, completion)

    def advance(self, r: _Rollout, completion: Completion) -> None:
        """Step 3: append the reply, step the episode, append its observation; finish the rollout if over."""
        t0 = time.perf_counter()
        self.append_reply(r, completion)
        r.turns += 1
        r.reply_tokens.append(len(completion.token_ids))
        r.stop_reasons.append(completion.finish_reason)
        ended_by_eos = completion.finish_reason == "eos" and bool(completion.token_ids)
        body = completion.token_ids[:-1] if ended_by_eos else completion.token_ids
        text = self.encodable(r, "reply", self.tokenizer.decode(body, skip_special_tokens=True,
                                                                clean_up_tokenization_spaces=False))
        r.messages.append({"role": "assistant", "content": text})
        self.stats.tokenize_seconds += time.perf_counter() - t0

        t0 = time.perf_counter()
        try:
            result = r.episode.step(text)
        except Exception as err:
            raise RuntimeError(
                f"task {self.task.name!r}: episode.step failed for example {r.example.id!r}: {err}"
            ) from err
        self.stats.env_seconds += time.perf_counter() - t0
        r.info = self.encodable(r, "info", dict(result.info))
        if r.info.get("error"):
            r.errors.append(str(r.info["error"]))
        r.done = bool(result.done)
        if not r.done and r.turns >= self.max_turns:
            r.truncation = "max_turns"
        r.finished = r.done or r.truncation is not None
        if result.messages or not r.finished:
            # observation tokens (or, with none, the template text up to the next generation prompt)
            t0 = time.perf_counter()
            r.messages.extend(self.encodable(r, "observation", dict(m)) for m in result.messages)
            obs_ids, r.rendered = encode_observation(
                self.tokenizer, r.messages, rendered_before_reply=r.rendered, reply=text,
                reply_has_eos=ended_by_eos, tools=r.tools,
            )
            r.ids += obs_ids
            r.mask += [0] * len(obs_ids)
            r.logps += [0.0] * len(obs_ids)
            self.stats.tokenize_seconds += time.perf_counter() - t0

    def append_reply(self, r: _Rollout, completion: Completion) -> None:
        """The reply's tokens (mask 1, their log-probs), its end as the template writes it.

        A reply that ends on an EOS id other than the tokenizer's (a second id of ``generation_config.
        eos_token_id``: Qwen3's ``<|endoftext|>``, Llama 3's ``<|eom_id|>``) gets the template's own
        end-of-turn token in that id's place, as context (mask 0, log-prob 0): every later turn then reads
        exactly the template's rendering, and the ids equal those of
        :func:`~lopd_lightning.rollout.chat.tokenize_conversation`. The sampled id is not trained on: the
        sequence cannot hold it and the template's token at once, and the template's token is not what the
        policy sampled (``stats.secondary_eos`` counts these replies; warned once).
        """
        ids, logps, mask = list(completion.token_ids), list(completion.logps), [1] * len(completion.token_ids)
        eos_id = _eos(self.tokenizer)[1]
        if completion.finish_reason == "eos" and ids and ids[-1] != eos_id:
            self.stats.secondary_eos += 1
            if not _WARNED["secondary_eos"]:
                _WARNED["secondary_eos"] = True
                log.warning(
                    "a reply of task %r ended on EOS id %d of the generation config, not on the template's "
                    "end-of-turn token %d: the template's token takes its place as context (mask 0), so the next "
                    "turn reads the template's rendering (RolloutStats.secondary_eos counts them; warned once)",
                    self.task.name, ids[-1], eos_id,
                )
            ids[-1], logps[-1], mask[-1] = eos_id, 0.0, 0
        r.ids += ids
        r.mask += mask
        r.logps += logps

    def encodable(self, r: _Rollout, what: str, value: Any) -> Any:
        """``value`` (a reply, an observation message, an info dict) with every lone UTF-16 surrogate in its
        strings replaced by U+FFFD (:func:`~lopd_lightning.text.encodable`; model-written text that reached
        a parser as a JSON escape), so that no tokenizer, JSON writer or log raises on it later. Counted in
        ``stats.lone_surrogates``, warned once."""
        clean, changed = _encodable(value)
        if changed:
            self.stats.lone_surrogates += 1
            if not _WARNED["lone_surrogates"]:
                _WARNED["lone_surrogates"] = True
                log.warning(
                    "task %r, example %r: the %s held lone UTF-16 surrogates (invalid Unicode, written by the "
                    "model); they were replaced with U+FFFD (RolloutStats.lone_surrogates counts them; warned once)",
                    self.task.name, r.example.id, what,
                )
        return clean

    def finish(self, t_start: float) -> RolloutBatch:
        """Steps 4 and 5: score every episode (:func:`episode_reward`) and assemble the batch."""
        rewards = []
        for r in self.rollouts:
            t0 = time.perf_counter()
            rewards.append(episode_reward(self.task, r.example, r.episode))
            self.stats.env_seconds += time.perf_counter() - t0
        rollouts = self.rollouts
        pad_id = _pad_token_id(self.tokenizer)
        batch = RolloutBatch(
            **_token_tensors([r.ids for r in rollouts], [r.mask for r in rollouts], [r.logps for r in rollouts],
                             pad_id),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            group_ids=torch.tensor([r.example_index for r in rollouts], dtype=torch.long),
            context_position=torch.tensor([r.context_position for r in rollouts], dtype=torch.long),
            example_ids=[r.example.id for r in rollouts],
            messages=[r.messages for r in rollouts],
            metadata=[_metadata(r) for r in rollouts],
            stats=self.stats,
            pad_token_id=pad_id,
        )
        self.stats.generated_tokens = batch.num_assistant_tokens()
        self.stats.rollouts = len(batch)
        self.stats.total_seconds = time.perf_counter() - t_start
        return batch


#: which one-time warnings of the episode loop were given (once per process).
_WARNED = {"secondary_eos": False, "lone_surrogates": False}


def _encodable(value: Any) -> tuple[Any, bool]:
    """``value`` with :func:`~lopd_lightning.text.encodable` applied to every string in it (dict keys and
    values, list and tuple items, nested; other objects as they are), and whether anything changed (then
    the containers on the way are new ones; else ``value`` itself comes back)."""
    if isinstance(value, str):
        return (encodable(value), True) if has_lone_surrogate(value) else (value, False)
    if type(value) is dict:
        pairs = [(_encodable(k), _encodable(v)) for k, v in value.items()]
        if any(kc or vc for (_, kc), (_, vc) in pairs):
            return {k: v for (k, _), (v, _) in pairs}, True
    elif type(value) in (list, tuple):
        items = [_encodable(v) for v in value]
        if any(changed for _, changed in items):
            return type(value)(v for v, _ in items), True
    return value, False


def _metadata(r: _Rollout) -> dict[str, Any]:
    """``RolloutBatch.metadata`` of one finished rollout."""
    return {
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
    }
