"""The checks ``lopd fit`` runs on the parsed config before it builds anything (before the student's weights
load): mistakes that would otherwise end, minutes later, in a traceback from torch, Lightning or a callback.

- a learning rate (``model.init_args.learning_rate``, ``composer_lr``, any ``*_lr``) that is negative or not
  finite (torch's optimizers refuse it once the model is built);
- ``trainer.accumulate_grad_batches`` other than 1 (every method steps its optimizers itself, so Lightning
  cannot accumulate);
- an LOPD-only callback (``MarginSchedule``, ``MemoryRefresh``:
  :class:`~lopd_lightning.modules.lopd_callbacks.LOPDOnlyCallback`) with another method, e.g. an LOPD config
  whose ``model.class_path`` was switched to ``GRPOModule``;
- LOPD with a bank of fewer than J experiences (``model.init_args.bank_path`` null or an empty bank, J > 0) and no
  ``MemoryRefresh`` to fill it: every step would train nothing
  (:func:`~lopd_lightning.memory.persistence.check_bank_fills`, which ``fit`` runs too);
- a sharded ``trainer.strategy`` where it cannot run: DeepSpeed with LOPD (two optimisers), or without the
  ``deepspeed`` package; FSDP or DeepSpeed on a machine without CUDA (Lightning refuses FSDP on CPU: ``The
  strategy `fsdp` requires a GPU accelerator``; torch's FSDP without a device: ``FSDP needs a non-CPU
  accelerator device``; with ``accelerator: gpu``: ``No supported gpu backend found!``; docs/scaling.md);
- ``model.init_args.generation_backend: vllm`` under a sharded ``trainer.strategy`` (FSDP, FSDP2's
  ``ModelParallelStrategy``, DeepSpeed): each rank's engine syncs from the whole student, which a rank of a
  sharded strategy does not hold (DDP runs one engine per rank);
- a launcher whose layout differs from ``trainer.num_nodes`` x ``trainer.devices`` (torchrun's ``--nnodes`` /
  ``--nproc-per-node``, SLURM's ``--nodes`` / ``--ntasks-per-node``, or SLURM's ``--ntasks`` without
  ``--ntasks-per-node``): Lightning refuses these only when fit launches, after the student loaded, with a
  traceback on every rank (:func:`check_launcher`).

And, for ``fit``, ``validate`` and ``test`` alike (:func:`check_run_config`):

- every folder the run will write into (a logger's ``save_dir``, ``trainer.default_root_dir``, a callback's
  ``dirpath`` or ``json_path``, an SFT ``save_dir``) that it could not create: a regular file on the way, or no
  permission (Lightning found it only when it first wrote, after the student loaded, with a
  ``NotADirectoryError`` traceback; :func:`check_output_folders`);
- the DataModule's numeric options (LightningCLI builds the DataModule after the model:
  :meth:`~lopd_lightning.data.OnPolicyDataModule.check_options`);
- a ``trainer`` option Lightning's ``Trainer`` refuses (``max_steps: -5``, ``devices: 0``, ``limit_val_batches:
  1.5``, ``accelerator: gpu`` without one...): the Trainer, built last, refused it after the student loaded; now
  a Trainer with the config's plain options (no logger, callbacks or plugins) is built first and its refusal
  named by key (:func:`check_trainer_options`);
- a ``ckpt_path`` that names no file (:func:`check_ckpt_path`).

Each raises :class:`~lopd_lightning.cli.errors.CLIError` (status 1) with one line naming the key and the fix.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lopd_lightning.cli.errors import CLIError, import_class

__all__ = ["check_ckpt_path", "check_config_files", "check_data_config", "check_fit_config", "check_folder", "check_generation_backend",
           "check_launcher", "check_output_folders", "check_run_config", "check_strategy", "check_trainer_options", "config_files"]


def _get(node: Any, key: str) -> Any:
    return node.get(key) if hasattr(node, "get") else None


def _node_class(node: Any) -> Any:
    """The class a config node names: its ``class_path`` imported, else the node itself if it is a class, else its
    type (an instance, or a registered name: ``str``)."""
    if _get(node, "class_path"):
        return import_class(str(_get(node, "class_path")))
    return node if isinstance(node, type) else type(node)


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
            with a model class that is not an LOPDModule; an LOPD fit on a bank of fewer than J experiences that
            nothing fills; a sharded strategy where it cannot run (:func:`check_strategy`) or with
            ``generation_backend: vllm`` (:func:`check_generation_backend`); a torchrun or SLURM layout other
            than the config's (:func:`check_launcher`). One line naming the key and the fix, status 1.
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
    check_launcher(trainer)
    _check_bank_fills(method, dict(_items(_get(model, "init_args"))), callbacks)


def check_folder(key: str, folder: Any, *, what: str = "folder") -> None:
    """Refuse ``folder`` (the value of config key ``key``) when a run could not create it or write into it
    (:func:`~lopd_lightning.io.unwritable_folder_reason`); nothing is created.

    Args:
        what: what is written there, for the message ("folder", "file's folder").

    Raises:
        CLIError: one line naming ``key``, the reason and the fix, status 1.
    """
    from lopd_lightning.io import unwritable_folder_reason

    if folder is None or str(folder) == "":
        return
    reason = unwritable_folder_reason(str(folder))
    if reason is not None:
        raise CLIError(f"{key} {str(folder)!r}: the run cannot create or write this {what} ({reason}); set {key} to a "
                       f"folder it can write", 1)


def _nodes(node: Any, key: str) -> list[tuple[str, Any]]:
    """(key, node) of a config value that is one class node or a list of them (``trainer.logger``,
    ``trainer.callbacks``): ``key`` for one, ``key[i]`` for the i-th of a list."""
    if isinstance(node, (list, tuple)):
        return [(f"{key}[{i}]", n) for i, n in enumerate(node)]
    return [] if node is None or isinstance(node, bool) else [(key, node)]


def check_output_folders(config: Any) -> None:
    """Refuse, before anything is built, a folder the run would write into and cannot create: each logger's
    ``save_dir`` (and ``root_dir``), ``trainer.default_root_dir`` (Lightning's default logger and checkpoints
    go there), each callback's ``dirpath`` (ModelCheckpoint) and the folder of its ``json_path``
    (RunSummary), and the model's ``save_dir`` (SFTModule's student). The generations go under the logger's
    folder, so its ``save_dir`` covers them.

    Raises:
        CLIError: :func:`check_folder`'s line for the first such key.
    """
    trainer, model = _get(config, "trainer"), _get(config, "model")
    check_folder("trainer.default_root_dir", _get(trainer, "default_root_dir"))
    for key, node in _nodes(_get(trainer, "logger"), "trainer.logger"):
        for name, value in _items(_get(node, "init_args")):
            if name in ("save_dir", "root_dir") and isinstance(value, (str, os.PathLike)):
                check_folder(f"{key}.init_args.{name}", value)
    for key, node in _nodes(_get(trainer, "callbacks"), "trainer.callbacks"):
        for name, value in _items(_get(node, "init_args")):
            if name == "dirpath" and isinstance(value, (str, os.PathLike)):
                check_folder(f"{key}.init_args.dirpath", value)
            elif name == "json_path" and isinstance(value, (str, os.PathLike)):
                check_folder(f"{key}.init_args.json_path", Path(value).parent, what="file's folder")
    save_dir = _get(_get(model, "init_args"), "save_dir")
    if isinstance(save_dir, (str, os.PathLike)):
        check_folder("model.init_args.save_dir", save_dir)


def config_files(args: list[str]) -> list[str]:
    """The files given with ``-c``/``--config`` on the command line ``args``, in order."""
    files = []
    for i, arg in enumerate(args):
        if arg in ("-c", "--config") and i + 1 < len(args):
            files.append(args[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def check_config_files(args: list[str]) -> None:
    """Refuse a ``-c`` file of ``args`` that is not a YAML mapping with each key once, naming the file and
    the line: jsonargparse parses the file's text and names neither (``while parsing a flow sequence``), reads
    a list or a scalar as ``Unexpected config``, and lets a repeated key's last value win without a word.
    A file that is not there is left to the parser (it names it).

    Raises:
        CLIError: ``-c FILE: not valid YAML (line L, column C: ...)``, ``... is empty``, ``... is a list, not a
            mapping``, ``... repeats the key K (lines A and B)``; status 2.
    """
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise _RepeatedKey(key, seen[key], line)
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    for name in config_files(args):
        try:
            text = Path(name).read_text()
        except (OSError, UnicodeDecodeError):
            continue
        try:
            value = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
        except _RepeatedKey as repeated:
            raise CLIError(f"-c {name}: repeats the key {repeated.key!r} (lines {repeated.first} and "
                           f"{repeated.second}; YAML would keep the last one); give each key once", 2) from None
        except yaml.YAMLError as bad:
            mark = getattr(bad, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            problem = getattr(bad, "problem", None) or str(bad).split("\n", 1)[0]
            raise CLIError(f"-c {name}: not valid YAML ({where}{problem}); fix the file", 2) from None
        if value is None:
            raise CLIError(f"-c {name}: the file is empty; give a YAML mapping (model:, data:, trainer:...) "
                           "or leave the -c out", 2)
        if not isinstance(value, dict):
            raise CLIError(f"-c {name}: a YAML {type(value).__name__}, not a mapping; a config maps keys "
                           "(model:, data:, trainer:...) to values", 2)


class _RepeatedKey(Exception):
    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def check_run_config(config: Any, subcommand: str | None) -> None:
    """Every check of a parsed ``fit``/``validate``/``test`` config (``config``: the subcommand's) that needs
    nothing built: :func:`check_fit_config` (``fit`` only), :func:`check_ckpt_path`, :func:`check_data_config`,
    :func:`check_output_folders` and :func:`check_trainer_options`, in that order.

    Raises:
        CLIError: the first refusal, one line naming the key, status 1.
    """
    if subcommand == "fit":
        check_fit_config(config)
    check_ckpt_path(_get(config, "ckpt_path"))
    check_data_config(_get(config, "data"))
    check_output_folders(config)
    check_trainer_options(_get(config, "trainer"))


#: ``ckpt_path`` values Lightning resolves itself (the best or last checkpoint of the run, SLURM's, a registry's)
_CKPT_NAMES = ("best", "last", "hpc", "registry")


def check_ckpt_path(ckpt_path: Any) -> None:
    """Refuse a ``ckpt_path`` that names no file (Lightning said so after the student loaded).

    Raises:
        CLIError: naming ``ckpt_path``, status 1.
    """
    if ckpt_path is None or not isinstance(ckpt_path, (str, os.PathLike)):
        return
    text = os.fspath(ckpt_path)
    if text in _CKPT_NAMES or text.startswith("registry:") or ("://" in text and not text.startswith("file://")):
        return
    path = Path(text.removeprefix("file://"))
    if not path.is_file():
        what = "a folder, not a checkpoint file" if path.is_dir() else "no such file"
        raise CLIError(f"ckpt_path {text!r}: {what}; give a .ckpt a run wrote (its checkpoints folder, e.g. "
                       f"<log_dir>/checkpoints/last.ckpt), one of {', '.join(_CKPT_NAMES[:2])}, or leave --ckpt_path out", 1)


def check_data_config(data: Any) -> None:
    """Run :meth:`~lopd_lightning.data.OnPolicyDataModule.check_options` on the config's ``data.init_args`` when
    ``data.class_path`` is an OnPolicyDataModule (LightningCLI builds the DataModule after the model).

    Raises:
        CLIError: its refusal, naming ``data.init_args.<key>``, status 1.
    """
    from lopd_lightning.data import OnPolicyDataModule

    cls = import_class(str(_get(data, "class_path") or ""))
    if not (isinstance(cls, type) and issubclass(cls, OnPolicyDataModule)):
        return
    try:
        cls.check_options(**dict(_items(_get(data, "init_args"))))
    except ValueError as error:
        raise CLIError(str(error), 1) from None


#: the ``trainer`` options that are objects, built by LightningCLI (not given to the Trainer built to check)
_TRAINER_OBJECTS = ("logger", "callbacks", "plugins", "profiler", "model_registry")


def _plain_trainer_options(trainer: Any) -> dict[str, Any]:
    """The config's ``trainer`` options that differ from the Trainer's defaults and are plain values (no class
    node: a strategy given by class is built by LightningCLI)."""
    import lightning.pytorch as pl

    defaults = inspect.signature(pl.Trainer.__init__).parameters
    options = {}
    for key, value in _items(trainer):
        parameter = defaults.get(key)
        if parameter is None or key in _TRAINER_OBJECTS or hasattr(value, "get") or isinstance(value, dict):
            continue
        if value != parameter.default:
            options[key] = value
    return options


def _build_trainer(options: dict[str, Any]) -> None:
    """A Trainer of ``options`` (nothing attached, nothing logged), to see whether Lightning refuses them."""
    import logging
    import warnings

    import lightning.pytorch as pl

    quiet = [logging.getLogger(name) for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")]
    levels = [logger.level for logger in quiet]
    try:
        for logger in quiet:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pl.Trainer(**{"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                          "enable_model_summary": False, **options, "callbacks": []})
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


def check_trainer_options(trainer: Any) -> None:
    """Refuse, before the student loads, what Lightning's ``Trainer`` refuses of the config's plain ``trainer``
    options (a bad ``max_steps``, ``devices``, ``limit_val_batches``, ``precision``, ``accelerator``, ``max_time``,
    strategy name...): a Trainer with those options and no logger, callbacks or plugins is built (LightningCLI
    builds the real one after the model), and a refusal is named by the option that makes it, found by
    building a Trainer with each option alone.

    Raises:
        CLIError: ``trainer.<key>=<value>: <Lightning's message>``, status 1.
    """
    options = _plain_trainer_options(trainer)
    try:
        _build_trainer(options)
    except Exception as error:  # Lightning's refusals: MisconfigurationException, ValueError, TypeError...
        culprit = None
        for key, value in options.items():
            try:
                _build_trainer({key: value})
            except Exception as alone:
                culprit, error = key, alone
                break
        text = " ".join(str(error).split()) or type(error).__name__
        where = f"trainer.{culprit}={options[culprit]!r}" if culprit else "trainer"
        raise CLIError(f"{where}: {text}", 1) from None


def _sharded_kind(strategy: Any) -> str | None:
    """"FSDP", "DeepSpeed" or None for ``trainer.strategy`` (a registered name, a class_path node or an instance)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if isinstance(strategy, str):
        name = strategy.lower()
        return "FSDP" if name.startswith("fsdp") else "DeepSpeed" if name.startswith("deepspeed") else None
    cls = _node_class(strategy)
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
    cls = _node_class(strategy)
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
    from lopd_lightning.memory.persistence import check_bank, check_bank_fills
    from lopd_lightning.modules import LOPDModule
    from lopd_lightning.modules.lopd_callbacks import MemoryRefresh

    if not issubclass(method, LOPDModule):
        return
    bank_path = init.get("bank_path", _default(method, "bank_path"))
    num_experiences = int(init.get("num_experiences", _default(method, "num_experiences")) or 0)
    refresh = any(isinstance(cls, type) and issubclass(cls, MemoryRefresh)
                  and args.get("every_n_steps", _default(cls, "every_n_steps")) for cls, args in callbacks)
    if refresh or num_experiences <= 0:
        return  # MemoryRefresh fills it (fit warns once that the first steps train nothing), or J needs no bank
    try:
        size = check_bank(str(bank_path), capacity=init.get("bank_capacity")) if bank_path else 0
    except (OSError, ValueError):
        return  # no bank, or a damaged one: the module's own check says so, also before the weights load
    try:
        check_bank_fills(size, num_experiences, bank_path, refresh=False)
    except ValueError as error:
        raise CLIError(str(error), 1) from None


def _int(value: Any) -> int | None:
    """``value`` as an int (an int, or a string of digits), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    return int(value) if isinstance(value, str) and value.strip().isdigit() else None


def _devices_per_node(devices: Any) -> int | None:
    """The processes per node ``trainer.devices`` asks for (an int, "4", a list of device indices), or None
    where Lightning resolves it from the machine ("auto", -1): then it is not compared."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    count = _int(devices)
    return count if count is not None and count > 0 else None


def _sets_cluster_environment(trainer: Any) -> bool:
    from lightning.fabric.plugins.environments import ClusterEnvironment

    plugins = _get(trainer, "plugins")
    plugins = plugins if isinstance(plugins, list) else [plugins] if plugins is not None else []
    for plugin in plugins:
        cls = _node_class(plugin)
        if isinstance(cls, type) and issubclass(cls, ClusterEnvironment):
            return True
    return False


def check_launcher(trainer: Any, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a launcher layout other than ``trainer.num_nodes`` x ``trainer.devices``, in one line naming the key,
    the launcher's value and the fix, before anything is built (Lightning refuses it only when fit launches,
    after the student loaded, as a ``ValueError`` or ``RuntimeError`` traceback on every rank).

    ``environ`` (default ``os.environ``) tells the launcher, found as Lightning finds it:

    - torchrun (``RANK``, ``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` set): ``trainer.devices`` must
      be ``LOCAL_WORLD_SIZE`` (``--nproc-per-node``) and ``trainer.num_nodes`` ``WORLD_SIZE / LOCAL_WORLD_SIZE``
      (``--nnodes``);
    - SLURM (``SLURM_NTASKS`` set, job name not ``bash`` or ``interactive``): more than one task needs
      ``--ntasks-per-node`` (``SLURM_NTASKS_PER_NODE``); for a config of more than one process,
      ``trainer.devices`` must be ``SLURM_NTASKS_PER_NODE``, ``trainer.num_nodes`` ``SLURM_NNODES`` and their
      product ``SLURM_NTASKS`` (a config of one node and one process, or ``devices: auto``, is not compared: a
      batch script may run it without srun).

    ``trainer.devices`` that Lightning resolves from the machine ("auto", -1) is not compared; nothing is
    checked without a launcher or when ``trainer.plugins`` gives a cluster environment.

    Raises:
        CLIError: the mismatch, naming ``trainer.devices`` or ``trainer.num_nodes`` (or the SLURM option) and
            the fix, status 1.
    """
    env = os.environ if environ is None else environ
    if _sets_cluster_environment(trainer):
        return
    nodes = _int(_get(trainer, "num_nodes"))
    nodes = 1 if nodes is None else nodes
    devices = _devices_per_node(_get(trainer, "devices"))
    if all(k in env for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        _check_torchrun(nodes, devices, _int(env.get("LOCAL_WORLD_SIZE")), _int(env.get("WORLD_SIZE")))
    elif "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        _check_slurm(nodes, devices, env)


def _check_torchrun(nodes: int, devices: int | None, per_node: int | None, world: int | None) -> None:
    if per_node is None or per_node < 1:
        return
    if devices is not None and devices != per_node:
        raise CLIError(f"trainer.devices={devices} but torchrun starts {per_node} processes per node "
                       f"(--nproc-per-node {per_node}, LOCAL_WORLD_SIZE): set --trainer.devices={per_node}, or start "
                       f"torchrun with --nproc-per-node {devices}", 1)
    if world is None or world == nodes * per_node:
        return
    if world % per_node:
        raise CLIError(f"trainer.num_nodes={nodes} but torchrun runs {world} processes (WORLD_SIZE), not a multiple of "
                       f"--nproc-per-node {per_node}: start torchrun with --nnodes {nodes} on every node", 1)
    raise CLIError(f"trainer.num_nodes={nodes} but torchrun runs {world // per_node} nodes of {per_node} processes "
                   f"(--nnodes {world // per_node}, WORLD_SIZE={world}): set --trainer.num_nodes={world // per_node}, "
                   f"or start torchrun with --nnodes {nodes}", 1)


def _check_slurm(nodes: int, devices: int | None, env: Mapping[str, str]) -> None:
    tasks, per_node, slurm_nodes = (_int(env.get(k)) for k in ("SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES"))
    layout = f"#SBATCH --nodes={nodes} --ntasks-per-node={devices or 'GPUS_PER_NODE'}"
    if (tasks or 1) > 1 and "SLURM_NTASKS_PER_NODE" not in env:
        raise CLIError(f"SLURM started {tasks} tasks (--ntasks) without --ntasks-per-node, which Lightning needs: "
                       f"in the batch script give {layout} (trainer.num_nodes, trainer.devices) instead of --ntasks", 1)
    if nodes == 1 and devices in (1, None):
        return  # one process (or one node's "auto"): not compared (a batch script may run it without srun)
    if devices is not None and per_node is not None and per_node != devices:
        raise CLIError(f"trainer.devices={devices} but SLURM starts {per_node} tasks per node (--ntasks-per-node="
                       f"{per_node}): set --trainer.devices={per_node}, or #SBATCH --ntasks-per-node={devices} "
                       "(one task per GPU)", 1)
    if slurm_nodes is not None and slurm_nodes != nodes:
        raise CLIError(f"trainer.num_nodes={nodes} but the SLURM job has {slurm_nodes} nodes (--nodes="
                       f"{slurm_nodes}): set --trainer.num_nodes={slurm_nodes}, or #SBATCH --nodes={nodes}", 1)
    if devices is not None and tasks is not None and tasks != nodes * devices:
        raise CLIError(f"trainer.num_nodes x trainer.devices = {nodes} x {devices} = {nodes * devices} processes but "
                       f"SLURM started {tasks} tasks (SLURM_NTASKS): give {layout} and no other --ntasks", 1)
