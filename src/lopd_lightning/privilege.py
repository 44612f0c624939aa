"""Is the teacher privileged? A check that runs before LOPD (or OPSD) spends its budget.

The teacher is the student's model reading a privileged context (LOPD: latents composed from the request's
retrieved experiences; OPSD: its reference, or a retrieved trace, as text). One that solves no more requests than
the student has little to distil: every LOPD run of this project so far had one (7/48 requests solved greedily,
as many as the student; 30/48 reading the experience as text). :func:`check_privilege` measures, on N requests:

- ``teacher_success``: the fraction the teacher solves answering greedily with its own context
  (:func:`teacher_greedy_replies`, scored by the task's checker: :func:`reply_outcome`);
- ``student_success``: the same without a context, under the student's weights (``teacher_mode: live``: the
  teacher's too);
- ``other_context_success``: request i's teacher reading the context of request (i + 1) mod N, as that request's
  teacher reads it (LOPD: its latents, composed with its task) (a context that helps only as a prompt, whatever it
  says, scores as high as its own);
- ``swap_effect``: the teacher's NLL of the references (:meth:`~lopd_lightning.modules.base.OnPolicyModule.reference_batch`)
  with the other request's context minus with its own, nats per token (global token mean; > 0: its own helps more);
- ``context_gain``: that NLL with no context minus with its own (> 0: the context helps at all).

:class:`PrivilegeCheck` runs it in ``fit`` (at the start, after LOPD's warm start, and every ``every_n_steps``),
logs ``privilege/*`` and for LOPD warns in one line naming the keys to look at; ``lopd privilege-check -c CONFIG``
runs it once. Single-turn tasks only (one greedy reply, scored as one episode step); a multi-turn task is refused.
The model runs in eval mode without gradients; the train flags, the active adapter, the ``requires_grad`` flags and
the torch, CUDA, Python and NumPy random states are restored, so a run with the check trains as one without it.

Source: benchmarks/privileged_margin.py (``teacher_greedy_success``; :func:`teacher_greedy_reply` and
:func:`reply_outcome` reimplement its functions). The benchmark measures on held-out questions, this on train ones.
"""

from __future__ import annotations

import inspect
import logging
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lopd_lightning.adapters import STUDENT, use_adapter
from lopd_lightning.lm import position_ids_from_mask
from lopd_lightning.losses import token_logps

if TYPE_CHECKING:
    from lopd_lightning.modules.base import OnPolicyModule
    from lopd_lightning.tasks import Example, Task

log = logging.getLogger(__name__)

__all__ = ["PrivilegeCheck", "PrivilegeReport", "RequestContext", "check_privilege", "check_supported",
           "not_privileged_warning", "reference_nll", "reply_outcome", "request_contexts", "teacher_greedy_replies",
           "teacher_greedy_reply"]

#: the config keys an LOPD run whose teacher is not privileged should look at (the warning names them)
LOPD_KEYS = (
    "model.init_args.composer_architecture (pointer: latents the frozen teacher reads from the start)",
    "model.init_args.allow_self_retrieval",
    "model.init_args.composer_path (its pretraining: warm_start_self_retrieval, warm_start_steps)",
    "model.init_args.context_framing",
    "model.init_args.num_latents",
)


class RequestContext(NamedTuple):
    """One request's privileged context, as the teacher reads it in its first user message.

    Attributes:
        context_ids: token ids of a text context, framing included (OPSD's); ``[]`` or None: none.
        latents: (L, d) float, the request's latents (LOPD's c_phi, real slots only), placed between the teacher's
            ``framing_prefix`` and ``framing_suffix``; None: none.
    """

    context_ids: list[int] | None = None
    latents: Tensor | None = None

    @property
    def empty(self) -> bool:
        """True when nothing is inserted."""
        return not self.context_ids and (self.latents is None or self.latents.shape[0] == 0)


NO_CONTEXT = RequestContext()


# ---------------------------------------------------------------------------------------- contexts
def _kind(module: Any) -> str | None:
    from lopd_lightning.modules.lopd import LOPDModule
    from lopd_lightning.modules.opsd import OPSDModule

    return "lopd" if isinstance(module, LOPDModule) else "opsd" if isinstance(module, OPSDModule) else None


