"""OnPolicyModule: what every method shares (student, rollouts, validation, logging, hooks).

A method (LOPD, GRPO, SDPO, OPSD, SFT) is one subclass that implements ``training_step`` with manual
optimisation. Everything that is not the method lives here, so that all methods see the same tasks,
rollouts, budgets and logging tags (``train/...``, ``val/...``, ``time/...``, ``by_rollouts/...``).

Public hooks a user overrides to adapt a method to a new task (see README "Your own task"):

- :meth:`OnPolicyModule.build_messages`: how an example becomes the student's first messages;
- :meth:`OnPolicyModule.score_trajectory`: how a finished trajectory is scored (reward in [0, 1]);
- :meth:`OnPolicyModule.experience_from_trajectory`: how a trajectory becomes a bank experience.
"""

from __future__ import annotations

import json
import logging
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from torchmetrics import MeanMetric
from typing_extensions import override

from lopd_lightning.adapters import as_lora_config, check_lora_config, prepare_backbone, student_parameters, use_adapter
from lopd_lightning.deprecation import warn_once
from lopd_lightning.lm import selected_hidden_states, selected_logits, unpack
from lopd_lightning.losses import token_logps
from lopd_lightning.teacher import position_ids_from_mask
from lopd_lightning.memory.bank import Experience
from lopd_lightning.models import describe, load_student
from lopd_lightning.rollout import RolloutBatch, batch_from_conversations, generate_rollouts
from lopd_lightning.tasks import Episode, Example, Message, StepResult, Task

log = logging.getLogger(__name__)

#: The student's adapter name when the student is trained with LoRA.
STUDENT_ADAPTER = "student"

#: Short names of the ``step_timings`` phases in the progress line.
PHASE_NAMES = {"generation": "gen", "student_step": "student", "composer_step": "composer"}


class StudentForward(NamedTuple):
    """What :meth:`OnPolicyModule.student_forward` returns.

    Attributes:
        values: (N, V) logits or (N, d) final hidden states at the selected positions, packed row-major.
        cache: the forward's key/value cache (a transformers ``Cache``) or None when not asked for.
    """

    values: Tensor
    cache: Any | None


def _fenced(text: str) -> str:
    """``text`` in a markdown code fence longer than any run of backticks inside it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def _md_escape(text: str) -> str:
    """``text`` with markdown's special characters escaped (for short labels outside code fences)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([\\`*_{}\[\]()#+\-.!|~])", r"\\\1", text)


class _HookedEpisode(Episode):
    """An episode whose reward goes through the module's :meth:`OnPolicyModule.score_trajectory`."""

    def __init__(self, module: OnPolicyModule, task: Task, example: Example, inner: Episode):
        self.module, self.task, self.example, self.inner = module, task, example, inner
        self.messages: list[Message] = list(module.build_messages(task, example))

    def step(self, reply: str) -> StepResult:
        result = self.inner.step(reply)
        self.messages.append({"role": "assistant", "content": reply})
        self.messages.extend(result.messages)
        return result

    def reward(self) -> float:
        return self.module.score_trajectory(self.task, self.example, self.messages, self.inner.reward())


class _HookedTask(Task):
    """A view of ``task`` whose messages and rewards come from the module's public hooks."""

    def __init__(self, module: OnPolicyModule, task: Task):
        self.module, self.task = module, task
        self.name, self.multi_turn = task.name, task.multi_turn
        # a task's own turn limit, read by generate_rollouts when the method sets none
        self.max_turns = getattr(task, "max_turns", None)

    def all_examples(self):
        return self.task.all_examples()

    def examples(self, split="train"):
        return self.task.examples(split)

    def initial_messages(self, example):
        return self.module.build_messages(self.task, example)

    def tools(self, example):
        return self.task.tools(example)

    def reference_solution(self, example):
        return self.task.reference_solution(example)

    def reference_replies(self, example):
        return self.task.reference_replies(example)

    def start(self, example):
        return _HookedEpisode(self.module, self.task, example, self.task.start(example))

    def experience_text(self, example, messages):
        return self.task.experience_text(example, messages)


def drop_stale_composer_weights(module: torch.nn.Module, checkpoint: dict[str, Any]) -> list[str]:
    """Remove from ``checkpoint["state_dict"]`` the composer-adapter weights a module without a composer
    cannot hold, with one warning; returns the keys removed.

    Checkpoints of GRPO, SDPO, OPSD, Skill-SD and SFT written before this was fixed carried an untrained
    composer LoRA (``...lora_A.composer.weight``) that these methods no longer have; without this, resuming
    or exporting such a checkpoint fails with "Unexpected key(s)". Called before the state dict loads.
    """
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict):
        return []
    own = set(module.state_dict())
    stale = [k for k in state if ".composer." in k and k not in own]
    for key in stale:
        del state[key]
    if stale:
        log.warning("this checkpoint holds %d composer-adapter weights that %s has no use for (an earlier "
                    "version gave every method an untrained composer); they are ignored", len(stale),
                    type(module).__name__)
    return stale


