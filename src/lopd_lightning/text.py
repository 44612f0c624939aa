"""Text -> token ids when the text is data: message contents, tool output, references, traces.

Two rules hold wherever the project tokenises text with the policy's tokenizer:

1. Data cannot forge control tokens. A tool result, a reference solution or a retrieved trace that spells
   a special token (``</s>``, ``<|im_end|>``, ``<|im_start|>``) is tokenised as that text, never as the
   control token: otherwise the policy would read a turn boundary the template never wrote, and an SFT
   reference holding ``</s>`` would teach an EOS in mid-reply. Only the chat template's own markers are
   special. :func:`encode_data` tokenises data (``split_special_tokens=True``); :func:`encode_rendered`
   tokenises a rendered chat template whose message contents are data (``data_spans``).
2. Text always encodes. Model-written text reaches the tokenizer through tools and parsers, and a JSON
   escape such as ``"\\ud800"`` decodes to a lone UTF-16 surrogate that no UTF-8 tokenizer accepts
   (``UnicodeEncodeError``); :func:`encodable` replaces each one with U+FFFD, character for character, so
   that spans stay where they were. Both encoders apply it.

For text without special-token strings both encoders give exactly the ids of ``tokenizer.encode(text,
add_special_tokens=False)`` (with ``add_special_tokens=True``, of ``tokenizer(text)``).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["REPLACEMENT_CHARACTER", "encodable", "encode_data", "encode_rendered", "has_lone_surrogate",
           "special_token_strings", "spells_special_token"]

#: what :func:`encodable` writes in place of a lone surrogate.
REPLACEMENT_CHARACTER = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(text: str) -> bool:
    """True when ``text`` holds a UTF-16 surrogate code point (invalid Unicode: it cannot be UTF-8 encoded)."""
    return _SURROGATE.search(text) is not None


def encodable(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD (same length; other text untouched)."""
    return _SURROGATE.sub(REPLACEMENT_CHARACTER, text)


@dataclass(frozen=True)
class _Specials:
    """A tokenizer's special tokens: their strings (longest first), a pattern matching any of them, their
    first characters (a cheap pre-check), and their ids and strip flags by string."""

    strings: tuple[str, ...]
    pattern: re.Pattern[str] | None
    first_chars: frozenset[str]
    ids: dict[str, int]
    lstrip: frozenset[str]
    rstrip: frozenset[str]


_CACHE: weakref.WeakKeyDictionary[Any, tuple[int, _Specials]] = weakref.WeakKeyDictionary()


def _specials(tokenizer: Any) -> _Specials:
    """The special tokens of ``tokenizer`` (cached per tokenizer while its length is unchanged).

    Called for every encoded text, so the check costs one ``len(tokenizer)`` (under 1 us for a fast tokenizer,
    against some 40 us for the tokenisation): a tokenizer that gains tokens is read again. A token of the
    vocabulary made special afterwards leaves the length, and so the cache, as it was (no cheaper key sees it:
    ``added_tokens_decoder`` is built anew on each read).

    Raises:
        ValueError: the tokenizer tokenises a special token's text as the control token even with
            ``split_special_tokens=True`` (data could forge control tokens).
    """
    size = len(tokenizer)
    try:
        cached = _CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable: no cache
        cached = None
    if cached is not None and cached[0] == size:
        return cached[1]
    added = [t for t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t[1], "special", False)]
    strings = tuple(sorted({str(t.content) for _, t in added if str(t.content)}, key=lambda s: (-len(s), s)))
    info = _Specials(
        strings=strings,
        pattern=re.compile("|".join(map(re.escape, strings))) if strings else None,
        first_chars=frozenset(s[0] for s in strings),
        ids={str(t.content): int(i) for i, t in added},
        lstrip=frozenset(str(t.content) for _, t in added if getattr(t, "lstrip", False)),
        rstrip=frozenset(str(t.content) for _, t in added if getattr(t, "rstrip", False)),
    )
    if strings:
        probe = _split_encode(tokenizer, strings[0], add_special_tokens=False)
        if probe == [info.ids[strings[0]]]:
            raise ValueError(
                f"{type(tokenizer).__name__} tokenises the text {strings[0]!r} as its special token even with "
                "split_special_tokens=True: message contents could forge control tokens; use a tokenizer that "
                "supports split_special_tokens (any transformers fast tokenizer does)"
            )
    try:
        _CACHE[tokenizer] = (size, info)
    except TypeError:
        pass
    return info


