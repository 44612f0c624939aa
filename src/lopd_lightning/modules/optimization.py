"""The optimiser steps of a training step, guarded: a non-finite loss or gradient never reaches the weights.

:class:`OptimizationMixin` is one part of :class:`~lopd_lightning.modules.base.OnPolicyModule` (it is not
used alone). Every method updates its weights through it, under Lightning's manual optimisation:

- :meth:`~OptimizationMixin.manual_backward`: the backward of the step's loss, skipped on every rank
  when the loss is not finite on one (the decision is all-reduced, so DDP ranks never wait on each other);
- :meth:`~OptimizationMixin.clip_and_step`: the one optimiser step per training step that Lightning
  counts (``trainer.global_step`` advances by one), after clipping the gradient norm;
- :meth:`~OptimizationMixin.step_uncounted`: any further optimiser step of the same training step
  (GRPO's extra PPO passes, LOPD's composer), which must not advance ``global_step``;
- :attr:`~OptimizationMixin.update_skipped`: whether this step's updates are skipped.

``non_finite_steps`` counts the steps whose update was skipped (logged as ``train/non_finite_steps``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor
from typing_extensions import override

from lopd_lightning.sharding import plain

log = logging.getLogger(__name__)

__all__ = ["OptimizationMixin"]


def clip_grads(params, max_norm: float) -> Tensor:
    """Clip the global grad norm of the ``params`` that have a gradient to ``max_norm`` (<= 0: no clip).

    Returns:
        () float: the norm before clipping (0 when no parameter has a gradient).
    """
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return torch.zeros(())
    # under FSDP2 the gradients are DTensors and the norm is the whole gradient's (all shards), a DTensor
    return plain(torch.nn.utils.clip_grad_norm_(with_grad, max_norm if max_norm > 0 else float("inf")))


class OptimizationMixin(LightningModule):
    """Guarded backward and optimiser steps (see the module docstring); no method steps a raw optimiser itself."""

    def _init_optimization(self) -> None:
        """The state this mixin keeps (called once by ``OnPolicyModule.__init__``)."""
        #: training steps whose update was skipped because a loss or a gradient norm was not finite.
        self.non_finite_steps = 0
        self._skip_update = False  # set by manual_backward on a non-finite loss; read through update_skipped

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
        norm = clip_grads(params, max_norm)
        if not torch.isfinite(norm):
            self.non_finite_steps += 1
            log.warning("non-finite grad norm at step %d: update skipped (%d so far)", self.global_step, self.non_finite_steps)
            optimizer.zero_grad(set_to_none=True)  # torch optimisers skip parameters whose grad is None
        optimizer.step()  # always called: it is what advances trainer.global_step under manual optimisation
        optimizer.zero_grad(set_to_none=True)
        return norm.detach()


