"""SelfTeacher: the teacher's passes on the student's positions, with a privileged context inserted.

The teacher reads the student's own conversation with a context inserted (:mod:`.splice`), runs under
its weights (:mod:`.weights`), optionally after a key/value prefix it shares with the student
(:mod:`.prefix_cache`), and returns its logits (or final hidden states) gathered back onto the student's
positions: ``out[b, t]`` is the teacher's distribution of the token that follows student token t.

Map to the method (docs/METHOD.md): section 4, pi_T(. | s, c_phi) = pi_theta_bar([s; c_phi]).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from peft import PeftModel
from torch import Tensor

from lopd_lightning.lm import selected_hidden_states, selected_logits
from lopd_lightning.teacher.prefix_cache import TeacherPrefix, after_prefix, check_prefix_read, prefix_from_model
from lopd_lightning.teacher.splice import (
    DEFAULT_FRAMING_PREFIX,
    DEFAULT_FRAMING_SUFFIX,
    Framing,
    TeacherInputs,
    check_splice_inputs,
    fit_contexts,
    frame_text,
    latent_contexts,
    place_latents,
    splice,
    student_to_teacher_positions,
)
from lopd_lightning.teacher.weights import TeacherMode, TeacherWeights
from lopd_lightning.text import encode_data

__all__ = ["SelfTeacher"]

ContextIds = Sequence[Sequence[int] | None]


class SelfTeacher(TeacherWeights):
    """The self-teacher on the shared backbone: context insertion, aligned logits (and the weights of
    :class:`~lopd_lightning.teacher.TeacherWeights`: modes, EMA, the scope of its passes).

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
        checkpoint_layers: checkpoint the decoder layers of the passes that record gradients for the
            latents (see :class:`~lopd_lightning.teacher.weights.TeacherWeights`).

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
        checkpoint_layers: bool = False,
    ) -> None:
        super().__init__(backbone, mode=mode, ema_rate=ema_rate, deterministic=deterministic,
                         checkpoint_layers=checkpoint_layers)
        self.tokenizer = tokenizer
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

    # ---------------------------------------------------------------- inputs
    def _tokenize(self, text: str) -> list[int]:
        """Ids of text inserted into the user message (framing, contexts): data, so special-token strings
        stay text (:func:`~lopd_lightning.text.encode_data`)."""
        return encode_data(self.tokenizer, text)

    @property
    def framing(self) -> Framing:
        """The latent contexts' framing ids and placeholder (:class:`~lopd_lightning.teacher.splice.Framing`)."""
        return Framing(self.prefix_ids, self.suffix_ids, self.placeholder_id)

    def frame_text_context(
        self, texts: Sequence[str | None], *, prefix: str | None = None, suffix: str | None = None
    ) -> list[str | None]:
        """The framed text contexts: ``prefix + text + suffix`` per row, the framing of every text context
        (LOPD's ``framing_prefix`` / ``framing_suffix`` by default: "Here is a reference example of a different,
        already solved task:\n" + text + "\nNow complete your task.\n\n").

        Args:
            texts: one per row; None or "" gives None (no context).
            prefix: text before (the teacher's ``framing_prefix`` when None; "" for none).
            suffix: text after (``framing_suffix`` when None).

        Returns:
            B framed texts (None where ``texts`` has None or "").
        """
        prefix = self.framing_prefix if prefix is None else prefix
        suffix = self.framing_suffix if suffix is None else suffix
        return [frame_text(text, prefix, suffix) for text in texts]

    def encode_text_context(
        self, texts: Sequence[str | None], *, prefix: str | None = None, suffix: str | None = None
    ) -> list[list[int]]:
        """Token ids of framed text contexts: :meth:`frame_text_context`'s ``prefix + text + suffix`` tokenised
        together as data (no special tokens added; special-token strings in them stay text: they go inside the
        user message).

        Args:
            texts: one per row; None or "" gives an empty context (nothing inserted).
            prefix: text before (the teacher's ``framing_prefix`` when None; "" for none).
            suffix: text after (``framing_suffix`` when None).

        Returns:
            B lists of ids for :meth:`insert_context` (``context_ids``).
        """
        framed = self.frame_text_context(texts, prefix=prefix, suffix=suffix)
        return [self._tokenize(text) if text is not None else [] for text in framed]

    def insert_context(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        context_position: Tensor | Sequence[int],
        *,
        context_ids: ContextIds | None = None,
        latents: Tensor | None = None,
        latent_mask: Tensor | None = None,
    ) -> TeacherInputs:
        """Insert each row's privileged context into the student's sequence at ``context_position``.

        Row b's context is ``prefix_ids + [placeholder] * L_b + suffix_ids`` with L_b = ``latent_mask[b].sum()``
        (latents), or ``context_ids[b]`` as given (text), or nothing when L_b = 0 / the ids are empty. A
        context that would not fit the model's ``max_length`` positions is cut (never the student's
        tokens; :func:`~lopd_lightning.teacher.splice.fit_contexts`). Rows are padded to
        T' = T + max_b C_b on the side the batch is padded on (:func:`~lopd_lightning.teacher.splice.splice`).

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
        pos = check_splice_inputs(input_ids, attention_mask, context_position, context_ids=context_ids, latents=latents)
        batch = input_ids.shape[0]
        num_slots = [0] * batch
        if latents is not None:
            contexts, num_slots, latent_mask = latent_contexts(latents, latent_mask, self.framing)
        elif context_ids is not None:
            contexts = [list(ids) if ids else [] for ids in context_ids]
        else:
            contexts = [[] for _ in range(batch)]
        if self.max_length is not None:
            lengths = attention_mask.sum(dim=1).tolist()
            contexts, num_slots, latent_mask, cut = fit_contexts(
                contexts, num_slots, latent_mask, lengths,
                max_length=self.max_length, framing=self.framing, cut_so_far=self.contexts_cut,
            )
            self.contexts_cut += cut
        slots = (len(self.prefix_ids), num_slots) if latents is not None else None
        inputs = splice(input_ids, attention_mask, pos, contexts, pad_id=self.pad_id, slots=slots)
        if latents is None or inputs.input_ids.shape[1] == input_ids.shape[1]:
            return inputs  # no latent to place: feed input_ids
        with self.teacher_scope() as model, torch.no_grad():
            token_embeds = model.get_input_embeddings()(inputs.input_ids)  # [B, T', d], constants
        assert latent_mask is not None
        return inputs._replace(inputs_embeds=place_latents(token_embeds, latents, latent_mask, inputs.latent_slots))

    # ---------------------------------------------------------------- forward
    def forward_inputs(self, inputs: TeacherInputs) -> Tensor:
        """Run the teacher on prepared inputs; (B, T', V) logits over the whole teacher sequence.

        Gradients are recorded only when ``inputs.inputs_embeds`` requires grad (the latents); the
        backbone's parameters are constants either way.
        """
        needs_grad = inputs.inputs_embeds is not None and inputs.inputs_embeds.requires_grad
        with self.teacher_scope(checkpointed=needs_grad) as model, (nullcontext() if needs_grad else torch.no_grad()):
            return model(**inputs.model_kwargs(), use_cache=False).logits

    def on_student_positions(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        context_position: Tensor | Sequence[int],
        *,
        positions: Tensor,
        output: str = "logits",
        context_ids: ContextIds | None = None,
        latents: Tensor | None = None,
        latent_mask: Tensor | None = None,
        prefix: TeacherPrefix | None = None,
    ) -> Tensor:
        """The teacher's outputs at the student's ``positions``, packed in row-major order of ``positions``.

        The teacher's side of :meth:`lopd_lightning.modules.base.OnPolicyModule.student_forward`.

        Args:
            positions: (B, T) bool on student positions.
            output: ``"logits"`` (N, V) (the LM head runs on the N positions only) or ``"hidden"``, the
                final hidden states (N, d) after the final norm (the caller applies the head:
                :class:`lopd_lightning.losses.lm_head.LMHead`).
            prefix: keys and values of the first ``prefix.length`` tokens (:class:`TeacherPrefix`, made
                with the teacher's weights): the pass then runs on the rest of the sequence only, forward
                and backward (same values up to float rounding). None of ``positions`` may fall in it,
                and every row's context must come after it.
            others: as in :meth:`insert_context`.

        Returns:
            (N, V) or (N, d) float in the model's dtype; differentiable in ``latents`` only.

        Raises:
            ValueError: an unknown ``output``, bad shapes (see :meth:`insert_context`), or a ``prefix``
                that does not fit.

        Source: pi_T(. | s, c_phi) = pi_theta_bar([s; c_phi]), docs/METHOD.md section 4.
        """
        if output not in ("logits", "hidden"):
            raise ValueError(f"output must be 'logits' or 'hidden', got {output!r}")
        inputs = self.insert_context(
            input_ids, attention_mask, context_position, context_ids=context_ids, latents=latents, latent_mask=latent_mask
        )
        if tuple(positions.shape) != tuple(input_ids.shape):
            raise ValueError(f"positions has shape {tuple(positions.shape)}, input_ids {tuple(input_ids.shape)}")
        teacher_positions = student_to_teacher_positions(inputs, positions)
        kwargs = inputs.model_kwargs()
        if prefix is not None and prefix.length > 0:
            kwargs, teacher_positions = after_prefix(prefix, inputs, teacher_positions, input_ids.shape[0])
        select = selected_logits if output == "logits" else selected_hidden_states
        needs_grad = inputs.inputs_embeds is not None and inputs.inputs_embeds.requires_grad
        checkpointed = needs_grad and kwargs.get("cache") is None  # a checkpointed layer would drop the prefix
        with self.teacher_scope(checkpointed=checkpointed) as model, (nullcontext() if needs_grad else torch.no_grad()):
            out = select(model, teacher_positions, **kwargs)
        if kwargs.get("cache") is not None:
            check_prefix_read(kwargs["cache"], prefix, inputs.attention_mask.shape[1])  # type: ignore[arg-type]
        return out

    def logits_on_student_positions(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        context_position: Tensor | Sequence[int],
        *,
        context_ids: ContextIds | None = None,
        latents: Tensor | None = None,
        latent_mask: Tensor | None = None,
        positions: Tensor | None = None,
        prefix: TeacherPrefix | None = None,
    ) -> Tensor:
        """The teacher's logits at the student's positions: (B, T, V), aligned like ``student(input_ids).logits``.

        With ``positions`` ((B, T) bool on student positions) only those logits are computed and returned
        packed, (N, V) in row-major order of ``positions`` (:meth:`on_student_positions`): the LM head then
        runs on N positions instead of B x T'.

        ``out[b, t]`` is the teacher's distribution of the token that follows student token t (so
        ``out[:, :-1]`` scores ``input_ids[:, 1:]``), whatever the context length and padding side. Pad
        positions hold logits of no meaning (mask them). Arguments as in :meth:`insert_context`.

        Args:
            prefix: as in :meth:`on_student_positions`; needs ``positions``.

        Returns:
            (B, T, V) float in the model's dtype, or packed (N, V) with ``positions``; differentiable in
            ``latents`` only.

        Raises:
            ValueError: bad shapes (see :meth:`insert_context`), or a ``prefix`` that does not fit.

        Source: pi_T(. | s, c_phi) = pi_theta_bar([s; c_phi]), docs/METHOD.md section 4.
        """
        context = dict(context_ids=context_ids, latents=latents, latent_mask=latent_mask)
        if positions is not None:
            return self.on_student_positions(
                input_ids, attention_mask, context_position, positions=positions, prefix=prefix, **context
            )
        if prefix is not None:
            raise ValueError("prefix needs positions (the logits of prefix tokens are not computed)")
        inputs = self.insert_context(input_ids, attention_mask, context_position, **context)
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
        context_ids: ContextIds | None = None,
        latents: Tensor | None = None,
        latent_mask: Tensor | None = None,
        prefix: TeacherPrefix | None = None,
    ) -> Tensor:
        """The teacher's final hidden states (after the final norm) at the student's ``positions``, packed (N, d).

        ``F.linear(out, *self.head_parameters())`` equals ``logits_on_student_positions(..., positions=positions)``
        (same rows, same order); :meth:`on_student_positions` with ``output="hidden"``.
        """
        return self.on_student_positions(
            input_ids, attention_mask, context_position, positions=positions, output="hidden",
            context_ids=context_ids, latents=latents, latent_mask=latent_mask, prefix=prefix,
        )

    def own_prefix(self, input_ids: Tensor, attention_mask: Tensor, length: int) -> TeacherPrefix:
        """The teacher's keys and values of the first ``length`` tokens of each row, no gradient.

        Args:
            input_ids, attention_mask: (B, T) the student's batch, right padded.
            length: the prefix length, e.g. :func:`~lopd_lightning.teacher.prefix_length`.

        Raises:
            ValueError: ``length`` outside [1, T].
        """
        if not 0 < length <= input_ids.shape[1]:
            raise ValueError(f"prefix length must be in [1, {input_ids.shape[1]}], got {length}")
        with self.teacher_scope() as model:
            return prefix_from_model(model, input_ids, attention_mask, length)
