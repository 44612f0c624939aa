"""The LM head where a loss needs it: on logits the forward already made, or chunk by chunk on hidden states.

The distillation loss and the margin of LOPD read the student's and the teacher's next-token
distributions at the N assistant tokens of a batch. With a large vocabulary (V = 49,152 for SmolLM2)
their (N, V) logits dominate the memory of a step, and they grow with the sequence length. Two modes,
chosen once (``LOPDModule(distill_chunk_size=...)``) and held by one object, :class:`LMHead`:

* full (``chunk_size=None``): the forwards return packed (N, V) logits (the head ran inside them) and
  the losses read them as they are;
* chunked (``chunk_size=c``): the forwards return packed (N, d) final hidden states (after the final
  norm), and the head ``hidden @ W.T + b`` runs c rows at a time, inside ``torch.utils.checkpoint``, so
  that no (N, V) tensor is ever alive: the extra peak memory is O(c x V) instead of O(N x V), flat in
  the sequence length (benchmarks/results/loss_memory.json); the price is one more head matmul per
  chunk in backward. Same values and gradients up to float rounding.

Map to the method (docs/METHOD.md):

* :meth:`LMHead.reverse_kl`, :func:`distillation_loss`: section 5, L_distill, the top-M + tail reverse KL
  KL(p~_S || p~_T) as a global token mean (:func:`lopd_lightning.losses.topk_tail_reverse_kl` on logits).
* :meth:`LMHead.token_logps`: section 5, log pi_T(a) and log pi_S(a) of the sampled tokens, from which
  :func:`lopd_lightning.composer.objective.margin_delta` makes the margin Delta(phi).
* :func:`chunked_topk_tail_reverse_kl`, :func:`chunked_head_kl`, :func:`chunked_token_logps`: the chunked
  computations themselves (one head, two heads, sampled-token log-probabilities).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lopd_lightning.lm import base_model
from lopd_lightning.losses.divergences import topk_tail_reverse_kl
from lopd_lightning.losses.tokens import token_logps
from lopd_lightning.losses._common import _check_temperature, _compute_dtype

__all__ = [
    "Head",
    "LMHead",
    "chunked_head_kl",
    "chunked_token_logps",
    "chunked_topk_tail_reverse_kl",
    "constant_head",
    "distillation_loss",
    "lm_head_parameters",
    "rollout_mean",
]

#: (weight (V, d), bias (V,) or None) of an output head.
Head = tuple[Tensor, Tensor | None]

Side = Literal["student", "teacher"]


def lm_head_parameters(model: nn.Module) -> Head:
    """(weight (V, d), bias or None) of the model's output head, for computing its logits chunk by chunk.

    Raises:
        ValueError: the head is not a plain ``nn.Linear`` (e.g. a LoRA adapter on ``lm_head``) or the
            model soft-caps its final logits (Gemma 2): the chunked losses apply ``hidden @ W.T + b`` only.
    """
    base = base_model(model)
    head = base.get_output_embeddings()
    if getattr(base.config, "final_logit_softcapping", None):
        raise ValueError("the model soft-caps its final logits; the chunked LM-head losses do not: "
                         "set distill_chunk_size to null")
    if not isinstance(head, nn.Linear):
        raise ValueError(f"the output head is a {type(head).__name__}, not an nn.Linear (a LoRA on lm_head?); "
                         "the chunked LM-head losses need its plain weight: set distill_chunk_size to null")
    return head.weight, head.bias


def constant_head(head: Head) -> Head:
    """The head with the tensors that require grad detached (the others are returned as they are)."""
    return tuple(t.detach() if t is not None and t.requires_grad else t for t in head)  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------
# the chunked computations: each chunk's logits made, reduced to (chunk,) values and freed
# --------------------------------------------------------------------------------------------------
def _in_chunks(kernel: Callable[..., Tensor], rows: tuple[Tensor, ...], constants: tuple, chunk_size: int) -> Tensor:
    """``cat(kernel(*row_chunk, *constants))`` over chunks of ``chunk_size`` rows; with a gradient to record,
    each chunk runs under non-reentrant ``torch.utils.checkpoint`` (its logits recomputed in backward)."""
    grad_needed = torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in (*rows, *constants)
    )
    parts = []
    for start in range(0, rows[0].shape[0], chunk_size):
        args = (*(r[start:start + chunk_size] for r in rows), *constants)
        parts.append(checkpoint(kernel, *args, use_reentrant=False) if grad_needed else kernel(*args))
    return torch.cat(parts)


def _one_head_kl_chunk(s: Tensor, t: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, temperature: float) -> Tensor:
    """One chunk of :func:`chunked_topk_tail_reverse_kl`: (c, d) hidden states -> (c,) KL."""
    return topk_tail_reverse_kl(F.linear(s, weight, bias), F.linear(t, weight, bias), top_k=top_k, temperature=temperature)


def _two_head_kl_chunk(s: Tensor, t: Tensor, ws: Tensor, bs: Tensor | None, wt: Tensor, bt: Tensor | None,
                       top_k: int, temperature: float) -> Tensor:
    """One chunk of :func:`chunked_head_kl` with two heads: (c, d) hidden states -> (c,) KL."""
    return topk_tail_reverse_kl(F.linear(s, ws, bs), F.linear(t, wt, bt), top_k=top_k, temperature=temperature)


def _token_logps_chunk(hidden: Tensor, tokens: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """One chunk of :func:`chunked_token_logps`: (c, d) hidden states -> (c,) log-probabilities."""
    return token_logps(F.linear(hidden, weight, bias)[None], tokens[None], temperature=temperature)[0]


def _check_hidden_pair(student_hidden: Tensor, teacher_hidden: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """Raise ValueError unless both sides are (..., d) alike and the head is (V, d) with a (V,) bias or None."""
    if student_hidden.shape != teacher_hidden.shape:
        raise ValueError(
            f"student hidden shape {tuple(student_hidden.shape)} != teacher hidden shape "
            f"{tuple(teacher_hidden.shape)}; align the teacher rows to the student's"
        )
    if student_hidden.ndim == 0:
        raise ValueError("hidden states need a hidden dimension (..., d), got scalars")
    d = student_hidden.shape[-1]
    if weight.ndim != 2 or weight.shape[1] != d:
        raise ValueError(f"lm_head_weight must be (V, d={d}), got shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"lm_head_bias must be (V={weight.shape[0]},), got {tuple(bias.shape)}")


def chunked_topk_tail_reverse_kl(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    lm_head_weight: Tensor,
    *,
    top_k: int = 20,
    temperature: float = 1.0,
    chunk_size: int = 256,
    lm_head_bias: Tensor | None = None,
) -> Tensor:
    """:func:`~lopd_lightning.losses.topk_tail_reverse_kl` of ``hidden @ W.T (+ b)``, ``chunk_size`` rows at a time.

    Same value and gradients as ``topk_tail_reverse_kl(F.linear(student_hidden, W, b),
    F.linear(teacher_hidden, W, b), top_k=top_k, temperature=temperature)`` (up to float rounding of the
    matmul), but the (N, V) logits of the two sides are never materialised together: each chunk's
    logits, log-softmaxes and top-k + tail buckets are computed, reduced to (chunk,) KL values and
    freed; backward recomputes them one chunk at a time (``torch.utils.checkpoint``, non-reentrant). The
    extra peak memory is therefore O(chunk_size x V) (about 8 float32 (chunk, V) buffers at once) instead
    of O(N x V) (benchmarks/results/loss_memory.json); the cost is one more forward of the two LM-head
    matmuls per chunk in backward.

    Gradients flow to ``student_hidden``, ``teacher_hidden``, ``lm_head_weight`` and ``lm_head_bias``,
    to whichever of them requires grad (detach the side held constant, as for the unchunked loss). The
    teacher's top-k indices come from its detached logits and are recomputed identically in backward.
    A final logit soft-cap (Gemma 2) is not applied: pass such models' logits to
    :func:`~lopd_lightning.losses.topk_tail_reverse_kl` instead.

    Args:
        student_hidden: (..., d) final hidden states of the student (after the final norm), e.g. packed
            (N, d) at the selected positions (:func:`lopd_lightning.lm.selected_hidden_states`).
        teacher_hidden: (..., d) the teacher's, aligned to the student's rows.
        lm_head_weight: (V, d) the output head's weight (``model.get_output_embeddings().weight``).
        top_k: size M of the teacher's support, >= 1 (docs/METHOD.md: M = 20).
        temperature: > 0; both sides use ``softmax(logits / temperature)``.
        chunk_size: rows per chunk, >= 1; it need not divide N.
        lm_head_bias: (V,) the head's bias, or None (SmolLM2 and Llama heads have none).

    Returns:
        (...) float32 (float64 for float64 input) per-token KL, >= 0 up to rounding; the leading shape
        of ``student_hidden``.

    Raises:
        ValueError: the hidden states differ in shape, ``lm_head_weight`` is not (V, d) with the hidden
            size d, the bias is not (V,), ``top_k`` < 1, ``chunk_size`` < 1 or the temperature is not > 0.

    Source: LOPD paper, docs/METHOD.md section 5 (L_distill); chunking of the LM head with recomputation
    as in chunked / fused linear cross-entropy kernels (e.g. Liger-Kernel's fused linear cross-entropy,
    torchtune's chunked cross-entropy).
    """
    _check_hidden_pair(student_hidden, teacher_hidden, lm_head_weight, lm_head_bias)
    _check_temperature(temperature)
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead, d = student_hidden.shape[:-1], student_hidden.shape[-1]
    student_rows = student_hidden.reshape(-1, d)  # [N, d]
    teacher_rows = teacher_hidden.reshape(-1, d)  # [N, d]
    if student_rows.shape[0] == 0:
        cdtype = _compute_dtype(torch.promote_types(student_hidden.dtype, lm_head_weight.dtype))
        return torch.zeros(lead, dtype=cdtype, device=student_hidden.device)
    constants = (lm_head_weight, lm_head_bias, int(top_k), float(temperature))
    return _in_chunks(_one_head_kl_chunk, (student_rows, teacher_rows), constants, chunk_size).reshape(lead)


def chunked_head_kl(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    student_head: Head,
    teacher_head: Head,
    *,
    top_k: int,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> Tensor:
    """Per-row top-k + tail reverse KL of the student's and the teacher's heads on (N, d) hidden states.

    Equals ``topk_tail_reverse_kl(F.linear(h_s, *student_head), F.linear(h_t, *teacher_head))`` with
    peak memory O(chunk_size x V). When both heads are the very same tensors this is
    :func:`chunked_topk_tail_reverse_kl`; otherwise (a teacher head held constant while the student's
    trains, or the teacher's own frozen copy) each chunk runs under ``torch.utils.checkpoint`` with the
    two heads apart, so the gradient reaches each head only through its own side (pass the constant
    side through :func:`constant_head`).

    Args:
        student_hidden, teacher_hidden: (N, d) final hidden states, aligned rows.
        student_head, teacher_head: (weight (V, d), bias (V,) or None) each.
        top_k: size M of the teacher's support, >= 1.
        temperature: > 0.
        chunk_size: rows per chunk, >= 1.

    Returns:
        (N,) float32 (float64 for float64 input).

    Raises:
        ValueError: the hidden states differ in shape, or ``chunk_size`` < 1 (and, with one head, the
            errors of :func:`chunked_topk_tail_reverse_kl`).

    Source: docs/METHOD.md section 5 (L_distill), as :func:`chunked_topk_tail_reverse_kl`.
    """
    (ws, bs), (wt, bt) = student_head, teacher_head
    if ws is wt and bs is bt:
        return chunked_topk_tail_reverse_kl(
            student_hidden, teacher_hidden, ws, top_k=top_k, temperature=temperature, chunk_size=chunk_size, lm_head_bias=bs
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if teacher_hidden.shape != student_hidden.shape:
        raise ValueError(f"student hidden {tuple(student_hidden.shape)} != teacher hidden {tuple(teacher_hidden.shape)}")
    if student_hidden.shape[0] == 0:
        dtype = torch.float64 if torch.promote_types(student_hidden.dtype, ws.dtype) == torch.float64 else torch.float32
        return torch.zeros(0, dtype=dtype, device=student_hidden.device)
    constants = (ws, bs, wt, bt, int(top_k), float(temperature))
    return _in_chunks(_two_head_kl_chunk, (student_hidden, teacher_hidden), constants, chunk_size)


def chunked_token_logps(
    hidden: Tensor,
    tokens: Tensor,
    head: Head,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> Tensor:
    """``token_logps(F.linear(hidden, *head)[None], tokens[None])[0]`` with peak memory O(chunk_size x V).

    Each chunk's logits are computed, reduced to (chunk,) log-probabilities and freed; with a gradient
    to record (``hidden`` or the head requires grad), backward recomputes them one chunk at a time
    (``torch.utils.checkpoint``, non-reentrant).

    Args:
        hidden: (N, d) final hidden states.
        tokens: (N,) integer ids in [0, V).
        head: (weight (V, d), bias or None); detach what must stay constant (:func:`constant_head`).
        temperature: > 0.
        chunk_size: rows per chunk, >= 1.

    Returns:
        (N,) float32 (float64 for float64 input) log-probabilities.

    Raises:
        ValueError: ``chunk_size`` < 1, or ``hidden`` is not (N, d) with (N,) ``tokens``.

    Source: log pi(a | s) of the sampled tokens (docs/METHOD.md section 5, the margin's delta), as
    :func:`lopd_lightning.losses.token_logps`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.ndim != 2 or tokens.shape != hidden.shape[:1]:
        raise ValueError(f"need (N, d) hidden and (N,) tokens, got {tuple(hidden.shape)} and {tuple(tokens.shape)}")
    weight, bias = head
    if hidden.shape[0] == 0:
        dtype = torch.float64 if torch.promote_types(hidden.dtype, weight.dtype) == torch.float64 else torch.float32
        return torch.zeros(0, dtype=dtype, device=hidden.device)
    return _in_chunks(_token_logps_chunk, (hidden, tokens), (weight, bias, float(temperature)), chunk_size)


# --------------------------------------------------------------------------------------------------
# one object for both modes
# --------------------------------------------------------------------------------------------------
class LMHead:
    """The student's and the teacher's LM heads, applied in full or in chunks: the losses' one view of them.

    Every method takes the ``values`` the forwards returned for :attr:`output`: packed (N, V) logits in
    full mode, packed (N, d) final hidden states in chunked mode, and gives the same result either way
    (up to float rounding). Which side trains is read from the values, as it would be from logits:

    * a side's head is trainable only through values that require grad: detach a side (``sg[.]`` in
      the method's equations) and its head is a constant too, as it is for detached logits;
    * the teacher's head is always a constant: the teacher's pass records no backbone parameter
      (:meth:`lopd_lightning.teacher.SelfTeacher.teacher_scope`), so only its values (through the
      latents) carry gradient.

    The heads' tensors are read at every call (after ``.to(device)`` or a strategy's wrapping they are
    not the tensors of construction time).

    Args:
        student: the student's causal LM (the shared backbone); read in chunked mode only.
        teacher: the model of the teacher's pass (:attr:`lopd_lightning.teacher.SelfTeacher.model`: the
            shared backbone or its frozen copy); read in chunked mode only.
        chunk_size: None (full mode) or the rows per chunk, an int >= 1.

    Raises:
        ValueError: ``chunk_size`` is not None or an int >= 1; in chunked mode, a model is missing or its
            head is not a plain linear layer without logit soft-capping (:func:`lm_head_parameters`:
            checked here, not at the first step).
    """

    def __init__(self, student: nn.Module | None = None, teacher: nn.Module | None = None, *, chunk_size: int | None = None):
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
        if chunk_size is not None and (student is None or teacher is None):
            raise ValueError("a chunked LMHead needs the student's and the teacher's models")
        self.chunk_size = chunk_size
        self._models = (student, teacher)
        if chunk_size is not None:
            self._heads()

    @property
    def chunked(self) -> bool:
        """True when the head runs chunk by chunk on hidden states."""
        return self.chunk_size is not None

    @property
    def output(self) -> Literal["logits", "hidden"]:
        """What the forwards must return for this head: ``"logits"`` (full) or ``"hidden"`` (chunked)."""
        return "hidden" if self.chunked else "logits"

    def _heads(self) -> tuple[Head, Head, Head]:
        """(the student's head, the same held constant, the teacher's head held constant), read now.

        When the teacher's head is the student's (one shared backbone) the two constant heads are the
        very same tensors, so the KL takes :func:`chunked_topk_tail_reverse_kl`'s one-head path."""
        student, teacher = self._models
        student_head = lm_head_parameters(student)
        student_const = constant_head(student_head)
        teacher_head = lm_head_parameters(teacher)
        same = teacher_head[0] is student_head[0] and teacher_head[1] is student_head[1]
        return student_head, student_const, student_const if same else constant_head(teacher_head)

    def reverse_kl(self, student: Tensor, teacher: Tensor, *, top_k: int, temperature: float = 1.0) -> Tensor:
        """Per-token top-k + tail reverse KL(p~_S || p~_T) on the teacher's top-``top_k`` support.

        Args:
            student, teacher: (N, V) logits or (N, d) hidden states (:attr:`output`), aligned rows; detach
                the side held constant.
            top_k: M, >= 1. temperature: > 0, both sides.

        Returns:
            (N,) float32 (float64 for float64 input).

        Raises:
            ValueError: see :func:`lopd_lightning.losses.topk_tail_reverse_kl` and :func:`chunked_head_kl`.

        Source: docs/METHOD.md section 5, L_distill's per-token term.
        """
        if not self.chunked:
            return topk_tail_reverse_kl(student[None], teacher[None], top_k=top_k, temperature=temperature)[0]
        student_head, student_const, teacher_const = self._heads()
        head = student_head if student.requires_grad else student_const
        return chunked_head_kl(
            student, teacher, head, teacher_const, top_k=top_k, temperature=temperature, chunk_size=self.chunk_size
        )

    def token_logps(self, values: Tensor, tokens: Tensor, *, side: Side, temperature: float = 1.0) -> Tensor:
        """log softmax(logits / temperature)[token] of ``side``'s head at each row.

        Args:
            values: (N, V) logits or (N, d) hidden states (:attr:`output`) of ``side``.
            tokens: (N,) integer ids in [0, V).
            side: ``"student"`` or ``"teacher"``: whose head (in chunked mode).
            temperature: > 0.

        Returns:
            (N,) float32 (float64 for float64 input), <= 0.

        Raises:
            ValueError: an unknown ``side``, or see :func:`lopd_lightning.losses.token_logps`.

        Source: log pi(a | s) of docs/METHOD.md section 5 (the margin's delta).
        """
        if side not in ("student", "teacher"):
            raise ValueError(f"side must be 'student' or 'teacher', got {side!r}")
        if not self.chunked:
            return token_logps(values[None], tokens[None], temperature=temperature)[0]
        student_head, student_const, teacher_const = self._heads()
        if side == "teacher":
            head = teacher_const
        else:
            head = student_head if values.requires_grad else student_const
        return chunked_token_logps(values, tokens, head, temperature=temperature, chunk_size=self.chunk_size)


# --------------------------------------------------------------------------------------------------
# LOPD's losses through the head
# --------------------------------------------------------------------------------------------------
def distillation_loss(
    head: LMHead, student: Tensor, teacher: Tensor, *, top_k: int, temperature: float = 1.0, num_tokens: float
) -> Tensor:
    """L_distill = sum_n KL(p~_S || p~_T)_n / num_tokens, the top-M + tail reverse KL as a global token mean.

    Detach the side held constant: ``distillation_loss(head, s, t.detach(), ...)`` is the student's loss,
    ``distillation_loss(head, s.detach(), t, ...)`` the composer's L_distill(phi; student detached).

    Args:
        head: the :class:`LMHead` (full or chunked).
        student, teacher: (N, V) logits or (N, d) hidden states at the N loss tokens, aligned rows.
        top_k: M, the teacher's support size. temperature: of both distributions.
        num_tokens: the global token count of the step (this rank's share:
            :meth:`lopd_lightning.modules.base.OnPolicyModule.num_loss_tokens`).

    Returns:
        () float32.

    Source: LOPD paper, docs/METHOD.md section 5: L_distill = sum omega KL(p~_S || p~_T) / sum omega (Eq. 10).
    """
    return head.reverse_kl(student, teacher, top_k=top_k, temperature=temperature).sum() / num_tokens


def rollout_mean(per_token: Tensor, mask: Tensor, *, num_rollouts: float) -> Tensor:
    """The sum over rollouts of each rollout's mean per-token value, divided by ``num_rollouts``: with
    ``num_rollouts`` the global count of rollouts with loss tokens over the ranks' count, the mean over every
    rank's rollouts of their token means once DDP averages the gradients (as :func:`distillation_loss`'s
    ``num_tokens`` does for the token mean).

    Args:
        per_token: (N,) float, one value per loss token, the N True positions of ``mask`` in row-major order
            (:meth:`LMHead.reverse_kl`).
        mask: (B, T) bool, the loss tokens of the B rollouts.
        num_rollouts: > 0 (the rollouts of this rank when there is one rank); 0 gives 0.

    Returns:
        () float: ``sum_b [sum_{t in b} per_token / n_b] / num_rollouts`` over the rollouts with n_b > 0.

    Raises:
        ValueError: ``per_token`` does not have one entry per True of ``mask``.

    Source: the LOPD authors' code averages the composer's KL per rollout, then over rollouts (docs/METHOD.md
    section 5, "composer_kl_mean").
    """
    rows = mask.nonzero()[:, 0]  # [N], the rollout of each loss token
    if rows.numel() != per_token.numel():
        raise ValueError(f"per_token has {per_token.numel()} entries for {rows.numel()} loss tokens")
    if num_rollouts <= 0:
        return per_token.sum() * 0.0
    counts = mask.sum(dim=1).to(per_token.dtype)  # [B]
    weights = 1.0 / counts.clamp(min=1)[rows]  # [N]: each token's share of its rollout's mean
    return (per_token * weights).sum() / num_rollouts
