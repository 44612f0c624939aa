"""Validation and test episodes of every method: greedy, one per example, logged as ``val/`` and ``test/``.

:class:`EvaluationMixin` is one part of :class:`~lopd_lightning.modules.base.OnPolicyModule` (it is not
used alone). Lightning's validation loop hands it the DataModule's val examples
(``validation_step``); each batch is run greedily by the current student
(:meth:`~EvaluationMixin.evaluate_examples`, through the module's hooks:
:class:`~lopd_lightning.modules.hooked_task.ModuleHookedTask`). At the end of the loop
:meth:`~EvaluationMixin.log_evaluation` writes ``<split>/reward_mean``, ``<split>/success_rate``,
``<split>/turns_mean``, ``<split>/reply_tokens_mean`` and ``<split>/cut_at_length_rate`` (per reply; left
out when no rank generated a reply) at x = the training steps done (and ``by_rollouts/<split>_...``),
the samples and the generations file (:mod:`lopd_lightning.modules.observability`), and one INFO line.
``lopd validate|test --ckpt_path`` labels all of them with the checkpoint's own step
(:meth:`~EvaluationMixin.evaluated_step`), not with the 0 its Trainer counts.

Under DDP the logged values count the examples that the distributed sampler repeats to even out the
ranks; the generations file keeps each example once.

Nothing is logged or written for Lightning's sanity-check validation (``num_sanity_val_steps``).
``validate_before_training`` runs the val split once before the first step, logged at step 0.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import MeanMetric
from typing_extensions import override

from lopd_lightning.modules.hooked_task import ModuleHookedTask
from lopd_lightning.modules.observability import ObservabilityMixin
from lopd_lightning.rollout import RolloutBatch, generate_rollouts
from lopd_lightning.tasks import Example, Task

log = logging.getLogger(__name__)

__all__ = ["EvaluationMixin"]


class EvaluationMixin(ObservabilityMixin):
    """Greedy validation and test episodes, their metrics and what they leave in the logs.

    Reads the module's ``hparams`` (``success_threshold``, ``seed``, ``save_generations``,
    ``log_samples``, ``validate_before_training``) and its rollout settings (``sampling_options``,
    ``student_context``), defined by :class:`~lopd_lightning.modules.base.OnPolicyModule`.

    Attributes (after an evaluation):
        last_val, last_test: the values :meth:`log_evaluation` returned for the last validation / test.
        val_history: ``(training steps done, values)`` of every validation of this run; checkpoints carry it,
            so a resumed run keeps its step-0 validation. A checkpoint written at a training step
            (``every_n_train_steps``, ``last.ckpt``) is written before that step's validation: a run resumed
            from it lacks that one entry, which is not run again (the logs have it). One written when a
            validation ends (compare.py's ``evaluated.ckpt``) has it, and so does a ``last.ckpt`` that
            :class:`~lopd_lightning.callbacks.LastCheckpointAtTrainEnd` writes at the end of training (when
            the schedule had not saved the final step already).
    """

    def _init_evaluation(self) -> None:
        """The state this mixin keeps (called once by ``OnPolicyModule.__init__``)."""
        self.val_reward = MeanMetric()
        self.val_success = MeanMetric()
        self.val_turns = MeanMetric()
        self.val_reply_tokens = MeanMetric()  # over replies, not episodes
        self.val_cut_at_length = MeanMetric()
        #: the batches of the current evaluation (samples and the generations file; reset by log_evaluation).
        self.eval_batches: list[RolloutBatch] = []

    # ------------------------------------------------------------------ episodes
    def evaluate_examples(self, task: Task, examples: list[Example]) -> RolloutBatch:
        """Greedy episodes of the current student on ``examples`` (one trajectory each)."""
        with self.student_context(), self.whole_weights():
            return generate_rollouts(
                self.backbone,
                self.tokenizer,
                ModuleHookedTask(task, self),
                examples,
                group_size=1,
                seed=self.hparams.seed,
                step=0,
                backend=self.generation_backend(),
                **self.sampling_options(greedy=True),
            )

    @override
    def validation_step(self, examples: list[Example], batch_idx: int) -> None:
        batch = self.evaluate_examples(self.trainer.datamodule.task, examples)
        rewards = batch.rewards.float().to(self.device)
        self.val_reward.update(rewards)
        self.val_success.update((rewards >= self.hparams.success_threshold).float())
        self.val_turns.update(torch.tensor([float(m.get("turns", 1)) for m in batch.metadata]))
        tokens, cut = batch.reply_lengths()  # updated even when empty: every rank syncs the same metrics
        self.val_reply_tokens.update(tokens)
        self.val_cut_at_length.update(cut)
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
        self.val_history = getattr(self, "val_history", []) + [(self.evaluated_step(), self.last_val)]

    @override
    def test_step(self, examples: list[Example], batch_idx: int) -> None:
        """The same greedy episodes as :meth:`validation_step` (``lopd test``: the DataModule's test split)."""
        self.validation_step(examples, batch_idx)

    @override
    def on_test_epoch_end(self) -> None:
        values = self.log_evaluation("test")
        if values is not None:
            self.last_test = values

    @override
    def on_train_start(self) -> None:
        """With ``validate_before_training``: the val split once before the first step, logged at step 0."""
        if self.hparams.validate_before_training and self.global_step == 0:
            dm = self.trainer.datamodule
            loader = dm.val_dataloader()
            for i, examples in enumerate(loader):
                self.validation_step(list(examples), i)
            values = self.log_evaluation("val", direct_step=0)
            if values is not None:
                self.last_val = values
                self.val_history = getattr(self, "val_history", []) + [(0, values)]

    def evaluated_step(self) -> int:
        """The training steps of the weights being evaluated: under ``validate``/``test`` of a checkpoint
        (``ckpt_path``), the checkpoint's ``global_step``; else ``trainer.global_step`` (a fit's, or a module
        validated after its fit on the same Trainer; 0 for one never trained)."""
        trainer = self._trainer
        if (trainer is not None and trainer.state.fn != "fit" and trainer.ckpt_path
                and getattr(self, "checkpoint_step", None) is not None):
            return int(self.checkpoint_step)
        return int(self.global_step)

    def reset_evaluation(self) -> None:
        """Forget the episodes of the current evaluation (metrics and batches)."""
        for metric in (self.val_reward, self.val_success, self.val_turns, self.val_reply_tokens,
                       self.val_cut_at_length):
            metric.reset()
        self.eval_batches = []

    # ------------------------------------------------------------------ what an evaluation leaves
    def log_evaluation(self, prefix: str, *, direct_step: int | None = None) -> dict[str, float] | None:
        """Log ``<prefix>/reward_mean``, ``<prefix>/success_rate``, ``<prefix>/turns_mean``,
        ``<prefix>/reply_tokens_mean`` and ``<prefix>/cut_at_length_rate`` (per reply) of the episodes
        since the last call (also ``by_rollouts/<prefix>_...``), show the first ``log_samples``
        episodes as TensorBoard text (``samples/<prefix>``), write every episode to
        ``<log_dir>/generations/<prefix>_step_<N>.jsonl``, reset and return the values (None when no
        episode ran).

        Inside ``fit`` the values are written straight to the loggers at x = the training steps done
        (``self.log`` would file the validation after step k under k - 1); they still reach
        ``trainer.callback_metrics`` (checkpoint monitors). Under ``validate``/``test`` they go through
        ``self.log`` (the results ``trainer.validate`` returns), with a ``step`` value that Lightning's loggers take
        for the x: :meth:`evaluated_step`, the checkpoint's step under ``--ckpt_path`` (Lightning would write 0).
        ``direct_step`` writes at that step instead (outside Lightning's validation loop, e.g. the evaluation
        before training, at 0).
        """
        if self.val_reward.update_count == 0:
            self.eval_batches = []
            return None
        values = {
            f"{prefix}/reward_mean": self.val_reward.compute(),
            f"{prefix}/success_rate": self.val_success.compute(),
            f"{prefix}/turns_mean": self.val_turns.compute(),
        }
        for name, metric in (("reply_tokens_mean", self.val_reply_tokens),
                             ("cut_at_length_rate", self.val_cut_at_length)):
            value = metric.compute()  # NaN when no rank had a reply: left out
            if not torch.isnan(value):
                values[f"{prefix}/{name}"] = value
        in_fit = self._trainer is not None and self.trainer.state.fn == "fit"
        step = self.evaluated_step() if direct_step is None else int(direct_step)
        if direct_step is None and not in_fit:  # `lopd validate` / `lopd test`: Lightning's loggers and results
            # Lightning's loggers write at a logged "step" (else at its fit loop's steps: 0 under validate)
            self.log_dict({**values, "step": float(step)}, prog_bar=False)
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
            if dm is not None and hasattr(dm, "val_examples"):
                order = {ex.id: i for i, ex in enumerate(dm.val_examples)}
                records.sort(key=lambda r: order.get(r["example_id"], len(order)))
        return records
