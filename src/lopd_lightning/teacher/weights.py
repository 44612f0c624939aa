"""The teacher's weights theta_bar: its mode (live, base, EMA), the EMA update, and the scope of its passes.

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
is a constant for the student's step, and only the latents (the composer) receive gradients.

Map to the method (docs/METHOD.md): section 4, the teacher modes live / base / ema (SDPO's EMA teacher,
section 6; OPSD's frozen one).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Literal

import torch
from peft import PeftModel
from torch import nn

from lopd_lightning.adapters import STUDENT, TEACHER_EMA, adapter_parameters, base_parameters, is_lora_student, use_adapter
from lopd_lightning.checkpointing import layers_checkpointed_in_eval
from lopd_lightning.losses.lm_head import Head, lm_head_parameters
from lopd_lightning.teacher.prefix_cache import has_dropout

log = logging.getLogger(__name__)

TeacherMode = Literal["live", "base", "ema"]
#: the values of :data:`TeacherMode`, in its order
TEACHER_MODES: tuple[str, ...] = ("live", "base", "ema")

__all__ = ["TEACHER_MODES", "TeacherMode", "TeacherWeights"]


@contextmanager
def _eval_mode(model: nn.Module, enabled: bool) -> Iterator[None]:
    """``model`` in eval mode inside (when ``enabled``), every module's train flag restored on exit."""
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


class TeacherWeights(nn.Module):
    """The teacher's weights on the shared backbone (the base of :class:`~lopd_lightning.teacher.SelfTeacher`).

    Args:
        backbone: the shared ``PeftModel`` (:func:`lopd_lightning.adapters.prepare_backbone`). Held
            without registration (not in this module's ``state_dict``; never copied for a LoRA student).
        mode: ``"live"`` (current student weights), ``"base"`` (initial weights) or ``"ema"`` (an EMA of
            the student, updated by :meth:`update_ema`). docs/METHOD.md section 4.
        ema_rate: EMA rate r: ``ema <- (1 - r) ema + r student`` (0.05 as in SDPO).
        deterministic: run the teacher pass in eval mode (no dropout); each module's train flag is
            restored afterwards.
        checkpoint_layers: the passes that record gradients (for the latents) checkpoint the model's decoder
            layers although in eval mode (:func:`~lopd_lightning.checkpointing.layers_checkpointed_in_eval`):
            set with activation checkpointing on the backbone, so the teacher's graph keeps each layer's
            input only.

    With a full-parameter student, ``base`` and ``ema`` hold one deepcopy of the backbone (registered as
    the submodule ``shadow``: saved in this module's ``state_dict``, moved with ``.to()``), frozen; a
    warning is logged. With a LoRA student no mode copies the backbone: ``ema`` adds the adapter
    ``"teacher_ema"`` (initialised to the student's LoRA, ``requires_grad`` False) to the shared backbone.

    Raises:
        ValueError: unknown mode or a rate outside [0, 1].
    """

    def __init__(self, backbone: PeftModel, *, mode: TeacherMode = "live", ema_rate: float = 0.05,
                 deterministic: bool = True, checkpoint_layers: bool = False) -> None:
        super().__init__()
        if mode not in TEACHER_MODES:
            raise ValueError(f"mode must be 'live', 'base' or 'ema', got {mode!r}")
        if not 0.0 <= ema_rate <= 1.0:
            raise ValueError(f"ema_rate must be in [0, 1], got {ema_rate}")
        self._backbone = (backbone,)  # a tuple: not registered, not copied
        self.mode: TeacherMode = mode
        self.ema_rate = ema_rate
        self.deterministic = deterministic
        self.checkpoint_layers = checkpoint_layers
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

    @property
    def shares_student_weights(self) -> bool:
        """True when the student's forward computes the same states as the teacher's on tokens before the
        context: ``live`` mode and no dropout anywhere in the backbone
        (:func:`~lopd_lightning.teacher.has_dropout`; conservative: a LoRA dropout on the composer's
        adapter, which is off in both passes, also counts). The student's key/value cache can then be
        the teacher's :class:`~lopd_lightning.teacher.TeacherPrefix`."""
        return self.mode == "live" and self.shadow is None and not has_dropout(self.backbone)

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
    def teacher_scope(self, *, checkpointed: bool = False) -> Iterator[nn.Module]:
        """The teacher's weights for the passes inside: the mode's adapter (composer LoRA off), every
        backbone parameter constant (``requires_grad`` off while inside), eval mode if ``deterministic``
        (then transformers' activation checkpointing, which acts in train mode only, leaves the pass alone
        and a key/value cache passed to it is used; in train mode a checkpointed layer would be recomputed
        under this scope's state, :class:`~lopd_lightning.checkpointing.ForwardStateRecompute`, but drops the cache).

        Args:
            checkpointed: the pass inside records gradients and has no key/value cache: with
                ``checkpoint_layers`` its decoder layers are checkpointed in eval mode too.

        Yields:
            the model to call (the backbone or its frozen copy).
        """
        model = self.model
        checkpoint = checkpointed and self.checkpoint_layers and self.deterministic
        with (use_adapter(model, self.adapter, grads="none"), _eval_mode(model, self.deterministic),
              layers_checkpointed_in_eval(model) if checkpoint else nullcontext()):
            yield model

    def head_parameters(self) -> Head:
        """(weight, bias) of the teacher model's output head, see :func:`lopd_lightning.losses.lm_head.lm_head_parameters`.

        The shared backbone's head for a LoRA student or ``live`` mode, else the frozen copy's. For a
        full-parameter student in ``live`` mode the weight requires grad outside :meth:`teacher_scope`:
        hold it constant with :func:`lopd_lightning.losses.lm_head.constant_head` (:class:`~lopd_lightning.losses.lm_head.LMHead`
        does).
        """
        return lm_head_parameters(self.model)
