"""The ``lopd`` command.

- ``lopd fit|validate|test -c CONFIG [-c MORE] [--print_config]``: the Lightning CLI in subclass mode: a
  config names any module (``LOPDModule``, ``GRPOModule``, ...), DataModule, task or callback class.
- ``lopd build-memory -c CONFIG [--from-references] [--out FOLDER]``: build the experience bank offline.
- ``lopd tasks verify NAME|module.Class [--limit N] [--max-turns N]``: replay every reference solution through
  the task's reward, with the turn limit of training.
- ``lopd tasks list``: the registered task names.
- ``lopd export CHECKPOINT --out FOLDER [--adapter]``: the student of any method's checkpoint as a Hugging
  Face folder (:mod:`lopd_lightning.export`).

A mistake the user can fix (a bad key or value, a missing folder, an unknown task) ends the command with
one line on stderr, ``error: <message>``, naming the config key and the fix, and a non-zero exit status
(2 for a command line or config that does not parse, 1 for the rest); ``--debug`` or ``LOPD_DEBUG=1``
shows the full traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import linecache
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("lopd_lightning")

#: The commands of ``lopd``, with the one line ``lopd --help`` shows for each.
COMMANDS: dict[str, str] = {
    "fit": "train a method: lopd fit -c CONFIG [-c MORE] [--key=value ...] [--print_config]",
    "validate": "greedy episodes of the configured student on the validation split",
    "test": "greedy episodes of the configured student on the test split",
    "build-memory": "build LOPD's experience bank offline: lopd build-memory -c CONFIG [--from-references]",
    "tasks": "list the tasks, or replay a task's reference solutions: lopd tasks list | verify NAME",
    "export": "the student of a checkpoint as a Hugging Face folder: lopd export CKPT --out FOLDER [--adapter]",
}
_LIGHTNING_COMMANDS = ("fit", "validate", "test")

HELP = f"""usage: lopd [--debug] COMMAND [options]

LOPD and the methods it is compared with (GRPO, SDPO, OPSD, Skill-SD, SFT) as Lightning modules.

commands:
{chr(10).join(f"  {name:<13} {text}" for name, text in COMMANDS.items())}

options:
  --debug        on an error, show the full traceback instead of one line (or set LOPD_DEBUG=1)
  -h, --help     this message; `lopd COMMAND --help` lists a command's options

examples:
  lopd fit -c configs/tiny.yaml                     # the whole pipeline on a tiny random model (seconds)
  lopd fit -c configs/quickstart/lopd.yaml --trainer.max_steps=20 --model.init_args.num_latents=32
  lopd export runs/quickstart/checkpoints/last.ckpt --out runs/quickstart/student
"""


class CLIError(Exception):
    """A mistake the user can fix: ``lopd`` prints ``error: <message>`` (one line) and exits with ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.message = message
        self.code = code


class _ArgumentParser(argparse.ArgumentParser):
    """argparse for the commands outside LightningCLI: a usage error is a :class:`CLIError` (one line)."""

    def error(self, message: str):
        raise CLIError(f"{self.prog}: {message} (see `{self.prog} --help`)", 2)


def did_you_mean(word: str, candidates: Any, *, prefix: str = "", quote: bool = False) -> str:
    """``"; did you mean <prefix><closest>?"`` for the closest of ``candidates``, or ``""`` when none is close."""
    match = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1, cutoff=0.6)
    if not match:
        return ""
    return f"; did you mean {match[0]!r}?" if quote else f"; did you mean {prefix}{match[0]}?"


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


