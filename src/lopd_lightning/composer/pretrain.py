"""The composer's pretraining (the paper's warm start, or cold start), a stage of its own run by Lightning.

One step on B successful train records r_1..r_B of the bank (:func:`pretraining_losses`):

1. each record's task is solved again by its reference solution y*, and the composer reads the task's
   J experiences: its top-J retrieval, where, with ``warm_start_self_retrieval``, the record itself takes
   one of the slots (slot ``(step + b) mod n_b``, n_b the row's experiences: J when retrieval found
   enough). The answer is then in one experience, so L_init rewards a composer that carries it (with
   other tasks' experiences only, a generic prompt fits L_init as well as a specific one; the authors' cold
   start retrieves with self-retrieval on, so its own trajectory is there too);
2. L_init = the teacher's NLL of y* with all J*K latents in its context
   (:func:`~lopd_lightning.composer.losses.latent_nll`);
3. L_rec = the teacher's NLL of the record's own trace m_b, asked to repeat it with only that experience's
   K latents in its context (:data:`RECONSTRUCTION_INSTRUCTION`): an objective that a constant prompt
   cannot satisfy. With ``warm_start_reconstruction_noise`` p > 0 the trace to repeat is a noised copy
   m~_b (:func:`noised_traces`: each token replaced, with probability p, by a token drawn from the
   pretraining records' tokens; new every step), and its latents are composed from m~_b: a composer that
   recalls a train record instead of reading it cannot repeat m~_b, so it learns to copy what it reads,
   which is what a held-out experience needs;
   (``warm_start_reconstruction_weight: 0``, the authors' cold start, leaves this pass out);
4. L_pre = w_task L_init + w_rec L_rec; AdamW on phi = (chi, psi) with the two clip norms, its learning
   rate ``warm_start_lr`` constant or (``warm_start_lr_schedule: cosine``) warmed up linearly over the first
   10% of the steps and then decayed to 0 along a cosine (:func:`lr_factor`).

:class:`ComposerPretraining` runs these steps under ``Trainer.fit`` (progress, checkpoints, resume and
TensorBoard from Lightning; the checkpoints hold phi only); :func:`pretrain_composer` builds the trainer
and saves the composer with :func:`~lopd_lightning.composer.model.save_composer`. ``lopd pretrain-composer
-c CONFIG`` calls it; LOPD's ``fit`` loads the result from ``model.init_args.composer_path``.
``LOPDModule.warm_start_composer`` (``warm_start_steps`` inside ``fit``) takes the same steps.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor
from typing_extensions import override

from lopd_lightning.composer.losses import latent_nll, latent_spread, pretraining_objective
from lopd_lightning.teacher.prefix_cache import PrefixStore
from lopd_lightning.composer.model import (
    LR_SCHEDULES,
    ClipNorms,
    ComposerOutput,
    clip_composer_grads,
    composer_parameter_groups,
    save_composer,
)

if TYPE_CHECKING:
    from lopd_lightning.memory.experience import Experience
    from lopd_lightning.modules.lopd import LOPDModule
    from lopd_lightning.tasks import Example, Task

__all__ = [
    "RECONSTRUCTION_INSTRUCTION",
    "warm_start",
    "warm_start_draws",
    "ComposerPretraining",
    "PretrainingLosses",
    "pretrain_composer",
    "lr_factor",
    "noised_traces",
    "pretraining_draws",
    "pretraining_losses",
    "pretraining_records",
    "reconstruction_batch",
    "token_pool",
]

log = logging.getLogger(__name__)

#: the user message of a reconstruction prompt (the latents go before it; the reply is the experience)
RECONSTRUCTION_INSTRUCTION = "Repeat the reference example word for word."


def lr_factor(step: int, steps: int, schedule: str) -> float:
    """The multiplier of ``warm_start_lr`` at 0-based ``step`` of ``steps``.

    ``constant``: 1. ``cosine``: a linear warm-up over the first ``w = max(1, steps // 10)`` steps,
    ``(step + 1) / w``, then ``0.5 * (1 + cos(pi * (step - w) / max(1, steps - w)))``, from 1 towards 0 (the
    warm-up and cosine decay of language-model training; a run of fewer than 20 steps has a warm-up of one
    step, and a 2-step run takes two steps at the full rate).

    Raises:
        ValueError: an unknown ``schedule``.
    """
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"model.init_args.warm_start_lr_schedule {schedule!r} is not one of {LR_SCHEDULES}")
    warm = max(1, steps // 10)
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def token_pool(tokenizer: Any, records: Sequence[Experience]) -> list[int]:
    """Every token id of the records' traces, in order (repeats kept: drawing uniformly from the pool
    draws by the records' token frequencies): what :func:`noised_traces` draws its replacements from."""
    return [t for record in records for t in tokenizer(record.trace, add_special_tokens=False)["input_ids"]]


def noised_traces(tokenizer: Any, records: Sequence[Experience], pool: Sequence[int], probability: float,
                  *, seed: int, step: int) -> list[Experience]:
    """The records with noised traces: each token of a trace (``tokenizer``, no special tokens) replaced, with
    ``probability``, by a token drawn uniformly from ``pool``, decoded back to text; the rest of each record
    as it was. Seeded by ``(seed, step)`` through a ``torch.Generator``: the same step gets the same copies
    (a resumed run replays them), another step other ones.

    Raises:
        ValueError: ``probability`` outside [0, 1), or an empty ``pool`` with ``probability`` > 0.
    """
    import dataclasses

    if not 0.0 <= probability < 1.0:
        raise ValueError(f"model.init_args.warm_start_reconstruction_noise must be in [0, 1), got {probability}")
    if probability == 0.0:
        return list(records)
    if not pool:
        raise ValueError("the pretraining records hold no token to draw the reconstruction noise from")
    generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    out = []
    for record in records:
        ids = tokenizer(record.trace, add_special_tokens=False)["input_ids"]
        hit = (torch.rand(len(ids), generator=generator) < probability).tolist()
        draws = torch.randint(len(pool), (len(ids),), generator=generator).tolist()
        noised = [pool[d] if h else t for t, h, d in zip(ids, hit, draws, strict=True)]
        out.append(dataclasses.replace(record, trace=tokenizer.decode(noised)))
    return out


class PretrainingLosses(NamedTuple):
    """One pretraining step's terms (() float tensors).

    Attributes:
        loss: L_pre, what the optimiser minimises.
        task_nll: L_init, nats per token of the reference solutions (0 when its weight is 0).
        reconstruction_nll: L_rec, nats per token of the reconstructed traces (0 when its weight is 0).
        spread: :func:`~lopd_lightning.composer.losses.latent_spread` of the step's experiences' latents.
    """

    loss: Tensor
    task_nll: Tensor
    reconstruction_nll: Tensor
    spread: Tensor


def pretraining_records(module: LOPDModule, train_examples: Sequence[Example]) -> list[Experience]:
    """The bank records pretraining draws from: successful (``reward >= success_threshold``) trajectories
    of ``train_examples`` (never a held-out task's)."""
    known = {ex.id for ex in train_examples}
    return [r for r in module.bank.records if r.reward >= module.hparams.success_threshold and r.task_id in known]


def pretraining_draws(records: Sequence, *, steps: int, batch_size: int, seed: int) -> list[list]:
    """``steps`` batches of ``batch_size`` items of ``records``, drawn with replacement by a
    ``torch.Generator`` seeded with ``seed``: the same every call, so a resumed run and an analysis replay
    them (step s trains on batch s). Empty when ``records`` is."""
    if not records:
        return []
    generator = torch.Generator().manual_seed(int(seed))
    return [[records[i] for i in torch.randint(len(records), (batch_size,), generator=generator).tolist()]
            for _ in range(steps)]


def reconstruction_batch(module: LOPDModule, records: Sequence[Experience]):
    """The teacher-forced batch of L_rec: per record, ``user: RECONSTRUCTION_INSTRUCTION``, ``assistant:
    its trace`` (the latents go at the start of the user message, as for any task)."""
    from lopd_lightning.rollout import batch_from_conversations

    conversations = [[{"role": "user", "content": RECONSTRUCTION_INSTRUCTION},
                      {"role": "assistant", "content": record.trace}] for record in records]
    return batch_from_conversations(module.tokenizer, conversations, rewards=[1.0] * len(records),
                                    group_ids=list(range(len(records))), example_ids=[r.task_id for r in records])


def with_own_record(retrieved: list[list[Experience]], records: Sequence[Experience], *, num_experiences: int,
                    step: int) -> tuple[list[list[Experience]], list[int]]:
    """Each row's experiences with its own record in slot ``(step + b) mod n_b`` (n_b: the row's experiences, J
    when its retrieval found J - 1 others; the others: its retrieval without the record itself, in order):
    ``(experiences, the own record's slot per row)``."""
    rows, slots = [], []
    for b, (found, own) in enumerate(zip(retrieved, records, strict=True)):
        others = [e for e in found if not (e.task_id == own.task_id and e.trace == own.trace)][: num_experiences - 1]
        slot = (step + b) % (len(others) + 1)
        rows.append(others[:slot] + [own] + others[slot:])
        slots.append(slot)
    return rows, slots


def pretraining_losses(module: LOPDModule, task: Task, examples: Sequence[Example], records: Sequence[Experience],
                       *, step: int, pool: Sequence[int] | None = None,
                       prefixes: PrefixStore | None = None) -> PretrainingLosses:
    """L_pre of one step on ``records`` (the bank records of ``examples``, row for row): see the module
    docstring. Reads ``module.hparams``: ``warm_start_self_retrieval``, ``warm_start_task_weight``,
    ``warm_start_reconstruction_weight``, ``warm_start_reconstruction_noise``, ``num_experiences``, ``seed``.
    ``pool``: the tokens the reconstruction noise draws from (:func:`token_pool` of every pretraining
    record; None: this step's records'). ``prefixes``: a :class:`~lopd_lightning.teacher.prefix_cache.PrefixStore`
    that keeps the teacher's prompt prefixes across steps (the teacher's weights do not change in pretraining);
    None computes them in each step's own no-grad pass.

    Raises:
        ValueError: ``num_experiences`` is 0 (no latent to pretrain).
    """
    hp = module.hparams
    if hp.num_experiences < 1:
        raise ValueError("model.init_args.num_experiences is 0: the teacher sees no latents, there is no composer to "
                         "pretrain; set it to >= 1 or warm_start_steps to 0")
    batch = module.reference_batch(task, list(examples)).to(module.device)
    retrieved = module.retrieve(task, list(examples))
    if hp.warm_start_self_retrieval:
        experiences, slots = with_own_record(retrieved, records, num_experiences=hp.num_experiences, step=step)
    else:
        experiences, slots = retrieved, [0] * len(records)
    if not any(experiences):
        raise ValueError("no row of this pretraining batch has an experience (retrieval found none and "
                         "model.init_args.warm_start_self_retrieval is false); set it to true, or fill the bank")
    batch.experiences = experiences
    composed = module.batch_latents(batch)
    k = module.composer.num_latents
    zero = composed.latents.sum() * 0.0
    task_nll = zero
    # the prompt before the latents (the system prompt and tool schemas) once, without gradients (the teacher's
    # weights are constants here): latent_nll's prefix_cache, as the training step's teacher_prefix_cache
    cached = bool(hp.get("teacher_prefix_cache", True)) and not hp.get("gradient_checkpointing", False)
    if cached and prefixes is not None:
        cached = prefixes
    if hp.warm_start_task_weight > 0:
        task_nll = latent_nll(module.teacher, composed, batch.input_ids, batch.attention_mask, batch.context_position,
                              batch.assistant_mask, prefix_cache=cached)
    # one experience per row that has one (the own record, or the first retrieved one): its K latents
    kept = [b for b, exps in enumerate(experiences) if exps]
    device = composed.latents.device
    index = torch.tensor([slots[b] for b in kept], device=device)[:, None] * k + torch.arange(k, device=device)
    rows = torch.tensor(kept, device=device)[:, None]
    own = ComposerOutput(composed.latents[rows, index], composed.latent_mask[rows, index])  # [B', K, d], [B', K]
    reconstruction = zero
    if hp.warm_start_reconstruction_weight > 0:
        targets = [experiences[b][slots[b]] for b in kept]
        read = own
        noise = float(hp.warm_start_reconstruction_noise)
        if noise > 0:  # repeat a noised copy, from the noised copy's own latents
            targets = noised_traces(module.tokenizer, targets,
                                    token_pool(module.tokenizer, records) if pool is None else pool, noise,
                                    seed=hp.seed, step=step)
            read = module.composer.compose([[(e.task_text, e.trace)] for e in targets])
        rec = reconstruction_batch(module, targets).to(module.device)
        reconstruction = latent_nll(module.teacher, read, rec.input_ids, rec.attention_mask, rec.context_position,
                                    rec.assistant_mask)
    loss = pretraining_objective(task_nll, reconstruction, task_weight=hp.warm_start_task_weight,
                                 reconstruction_weight=hp.warm_start_reconstruction_weight)
    spread = latent_spread(own.latents, own.latent_mask.any(dim=1))
    return PretrainingLosses(loss, task_nll.detach(), reconstruction.detach(), spread)


def pretraining_optimizer(module: LOPDModule) -> torch.optim.AdamW:
    """AdamW at ``warm_start_lr`` without weight decay over phi: the compressor and the encoder LoRA as two
    parameter groups, each with its clip norm (``composer_clip_compressor``, ``composer_clip_lora``)."""
    hp = module.hparams
    groups = composer_parameter_groups(module.composer, lr=hp.warm_start_lr, weight_decay=0.0,
                                       compressor_clip=hp.composer_clip_compressor, lora_clip=hp.composer_clip_lora)
    return torch.optim.AdamW(groups, lr=hp.warm_start_lr, weight_decay=0.0)


def pretraining_scheduler(module: LOPDModule, optimizer: torch.optim.Optimizer,
                          steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``warm_start_lr`` times :func:`lr_factor` at each of ``steps`` steps (``warm_start_lr_schedule``), stepped
    once per optimiser step."""
    schedule = str(module.hparams.warm_start_lr_schedule)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps, schedule))


def clip_pretraining_grads(module: LOPDModule) -> ClipNorms:
    """Clip phi's gradients, the compressor and the LoRA each to its own norm; their norms before clipping."""
    hp = module.hparams
    return clip_composer_grads(module.composer, compressor_clip=hp.composer_clip_compressor,
                               lora_clip=hp.composer_clip_lora)


def warm_start_draws(module: LOPDModule, datamodule: Any) -> list[list[Experience]]:
    """The records the in-process warm start trains on, one list per step (``warm_start_steps`` of
    ``warm_start_batch_size``; empty without any): :func:`pretraining_records` of ``datamodule``'s (an
    ``OnPolicyDataModule``) train split drawn by :func:`pretraining_draws` with ``hparams.seed`` (the batches
    of :class:`ComposerPretraining`'s steps). Logs at INFO how many bank records qualify."""
    records = pretraining_records(module, datamodule.train_examples)
    if len(records) < len(module.bank):
        log.info("composer warm start: %d of %d bank records are successful trajectories of this task's "
                 "train split", len(records), len(module.bank))
    hp = module.hparams
    return pretraining_draws(records, steps=hp.warm_start_steps, batch_size=hp.warm_start_batch_size, seed=hp.seed)


def warm_start(module: LOPDModule, datamodule: Any) -> None:
    """The pretraining's steps in this process, without Lightning (LOPD's ``fit`` runs it first when the composer
    is fresh): ``warm_start_steps`` AdamW steps (``warm_start_lr``, no weight decay, the two clip norms) of
    :func:`pretraining_losses` on the batches of :func:`warm_start_draws`, the same steps as
    :class:`ComposerPretraining`'s. Source: docs/METHOD.md section 5, "Composer cold start", and section 3,
    "Deviation"."""
    draws = warm_start_draws(module, datamodule)
    if not draws and module.hparams.warm_start_steps > 0:
        log.warning("composer warm start skipped: the bank holds no successful trajectory")
    if not draws:
        return
    optimizer = pretraining_optimizer(module)
    scheduler = pretraining_scheduler(module, optimizer, len(draws))
    pool = token_pool(module.tokenizer, pretraining_records(module, datamodule.train_examples)) \
        if module.hparams.warm_start_reconstruction_noise > 0 else []
    prefixes = PrefixStore()  # the teacher's weights stay as they are for the whole warm start
    for step, chosen in enumerate(draws):
        examples = [datamodule.example(r.task_id) for r in chosen]
        losses = pretraining_losses(module, datamodule.task, examples, chosen, step=step, pool=pool, prefixes=prefixes)
        losses.loss.backward()
        clip_pretraining_grads(module)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == len(draws) - 1:
            log.info("composer warm start %d/%d: L_pre %.4f (L_init %.4f, L_rec %.4f, spread %.3f)", step + 1,
                     len(draws), losses.loss.item(), losses.task_nll.item(), losses.reconstruction_nll.item(),
                     losses.spread.item())


class ComposerPretraining(LightningModule):
    """The composer's pretraining as a LightningModule: ``Trainer.fit`` runs :func:`pretraining_losses`.

    Step s trains on batch s of :func:`pretraining_draws` (``warm_start_steps`` batches of
    ``warm_start_batch_size`` records, seeded with the module's ``seed``), indexed by ``global_step`` so
    that a resumed run continues where it stopped. The optimiser is AdamW at ``warm_start_lr`` (no weight
    decay; shaped by ``warm_start_lr_schedule``, :func:`lr_factor`) over phi, the compressor and the LoRA
    each clipped to its own norm
    (:func:`~lopd_lightning.composer.model.clip_composer_grads`). Checkpoints hold phi and the optimiser's
    state only (not the backbone). Logs ``pretrain/loss``, ``pretrain/task_nll``,
    ``pretrain/reconstruction_nll`` and ``pretrain/latent_spread``.

    Args:
        module: the LOPDModule whose composer, teacher and bank are used (its settings: ``module.hparams``).
        task: the task whose train examples the records solve.
        examples: the train examples by id.
        records: :func:`pretraining_records`.

    Raises:
        ValueError: no record to draw from, or ``warm_start_steps`` < 1.
    """

    def __init__(self, module: LOPDModule, task: Task, examples: dict[str, Example], records: Sequence[Experience]):
        super().__init__()
        hp = module.hparams
        if not records:
            raise ValueError("the bank holds no successful trajectory of the train split to pretrain the composer on; "
                             "build one with `lopd build-memory -c CONFIG --from-references`")
        if hp.warm_start_steps < 1:
            raise ValueError(f"model.init_args.warm_start_steps must be >= 1 to pretrain, got {hp.warm_start_steps}")
        self.lopd = module
        self.task = task
        self.examples = examples
        self.draws = pretraining_draws(records, steps=hp.warm_start_steps, batch_size=hp.warm_start_batch_size,
                                       seed=hp.seed)
        #: the tokens of every record, what the reconstruction noise draws from
        self.pool = token_pool(module.tokenizer, records) if hp.warm_start_reconstruction_noise > 0 else []
        #: the teacher's prompt prefixes, kept across steps (its weights do not change in this stage)
        self.prefixes = PrefixStore()
        self.strict_loading = False  # checkpoints hold phi only

    def trainable_names(self) -> set[str]:
        """The state-dict keys of phi (what the checkpoints hold)."""
        ids = {id(p) for p in self.lopd.composer.trainable_parameters()}
        return {name for name, p in self.named_parameters() if id(p) in ids}

    @override
    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(len(self.draws)), batch_size=None, shuffle=False)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        step = int(self.global_step)
        records = self.draws[step]
        examples = [self.examples[r.task_id] for r in records]
        self.lopd.train()
        losses = pretraining_losses(self.lopd, self.task, examples, records, step=step, pool=self.pool,
                                    prefixes=self.prefixes)
        self.log_dict({"pretrain/loss": losses.loss.detach(), "pretrain/task_nll": losses.task_nll,
                       "pretrain/reconstruction_nll": losses.reconstruction_nll,
                       "pretrain/latent_spread": losses.spread}, prog_bar=True, batch_size=len(records))
        return losses.loss

    @override
    def configure_optimizers(self):
        optimizer = pretraining_optimizer(self.lopd)
        scheduler = pretraining_scheduler(self.lopd, optimizer, len(self.draws))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def on_before_optimizer_step(self, optimizer) -> None:
        norms = clip_pretraining_grads(self.lopd)
        self.log_dict({"pretrain/grad_norm_compressor": norms.compressor, "pretrain/grad_norm_lora": norms.lora})

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        keep = self.trainable_names()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}


