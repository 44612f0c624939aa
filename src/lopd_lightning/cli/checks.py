"""The checks ``lopd fit`` runs on the parsed config before it builds anything (before the student's weights
load): mistakes that would otherwise end, minutes later, in a traceback from torch, Lightning or a callback.

- a learning rate (``model.init_args.learning_rate``, ``composer_lr``, any ``*_lr``) that is negative or not
  finite (torch's optimizers refuse it once the model is built);
- ``trainer.accumulate_grad_batches`` other than 1 (every method steps its optimizers itself, so Lightning
  cannot accumulate);
- an LOPD-only callback (``MarginSchedule``, ``MemoryRefresh``:
  :class:`~lopd_lightning.modules.lopd_callbacks.LOPDOnlyCallback`) with another method, e.g. an LOPD config
  whose ``model.class_path`` was switched to ``GRPOModule``;
- LOPD with no bank (``model.init_args.bank_path`` null, J > 0) and no ``MemoryRefresh`` to fill it: every step
  would train nothing (:func:`~lopd_lightning.memory.persistence.check_bank_fills`, which ``fit`` runs too);
- a sharded ``trainer.strategy`` where it cannot run: DeepSpeed with LOPD (two optimisers), or without the
  ``deepspeed`` package; FSDP or DeepSpeed on a machine without CUDA (Lightning refuses FSDP on CPU: ``The
  strategy `fsdp` requires a GPU accelerator``; torch's FSDP without a device: ``FSDP needs a non-CPU
  accelerator device``; with ``accelerator: gpu``: ``No supported gpu backend found!``; docs/scaling.md);
- ``model.init_args.generation_backend: vllm`` under a sharded ``trainer.strategy`` (FSDP, FSDP2's
  ``ModelParallelStrategy``, DeepSpeed): each rank's engine syncs from the whole student, which a rank of a
  sharded strategy does not hold (DDP runs one engine per rank).

Each raises :class:`~lopd_lightning.cli.errors.CLIError` (status 1) with one line naming the key and the fix.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from lopd_lightning.cli.errors import CLIError, import_class

__all__ = ["check_fit_config", "check_generation_backend", "check_strategy"]


def _get(node: Any, key: str) -> Any:
    return node.get(key) if hasattr(node, "get") else None


def _items(node: Any) -> list[tuple[str, Any]]:
    if node is None:
        return []
    if hasattr(node, "as_dict"):
        node = node.as_dict()
    return list(node.items()) if isinstance(node, dict) else []


def check_fit_config(config: Any) -> None:
    """Refuse, before anything is built, what a fit of ``config`` (the parsed ``fit`` config) would refuse
    only after the student loaded.

    Raises:
        CLIError: a negative or non-finite learning rate (``model.init_args.learning_rate``, ``*_lr``);
            ``trainer.accumulate_grad_batches`` other than 1; an LOPD-only callback in ``trainer.callbacks``
            with a model class that is not an LOPDModule; an LOPD fit with no bank that nothing fills; a sharded
            strategy where it cannot run (:func:`check_strategy`) or with ``generation_backend: vllm``
            (:func:`check_generation_backend`). One line naming the key and the fix, status 1.
    """
    model, trainer = _get(config, "model"), _get(config, "trainer")
    for key, value in _items(_get(model, "init_args")):
        if (key == "learning_rate" or key.endswith("_lr")) and isinstance(value, (int, float)) and not (
            math.isfinite(value) and value >= 0
        ):
            raise CLIError(f"model.init_args.{key} must be a finite number >= 0 (a learning rate or, for dual_lr, "
                           f"the dual step size), got {float(value)}", 1)
    accumulate = _get(trainer, "accumulate_grad_batches")
    if accumulate not in (None, 1):
        raise CLIError(
            f"trainer.accumulate_grad_batches={accumulate}: every method steps its optimizers itself (manual "
            "optimization), so Lightning cannot accumulate gradients; remove trainer.accumulate_grad_batches (or "
            "set it to 1) and raise data.init_args.examples_per_step for more examples per update", 1
        )
    method = import_class(str(_get(model, "class_path") or ""))
    if not isinstance(method, type):
        return  # a class_path that does not import is the parser's error
    callbacks = _get(trainer, "callbacks")
    if callbacks is not None and not isinstance(callbacks, list):
        callbacks = [callbacks]
    callbacks = [(import_class(str(_get(c, "class_path") or "")), dict(_items(_get(c, "init_args"))))
                 for c in callbacks or []]
    _check_method_callbacks(method, [cls for cls, _ in callbacks])
    check_generation_backend(_get(_get(model, "init_args"), "generation_backend"), _get(trainer, "strategy"))
    check_strategy(method, _get(trainer, "strategy"))
    _check_bank_fills(method, dict(_items(_get(model, "init_args"))), callbacks)


def _sharded_kind(strategy: Any) -> str | None:
    """"FSDP", "DeepSpeed" or None for ``trainer.strategy`` (a registered name, a class_path node or an instance)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if isinstance(strategy, str):
        name = strategy.lower()
        return "FSDP" if name.startswith("fsdp") else "DeepSpeed" if name.startswith("deepspeed") else None
    cls = strategy if isinstance(strategy, type) else type(strategy)
    if _get(strategy, "class_path"):
        cls = import_class(str(_get(strategy, "class_path")))
    if isinstance(cls, type) and issubclass(cls, FSDPStrategy):
        return "FSDP"
    if isinstance(cls, type) and issubclass(cls, DeepSpeedStrategy):
        return "DeepSpeed"
    return None


