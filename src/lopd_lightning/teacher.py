"""The latent-conditioned self-teacher pi_T(. | s, c_phi) = pi_theta_bar([s; c_phi]) (docs/METHOD.md section 4).

The teacher reads the student's own conversation s with a privileged context inserted at the start of
the first user message's content:

    ... <|im_start|>user\\n  [framing_prefix] [c_phi: L placeholder positions] [framing_suffix]  {x} ...

The placeholder positions' *input embeddings* are replaced by the latent tokens c_phi (built out of
place with ``index_put`` + ``torch.where``, so gradients reach the composer). The same insertion code
takes a *text* context instead (token ids per row: OPSD's reference solution, SDPO's successful sibling).
A row without a context (empty bank, J = 0, all latents masked, empty text) gets nothing inserted and
its teacher pass is exactly the student's sequence.

The teacher's logits are gathered back onto the student's positions (``index_map``), so the returned
``(B, T, V)`` tensor follows the convention of ``student(input_ids).logits``: index t predicts token t+1.
Positions come from the attention mask (``cumsum - 1``), so left or right padding and the inserted
context never shift them. Use :func:`position_ids_from_mask` for the student's pass too.

Teacher weights theta_bar (``mode``):

==========  =========================================  ==============================================
mode        LoRA student                               full-parameter student
==========  =========================================  ==============================================
``live``    the ``"student"`` adapter (shared)         the base weights (shared)
``base``    all adapters disabled (shared)             one frozen deepcopy of the initial backbone
``ema``     a third adapter ``"teacher_ema"`` (EMA of  an EMA deepcopy of the backbone
            the student's LoRA; no backbone copy)
==========  =========================================  ==============================================

The composer's LoRA is never active in the teacher pass. During the pass every backbone parameter has
``requires_grad`` off (:func:`lopd_lightning.adapters.use_adapter` with ``grads="none"``): the teacher
is a constant for the student's step, and only the latents (the composer) receive gradients. Without
latents that need a gradient, the pass runs under ``torch.no_grad()``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Literal, NamedTuple

import torch
from peft import PeftModel
from torch import Tensor, nn

from lopd_lightning.adapters import (
    STUDENT,
    TEACHER_EMA,
    adapter_parameters,
    base_parameters,
    is_lora_student,
    use_adapter,
)
from lopd_lightning.lm import (
    Head,
    base_model,
    decoder_hidden_states,
    lm_head_parameters,
    selected_hidden_states,
    selected_logits,
)
from lopd_lightning.losses import token_logps

log = logging.getLogger(__name__)

TeacherMode = Literal["live", "base", "ema"]

DEFAULT_FRAMING_PREFIX = "Here is a reference example of a different, already solved task:\n"
DEFAULT_FRAMING_SUFFIX = "\nNow complete your task.\n\n"

__all__ = [
    "DEFAULT_FRAMING_PREFIX",
    "DEFAULT_FRAMING_SUFFIX",
    "SelfTeacher",
    "TeacherInputs",
    "TeacherPrefix",
    "has_dropout",
    "prefix_length",
    "supports_prefix_cache",
    "position_ids_from_mask",
    "shifted_token_logps",
    "warm_start_loss",
]


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids that ignore padding: ``cumsum(mask) - 1``, 0 on leading pads.

    Args:
        attention_mask: (B, T) {0, 1} or bool.

    Returns:
        (B, T) long: 0, 1, 2, ... over the real tokens of each row, whatever the padding side or holes.
    """
    mask = attention_mask.long()
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)