class OnPolicyModule(LightningModule):
    """Base of every method: owns the student, makes rollouts, validates, logs.

    Args:
        model: ``"tiny"``, ``"smollm2-135m-instruct"`` (packaged) or a local Hugging Face folder.
        dtype: weights dtype ("float32"; "bfloat16" on GPUs).
        lora: LoRA settings of the student (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``)
            or None for a full-parameter student.
        learning_rate: AdamW learning rate of the student.
        weight_decay: AdamW weight decay of the student.
        grad_clip: max global grad norm of the student's update (0 disables).
        rollouts_per_example: trajectories per example per step (GRPO's group size G).
        temperature, top_p, top_k: sampling settings of training rollouts.
        max_new_tokens: token limit per assistant turn.
        max_turns: turn limit of multi-turn episodes (None: the rollout default).
        max_prompt_tokens: an episode whose context grows past this many tokens ends before its next turn
            (recorded as ``truncation="context"``).
        val_max_new_tokens: token limit per turn of validation episodes (None: ``max_new_tokens``).
        success_threshold: a trajectory with reward >= this counts as a success (``*/success_rate``).
        gradient_checkpointing: trade compute for activation memory in the student's backward.
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

    Nothing is logged or written for Lightning's sanity-check validation (``num_sanity_val_steps``). The
    validation that runs after training step k is logged at x = k under ``val/`` (Lightning's own
    ``self.log`` would file it under k - 1) and at x = the trajectories generated so far under
    ``by_rollouts/``.
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
        rollouts_per_example: int = 1,
        temperature: float = 0.7,
        top_p: float = 0.95,
        top_k: int = 20,
        max_new_tokens: int = 256,
        max_turns: int | None = None,
        max_prompt_tokens: int | None = None,
        val_max_new_tokens: int | None = None,
        success_threshold: float = 1.0,
        gradient_checkpointing: bool = False,
        validate_before_training: bool = False,
        seed: int = 0,
        log_samples: int = 4,
        log_samples_every_n_steps: int = 10,
        sample_prompt_chars: int = 400,
        save_generations: bool = True,
        progress_every_n_steps: int = 1,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        if rollouts_per_example < 1:
            raise ValueError(f"model.init_args.rollouts_per_example must be >= 1, got {rollouts_per_example}")
        if temperature <= 0:
            raise ValueError(f"model.init_args.temperature must be > 0 for training rollouts, got {temperature}")
        for key, value in (("log_samples", log_samples), ("log_samples_every_n_steps", log_samples_every_n_steps),
                           ("sample_prompt_chars", sample_prompt_chars), ("progress_every_n_steps", progress_every_n_steps)):
            if value < 0:
                raise ValueError(f"{key} must be >= 0 (0 = off), got {value}; set model.init_args.{key}")
        for key, config in (("lora", lora), ("composer_lora", self.composer_lora_config())):
            check_lora_config(as_lora_config(config, key=key), key)  # before the weights load; target_modules after
        self.model_name = model
        backbone, self.tokenizer = load_student(model, dtype=dtype, seed=seed)
        if gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            backbone.config.use_cache = False
        backbone.train()  # from_pretrained returns eval mode; rollouts switch to eval and back themselves
        self.backbone = prepare_backbone(backbone, student_lora=lora, composer_lora=self.composer_lora_config())
        self.is_lora_student = lora is not None
        log.info("student %s (%s)", model, describe(backbone))
        self.rollouts_consumed = 0
        #: training steps whose update was skipped because a loss or a gradient norm was not finite.
        self.non_finite_steps = 0
        self._skip_update = False  # set by manual_backward on a non-finite loss; read through update_skipped
        self.step_timings: dict[str, float] = {}
        self.val_reward = MeanMetric()
        self.val_success = MeanMetric()
        self.val_turns = MeanMetric()
        #: the batches of the current evaluation (samples and the generations file; reset by log_evaluation).
        self.eval_batches: list[RolloutBatch] = []
        #: reward, success rate and loss of the last training step (the progress line).
        self.last_step_values: dict[str, float] = {}

    # ------------------------------------------------------------------ public hooks
    def build_messages(self, task: Task, example: Example) -> list[Message]:
        """The student's first messages for ``example`` (default: ``task.initial_messages``)."""
        return task.initial_messages(example)

    def score_trajectory(self, task: Task, example: Example, messages: list[Message], reward: float) -> float:
        """The reward in [0, 1] of a finished trajectory (default: the environment's ``reward``).

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

    def composer_lora_config(self) -> dict[str, Any] | None:
        """LoRA settings of a composer adapter on the shared backbone (None, the default: the method has no
        composer, and the backbone no composer parameter, which DDP would find unused)."""
        return None

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
        options = dict(
            temperature=hp.temperature,
            top_p=hp.top_p,
            top_k=hp.top_k,
            max_new_tokens=hp.max_new_tokens,
            max_prompt_tokens=hp.max_prompt_tokens,
            greedy=greedy,
        )
        if hp.max_turns is not None:
            options["max_turns"] = hp.max_turns
        if greedy and hp.val_max_new_tokens is not None:
            options["max_new_tokens"] = hp.val_max_new_tokens
        return options

    def rollout_seed(self) -> int:
        """The sampling seed of this rank: ``seed + 7919 * rank`` (ranks sample different rollouts)."""
        return int(self.hparams.seed) + 7919 * int(self.global_rank)

    def retrieve(self, task: Task, examples: list[Example]) -> list[list[Experience]] | None:
        """Experiences retrieved for each example (None: the method uses no bank)."""
        return None

    def make_batch(self, task: Task, examples: list[Example]) -> RolloutBatch:
        """Generate this step's on-policy rollouts for ``examples`` (called by the DataModule).

        Returns:
            A RolloutBatch with ``rollouts_per_example`` trajectories per example (contiguous groups) and,
            for methods with a bank, ``experiences`` (one list per trajectory).
        """
        self.step_timings = {}
        start = time.perf_counter()
        experiences = self.retrieve(task, examples)
        self.step_timings["retrieval"] = time.perf_counter() - start
        start = time.perf_counter()
        with self.student_context():
            batch = generate_rollouts(
                self.backbone,
                self.tokenizer,
                _HookedTask(self, task),
                examples,
                num_rollouts_per_example=self.hparams.rollouts_per_example,
                seed=self.rollout_seed(),
                step=int(self.global_step),
                **self.sampling_options(),
            )
        self.step_timings["generation"] = time.perf_counter() - start
        self.annotate(batch, examples)
        if experiences is not None:
            g = self.hparams.rollouts_per_example
            batch.experiences = [experiences[i // g] for i in range(len(batch))]
        self.rollouts_consumed += self.global_count(len(batch))
        return batch

    def reference_trajectory(self, task: Task, example: Example) -> tuple[list[Message], float]:
        """The reference solution replayed through a fresh episode: (the whole conversation, its reward).

        The conversation holds the initial messages, the reference replies and the environment's
        observations; the reward goes through :meth:`score_trajectory` like a rollout's.
        """
        messages = list(self.build_messages(task, example))
        episode = task.start(example)
        for reply in task.reference_replies(example):
            result = episode.step(reply)
            messages.append({"role": "assistant", "content": reply})
            messages.extend(result.messages)
            if result.done:
                break
        return messages, self.score_trajectory(task, example, messages, episode.reward())

    def reference_conversation(self, task: Task, example: Example) -> list[Message]:
        """The conversation of :meth:`reference_trajectory` (teacher-forced SFT and warm-start data)."""
        return self.reference_trajectory(task, example)[0]

    def reference_batch(self, task: Task, examples: list[Example]) -> RolloutBatch:
        """A teacher-forced batch of the examples' reference solutions (reward 1, one per example)."""
        conversations = [self.reference_conversation(task, ex) for ex in examples]
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
            value = value.clone()
            dist.all_reduce(value)
            value = value / dist.get_world_size()
        return value

    def shifted(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """Targets and loss mask aligned with ``logits[:, :-1]``: ``(input_ids[:, 1:], assistant_mask[:, 1:])``."""
        return batch.input_ids[:, 1:], batch.assistant_mask[:, 1:].bool()

    def student_forward(
        self, batch: RolloutBatch, positions: Tensor, *, output: str = "logits", keep_cache: bool = False
    ) -> StudentForward:
        """The student's forward pass on the batch, its outputs kept only at ``positions``.

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
            ValueError: an unknown ``output``.
        """
        if output not in ("logits", "hidden"):
            raise ValueError(f"output must be 'logits' or 'hidden', got {output!r}")
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

    def student_logits(self, batch: RolloutBatch, positions: Tensor | None = None, **deprecated: Any) -> Tensor:
        """Logits of the student on the batch; position t predicts token t+1.

        Args:
            positions: (B, T-1) bool in shifted coordinates (e.g. the loss mask of :meth:`shifted`), or None.

        Returns:
            (B, T-1, V) without ``positions``; packed (N, V) at the selected positions with them (the LM
            head runs only there). For the key/value cache too, use :meth:`student_forward`.
        """
        if deprecated.pop("return_cache", False):
            warn_once("student_logits.return_cache", "student_logits(..., return_cache=True) is deprecated; use "
                      "student_forward(batch, positions, keep_cache=True), which returns a StudentForward")
            if positions is None:
                raise ValueError("student_logits(return_cache=True) needs positions; use student_forward")
            return tuple(self.student_forward(batch, positions, keep_cache=True))  # type: ignore[return-value]
        if deprecated:
            raise TypeError(f"student_logits() got unexpected keyword arguments {sorted(deprecated)}")
        if positions is not None:
            return self.student_forward(batch, positions).values
        with self.student_context():
            return selected_logits(
                self.backbone,
                None,
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=position_ids_from_mask(batch.attention_mask),
            )[:, :-1]

    @staticmethod
    def unshift(positions: Tensor) -> Tensor:
        """(B, T-1) shifted-coordinate positions -> (B, T) model positions (a False column appended)."""
        return torch.cat([positions.bool(), positions.new_zeros(positions.shape[0], 1).bool()], dim=1)

    def student_logps(self, batch: RolloutBatch, *, temperature: float = 1.0) -> Tensor:
        """(B, T-1) log-probs of the batch's tokens under the student on the assistant tokens (0 elsewhere)."""
        targets, mask = self.shifted(batch)
        logits = self.student_logits(batch, mask)
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
        """True under a sharded strategy (FSDP, DeepSpeed), where every rank must run every forward of
        the backbone (each layer's all-gather is a collective): no rank may skip a teacher pass."""
        if self._trainer is None:
            return False
        from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

        return isinstance(self.trainer.strategy, (FSDPStrategy, DeepSpeedStrategy))

    def vocab_size(self) -> int:
        """Rows of the student's input embedding (the vocabulary the logits range over)."""
        return int(self.backbone.get_input_embeddings().weight.shape[0])

    def check_top_k(self, name: str, k: int) -> None:
        """Raise ValueError naming ``model.init_args.<name>`` when ``k`` exceeds the vocabulary."""
        vocab = self.vocab_size()
        if k > vocab:
            raise ValueError(f"{name}={k} is larger than the vocabulary ({vocab} tokens); set model.init_args.{name} <= {vocab}")

    def all_ranks_true(self, flag: bool) -> bool:
        """True when ``flag`` holds on every rank (one all-reduce under DDP; ``flag`` itself otherwise)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor(0.0 if flag else 1.0, device=self.device)
            dist.all_reduce(t)
            return bool(t.item() == 0)
        return bool(flag)

    @override
    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward of ``loss``, unless it is not finite on some rank: then no rank runs it, a warning is
        logged, ``non_finite_steps`` counts the step and :meth:`clip_and_step` skips this step's updates,
        so a NaN or inf (from the logits, a reward or the loss) never reaches the weights. The decision is
        all-reduced, so DDP ranks skip together and never wait on each other."""
        if self.all_ranks_true(bool(torch.isfinite(loss.detach()).all())):
            super().manual_backward(loss, *args, **kwargs)
            return
        if not self._skip_update:
            self.non_finite_steps += 1
            log.warning(
                "non-finite loss at step %d (%s on this rank): the step's update is skipped (%d skipped so far)",
                self.global_step, float(loss.detach().float().sum()), self.non_finite_steps,
            )
        self._skip_update = True

    @property
    def update_skipped(self) -> bool:
        """True from a :meth:`manual_backward` that skipped a non-finite loss until this step's
        :meth:`clip_and_step`: no optimiser of this step may update the weights."""
        return self._skip_update

    def step_uncounted(self, optimizer, clip_grads) -> Tensor:
        """Step ``optimizer`` without advancing ``trainer.global_step``, then zero its gradients.

        For every optimiser step of a training step except the one :meth:`clip_and_step` counts (GRPO's
        extra PPO passes, LOPD's composer). It steps the raw torch optimiser: a ``LightningOptimizer``
        step would advance ``global_step`` again.

        Args:
            optimizer: a ``LightningOptimizer`` (from :meth:`optimizers`) or a torch optimiser.
            clip_grads: called once to clip the gradients; returns the grad norm (a tensor, or several:
                every one must be finite for the update to happen).

        Returns:
            () float: the largest norm ``clip_grads`` returned, or nan when the step was skipped
            (:attr:`update_skipped`). A non-finite norm skips the update and counts in ``non_finite_steps``.
        """
        raw = getattr(optimizer, "optimizer", optimizer)
        if self._skip_update:  # a non-finite loss this step: no optimiser may update the weights
            raw.zero_grad(set_to_none=True)
            return torch.tensor(float("nan"))
        out = clip_grads()
        parts = out if isinstance(out, (tuple, list)) else (out,)
        norms = torch.stack([torch.as_tensor(n, dtype=torch.float32).detach().reshape(()) for n in parts]) if parts else torch.zeros(0)
        if bool(torch.isfinite(norms).all()):
            raw.step()
        else:
            self.non_finite_steps += 1
            log.warning("non-finite grad norm at step %d (uncounted optimiser step): update skipped (%d so far)",
                        self.global_step, self.non_finite_steps)
        raw.zero_grad(set_to_none=True)
        return norms.max() if norms.numel() else torch.zeros(())

    def clip_and_step(self, optimizer, params, max_norm: float) -> Tensor:
        """Clip ``params``' grad norm to ``max_norm`` (0: no clip), step and zero the optimiser.

        Use it for the one optimiser per training step that Lightning counts (``trainer.global_step``
        advances by one per ``LightningOptimizer.step`` call under manual optimisation): a non-finite
        norm skips the update but still counts the step, so ``max_steps`` means training steps.

        Returns:
            () float: the grad norm before clipping (inf/nan when non-finite, or nan when
            :meth:`manual_backward` skipped a non-finite loss; the update is then skipped).
        """
        params = [p for p in params if p.grad is not None]
        if self._skip_update:  # a non-finite loss this step (manual_backward): no update, the step counts
            self._skip_update = False
            optimizer.zero_grad(set_to_none=True)
            optimizer.step()
            return torch.tensor(float("nan"))
        if not params:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return torch.zeros(())
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if not torch.isfinite(norm):
            self.non_finite_steps += 1
            log.warning("non-finite grad norm at step %d: update skipped (%d so far)", self.global_step, self.non_finite_steps)
            optimizer.zero_grad(set_to_none=True)  # torch optimisers skip parameters whose grad is None
        optimizer.step()  # always called: it is what advances trainer.global_step under manual optimisation
        optimizer.zero_grad(set_to_none=True)
        return norm.detach()

    # ------------------------------------------------------------------ logging
    def log_rollout_metrics(self, batch: RolloutBatch, metrics: dict[str, float | Tensor]) -> None:
        """Log the shared ``train/``, ``time/`` and ``by_rollouts/`` tags of one step."""
        rewards = batch.rewards.float()
        success = (rewards >= self.hparams.success_threshold).float()
        shared = {
            "train/reward_mean": self.global_mean(rewards.mean()),
            "train/success_rate": self.global_mean(success.mean()),
            "train/rollouts": float(self.rollouts_consumed),
            "train/non_finite_steps": float(self.non_finite_steps),
        }
        values = {**shared, **{k: (v.detach() if isinstance(v, Tensor) else v) for k, v in metrics.items()}}
        for phase, seconds in self.step_timings.items():
            values[f"time/{phase}"] = seconds
        self.log_dict({k: float(v) for k, v in values.items()}, on_step=True, on_epoch=False, batch_size=len(batch))
        self.last_step_values = {
            "reward": float(shared["train/reward_mean"]),
            "success": float(shared["train/success_rate"]),
            **({"loss": float(values["train/loss"])} if "train/loss" in values else {}),
        }
        self.log("reward", float(shared["train/reward_mean"]), prog_bar=True, logger=False, batch_size=len(batch))
        self.log("rollouts", float(self.rollouts_consumed), prog_bar=True, logger=False, batch_size=len(batch))
        self.log_by_rollouts({k.split("/", 1)[1]: v for k, v in values.items() if k.startswith("train/")})

    def log_by_rollouts(self, values: dict[str, float | Tensor]) -> None:
        """Write ``by_rollouts/<name>`` scalars whose x-axis is the cumulative trajectory count."""
        if self.global_rank != 0:
            return
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                for name, value in values.items():
                    logger.experiment.add_scalar(f"by_rollouts/{name}", float(value), self.rollouts_consumed)

    # ------------------------------------------------------------------ validation
    def evaluate_examples(self, task: Task, examples: list[Example]) -> RolloutBatch:
        """Greedy episodes of the current student on ``examples`` (one trajectory each)."""
        with self.student_context():
            return generate_rollouts(
                self.backbone,
                self.tokenizer,
                _HookedTask(self, task),
                examples,
                num_rollouts_per_example=1,
                seed=self.hparams.seed,
                step=0,
                **self.sampling_options(greedy=True),
            )

    @override
    def validation_step(self, examples: list[Example], batch_idx: int) -> None:
        batch = self.evaluate_examples(self.trainer.datamodule.task, examples)
        rewards = batch.rewards.float().to(self.device)
        self.val_reward.update(rewards)
        self.val_success.update((rewards >= self.hparams.success_threshold).float())
        self.val_turns.update(torch.tensor([float(m.get("turns", 1)) for m in batch.metadata]))
        self.eval_batches.append(batch)

    @override
    def on_validation_epoch_end(self) -> None:
        if self._trainer is not None and self.trainer.sanity_checking:
            self.reset_evaluation()  # Lightning's sanity check: nothing logged, written or remembered
            return
        values = self.log_evaluation("val")
        if values is None:
            return
        self.last_val = values
        self.val_history = getattr(self, "val_history", []) + [(int(self.global_step), self.last_val)]

    @override
    def test_step(self, examples: list[Example], batch_idx: int) -> None:
        """The same greedy episodes as :meth:`validation_step` (``lopd test``: the DataModule's test split)."""
        self.validation_step(examples, batch_idx)

    @override
    def on_test_epoch_end(self) -> None:
        values = self.log_evaluation("test")
        if values is not None:
            self.last_test = values

    def reset_evaluation(self) -> None:
        """Forget the episodes of the current evaluation (metrics and batches)."""
        for metric in (self.val_reward, self.val_success, self.val_turns):
            metric.reset()
        self.eval_batches = []

    def log_evaluation(self, prefix: str, *, direct_step: int | None = None) -> dict[str, float] | None:
        """Log ``<prefix>/reward_mean``, ``<prefix>/success_rate`` and ``<prefix>/turns_mean`` of the
        episodes since the last call (also ``by_rollouts/<prefix>_...``), show the first ``log_samples``
        episodes as TensorBoard text (``samples/<prefix>``), write every episode to
        ``<log_dir>/generations/<prefix>_step_<N>.jsonl``, reset and return the values (None when no
        episode ran).

        Inside ``fit`` the values are written straight to the loggers at x = the training steps done
        (``self.log`` would file the validation after step k under k - 1); they still reach
        ``trainer.callback_metrics`` (checkpoint monitors). ``direct_step`` writes at that step instead
        (outside Lightning's validation loop, e.g. the evaluation before training, at 0).
        """
        if self.val_reward.update_count == 0:
            self.eval_batches = []
            return None
        values = {
            f"{prefix}/reward_mean": self.val_reward.compute(),
            f"{prefix}/success_rate": self.val_success.compute(),
            f"{prefix}/turns_mean": self.val_turns.compute(),
        }
        in_fit = self._trainer is not None and self.trainer.state.fn == "fit"
        step = int(self.global_step) if direct_step is None else int(direct_step)
        if direct_step is None and not in_fit:  # `lopd validate` / `lopd test`: Lightning's loggers and results
            self.log_dict(values, prog_bar=False)
        else:
            if direct_step is None:
                self.log_dict(values, prog_bar=False, logger=False)
            self.log_to_loggers({k: float(v) for k, v in values.items()}, step)
        self.log_by_rollouts({f"{prefix}_" + k.split("/", 1)[1]: v for k, v in values.items()})
        records = self.evaluation_records(prefix, step)
        path = self.write_generations(prefix, step, records)
        self.log_sample_text(prefix, step, records)
        # the episodes that ran: the records when they were gathered (they are not without a logger)
        episodes = len(records) if records else self._evaluation_episodes()
        if self.global_rank == 0:
            log.info(
                "%s after step %d: reward %.3f | success %.3f | turns %.2f | %d episodes%s", prefix, step,
                float(values[f"{prefix}/reward_mean"]), float(values[f"{prefix}/success_rate"]),
                float(values[f"{prefix}/turns_mean"]), episodes, f" | generations {path}" if path else "",
            )
        self.reset_evaluation()
        return {k: float(v) for k, v in values.items()}

    def _evaluation_episodes(self) -> int:
        """The episodes of the current evaluation on every rank (an example a distributed sampler repeated
        to even out the ranks counted once, as :meth:`evaluation_records` keeps it)."""
        ids = [example_id for batch in self.eval_batches for example_id in batch.example_ids]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, ids)
            return len({example_id for rank_ids in gathered for example_id in rank_ids})
        return len(ids)

    def log_to_loggers(self, values: dict[str, float], step: int) -> None:
        """Write scalars to every logger at ``step`` (rank 0), bypassing Lightning's step bookkeeping."""
        if self.global_rank != 0:
            return
        for logger in self.loggers:
            logger.log_metrics(values, step=step)

    # ------------------------------------------------------------------ samples and generations
    def trajectory_records(self, batch: RolloutBatch, prefix: str, step: int, rows: int | None = None) -> list[dict[str, Any]]:
        """One JSON-ready dict per trajectory of ``batch`` (its first ``rows``): ``step``, ``split``,
        ``example_id``, ``reward``, ``success``, ``turns``, ``done``, ``truncation``, ``errors`` (the
        checker's verdicts), ``info`` (the last step's ``StepResult.info``) and ``messages``."""
        out = []
        for i in range(len(batch) if rows is None else min(rows, len(batch))):
            meta = batch.metadata[i]
            reward = float(batch.rewards[i])
            out.append({
                "step": int(step),
                "split": prefix,
                "example_id": batch.example_ids[i],
                "reward": reward,
                "success": bool(reward >= self.hparams.success_threshold),
                "turns": meta.get("turns"),
                "done": meta.get("done"),
                "truncation": meta.get("truncation"),
                "errors": list(meta.get("errors") or []),
                "info": dict(meta.get("info") or {}),
                "messages": [dict(m) for m in batch.messages[i]],
            })
        return out

    def evaluation_records(self, prefix: str, step: int) -> list[dict[str, Any]]:
        """The records (:meth:`trajectory_records`) of the current evaluation, gathered from every rank
        in the val split's order (an example that a distributed sampler repeated to even out the ranks
        is kept once). Empty when nothing would use them (no logger, or samples and file both off)."""
        wanted = (self.hparams.save_generations or self.hparams.log_samples > 0) and bool(self.loggers)
        if not wanted:
            return []
        records = [r for batch in self.eval_batches for r in self.trajectory_records(batch, prefix, step)]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[list[dict[str, Any]]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, records)
            seen: set[str] = set()
            records = []
            for r in (r for rank_records in gathered for r in rank_records):
                if r["example_id"] not in seen:
                    seen.add(r["example_id"])
                    records.append(r)
            dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
            if dm is not None and hasattr(dm, "val_examples_list"):
                order = {ex.id: i for i, ex in enumerate(dm.val_examples_list)}
                records.sort(key=lambda r: order.get(r["example_id"], len(order)))
        return records

    def generations_dir(self) -> Path | None:
        """``<log_dir>/generations`` of the first logger (None without a logger)."""
        if not self.loggers:
            return None
        logger = self.loggers[0]
        root = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        return None if root is None else Path(root) / "generations"

    def write_generations(self, prefix: str, step: int, records: list[dict[str, Any]]) -> Path | None:
        """Write ``records`` to ``<log_dir>/generations/<prefix>_step_<step>.jsonl`` (rank 0, one JSON
        object a line); returns the path, or None when nothing was written."""
        if not self.hparams.save_generations or self.global_rank != 0 or not records:
            return None
        directory = self.generations_dir()
        if directory is None:
            return None
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{prefix}_step_{step}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        return path

    def log_sample_text(self, prefix: str, step: int, records: list[dict[str, Any]]) -> None:
        """The first ``log_samples`` records as one markdown text, TensorBoard tag ``samples/<prefix>`` at
        ``step`` (rank 0, TensorBoard loggers only)."""
        n = int(self.hparams.log_samples)
        if n <= 0 or not records or self.global_rank != 0:
            return
        text = "\n\n---\n\n".join(self.sample_markdown(r) for r in records[:n])
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(f"samples/{prefix}", text, global_step=step)

    def sample_markdown(self, record: dict[str, Any]) -> str:
        """One trajectory as markdown: a header (example, reward, success, turns, truncation), the
        checker's verdict, the prompt's last ``sample_prompt_chars`` characters, then every reply and
        observation. Every text from the model or the task sits in a code fence longer than any run of
        backticks inside it, so nothing in it is read as markdown."""
        messages = record["messages"]
        first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        turns = record.get("turns")
        head = [f"**{_md_escape(str(record['example_id']))}** (step {record['step']})",
                f"reward {record['reward']:.3f}", "success" if record["success"] else "failure",
                f"{turns} turn{'' if turns == 1 else 's'}"]
        if record.get("truncation"):
            head.append(f"cut: {_md_escape(str(record['truncation']))}")
        parts = [" · ".join(head)]
        verdict = "; ".join(record.get("errors") or [])
        extra = {k: v for k, v in (record.get("info") or {}).items() if k != "error"}
        if verdict:
            parts.append("checker:\n\n" + _fenced(verdict))
        if extra:
            parts.append("info:\n\n" + _fenced(json.dumps(extra, ensure_ascii=False, default=str)))
        prompt = "\n\n".join(f"[{m.get('role')}] {m.get('content') or ''}" for m in messages[:first])
        limit = int(self.hparams.sample_prompt_chars)
        if len(prompt) > limit:
            prompt = "..." + prompt[len(prompt) - limit:] if limit > 0 else "..."
            label = f"prompt (last {limit} characters)"
        else:
            label = "prompt"
        parts.append(f"{label}:\n\n" + _fenced(prompt))
        turn = 0
        for m in messages[first:]:
            role = _md_escape(str(m.get("role")))
            if role == "assistant":
                turn += 1
                role = f"assistant (turn {turn})"
            content = str(m.get("content") or "")
            if not content.strip():  # an empty fence says nothing: show what the whitespace is
                role += " (empty)" if not content else " (whitespace only, shown escaped)"
                content = repr(content) if content else ""
            parts.append(f"{role}:\n\n" + _fenced(content))
        return "\n\n".join(parts)

    # ------------------------------------------------------------------ progress
    def progress_line(self, batch: RolloutBatch | None = None) -> str:
        """The one-line summary of the last training step, e.g. ``step 3/20 | trajectories 12 | reward
        0.250 | success 0.250 | loss 0.0123 | gen 20.1s student 10.2s teacher 3.0s``."""
        step = int(self.global_step)
        max_steps = int(self.trainer.max_steps) if self._trainer is not None and self.trainer.max_steps else -1
        parts = [f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}",
                 f"trajectories {self.rollouts_consumed}"]
        values = self.last_step_values
        if "reward" in values:
            parts += [f"reward {values['reward']:.3f}", f"success {values['success']:.3f}"]
        if "loss" in values:
            parts.append(f"loss {values['loss']:.4g}")
        no_bank = batch is None or getattr(batch, "experiences", None) is None
        phases = [f"{PHASE_NAMES.get(k, k)} {v:.1f}s" for k, v in self.step_timings.items()
                  if not (k == "retrieval" and no_bank)]
        if phases:
            parts.append(" ".join(phases))
        return " | ".join(parts)

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The progress line (every ``progress_every_n_steps``) and the training samples (every
        ``log_samples_every_n_steps``), on rank 0."""
        if self.global_rank != 0:
            return
        step = int(self.global_step)
        every = int(self.hparams.progress_every_n_steps)
        if every > 0 and step % every == 0:
            log.info("%s", self.progress_line(batch))
        every = int(self.hparams.log_samples_every_n_steps)
        if every > 0 and step % every == 0 and self.hparams.log_samples > 0 and isinstance(batch, RolloutBatch):
            records = self.trajectory_records(batch, "train", step, rows=int(self.hparams.log_samples))
            self.log_sample_text("train", step, records)

    @override
    def configure_callbacks(self):
        """Lightning's default progress bar, replaced by one that counts training steps (``step k/N``)
        instead of epochs: the on-policy stream is one endless epoch (``max_epochs=-1``), which the default
        bar showed as ``Epoch 0/-2``. A progress bar of any other class, or none, is left alone.

        The default bar is taken out of ``trainer.callbacks`` here, before any callback hook ran, and the
        step-counting one returned in its place: Lightning then adds it as a new callback (every hook,
        ``setup`` included) instead of overriding the Trainer's with its INFO line on every run."""
        from lopd_lightning.callbacks import step_progress_bar

        if self._trainer is None:
            return []
        default = self.trainer.progress_bar_callback
        bar = step_progress_bar(default)
        if bar is None:
            return []
        self.trainer.callbacks = [c for c in self.trainer.callbacks if c is not default]
        return [bar]

    @override
    def on_train_start(self) -> None:
        if self.hparams.validate_before_training and self.global_step == 0:
            dm = self.trainer.datamodule
            loader = dm.val_dataloader()
            for i, examples in enumerate(loader):
                self.validation_step(examples, i)
            values = self.log_evaluation("val", direct_step=0)
            if values is not None:
                self.last_val = values
                self.val_history = getattr(self, "val_history", []) + [(0, values)]

    # ------------------------------------------------------------------ checkpoints
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lopd_state"] = {
            "rollouts_consumed": self.rollouts_consumed,
            "non_finite_steps": self.non_finite_steps,
            **self.method_state(),
        }

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        drop_stale_composer_weights(self, checkpoint)
        state = checkpoint.get("lopd_state", {})
        self.rollouts_consumed = int(state.get("rollouts_consumed", 0))
        self.non_finite_steps = int(state.get("non_finite_steps", 0))
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