def check_strategy(method: type, strategy: Any, *, cuda: bool | None = None) -> None:
    """Refuse, in one line naming ``trainer.strategy``, a sharded strategy that cannot run here: DeepSpeed with
    LOPD (two optimisers), DeepSpeed without the ``deepspeed`` package, FSDP or DeepSpeed without CUDA
    (``cuda``: whether CUDA is available; None: ask torch). DDP and single-device runs pass."""
    import importlib.util

    import torch

    from lopd_lightning.modules import LOPDModule

    kind = _sharded_kind(strategy)
    if kind is None:
        return
    if kind == "DeepSpeed" and isinstance(method, type) and issubclass(method, LOPDModule):
        raise CLIError("trainer.strategy: DeepSpeed supports one optimiser and LOPDModule trains two (student and "
                       "composer); use -c configs/trainer/fsdp.yaml (CUDA) or trainer.strategy=ddp for LOPD", 1)
    if not (torch.cuda.is_available() if cuda is None else cuda):
        raise CLIError(f"trainer.strategy: {kind} needs CUDA GPUs and this machine has none (Lightning and torch "
                       "refuse it on CPU); set trainer.strategy=ddp with --trainer.accelerator=cpu (gloo) or run on a "
                       "machine with CUDA", 1)
    if kind == "DeepSpeed" and importlib.util.find_spec("deepspeed") is None:
        raise CLIError("trainer.strategy: DeepSpeed is not installed; pip install deepspeed, or set "
                       "trainer.strategy=ddp (or -c configs/trainer/fsdp.yaml)", 1)


def check_generation_backend(backend: Any, strategy: Any) -> None:
    """Refuse ``generation_backend: vllm`` under a sharded ``strategy`` (FSDP, FSDP2's ``ModelParallelStrategy``,
    DeepSpeed; a registered name, a class_path node or an instance): one line naming
    ``model.init_args.generation_backend`` and the fix (:data:`~lopd_lightning.rollout.registry.VLLM_SHARDED_REFUSAL`).
    Any other backend or strategy passes."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lopd_lightning.rollout.registry import VLLM_SHARDED_REFUSAL

    if backend != "vllm" or strategy is None:
        return
    cls = strategy if isinstance(strategy, type) else type(strategy)
    if _get(strategy, "class_path"):
        cls = import_class(str(_get(strategy, "class_path")))
    model_parallel = isinstance(cls, type) and issubclass(cls, ModelParallelStrategy)
    if model_parallel or _sharded_kind(strategy) is not None:
        raise CLIError(VLLM_SHARDED_REFUSAL, 1)


def _check_method_callbacks(method: type, classes: list[Any]) -> None:
    from lopd_lightning.modules.lopd_callbacks import LOPDOnlyCallback, lopd_only_refusal
    from lopd_lightning.modules import LOPDModule

    if issubclass(method, LOPDModule):
        return
    lopd_only = [c for c in classes if isinstance(c, type) and issubclass(c, LOPDOnlyCallback)]
    if lopd_only:
        raise CLIError(lopd_only_refusal(lopd_only, method.__name__), 1)


def _default(cls: type, name: str) -> Any:
    parameter = inspect.signature(cls).parameters.get(name)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def _check_bank_fills(method: type, init: dict[str, Any], callbacks: list[tuple[Any, dict[str, Any]]]) -> None:
    from lopd_lightning.modules.lopd_callbacks import MemoryRefresh
    from lopd_lightning.memory.persistence import check_bank_fills
    from lopd_lightning.modules import LOPDModule

    if not issubclass(method, LOPDModule):
        return
    bank_path = init.get("bank_path", _default(method, "bank_path"))
    if bank_path:
        return  # a missing or too small bank is refused by the module's own checks, also before the weights load
    if any(isinstance(cls, type) and issubclass(cls, MemoryRefresh)
           and args.get("every_n_steps", _default(cls, "every_n_steps")) for cls, args in callbacks):
        return  # MemoryRefresh fills it: fit warns once that the first steps train nothing
    try:
        check_bank_fills(0, int(init.get("num_experiences", _default(method, "num_experiences")) or 0), bank_path,
                         refresh=False)
    except ValueError as error:
        raise CLIError(str(error), 1) from None
