"""SFTModule: a supervised warm start of the student on the tasks' reference solutions.

Small students may not succeed at all on their own (SmolLM2-135M-Instruct scores 0% zero-shot on BFCL
simple_python), and then no on-policy method has a signal. This module trains the student with the
token-level negative log-likelihood of the reference conversations, with the same tokenisation and
assistant masks as the rollouts, and saves the result as a Hugging Face folder that the next stage
loads as its ``model``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import Tensor
from typing_extensions import override

from lopd_lightning.losses import masked_mean
from lopd_lightning.modules.base import OnPolicyModule
from lopd_lightning.rollout import RolloutBatch
from lopd_lightning.tasks import Example, Task

log = logging.getLogger(__name__)


class SFTModule(OnPolicyModule):
    """Supervised fine-tuning on reference solutions: L = -sum omega log pi(y* | s) / sum omega.

    Besides :class:`~lopd_lightning.modules.base.OnPolicyModule`'s arguments (``--help`` lists both):

    Args:
        save_dir: when set, the student (LoRA merged into the weights) and tokenizer are saved there
            as a Hugging Face folder at the end of fit, ready to be the ``model`` of the next stage.
    """

    def __init__(self, model: str = "tiny", *, save_dir: str | None = None, **kwargs: Any):
        super().__init__(model, **kwargs)
        self.save_hyperparameters()

    @override
    def make_batch(self, task: Task, examples: list[Example]) -> RolloutBatch:
        batch = self.reference_batch(task, examples)
        self.rollouts_consumed += self.global_count(len(batch))
        self.step_timings = {}
        return batch

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        with self.timed("student_step"):
            _, mask = self.shifted(batch)
            logps = self.student_logps(batch)
            loss = masked_mean(-logps, mask, num_tokens=self.num_loss_tokens(batch))
            self.manual_backward(loss)
            norm = self.clip_and_step(optimizer, self.student_parameters(), self.hparams.grad_clip)
        self.log_rollout_metrics(batch, {"train/loss": loss, "train/nll": loss, "train/grad_norm": norm})
        return loss.detach()

    @override
    def on_fit_end(self) -> None:
        if self.hparams.save_dir and self.global_rank == 0:
            path = self.save_student(self.hparams.save_dir)
            print(f"SFT student saved to {path}")

    def save_student(self, folder: str | Path) -> Path:
        """Save the student (LoRA merged) and tokenizer as a Hugging Face folder; returns the folder."""
        from lopd_lightning.adapters import merged_student

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        model = merged_student(self.backbone)
        model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        return folder
