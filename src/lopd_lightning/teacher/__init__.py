"""The latent-conditioned self-teacher pi_T(. | s, c_phi) = pi_theta_bar([s; c_phi]) (docs/METHOD.md section 4).

The teacher reads the student's own conversation s with a privileged context inserted at the start of
the first user message's content:

    ... <|im_start|>user\\n  [framing_prefix] [c_phi: L placeholder positions] [framing_suffix]  {x} ...

The placeholder positions' *input embeddings* are replaced by the latent tokens c_phi (built out of
place, so gradients reach the composer). The same insertion code takes a *text* context instead (token
ids per row: OPSD's reference solution, SDPO's successful sibling). A row without a context (empty bank,
J = 0, all latents masked, empty text) gets nothing inserted and its teacher pass is exactly the
student's sequence. The teacher's outputs are gathered back onto the student's positions, so they follow
the convention of ``student(input_ids).logits``: index t predicts token t+1. Positions come from the
attention mask (:func:`lopd_lightning.lm.position_ids_from_mask`), so padding and the inserted context
never shift them.

One concern per module, the public names re-exported here:

* :mod:`.splice`: sequence splicing, the teacher's input (:class:`TeacherInputs`, the framing texts).
* :mod:`.weights`: the teacher's weights theta_bar: modes ``live`` / ``base`` / ``ema``, the EMA update
  and the scope of its passes (:class:`TeacherWeights`).
* :mod:`.prefix_cache`: the key/value prefix the teacher shares with the student (:class:`TeacherPrefix`,
  :func:`prefix_length`, :func:`supports_prefix_cache`, :func:`has_dropout`).
* :mod:`.self_teacher`: :class:`SelfTeacher`, which puts them together (insert, run, gather back).
"""

from __future__ import annotations

from lopd_lightning.teacher.prefix_cache import TeacherPrefix, has_dropout, prefix_length, supports_prefix_cache
from lopd_lightning.teacher.self_teacher import SelfTeacher
from lopd_lightning.teacher.splice import (
    DEFAULT_FRAMING_PREFIX,
    DEFAULT_FRAMING_SUFFIX,
    FRAMINGS,
    TeacherInputs,
    frame_text,
    resolve_framing,
)
from lopd_lightning.teacher.weights import TEACHER_MODES, TeacherMode, TeacherWeights

__all__ = [
    "DEFAULT_FRAMING_PREFIX",
    "DEFAULT_FRAMING_SUFFIX",
    "FRAMINGS",
    "SelfTeacher",
    "TEACHER_MODES",
    "TeacherInputs",
    "TeacherMode",
    "TeacherPrefix",
    "TeacherWeights",
    "frame_text",
    "has_dropout",
    "prefix_length",
    "resolve_framing",
    "supports_prefix_cache",
]