def check_supported(module: Any, task: Any | None = None) -> None:
    """Refuse, in one line, what the check cannot measure.

    Raises:
        ValueError: ``module`` is neither an LOPDModule nor an OPSDModule (no privileged context to read), or
            ``task`` is multi-turn (each greedy reply is scored as one episode step).
    """
    if _kind(module) is None:
        raise ValueError(f"the privilege check reads the teacher's context of an LOPDModule or an OPSDModule (or a "
                         f"subclass); {type(module).__name__} has none: remove PrivilegeCheck from trainer.callbacks")
    if task is not None and getattr(task, "multi_turn", False):
        raise ValueError(f"the privilege check scores one greedy reply per request and task "
                         f"{getattr(task, 'name', type(task).__name__)!r} is multi-turn; it supports single-turn tasks "
                         f"only (remove PrivilegeCheck from trainer.callbacks)")


def request_contexts(module: OnPolicyModule, task: Task, examples: Sequence[Example], *,
                     batch_size: int = 8) -> list[RequestContext]:
    """Each request's own privileged context, as the module's teacher reads it in training (call without gradients).

    - LOPDModule: the latents of the request's own retrieval (``module.retrieve(task, [example])``: the J nearest
      bank records; its own only with ``allow_self_retrieval``), composed by ``module.composer`` from the pairs
      ``(example.text, record.trace)`` as :meth:`~lopd_lightning.modules.lopd.LOPDModule.batch_latents` does,
      ``batch_size`` requests per composer pass; none when nothing is retrieved.
    - OPSDModule: the token ids of :meth:`~lopd_lightning.modules.opsd.OPSDModule.context_ids`: the reference
      (:meth:`~lopd_lightning.modules.opsd.OPSDModule.reference_text`) in ``OPSD_REFERENCE_TEMPLATE``, or with
      ``privileged_context: retrieved`` the nearest record's trace, in the teacher's framing (the reference too when
      ``context_framing`` is set); none without one.

    Returns:
        One :class:`RequestContext` per example, in order (latents on the composer's device).

    Raises:
        ValueError: another kind of module (:func:`check_supported`).
    """
    check_supported(module)
    out: list[RequestContext] = []
    for i in range(0, len(examples), batch_size):
        chunk = list(examples[i : i + batch_size])
        if _kind(module) == "opsd":
            out.extend(RequestContext(context_ids=ids or None) for ids in _opsd_context_ids(module, task, chunk))
            continue
        pairs = [[(ex.text, e.trace) for e in row] for ex, row in zip(chunk, module.retrieve(task, chunk), strict=True)]
        if not any(pairs):
            out.extend(NO_CONTEXT for _ in chunk)
            continue
        composed = module.composer.compose(pairs)
        out.extend(RequestContext(latents=latents[mask].detach()) if bool(mask.any()) else NO_CONTEXT
                   for latents, mask in zip(composed.latents, composed.latent_mask, strict=True))
    return out


def _opsd_context_ids(module: Any, task: Task, examples: list[Example]) -> list[list[int]]:
    """OPSD's :meth:`~lopd_lightning.modules.opsd.OPSDModule.teacher_contexts` for requests of ``task`` (that method
    reads a batch and looks its references up through the trainer's DataModule)."""
    from lopd_lightning.modules.opsd import OPSDContexts

    retrieved = module.hparams.privileged_context == "retrieved"
    if retrieved:
        experiences = module.retrieve(task, examples) or [[] for _ in examples]
        texts = [exps[0].trace if exps and exps[0].trace else None for exps in experiences]
    else:
        texts = [module.reference_text(task, example) for example in examples]
    kept = torch.tensor([t is not None for t in texts], dtype=torch.bool)
    if retrieved or module.hparams.get("context_framing") is not None:
        return module.context_ids(OPSDContexts(texts=module.teacher.frame_text_context(texts), kept=kept))
    return module.context_ids(OPSDContexts(texts=module.framed(texts), kept=kept, references=texts))