def special_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The texts of the tokenizer's special (control) tokens, longest first (``added_tokens_decoder`` entries
    marked ``special``)."""
    return _specials(tokenizer).strings


def _split_encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """``tokenizer(text, split_special_tokens=True)`` ids: special-token strings in ``text`` as plain text."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True)["input_ids"])


def _spells_special(info: _Specials, text: str) -> bool:
    """Whether ``text`` contains a special token's string."""
    if info.pattern is None or not any(c in text for c in info.first_chars):
        return False
    return info.pattern.search(text) is not None


def spells_special_token(tokenizer: Any, text: str) -> bool:
    """Whether ``text`` contains the text of one of the tokenizer's special tokens (``</s>``, ``<|im_end|>``)."""
    return _spells_special(_specials(tokenizer), text)


def encode_data(tokenizer: Any, text: str, *, add_special_tokens: bool = False,
                max_length: int | None = None) -> list[int]:
    """Token ids of data text: special-token strings in it stay text, lone surrogates become U+FFFD.

    Args:
        tokenizer: a Hugging Face tokenizer (``split_special_tokens`` support is checked once).
        text: the data (a message content, a reference, a trace, a teacher's context).
        add_special_tokens: add the tokenizer's own BOS/EOS around it, as ``tokenizer(text)`` does.
        max_length: truncate to this many ids, as ``tokenizer(text, truncation=True, max_length=...)`` does
            (the added BOS/EOS kept); None: no limit.

    Returns:
        The ids; ``[]`` for "" without ``add_special_tokens``. For text without special-token strings, the
        ids of ``tokenizer(text, add_special_tokens=add_special_tokens)`` (truncated likewise).

    Raises:
        ValueError: the tokenizer cannot tokenise special-token strings as text (see :func:`special_token_strings`).
    """
    text = encodable(text)
    info = _specials(tokenizer)
    if not text and not add_special_tokens:
        return []
    options: dict[str, Any] = {"add_special_tokens": add_special_tokens}
    if max_length is not None:
        options.update(truncation=True, max_length=int(max_length))
    if _spells_special(info, text):  # else nothing to forge: the tokenizer's ordinary ids
        options["split_special_tokens"] = True
    return list(tokenizer(text, **options)["input_ids"])


def encode_rendered(tokenizer: Any, text: str, data_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
    """Token ids of a rendered chat template whose message contents (``data_spans``) are data.

    Outside the spans, special-token strings are the template's own markers and become their ids; inside,
    they are text (:func:`encode_data`'s rule). The text is cut only at the template's markers (where the
    tokenizer cuts anyway), so ids across a content's edges merge as in the whole text; a marker's
    ``lstrip``/``rstrip`` flags are honoured. No BOS/EOS is added.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the rendered text (or a piece of it).
        data_spans: ``[start, end)`` character spans of ``text`` that hold data (message contents); may be
            empty, unsorted, or reach outside ``text`` (clipped).

    Returns:
        The ids; for text whose spans spell no special token, exactly ``tokenizer.encode(text,
        add_special_tokens=False)``.

    Raises:
        ValueError: the tokenizer cannot tokenise special-token strings as text.
    """
    text = encodable(text)
    info = _specials(tokenizer)
    if not text:
        return []
    spans = [(max(a, 0), min(b, len(text))) for a, b in data_spans if min(b, len(text)) > max(a, 0)]
    if not any(_spells_special(info, text[a:b]) for a, b in spans):
        return list(tokenizer.encode(text, add_special_tokens=False))
    ids: list[int] = []
    start = 0
    strip_next = False
    for match in info.pattern.finditer(text):
        a, b = match.span()
        if any(a < e and s < b for s, e in spans):  # touches data: text, not a marker
            continue
        run = text[start:a]
        if strip_next:
            run = run.lstrip()
        if match.group() in info.lstrip:
            run = run.rstrip()
        ids += _split_encode(tokenizer, run, add_special_tokens=False) if run else []
        ids.append(info.ids[match.group()])
        start, strip_next = b, match.group() in info.rstrip
    run = text[start:].lstrip() if strip_next else text[start:]
    return ids + (_split_encode(tokenizer, run, add_special_tokens=False) if run else [])