# ---------------------------------------------------------------------------------------- LightningCLI
def _lightning_cli(args: list[str], *, run: bool = True, instantiate: bool = True):
    """The LightningCLI of ``lopd fit|validate|test`` on ``args`` (the command line less ``lopd``).

    Args:
        run: parse a subcommand (``fit``, ...) and run it; False: no subcommand, the classes only.
        instantiate: False parses the config and stops (``cli.config`` holds it, nothing is built).

    Raises:
        CLIError: the command line or a config does not parse (unknown key, wrong type, missing file):
            the message names the key and, for a misspelt one, the closest valid key.
    """
    from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.modules.base import OnPolicyModule
    import lopd_lightning.modules  # noqa: F401  (registers the shipped methods for short class names)
    import lopd_lightning.callbacks  # noqa: F401

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
            return {k: v for k, v in LightningCLI.subcommands().items() if k in _LIGHTNING_COMMANDS}

        def parse_arguments(self, parser, args) -> None:
            # `args` is always the exact list main() took from sys.argv (less --debug) or one a command
            # built; LightningCLI's warning about passing both `args` and a command line does not apply
            try:
                self.config = parser.parse_args(args)
            except argparse.ArgumentError as error:
                subparsers = getattr(self, "_subcommand_parsers", {})
                raise CLIError(parse_error_message(error, parser, subparsers, args), 2) from error

        def before_instantiate_classes(self) -> None:
            check_task_name(self.config[self.subcommand] if self.subcommand else self.config)

        def instantiate_classes(self) -> None:
            if instantiate:
                super().instantiate_classes()

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
        parser_kwargs={"parser_mode": "omegaconf", **quiet, **{c: dict(quiet) for c in _LIGHTNING_COMMANDS}},
    )