# ---------------------------------------------------------------------------------------- greedy replies
@contextmanager
def _student_scope(module: OnPolicyModule) -> Iterator[torch.nn.Module]:
    """The student's weights (its adapter, or a full student's base weights), eval mode, no parameter recording
    gradients; all restored on exit."""
    flags = [(m, m.training) for m in module.backbone.modules()]
    with use_adapter(module.backbone, STUDENT if module.is_lora_student else None, grads="none"):
        module.backbone.eval()
        try:
            yield module.backbone
        finally:
            for m, flag in flags:
                m.training = flag


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def _row_inputs(module: OnPolicyModule, task: Task, example: Example, context: RequestContext | None,
                weights: str, device: torch.device) -> tuple[Tensor, Tensor | None]:
    """One request's prompt with its context inserted: (T,) ids and (T, d) embeddings (latents) or None."""
    from lopd_lightning.rollout import encode_prompt

    prompt = encode_prompt(module.tokenizer, module.build_messages(task, example), tools=task.tools(example))
    ids = torch.tensor([prompt.input_ids], device=device)
    if weights == "student" or context is None or context.empty:
        return ids[0], None
    if context.latents is not None and context.latents.shape[0] > 0:
        kwargs: dict[str, Any] = {"latents": context.latents[None].to(device)}
    else:
        kwargs = {"context_ids": [list(context.context_ids or [])]}
    inputs = module.teacher.insert_context(ids, torch.ones_like(ids), [prompt.context_position], **kwargs)
    return inputs.input_ids[0], inputs.inputs_embeds[0] if inputs.inputs_embeds is not None else None


def teacher_greedy_replies(
    module: OnPolicyModule, task: Task, examples: Sequence[Example],
    contexts: Sequence[RequestContext | None] | None = None, *, max_new_tokens: int, batch_size: int = 8,
    weights: Literal["teacher", "student"] = "teacher",
) -> list[str]:
    """Greedy replies to ``examples``, ``batch_size`` requests decoded together.

    A request's prompt is ``module.build_messages`` rendered with the generation prompt and the task's tools
    (:func:`~lopd_lightning.rollout.encode_prompt`), its context inserted by
    :meth:`~lopd_lightning.teacher.SelfTeacher.insert_context` at the first user message's content. The rows are
    left padded (pad id; zero embeddings), positioned from the attention mask
    (:func:`~lopd_lightning.lm.position_ids_from_mask`) and decoded greedily with one key/value cache (the prompt's
    last logit only, where the model takes ``logits_to_keep``). A reply stops before the first EOS id
    (:func:`~lopd_lightning.rollout.chat.eos_token_ids`: the tokenizer's, then the generation config's: the ids the
    student's rollouts stop on) or after ``max_new_tokens`` tokens, and is decoded without special tokens. The
    replies are those of one request at a time (tested on a tiny model), up to a padded batch's float rounding.

    Args:
        contexts: one per example (None or empty: nothing inserted); None: none for any.
        max_new_tokens: >= 1, the token limit of a reply.
        weights: ``"teacher"`` (:meth:`~lopd_lightning.teacher.TeacherWeights.teacher_scope`: its mode's weights,
            composer LoRA off) or ``"student"`` (the student's weights; ``contexts`` are not read).

    Returns:
        One reply (str) per example, in order.

    Raises:
        ValueError: ``max_new_tokens`` or ``batch_size`` < 1, unknown ``weights``, ``contexts`` of another length.
    """
    from lopd_lightning.rollout.chat import eos_token_ids

    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens} and {batch_size}")
    if weights not in ("teacher", "student"):
        raise ValueError(f"weights must be 'teacher' or 'student', got {weights!r}")
    if contexts is not None and len(contexts) != len(examples):
        raise ValueError(f"{len(contexts)} contexts for {len(examples)} examples")
    contexts = list(contexts) if contexts is not None else [None] * len(examples)
    tokenizer = module.tokenizer
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    device = next(module.backbone.parameters()).device
    replies: list[list[int]] = []
    for start in range(0, len(examples), batch_size):
        chunk = zip(examples[start : start + batch_size], contexts[start : start + batch_size], strict=True)
        rows = [_row_inputs(module, task, example, context, weights, device) for example, context in chunk]
        scope = module.teacher.teacher_scope() if weights == "teacher" else _student_scope(module)
        with torch.no_grad(), scope as model:
            replies += _decode(model, rows, pad_id=pad_id, eos=set(eos_token_ids(model, tokenizer)),
                               max_new_tokens=max_new_tokens)
    return [tokenizer.decode(r, skip_special_tokens=True, clean_up_tokenization_spaces=False) for r in replies]


