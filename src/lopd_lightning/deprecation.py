"""Deprecated spellings that keep working for one release: renamed arguments and config keys, moved names.

Every rename warns once per process (a ``FutureWarning``, shown by default) and names the new spelling;
the old spelling is removed in the release after next. ``CHANGELOG.md`` lists every rename.

* :data:`RENAMED_KEYS` maps an old constructor argument (``model.init_args.<old>`` in a config) to its
  new name; the metaclass :class:`RenamedArguments` applies it to every method module's constructor call
  (``OnPolicyModule`` and its subclasses, ``load_from_checkpoint`` of an old checkpoint included),
  ``lopd_lightning.cli`` to a config file and the command line.
* :func:`renamed_kwargs` renames the keywords of a function.
* :func:`moved_names` gives a module the ``__getattr__`` that serves a name that now lives elsewhere.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["RENAMED_KEYS", "RenamedArguments", "moved_names", "rename_keys", "renamed_kwargs", "warn_once"]

F = TypeVar("F", bound=Callable[..., Any])

#: old constructor argument -> new one, for every method module (config key ``model.init_args.<old>``).
RENAMED_KEYS: dict[str, str] = {
    "rollouts_per_example": "group_size",  # GRPO's G, the field's name
    "top_m": "distill_top_k",  # LOPD's M, the top-k support of the distillation divergence
    "top_k_distill": "distill_top_k",  # SDPO's and OPSD's name for the same thing
    "jsd_alpha": "jsd_beta",  # SDPO's name of the generalized JSD's interpolation (GKD: beta)
}

_warned: set[str] = set()


def warn_once(key: str, message: str, *, stacklevel: int = 3) -> None:
    """Issue ``message`` as a ``FutureWarning`` the first time ``key`` is seen in this process.

    ``stacklevel`` counts from the caller of ``warn_once`` as ``warnings.warn``'s does from its caller plus
    one (the default 3 attributes the warning to the caller of the function that called ``warn_once``).
    """
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, FutureWarning, stacklevel=stacklevel)


def rename_keys(
    values: Mapping[str, Any], *, where: str, renames: Mapping[str, str] = RENAMED_KEYS, stacklevel: int = 4
) -> dict[str, Any]:
    """``values`` with every old key of ``renames`` replaced by its new one (warning once per key).

    Args:
        values: keyword arguments or a config mapping.
        where: how the user spelled the parent, for the message (``"model.init_args"``, ``"LOPDModule"``).

    Raises:
        ValueError: both the old and the new spelling are given.
    """
    out = dict(values)
    for old, new in renames.items():
        if old not in out:
            continue
        if new in out:
            raise ValueError(f"{where}.{old} and {where}.{new} are the same setting; keep only {where}.{new}")
        warn_once(f"{where}.{old}", f"{where}.{old} is deprecated and will be removed; use {where}.{new}",
                  stacklevel=stacklevel)
        out[new] = out.pop(old)
    return out


def renamed_kwargs(renames: Mapping[str, str]) -> Callable[[F], F]:
    """Decorate a function so that the old keyword names of ``renames`` (old -> new) still work, warning once.

    For functions only: a class's constructor uses :class:`RenamedArguments`, which adds no stack frame
    between nested ``__init__`` calls (Lightning's ``save_hyperparameters`` walks those frames).
    """

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if any(old in kwargs for old in renames):
                kwargs = rename_keys(kwargs, where=func.__name__, renames=renames, stacklevel=4)
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


class RenamedArguments(type):
    """Metaclass whose constructor calls accept the old argument names of :data:`RENAMED_KEYS`.

    ``Cls(rollouts_per_example=4)`` becomes ``Cls(group_size=4)`` with one ``FutureWarning``; giving both
    spellings raises ValueError. The renaming happens before ``__init__`` runs, so the constructors (and
    Lightning's ``save_hyperparameters``, which reads their frames) only ever see the new names. A subclass
    that passes an old name on to ``super().__init__(...)`` must use the new one.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if any(old in kwargs for old in RENAMED_KEYS):
            kwargs = rename_keys(kwargs, where=cls.__name__, stacklevel=4)
        return super().__call__(*args, **kwargs)


def moved_names(module_name: str, moves: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving names that moved: ``moves`` maps an old name to ``"pkg.mod:name"``.

    Use as ``__getattr__ = moved_names(__name__, {"old": "lopd_lightning.new:New"})``; the first access
    of each old name warns once. Unknown names raise AttributeError as usual.
    """

    def __getattr__(name: str) -> Any:
        target = moves.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        path, _, attr = target.partition(":")
        warn_once(f"{module_name}.{name}", f"{module_name}.{name} moved to {path}.{attr}; import it from there")
        return getattr(importlib.import_module(path), attr)

    return __getattr__
