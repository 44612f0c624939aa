"""One line for every mistake a user can fix: what ``lopd`` prints instead of a traceback.

A mistake the user can fix (a bad key or value, a missing folder, an unknown task) ends the command with
one line on stderr, ``error: <message>``, naming the config key and the fix, and a non-zero exit status
(2 for a command line or config that does not parse, 1 for the rest): :class:`CLIError` for the checks of
``lopd`` itself, :func:`parse_error_message` for what jsonargparse refuses, :func:`explain` for an error
raised while the configured classes were built. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import linecache
import os
import re
from pathlib import Path
from typing import Any

from lopd_lightning.hints import closest, did_you_mean
from lopd_lightning.introspect import exception_chain, init_parameters

__all__ = [
    "ArgumentParser",
    "CLIError",
    "explain",
    "import_class",
    "import_task_class",
    "interpolation_error_message",
    "parse_error_message",
]


class CLIError(Exception):
    """A mistake the user can fix: ``lopd`` prints ``error: <message>`` (one line) and exits with ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.message = message
        self.code = code



class ArgumentParser(argparse.ArgumentParser):
    """argparse for the commands outside LightningCLI: a usage error is a :class:`CLIError` (one line)."""

    def error(self, message: str):
        raise CLIError(f"{self.prog}: {message} (see `{self.prog} --help`)", 2)


def import_class(path: str) -> type | None:
    """The class at ``path`` (``module.Class``, or a short name of lopd_lightning's modules, DataModule or
    callbacks), or None when there is none."""
    module_name, _, name = path.rpartition(".")
    ours = ["lopd_lightning.modules", "lopd_lightning.data", "lopd_lightning.callbacks",
            "lopd_lightning.modules.lopd_callbacks"]
    for module in ([module_name] if module_name else ours):
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            continue
        if isinstance(obj, type):
            return obj
    return None


def import_task_class(name: str) -> type:
    """The object at ``module.Class`` ``name``, for a task (``lopd tasks verify``, ``data.init_args.task``).

    Raises:
        CLIError: the module does not import (status 2; 1 when the module itself is broken, an error at
            its import) or has no such attribute (2); the message names the module and the task.
    """
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
        return getattr(module, class_name)
    except AttributeError as error:
        raise CLIError(f"module {module_name!r} has no {class_name!r} (task {name!r})", 2) from error


def _known_class_paths(key: str) -> list[str]:
    """The class paths a ``<key>`` (``model.class_path``, ``trainer.callbacks...``) is likely meant to name."""
    import lightning.pytorch.callbacks as pl_callbacks
    import lightning.pytorch.loggers as pl_loggers

    if key.startswith("model"):
        return [f"lopd_lightning.modules.{name}" for name in _known_classes("model")]
    if key.startswith("data"):
        return ["lopd_lightning.data.OnPolicyDataModule"]
    if "callbacks" in key:
        import lopd_lightning.callbacks as generic
        import lopd_lightning.modules.lopd_callbacks as lopd_only

        return ([f"{ours.__name__}.{n}" for ours in (generic, lopd_only) for n, v in vars(ours).items()
                 if isinstance(v, type) and issubclass(v, pl_callbacks.Callback) and v.__module__ == ours.__name__]
                + [f"lightning.pytorch.callbacks.{n}" for n in pl_callbacks.__all__])
    if "logger" in key:
        return [f"lightning.pytorch.loggers.{n}" for n in pl_loggers.__all__]
    return []


def _class_path_message(key: str, class_path: str, reason: str) -> str:
    """One line for a ``class_path`` that names no class: the key, the reason, the closest known class."""
    if key.endswith("task.class_path"):
        try:
            import_task_class(class_path)
        except CLIError as error:
            return f"{key}: {error.message}"
    hint = did_you_mean(class_path, _known_class_paths(key), quote=True)
    return f"{key}: no class {class_path!r} ({' '.join(reason.split())}){hint or '; give module.Class of an importable class'}"


