"""Introspection shared by the CLI and ``lopd export``: the parameters a config may set, an exception's chain."""

from __future__ import annotations

import inspect

__all__ = ["exception_chain", "init_parameters"]


def exception_chain(error: BaseException) -> list[BaseException]:
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
