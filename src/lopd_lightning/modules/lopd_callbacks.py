"""The LOPD-only callbacks: the experience-bank refresh and the margin schedule of :class:`LOPDModule`.

They act on what only an LOPDModule has (``pl_module.bank``, ``pl_module.scale_margin``), take explicit
constructor arguments and are configured in YAML (``trainer.callbacks``, e.g. ``class_path:
lopd_lightning.modules.lopd_callbacks.MemoryRefresh``). A fit of another method with one of them (GRPO, SDPO,
..., e.g. an LOPD config whose ``model.class_path`` was switched) is refused in one line naming the callback
to drop from ``trainer.callbacks`` (:func:`lopd_only_refusal`; ``lopd fit`` says it before the weights load,
:mod:`lopd_lightning.cli.checks`). The method-independent callbacks are in :mod:`lopd_lightning.callbacks`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lopd_lightning.modules.lopd import LOPDModule

__all__ = ["LOPDOnlyCallback", "MarginSchedule", "MemoryRefresh", "lopd_only_refusal"]

log = logging.getLogger(__name__)


class LOPDOnlyCallback(Callback):
    """A callback that acts on what only :class:`~lopd_lightning.modules.LOPDModule` (and its subclasses) has.

    Its ``setup`` for a fit refuses a module that is not an LOPDModule (as ``lopd fit`` does before the weights
    load), also one that has an attribute of the same name (OPSD's ``bank`` with ``privileged_context:
    retrieved`` is a fixed bank, not LOPD's).

    Raises:
        ValueError: (``setup``, stage "fit") the module is not an LOPDModule; the message names the callback
            and says to drop it from ``trainer.callbacks`` (:func:`lopd_only_refusal`).
    """

    #: what it does (for the refusal)
    DOES: ClassVar[str] = ""

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and not isinstance(pl_module, LOPDModule):
            raise ValueError(lopd_only_refusal([type(self)], type(pl_module).__name__))


def lopd_only_refusal(callbacks: list[type[LOPDOnlyCallback]], method: str) -> str:
    """The one line refusing the LOPD-only ``callbacks`` (classes) on a fit of ``method`` (a class name)."""
    names = [c.__name__ for c in callbacks]
    what = ", ".join(f"{c.__name__} ({c.DOES})" for c in callbacks[:-1])
    what = f"{what} and {names[-1]} ({callbacks[-1].DOES})" if what else f"{names[0]} ({callbacks[0].DOES})"
    them = "it" if len(names) == 1 else "them"
    return (f"trainer.callbacks: {what} work{'s' if len(names) == 1 else ''} only with LOPDModule, and {method} "
            f"is not one; drop {them} from trainer.callbacks")


class MemoryRefresh(LOPDOnlyCallback):
    """Every ``every_n_steps`` steps, add the successful rollouts of the last steps to the bank.

    It lets LOPD start on an empty bank (``bank_path: null``, an empty bank folder) or one of fewer than J
    experiences: the teacher reads no experience (and LOPD trains nothing) until the bank holds J, which fit
    says when it starts and this callback when retrieval starts.

    Args:
        every_n_steps: refresh period in optimiser steps; 0 turns the refresh off (the paper's frozen bank).
        min_reward: a trajectory enters the bank when its reward is >= this.

    The bank's own capacity and eviction rule apply (``LOPDModule(bank_capacity=..., bank_eviction=...)``).
    Experiences are made by the module's public hook ``experience_from_trajectory``. Under data
    parallelism every rank gathers all ranks' candidates and adds the same list in the same order,
    so the bank stays identical on every rank.

    LOPD-only (:class:`LOPDOnlyCallback`): a fit of a module without a ``bank`` is refused at setup.

    Raises:
        ValueError: ``every_n_steps`` < 0; (``setup``) a fit of a module without an experience bank.
    """

    DOES = "it adds successful rollouts to LOPDModule's experience bank"

    def __init__(self, every_n_steps: int = 10, min_reward: float = 1.0):
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0 (0 = off), got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.min_reward = min_reward
        self.pending: list[dict[str, Any]] = []
        self.added_total = 0
        #: steps that ran with fewer than J experiences in the bank (no retrieval: LOPD trained nothing in them)
        self.empty_steps = 0

    @property
    def fills_bank(self) -> bool:
        """True when it adds trajectories to the bank (``every_n_steps`` > 0): LOPD may then start on an empty or
        small one, and retrieves once it holds J experiences."""
        return self.every_n_steps > 0

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.every_n_steps == 0:  # setup refused any module that is not an LOPDModule
            return
        wanted = int(pl_module.hparams.num_experiences)
        # the bank changes only here, so it held fewer than J (and nothing was retrieved) all step
        was_short = len(pl_module.bank) < wanted
        self.empty_steps += was_short
        rewards = batch.rewards.tolist()
        for i, reward in enumerate(rewards):
            if reward >= self.min_reward:
                self.pending.append(
                    {"example_id": batch.example_ids[i], "messages": batch.messages[i], "reward": float(reward)}
                )
        if trainer.global_step % self.every_n_steps == 0:
            self.refresh(trainer, pl_module)
        if was_short and len(pl_module.bank) >= wanted:
            log.warning("the bank held fewer than J=%d experiences for the first %d steps, which retrieved nothing and "
                        "trained nothing; it now holds %d experiences, and retrieval starts", wanted, self.empty_steps,
                        len(pl_module.bank))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        wanted = int(pl_module.hparams.num_experiences)
        if self.every_n_steps and len(pl_module.bank) < wanted and self.empty_steps:
            held = "stayed empty" if len(pl_module.bank) == 0 else \
                f"never reached J={wanted} experiences (it holds {len(pl_module.bank)})"
            log.warning("the bank %s: all %d steps ran without experiences and trained nothing; build "
                        "one with `lopd build-memory -c CONFIG --from-references` (model.init_args.bank_path)",
                        held, self.empty_steps)

    def refresh(self, trainer: Trainer, pl_module: LightningModule) -> int:
        """Add the pending candidates (from every rank) to the bank; returns how many entered it."""
        candidates = self.pending
        self.pending = []
        if trainer.world_size > 1:
            import torch.distributed as dist

            gathered: list[list[dict[str, Any]]] = [[] for _ in range(trainer.world_size)]
            dist.all_gather_object(gathered, candidates)
            candidates = [c for rank_list in gathered for c in rank_list]
        dm = trainer.datamodule
        experiences = []
        for c in candidates:
            example = dm.example(c["example_id"])
            exp = pl_module.experience_from_trajectory(dm.task, example, c["messages"], c["reward"])
            if exp is not None:
                experiences.append(exp)
        added = pl_module.bank.add(experiences) if experiences else 0
        self.added_total += added
        total = float(self.added_total)
        # as the module's own train/ tags (after its step's log_rollout_metrics): callback_metrics, the loggers at
        # x = this step and by_rollouts/ (Lightning's logger would file it at x = step - 1, with an `epoch` scalar)
        pl_module.log("train/bank_added", total, on_step=True, on_epoch=False, logger=False)
        pl_module.log_step_scalars({"train/bank_added": total})
        pl_module.log_by_rollouts({"bank_added": total})
        log.info("memory refresh at step %d: %d candidates, %d added, bank size %d",
                 trainer.global_step, len(candidates), added, len(pl_module.bank))
        return added

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"pending": self.pending, "added_total": self.added_total, "empty_steps": self.empty_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = sorted({"pending", "added_total", "empty_steps"} - set(state_dict))
        if missing:
            raise ValueError(f"this checkpoint has no {', '.join(missing)} in the state of MemoryRefresh: another "
                             "version of lopd_lightning wrote it; retrain, or resume with the lopd_lightning commit "
                             "that wrote it")
        self.pending = list(state_dict["pending"])
        self.added_total = int(state_dict["added_total"])
        self.empty_steps = int(state_dict["empty_steps"])


class MarginSchedule(LOPDOnlyCallback):
    """Ramps the privileged margin m (docs/METHOD.md section 5) of the module before every step.

    The module owns m: its ``margin`` argument is the target and ``LOPDModule.margin`` the value in effect.
    This callback owns only the ramp's shape: before each step it calls
    ``pl_module.scale_margin(self.fraction(trainer.global_step))``.

    Args:
        schedule: "constant" (the paper: m throughout), "linear" (0 -> m over ``warmup_steps``, then m) or
            "cosine" (0 -> m along a half cosine over ``warmup_steps``, then m).
        warmup_steps: length of the ramp of "linear" and "cosine"; ignored by "constant".

    LOPD-only (:class:`LOPDOnlyCallback`): a fit of a module without a privileged margin is refused at setup.

    Raises:
        ValueError: an unknown ``schedule``, a ramp without ``warmup_steps``; (``setup``) a fit of a module
            without a privileged margin.
    """

    DOES = "it sets LOPDModule's privileged margin"

    def __init__(self, schedule: Literal["constant", "linear", "cosine"] = "constant", warmup_steps: int = 0):
        if schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"schedule must be 'constant', 'linear' or 'cosine', got {schedule!r}")
        if schedule != "constant" and warmup_steps < 1:
            raise ValueError(f"schedule {schedule!r} needs warmup_steps >= 1, got {warmup_steps}")
        self.schedule = schedule
        self.warmup_steps = int(warmup_steps)

    def fraction(self, step: int) -> float:
        """The fraction of the target m in effect at optimiser step ``step`` (0-based), in [0, 1]."""
        if self.schedule == "constant" or step >= self.warmup_steps:
            return 1.0
        fraction = step / self.warmup_steps
        if self.schedule == "linear":
            return fraction
        return 0.5 * (1.0 - math.cos(math.pi * fraction))

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        pl_module.scale_margin(self.fraction(trainer.global_step))