def _decode(model: torch.nn.Module, rows: list[tuple[Tensor, Tensor | None]], *, pad_id: int, eos: set[int],
            max_new_tokens: int) -> list[list[int]]:
    """Greedy token ids of the left-padded ``rows`` ((T_b,) ids, (T_b, d) embeddings or None), one cache."""
    length, batch, device = max(ids.shape[0] for ids, _ in rows), len(rows), rows[0][0].device
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((batch, length), dtype=torch.long, device=device)
    for b, (ids, _) in enumerate(rows):
        input_ids[b, length - ids.shape[0] :], mask[b, length - ids.shape[0] :] = ids, 1
    kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": position_ids_from_mask(mask), "use_cache": True}
    if any(embeds is not None for _, embeds in rows):
        table = model.get_input_embeddings()
        dense = [embeds if embeds is not None else table(ids) for ids, embeds in rows]
        kwargs["inputs_embeds"] = dense[0].new_zeros((batch, length, dense[0].shape[-1]))
        for b, embeds in enumerate(dense):
            kwargs["inputs_embeds"][b, length - embeds.shape[0] :] = embeds
    else:
        kwargs["input_ids"] = input_ids
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = 1
    out = model(**kwargs)
    cache_key = "cache" if "cache" in out else "past_key_values"  # the name differs across transformers 5.x
    cache, position = out[cache_key], kwargs["position_ids"][:, -1:]
    replies: list[list[int]] = [[] for _ in rows]
    done = [False] * batch
    for step in range(max_new_tokens):
        tokens = out.logits[:, -1].argmax(dim=-1).tolist()
        for b, token in enumerate(tokens):
            if not done[b] and token in eos:
                done[b] = True
            elif not done[b]:
                replies[b].append(int(token))
        if all(done) or step == max_new_tokens - 1:
            break
        feed = torch.tensor([[pad_id if d else t] for d, t in zip(done, tokens, strict=True)], device=device)
        mask, position = torch.cat([mask, mask.new_ones(batch, 1)], dim=1), position + 1
        out = model(input_ids=feed, attention_mask=mask, position_ids=position, use_cache=True, **{cache_key: cache})
        cache = out[cache_key]
    return replies


def teacher_greedy_reply(module: OnPolicyModule, task: Task, example: Example, *, context_ids: Sequence[int] | None = None,
                         composer: Any | None = None, composed: Any | None = None, max_new_tokens: int) -> str:
    """The teacher's greedy reply to one request with a text context (``context_ids``), the latents of ``composer``
    of its retrieved experiences (``module.retrieve``, pairs ``(example.text, trace)``) or given latents ``composed``
    (a :class:`~lopd_lightning.composer.ComposerOutput` of one row); none of them: no context. The function of that
    name in benchmarks/privileged_margin.py, on :func:`teacher_greedy_replies`."""
    with torch.no_grad():
        if composer is not None:
            composed = composer.compose([[(example.text, e.trace) for e in module.retrieve(task, [example])[0]]])
        if composed is not None:
            context = RequestContext(latents=composed[0][0][composed[1][0].bool()])
        else:
            context = RequestContext(context_ids=list(context_ids) if context_ids else None)
        return teacher_greedy_replies(module, task, [example], [context], max_new_tokens=max_new_tokens)[0]


def reply_outcome(task: Task, example: Example, reply: str) -> tuple[float, str | None]:
    """The checked reward of a single-turn reply (one step of a fresh ``task.start(example)`` episode, through
    :func:`~lopd_lightning.tasks.episode_reward`; the task's checker, not the module's ``score_trajectory``) and the
    checker's error (None when it passed or gave none)."""
    from lopd_lightning.tasks import episode_reward

    episode = task.start(example)
    result = episode.step(reply)
    return episode_reward(task, example, episode), (result.info or {}).get("error")


