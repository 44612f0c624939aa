"""What a run shows while it trains: the logged tags, the progress line, samples, the generations files.

:class:`ObservabilityMixin` is one part of :class:`~lopd_lightning.modules.base.OnPolicyModule` (it is
not used alone). Everything a person reads during or after a run is written here:

- the scalar tags of every training step (:meth:`~ObservabilityMixin.log_rollout_metrics`): ``train/...``
  (the shared reward, success rate, trajectory count, skipped steps, and the method's own values),
  ``time/<phase>`` (seconds of each phase of the step) and ``by_rollouts/<name>`` (the same values with
  the trajectories generated so far as x-axis);
- the progress line, one INFO line every ``progress_every_n_steps`` steps (:meth:`~ObservabilityMixin.progress_line`);
- trajectories as TensorBoard text (``samples/<split>``, :meth:`~ObservabilityMixin.sample_markdown`) and
  every validation episode as one JSON line in ``<log_dir>/generations/<split>_step_<N>.jsonl``
  (:meth:`~ObservabilityMixin.trajectory_records`, :meth:`~ObservabilityMixin.write_generations`);
- the step-counting progress bar (:meth:`~ObservabilityMixin.configure_callbacks`).

The validation metrics themselves (``val/...``) are computed in :mod:`lopd_lightning.modules.evaluation`,
which writes them through the functions here.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from typing_extensions import override

from lopd_lightning.callbacks import AtomicCheckpointIO, LastCheckpointAtTrainEnd, step_progress_bar
from lopd_lightning.io import atomic_write
from lopd_lightning.rollout import RolloutBatch

log = logging.getLogger(__name__)

__all__ = ["PHASE_NAMES", "ObservabilityMixin"]

#: Short names of the ``step_timings`` phases in the progress line.
PHASE_NAMES = {"generation": "gen", "student_step": "student", "composer_step": "composer"}


def _fenced(text: str) -> str:
    """``text`` in a markdown code fence longer than any run of backticks inside it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def _md_escape(text: str) -> str:
    """``text`` with markdown's special characters escaped (for short labels outside code fences)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([\\`*_{}\[\]()#+\-.!|~])", r"\\\1", text)


class ObservabilityMixin(LightningModule):
    """The logged tags, progress line, TensorBoard samples and generations files of an ``OnPolicyModule``.

    Reads the module's ``hparams`` (``success_threshold``, ``log_samples``, ``log_samples_every_n_steps``,
    ``sample_prompt_chars``, ``save_generations``, ``progress_every_n_steps``; documented on
    :class:`~lopd_lightning.modules.base.OnPolicyModule`), ``rollouts_consumed``, ``non_finite_steps`` and
    ``step_timings``. Only rank 0 writes to loggers and files.
    """

    def _init_observability(self) -> None:
        """The state this mixin keeps (called once by ``OnPolicyModule.__init__``)."""
        #: reward, success rate and loss of the last training step (the progress line).
        self.last_step_values: dict[str, float] = {}

    # ------------------------------------------------------------------ scalars
    def log_rollout_metrics(self, batch: RolloutBatch, metrics: dict[str, float | Tensor]) -> None:
        """Log the shared ``train/``, ``time/`` and ``by_rollouts/`` tags of one step, with ``metrics`` (the
        method's own ``train/...`` values, logged as they are; tensors are detached).

        The shared tags: ``reward_mean``, ``success_rate``, ``rollouts``, ``non_finite_steps`` and, for a
        generated batch, ``reply_tokens_mean`` (tokens per reply) and ``cut_at_length_rate`` (the fraction
        of replies that ended at ``max_new_tokens``), both over every reply of every rank (left out for a
        teacher-forced batch, e.g. SFT's)."""
        rewards = batch.rewards.float()
        success = (rewards >= self.hparams.success_threshold).float()
        shared = {
            "train/reward_mean": self.global_mean(rewards.mean()),
            "train/success_rate": self.global_mean(success.mean()),
            "train/rollouts": float(self.rollouts_consumed),
            "train/non_finite_steps": float(self.non_finite_steps),
        }
        tokens, cut = batch.reply_lengths()
        replies = self.global_count(len(tokens))  # ratios of sums over every rank's replies
        if replies > 0:  # the same global count on every rank: each rank runs the same collectives
            shared["train/reply_tokens_mean"] = self.global_count(int(tokens.sum())) / replies
            shared["train/cut_at_length_rate"] = self.global_count(int(cut.sum())) / replies
        values = {**shared, **{k: (v.detach() if isinstance(v, Tensor) else v) for k, v in metrics.items()}}
        for phase, seconds in self.step_timings.items():
            values[f"time/{phase}"] = seconds
        floats = {k: float(v) for k, v in values.items()}
        # callback_metrics (progress, checkpoint monitors); the loggers get them below, at x = this step
        self.log_dict(floats, on_step=True, on_epoch=False, batch_size=len(batch), logger=False)
        self.log_step_scalars(floats)
        self.last_step_values = {
            "reward": float(shared["train/reward_mean"]),
            "success": float(shared["train/success_rate"]),
            **({"loss": float(values["train/loss"])} if "train/loss" in values else {}),
        }
        self.log("reward", float(shared["train/reward_mean"]), prog_bar=True, logger=False, batch_size=len(batch))
        self.log("rollouts", float(self.rollouts_consumed), prog_bar=True, logger=False, batch_size=len(batch))
        self.log_by_rollouts({k.split("/", 1)[1]: v for k, v in values.items() if k.startswith("train/")})

    def log_step_scalars(self, values: dict[str, float]) -> None:
        """Write ``values`` to the loggers at x = ``global_step``: after the k-th optimiser step that is k,
        the x of the validation that follows it (Lightning's own ``self.log`` under manual optimisation
        files a training step's values under k - 1). Every ``log_every_n_steps`` steps, as Lightning's
        logging does."""
        if self._trainer is None:
            return
        step = int(self.global_step)
        every = int(getattr(self.trainer, "log_every_n_steps", 1) or 1)
        if step % every == 0 or self.trainer.should_stop:
            self.log_to_loggers(values, step)

    def log_by_rollouts(self, values: dict[str, float | Tensor]) -> None:
        """Write ``by_rollouts/<name>`` scalars whose x-axis is the cumulative trajectory count."""
        if self.global_rank != 0:
            return
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                for name, value in values.items():
                    logger.experiment.add_scalar(f"by_rollouts/{name}", float(value), self.rollouts_consumed)

    def log_to_loggers(self, values: dict[str, float], step: int) -> None:
        """Write scalars to every logger at ``step`` (rank 0), bypassing Lightning's step bookkeeping."""
        if self.global_rank != 0:
            return
        for logger in self.loggers:
            logger.log_metrics(values, step=step)

    # ------------------------------------------------------------------ samples and generations
    def trajectory_records(self, batch: RolloutBatch, prefix: str, step: int, rows: int | None = None) -> list[dict[str, Any]]:
        """One JSON-ready dict per trajectory of ``batch`` (its first ``rows``): ``step``, ``split``,
        ``example_id``, ``reward``, ``success``, ``turns``, ``done``, ``truncation``, ``reply_tokens`` and
        ``stop_reasons`` (per assistant turn: tokens generated, and ``"eos"``, ``"stop_string"`` or
        ``"length"``, a reply cut at the token limit; empty for a batch that was not generated),
        ``errors`` (the checker's verdicts), ``info`` (the last step's ``StepResult.info``) and
        ``messages``."""
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
                "reply_tokens": [int(n) for n in meta.get("reply_tokens") or []],
                "stop_reasons": [str(r) for r in meta.get("stop_reasons") or []],
                "errors": list(meta.get("errors") or []),
                "info": dict(meta.get("info") or {}),
                "messages": [dict(m) for m in batch.messages[i]],
            })
        return out

    def generations_dir(self) -> Path | None:
        """``<log_dir>/generations`` of the first logger (None without a logger)."""
        if not self.loggers:
            return None
        logger = self.loggers[0]
        root = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        return None if root is None else Path(root) / "generations"

    def write_generations(self, prefix: str, step: int, records: list[dict[str, Any]]) -> Path | None:
        """Write ``records`` to ``<log_dir>/generations/<prefix>_step_<step>.jsonl`` (rank 0, one JSON
        object a line); returns the path, or None when nothing was written. The file appears whole or not at
        all (:func:`~lopd_lightning.io.atomic_write`: written beside it, then renamed): a process killed or a
        disk filled while writing leaves no part of it (and an earlier file of that name as it was), so a
        reader (benchmarks/compare_runs.py's resume, which re-runs an evaluation whose file is missing) never
        takes half an evaluation for a finished one."""
        if not self.hparams.save_generations or self.global_rank != 0 or not records:
            return None
        directory = self.generations_dir()
        if directory is None:
            return None
        path = directory / f"{prefix}_step_{step}.jsonl"
        with atomic_write(path, "w") as f:  # the folder created
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
        parts.extend(_conversation_markdown(messages[first:]))
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
        ``setup`` included) instead of overriding the Trainer's with its INFO line on every run.

        And :class:`~lopd_lightning.callbacks.LastCheckpointAtTrainEnd`, so that a ``ModelCheckpoint`` with
        ``save_last`` leaves ``last.ckpt`` at the final step, not at its schedule's last multiple.

        And, not a callback: the Trainer's checkpoint writer, when it is Lightning's default, becomes
        :class:`~lopd_lightning.callbacks.AtomicCheckpointIO` (a checkpoint appears whole or not at all)."""
        if self._trainer is None:
            return []
        AtomicCheckpointIO.install(self.trainer)
        # Lightning would replace a Trainer's own one (same type) with an INFO line on every later stage
        final = [] if any(isinstance(c, LastCheckpointAtTrainEnd) for c in self.trainer.callbacks) \
            else [LastCheckpointAtTrainEnd()]
        default = self.trainer.progress_bar_callback
        bar = step_progress_bar(default)
        if bar is None:
            return final
        self.trainer.callbacks = [c for c in self.trainer.callbacks if c is not default]
        return [bar, *final]


def _conversation_markdown(messages: list[dict[str, Any]]) -> list[str]:
    """Each reply and observation of a trajectory (from its first reply on) as ``role:`` and a fence;
    replies are numbered by turn, and an empty or whitespace-only text says so."""
    parts, turn = [], 0
    for m in messages:
        role = _md_escape(str(m.get("role")))
        if role == "assistant":
            turn += 1
            role = f"assistant (turn {turn})"
        content = str(m.get("content") or "")
        if not content.strip():  # an empty fence says nothing: show what the whitespace is
            role += " (empty)" if not content else " (whitespace only, shown escaped)"
            content = repr(content) if content else ""
        parts.append(f"{role}:\n\n" + _fenced(content))
    return parts