def pretrain_composer(module: LOPDModule, datamodule: Any, out: str | Path, *, resume: bool = False,
                      trainer_options: dict[str, Any] | None = None, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Pretrain ``module``'s composer with Lightning and save it to ``out`` (:func:`save_composer`).

    Args:
        module: an LOPDModule (its ``warm_start_*`` settings, bank, composer and teacher).
        datamodule: an :class:`~lopd_lightning.data.OnPolicyDataModule` (its task and train split).
        out: the composer's folder: ``composer.pt``, ``checkpoints/`` (Lightning's, every 10% of the
            steps and the last) and ``tensorboard/``.
        resume: continue from ``out/checkpoints/last.ckpt`` when it exists.
        trainer_options: more ``Trainer`` arguments (accelerator, precision, ...).
        callbacks: Lightning callbacks besides the checkpointing one (e.g. an evaluation every n steps).

    Returns:
        What was saved beside the weights: steps, seconds, the last losses, the bank's size.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    out = Path(out)
    examples = {ex.id: ex for ex in datamodule.train_examples}
    records = pretraining_records(module, datamodule.train_examples)
    pretraining = ComposerPretraining(module, datamodule.task, examples, records)
    steps = len(pretraining.draws)
    every = max(1, steps // 10)
    options = dict(accelerator="cpu", devices=1, logger=TensorBoardLogger(str(out), name="tensorboard"),
                   enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0, limit_val_batches=0)
    options.update(trainer_options or {})
    options.update(max_steps=steps)
    checkpoints = ModelCheckpoint(dirpath=str(out / "checkpoints"), save_last=True, every_n_train_steps=every,
                                  save_top_k=1, monitor=None)
    trainer = Trainer(callbacks=[checkpoints, *callbacks], **options)
    last = out / "checkpoints" / "last.ckpt"
    start = time.perf_counter()
    trainer.fit(pretraining, ckpt_path=str(last) if resume and last.exists() else None)
    seconds = time.perf_counter() - start
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("pretrain/")}
    info = {"steps": int(trainer.global_step), "seconds": seconds, "records": len(records), "metrics": metrics,
            "warm_start_batch_size": module.hparams.warm_start_batch_size,
            "warm_start_lr": module.hparams.warm_start_lr}
    save_composer(module.composer, out, info=info)
    log.info("composer pretrained for %d steps (%.0f s) -> %s", info["steps"], seconds, out)
    return info
