"""Callbacks for any method: the run summary, the last checkpoint at the final step, and progress bars
that count training steps; and :class:`AtomicCheckpointIO`, the checkpoint writer every on-policy module
installs (a checkpoint appears whole or not at all).

The LOPD-only callbacks (``MemoryRefresh``, ``MarginSchedule``) are beside LOPD, in
:mod:`lopd_lightning.modules.lopd_callbacks`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar, TQDMProgressBar
from typing_extensions import override

from lopd_lightning.io import atomic_write, write_json


class RunSummary(Callback):
    """Prints what a user wants at the end of a fit: the held-out metric before and after, seconds per
    step by phase, peak memory, the TensorBoard folder and the checkpoint path; optionally as JSON.

    Args:
        metric: the validation tag to report (e.g. ``"val/success_rate"``).
        json_path: also write the summary there (None: print only); the file is replaced whole or not at all
            (:func:`~lopd_lightning.io.write_json`), and ``lopd fit`` checks its folder before the model loads.
    """

    def __init__(self, metric: str = "val/success_rate", json_path: str | None = None):
        self.metric = metric
        self.json_path = json_path
        self.phase_seconds: dict[str, list[float]] = {}
        self.start_time: float | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        import time

        self.start_time = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        for phase, seconds in getattr(pl_module, "step_timings", {}).items():
            self.phase_seconds.setdefault(phase, []).append(float(seconds))

    @staticmethod
    def generations(pl_module: LightningModule) -> str | None:
        """The folder of the validation generations (``<log_dir>/generations``), when it was written."""
        folder = pl_module.generations_dir() if hasattr(pl_module, "generations_dir") else None
        return str(folder) if folder is not None and folder.is_dir() else None

    def summary(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """The summary as a dict (also what is printed and written)."""
        import resource
        import statistics
        import time

        history = getattr(pl_module, "val_history", [])
        values = [(step, metrics.get(self.metric)) for step, metrics in history]
        ckpt = trainer.checkpoint_callback
        logger = trainer.logger
        return {
            "method": type(pl_module).__name__,
            "metric": self.metric,
            "before": values[0][1] if values and values[0][0] == 0 else None,
            "after": values[-1][1] if values and values[-1][0] > 0 else None,
            "history": values,
            "steps": int(trainer.global_step),
            "rollouts": int(getattr(pl_module, "rollouts_consumed", 0)),
            "train_seconds": None if self.start_time is None else time.perf_counter() - self.start_time,
            "seconds_per_step_median": {k: statistics.median(v) for k, v in self.phase_seconds.items() if v},
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "log_dir": getattr(logger, "log_dir", None) if logger else None,
            "generations": self.generations(pl_module),
            "checkpoint": (ckpt.last_model_path or ckpt.best_model_path or None) if ckpt is not None else None,
        }

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        s = self.summary(trainer, pl_module)
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(s["seconds_per_step_median"].items()))
        print(
            f"\n== {s['method']}: {s['steps']} steps, {s['rollouts']} trajectories ==\n"
            f"held-out {self.metric}: before {fmt(s['before'])} -> after {fmt(s['after'])}\n"
            f"median seconds per step by phase: {phases or 'n/a'}\n"
            f"peak memory (RSS): {s['peak_rss_mb']:.0f} MB\n"
            f"TensorBoard logs: {s['log_dir']}  (tensorboard --logdir {s['log_dir']}; sample trajectories under TEXT)\n"
            + (f"validation generations (one JSON line per episode): {s['generations']}\n" if s["generations"] else "")
            + f"checkpoint: {s['checkpoint']}",
            flush=True,
        )
        if self.json_path:  # whole or not at all: a failed write leaves the previous summary
            write_json(self.json_path, s, indent=2)


class LastCheckpointAtTrainEnd(Callback):
    """Writes the last checkpoint (``last.ckpt``) of every ``ModelCheckpoint(save_last=...)`` at the end of
    training when that callback last saved at an earlier step, so that ``last.ckpt`` is the trained model.

    Lightning's ``ModelCheckpoint`` saves on its own schedule (``every_n_train_steps``, after validation,
    ...), and its ``on_train_end`` writes ``last.ckpt`` only when nothing was saved during the fit: a run of
    70 steps with ``every_n_train_steps: 4`` ended with a ``last.ckpt`` of step 68, which ``lopd export``
    and the run summary took for the final model. The save goes through the checkpoint callback's own
    ``_save_last_checkpoint`` (its file name template and version counter, the previous last removed; with
    ``save_last: link`` a file, since no top-k checkpoint of the final step exists to link to), is skipped
    where that callback would skip a save (already saved at this step, e.g. after a validation at the final
    step; not fitting), and runs on every rank (Lightning's save is collective). A run stopped by an
    exception is not saved here.

    Every on-policy module adds it after the Trainer's callbacks (:meth:`OnPolicyModule.configure_callbacks`);
    another module can pass it to its ``Trainer``, after any callback that changes the weights in
    ``on_train_end`` (e.g. ``StochasticWeightAveraging``), which it would otherwise save before. A
    ``ModelCheckpoint`` without ``save_last`` is left alone.
    """

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for callback in trainer.checkpoint_callbacks:
            if (isinstance(callback, ModelCheckpoint) and callback.save_last
                    and not callback._should_skip_saving_checkpoint(trainer)):
                # link mode links last.ckpt to the callback's latest file, a top-k one of an earlier step: the
                # final state must be written as a file of its own
                callback._last_checkpoint_saved = ""
                callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose local saves are written beside the target and renamed into place
    (:func:`~lopd_lightning.io.atomic_write`), so that a save that fails or is killed half-way leaves the previous
    checkpoint whole.

    Lightning's own writer serialises the checkpoint in memory, writes it to a file in the system's temporary
    folder and moves that into place (fsspec's transaction): a rename where both are on one filesystem; a copy
    into the target elsewhere (a ``/tmp`` on local disk, checkpoints on a network filesystem), which a full disk
    or a kill leaves truncated where the previous checkpoint was. Remote paths (``s3://``, ...) and saves with
    ``storage_options`` go through Lightning's writer (an object store replaces an object whole); loading and
    removing are Lightning's.

    Every on-policy module installs it in place of Lightning's default writer when a stage starts
    (:meth:`~lopd_lightning.modules.observability.ObservabilityMixin.configure_callbacks`); a writer given in
    ``trainer.plugins`` (or a strategy's own, e.g. DeepSpeed's) is left alone.
    """

    @staticmethod
    def install(trainer: Trainer) -> bool:
        """Put an :class:`AtomicCheckpointIO` in place of ``trainer``'s checkpoint writer when that is exactly
        Lightning's default ``TorchCheckpointIO``; returns whether it did."""
        strategy = trainer.strategy
        if type(strategy.checkpoint_io) is not TorchCheckpointIO:
            return False
        strategy.checkpoint_io = AtomicCheckpointIO()
        return True

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        text = os.fspath(path)
        if storage_options is not None or ("://" in text and not text.startswith("file://")):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        import io

        import torch

        buffer = io.BytesIO()  # serialised first, as Lightning's writer does: a full disk is then the OSError
        torch.save(checkpoint, buffer)  # of the file's write (torch's zip writer reports it as a RuntimeError)
        with atomic_write(Path(text.removeprefix("file://")), "wb") as f:
            f.write(buffer.getbuffer())


def step_description(trainer: Trainer) -> str:
    """``"step k/N"`` (training steps done / ``max_steps``), or ``"step k"`` without a step limit."""
    max_steps = trainer.max_steps
    if max_steps is not None and max_steps > 0:
        return f"step {trainer.global_step}/{max_steps}"
    return f"step {trainer.global_step}"


class StepTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, described by training steps (``step k/N``) instead of the epoch."""

    @override
    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(step_description(trainer))

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.train_progress_bar is not None:  # before the bar's own update, which redraws it
            self.train_progress_bar.set_description(step_description(trainer), refresh=False)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class StepRichProgressBar(RichProgressBar):
    """Lightning's rich bar, described by training steps (``step k/N``) instead of ``Epoch 0/-2`` (the
    endless on-policy stream runs one epoch with ``max_epochs=-1``)."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        description = step_description(self.trainer)
        if len(self.validation_description) > len(description):
            description = f"{description:{len(self.validation_description)}}"  # as Lightning pads it
        return description

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:  # before the bar's own update
            self.progress.update(self.train_progress_bar_id, description=self._get_train_description(trainer.current_epoch))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def train_description(self) -> str | None:
        """The train bar's current description (None before the bar exists)."""
        if self.progress is None or self.train_progress_bar_id is None:
            return None
        return str(self.progress.tasks[self.train_progress_bar_id].description)


def step_progress_bar(bar: ProgressBar | None) -> ProgressBar | None:
    """A step-counting replacement of Lightning's default progress bar ``bar`` with the same settings,
    or None when ``bar`` is None (disabled) or not exactly Lightning's ``TQDMProgressBar`` /
    ``RichProgressBar`` (a user's own bar is kept)."""
    if type(bar) is RichProgressBar:
        return StepRichProgressBar(
            refresh_rate=bar.refresh_rate, leave=bar._leave, theme=bar.theme, console_kwargs=bar._console_kwargs
        )
    if type(bar) is TQDMProgressBar:
        return StepTQDMProgressBar(refresh_rate=bar.refresh_rate, process_position=bar.process_position, leave=bar._leave)
    return None
