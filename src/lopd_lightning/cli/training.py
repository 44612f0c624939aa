"""``lopd fit|validate|test``: the LightningCLI in subclass mode, and the checks it runs before building anything.

A config names any module (``LOPDModule``, ``GRPOModule``, ...), DataModule, task or callback class.
A parse error becomes one line naming the key (:func:`~lopd_lightning.cli.errors.parse_error_message`);
an unknown task name is reported before the student loads (:func:`check_task_name`). An argument the
class does not take is one line naming the key and the closest argument it does take (its name, or the
meaning its docstring gives: ``model.init_args.rollouts_per_example`` suggests ``group_size``).
Before ``fit`` builds anything, :func:`~lopd_lightning.cli.checks.check_fit_config` refuses what would fail
only after the student loaded (a negative learning rate, gradient accumulation, an LOPD-only callback on
another method), and before any subcommand builds anything :func:`~lopd_lightning.cli.checks.check_run_config`
refuses a folder the run would write into and cannot create, a DataModule or Trainer option out of range, a
``ckpt_path`` that names no file.

Interpolation: a value ``${a.b.c}`` (OmegaConf) takes the value of the key ``a.b.c``, written as its path
from the config's top (``${model.init_args.max_new_tokens}``, ``${trainer.max_steps}``; no ``fit.``) in a
config file or on the command line (``'--model.init_args.x=${model.init_args.y}'``). It is resolved once,
after every source is merged (the ``-c`` files in order, then the command line: jsonargparse's
``omegaconf+`` mode), so it follows a later ``-c`` file or a command-line override of ``a.b.c``.
``--print_config`` and the run's saved ``config.yaml`` show the resolved values. A path that names no key
is one line with the closest key. A file given for one key (``--model=model.yaml``) writes paths from its
own top (``${init_args.max_new_tokens}``).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from lopd_lightning.cli.checks import check_config_files, check_run_config
from lopd_lightning.cli.errors import CLIError, interpolation_error_message, parse_error_message
from lopd_lightning.hints import did_you_mean

__all__ = ["LIGHTNING_COMMANDS", "check_task_name", "lightning_cli", "relative_interpolations"]

#: The subcommands LightningCLI runs (no ``predict``: no module implements ``predict_step``).
LIGHTNING_COMMANDS = ("fit", "validate", "test")


def check_task_name(config: Any) -> None:
    """Raise ValueError for an unknown task name in a parsed config, before any class is instantiated.

    LightningCLI instantiates the model before the DataModule, so without this check a misspelt
    ``data.init_args.task`` would only be reported after the student had been loaded.

    Raises:
        ValueError: ``data.init_args.task`` is a string that is not a registered task name (the message
            lists the known ones and the closest).
    """
    from lopd_lightning.tasks import TASK_NAMES

    data = config.get("data") if hasattr(config, "get") else None
    init_args = data.get("init_args") if hasattr(data, "get") else None
    task = init_args.get("task") if hasattr(init_args, "get") else None
    if isinstance(task, str) and task not in TASK_NAMES:
        if "." in task:  # a class path given as a name: jsonargparse builds a class only from class_path
            raise ValueError(
                f"data.init_args.task {task!r} is not a task name; to use a Task subclass give its class path as "
                f"data.init_args.task: {{class_path: {task}}} (command line: --data.init_args.task.class_path={task}); "
                f"known task names: {', '.join(TASK_NAMES)}"
            )
        hint = did_you_mean(task, TASK_NAMES, quote=True)
        raise ValueError(
            f"unknown task {task!r} (data.init_args.task){hint}{' known' if hint else '; known'} tasks: "
            f"{', '.join(TASK_NAMES)} (or give a Task subclass as data.init_args.task: {{class_path: module.Class}})"
        )


_ABSOLUTE = re.compile(r"\$\{([A-Za-z][A-Za-z0-9_.\[\]]*)\}")


def relative_interpolations(args: list[str]) -> list[str]:
    """``args`` with each ``${a.b}`` of a ``--key=value`` (or ``--key value``) written relative to ``key``.

    OmegaConf resolves the merged config of a subcommand under its name (``fit.model...``); jsonargparse
    rewrites the absolute paths of config files relative to where they stand, and this does the same for
    the command line, so ``--model.init_args.x=${model.init_args.y}`` means the key the user wrote.
    """
    out = list(args)
    for i, arg in enumerate(out):
        if not arg.startswith("--"):
            continue
        key, eq, value = arg[2:].partition("=")
        j = i if eq else i + 1
        if not eq:
            if j >= len(out) or out[j].startswith("--"):  # a flag without a value
                continue
            value = out[j]
        if "${" not in value or value.lstrip().startswith(("{", "[")):
            continue
        up = "." * (key.count(".") + 1)  # from the node at `key` up to the subcommand's top
        value = _ABSOLUTE.sub(lambda m: "${" + up + m.group(1) + "}", value)
        out[j] = f"--{key}={value}" if eq else value
    return out


def lightning_cli(args: list[str], *, run: bool = True, instantiate: bool = True) -> Any:
    """The LightningCLI of ``lopd fit|validate|test`` on ``args`` (the command line less ``lopd``).

    Args:
        run: parse a subcommand (``fit``, ...) and run it; False: no subcommand, the classes only.
        instantiate: False parses the config and stops (``cli.config`` holds it, nothing is built).

    Returns:
        The ``LightningCLI`` (``.config``; ``.model``, ``.datamodule``, ``.trainer`` once instantiated).

    Raises:
        CLIError: the command line or a config does not parse (unknown key, wrong type, missing file, a
            ``class_path`` that names no class, a ``${...}`` that names no key): the message names the key
            and, for a misspelt one, the closest valid key or class; for ``fit``, what
            :func:`~lopd_lightning.cli.checks.check_fit_config` refuses before anything is built.
    """
    from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

    import lopd_lightning.callbacks  # noqa: F401
    import lopd_lightning.modules  # noqa: F401  (registers the shipped methods for short class names)
    import lopd_lightning.modules.lopd_callbacks  # noqa: F401  (and LOPD's callbacks)
    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.modules.base import OnPolicyModule

    class SaveConfigToLogger(SaveConfigCallback):
        """The run's ``config.yaml`` goes into the logger's folder; without a logger, nowhere (Lightning's
        default would drop it into the current folder)."""

        def setup(self, trainer, pl_module, stage: str) -> None:
            if not trainer.loggers:
                return
            super().setup(trainer, pl_module, stage)

    class LOPDCLI(LightningCLI):
        @staticmethod
        def subcommands() -> dict[str, set[str]]:
            # no `predict`: no module implements predict_step
            return {k: v for k, v in LightningCLI.subcommands().items() if k in LIGHTNING_COMMANDS}

        def parse_arguments(self, parser, args) -> None:
            # `args` is always the exact list main() took from sys.argv (less --debug) or one a command
            # built; LightningCLI's warning about passing both `args` and a command line does not apply
            check_config_files(args)
            try:
                self.config = parser.parse_args(relative_interpolations(args))
            except argparse.ArgumentError as error:
                subparsers = getattr(self, "_subcommand_parsers", {})
                raise CLIError(parse_error_message(error, parser, subparsers, args), 2) from error
            except Exception as error:  # a ${...} that does not resolve (omegaconf's errors)
                message = interpolation_error_message(error, next((a for a in args if a in LIGHTNING_COMMANDS), None))
                if message is None:
                    raise
                raise CLIError(message, 2) from error

        def before_instantiate_classes(self) -> None:
            config = self.config[self.subcommand] if self.subcommand else self.config
            check_task_name(config)
            check_run_config(config, self.subcommand)

        def instantiate_classes(self) -> None:
            if instantiate:
                super().instantiate_classes()

    from jsonargparse import set_parsing_settings

    # `${a.b}` in a config file is the path from its top; omegaconf+ resolves the merged config under the
    # subcommand, so jsonargparse rewrites these paths relative to where they stand
    set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    quiet = {"exit_on_error": False}  # parse errors raise, and become one line in main()
    return LOPDCLI(
        OnPolicyModule,
        OnPolicyDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=SaveConfigToLogger,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
        parser_kwargs={"parser_mode": "omegaconf+", **quiet, **{c: dict(quiet) for c in LIGHTNING_COMMANDS}},
    )
