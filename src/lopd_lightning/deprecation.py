"""Deprecated spellings that keep working for one release: renamed arguments and config keys, moved names.

Every rename warns once per process (a ``FutureWarning``, shown by default) and names the new spelling;
the old spelling is removed in the release after next. ``CHANGELOG.md`` lists every rename.

* :data:`RENAMED_KEYS` lists every renamed constructor argument of the method modules (old -> new, the
  config key ``model.init_args.<old>``); readers of stored hyperparameters and configs (``lopd export``,
  ``benchmarks/compare.py``) rename with :func:`rename_keys`.
* A method module keeps each old name of its own constructor as a keyword-only parameter, default None,
  documented as deprecated, and folds it into the new one with :func:`fold_renamed` before calling
  ``super().__init__``; the class lists those names in its ``RENAMED_ARGUMENTS`` (read, with its bases',
  by :func:`renamed_arguments`; :func:`store_under_new_names` keeps them out of the hyperparameters).
  Being real parameters, the old names work wherever a constructor is called: Python, a subclass's
  ``super().__init__(...)``, ``load_from_checkpoint`` of an old checkpoint, and every config jsonargparse
  reads (included files and the command line too).
* :func:`renamed_kwargs` renames the keywords of a function.
* :func:`moved_names` gives a module the ``__getattr__`` that serves a name that now lives elsewhere.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TypeVar

__all__ = [
    "RENAMED_KEYS",
    "fold_renamed",
    "moved_names",
    "rename_keys",
    "renamed_arguments",
    "renamed_kwargs",
    "store_under_new_names",
    "warn_once",
]

F = TypeVar("F", bound=Callable[..., Any])

#: old constructor argument -> new one, over all method modules (config key ``model.init_args.<old>``); each
#: class accepts only its own (``RENAMED_ARGUMENTS``): ``top_m`` is LOPD's, ``jsd_alpha`` SDPO's.
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

    For functions only: a method module's constructor keeps its old names as deprecated parameters
    (:func:`fold_renamed`), which adds no stack frame between nested ``__init__`` calls (Lightning's
    ``save_hyperparameters`` walks those frames) and shows the old names in ``--help``.
    """

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if any(old in kwargs for old in renames):
                kwargs = rename_keys(kwargs, where=func.__name__, renames=renames, stacklevel=4)
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


#: Where a deprecation warning is not attributed: this package and the frameworks that call constructors
#: for the user (Lightning's ``load_from_checkpoint``, LightningCLI, jsonargparse).
_NOT_THE_USER = ("lopd_lightning.", "lightning.", "lightning_fabric.", "pytorch_lightning.", "jsonargparse.")


def _user_stacklevel(frame: Any) -> int:
    """``warn_once``'s ``stacklevel`` that attributes a warning issued by a function whose caller's frame
    is ``frame`` to the first frame outside :data:`_NOT_THE_USER` (the user's line; ``frame`` itself
    when every frame is inside)."""
    level, outer = 3, frame
    while outer is not None and str(outer.f_globals.get("__name__", "")).startswith(_NOT_THE_USER):
        outer, level = outer.f_back, level + 1
    return 3 if outer is None else level


def fold_renamed(owner: str, old_name: str, old_value: Any, new_name: str, new_value: Any, default: Any) -> Any:
    """The value of constructor argument ``new_name`` when its deprecated spelling ``old_name`` may be given.

    A constructor that keeps ``old_name`` as a keyword-only parameter (default None) calls this before
    ``super().__init__`` and rebinds ``new_name`` to the result, so that the constructors above it, and
    Lightning's ``save_hyperparameters`` (which reads their frames), see the new value.

    Args:
        owner: the class being built (``type(self).__name__``), for the messages.
        old_value: the deprecated parameter's value; None: not given.
        new_value: the new parameter's value. jsonargparse and ``load_from_checkpoint`` pass every
            argument, defaults included, so ``new_value == default`` counts as not given; and
            ``new_value == old_value`` is no conflict (``load_from_checkpoint`` of a subclass that passes
            the old name to ``super().__init__`` gives both, equal).
        default: ``new_name``'s default in the signature of the constructor that calls this.

    Returns:
        ``new_value`` when ``old_value`` is None, else ``old_value``, with a ``FutureWarning`` once per
        process and ``owner.old_name`` naming the new spelling, attributed to the user's line (the
        first caller outside this package, Lightning and jsonargparse).

    Raises:
        ValueError: both spellings are given with different values (``old_value`` is not None and
            ``new_value`` is neither ``default`` nor ``old_value``); the message names both, as
            attributes and as config keys.
    """
    if old_value is None:
        return new_value
    if new_value != default and new_value != old_value:
        raise ValueError(
            f"{owner}.{old_name} and {owner}.{new_name} are the same setting (config keys "
            f"model.init_args.{old_name} and model.init_args.{new_name}), given {old_value!r} and "
            f"{new_value!r}; keep only {new_name}"
        )
    warn_once(
        f"{owner}.{old_name}",
        f"{owner}.{old_name} is deprecated and will be removed; use {owner}.{new_name} "
        f"(config key model.init_args.{new_name})",
        stacklevel=_user_stacklevel(sys._getframe(1)),
    )
    return old_value


def renamed_arguments(cls: type) -> dict[str, str]:
    """old -> new for the deprecated constructor parameters of ``cls`` and its bases: the union of the
    ``RENAMED_ARGUMENTS`` class attributes along its MRO ({} for a class without any)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        out.update(vars(klass).get("RENAMED_ARGUMENTS", {}))
    return out


def store_under_new_names(hparams: MutableMapping[str, Any], cls: type) -> None:
    """Rename, in place, the deprecated argument names of ``cls`` (:func:`renamed_arguments`) in ``hparams``
    (a module's hyperparameters): a value given under an old name (not None) is stored under the new one,
    and the old name is dropped, unless a subclass outside this package declares it as a parameter of its
    own (its checkpoint then reloads: ``load_from_checkpoint`` passes it back with the equal new value)."""
    renames = renamed_arguments(cls)
    if not renames:
        return
    ours = next(k for k in cls.__mro__ if "RENAMED_ARGUMENTS" in vars(k))
    own = {name for k in cls.__mro__ if issubclass(k, ours) and "__init__" in vars(k)
           and not k.__module__.startswith("lopd_lightning.") for name in inspect.signature(k.__init__).parameters}
    for old, new in renames.items():
        if hparams.get(old) is not None:
            hparams[new] = hparams[old]
        if old not in own:
            hparams.pop(old, None)


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