# ---------------------------------------------------------------------------------------- reference NLL
def reference_nll(module: OnPolicyModule, task: Task, examples: Sequence[Example],
                  contexts: Sequence[RequestContext | None], *, batch_size: int = 8) -> tuple[float, int]:
    """The teacher's NLL of the examples' references with ``contexts`` (one per example; None: none), no gradient:
    :meth:`~lopd_lightning.modules.base.OnPolicyModule.reference_batch`'s assistant tokens (every reply) scored by
    :meth:`~lopd_lightning.teacher.SelfTeacher.logits_on_student_positions` with each row's context, as
    :func:`~lopd_lightning.composer.losses.latent_nll` scores a reference with latents.

    Returns:
        (the sum over those tokens of -log pi_T(token | prefix, context), nats; the token count).

    Raises:
        NotImplementedError: the task has no reference replies.
    """
    total, count = 0.0, 0
    device = next(module.backbone.parameters()).device
    for start in range(0, len(examples), batch_size):
        ctx = [c if c is not None else NO_CONTEXT for c in contexts[start : start + batch_size]]
        batch = module.reference_batch(task, list(examples[start : start + batch_size]))
        input_ids, attention = batch.input_ids.to(device), batch.attention_mask.to(device)
        mask = batch.assistant_mask[:, 1:].bool().to(device) & attention[:, 1:].bool()  # [B, T-1]
        if not bool(mask.any()):
            continue
        kwargs: dict[str, Any] = {}
        widths = [c.latents.shape[0] if c.latents is not None else 0 for c in ctx]
        if max(widths) > 0:
            d = next(c.latents for c, w in zip(ctx, widths, strict=True) if w).shape[-1]
            latents = torch.zeros((len(ctx), max(widths), d), device=device)
            for b, (c, w) in enumerate(zip(ctx, widths, strict=True)):
                if w:
                    latents[b, :w] = c.latents.to(device, latents.dtype)
            kwargs.update(latents=latents, latent_mask=torch.arange(max(widths), device=device)[None]
                          < torch.tensor(widths, device=device)[:, None])
        elif any(c.context_ids for c in ctx):
            kwargs["context_ids"] = [list(c.context_ids or []) for c in ctx]
        with torch.no_grad():
            logits = module.teacher.logits_on_student_positions(
                input_ids, attention, torch.as_tensor(batch.context_position, device=device),
                positions=module.unshift(mask), **kwargs)  # [N, V]
            logps = token_logps(logits[None].float(), input_ids[:, 1:][mask][None])[0]
        total += float(-logps.sum())
        count += int(mask.sum())
    return total, count


# ---------------------------------------------------------------------------------------- the check
@dataclass(frozen=True)
class PrivilegeReport:
    """What :func:`check_privilege` measured (fractions of the requests; NLL differences in nats per token).

    Attributes:
        requests: N, the requests measured.
        teacher_success: the fraction the teacher solves greedily with its own context.
        student_success: the fraction the student solves greedily (no context, its own weights).
        other_context_success: the fraction the teacher solves with the context of request (i + 1) mod N.
        swap_effect: NLL(reference | other's context) - NLL(reference | own), nats per token (global token mean;
            > 0: its own context helps more); None when the task has no references.
        context_gain: NLL(reference | no context) - NLL(reference | own), nats per token; None likewise.
        seconds: wall time of the check (under DDP, of this rank's share).
    """

    requests: int
    teacher_success: float
    student_success: float
    other_context_success: float
    swap_effect: float | None
    context_gain: float | None
    seconds: float

    @property
    def privileged(self) -> bool:
        """True when the teacher with its context solves more requests than the student."""
        return self.teacher_success > self.student_success

    def metrics(self) -> dict[str, float]:
        """``privilege/teacher_greedy_success``, ``privilege/student_greedy_success``,
        ``privilege/other_context_greedy_success``, ``privilege/teacher_minus_student`` and, when measured,
        ``privilege/swap_effect`` and ``privilege/context_gain`` (nats per token)."""
        out = {"privilege/teacher_greedy_success": float(self.teacher_success),
               "privilege/student_greedy_success": float(self.student_success),
               "privilege/other_context_greedy_success": float(self.other_context_success),
               "privilege/teacher_minus_student": float(self.teacher_success - self.student_success)}
        for name, value in (("swap_effect", self.swap_effect), ("context_gain", self.context_gain)):
            if value is not None:
                out[f"privilege/{name}"] = float(value)
        return out

    def line(self) -> str:
        """One line: ``privilege check on 32 train requests: teacher 7/32 solved greedily with its own context, ...``."""
        n = self.requests
        solved = [f"{round(f * n)}/{n}" for f in (self.teacher_success, self.student_success, self.other_context_success)]
        nats = ["n/a" if v is None else f"{v:+.3f}" for v in (self.swap_effect, self.context_gain)]
        return (f"privilege check on {n} train requests: teacher {solved[0]} solved greedily with its own context, "
                f"student {solved[1]}, teacher with another request's context {solved[2]}; reference NLL swap effect "
                f"{nats[0]} nats/token, context gain {nats[1]} nats/token ({self.seconds:.1f} s)")

    def as_dict(self) -> dict[str, Any]:
        """The fields, JSON-ready."""
        return asdict(self)


