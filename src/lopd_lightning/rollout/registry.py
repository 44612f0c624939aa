"""The generation backends by config name (``model.init_args.generation_backend``) and their factory."""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

from lopd_lightning.rollout.backends import GenerationBackend, HFGenerateBackend

__all__ = ["BACKENDS", "VLLM_MAX_TEMPERATURE", "VLLM_SHARDED_REFUSAL", "check_vllm_options", "make_backend"]


#: the generation backends by config name (``model.init_args.generation_backend``).
BACKENDS = ("hf", "vllm")

#: the highest sampling temperature vLLM accepts (``SamplingParams``: "temperature must be in [0, 2]")
VLLM_MAX_TEMPERATURE = 2.0

#: the refusal of ``generation_backend: vllm`` under a sharded strategy (the module's and ``lopd fit``'s check)
VLLM_SHARDED_REFUSAL = ("model.init_args.generation_backend: vllm syncs each rank's engine from the whole student on "
                        "that rank, and a sharded trainer.strategy (FSDP, FSDP2, DeepSpeed) holds only a shard of it; "
                        "use trainer.strategy=ddp (one engine per rank) or generation_backend: hf")


def make_backend(name: str, model: Any, tokenizer: Any, *, adapter: str | None = None,
                 options: dict[str, Any] | None = None, local_rank: int | None = None) -> GenerationBackend:
    """The generation backend ``name`` for ``model`` (the student).

    Args:
        name: ``"hf"`` (:class:`~lopd_lightning.rollout.backends.HFGenerateBackend`, the default and the reference) or ``"vllm"``
            (:class:`~lopd_lightning.rollout.vllm_backend.VLLMBackend`, needs the ``vllm`` extra).
        adapter: the student's LoRA adapter, merged into the engine's weights (vLLM; None: full student).
        options: keyword options of the backend's constructor (``model.init_args.vllm_options`` for vLLM).
        local_rank: vLLM under data parallelism: this process's index on its machine (its cores on CPU, its
            GPU ``cuda:local_rank``); None: ``LOCAL_RANK``, else 0. The HF backend ignores it.

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
            return VLLMBackend(model, tokenizer, adapter=adapter, local_rank=local_rank, **options)
        except TypeError as exc:
            if "unexpected keyword" not in str(exc):
                raise
            raise ValueError(f"model.init_args.vllm_options: {exc}; see VLLMBackend's arguments") from None
    raise ValueError(f"unknown generation backend {name!r}; choose one of {', '.join(BACKENDS)}")


def check_vllm_options(options: dict[str, Any] | None, *, temperature: float | None = None,
                       student_dtype: Any = None, lora: bool = False) -> None:
    """Fail before any weight loads when ``generation_backend: vllm`` cannot work here.

    Args:
        options: ``model.init_args.vllm_options``.
        temperature: the rollouts' sampling temperature (None: not checked).
        student_dtype: the student's dtype (None: the engine dtype is not checked against it).
        lora: the student trains a LoRA adapter (merged into the engine's weights).

    Raises:
        ValueError: vLLM is not installed in this environment, ``options`` has a key
            :class:`~lopd_lightning.rollout.vllm_backend.VLLMBackend` does not take, ``threads`` or ``kv_cache_gib``
            is set but not an int >= 1 (:func:`~lopd_lightning.rollout.vllm_backend.check_option_count`),
            ``temperature`` is above
            :data:`VLLM_MAX_TEMPERATURE` (vLLM's ``SamplingParams`` would refuse it at the first rollouts), or the
            engine dtype cannot hold the student's merged weights
            (:func:`~lopd_lightning.rollout.vllm_backend.check_engine_dtype`); one line each, naming the config
            key and the fix.
    """
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("model.init_args.generation_backend: vllm needs vLLM, which this environment lacks; "
                         "run in the environment `make test-vllm` builds (.venv-vllm/bin/lopd) or use generation_backend: hf")
    from lopd_lightning.rollout.vllm_backend import (  # no vLLM import at module level
        COUNT_OPTIONS, VLLMBackend, check_engine_dtype, check_option_count)

    known = [n for n in inspect.signature(VLLMBackend.__init__).parameters if n not in ("self", "model", "tokenizer", "adapter", "local_rank")]
    unknown = sorted(set(options or {}) - set(known))
    if unknown:
        raise ValueError(f"model.init_args.vllm_options has unknown keys {unknown}; choose from {known}")
    for key in COUNT_OPTIONS:  # else refused only when an engine starts (threads: under DDP only), or ignored
        if (options or {}).get(key) is not None:
            check_option_count(key, options[key])
    if temperature is not None and temperature > VLLM_MAX_TEMPERATURE:
        raise ValueError(f"model.init_args.temperature={temperature}: vLLM samples at temperatures up to "
                         f"{VLLM_MAX_TEMPERATURE:g}; set it <= {VLLM_MAX_TEMPERATURE:g} or use generation_backend: hf")
    if student_dtype is not None:
        check_engine_dtype((options or {}).get("dtype", "float32"), student_dtype, lora=lora)