#: the last part of a key that takes a class -> a class path to give as the example
_CLASS_EXAMPLES = {"model": "lopd_lightning.modules.LOPDModule", "data": "lopd_lightning.data.OnPolicyDataModule",
                   "logger": "lightning.pytorch.loggers.TensorBoardLogger",
                   "callbacks": "lightning.pytorch.callbacks.ModelCheckpoint"}


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
    chain = exception_chain(error)
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
            owner = import_class(m.group(1))
            if owner is None:  # the class does not import: its class_path is wrong, not its init_args
                return _class_path_message(".".join([*path, "class_path"]), m.group(1), str(chain[-1]))
            path.append("init_args")
    inner = str(chain[-1]).strip()
    key = ".".join(path)
    nested = _unimportable_class_path(chain)  # a subtype's class_path, e.g. data.init_args.task's
    if nested is not None:
        return _class_path_message(".".join([*path, "class_path"]), *nested)
    broken = _broken_task_module(chain) if path and path[-1] == "task" else None
    if broken is not None:  # a task module that raises at import: jsonargparse reports only its message
        return f"{key}.class_path: {broken}"

    m = re.fullmatch(r"Option '([^']+)' is not accepted", _plain(inner)) or re.fullmatch(
        r"Key '([^']+)' is not expected", _plain(inner)
    )
    if m:
        bad = f"{key}.{m.group(1)}" if key else m.group(1)
        if owner is None:
            return f"unknown key {bad}{did_you_mean(bad, keys)}"
        hint = _argument_hint(bad, key, owner)
        return f"unknown key {bad} ({owner.__name__} has no argument {m.group(1)!r}){hint}"
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
        example = _CLASS_EXAMPLES.get(section.split(".")[-1], "module.Class of an importable class")
        return (f"{section}: no class {m.group(1)!r}; give a class path such as "
                f"{example}{did_you_mean(m.group(1), _known_classes(section), quote=True)}")
    if key == "config":
        return f"-c/--config: {_plain(inner)}"
    return f"{key}: {_plain(inner)}" if key else _plain(inner)


def _unimportable_class_path(chain: list[BaseException]) -> tuple[str, str] | None:
    """(class path, reason) of a ``class_path`` that does not import, reported inside a Union's subtype
    errors (the key of a ``str | Task`` such as ``data.init_args.task``), or None."""
    pattern = re.compile(r"Problem with given class_path '([^']+)':\s*\n\s*(No module named .*|module '[^']+' has no attribute .*)")
    for error in reversed(chain):
        for m in pattern.finditer(str(error)):
            if import_class(m.group(1)) is None:
                return m.group(1), m.group(2)
    return None


def _broken_task_module(chain: list[BaseException]) -> str | None:
    """What :func:`import_task_class` says of the task ``class_path`` given in ``chain``'s errors, when its
    module raises at import (a SyntaxError, an exception at its top level), or None."""
    given = re.compile(r"Given value: (?:NestedArg\(key='class_path', val='([^']+)'\)|\{'class_path': '([^']+)')")
    for error in reversed(chain):
        m = given.search(str(error))
        if m:
            try:
                import_task_class(m.group(1) or m.group(2))
            except CLIError as failure:
                return failure.message
            return None
    return None


def interpolation_error_message(error: BaseException, subcommand: str | None) -> str | None:
    """One line for a ``${...}`` that does not resolve (an omegaconf error among ``error``'s causes): the key
    that holds it and, for a path that names no key, the closest key; None when it is no such error.

    Args:
        subcommand: the subcommand whose config it is (``fit``): omegaconf names keys under it.
    """
    from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException

    found = next((e for e in exception_chain(error) if isinstance(e, OmegaConfBaseException)), None)
    if found is None:
        return None
    strip = (lambda k: k[len(subcommand) + 1:] if k.startswith(f"{subcommand}.") else k) if subcommand else (lambda k: k)
    key = strip(str(getattr(found, "full_key", None) or "")) or "config"
    text = " ".join(str(found).split("\n", 1)[0].split())
    m = re.search(r"\(resolved to '([^']+)'\)", text)
    if isinstance(found, InterpolationKeyError) and m:
        missing = strip(m.group(1))
        parent = getattr(found, "parent_node", None)
        keys = [strip(k) for k in _flat_keys(parent._get_root())] if parent is not None else []
        match = closest(missing, keys)
        hint = f"; did you mean ${{{match}}}?" if match else "; give the key's path from the config's top, e.g. ${trainer.max_steps}"
        return f"{key}: ${{{missing}}} names no key{hint}"
    return f"{key}: cannot resolve {getattr(found, 'child_node', None) or 'its ${...}'}: {text}"