@contextmanager
def _unchanged_state(module: OnPolicyModule) -> Iterator[None]:
    """Eval mode and no gradients inside; the train flags, the RNG states (torch, CUDA, Python, NumPy) and the
    teacher's ``contexts_cut`` counter restored on exit."""
    import numpy as np

    flags = [(m, m.training) for m in module.modules()]
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    teacher = getattr(module, "teacher", None)
    cut = getattr(teacher, "contexts_cut", None)
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, flag in flags:
            m.training = flag
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if cut is not None:
            teacher.contexts_cut = cut


def check_privilege(module: OnPolicyModule, task: Task, examples: Sequence[Example], *,
                    max_new_tokens: int | None = None, batch_size: int = 8) -> PrivilegeReport:
    """Measure whether the module's teacher is privileged on ``examples`` (the module docstring's quantities).

    Under DDP (a process group of W > 1 ranks) rank r measures the requests i with i % W == r (composing the
    contexts of their (i + 1) mod N too) and the counts and NLL sums are all-reduced in one collective that every
    rank calls, whatever its share: every rank returns the same report. A sharded strategy (FSDP, DeepSpeed,
    FSDP2: every forward is a collective) is refused.

    Args:
        module: an LOPDModule or OPSDModule.
        task: a single-turn task. examples: the N >= 1 requests (the callback's and the command's: the first N
            of the DataModule's ``train_examples``).
        max_new_tokens: the replies' token limit (default: ``val_max_new_tokens``, else ``max_new_tokens``, as
            the module's greedy validation).
        batch_size: requests per decoding batch, composer pass and NLL pass.

    Returns:
        :class:`PrivilegeReport`.

    Raises:
        ValueError: an unsupported module or task (:func:`check_supported`), no examples, a sharded strategy.
    """
    check_supported(module, task)
    if not examples:
        raise ValueError("the privilege check needs at least one request")
    if getattr(module, "_trainer", None) is not None and module.sharded:
        raise ValueError("the privilege check runs on one device or under DDP; under a sharded strategy (FSDP, "
                         "DeepSpeed, FSDP2) remove PrivilegeCheck from trainer.callbacks and run `lopd privilege-check`")
    max_new_tokens = int(max_new_tokens or module.hparams.get("val_max_new_tokens") or module.hparams.max_new_tokens)
    start, n = time.perf_counter(), len(examples)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    mine = [i for i in range(n) if i % world == rank]
    needed = sorted({*mine, *((i + 1) % n for i in mine)})
    with _unchanged_state(module):
        contexts = request_contexts(module, task, [examples[i] for i in needed], batch_size=batch_size)
        by_index = dict(zip(needed, contexts, strict=True))
        own, other = [by_index[i] for i in mine], [by_index[(i + 1) % n] for i in mine]
        requests = [examples[i] for i in mine]
        totals = []
        for given, weights in ((own, "teacher"), (None, "student"), (other, "teacher")):
            replies = teacher_greedy_replies(module, task, requests, given, max_new_tokens=max_new_tokens,
                                             batch_size=batch_size, weights=weights)
            totals.append(float(sum(reply_outcome(task, ex, r)[0] >= 1.0 for ex, r in zip(requests, replies, strict=True))))
        try:
            nll = [reference_nll(module, task, requests, c, batch_size=batch_size) for c in (own, other, [None] * len(mine))]
            totals += [*(total for total, _ in nll), float(nll[0][1]), 1.0]
        except NotImplementedError:  # no references: the NLL part is left out
            totals += [0.0, 0.0, 0.0, 0.0, 0.0]
    if world > 1:
        reduced = torch.tensor(totals, dtype=torch.float64, device=module.device)
        dist.all_reduce(reduced)
        totals = reduced.tolist()
    teacher_ok, student_ok, other_ok, own_nll, other_nll, none_nll, tokens, references = totals
    measured = tokens > 0 and references == world
    return PrivilegeReport(
        requests=n, teacher_success=teacher_ok / n, student_success=student_ok / n, other_context_success=other_ok / n,
        swap_effect=(other_nll - own_nll) / tokens if measured else None,
        context_gain=(none_nll - own_nll) / tokens if measured else None, seconds=time.perf_counter() - start)


