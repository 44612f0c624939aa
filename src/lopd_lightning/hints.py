"""The did-you-mean hints of the one-line errors: the closest known name, and the names to choose from.

Two phrasings, one lookup (:func:`closest`, difflib's ratio): a value a config check refuses ends with
:func:`choose_one_of` (``model.init_args.embedder 'hashng' is not an embedder; did you mean 'hashing'? choose
one of minilm, backbone, hashing``), a name the CLI does not know with :func:`did_you_mean` (``unknown key
trainer.max_step ...; did you mean trainer.max_steps?``). This module imports nothing of the project, so any
package may use it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["choose_one_of", "closest", "did_you_mean"]


def closest(word: object, candidates: Iterable[object], *, cutoff: float = 0.6) -> str | None:
    """The candidate most like ``word`` (both as str; difflib's ratio at least ``cutoff``), or None when none is."""
    match = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1, cutoff=cutoff)
    return match[0] if match else None


def did_you_mean(word: object, candidates: Iterable[object], *, prefix: str = "", quote: bool = False) -> str:
    """``"; did you mean <prefix><closest>?"`` for :func:`closest` of ``candidates`` (``quote``: the closest in
    quotes, ``'<closest>'``, and no prefix), or ``""`` when none is close."""
    match = closest(word, candidates)
    if match is None:
        return ""
    return f"; did you mean {match!r}?" if quote else f"; did you mean {prefix}{match}?"


def choose_one_of(word: object, choices: Iterable[str]) -> str:
    """The fix for a value ``word`` that is none of ``choices``: ``"did you mean '<closest>'? choose one of a, b,
    c"``, without the question when none is close (:func:`closest`); ``choices`` listed in their order."""
    choices = list(choices)
    match = closest(word, choices)
    return f"{f'did you mean {match!r}? ' if match else ''}choose one of {', '.join(choices)}"
