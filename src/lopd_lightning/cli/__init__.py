"""The ``lopd`` command.

- ``lopd fit|validate|test -c CONFIG [-c MORE] [--print_config]``: the Lightning CLI in subclass mode: a
  config names any module (``LOPDModule``, ``GRPOModule``, ...), DataModule, task or callback class.
- ``lopd build-memory -c CONFIG [--from-references] [--out FOLDER]``: build the experience bank offline.
- ``lopd pretrain-composer -c CONFIG [--out FOLDER] [--steps N] [--resume]``: pretrain LOPD's composer on the
  bank, as a stage of its own (saved where ``model.init_args.composer_path`` reads it).
- ``lopd privilege-check -c CONFIG [--requests N] [--out FILE.json]``: whether the configured teacher, with its
  context, solves more train requests greedily than the student (:mod:`lopd_lightning.privilege`).
- ``lopd tasks verify NAME|module.Class [--limit N] [--max-turns N]``: replay every reference solution through
  the task's reward, with the turn limit of training.
- ``lopd tasks list``: the registered task names.
- ``lopd export CHECKPOINT --out FOLDER [--adapter]``: the student of any method's checkpoint as a Hugging
  Face folder (:mod:`lopd_lightning.export`).

The modules: ``training`` (fit/validate/test: the LightningCLI), ``commands`` (build-memory,
pretrain-composer, privilege-check, tasks, export), ``errors`` (the one-line errors); this one holds the entry point
:func:`main` (the ``lopd`` console script; ``python -m lopd_lightning.cli`` runs it too).

A mistake the user can fix (a bad key or value, a missing folder, an unknown task) ends the command with
one line on stderr, ``error: <message>``, naming the config key and the fix, and a non-zero exit status
(2 for a command line or config that does not parse, 1 for the rest); ``--debug`` or ``LOPD_DEBUG=1``
shows the full traceback instead.

In ``lopd fit|validate|test``, ``${model.init_args.max_new_tokens}`` (a key's path from the config's top) in a
config file or on the command line is resolved after every ``-c`` file and the command line are merged, so
it follows a later override of that key (:mod:`lopd_lightning.cli.training`).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from lopd_lightning.cli.commands import (
    build_memory_command,
    export_command,
    pretrain_composer_command,
    privilege_check_command,
    tasks_command,
)
from lopd_lightning.cli.errors import (
    CLIError,
    explain,
    parse_error_message,
)
from lopd_lightning.cli.training import (
    LIGHTNING_COMMANDS,
    check_task_name,
    lightning_cli,
)
from lopd_lightning.hints import did_you_mean

__all__ = [
    "COMMANDS",
    "HELP",
    "CLIError",
    "build_memory_command",
    "check_task_name",
    "configure_logging",
    "explain",
    "export_command",
    "lightning_cli",
    "main",
    "parse_error_message",
    "pretrain_composer_command",
    "privilege_check_command",
    "tasks_command",
]

#: The commands of ``lopd``, with the one line ``lopd --help`` shows for each.
COMMANDS: dict[str, str] = {
    "fit": "train a method: lopd fit -c CONFIG [-c MORE] [--key=value ...] [--print_config]",
    "validate": "greedy episodes of the configured student on the validation split",
    "test": "greedy episodes of the configured student on the test split",
    "build-memory": "build LOPD's experience bank offline: lopd build-memory -c CONFIG [--from-references]",
    "pretrain-composer": "pretrain LOPD's composer on the bank: lopd pretrain-composer -c CONFIG [--steps N] [--resume]",
    "privilege-check": "is the teacher privileged? lopd privilege-check -c CONFIG [--requests N] [--out FILE.json]",
    "tasks": "list the tasks, or replay a task's reference solutions: lopd tasks list | verify NAME",
    "export": "the student of a checkpoint as a Hugging Face folder: lopd export CKPT --out FOLDER [--adapter]",
}

HELP = f"""usage: lopd [--debug] COMMAND [options]

LOPD and the methods it is compared with (GRPO, SDPO, OPSD, Skill-SD, SFT) as Lightning modules.

commands:
{chr(10).join(f"  {name:<18} {text}" for name, text in COMMANDS.items())}

options:
  --debug        on an error, show the full traceback instead of one line (or set LOPD_DEBUG=1)
  -h, --help     this message; `lopd COMMAND --help` lists a command's options