def not_privileged_warning(module: Any, report: PrivilegeReport) -> str | None:
    """The one warning line for an LOPD teacher no better than its student (``teacher_success <= student_success``),
    naming the keys to look at (:data:`LOPD_KEYS`); None otherwise, and for any other module."""
    if report.privileged or _kind(module) != "lopd":
        return None
    n = report.requests
    return (f"the LOPD teacher is not privileged: with its latents it solves {round(report.teacher_success * n)}/{n} "
            f"train requests greedily, no more than the student ({round(report.student_success * n)}/{n}), so the "
            f"distillation has little to give; look at {', '.join(LOPD_KEYS)}")


class PrivilegeCheck(Callback):
    """:func:`check_privilege` in ``fit``: when training starts and every ``every_n_steps`` steps.

    It runs at ``on_train_start``, after the module's ``on_fit_start`` (where LOPD warm-starts a fresh composer: it
    measures the composer training starts from), at the current ``global_step`` (0, or a resumed run's), and with
    n = ``every_n_steps`` > 0 after every training step whose ``global_step`` is a multiple of n, so a teacher that
    loses its privilege shows. Each run logs :meth:`PrivilegeReport.metrics` (``privilege/*``) to the trainer's
    loggers at ``global_step``, :meth:`PrivilegeReport.line` at INFO (logger ``lopd_lightning.privilege``) and, with
    ``warn``, for an LOPDModule whose teacher solves no more requests than its student, one WARNING line naming the
    keys to look at (:func:`not_privileged_warning`); all three on rank 0 only. Under DDP every rank measures its
    share and the counts are all-reduced. The requests: the first ``num_requests`` of the DataModule's
    ``train_examples``. :attr:`reports` keeps ``(global_step, report)`` of each run.

    Args:
        num_requests: N >= 1 (32). every_n_steps: also every n training steps (0: at the start only).
        max_new_tokens: the replies' token limit (None: the module's greedy validation's).
        warn: log the warning of a teacher that is not privileged. batch_size: requests decoded together (8).

    Raises:
        ValueError: a bad argument (at construction); at ``setup``, a module other than LOPD or OPSD, a multi-turn
            task, no OnPolicyDataModule, or a sharded strategy.
    """

    def __init__(self, num_requests: int = 32, every_n_steps: int = 0, max_new_tokens: int | None = None,
                 warn: bool = True, batch_size: int = 8) -> None:
        for name, value, least in (("num_requests", num_requests, 1), ("every_n_steps", every_n_steps, 0),
                                   ("batch_size", batch_size, 1), ("max_new_tokens", max_new_tokens, 1)):
            if (value is not None or name != "max_new_tokens") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"PrivilegeCheck {name} must be an int >= {least}"
                                 f"{' or null' if name == 'max_new_tokens' else ''}, got {value!r}; set it in the "
                                 f"callback's init_args (trainer.callbacks)")
        self.num_requests, self.every_n_steps, self.max_new_tokens = num_requests, every_n_steps, max_new_tokens
        self.warn, self.batch_size = warn, batch_size
        self.reports: list[tuple[int, PrivilegeReport]] = []  #: ``(global_step, report)`` of every check of this fit
        self._last_step: int | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "train_examples"):
            raise ValueError("PrivilegeCheck reads its requests from the DataModule's train_examples "
                             "(lopd_lightning.data.OnPolicyDataModule); fit with one")
        check_supported(pl_module, datamodule.task)
        if pl_module.sharded:
            raise ValueError("PrivilegeCheck runs on one device or under DDP; under a sharded strategy (FSDP, DeepSpeed, "
                             "FSDP2) remove it from trainer.callbacks and run `lopd privilege-check`")

    def on_train_start(self, trainer, pl_module) -> None:
        self.run(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self.run(trainer, pl_module)

    def run(self, trainer, pl_module) -> PrivilegeReport | None:
        """One check at ``trainer.global_step`` (at most one a step): measured, logged, warned; None when this step
        was checked already."""
        step = int(trainer.global_step)
        if step == self._last_step:
            return None
        self._last_step = step
        datamodule = trainer.datamodule
        report = check_privilege(pl_module, datamodule.task, datamodule.train_examples[: self.num_requests],
                                 max_new_tokens=self.max_new_tokens, batch_size=self.batch_size)
        self.reports.append((step, report))
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(report.metrics(), step=step)
            log.info("step %d: %s", step, report.line())
            warning = not_privileged_warning(pl_module, report) if self.warn else None
            if warning:
                log.warning(warning)
        return report
