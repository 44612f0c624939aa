"""Rollouts: the student's trajectories in a task, as the token ids, masks and rewards every method trains on.

One concern per module:

- :mod:`~lopd_lightning.rollout.batch`: :class:`RolloutBatch` (the batch and its conventions: right
  padding, ``assistant_mask``, ``sampling_logps``, ``context_position``) and :class:`RolloutStats`.
- :mod:`~lopd_lightning.rollout.chat`: chat templates -> token ids (:func:`encode_prompt`,
  :func:`encode_observation`, :func:`tokenize_conversation`) and teacher-forced batches
  (:func:`batch_from_conversations`).
- :mod:`~lopd_lightning.rollout.sampling`: per-rollout seeds (:func:`derive_seed`) and the seeded sampler.
- :mod:`~lopd_lightning.rollout.backends`: generation behind one interface (:class:`GenerationBackend`,
  :class:`GenerationSession`, :class:`SamplingSettings`, :class:`Completion`; its contract) and
  :class:`HFGenerateBackend`.
- :mod:`~lopd_lightning.rollout.kv_reuse`: the HF backend's prefix reuse (the keys/values of contexts
  computed earlier in a session, found by their token ids).
- :mod:`~lopd_lightning.rollout.episodes`: the multi-turn episode loop on top of a backend
  (:func:`generate_rollouts`, :func:`warn_turn_limit`).

Every name below imports from ``lopd_lightning.rollout`` directly.
"""

from lopd_lightning.rollout.backends import (
    Completion,
    FinishReason,
    GenerationBackend,
    GenerationSession,
    HFGenerateBackend,
    SamplingSettings,
)
from lopd_lightning.rollout.batch import RolloutBatch, RolloutStats
from lopd_lightning.rollout.chat import (
    ChatTemplateError,
    PromptEncoding,
    batch_from_conversations,
    encode_observation,
    encode_prompt,
    render_chat,
    tokenize_conversation,
)
from lopd_lightning.rollout.episodes import (
    _TURN_LIMIT_WARNED,  # noqa: F401  (the tasks already warned about their turn limit; tests clear it)
    generate_rollouts,
    warn_turn_limit,
)
from lopd_lightning.rollout.sampling import derive_seed

__all__ = [
    "ChatTemplateError",
    "Completion",
    "FinishReason",
    "GenerationBackend",
    "GenerationSession",
    "HFGenerateBackend",
    "PromptEncoding",
    "RolloutBatch",
    "RolloutStats",
    "SamplingSettings",
    "batch_from_conversations",
    "derive_seed",
    "encode_observation",
    "encode_prompt",
    "generate_rollouts",
    "render_chat",
    "tokenize_conversation",
    "warn_turn_limit",
]