def _flat_keys(node: Any, prefix: str = "") -> list[str]:
    """The dotted keys of an omegaconf DictConfig (its lists' items as ``key[i]``)."""
    from omegaconf import DictConfig, ListConfig

    out: list[str] = []
    if isinstance(node, DictConfig):
        for k in node.keys():
            path = f"{prefix}.{k}" if prefix else str(k)
            out.append(path)
            out.extend(_flat_keys(node._get_node(k), path))
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            out.extend(_flat_keys(node._get_node(i), f"{prefix}[{i}]"))
    return out


#: words of an argument's name that say nothing about which argument it is
_FILLER_WORDS = frozenset({"a", "an", "by", "in", "num", "number", "of", "per", "the", "to"})


def _words(text: str) -> set[str]:
    """The lower-case words of ``text`` (split at anything but letters and digits), plurals made singular."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w for w in words}


def _documented_arguments(cls: type) -> dict[str, str]:
    """Argument name -> its text in the ``Args:`` sections of the docstrings of ``cls`` and its bases
    (Google style: ``name: text`` or ``name, other: text``, continued on more deeply indented lines)."""
    out: dict[str, str] = {}
    for klass in cls.__mro__:
        lines = (klass.__doc__ or "").splitlines()
        start = next((i + 1 for i, line in enumerate(lines) if line.strip() == "Args:"), None)
        if start is None:
            continue
        indent, names = None, []
        for line in lines[start:]:
            if not line.strip():
                continue
            depth = len(line) - len(line.lstrip())
            indent = depth if indent is None else indent
            if depth < indent:
                break
            m = re.match(r"([\w, ]+):(.*)", line.strip()) if depth == indent else None
            if m:
                names = [n.strip() for n in m.group(1).split(",") if n.strip()]
                line = m.group(2)
            for name in names:
                out[name] = f"{out.get(name, '')} {line.strip()}"
    return out


def _closest_argument(name: str, owner: type) -> str | None:
    """The argument of ``owner`` an unknown argument ``name`` most likely means, or None: a near-certain typo
    of one; else the one argument whose name has the same words in another order; else the one argument
    whose name and documentation hold every word of ``name`` (``rollouts_per_example``: ``group_size``,
    documented as the rollouts per example); else the closest name (:func:`~lopd_lightning.hints.closest`)."""
    params = init_parameters(owner)
    match = closest(name, params, cutoff=0.85)
    if match:
        return match
    wanted = _words(name) - _FILLER_WORDS
    if wanted:
        docs = _documented_arguments(owner)
        for covers in (lambda p: _words(p) - _FILLER_WORDS == wanted,
                       lambda p: wanted <= _words(p) | _words(docs.get(p, ""))):
            found = [p for p in params if covers(p)]
            if len(found) == 1:
                return found[0]
    return closest(name, params)


def _argument_hint(bad: str, key: str, owner: type) -> str:
    """Did-you-mean for an unknown constructor argument ``bad`` (``<key>.<name>``) of ``owner``: the argument it
    most likely means (:func:`_closest_argument`)."""
    name = bad[len(key) + 1:] if key and bad.startswith(f"{key}.") else bad
    match = _closest_argument(name, owner)
    return f"; did you mean {key}.{match}?" if match else ""


def _suggest_key(key: str, keys: list[str], *, prefix: str = "") -> str:
    """Did-you-mean for a dotted key: the closest whole key, else the closest first component."""
    hint = did_you_mean(key, keys, prefix=prefix)
    if hint or "." not in key:
        return hint
    head, rest = key.split(".", 1)
    heads = {k.split(".", 1)[0] for k in keys}
    match = closest(head, sorted(heads))
    return f"; did you mean {prefix}{match}.{rest}?" if match and match != head else ""


def _package_dir() -> str:
    """The folder of the lopd_lightning package (this module is in its ``cli/``), with a trailing separator."""
    return str(Path(__file__).resolve().parent.parent) + os.sep


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
    chain = exception_chain(error)
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
