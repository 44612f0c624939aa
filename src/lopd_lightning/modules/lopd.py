"""LOPDModule: Latent On-Policy Self-Distillation (docs/METHOD.md sections 2-5).

One training step (manual optimisation, two optimisers):

1. the DataModule's batch: the student's rollouts with the top-J experiences retrieved per example;
2. the student's forward at its assistant tokens (logits, or final hidden states with
   ``distill_chunk_size``: :class:`~lopd_lightning.losses.lm_head.LMHead` holds that choice) and, in ``live`` mode
   without dropout, its key/value cache of the prompt before the context, which the teacher's pass
   starts from (``teacher_prefix_cache``; other modes compute that prefix with one no-grad teacher pass);
3. the composer turns each example's experiences into J*K latent tokens c_phi, and the self-teacher
   (the shared backbone, composer LoRA off) scores every student token with the latents in its first
   user message: the teacher's outputs on the student's positions;
4. student loss: L_distill = global token mean of KL(p~_S || p~_T) on the teacher's top-M + tail
   support, the teacher constant (:func:`~lopd_lightning.losses.lm_head.distillation_loss`);
5. composer loss: L_distill(student detached) + beta (m - Delta(phi)) + lambda * anchor
   (:func:`~lopd_lightning.composer.objective.composer_objective`), where Delta is the privileged margin
   (:func:`~lopd_lightning.composer.objective.margin_delta`) and the anchor ties c_phi to the warm-started
   composer's latents (:func:`~lopd_lightning.composer.objective.anchor_loss`);
6. one backward pass of the sum (disjoint parameters), then the student step and the composer step;
7. dual ascent: beta <- max(0, beta + eta_beta (m - Delta)), Delta averaged over ranks
   (:class:`~lopd_lightning.losses.dual.DualAscent`).

With ``freeze_composer`` (the paper's frozen-composer ablation) steps 5-7 are left out: the teacher's pass
runs without gradients, Delta is only measured, and neither the composer nor beta moves.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from torch import Tensor
from typing_extensions import override

from lopd_lightning.adapters import add_composer_adapter, copy_adapter
from lopd_lightning.checkpointing import recorded_forwards
from lopd_lightning.losses.dual import DualAscent
from lopd_lightning.losses.lm_head import LMHead, distillation_loss, rollout_mean
from lopd_lightning.composer import ComposerOutput, LatentComposer, clip_composer_grads, load_composer
from lopd_lightning.composer.model import ClipNorms
from lopd_lightning.composer.objective import anchor_loss, composer_objective, has_both_outcomes, margin_delta
from lopd_lightning.composer.probe import latent_probe
from lopd_lightning.composer.pretrain import warm_start, warm_start_draws
from lopd_lightning.memory.experience import Experience
from lopd_lightning.memory.module_bank import build_bank, retrieve_from
from lopd_lightning.memory.persistence import check_bank_fills
from lopd_lightning.modules.base import OnPolicyModule
from lopd_lightning.modules.lopd_options import check_lopd_options
from lopd_lightning.rollout import RolloutBatch
from lopd_lightning.sharding import local, plain
from lopd_lightning.tasks import Example, Task
from lopd_lightning.teacher import SelfTeacher, TeacherPrefix, prefix_length, resolve_framing, supports_prefix_cache

log = logging.getLogger(__name__)

COMPOSER_ADAPTER = "composer"
#: The frozen snapshot of the warm-started composer LoRA (the anchor c_phi0 of docs/METHOD.md section 5).
ANCHOR_ADAPTER = "composer_anchor"
DEFAULT_COMPOSER_LORA = {
    "r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


class LOPDLosses(NamedTuple):
    """What :meth:`LOPDModule.losses` returns (scalars are () float tensors).

    Attributes:
        loss_student: the distillation loss of the student (teacher detached), the global token mean.
        loss_composer: the composer objective (student detached): ``distill_c + beta (m - delta) +
            lambda anchor``; backpropagate the sum of the two losses once.
        distill_c: the composer's distillation term.
        delta: the margin Delta, differentiable in the latents.
        anchor: the anchor term (mean squared distance to the frozen anchor's latents).
        has_latents: (B,) bool, rows whose teacher saw latents.

    With ``freeze_composer``: ``delta`` has no gradient, ``distill_c`` and ``anchor`` are 0 (not computed), and
    ``loss_composer`` is 0 with a zero gradient for every composer parameter (what DDP needs).
    """

    loss_student: Tensor
    loss_composer: Tensor
    distill_c: Tensor
    delta: Tensor
    anchor: Tensor
    has_latents: Tensor


class LOPDModule(OnPolicyModule):
    """LOPD: a student distilled towards its latent-conditioned self-teacher; the composer trained with a margin.

    ``beta`` (a property) is the dual variable of :attr:`dual` (:class:`~lopd_lightning.losses.dual.DualAscent`);
    ``lm_head`` (:class:`~lopd_lightning.losses.lm_head.LMHead`) applies the student's and the teacher's LM heads
    in full or in chunks (``distill_chunk_size``).

    Besides :class:`~lopd_lightning.modules.base.OnPolicyModule`'s arguments (``--help`` lists both):

    Args:
        num_latents: K, latent tokens per experience (paper: 32).
        num_experiences: J, experiences retrieved per task (paper: 3).
        composer_depth: depth of the Perceiver resampler (``composer_architecture: perceiver``), weights shared
            (paper: 8).
        composer_lora: LoRA of the composer's encoder (paper: rank 8, alpha 16, dropout 0, all projections).
        composer_lr: AdamW learning rate of the composer (paper: 1e-5).
        composer_clip_compressor, composer_clip_lora: separate grad-clip norms of the compressor chi and the
            encoder LoRA psi (paper: 30 and 3).
        composer_architecture: the compressor: ``"memory_tokens"`` (the default: K learned embeddings read
            out at the end of the encoder's input) or ``"perceiver"`` (the paper's Perceiver resampler);
            docs/METHOD.md section 3, "Deviation" gives the measurement (benchmarks/results/latent_capacity.json).
        composer_output_gain: the initial gain of the compressor's output LayerNorm: ``"embedding"`` (the
            default: the RMS of the backbone's token embeddings, so the latents start at their scale) or a
            number (1.0: PyTorch's default and this project's before; the paper does not say).
        composer_path: a folder written by ``lopd pretrain-composer`` (``composer.pt``): the composer is
            loaded from it at construction, becomes the anchor c_phi0, and no warm start runs in ``fit``.
        freeze_composer: the paper's frozen-composer ablation (default False): the composer (compressor and
            encoder LoRA), as pretrained (``composer_path``, or the warm start that ``fit`` runs first), is
            never updated by the training step, and the student is distilled as usual towards the teacher
            with its latents. No composer objective is computed (the teacher's pass runs without gradients),
            the composer's optimiser never steps and beta stays at ``beta_init`` (no dual step):
            ``train/margin_delta`` is still logged, as a measurement, and ``train/beta`` (constant);
            ``train/composer_loss`` and ``train/composer_anchor`` are not.
        distill_top_k: M, the teacher's top-M support of the distillation KL (paper: 20).
        margin: m, the privileged margin (paper: 0.05): the target of :meth:`scale_margin`, which a
            ``MarginSchedule`` callback calls to ramp m up to it.
        anchor_weight: lambda, weight of the latent anchor to the warm-started composer (paper: 0.2).
        margin_weighting: how Delta weighs the rollouts: ``"paper"`` (the default: the mean of A D over
            rollouts) or ``"balanced"`` (successes and failures weighed equally; not in the paper, see
            :func:`lopd_lightning.composer.objective.privileged_margin`).
        dual_lr: eta_beta, step size of the dual ascent on beta (paper: 0.5).
        beta_init: beta_0 (paper: 0).
        teacher_mode: "live" (current student weights: the design card's weight sharing), "base"
            (initial weights: the paper's frozen teacher) or "ema".
        teacher_ema_rate: EMA rate of teacher_mode "ema".
        bank_path: folder of a saved ExperienceBank (``lopd build-memory``); None starts empty, which ``fit``
            refuses unless a MemoryRefresh callback will fill it (an empty bank trains nothing).
        embedder: "minilm" (all-MiniLM-L6-v2, default), "backbone" or "hashing".
        bank_capacity: cap of the bank (None: unbounded); eviction rule ``bank_eviction``.
        allow_self_retrieval: let a task retrieve its own records (the paper's code: allowed).
        max_experience_tokens: truncation of each "task + past trajectory" text read by the encoder.
        warm_start_steps: steps of the composer's pretraining (the paper's warm start, about 1000 steps):
            what ``lopd pretrain-composer`` runs, and what ``fit`` runs first when the composer is fresh and
            no ``composer_path`` is given (0 skips; :mod:`lopd_lightning.composer.pretrain`).
        warm_start_batch_size: successful bank trajectories per pretraining step.
        warm_start_lr: AdamW learning rate of the pretraining (no weight decay; the paper's warm start uses
            the composer's 1e-5).
        warm_start_task_weight: weight of L_init, the teacher's NLL of a solved task's reference solution
            given the latents of its experiences (the paper's warm start: 1).
        warm_start_reconstruction_weight: weight of L_rec, the teacher's NLL of an experience's trace when it
            is asked to repeat it from that experience's latents alone (not in the paper: 0 is its warm start).
        warm_start_self_retrieval: during pretraining, a record's own trajectory is one of its J experiences
            (the authors' code does this through its retrieval, self-retrieval on; training's retrieval is
            ``allow_self_retrieval``'s).
        warm_start_reconstruction_noise: p in [0, 1): L_rec repeats a copy of the experience with each token
            replaced, with probability p, by a token drawn from the pretraining records (new every step), read
            from the copy's own latents, so that recalling a train record cannot meet it; 0 repeats the
            experience itself (not in the paper; docs/METHOD.md section 3, "Deviation").
        warm_start_lr_schedule: "cosine" (a linear warm-up over the first 10% of the pretraining's steps, then
            a cosine decay to 0) or "constant" (the paper does not say).
        latent_probe_every_n_steps: every n training steps, log ``train/latent_spread`` and how much the
            teacher changes when each row's experiences are swapped for another task's
            (``train/latent_swap_effect``, ``train/latent_own_minus_other``); costs one composer and two teacher
            passes without gradients; 0 never.
        distill_temperature: temperature of both distributions in the KL (1.0 in the paper).
        distill_chunk_size: None (default) computes the student's and the teacher's logits packed (N, V)
            at the N assistant positions. An int c >= 1 keeps only their final hidden states (N, d) and
            applies the LM head c rows at a time (:class:`~lopd_lightning.losses.lm_head.LMHead`), in the
            distillation KL of both losses and in the sampled-token log-probs of the margin Delta: same
            values and gradients up to float rounding, and the extra peak memory of the losses is
            O(c x V) instead of O(N x V), flat in the sequence length (benchmarks/results/loss_memory.json).
            The price is recomputing the LM-head matmuls (and softmaxes) of every chunk in backward, a
            slower loss. Needs a plain linear LM head without logit soft-capping (checked at construction).
        teacher_prefix_cache: start the teacher's pass after the tokens that precede every row's context
            (:func:`~lopd_lightning.teacher.prefix_length`: the shortest, over the batch's rows, prompt
            prefix up to the first user message's content; for BFCL the system prompt with the tool
            schemas, most of the prompt), using their keys and values instead of recomputing them: in
            ``live`` mode without dropout the student's own forward's, otherwise one no-grad teacher pass
            over them. The causal mask makes those states independent of the latents, so the teacher's
            logits and every gradient are the same up to float rounding, and the teacher's forward and
            the composer's backward through it run on the rest only (benchmarks/README.md, step_cost: the
            two runs of d635d06, with and without it). False recomputes the whole sequence, as activation
            checkpointing does (below). Models whose cache is not a plain full-attention one (sliding
            window, linear attention) get False, with a warning.
        context_framing: the text around the latents in the teacher's first user message (and in the
            pretraining's, which runs the same teacher): a name of
            :data:`~lopd_lightning.teacher.splice.FRAMINGS` (``"short"``, the default: "Here is a reference
            example of a different, already solved task:" ... "Now complete your task."; ``"from_scratch"``:
            the long anti-copying framing of the authors' code, in this project's words) or ``{prefix: ...,
            suffix: ...}``. docs/METHOD.md section 4.
        composer_kl_mean: how the composer's distillation term L_distill(phi; student detached) averages the
            per-token KL: ``"token"`` (the default: the global token mean, as the student's loss) or
            ``"rollout"`` (the authors' code: the mean over each rollout's tokens, then the mean over the
            rollouts of every rank, so a long rollout weighs as much as a short one). The student's loss is
            the global token mean either way.
        composer_clip_joint: None (the default) clips the compressor and the encoder LoRA separately
            (``composer_clip_compressor``, ``composer_clip_lora``) in the training step; a number c > 0 clips
            every composer gradient jointly to total norm c instead (the authors' code: 1.0). The pretraining
            keeps the two separate norms.

    Activation checkpointing (``gradient_checkpointing=True``, an argument of the base module): the step's
    one backward runs after the student's pass (adapter ``"student"``, or the base weights of a full
    student), the composer's encoder pass (adapter ``"composer"``, only psi trainable) and the teacher's
    pass (its mode's weights, every backbone weight constant, eval mode) have each switched the shared
    backbone back. Every decoder layer of these three passes keeps only its input and is recomputed in that
    backward under the adapter(s), disabled flag, LoRA scaling, ``requires_grad`` flags and train flags its
    forward ran with (:class:`~lopd_lightning.checkpointing.ForwardStateRecompute`); torch's checkpoint
    restores the dropout RNG. The teacher's layers are checkpointed in eval mode (no dropout:
    :func:`~lopd_lightning.checkpointing.layers_checkpointed_in_eval`). A checkpointed layer reads no
    key/value cache, so the teacher's pass covers the whole sequence (``teacher_prefix_cache`` is not
    used). Refused (ValueError naming
    ``model.init_args.gradient_checkpointing``) only for a model whose layers do not checkpoint through
    transformers' per-layer checkpoint function, where the recompute context cannot be installed; a first
    training step that ran no layer through it raises RuntimeError.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        num_latents: int = 32,
        num_experiences: int = 3,
        composer_depth: int = 8,
        composer_lora: dict[str, Any] | None = None,
        composer_lr: float = 1e-5,
        composer_clip_compressor: float = 30.0,
        composer_clip_lora: float = 3.0,
        composer_architecture: str = "memory_tokens",
        composer_output_gain: float | str = "embedding",
        composer_path: str | None = None,
        freeze_composer: bool = False,
        distill_top_k: int = 20,
        margin: float = 0.05,
        anchor_weight: float = 0.2,
        margin_weighting: str = "paper",
        dual_lr: float = 0.5,
        beta_init: float = 0.0,
        teacher_mode: str = "live",
        teacher_ema_rate: float = 0.05,
        bank_path: str | None = None,
        embedder: str = "minilm",
        bank_capacity: int | None = None,
        bank_eviction: str = "lowest_reward",
        allow_self_retrieval: bool = False,
        max_experience_tokens: int = 512,
        warm_start_steps: int = 0,
        warm_start_batch_size: int = 8,
        warm_start_lr: float = 1e-3,
        warm_start_task_weight: float = 1.0,
        warm_start_reconstruction_weight: float = 1.0,
        warm_start_self_retrieval: bool = True,
        warm_start_reconstruction_noise: float = 0.3,
        warm_start_lr_schedule: str = "cosine",
        latent_probe_every_n_steps: int = 10,
        distill_temperature: float = 1.0,
        distill_chunk_size: int | None = None,
        teacher_prefix_cache: bool = True,
        context_framing: str | dict[str, str] = "short",
        composer_kl_mean: str = "token",
        composer_clip_joint: float | None = None,
        **kwargs: Any,
    ):
        composer_cfg = dict(DEFAULT_COMPOSER_LORA) if composer_lora is None else composer_lora
        check_lopd_options(  # the checks that need no model, before the student is loaded
            num_latents=num_latents, num_experiences=num_experiences, distill_top_k=distill_top_k, embedder=embedder,
            bank_path=bank_path, bank_capacity=bank_capacity, distill_chunk_size=distill_chunk_size,
            composer_lora=composer_cfg, beta_init=beta_init, dual_lr=dual_lr, margin_weighting=margin_weighting,
            composer_architecture=composer_architecture, composer_path=composer_path, composer_output_gain=composer_output_gain,
            warm_start_weights=(warm_start_task_weight, warm_start_reconstruction_weight),
            warm_start_lr=warm_start_lr, warm_start_batch_size=warm_start_batch_size,
            warm_start_reconstruction_noise=warm_start_reconstruction_noise,
            warm_start_lr_schedule=warm_start_lr_schedule, latent_probe_every_n_steps=latent_probe_every_n_steps,
            composer_kl_mean=composer_kl_mean, composer_clip_joint=composer_clip_joint, teacher_mode=teacher_mode,
        )
        framing_prefix, framing_suffix = resolve_framing(context_framing)
        super().__init__(model, **kwargs)
        if self.hparams.gradient_checkpointing and not self.checkpointed_modules:
            raise ValueError(
                f"model.init_args.gradient_checkpointing: {model!r} checkpoints its layers in a way LOPD cannot "
                "recompute under the right LoRA adapter (no transformers GradientCheckpointingLayer); "
                "set it to false"
            )
        self.save_hyperparameters()
        self.check_top_k("distill_top_k", distill_top_k)
        self.backbone = add_composer_adapter(self.backbone, composer_cfg)  # psi, on the shared backbone
        composer_options = dict(num_latents=num_latents, depth=composer_depth, max_experience_tokens=max_experience_tokens,
                                architecture=composer_architecture, output_gain=composer_output_gain)
        self.composer = LatentComposer(self.backbone, self.tokenizer, adapter_name=COMPOSER_ADAPTER, **composer_options)
        self.teacher = SelfTeacher(self.backbone, self.tokenizer, mode=teacher_mode, ema_rate=teacher_ema_rate,
                                   checkpoint_layers=self.hparams.gradient_checkpointing,
                                   framing_prefix=framing_prefix, framing_suffix=framing_suffix)
        if teacher_prefix_cache and not supports_prefix_cache(self.backbone):
            log.warning("teacher_prefix_cache is off: this model's key/value cache is not plain full attention in "
                        "every layer (sliding window or linear attention); the teacher recomputes the whole sequence")
            self.hparams.teacher_prefix_cache = False
        #: the student's and the teacher's LM heads, in full or in chunks (checks the heads when chunked).
        self.lm_head = LMHead(self.backbone, self.teacher.model, chunk_size=distill_chunk_size)
        self.bank = build_bank(
            bank_path, embedder, num_experiences=num_experiences, capacity=bank_capacity, eviction=bank_eviction,
            allow_self_retrieval=allow_self_retrieval, model=self.backbone, tokenizer=self.tokenizer,
        )
        # c_phi0: a frozen snapshot of the composer (its own LoRA adapter on the same backbone + a compressor)
        copy_adapter(self.backbone, COMPOSER_ADAPTER, ANCHOR_ADAPTER)
        self.anchor_composer = LatentComposer(self.backbone, self.tokenizer, adapter_name=ANCHOR_ADAPTER, **composer_options)
        #: what ``lopd pretrain-composer`` saved beside the composer loaded from ``composer_path`` (None: none)
        self.composer_info = load_composer(self.composer, composer_path) if composer_path else None
        self.freeze_anchor()
        #: m in effect this step (float): the ``margin`` argument, or the part of it :meth:`scale_margin` set.
        self.margin = float(margin)
        #: beta and its dual ascent (docs/METHOD.md 5); ``self.beta`` reads and sets its value.
        self.dual = DualAscent(beta_init, lr=dual_lr)
        self.warm_started = warm_start_steps == 0 or bool(composer_path)

    @property
    def beta(self) -> float:
        """beta, the weight of (m - Delta) in the composer objective (:attr:`dual`'s value)."""
        return self.dual.value

    @beta.setter
    def beta(self, value: float) -> None:
        self.dual.value = float(value)

    def scale_margin(self, fraction: float) -> None:
        """Set :attr:`margin`, the m in effect, to ``fraction`` (in [0, 1]) of the ``margin`` argument, the target m.

        The one way m moves during a fit (``MarginSchedule`` calls it before every step; docs/METHOD.md section 5).
        """
        self.margin = fraction * float(self.hparams.margin)

    # ------------------------------------------------------------------ retrieval
    @override
    def retrieve(self, task: Task, examples: list[Example]) -> list[list[Experience]]:
        """Top-J experiences per example from the bank (fewer when the bank is small or empty; none with J = 0):
        :func:`~lopd_lightning.memory.module_bank.retrieve_from`."""
        return retrieve_from(self.bank, examples, self.hparams.num_experiences).experiences

    def batch_latents(self, batch: RolloutBatch, composer: LatentComposer | None = None) -> ComposerOutput:
        """c_phi of the batch: row b's retrieved experiences (``batch.experiences[b]``), each read by the encoder
        with "Task to solve: <row b's own task>" (``batch.metadata[b]["task_text"]``), through
        :meth:`~lopd_lightning.composer.model.LatentComposer.compose` (the one texts -> latents).

        Args:
            composer: the composer to run (default: :attr:`composer`; :meth:`anchor_latents` passes the anchor).

        Returns:
            :class:`~lopd_lightning.composer.model.ComposerOutput`: latents (B, J*K, d) float and latent_mask
            (B, J*K) bool, False on the slots of rows with fewer than J experiences.
        """
        experiences = batch.experiences or [[] for _ in range(len(batch))]
        pairs = [[(meta["task_text"], e.trace) for e in row] for meta, row in zip(batch.metadata, experiences, strict=True)]
        return (composer or self.composer).compose(pairs)

    # ------------------------------------------------------------------ warm start
    def anchor_latents(self, batch: RolloutBatch) -> Tensor:
        """c_phi0: latents of the frozen snapshot of the warm-started composer, no gradient."""
        with torch.no_grad():
            return self.batch_latents(batch, self.anchor_composer).latents

    def freeze_anchor(self) -> None:
        """Copy the current composer (LoRA and compressor) into the frozen anchor c_phi0."""
        copy_adapter(self.backbone, COMPOSER_ADAPTER, ANCHOR_ADAPTER)
        self.anchor_composer.compressor.load_state_dict(self.composer.compressor.state_dict())
        self.anchor_composer.requires_grad_(False)

    # ------------------------------------------------------------------ training
    def losses(self, batch: RolloutBatch) -> LOPDLosses:
        """The step's forward passes and losses, no backward (steps 2-5 of the module docstring).

        Returns:
            :class:`LOPDLosses`.
        """
        targets, mask = self.shifted(batch)  # the N loss tokens omega; outputs exist only there (packed)
        num_tokens = self.num_loss_tokens(batch)
        head, top_k, tau = self.lm_head, self.hparams.distill_top_k, self.hparams.distill_temperature
        n_prefix = self._prefix_length(batch)  # the teacher's pass starts after these tokens
        with self.timed("student_step"):
            student, prefix = self._student_pass(batch, mask, n_prefix)  # [N, V] or [N, d]
        frozen = self.hparams.freeze_composer  # no composer objective: no graph through the teacher
        with self.timed("teacher"), torch.no_grad() if frozen else nullcontext():
            composed, teacher = self._teacher_pass(batch, mask, n_prefix, prefix)  # [N, V] or [N, d]
            del prefix
        with self.timed("student_step"):
            loss_student = distillation_loss(head, student, teacher.detach(), top_k=top_k, temperature=tau, num_tokens=num_tokens)
        with self.timed("composer_step"), torch.no_grad() if frozen else nullcontext():
            # Delta only over rollouts whose teacher saw latents: without them delta is 0 by construction
            # (live mode) and would pull Delta to 0 and wind beta up with no signal
            has_latents = composed.latent_mask.any(dim=-1)  # [B]
            delta = margin_delta(head, student, teacher, targets[mask], mask, batch.rewards, rows=has_latents,
                                 weighting=self.hparams.margin_weighting)
            if frozen:  # Delta is a measurement; the composer's loss is the zero term below
                distill_c = anchor = loss_composer = delta.new_zeros(())
            else:
                distill_c = self._composer_distillation(mask, student.detach(), teacher, num_tokens)
                anchor = anchor_loss(composed.latents, self.anchor_latents(batch), composed.latent_mask)
                loss_composer = composer_objective(distill_c, delta, anchor, beta=self.beta, margin=self.margin,
                                                   anchor_weight=self.hparams.anchor_weight)
        # every composer parameter joins the graph (a zero term when no row has latents, or a frozen composer), so
        # DDP's gradient all-reduce sees the same parameters on every rank and every step
        # (under FSDP2 each rank's own shard: plain() of a DTensor parameter would gather it)
        loss_composer = loss_composer + 0.0 * sum(local(p).sum() for p in self.composer.trainable_parameters())
        return LOPDLosses(loss_student, loss_composer, distill_c, delta, anchor, has_latents)

    def _composer_distillation(self, mask: Tensor, student: Tensor, teacher: Tensor, num_tokens: float) -> Tensor:
        """The composer's L_distill(phi; student detached) (``student`` already detached): the global token mean
        (``composer_kl_mean: token``, :func:`~lopd_lightning.losses.lm_head.distillation_loss`) or the mean over
        rollouts of each rollout's token mean (``rollout``, :func:`~lopd_lightning.losses.lm_head.rollout_mean`),
        over all ranks' rollouts that have loss tokens."""
        head, top_k, tau = self.lm_head, self.hparams.distill_top_k, self.hparams.distill_temperature
        if self.hparams.get("composer_kl_mean", "token") == "token":
            return distillation_loss(head, student, teacher, top_k=top_k, temperature=tau, num_tokens=num_tokens)
        per_token = head.reverse_kl(student, teacher, top_k=top_k, temperature=tau)  # [N]
        rollouts = int(mask.any(dim=1).sum())  # this rank's rollouts with loss tokens; the denominator is its share
        return rollout_mean(per_token, mask, num_rollouts=self.global_count(rollouts) / self.global_count(1))

    def _student_pass(self, batch: RolloutBatch, mask: Tensor, n_prefix: int) -> tuple[Tensor, TeacherPrefix | None]:
        """The student's outputs at ``mask`` (:attr:`lm_head`'s kind) and, when its weights are the teacher's,
        the key/value prefix of ``n_prefix`` tokens its forward computed for the teacher."""
        share = n_prefix > 0 and self.teacher.shares_student_weights
        forward = self.student_forward(batch, mask, output=self.lm_head.output, keep_cache=share)
        return forward.values, (TeacherPrefix.from_cache(forward.cache, n_prefix) if share else None)

    def _teacher_pass(
        self, batch: RolloutBatch, mask: Tensor, n_prefix: int, prefix: TeacherPrefix | None
    ) -> tuple[ComposerOutput, Tensor]:
        """The latents c_phi and the teacher's outputs at the student's ``mask`` with them in its context,
        after the shared ``n_prefix`` tokens (``prefix`` from the student, or one no-grad teacher pass)."""
        if n_prefix > 0 and prefix is None:
            prefix = self.teacher.own_prefix(batch.input_ids, batch.attention_mask, n_prefix)
        composed = self.batch_latents(batch)
        teacher = self.teacher.on_student_positions(
            batch.input_ids, batch.attention_mask, batch.context_position, positions=self.unshift(mask),
            output=self.lm_head.output, latents=composed.latents, latent_mask=composed.latent_mask, prefix=prefix,
        )
        return composed, teacher

    def _prefix_length(self, batch: RolloutBatch) -> int:
        """The tokens before every row's context, where the teacher's pass starts (0: ``teacher_prefix_cache``
        off, or activation checkpointing: a checkpointed layer drops a key/value cache)."""
        if not self.hparams.get("teacher_prefix_cache", True) or self.hparams.gradient_checkpointing:
            return 0
        return prefix_length(batch.attention_mask, batch.context_position)

    def _check_layers_checkpointed(self) -> None:
        """With gradient_checkpointing, the first training step's passes must have run checkpointed layers."""
        if self.hparams.gradient_checkpointing and not getattr(self, "_layers_checkpointed", False):
            if not recorded_forwards(self.backbone):
                raise RuntimeError("model.init_args.gradient_checkpointing: the training step ran no layer through the "
                                   "checkpoint that recomputes under the forward's LoRA adapter; set it to false")
            self._layers_checkpointed = True

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        opt_student, opt_composer = self.optimizers()
        probe = self.latent_probe(batch) if self._probe_due() else {}  # the composer that makes this step's teacher
        loss_student, loss_composer, _, delta, anchor, has_latents = self.losses(batch)
        self._check_layers_checkpointed()

        # One backward pass of the sum: the two graphs touch disjoint trainable parameters (the student's
        # loss sees the teacher detached, the composer's sees the student detached), so each optimiser
        # gets exactly its own loss's gradient. One pass is what DDP's reducer expects (one backward per
        # forward, every parameter used), and it runs before either optimiser step: the teacher and
        # encoder graphs saved backbone weights that the student's in-place update would invalidate, so
        # both gradients are taken at the weights that made this step's rollouts and teacher logits.
        with self.timed("backward"):
            self.manual_backward(loss_student + loss_composer)

        skipped = self.update_skipped  # a non-finite loss: manual_backward ran no backward on any rank
        with self.timed("student_step"):
            student_norm = self.clip_and_step(opt_student, self.student_parameters(), self.hparams.grad_clip)
        frozen = self.hparams.freeze_composer
        with self.timed("composer_step"):
            if skipped or frozen:  # skipped: counted once by manual_backward; frozen: its gradient is the zero term
                opt_composer.zero_grad(set_to_none=True)
            else:
                self.step_uncounted(opt_composer, self.clip_composer_gradients)

        rows_with_latents = self.global_count(has_latents.sum())
        delta_global = self.global_mean(delta)
        informative = rows_with_latents > 0
        if self.hparams.margin_weighting == "balanced":  # Delta is 0 on ranks without both outcomes: leave them out
            rows = has_latents & self.shifted(batch)[1].any(dim=1)
            ranks = self.global_count(int(has_both_outcomes(batch.rewards, rows)))
            delta_global, informative = delta_global * self.global_count(1) / max(ranks, 1), ranks > 0
        beta_before = self.beta
        # dual ascent only when Delta carries signal (docs/METHOD.md 5): some teacher saw latents (balanced:
        # and some rank had both outcomes); a non-finite Delta is skipped; a frozen composer has no beta to weigh
        self.dual.update(delta_global, self.margin, active=informative and not skipped and not frozen)
        if self.hparams.teacher_mode == "ema":
            self.teacher.update_ema()

        composer_terms = {} if frozen else {
            "train/composer_loss": self.global_mean(loss_composer), "train/composer_anchor": anchor,
        }
        self.log_rollout_metrics(
            batch,
            {
                **probe,
                "train/loss": self.global_mean(loss_student),
                **composer_terms,
                "train/margin_delta": delta_global,
                "train/margin_m": self.margin,
                "train/beta": beta_before,
                "train/grad_norm": student_norm,
                "train/bank_size": float(len(self.bank)),
            },
        )
        return loss_student.detach()

    def clip_composer_gradients(self) -> Tensor | ClipNorms:
        """Clip the composer's gradients before its step: jointly to ``composer_clip_joint`` when set (the authors'
        code, 1.0), else the compressor to ``composer_clip_compressor`` and the encoder LoRA to
        ``composer_clip_lora`` (:func:`~lopd_lightning.composer.model.clip_composer_grads`).

        Returns the norm(s) before clipping: () float (joint; 0 without gradients) or :class:`ClipNorms`."""
        joint = self.hparams.get("composer_clip_joint")
        if joint is None:
            return clip_composer_grads(self.composer, compressor_clip=self.hparams.composer_clip_compressor,
                                       lora_clip=self.hparams.composer_clip_lora)
        grads = [p for p in self.composer.trainable_parameters() if p.grad is not None]
        return plain(torch.nn.utils.clip_grad_norm_(grads, float(joint))) if grads else torch.zeros(())

    def _probe_due(self) -> bool:
        every = self.hparams.get("latent_probe_every_n_steps", 0)
        return bool(every) and self.global_step % every == 0 and self.hparams.num_experiences > 0

    def latent_probe(self, batch: RolloutBatch) -> dict[str, Tensor]:
        """``train/latent_spread``, ``train/latent_swap_effect``, ``train/latent_own_minus_other`` of ``batch``
        (:func:`~lopd_lightning.composer.probe.latent_probe`); {} when no rank could measure them."""
        return latent_probe(self, batch)

    @override
    def setup(self, stage: str) -> None:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        if self._trainer is not None and isinstance(self.trainer.strategy, DeepSpeedStrategy):
            raise ValueError(
                "LOPDModule trains two optimisers (student and composer) and Lightning's DeepSpeed strategy "
                "supports one; use configs/trainer/fsdp.yaml (FSDP) or DDP for LOPD"
            )

    @override
    def on_fit_start(self) -> None:
        # a callback that adds the run's trajectories to the bank says so (MemoryRefresh.fills_bank)
        refresh = any(getattr(c, "fills_bank", False) for c in self.trainer.callbacks)
        check_bank_fills(len(self.bank), self.hparams.num_experiences, self.hparams.bank_path, refresh=refresh)
        if not self.warm_started:
            self.warm_start_composer()
            self.freeze_anchor()

    def warm_start_draws(self, datamodule: Any) -> list[list[Experience]]:
        """The bank records :meth:`warm_start_composer` trains on, one list per step
        (:func:`~lopd_lightning.composer.pretrain.warm_start_draws`)."""
        return warm_start_draws(self, datamodule)

    def warm_start_composer(self, datamodule: Any | None = None) -> None:
        """The composer's pretraining inside ``fit``: the steps of ``lopd pretrain-composer``, in this process
        (:func:`~lopd_lightning.composer.pretrain.warm_start`). For budgets of more than a few minutes run
        ``lopd pretrain-composer`` (checkpoints, resume, TensorBoard) and load its result with ``composer_path``.

        Args:
            datamodule: the :class:`~lopd_lightning.data.OnPolicyDataModule` whose train split's records
                are used (default: the trainer's; pass one to warm-start outside ``fit``).
        """
        warm_start(self, datamodule if datamodule is not None else self.trainer.datamodule)
        self.warm_started = True

    # ------------------------------------------------------------------ optimisers and state
    @override
    def sharded_models(self) -> list[torch.nn.Module]:
        """The backbone (its decoder layers hold the composer's LoRA and the anchor's) and, under FSDP2, the
        composer's compressor chi as one more unit (its gradients are then reduced like the backbone's); the
        anchor's frozen compressor stays whole on every rank."""
        return [*super().sharded_models(), self.composer.compressor]

    @override
    def configure_optimizers(self):
        student = torch.optim.AdamW(
            self.student_parameters(), lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay
        )
        composer = torch.optim.AdamW(self.composer.trainable_parameters(), lr=self.hparams.composer_lr)
        return [student, composer]

    @override
    def method_state(self) -> dict[str, Any]:
        return {
            **self.dual.state_dict(),  # "beta", the key every LOPD checkpoint has
            "margin": self.margin,
            "warm_started": self.warm_started,
            "bank": self.bank.state_dict(),
        }

    @override
    def load_method_state(self, state: dict[str, Any]) -> None:
        self.dual.load_state_dict(state)
        self.margin = float(state["margin"])
        self.warm_started = bool(state["warm_started"])
        self.bank.load_state_dict(state["bank"])
