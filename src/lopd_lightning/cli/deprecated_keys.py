"""Old spellings of renamed config keys, rewritten before jsonargparse reads the command line.

The keys of :data:`~lopd_lightning.deprecation.RENAMED_KEYS` (``model.init_args.rollouts_per_example`` ->
``group_size``, ``top_m`` and ``top_k_distill`` -> ``distill_top_k``, ``jsd_alpha`` -> ``jsd_beta``) keep
working for one release, in a config file (``-c old.yaml``: the key under ``model.init_args``, also under
a subcommand's ``model``) and on the command line (``--model.init_args.<old>=V`` or ``--model.<old>=V``).
Each old key gives one ``FutureWarning`` per process naming the new key, located where it was written:
``old.yaml:27: FutureWarning: model.init_args.rollouts_per_example is deprecated ...; use
model.init_args.group_size`` (Python shows the file's line below it), or ``<command line>:N: ...`` for
the N-th argument. Giving an old key and its new spelling in the same config file, or both on the
command line, is a mistake: :class:`~lopd_lightning.cli.errors.CLIError` with status 1. (Across sources,
the later one wins as usual: ``-c old.yaml --model.init_args.group_size=8`` sets 8.)
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from lopd_lightning.cli.errors import CLIError
from lopd_lightning.deprecation import RENAMED_KEYS, rename_keys

__all__ = ["rename_deprecated_keys"]

#: Where the renamed keys live in a config (the arguments of the method module's constructor).
MODEL_ARGS = "model.init_args"
#: ``--model.init_args.<key>[=value]`` or jsonargparse's short ``--model.<key>[=value]``.
_MODEL_FLAG = re.compile(r"--model\.(?:init_args\.)?(\w+)(=.*)?", re.S)
_CONFIG_FLAGS = ("-c", "--config")


def rename_deprecated_keys(args: list[str], folder: Path) -> list[str]:
    """``args`` (a ``lopd fit|validate|test`` command line) with every old key of ``RENAMED_KEYS`` renamed.

    A config file (``-c FILE``, ``--config FILE``, ``--config=FILE``) that holds an old key under
    ``model.init_args`` is replaced by a copy in ``folder`` with the key renamed (the rest of its text
    unchanged, so comments and number spellings stay); a config given as a YAML string is renamed in
    place; ``--model.init_args.<old>`` flags are renamed. Arguments without old keys are kept as they are.

    Args:
        folder: an existing folder for the renamed copies; it must outlive the parsing of ``args``.

    Returns:
        A new list; ``args`` is not modified.

    Raises:
        CLIError: (status 1) an old key and its new spelling in the same config file, or both on the
            command line; the message names the source and the key to keep.
    """
    copies = iter(folder / str(n) for n in range(len(args)))  # one subfolder per file: names may repeat
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in _CONFIG_FLAGS and i + 1 < len(args):
            out += [arg, _renamed_config(args[i + 1], next(copies))]
            i += 2
            continue
        if arg.startswith("--config="):
            arg = "--config=" + _renamed_config(arg[len("--config="):], next(copies))
        out.append(arg)
        i += 1
    return _renamed_flags(out)


def _renamed(keys: dict[str, Any], *, source: str, line_of: Callable[[str], int]) -> dict[str, Any]:
    """``keys`` with the old names renamed (:func:`~lopd_lightning.deprecation.rename_keys`, once per key and
    process). Each warning is located where the user wrote the old key: ``source`` (a config file, or
    ``<command line>``) and ``line_of(old key)`` (its line in the file, its position on the command line).

    Raises:
        CLIError: (status 1) an old key and its new spelling are both in ``keys``.
    """
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            renamed = rename_keys(keys, where=MODEL_ARGS)
    except ValueError as error:
        raise CLIError(f"{source}: {error}", 1) from None
    for warning in caught:
        old = next((k for k in keys if f"{MODEL_ARGS}.{k} " in str(warning.message)), "")
        warnings.warn_explicit(str(warning.message), warning.category, filename=source, lineno=line_of(old))
    return renamed


def _line_in(text: str, key: str) -> int:
    """The 1-based line of ``text`` where ``key`` is first written as a YAML key (1 when not found)."""
    pattern = re.compile(rf"(^|[\s{{,]){re.escape(key)}\s*:")
    return next((n for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)), 1)


def _model_sections(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``model`` mappings of a config: top level, and under a subcommand (``fit: {model: ...}``)."""
    sections = [config.get("model")] + [(config.get(c) or {}).get("model") for c in ("fit", "validate", "test")
                                         if isinstance(config.get(c), dict)]
    return [s for s in sections if isinstance(s, dict) and isinstance(s.get("init_args"), dict)]


def _renamed_config(value: str, copy_folder: Path) -> str:
    """The config ``value`` (a file path or a YAML string) with its old keys renamed: a renamed copy of the
    file in ``copy_folder`` (created), the renamed YAML string, or ``value`` itself when it holds no old key
    (or is anything jsonargparse should report: a missing file, bad YAML)."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # a YAML string too long or odd to be a path
        is_file = False
    source = value if is_file else "the config given as text"
    try:
        text = path.read_text(encoding="utf-8") if is_file else value
        config = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return value  # jsonargparse reports it, with its own message
    if not isinstance(config, dict):
        return value
    sections = [s for s in _model_sections(config) if any(k in RENAMED_KEYS for k in s["init_args"])]
    if not sections:
        return value
    old_keys = {k for s in sections for k in s["init_args"] if k in RENAMED_KEYS}
    for section in sections:
        section["init_args"] = _renamed(section["init_args"], source=source, line_of=lambda key: _line_in(text, key))
    for old in sorted(old_keys):  # rename the key in the text, so that comments and number spellings stay
        text = re.sub(rf"(^|[\s{{,]){old}(\s*:)", rf"\g<1>{RENAMED_KEYS[old]}\g<2>", text, flags=re.M)
    if yaml.safe_load(text) != config:  # the old name is also a key elsewhere: write the renamed mapping out
        text = yaml.safe_dump(config, sort_keys=False)
    if not is_file:
        return text
    copy_folder.mkdir(parents=True, exist_ok=True)
    copy = copy_folder / path.name
    copy.write_text(text, encoding="utf-8")
    return str(copy)


def _renamed_flags(args: list[str]) -> list[str]:
    """``--model.init_args.<old>`` (and ``--model.<old>``) flags renamed to the new key."""
    matches = [_MODEL_FLAG.fullmatch(a) if a.startswith("--model.") else None for a in args]
    given = [m.group(1) for m in matches if m is not None]
    if not any(k in RENAMED_KEYS for k in given):
        return list(args)
    position = {m.group(1): n for n, m in reversed(list(enumerate(matches, 1))) if m is not None}
    _renamed(dict.fromkeys(given), source="<command line>", line_of=lambda key: position.get(key, 1))
    out = []
    for arg, m in zip(args, matches):
        if m is not None and m.group(1) in RENAMED_KEYS:
            start, end = m.span(1)
            arg = arg[:start] + RENAMED_KEYS[m.group(1)] + arg[end:]
        out.append(arg)
    return out