examples:
  lopd fit -c configs/tiny.yaml                     # the whole pipeline on a tiny random model (seconds)
  lopd pretrain-composer -c configs/quickstart/lopd.yaml --steps 100   # the composer, before fit
  lopd fit -c configs/quickstart/lopd.yaml --trainer.max_steps=20
  lopd export runs/quickstart/checkpoints/last.ckpt --out runs/quickstart/student
"""


class _DropLightningTips(logging.Filter):
    """Lightning's advertisements ("💡 Tip: ... try installing litlogger/litmodels") on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)


#: Lightning 2.6 warns at every ``every_n_train_steps`` checkpoint of a manual-optimisation module (every method
#: here) that the checkpoint holds the state *after* the optimiser step, with a 12-line code example. That
#: state is the one an exact resume needs (``global_step`` N and the weights after N steps), so the warning
#: says nothing to act on; it is dropped by its exact opening.
CHECKPOINT_AFTER_STEP_WARNING = (r"Using ModelCheckpoint with manual optimization and every_n_train_steps, "
                                 r"but no pre-optimization")

#: Lightning warns, once a tag, that an epoch-level value should be logged with ``sync_dist=True`` whenever
#: torch.distributed is up: under DDP, and in one process whose vLLM engine brought it up (where Lightning's
#: single-device trainer ignores ``sync_dist`` anyway). The evaluation's tags
#: (:meth:`~lopd_lightning.modules.evaluation.EvaluationMixin.log_evaluation`) are torchmetrics values already
#: reduced over the ranks, so for those tags, and only those, the warning says nothing to act on.
EVALUATION_SYNC_DIST_WARNING = (r"It is recommended to use `self\.log\('(val|test)/(reward_mean|success_rate|turns_mean|"
                                r"reply_tokens_mean|cut_at_length_rate)', \.\.\., sync_dist=True\)`")
_DROPPED_WARNINGS = (CHECKPOINT_AFTER_STEP_WARNING, EVALUATION_SYNC_DIST_WARNING)


def configure_logging() -> None:
    """INFO logs on stderr, each line once; no Lightning tips; faiss's loader quiet; Lightning's warnings that
    a manual-optimisation checkpoint holds the post-step state (:data:`CHECKPOINT_AFTER_STEP_WARNING`) and that
    the evaluation's tags should sync across devices (:data:`EVALUATION_SYNC_DIST_WARNING`) dropped."""
    # once: every change to the filters resets Python's "already shown" registries, so that a warning shown
    # once per location (a FutureWarning of transformers) would print again at every later main()
    installed = {message.pattern for action, message, *_ in warnings.filters
                 if action == "ignore" and message is not None}
    for pattern in _DROPPED_WARNINGS:
        if pattern not in installed:
            warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("faiss").setLevel(logging.WARNING)  # its loader logs a missing AVX2 build at INFO
    # Lightning's "lightning" logger has its own handler ("INFO: ..."); propagating to the root one as
    # well printed each of its lines twice
    logging.getLogger("lightning").propagate = False
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLightningTips) for f in logger.filters):
            logger.addFilter(_DropLightningTips())


def _debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("LOPD_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(HELP, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "tasks":
        return tasks_command(rest)
    if command == "build-memory":
        return build_memory_command(rest)
    if command == "pretrain-composer":
        return pretrain_composer_command(rest)
    if command == "privilege-check":
        return privilege_check_command(rest)
    if command == "export":
        return export_command(rest)
    if command in LIGHTNING_COMMANDS or (command.startswith("-") and any(a in LIGHTNING_COMMANDS for a in argv)):
        lightning_cli(argv)
        return 0
    if command.startswith("-"):
        raise CLIError(f"give a command first: lopd COMMAND [options], COMMAND one of {', '.join(COMMANDS)} "
                       f"(see `lopd --help`)", 2)
    raise CLIError(f"unknown command {command!r}{did_you_mean(command, COMMANDS, quote=True)} (commands: {', '.join(COMMANDS)}; "
                   f"see `lopd --help`)", 2)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lopd`` console script.

    Returns 0 (or a command's own status, e.g. 1 when ``lopd tasks verify`` finds a failing reference).
    A mistake the user can fix raises ``SystemExit(1 or 2)`` after printing ``error: <message>`` on
    stderr; ``--debug`` (anywhere on the command line) or ``LOPD_DEBUG=1`` re-raises it with its traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    configure_logging()
    try:
        return _dispatch(argv)
    except Exception as error:
        explained = None if debug else explain(error)
        if explained is None:
            raise
        message, code = explained
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(code) from None