def shifted_token_logps(logits: Tensor, input_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Log-probs of ``input_ids[:, 1:]`` from causal-LM ``logits`` (index t predicts token t+1).

    Args:
        logits: (B, T, V) float, e.g. from :meth:`SelfTeacher.logits_on_student_positions` or the student.
        input_ids: (B, T) long.
        temperature: divide the logits by it first.

    Returns:
        (B, T-1) float32: ``log p(input_ids[b, t+1] | input_ids[b, :t+1])``; pad positions hold the
        log-prob of the pad token (mask them).
    """
    return token_logps(logits[:, :-1], input_ids[:, 1:], temperature=temperature)


class TeacherInputs(NamedTuple):
    """The teacher's batch, the student's sequence with the context inserted. T' = T + max_b C_b.

    Attributes:
        input_ids: (B, T') long; the placeholder id at latent slots, pad id on padding.
        inputs_embeds: (B, T', d) or None (None for a text context or no context: feed ``input_ids``).
        attention_mask: (B, T') long {0, 1}.
        position_ids: (B, T') long, :func:`position_ids_from_mask` of ``attention_mask``.
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


@contextmanager
def _eval_mode(model: nn.Module, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _teacher_positions(inputs: TeacherInputs, positions: Tensor) -> Tensor:
    """(B, T) bool student positions -> (B, T') bool positions of the same tokens in the teacher's rows."""
    out = torch.zeros(inputs.attention_mask.shape, dtype=torch.bool, device=positions.device)
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(inputs.index_map)
    out[rows[positions.bool()], inputs.index_map[positions.bool()]] = True
    return out


class SelfTeacher(nn.Module):
    """The self-teacher on the shared backbone: context insertion, aligned logits, teacher modes, EMA.

    Args:
        backbone: the shared ``PeftModel`` (:func:`lopd_lightning.adapters.prepare_backbone`). Held
            without registration (not in this module's ``state_dict``; never copied for a LoRA student).
        tokenizer: the backbone's tokenizer (tokenises the framing text and text contexts).
        mode: ``"live"`` (current student weights), ``"base"`` (initial weights) or ``"ema"`` (an EMA of
            the student, updated by :meth:`update_ema`). docs/METHOD.md section 4.
        ema_rate: EMA rate r: ``ema <- (1 - r) ema + r student`` (0.05 as in SDPO).
        framing_prefix: text before the latents (a reference example of a different, solved task).
        framing_suffix: text after them ("now complete your task").
        placeholder_id: token id written at latent slots in ``input_ids`` (its embedding is replaced);
            the tokenizer's pad id (else 0) when None.
        deterministic: run the teacher pass in eval mode (no dropout); each module's train flag is
            restored afterwards.

    With a full-parameter student, ``base`` and ``ema`` hold one deepcopy of the backbone (registered as
    the submodule ``shadow``: saved in this module's ``state_dict``, moved with ``.to()``), frozen; a
    warning is logged. With a LoRA student no mode copies the backbone: ``ema`` adds the adapter
    ``"teacher_ema"`` (initialised to the student's LoRA, ``requires_grad`` False) to the shared backbone.

    Raises:
        ValueError: unknown mode or a rate outside [0, 1].
    """

    def __init__(
        self,
        backbone: PeftModel,
        tokenizer,
        *,
        mode: TeacherMode = "live",
        ema_rate: float = 0.05,
        framing_prefix: str = DEFAULT_FRAMING_PREFIX,
        framing_suffix: str = DEFAULT_FRAMING_SUFFIX,
        placeholder_id: int | None = None,
        deterministic: bool = True,
    ) -> None:
        super().__init__()
        if mode not in ("live", "base", "ema"):
            raise ValueError(f"mode must be 'live', 'base' or 'ema', got {mode!r}")
        if not 0.0 <= ema_rate <= 1.0:
            raise ValueError(f"ema_rate must be in [0, 1], got {ema_rate}")
        self._backbone = (backbone,)  # a tuple: not registered, not copied
        self.tokenizer = tokenizer
        self.mode: TeacherMode = mode
        self.ema_rate = ema_rate
        self.deterministic = deterministic
        self.framing_prefix = framing_prefix
        self.framing_suffix = framing_suffix
        self.prefix_ids: list[int] = self._tokenize(framing_prefix)
        self.suffix_ids: list[int] = self._tokenize(framing_suffix)
        if placeholder_id is None:
            placeholder_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.placeholder_id = int(placeholder_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        config = backbone.get_base_model().config if hasattr(backbone, "get_base_model") else getattr(backbone, "config", None)
        #: the longest teacher sequence (the model's context); None: no limit known.
        self.max_length: int | None = getattr(config, "max_position_embeddings", None)
        #: rows whose privileged context was cut to fit ``max_length`` (see :meth:`insert_context`).
        self.contexts_cut = 0
        self.lora_student = is_lora_student(backbone)
        self.shadow: nn.Module | None = None
        if mode == "ema" and self.lora_student:
            self._add_ema_adapter()
        elif mode in ("base", "ema") and not self.lora_student:
            log.warning(
                "SelfTeacher(mode=%r) with a full-parameter student keeps one frozen deepcopy of the backbone "
                "(%s weights): a second full copy in memory",
                mode,
                "initial" if mode == "base" else "EMA",
            )
            shadow = copy.deepcopy(backbone)
            for p in shadow.parameters():
                p.requires_grad_(False)
                p.grad = None
            self.shadow = shadow

    # ---------------------------------------------------------------- weights
    @property
    def backbone(self) -> PeftModel:
        """The shared backbone (not a submodule)."""
        return self._backbone[0]

    @property
    def model(self) -> PeftModel:
        """The model that runs the teacher pass: the shared backbone, or the frozen copy (full student)."""
        return self.shadow if self.shadow is not None else self.backbone  # type: ignore[return-value]

    @property
    def adapter(self) -> str | None:
        """The adapter active in the teacher pass (None: all adapters disabled)."""
        if self.shadow is not None:
            return None
        if self.mode == "live":
            return STUDENT if self.lora_student else None
        if self.mode == "base":
            return None
        return TEACHER_EMA

    def _add_ema_adapter(self) -> None:
        backbone = self.backbone
        if TEACHER_EMA not in backbone.peft_config:
            # use_adapter restores the active adapter, the disabled state and every existing flag on exit
            with use_adapter(backbone, STUDENT):
                backbone.add_adapter(TEACHER_EMA, copy.deepcopy(backbone.peft_config[STUDENT]))
            with torch.no_grad():
                for ema, live in zip(self._ema_lora_parameters(), adapter_parameters(backbone, STUDENT), strict=True):
                    ema.copy_(live)
        for p in self._ema_lora_parameters():
            p.requires_grad_(False)

    def _ema_lora_parameters(self) -> list[nn.Parameter]:
        return adapter_parameters(self.backbone, TEACHER_EMA)

    def ema_parameter_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(ema, student) parameter pairs that :meth:`update_ema` blends; empty unless mode is ``ema``."""
        if self.mode != "ema":
            return []
        if self.lora_student:
            return list(zip(self._ema_lora_parameters(), adapter_parameters(self.backbone, STUDENT), strict=True))
        assert self.shadow is not None
        live_base = {id(p) for p in base_parameters(self.backbone)}
        shadow_params = dict(self.shadow.named_parameters())
        return [(shadow_params[n], p) for n, p in self.backbone.named_parameters() if id(p) in live_base]

    @torch.no_grad()
    def update_ema(self) -> None:
        """``ema <- (1 - r) * ema + r * student`` for every EMA weight (r = ``ema_rate``); no-op unless ``ema``.

        LoRA student: the ``"teacher_ema"`` adapter follows the ``"student"`` adapter. Full student: the
        frozen copy's base weights follow the backbone's. Call once per student optimiser step.
        """
        for ema, live in self.ema_parameter_pairs():
            ema.lerp_(live.to(ema.dtype), self.ema_rate)

    @contextmanager
    def teacher_scope(self) -> Iterator[nn.Module]:
        """The teacher's weights for the passes inside: the mode's adapter (composer LoRA off), every
        backbone parameter constant (``requires_grad`` off while inside), eval mode if ``deterministic``.

        Yields:
            the model to call (the backbone or its frozen copy).
        """
        model = self.model
        with use_adapter(model, self.adapter, grads="none"), _eval_mode(model, self.deterministic):
            yield model

    # ---------------------------------------------------------------- inputs
    def _tokenize(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_text_context(
        self, texts: Sequence[str | None], *, prefix: str | None = None, suffix: str | None = None
    ) -> list[list[int]]:
        """Token ids of framed text contexts: ``prefix + text + suffix`` tokenised together, no special tokens.

        Args:
            texts: one per row; None or "" gives an empty context (nothing inserted).
            prefix: text before (the teacher's ``framing_prefix`` when None; "" for none).
            suffix: text after (``framing_suffix`` when None).

        Returns:
            B lists of ids for :meth:`insert_context` (``context_ids``).
        """
        prefix = self.framing_prefix if prefix is None else prefix
        suffix = self.framing_suffix if suffix is None else suffix
        return [self._tokenize(prefix + text + suffix) if text else [] for text in texts]

    def insert_context(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        context_position: Tensor | Sequence[int],
        *,
        context_ids: Sequence[Sequence[int] | None] | None = None,
        latents: Tensor | None = None,
        latent_mask: Tensor | None = None,
    ) -> TeacherInputs:
        """Insert each row's privileged context into the student's sequence at ``context_position``.

        Row b's context is ``prefix_ids + [placeholder] * L_b + suffix_ids`` with L_b = ``latent_mask[b].sum()``
        (latents), or ``context_ids[b]`` as given (text), or nothing when L_b = 0 / the ids are empty.
        Rows are padded to T' = T + max_b C_b on the side the batch is padded on (left when some row starts
        with a pad, else right), so padding stays contiguous; positions come from the mask either way.

        Args:
            input_ids: (B, T) long, the student's tokens (prompt and completion), left or right padded.
            attention_mask: (B, T) {0, 1}.
            context_position: (B,) long, the index in ``input_ids`` where the first user message's content
                starts; in [0, T].
            context_ids: B token-id lists (text contexts); exclusive with ``latents``.
            latents: (B, L, d) float, c_phi; row b's latents where ``latent_mask[b]`` is True fill its
                placeholders in order. Any dtype (cast to the embedding's).
            latent_mask: (B, L) bool; all True when None.

        Returns:
            :class:`TeacherInputs`. ``inputs_embeds`` is set when latents are given: the teacher model's
            token embeddings (constants) with the latents at the placeholder positions (differentiable in
            the latents). The embedding lookup runs under :meth:`teacher_scope`.

        Raises:
            ValueError: both or mismatched contexts, bad shapes, or a position outside [0, T].
        """
        if context_ids is not None and latents is not None:
            raise ValueError("give context_ids or latents, not both")
        if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
            raise ValueError(
                f"expected (B, T) ids and mask, got {tuple(input_ids.shape)}, {tuple(attention_mask.shape)}"
            )
        batch, length = input_ids.shape
        device = input_ids.device
        pos = torch.as_tensor(context_position, device=device, dtype=torch.long).reshape(-1)
        if pos.shape[0] != batch:
            raise ValueError(f"context_position must have {batch} entries, got {pos.shape[0]}")
        if bool(((pos < 0) | (pos > length)).any()):
            raise ValueError(f"context_position must be in [0, {length}], got {pos.tolist()}")

        # per-row context token ids and the number of latent slots
        num_slots = [0] * batch
        if latents is not None:
            if latents.dim() != 3 or latents.shape[0] != batch:
                raise ValueError(f"latents must be (B={batch}, L, d), got {tuple(latents.shape)}")
            if latent_mask is None:
                latent_mask = torch.ones(latents.shape[:2], dtype=torch.bool, device=latents.device)
            if latent_mask.shape != latents.shape[:2]:
                raise ValueError(f"latent_mask must be {tuple(latents.shape[:2])}, got {tuple(latent_mask.shape)}")
            latent_mask = latent_mask.bool()
            num_slots = [int(n) for n in latent_mask.sum(dim=1).tolist()]
            contexts = [
                self.prefix_ids + [self.placeholder_id] * n + self.suffix_ids if n > 0 else [] for n in num_slots
            ]
        elif context_ids is not None:
            if len(context_ids) != batch:
                raise ValueError(f"context_ids must have {batch} rows, got {len(context_ids)}")
            contexts = [list(ids) if ids else [] for ids in context_ids]
        else:
            contexts = [[] for _ in range(batch)]

        contexts, num_slots, latent_mask = self._fit_contexts(contexts, num_slots, latent_mask, attention_mask)
        ctx_len = torch.tensor([len(c) for c in contexts], dtype=torch.long, device=device)  # [B]
        max_ctx = int(ctx_len.max()) if batch else 0
        left_padded = bool((attention_mask[:, 0] == 0).any()) if length else False
        offset = (max_ctx - ctx_len) if left_padded else torch.zeros_like(ctx_len)  # [B]
        steps = torch.arange(length, device=device)
        index_map = offset[:, None] + steps[None, :] + ctx_len[:, None] * (steps[None, :] >= pos[:, None])  # [B, T]

        total = length + max_ctx
        teacher_ids = torch.full((batch, total), self.pad_id, dtype=torch.long, device=device)
        teacher_mask = torch.zeros((batch, total), dtype=torch.long, device=device)
        teacher_ids.scatter_(1, index_map, input_ids.long())
        teacher_mask.scatter_(1, index_map, attention_mask.long())
        context_mask = torch.zeros((batch, total), dtype=torch.bool, device=device)
        latent_slots = torch.zeros((batch, total), dtype=torch.bool, device=device)
        if max_ctx > 0:
            ctx = torch.full((batch, max_ctx), self.pad_id, dtype=torch.long, device=device)
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
            if latents is not None:
                slots = torch.tensor(num_slots, dtype=torch.long, device=device)
                start = len(self.prefix_ids)
                is_slot = (i[None, :] >= start) & (i[None, :] < start + slots[:, None])  # [B, Cmax]
                s_rows, s_cols = is_slot.nonzero(as_tuple=True)
                latent_slots[s_rows, ctx_pos[s_rows, s_cols]] = True
        position_ids = position_ids_from_mask(teacher_mask)

        inputs_embeds = None
        if latents is not None and max_ctx > 0:
            with self.teacher_scope() as model, torch.no_grad():
                token_embeds = model.get_input_embeddings()(teacher_ids)  # [B, T', d], constants
            assert latent_mask is not None
            values = latents.to(device=device, dtype=token_embeds.dtype)[latent_mask.to(device)]  # [N, d]
            s_rows, s_pos = latent_slots.nonzero(as_tuple=True)  # row-major: same order as values
            canvas = token_embeds.new_zeros(token_embeds.shape).index_put((s_rows, s_pos), values)
            inputs_embeds = torch.where(latent_slots[..., None], canvas, token_embeds)
        return TeacherInputs(
            teacher_ids, inputs_embeds, teacher_mask, position_ids, index_map, context_mask, latent_slots
        )

    def _fit_contexts(
        self, contexts: list[list[int]], num_slots: list[int], latent_mask: Tensor | None, attention_mask: Tensor
    ) -> tuple[list[list[int]], list[int], Tensor | None]:
        """Cut each row's privileged context so that the teacher's row fits ``max_length`` tokens.

        The student's own tokens (the question, the replies, the observations) are never cut: the
        retrieved or privileged context goes first. A text context keeps its beginning and its end (its
        framing: what it is, and what to do next) and loses its middle; latents keep
        their first slots (the first experiences', in retrieval order) inside the framing, and a row
        with no room for the framing and one slot gets no context. Each cut is counted and logged.
        """
        if self.max_length is None:
            return contexts, num_slots, latent_mask
        lengths = attention_mask.sum(dim=1).tolist()
        framing = len(self.prefix_ids) + len(self.suffix_ids)
        cloned = False
        for b, context in enumerate(contexts):
            room = int(self.max_length) - int(lengths[b])
            if len(context) <= room:
                continue
            self.contexts_cut += 1
            if latent_mask is None:  # a text context: keep its beginning and its end (the framing), cut the middle
                head = max(room, 0) // 2
                contexts[b] = context[:head] + context[len(context) - (max(room, 0) - head):] if room > 0 else []
            else:
                keep = max(room - framing, 0)
                num_slots[b] = keep
                contexts[b] = self.prefix_ids + [self.placeholder_id] * keep + self.suffix_ids if keep > 0 else []
                if not cloned:
                    latent_mask, cloned = latent_mask.clone(), True  # the caller's mask is not changed
                on = latent_mask[b].nonzero(as_tuple=True)[0]
                latent_mask[b, on[keep:]] = False
            log.warning(
                "teacher row %d: %d context tokens do not fit the model's %d positions next to the student's %d "
                "tokens; the context is cut to %d (%d rows so far)",
                b, len(context), self.max_length, lengths[b], len(contexts[b]), self.contexts_cut,
            )
        return contexts, num_slots, latent_mask

    # ---------------------------------------------------------------- forward
    def forward_inputs(self, inputs: TeacherInputs) -> Tensor:
        """Run the teacher on prepared inputs; (B, T', V) logits over the whole teacher sequence.

        Gradients are recorded only when ``inputs.inputs_embeds`` requires grad (the latents); the
        backbone's parameters are constants either way.
        """
        needs_grad = inputs.inputs_embeds is not None and inputs.inputs_embeds.requires_grad
        with self.teacher_scope() as model, (nullcontext() if needs_grad else torch.no_grad()):
            return model(**inputs.model_kwargs(), use_cache=False).logits

    def logits_on_student_positions(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        context_position: Tensor | Sequence[int],
        *,
        context_ids: Sequence[Sequence[int] | None] | None = None,
        latents: Tensor | None = None,
        latent_mask: Tensor | None = None,
        positions: Tensor | None = None,
        prefix: TeacherPrefix | None = None,
    ) -> Tensor:
        """The teacher's logits at the student's positions: (B, T, V), aligned like ``student(input_ids).logits``.

        With ``positions`` ((B, T) bool on student positions) only those logits are computed and returned
        packed, (N, V) in row-major order of ``positions`` (see :func:`lopd_lightning.lm.selected_logits`):
        the LM head then runs on N positions instead of B x T'.

        ``out[b, t]`` is the teacher's distribution of the token that follows student token t (so
        ``out[:, :-1]`` scores ``input_ids[:, 1:]``), whatever the context length and padding side. Pad
        positions hold logits of no meaning (mask them). Arguments as in :meth:`insert_context`.

        Args:
            prefix: keys and values of the first ``prefix.length`` tokens (:class:`TeacherPrefix`, made
                with the teacher's weights): the pass then runs on the rest of the sequence only, forward
                and backward (same values up to float rounding). Needs ``positions``, none of them in the
                prefix, and a prefix before every row's context.

        Returns:
            (B, T, V) float in the model's dtype, or packed (N, V) with ``positions``; differentiable in
            ``latents`` only.

        Raises:
            ValueError: bad shapes (see :meth:`insert_context`), or a ``prefix`` that does not fit.

        Source: pi_T(. | s, c_phi) = pi_theta_bar([s; c_phi]), docs/METHOD.md section 4.
        """
        inputs = self.insert_context(
            input_ids,
            attention_mask,
            context_position,
            context_ids=context_ids,
            latents=latents,
            latent_mask=latent_mask,
        )
        if positions is not None:
            return self._on_positions(selected_logits, inputs, input_ids, positions, prefix)
        if prefix is not None:
            raise ValueError("prefix needs positions (the logits of prefix tokens are not computed)")
        logits = self.forward_inputs(inputs)  # [B, T', V]
        index = inputs.index_map[..., None].expand(-1, -1, logits.shape[-1])
        return logits.gather(1, index)

    def hidden_on_student_positions(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        context_position: Tensor | Sequence[int],
        *,
        positions: Tensor,
        context_ids: Sequence[Sequence[int] | None] | None = None,
        latents: Tensor | None = None,
        latent_mask: Tensor | None = None,
        prefix: TeacherPrefix | None = None,
    ) -> Tensor:
        """The teacher's final hidden states (after the final norm) at the student's ``positions``, packed (N, d).

        ``F.linear(out, *self.head_parameters())`` equals ``logits_on_student_positions(..., positions=positions)``
        (same rows, same order); the caller applies the head chunk by chunk (peak memory O(chunk x V)
        instead of O(N x V)). Differentiable in ``latents`` only; the backbone is constant.

        Args:
            positions: (B, T) bool on student positions (required).
            prefix: as in :meth:`logits_on_student_positions`.
            others: as in :meth:`insert_context`.

        Returns:
            (N, d) float in the model's dtype, row-major order of ``positions``.
        """
        inputs = self.insert_context(
            input_ids,
            attention_mask,
            context_position,
            context_ids=context_ids,
            latents=latents,
            latent_mask=latent_mask,
        )
        return self._on_positions(selected_hidden_states, inputs, input_ids, positions, prefix)

    def _on_positions(self, select, inputs: TeacherInputs, input_ids: Tensor, positions: Tensor,
                      prefix: TeacherPrefix | None) -> Tensor:
        """``select(model, teacher_positions, **model_kwargs)`` under the teacher's scope, after ``prefix`` if given."""
        if tuple(positions.shape) != tuple(input_ids.shape):
            raise ValueError(f"positions has shape {tuple(positions.shape)}, input_ids {tuple(input_ids.shape)}")
        teacher_positions = _teacher_positions(inputs, positions)
        kwargs = inputs.model_kwargs()
        if prefix is not None and prefix.length > 0:
            n = prefix.length
            batch = input_ids.shape[0]
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
            kwargs = {k: (v if k == "attention_mask" else v[:, n:]) for k, v in kwargs.items()}
            kwargs["cache"] = prefix.cache()
            teacher_positions = teacher_positions[:, n:]
        needs_grad = inputs.inputs_embeds is not None and inputs.inputs_embeds.requires_grad
        with self.teacher_scope() as model, (nullcontext() if needs_grad else torch.no_grad()):
            out = select(model, teacher_positions, **kwargs)
        cache = kwargs.get("cache")
        if cache is not None and cache.get_seq_length() != inputs.attention_mask.shape[1]:
            # the decoder did not read the prefix (an unrecognised cache argument): never a silent wrong pass
            raise RuntimeError(
                f"the teacher's pass did not extend the {prefix.length}-token prefix cache "  # type: ignore[union-attr]
                f"({cache.get_seq_length()} of {inputs.attention_mask.shape[1]} positions); set "
                f"teacher_prefix_cache to false and report the transformers version"
            )
        return out

    @property
    def shares_student_weights(self) -> bool:
        """True when the student's forward computes the same states as the teacher's on tokens before the
        context: ``live`` mode and no dropout anywhere in the backbone (:func:`has_dropout`; conservative:
        a LoRA dropout on the composer's adapter, which is off in both passes, also counts). The student's
        key/value cache can then be the teacher's :class:`TeacherPrefix`."""
        return self.mode == "live" and self.shadow is None and not has_dropout(self.backbone)

    def own_prefix(self, input_ids: Tensor, attention_mask: Tensor, length: int) -> TeacherPrefix:
        """The teacher's keys and values of the first ``length`` tokens of each row, no gradient.

        Args:
            input_ids, attention_mask: (B, T) the student's batch, right padded.
            length: the prefix length, e.g. :func:`prefix_length`.
        """
        if not 0 < length <= input_ids.shape[1]:
            raise ValueError(f"prefix length must be in [1, {input_ids.shape[1]}], got {length}")
        mask = attention_mask[:, :length]
        with self.teacher_scope() as model, torch.no_grad():
            _, cache = decoder_hidden_states(
                model, return_cache=True, input_ids=input_ids[:, :length], attention_mask=mask,
                position_ids=position_ids_from_mask(mask),
            )
        return TeacherPrefix.from_cache(cache, length)

    def head_parameters(self) -> Head:
        """(weight, bias) of the teacher model's output head, see :func:`lopd_lightning.lm.lm_head_parameters`.

        The shared backbone's head for a LoRA student or ``live`` mode, else the frozen copy's. For a
        full-parameter student in ``live`` mode the weight requires grad outside :meth:`teacher_scope`:
        hold it constant with :func:`lopd_lightning.lm.constant_head`.
        """
        return lm_head_parameters(self.model)

    def teacher_logps(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        context_position: Tensor | Sequence[int],
        *,
        context_ids: Sequence[Sequence[int] | None] | None = None,
        latents: Tensor | None = None,
        latent_mask: Tensor | None = None,
        temperature: float = 1.0,
    ) -> Tensor:
        """log pi_T(input_ids[:, t+1] | s_<=t, context): (B, T-1) float32, see :func:`shifted_token_logps`."""
        logits = self.logits_on_student_positions(
            input_ids,
            attention_mask,
            context_position,
            context_ids=context_ids,
            latents=latents,
            latent_mask=latent_mask,
        )
        return shifted_token_logps(logits, input_ids, temperature=temperature)


def warm_start_loss(
    teacher: SelfTeacher,
    composer_output,
    input_ids: Tensor,
    attention_mask: Tensor,
    context_position: Tensor | Sequence[int],
    assistant_mask: Tensor,
) -> Tensor:
    """Composer cold start: L_init = -log pi_theta_bar(y* | s, c_phi), a masked token mean.

    Args:
        teacher: the self-teacher (its mode gives theta_bar).
        composer_output: :class:`lopd_lightning.memory.composer.ComposerOutput` (latents (B, L, d),
            latent_mask (B, L)) for the retrieved experiences of each row.
        input_ids: (B, T) long, successful trajectories y* with their prompts.
        attention_mask: (B, T) {0, 1}.
        context_position: (B,) long, where the first user message's content starts.
        assistant_mask: (B, T) {0, 1}, 1 on the assistant tokens of y* (aligned with ``input_ids``: the
            tokens to predict).

    Returns:
        () float32: ``-sum(mask * logp) / sum(mask)`` over the predicted tokens ``input_ids[:, 1:]`` with
        ``mask = assistant_mask[:, 1:] * attention_mask[:, 1:]``; 0 (still attached to the graph) when no
        token is masked in. Gradients reach the latents (the composer) only.

    Source: the composer cold start of LOPD (docs/METHOD.md section 5).
    """
    latents, latent_mask = composer_output[0], composer_output[1]
    mask = assistant_mask[:, 1:].bool() & attention_mask[:, 1:].bool()  # [B, T-1]
    positions = torch.cat([mask, mask.new_zeros(mask.shape[0], 1)], dim=1)  # logits that predict masked tokens
    logits = teacher.logits_on_student_positions(
        input_ids, attention_mask, context_position, latents=latents, latent_mask=latent_mask, positions=positions
    )  # [N, V]: the LM head runs on the N predicted tokens only
    logps = token_logps(logits[None], input_ids[:, 1:][mask][None])[0]
    loss = -logps.sum() / mask.sum().clamp(min=1).to(logps.dtype)
    if not loss.requires_grad and latents.requires_grad:  # no row had a latent: keep the graph for backward()
        loss = loss + 0.0 * latents.sum()
    return loss