# ---------------------------------------------------------------------------------------- errors
def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes / contexts, outermost first."""
    chain: list[BaseException] = []
    while error is not None and all(error is not e for e in chain):
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def init_parameters(cls: type) -> list[str]:
    """The keyword arguments a class accepts, following ``**kwargs`` up the base classes (as jsonargparse does)."""
    names: list[str] = []
    for klass in cls.__mro__:
        if klass is object or "__init__" not in vars(klass):
            continue
        try:
            params = inspect.signature(klass.__init__).parameters.values()
        except (TypeError, ValueError):
            break
        names += [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                  and p.name not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def _import_class(path: str) -> type | None:
    module_name, _, name = path.rpartition(".")
    for module in ([module_name] if module_name else ["lopd_lightning.modules", "lopd_lightning.data", "lopd_lightning.callbacks"]):
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            continue
        if isinstance(obj, type):
            return obj
    return None


def _known_classes(section: str) -> list[str]:
    if section == "model":
        import lopd_lightning.modules as modules

        return [n for n in modules.__all__ if n != "OnPolicyModule"]
    if section == "data":
        return ["OnPolicyDataModule"]
    return []


def _plain(message: str) -> str:
    """The first line of a jsonargparse message, with ``<class 'int'>`` written ``int``."""
    lines = [line.strip(" -") for line in message.strip().splitlines() if line.strip(" -")]
    text = lines[0] if lines else message.strip()
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    m = re.fullmatch(r"Expected a ([\w.\[\], ]+)\. Got value: (.*)", text)
    return f"expected {m.group(1)}, got {m.group(2)!r}" if m else text


def parse_error_message(error: BaseException, parser: Any, subparsers: dict[str, Any], args: list[str]) -> str:
    """One line for a jsonargparse error: the config key, what is wrong, and the closest valid key.

    Args:
        parser, subparsers: the CLI's parser and its subcommand parsers (for the valid keys).
        args: the command line that was parsed (for the subcommand).
    """
    chain = _chain(error)
    subcommand = next((a for a in args if a in subparsers), None)
    sub = subparsers.get(subcommand, parser)
    keys = [a.dest for a in getattr(sub, "_actions", []) if not a.dest.endswith(".help") and a.dest != "help"]
    path: list[str] = []
    owner: type | None = None
    for e in chain:
        text = str(e).strip()
        m = re.match(r'Parser key "([^"]+)":', text)
        if m and (not path or path[-1] != m.group(1)):
            path.append(m.group(1))
        m = re.match(r"Problem with given class_path '([^']+)':", text)
        if m and (not path or path[-1] != "init_args"):
            owner = _import_class(m.group(1))
            path.append("init_args")
    inner = str(chain[-1]).strip()
    key = ".".join(path)

    m = re.fullmatch(r"Option '([^']+)' is not accepted", _plain(inner)) or re.fullmatch(
        r"Key '([^']+)' is not expected", _plain(inner)
    )
    if m:
        bad = f"{key}.{m.group(1)}" if key else m.group(1)
        known = [f"{key}.{p}" for p in init_parameters(owner)] if owner is not None else keys
        where = f" ({owner.__name__} has no argument {m.group(1)!r})" if owner is not None else ""
        return f"unknown key {bad}{where}{did_you_mean(bad, known)}"
    m = re.fullmatch(r"Subcommand '([^']+)' does not accept option '([^']+)'", _plain(inner))
    if m:
        return f"unknown key {m.group(2)} (lopd {m.group(1)} has no such option){_suggest_key(m.group(2), keys)}"
    m = re.fullmatch(r"unrecognized arguments: (.*)", _plain(inner))
    if m:
        bad = m.group(1).split()[0]
        name = bad.lstrip("-").split("=", 1)[0]
        hint = _suggest_key(name, keys, prefix="--") if bad.startswith("--") else ""
        return f"unknown option {bad}{hint} (see `lopd {subcommand or 'COMMAND'} --help`)"
    m = re.search(r"Expected a dot import path string: (\S+)", inner)
    if m:
        section = path[0] if path else "model"
        return (f"{section}: no class {m.group(1)!r}; give a class path such as "
                f"lopd_lightning.modules.LOPDModule{did_you_mean(m.group(1), _known_classes(section), quote=True)}")
    if key == "config":
        return f"-c/--config: {_plain(inner)}"
    return f"{key}: {_plain(inner)}" if key else _plain(inner)


def _suggest_key(key: str, keys: list[str], *, prefix: str = "") -> str:
    """Did-you-mean for a dotted key: the closest whole key, else the closest first component."""
    hint = did_you_mean(key, keys, prefix=prefix)
    if hint or "." not in key:
        return hint
    head, rest = key.split(".", 1)
    heads = {k.split(".", 1)[0] for k in keys}
    match = difflib.get_close_matches(head, sorted(heads), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{match[0]}.{rest}?" if match and match[0] != head else ""


def _package_dir() -> str:
    return str(Path(__file__).resolve().parent) + os.sep


def _raised_here(error: BaseException) -> bool:
    """True when a ``raise`` statement of this package raised ``error`` (its own message, not a bug's)."""
    tb = error.__traceback__
    if tb is None or isinstance(error, AssertionError):
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    if not str(Path(filename).resolve()).startswith(_package_dir()):
        return False
    return linecache.getline(filename, tb.tb_lineno).strip().startswith("raise")


def _owner(error: BaseException) -> tuple[str, type] | None:
    """The config section whose class raised ``error`` in its constructor: ("model", LOPDModule), ..."""
    from lightning.pytorch import Callback, LightningDataModule, LightningModule

    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "__init__":
            obj = frame.f_locals.get("self")
            for base, section in ((LightningModule, "model"), (LightningDataModule, "data")):
                if isinstance(obj, base):
                    return section, type(obj)
            if isinstance(obj, Callback):
                return f"trainer.callbacks[{type(obj).__name__}]", type(obj)
        tb = tb.tb_next
    return None


def _name_the_key(message: str, owner: tuple[str, type] | None) -> str:
    """``x must be ...`` raised by a config class's constructor becomes ``model.init_args.x must be ...``."""
    if owner is None or "init_args." in message:
        return message
    m = re.match(r"([A-Za-z_]\w*)\b", message)
    if m and m.group(1) in init_parameters(owner[1]):
        return f"{owner[0]}.init_args.{message}"
    return message


def explain(error: BaseException) -> tuple[str, int] | None:
    """The one line and exit status ``lopd`` shows for ``error``, or None to show its traceback.

    - :class:`CLIError` (and argparse errors): its message, status 2;
    - an exception raised by this package's own ``raise`` (a check with its message), found among the
      causes of what Lightning or jsonargparse wrapped it in: its message, the config key named, status 1;
    - any other exception raised while a config class was built (e.g. a LoRA field peft refuses): its
      innermost message with the config section, status 1;
    - anything else (a bug): None.
    """
    if isinstance(error, CLIError):
        return error.message, error.code
    if isinstance(error, argparse.ArgumentError):
        return _plain(str(error)), 2
    chain = _chain(error)
    ours = next((e for e in chain if _raised_here(e)), None)
    if ours is not None:
        return " ".join(_name_the_key(str(ours), _owner(ours)).split()), 1
    if any("Does not validate against any of the Union subtypes" in str(e) for e in chain):
        inner = chain[-1]
        owner = _owner(inner)
        where = f"{owner[0]}: " if owner else ""
        text = " ".join(str(inner).split()) or type(inner).__name__
        return f"{where}{text} (--debug shows the traceback)", 1
    return None


# ---------------------------------------------------------------------------------------- commands
def _task(name: str):
    """A task by registry name or by ``module.Class`` (a Task subclass built with its defaults)."""
    from lopd_lightning.tasks import TASK_NAMES, Task, get_task

    if name in TASK_NAMES:
        return get_task(name)
    if "." not in name:
        raise CLIError(
            f"unknown task {name!r}{did_you_mean(name, TASK_NAMES, quote=True)} (known tasks: {', '.join(TASK_NAMES)}; "
            f"or a Task subclass as module.Class, importable from PYTHONPATH)", 2
        )
    module_name, _, class_name = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise CLIError(f"cannot import {module_name!r} for task {name!r}: {error} (is its folder on PYTHONPATH?)", 2) from error
    except Exception as error:  # the module itself is broken: a SyntaxError, an error at import time
        where = f"{type(error).__name__}: {' '.join(str(error).split())}"
        raise CLIError(f"cannot import {module_name!r} for task {name!r}: {where}; fix the module "
                       f"(lopd --debug tasks verify {name} shows the traceback)", 1) from error
    try:
        cls = getattr(module, class_name)
    except AttributeError as error:
        raise CLIError(f"module {module_name!r} has no {class_name!r} (task {name!r})", 2) from error
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise CLIError(f"{name!r} is not a lopd_lightning.tasks.Task subclass", 2)
    try:
        inspect.signature(cls).bind()
    except TypeError as error:
        required = [p.name for p in inspect.signature(cls).parameters.values()
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        raise CLIError(
            f"task class {name!r} needs arguments ({', '.join(required) or error}); lopd tasks verify builds it "
            f"without any: give them defaults, or verify a subclass that sets them", 2
        ) from error
    except ValueError:  # no signature to read (a builtin base): the call below tells
        pass
    return cls()


def tasks_command(argv: list[str]) -> int:
    """``lopd tasks verify NAME|module.Class [--limit N] [--max-turns N]`` and ``lopd tasks list``."""
    from lopd_lightning.tasks import TASK_NAMES

    parser = _ArgumentParser(prog="lopd tasks")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="list the registered tasks")
    verify = sub.add_parser("verify", help="replay every reference solution through the task's reward")
    verify.add_argument("name", help=f"one of: {', '.join(TASK_NAMES)}; or a Task subclass as module.Class")
    verify.add_argument("--limit", type=int, default=None, help="only the first N examples")
    verify.add_argument("--split", default="all", choices=["train", "val", "all"])
    verify.add_argument("--max-turns", type=int, default=None,
                        help="replies per episode, as model.init_args.max_turns (default: the task's, as in training)")
    args = parser.parse_args(argv)
    if args.action == "list":
        print("\n".join(TASK_NAMES))
        return 0
    for option, value, default in (("--limit", args.limit, "to replay every example"),
                                   ("--max-turns", args.max_turns, "for the task's own turn limit")):
        if value is not None and value < 1:
            raise CLIError(f"lopd tasks verify: {option} must be >= 1, got {value} (leave it out {default})", 2)
    from lopd_lightning.tasks.verify import verify_task

    task = _task(args.name)
    start = time.perf_counter()
    report = verify_task(task, limit=args.limit, split=args.split, max_turns=args.max_turns)
    seconds = time.perf_counter() - start
    print(f"{args.name}: {report.n_full_marks}/{report.n} reference solutions score 1.0 ({seconds:.1f} s)")
    for example_id, reward in report.failures[:20]:
        reason = report.reason(example_id)
        print(f"  FAIL {example_id}: reward {reward}" + (f" ({' '.join(reason.split())[:300]})" if reason else ""))
    if len(report.failures) > 20:
        print(f"  ... and {len(report.failures) - 20} more")
    advice = report.turn_limit_advice()
    if advice:
        print(advice)
    return 0 if report.n_full_marks == report.n else 1


def _hooks_only_module(cli) -> tuple[Any, Any, Any]:
    """(module, datamodule, bank settings) of a parsed config, without the module's weights.

    ``--from-references`` only replays reference solutions through the module's hooks
    (``build_messages``, ``score_trajectory``, ``experience_from_trajectory``) and embeds the results,
    so the module is made without running its constructor (which loads the student): an instance of
    the configured class with its ``hparams`` and tokenizer, and no backbone. A hook that needs more
    makes build-memory fall back to the whole module.
    """
    from lightning.pytorch import LightningModule

    from lopd_lightning.memory.bank import ExperienceBank
    from lopd_lightning.memory.embed import get_embedder
    from lopd_lightning.models import load_tokenizer

    config = cli.config.clone()
    model_config = config.model
    cls = _import_class(model_config.class_path)
    init = model_config.init_args.as_dict() if hasattr(model_config.init_args, "as_dict") else dict(model_config.init_args)
    config.model = None
    datamodule = cli.parser.instantiate_classes(config).data
    module = cls.__new__(cls)
    LightningModule.__init__(module)
    module.hparams.update(init)
    module.model_name = init.get("model")
    module.tokenizer = load_tokenizer(init.get("model"))
    bank = ExperienceBank(
        get_embedder(init["embedder"]),
        capacity=init.get("bank_capacity"),
        eviction=init.get("bank_eviction", "lowest_reward"),
        allow_self_retrieval=init.get("allow_self_retrieval", False),
    )
    return module, datamodule, bank


def _reference_experiences(module, task, examples, min_reward: float) -> list:
    experiences = []
    for ex in examples:  # replayed and scored: a reference the checker rejects is reported, not kept
        messages, reward = module.reference_trajectory(task, ex)
        if reward < min_reward:
            print(f"  skipped {ex.id}: its reference solution scores {reward}", flush=True)
            continue
        exp = module.experience_from_trajectory(task, ex, messages, reward)
        if exp is not None:
            experiences.append(exp)
    return experiences


def build_memory_command(argv: list[str]) -> int:
    """``lopd build-memory -c CONFIG``: roll out the model on the train split, keep the successes.

    The bank is built as the paper does: rollouts of the configured model (the ``model`` section) on the
    train split, sampled with the module's settings, kept when the reward reaches ``--min-reward``.
    ``--from-references`` seeds it with the tasks' reference solutions instead (for base models too
    weak to succeed on their own); it needs the tokenizer and the embedder, not the student's weights,
    which it does not load (but with ``embedder: backbone``). The folder is the module's ``bank_path``
    unless ``--out`` is given.
    """
    parser = _ArgumentParser(prog="lopd build-memory")
    parser.add_argument("-c", "--config", action="append", required=True, help="the fit config(s)")
    parser.add_argument("--out", default=None, help="bank folder (default: model.init_args.bank_path)")
    parser.add_argument("--from-references", action="store_true", help="seed from reference solutions")
    parser.add_argument("--min-reward", type=float, default=1.0, help="keep trajectories with reward >= this")
    parser.add_argument("--rollouts", type=int, default=None, help="rollouts per example (default: the module's)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N train examples")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per generation batch")
    args, rest = parser.parse_known_args(argv)

    from lopd_lightning.memory.bank import ExperienceBank

    config_args = ["--trainer.logger=false", *[a for c in args.config for a in ("-c", c)], *rest]
    parsed = _lightning_cli(config_args, run=False, instantiate=False)  # the config only: nothing is built yet
    model_config = parsed.config.model
    init = model_config.init_args
    if "embedder" not in init or "bank_path" not in init:
        raise CLIError(f"model.class_path {model_config.class_path} has no experience bank; "
                       f"build-memory is for LOPDModule (or a subclass)", 2)
    # the configured bank_path is where the bank goes, not a bank to load: read it, then build without it
    out = args.out or init.bank_path
    if not out:
        raise CLIError("give --out FOLDER or set model.init_args.bank_path in the config", 2)
    start = time.perf_counter()
    experiences = None
    if args.from_references and init.embedder != "backbone":
        module, dm, bank = _hooks_only_module(parsed)
        examples = dm.train_examples[: args.limit] if args.limit else dm.train_examples
        try:
            experiences = _reference_experiences(module, dm.task, examples, args.min_reward)
        except AttributeError as error:  # a hook that reads what only the whole module has
            log.info("build-memory: a hook needs the whole module (%s); loading it", error)
    if experiences is None:
        cli = _lightning_cli([*config_args, "--model.init_args.bank_path=null"], run=False)
        module, dm = cli.model, cli.datamodule
        bank = module.bank
        examples = dm.train_examples[: args.limit] if args.limit else dm.train_examples
        if args.from_references:
            experiences = _reference_experiences(module, dm.task, examples, args.min_reward)
        else:
            experiences = _rollout_experiences(module, dm, examples, args)
    fresh = ExperienceBank(bank.embedder, **bank.settings())
    fresh.add(experiences)
    fresh.save(out)
    seconds = time.perf_counter() - start
    source = "reference solutions" if args.from_references else "rollouts"
    print(f"bank: {len(fresh)} experiences from {len(examples)} train examples ({source}) -> {out} ({seconds:.1f} s)")
    return 0


def _rollout_experiences(module, dm, examples, args) -> list:
    if args.rollouts is not None:
        module.hparams.rollouts_per_example = args.rollouts
    experiences = []
    for i in range(0, len(examples), args.batch_size):
        chunk = examples[i : i + args.batch_size]
        batch = module.make_batch(dm.task, chunk)
        for j in range(len(batch)):
            reward = float(batch.rewards[j])
            if reward >= args.min_reward:
                ex = dm.example(batch.example_ids[j])
                exp = module.experience_from_trajectory(dm.task, ex, batch.messages[j], reward)
                if exp is not None:
                    experiences.append(exp)
        print(f"  rolled out {min(i + args.batch_size, len(examples))}/{len(examples)} examples, "
              f"{len(experiences)} successful so far", flush=True)
    return experiences


def export_command(argv: list[str]) -> int:
    """``lopd export CHECKPOINT --out FOLDER [--adapter] [--class CLASS]``: see :mod:`lopd_lightning.export`."""
    parser = _ArgumentParser(
        prog="lopd export",
        description="Write the student of a checkpoint of any method as a Hugging Face folder: the LoRA merged "
        "into the weights (default), or with --adapter the student LoRA alone beside its base model. "
        "The folder loads with transformers' AutoModelForCausalLM.from_pretrained and is a valid "
        "model.init_args.model for lopd fit/validate/test.",
    )
    parser.add_argument("checkpoint", help="a Lightning checkpoint (.ckpt) of any lopd_lightning method")
    parser.add_argument("--out", required=True, help="the folder to write (created)")
    parser.add_argument("--adapter", action="store_true", help="save the student LoRA only, beside its base model")
    parser.add_argument("--class", dest="module_class", default=None,
                        help="the module's class (e.g. LOPDModule) when the checkpoint does not name it")
    parser.add_argument("--model", default=None,
                        help="the base model to rebuild the module on, when the one the checkpoint names has moved")
    args = parser.parse_args(argv)
    from lopd_lightning.export import export_checkpoint

    start = time.perf_counter()
    folder = export_checkpoint(args.checkpoint, args.out, adapter=args.adapter, module_class=args.module_class,
                               model=args.model)
    form = "student LoRA beside its base" if args.adapter else "LoRA merged"
    print(f"exported the student of {args.checkpoint} ({form}) -> {folder} ({time.perf_counter() - start:.1f} s)")
    return 0


# ---------------------------------------------------------------------------------------- main
class _DropLightningTips(logging.Filter):
    """Lightning's advertisements ("💡 Tip: ... try installing litlogger/litmodels") on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)


def configure_logging() -> None:
    """INFO logs on stderr, each line once; no Lightning tips; faiss's loader quiet."""
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
    if command == "export":
        return export_command(rest)
    if command in _LIGHTNING_COMMANDS or (command.startswith("-") and any(a in _LIGHTNING_COMMANDS for a in argv)):
        _lightning_cli(argv)
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


if __name__ == "__main__":
    sys.exit(main())
