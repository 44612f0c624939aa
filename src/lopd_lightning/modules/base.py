"""OnPolicyModule: what every method shares (the student, its rollouts, the update of one step).

A method (LOPD, GRPO, SDPO, OPSD, Skill-SD, SFT) is one subclass that implements ``training_step`` with
manual optimisation. Everything that is not the method lives in this base, so that all methods see the
same tasks, rollouts, budgets and logging tags (``train/...``, ``val/...``, ``time/...``,
``by_rollouts/...``). It is split by concern:

- this file: the student (loading, its adapter, its forward on a batch), the step's rollouts
  (:meth:`OnPolicyModule.make_batch`, the :class:`~lopd_lightning.data.RolloutSource` the DataModule
  calls), the shared reductions over ranks and the checkpointed state;
- :mod:`lopd_lightning.modules.hooked_task`: how the hooks below enter the rollout loop;
- :mod:`lopd_lightning.modules.optimization`: the guarded backward and optimiser steps (a non-finite
  loss or gradient never reaches the weights; one counted step per training step);
- :mod:`lopd_lightning.modules.evaluation`: greedy validation and test episodes, ``val/`` and ``test/``;
- :mod:`lopd_lightning.modules.observability`: the logged tags, the progress line, the samples shown as
  TensorBoard text and the generations files.

Public hooks a user overrides to adapt a method to a new task (see README "Your own task"):

- :meth:`OnPolicyModule.build_messages`: how an example becomes the student's first messages;
- :meth:`OnPolicyModule.score_trajectory`: how a finished trajectory is scored (reward in [0, 1]);
- :meth:`OnPolicyModule.experience_from_trajectory`: how a trajectory becomes a bank experience.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lopd_lightning.adapters import as_lora_config, check_lora_config, prepare_backbone, student_parameters, use_adapter
from lopd_lightning.checkpointing import enable_activation_checkpointing
from lopd_lightning.lm import position_ids_from_mask, selected_hidden_states, selected_logits, unpack
from lopd_lightning.losses import token_logps
from lopd_lightning.memory.experience import Experience
from lopd_lightning.models import describe, load_student
from lopd_lightning.modules.evaluation import EvaluationMixin
from lopd_lightning.modules.hooked_task import ModuleHookedTask
from lopd_lightning.modules.observability import ObservabilityMixin
from lopd_lightning.modules.optimization import OptimizationMixin
from lopd_lightning.modules.ranges import check_option_ranges
from lopd_lightning.rollout import RolloutBatch, batch_from_conversations, generate_rollouts
from lopd_lightning.rollout.backends import GenerationBackend
from lopd_lightning.rollout.registry import BACKENDS, VLLM_SHARDED_REFUSAL, check_vllm_options, make_backend
from lopd_lightning.sharding import gathered, is_fsdp2, shard_model
from lopd_lightning.tasks import Example, Message, Task, replay_references

log = logging.getLogger(__name__)

#: The student's adapter name when the student is trained with LoRA.
STUDENT_ADAPTER = "student"


class StudentForward(NamedTuple):
    """What :meth:`OnPolicyModule.student_forward` returns.

    Attributes:
        values: (N, V) logits or (N, d) final hidden states at the selected positions, packed row-major.
        cache: the forward's key/value cache (a transformers ``Cache``) or None when not asked for.
    """

    values: Tensor
    cache: Any | None


#: what to do with a checkpoint this version cannot restore
OTHER_CHECKPOINT = ("another version of lopd_lightning, or other settings, wrote it; retrain, or load it with the "
                    "settings and the lopd_lightning commit that wrote it")


def check_checkpoint(module: OnPolicyModule, checkpoint: dict[str, Any]) -> None:
    """Refuse, in one line, a checkpoint ``module`` cannot restore as it is: called before anything loads.

    Raises:
        ValueError: its ``lopd_state`` lacks an entry that :meth:`OnPolicyModule.on_save_checkpoint` writes
            (but ``val_history``, which older checkpoints lack and restore as empty),
            or (with ``strict_loading``) the names of its weights differ from the module's (e.g. another
            LoRA, composer or version); the message counts the names and shows one of each kind.
    """
    name = type(module).__name__
    state = checkpoint.get("lopd_state")
    wanted = {"rollouts_consumed", "non_finite_steps", *module.method_state()}
    missing_state = sorted(wanted - set(state)) if isinstance(state, dict) else ["lopd_state"]
    if missing_state:
        raise ValueError(f"this checkpoint has no {', '.join(missing_state)} in the state of {name}: {OTHER_CHECKPOINT}")
    saved = checkpoint.get("state_dict")
    if not isinstance(saved, dict) or not module.strict_loading:
        return
    own = set(module.state_dict())
    extra, absent = sorted(set(saved) - own), sorted(own - set(saved))
    if extra or absent:
        parts = [f"{len(keys)} {kind}, e.g. {keys[0]!r}" for kind, keys in (("unexpected", extra), ("missing", absent)) if keys]
        raise ValueError(f"this checkpoint's weights do not match {name}'s ({'; '.join(parts)}): {OTHER_CHECKPOINT}")


class OnPolicyModule(EvaluationMixin, ObservabilityMixin, OptimizationMixin):
    """Base of every method: owns the student, makes rollouts, validates, logs.

    Args:
        model: ``"tiny"``, ``"smollm2-135m-instruct"`` (packaged) or a local Hugging Face folder.
        dtype: weights dtype ("float32"; "bfloat16" on GPUs).
        lora: LoRA settings of the student (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``)
            or None for a full-parameter student.
        learning_rate: AdamW learning rate of the student.
        weight_decay: AdamW weight decay of the student.
        grad_clip: max global grad norm of the student's update (0 disables).
        group_size: rollouts (trajectories) per example per step (GRPO's group size G).
        temperature, top_p, top_k: sampling settings of training rollouts.
        max_new_tokens: token limit per assistant turn.
        max_turns: turn limit of multi-turn episodes (None: the rollout default).
        max_prompt_tokens: an episode whose context grows past this many tokens ends before its next turn
            (recorded as ``truncation="context"``).
        val_max_new_tokens: token limit per turn of validation episodes (None: ``max_new_tokens``).
        generation_batch_size: most episodes per generation call (None: all of a step's, or all of a
            validation batch's, at once); with a number the longest contexts go first, so similar lengths
            share a call and pad less. Tokens do not depend on it (per-rollout seeds). It does not bound
            the HF backend's prefix cache: while a rollout call runs, the keys/values of every live episode
            are kept across chunks (``rows x tokens x layers x 2 x kv_heads x head_dim x dtype bytes``).
        success_threshold: a trajectory with reward >= this counts as a success (``*/success_rate``).
        gradient_checkpointing: trade compute for activation memory: every decoder layer run in train mode
            with gradients (the student's pass; LOPD's composer encoder too) keeps only its input and is
            recomputed in the backward, under the adapter, ``requires_grad`` flags and train flags its
            forward ran with (:func:`~lopd_lightning.checkpointing.enable_activation_checkpointing`).
        validate_before_training: run the val split once before the first step, logged at step 0.
        seed: base seed of rollout sampling (each rank adds its rank).
        log_samples: trajectories shown as TensorBoard text (``samples/val``, ``samples/train``): the
            first ``log_samples`` val episodes of every validation (0: none).
        log_samples_every_n_steps: also show the first ``log_samples`` training trajectories of every
            n-th step (0: never).
        sample_prompt_chars: characters of the prompt's end shown in a sample (the replies and
            observations are shown whole).
        save_generations: write every validation episode (conversation, reward, success, turns,
            truncation, the checker's verdict) to ``<log_dir>/generations/val_step_<N>.jsonl`` (N: the
            training steps done); nothing is written without a logger.
        progress_every_n_steps: log one INFO line every n training steps (step, trajectories so far,
            reward, success, loss, seconds by phase; 0: none).
        generation_backend: ``"hf"`` (transformers' ``generate`` on the live student; the default and the
            reference) or ``"vllm"`` (an in-process vLLM engine, the ``vllm`` extra, one per rank under DDP; the
            student's weights, LoRA merged, are synced into it after every optimiser step; refused under FSDP,
            FSDP2 and DeepSpeed). See :mod:`lopd_lightning.rollout`.
        vllm_options: keyword options of :class:`~lopd_lightning.rollout.vllm_backend.VLLMBackend`
            (``dtype``, ``max_model_len``, ``kv_cache_gib``, ``enable_prefix_caching``, ``threads``: cores per rank
            on CPU under DDP, ``engine_options``).

    Raises:
        ValueError: ``group_size`` < 1, ``temperature`` <= 0 (with vLLM: above 2, which vLLM refuses), a negative
            logging option, an option out of its range (``modules.ranges.OPTION_RANGES``, a subclass's too), a
            bad LoRA setting or a vLLM engine dtype that cannot hold the student's merged weights (before the
            weights load: :func:`~lopd_lightning.rollout.vllm_backend.check_engine_dtype`).

    Nothing is logged or written for Lightning's sanity-check validation (``num_sanity_val_steps``). The
    k-th training step (the k-th optimiser step, 1-based) and the validation that runs after it are both
    logged at x = k under ``train/``, ``time/`` and ``val/`` (Lightning's own ``self.log`` under
    manual optimisation would file them under k - 1), the evaluation before training at x = 0, and at
    x = the trajectories generated so far under ``by_rollouts/``.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        dtype: str = "float32",
        lora: dict[str, Any] | None = None,
        learning_rate: float = 1e-5,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        group_size: int = 1,
        temperature: float = 0.7,
        top_p: float = 0.95,
        top_k: int = 20,
        max_new_tokens: int = 256,
        max_turns: int | None = None,
        max_prompt_tokens: int | None = None,
        val_max_new_tokens: int | None = None,
        generation_batch_size: int | None = None,
        success_threshold: float = 1.0,
        gradient_checkpointing: bool = False,
        validate_before_training: bool = False,
        seed: int = 0,
        log_samples: int = 4,
        log_samples_every_n_steps: int = 10,
        sample_prompt_chars: int = 400,
        save_generations: bool = True,
        progress_every_n_steps: int = 1,
        generation_backend: str = "hf",
        vllm_options: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()  # the arguments of the whole constructor chain: a method's own too
        check_option_ranges(self.hparams)  # before the weights load
        self.automatic_optimization = False
        if group_size < 1:
            raise ValueError(f"model.init_args.group_size must be >= 1, got {group_size}")
        if not temperature > 0:  # NaN too
            raise ValueError(f"model.init_args.temperature must be > 0 for training rollouts, got {temperature}")
        for key, value in (("log_samples", log_samples), ("log_samples_every_n_steps", log_samples_every_n_steps),
                           ("sample_prompt_chars", sample_prompt_chars), ("progress_every_n_steps", progress_every_n_steps)):
            if value < 0:
                raise ValueError(f"{key} must be >= 0 (0 = off), got {value}; set model.init_args.{key}")
        if generation_batch_size is not None and (isinstance(generation_batch_size, bool) or generation_batch_size < 1):
            raise ValueError(f"model.init_args.generation_batch_size must be null or an int >= 1, got {generation_batch_size!r}")
        if generation_backend not in BACKENDS:
            raise ValueError(f"model.init_args.generation_backend must be one of {', '.join(BACKENDS)}, "
                             f"got {generation_backend!r}")
        if generation_backend == "vllm":
            check_vllm_options(vllm_options, temperature=temperature, student_dtype=dtype, lora=lora is not None)
        if vllm_options and generation_backend != "vllm":
            raise ValueError("model.init_args.vllm_options is set but generation_backend is "
                             f"{generation_backend!r}; set model.init_args.generation_backend: vllm or drop vllm_options")
        check_lora_config(as_lora_config(lora, key="lora"), "lora")  # before the weights load; target_modules after
        self.model_name = model
        backbone, self.tokenizer = load_student(model, dtype=dtype, seed=seed)
        #: modules whose activation checkpoint recomputes under the forward's adapter state (0: none, or off)
        self.checkpointed_modules = enable_activation_checkpointing(backbone) if gradient_checkpointing else 0
        if gradient_checkpointing:
            backbone.config.use_cache = False
        backbone.train()  # from_pretrained returns eval mode; rollouts switch to eval and back themselves
        self.backbone = prepare_backbone(backbone, student_lora=lora)
        self.is_lora_student = lora is not None
        log.info("student %s (%s)", model, describe(backbone))
        self.rollouts_consumed = 0
        self.step_timings: dict[str, float] = {}
        self._backend: GenerationBackend | None = None
        self._backend_step = -1  # the global_step whose weights the backend samples from
        self._init_optimization()
        self._init_evaluation()
        self._init_observability()

    # ------------------------------------------------------------------ public hooks
    def build_messages(self, task: Task, example: Example) -> list[Message]:
        """The student's first messages for ``example`` (default: ``task.initial_messages``); every rollout and
        validation episode reads it through :class:`~lopd_lightning.modules.hooked_task.ModuleHookedTask`."""
        return task.initial_messages(example)

    def score_trajectory(self, task: Task, example: Example, messages: list[Message], reward: float) -> float:
        """The reward in [0, 1] of a finished trajectory (default: the environment's ``reward``); every rollout's
        reward goes through it (:class:`~lopd_lightning.modules.hooked_task.ModuleHookedEpisode`), as does
        :meth:`reference_trajectory`'s.

        Args:
            messages: the whole conversation (initial messages, replies, observations).
            reward: what the task's episode returned.
        """
        return reward

    def experience_from_trajectory(
        self, task: Task, example: Example, messages: list[Message], reward: float
    ) -> Experience | None:
        """The bank entry a trajectory becomes (None: keep nothing). Default: the task's trace text."""
        return Experience(
            task_id=example.id,
            task_text=example.text,
            trace=task.experience_text(example, messages),
            reward=float(reward),
            step=int(self.global_step),
        )

    # ------------------------------------------------------------------ rollouts
    @property
    def student(self) -> torch.nn.Module:
        """The shared backbone (a PeftModel); run it under :meth:`student_context` for the student."""
        return self.backbone

    def student_context(self):
        """Context manager that activates the student's weights on the shared backbone."""
        return use_adapter(self.backbone, STUDENT_ADAPTER if self.is_lora_student else None)

    def sampling_options(self, *, greedy: bool = False) -> dict[str, Any]:
        """Keyword options of :func:`~lopd_lightning.rollout.generate_rollouts` for this method."""
        hp = self.hparams
        options = dict(temperature=hp.temperature, top_p=hp.top_p, top_k=hp.top_k, max_new_tokens=hp.max_new_tokens,
                       max_prompt_tokens=hp.max_prompt_tokens, greedy=greedy)
        if hp.max_turns is not None:
            options["max_turns"] = hp.max_turns
        if greedy and hp.val_max_new_tokens is not None:
            options["max_new_tokens"] = hp.val_max_new_tokens
        if hp.get("generation_batch_size") is not None:
            options["generation_batch_size"] = hp.generation_batch_size
        return options

    def generation_backend(self) -> GenerationBackend:
        """The backend rollouts and evaluations generate with (``generation_backend``), sampling from the
        student's current weights: built on first use, and for an engine with weights of its own (vLLM)
        synced when they may have changed since the last sync: after an optimiser step (``global_step``
        moved), after a checkpoint load, or after :meth:`mark_weights_changed`. The HF backend runs the live
        student and needs no sync.

        Under data parallelism (DDP) each rank builds its own engine, all ranks together at their first rollouts
        or evaluation (vLLM creates its process groups collectively), on the rank's own cores (CPU) or its own
        training GPU, and syncs it from its own replica of the student (identical on every rank).

        Raises:
            ValueError: ``generation_backend: vllm`` under a sharded strategy (FSDP, FSDP2, DeepSpeed): a rank
                holds a shard of the student, not the whole weights an engine loads (one line naming
                ``model.init_args.generation_backend`` and the fix).
        """
        if self._backend is None:
            name = self.hparams.get("generation_backend", "hf")
            if name == "vllm" and self.sharded:
                raise ValueError(VLLM_SHARDED_REFUSAL)
            adapter = STUDENT_ADAPTER if self.is_lora_student else None
            with self.student_context():
                self._backend = make_backend(name, self.backbone, self.tokenizer, adapter=adapter,
                                             options=self.hparams.get("vllm_options"), local_rank=self.engine_local_rank())
            self._backend_step = int(self.global_step)
        elif self._backend_step != int(self.global_step):
            start = time.perf_counter()
            self._backend.sync_weights(self.backbone)
            if getattr(self._backend, "copies_weights", True):  # the HF backend runs the live student: nothing synced
                self.step_timings["weight_sync"] = time.perf_counter() - start
            self._backend_step = int(self.global_step)
        return self._backend

    def engine_local_rank(self) -> int:
        """The local rank a vLLM engine of this process is built for: the index of the training GPU on CUDA (the
        engine runs on ``cuda:<it>``), else the trainer's local rank (its block of cores on CPU), 0 without one."""
        if self.device.type == "cuda" and self.device.index is not None:
            return int(self.device.index)
        return int(self.local_rank) if self._trainer is not None else 0

    def mark_weights_changed(self) -> None:
        """Tell the generation backend that the student's weights changed outside an optimiser step (a
        checkpoint load does it itself): the next rollouts sync them first."""
        self._backend_step = -1

    def rollout_seed(self) -> int:
        """The sampling seed of this rank: ``seed + 7919 * rank`` (ranks sample different rollouts)."""
        return int(self.hparams.seed) + 7919 * int(self.global_rank)

    def retrieve(self, task: Task, examples: list[Example]) -> list[list[Experience]] | None:
        """Experiences retrieved for each example (None: the method uses no bank)."""
        return None

    def make_batch(self, task: Task, examples: list[Example]) -> RolloutBatch:
        """Generate this step's on-policy rollouts for ``examples``: the
        :class:`~lopd_lightning.data.RolloutSource` interface, which the DataModule calls once per
        training step (generation under the student adapter through
        :class:`~lopd_lightning.modules.hooked_task.ModuleHookedTask`, then retrieval of the experiences the
        teacher will see, then the trajectory count).

        Returns:
            A RolloutBatch with ``group_size`` trajectories per example (contiguous groups) and,
            for methods with a bank, ``experiences`` (one list per trajectory).
        """
        self.step_timings = {}
        backend = self.generation_backend()  # syncs an engine's weights first (timed apart: ``weight_sync``)
        start = time.perf_counter()
        with self.student_context(), self.whole_weights():
            batch = generate_rollouts(
                self.backbone,
                self.tokenizer,
                ModuleHookedTask(task, self),
                examples,
                group_size=self.hparams.group_size,
                seed=self.rollout_seed(),
                step=int(self.global_step),
                backend=backend,
                **self.sampling_options(),
            )
        self.step_timings["generation"] = time.perf_counter() - start
        start = time.perf_counter()
        experiences = self.retrieve(task, examples)  # for the teacher's context; the rollouts never see them
        if experiences is not None:  # a method without a bank logs no time/retrieval
            self.step_timings["retrieval"] = time.perf_counter() - start
        self.annotate(batch, examples)
        if experiences is not None:
            g = self.hparams.group_size
            batch.experiences = [experiences[i // g] for i in range(len(batch))]
        self.rollouts_consumed += self.global_count(len(batch))
        return batch

    def reference_trajectory(self, task: Task, example: Example) -> tuple[list[Message], float]:
        """The reference solution replayed through a fresh episode: (the whole conversation, its reward).

        The conversation holds the initial messages, the reference replies and the environment's
        observations; the reward goes through :meth:`score_trajectory` like a rollout's.
        """
        messages, reward = replay_references(task, example, list(self.build_messages(task, example)))
        return messages, self.score_trajectory(task, example, messages, reward)

    def reference_batch(self, task: Task, examples: list[Example]) -> RolloutBatch:
        """A teacher-forced batch of the examples' reference solutions, the conversations of
        :meth:`reference_trajectory` (reward 1, one row per example: SFT's and the composer warm start's data)."""
        conversations = [self.reference_trajectory(task, ex)[0] for ex in examples]
        batch = batch_from_conversations(
            self.tokenizer,
            conversations,
            rewards=[1.0] * len(examples),
            group_ids=list(range(len(examples))),
            example_ids=[ex.id for ex in examples],
            tools=[task.tools(ex) for ex in examples],
        )
        self.annotate(batch, examples)
        return batch

    @staticmethod
    def annotate(batch: RolloutBatch, examples: list[Example]) -> None:
        """Record each row's task text in ``batch.metadata[i]["task_text"]`` (rows follow ``example_ids``)."""
        text = {ex.id: ex.text for ex in examples}
        for meta, example_id in zip(batch.metadata, batch.example_ids, strict=True):
            meta["task_text"] = text[example_id]

    # ------------------------------------------------------------------ shared computations
    def global_count(self, n: int | Tensor) -> int:
        """Sum of ``n`` over all ranks (itself without a process group)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.as_tensor(n, dtype=torch.float64, device=self.device).clone()
            dist.all_reduce(t)
            return int(t.item())
        return int(n)

    def global_mean(self, value: Tensor) -> Tensor:
        """Mean of a scalar over all ranks (itself without a process group); no gradient."""
        value = value.detach().float()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            value = value.to(self.device).clone()  # NCCL reduces only tensors on the GPU
            dist.all_reduce(value)
            value = value / dist.get_world_size()
        return value

    def shifted(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """Targets and loss mask aligned with ``logits[:, :-1]``: ``(input_ids[:, 1:], assistant_mask[:, 1:])``."""
        return batch.input_ids[:, 1:], batch.assistant_mask[:, 1:].bool()

    def student_forward(
        self, batch: RolloutBatch, positions: Tensor, *, output: str = "logits", keep_cache: bool = False
    ) -> StudentForward:
        """The student's forward pass on the batch, its outputs kept only at ``positions``: the one pass every
        method's student loss reads (LOPD's and the self-distillation methods' logits or hidden states;
        :meth:`student_logps` for the log-probs of the batch's own tokens).

        Args:
            positions: (B, T-1) bool in shifted coordinates (e.g. the loss mask of :meth:`shifted`).
            output: ``"logits"`` (the LM head runs only at ``positions``: see :mod:`lopd_lightning.lm`) or
                ``"hidden"`` (the final hidden states after the final norm; the LM head is left to the caller).
            keep_cache: also keep the forward's key/value cache (a transformers ``Cache``, in the graph),
                for a teacher pass that starts after a prefix it shares with the student.

        Returns:
            :class:`StudentForward`: ``values`` packed (N, V) logits or (N, d) hidden states, N = the
            number of selected positions, row-major; ``cache`` or None.

        Raises:
            ValueError: an unknown ``output``, or ``keep_cache`` in train mode with ``gradient_checkpointing``
                (transformers' checkpointed layers drop the cache: it would come back empty).
        """
        if output not in ("logits", "hidden"):
            raise ValueError(f"output must be 'logits' or 'hidden', got {output!r}")
        if keep_cache and self.checkpointed_modules and self.backbone.training:
            raise ValueError("student_forward(keep_cache=True) under gradient_checkpointing: checkpointed layers "
                             "keep no key/value cache; compute the prefix without gradients instead")
        select = selected_logits if output == "logits" else selected_hidden_states
        with self.student_context():
            out = select(
                self.backbone,
                self.unshift(positions),
                return_cache=keep_cache,
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=position_ids_from_mask(batch.attention_mask),
            )
        return StudentForward(*out) if keep_cache else StudentForward(out, None)

    @staticmethod
    def unshift(positions: Tensor) -> Tensor:
        """(B, T-1) shifted-coordinate positions -> (B, T) model positions (a False column appended)."""
        return torch.cat([positions.bool(), positions.new_zeros(positions.shape[0], 1).bool()], dim=1)

    def student_logps(self, batch: RolloutBatch, *, temperature: float = 1.0) -> Tensor:
        """The student's log-probs log pi_S(a | s) of the batch's own tokens at its assistant tokens, unpacked:
        what GRPO's ratio and SFT's NLL read (:meth:`student_forward` gives the whole distribution, packed).

        Args:
            temperature: the logits are divided by it before the log-softmax.

        Returns:
            (B, T-1) float, in shifted coordinates (position t scores token t+1); 0 off the assistant mask.
        """
        targets, mask = self.shifted(batch)
        logits = self.student_forward(batch, mask).values  # [N, V]
        return unpack(token_logps(logits[None], targets[mask][None], temperature=temperature)[0], mask)

    def num_loss_tokens(self, batch: RolloutBatch, mask: Tensor | None = None) -> float:
        """The denominator of the global token mean on this rank: (loss tokens over all ranks) / W.

        Each rank divides its token sum by this; DDP then averages the gradients over the W ranks, so
        the update is the gradient of sum(all ranks' tokens) / (all ranks' token count): one large
        batch's (docs/METHOD.md 5). The loss value is the same on every rank once averaged over ranks.

        Args:
            mask: the loss tokens, (B, T-1) bool in shifted coordinates (default: every assistant token;
                a method that drops rows, e.g. SDPO without a successful sibling, passes its own).
        """
        if mask is None:
            _, mask = self.shifted(batch)
        return max(1, self.global_count(mask.sum())) / max(1, int(self.trainer.world_size) if self._trainer else 1)

    @contextmanager
    def timed(self, phase: str):
        """Adds the wall time of the block to ``time/<phase>`` of this step."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.step_timings[phase] = self.step_timings.get(phase, 0.0) + time.perf_counter() - start

    @property
    def sharded(self) -> bool:
        """True under a sharded strategy (FSDP, FSDP2 with ModelParallelStrategy, DeepSpeed), where every rank
        must run every forward of the backbone (each layer's all-gather is a collective): no rank may skip a
        teacher pass."""
        if self._trainer is None:
            return False
        from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

        return isinstance(self.trainer.strategy, (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy))

    @override
    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy`` only: shard the student's backbone, and every other causal
        LM the module holds (a full-parameter teacher's frozen copy), with FSDP2 over the data-parallel mesh
        (:func:`lopd_lightning.sharding.shard_model`). Under every other strategy it does nothing."""
        if self._trainer is None or not is_fsdp2(self.trainer.strategy):
            return
        mesh = self.device_mesh["data_parallel"]
        for model in self.sharded_models():
            shard_model(model, mesh)

    def sharded_models(self) -> list[torch.nn.Module]:
        """The causal LMs :meth:`configure_model` shards under FSDP2: the backbone and, where a teacher keeps
        one, its frozen copy of a full-parameter student. A method holding another one extends the list."""
        models = [self.backbone]
        shadow = getattr(getattr(self, "teacher", None), "shadow", None)
        if shadow is not None:
            models.append(shadow)
        return models

    def whole_weights(self):
        """Context manager for generation: under FSDP2 the student's weights are gathered whole for its
        duration (ranks generate different numbers of tokens; :func:`lopd_lightning.sharding.gathered`);
        nothing otherwise."""
        return gathered(self.backbone)

    def vocab_size(self) -> int:
        """Rows of the student's input embedding (the vocabulary the logits range over)."""
        return int(self.backbone.get_input_embeddings().weight.shape[0])

    def check_top_k(self, name: str, k: int) -> None:
        """Raise ValueError naming ``model.init_args.<name>`` when ``k`` exceeds the vocabulary."""
        vocab = self.vocab_size()
        if k > vocab:
            raise ValueError(f"{name}={k} is larger than the vocabulary ({vocab} tokens); set model.init_args.{name} <= {vocab}")

    # ------------------------------------------------------------------ checkpoints
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lopd_state"] = {
            "rollouts_consumed": self.rollouts_consumed,
            "non_finite_steps": self.non_finite_steps,
            # every validation so far, so that a resumed run's summary still has its step-0 "before"
            "val_history": [(int(step), {k: float(v) for k, v in values.items()})
                            for step, values in getattr(self, "val_history", [])],
            **self.method_state(),
        }

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_checkpoint(self, checkpoint)
        self.mark_weights_changed()  # an engine with its own weights (vLLM) syncs before its next rollouts
        #: the training steps of the weights last loaded from a checkpoint (``lopd validate --ckpt_path``'s label)
        self.checkpoint_step = int(checkpoint.get("global_step", 0))
        state = checkpoint["lopd_state"]
        self.rollouts_consumed = int(state["rollouts_consumed"])
        self.non_finite_steps = int(state["non_finite_steps"])
        # optional: a checkpoint written before val_history was saved restores an empty history
        self.val_history = [(int(step), dict(values)) for step, values in state.get("val_history", [])]
        self.load_method_state(state)

    def method_state(self) -> dict[str, Any]:
        """Extra state of the method that checkpoints carry (beta, the bank...). Default: none."""
        return {}

    def load_method_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`method_state` saved."""

    def student_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the student's optimiser updates (LoRA weights, or the whole backbone)."""
        return student_parameters(self.backbone)

    @override
    def configure_optimizers(self):
        return torch.optim.AdamW(
            self.student_parameters(), lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay
        )
