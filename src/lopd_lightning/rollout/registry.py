"""The generation backends by config name (``model.init_args.generation_backend``) and their factory."""

from __future__ import annotations

from typing import Any

from lopd_lightning.rollout.backends import GenerationBackend, HFGenerateBackend

__all__ = ["BACKENDS", "make_backend"]


#: the generation backends by config name (``model.init_args.generation_backend``).
BACKENDS = ("hf", "vllm")


def make_backend(name: str, model: Any, tokenizer: Any, *, adapter: str | None = None,
                 options: dict[str, Any] | None = None) -> GenerationBackend:
    """The generation backend ``name`` for ``model`` (the student).

    Args:
        name: ``"hf"`` (:class:`~lopd_lightning.rollout.backends.HFGenerateBackend`, the default and the reference) or ``"vllm"``
            (:class:`~lopd_lightning.rollout.vllm_backend.VLLMBackend`, needs the ``vllm`` extra).
        adapter: the student's LoRA adapter, merged into the engine's weights (vLLM; None: full student).
        options: keyword options of the backend's constructor (``model.init_args.vllm_options`` for vLLM).

    Raises:
        ValueError: an unknown ``name`` (the message lists the known ones), or an unknown option.
        ImportError: ``"vllm"`` without vLLM installed (the message names the extra).
    """
    options = dict(options or {})
    if name == "hf":
        if options:
            raise ValueError(f"the hf backend takes no options, got {sorted(options)}")
        return HFGenerateBackend(model, tokenizer)
    if name == "vllm":
        from lopd_lightning.rollout.vllm_backend import VLLMBackend  # lazy: vLLM is an optional extra

        try:
            return VLLMBackend(model, tokenizer, adapter=adapter, **options)
        except TypeError as exc:
            if "unexpected keyword" not in str(exc):
                raise
            raise ValueError(f"model.init_args.vllm_options: {exc}; see VLLMBackend's arguments") from None
    raise ValueError(f"unknown generation backend {name!r}; choose one of {', '.join(BACKENDS)}")

