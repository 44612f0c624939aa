"""Plain built-in data <-> one line of JSON, tagged so that tuple, list, set, frozenset, dict keys, bytes,
complex and big ints survive: the values that travel between the checker's and the candidate's processes
(:func:`lopd_lightning.sandbox.run_checked`). Standard library only: the trainer imports it as
:mod:`lopd_lightning.sandbox.child.codec`, the sandboxed child program from its own folder.

Only exact built-in types are plain: no subclass, no object with methods of its own, so nothing decoded can
override ``__eq__``; decoding is ``json.loads`` and the built-in constructors, never ``pickle``, ``marshal`` or
``eval``.
"""

from __future__ import annotations

import json

__all__ = ["MAX_DEPTH", "MAX_ITEMS", "MAX_LINE", "NotPlainData", "decode", "encode", "from_json"]

#: Plain data: deepest nesting, most values (scalars included), longest encoded line (bytes).
MAX_DEPTH = 100
MAX_ITEMS = 1_000_000
MAX_LINE = 16 << 20
#: Ints longer than this many bits travel as hex (decimal conversion is capped at 4300 digits).
_HEX_BITS = 10_000

_SCALARS = (type(None), bool, str, float)
_CONTAINER_TAGS = {tuple: "t", set: "s", frozenset: "f"}
_TAGS = ("t", "s", "f", "d", "b", "c", "i")


class NotPlainData(TypeError):
    """A value that is not plain built-in data, or past the depth or size bounds."""


def encode(value, *, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS) -> str:
    """One line of JSON for ``value``: None, bool, int, float (inf, nan and -0.0 too), complex, str,
    bytes, and list, tuple, set, frozenset and dict of them, at most ``max_depth`` deep and
    ``max_items`` values in all.

    Raises:
        NotPlainData: any other type (subclasses included), too deep or too many values.
    """
    count = 0

    def walk(v, depth):
        nonlocal count
        count += 1
        if count > max_items:
            raise NotPlainData(f"more than {max_items} values")
        kind = type(v)
        if kind in _SCALARS:
            return v
        if kind is int:
            return v if v.bit_length() <= _HEX_BITS else {"i": hex(v)}
        if kind is bytes:
            return {"b": v.hex()}
        if kind is complex:
            return {"c": [v.real, v.imag]}
        if kind in (list, tuple, set, frozenset, dict):
            if depth >= max_depth:
                raise NotPlainData(f"nested deeper than {max_depth}")
            if kind is dict:
                return {"d": [[walk(k, depth + 1), walk(x, depth + 1)] for k, x in v.items()]}
            items = [walk(x, depth + 1) for x in v]
            return items if kind is list else {_CONTAINER_TAGS[kind]: items}
        raise NotPlainData(f"a {kind!r}, not plain built-in data")

    return json.dumps(walk(value, 0), ensure_ascii=True, separators=(",", ":"), allow_nan=True)


def decode(text, *, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS):
    """The value of one line made by :func:`encode` (str or bytes). Only ``json.loads`` and the
    constructors of the built-in types run: nothing in the text can name code to run.

    Raises:
        ValueError: not such a line (bad JSON, an unknown tag, an unhashable set member or dict key,
            too deep, too many values).
    """
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth}") from None
    return from_json(data, max_depth=max_depth, max_items=max_items)


def from_json(data, *, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS):
    """The value of already parsed JSON in :func:`encode`'s tagged form (see :func:`decode`)."""
    count = 0

    def walk(v, depth):
        nonlocal count
        count += 1
        if count > max_items:
            raise ValueError(f"more than {max_items} values")
        kind = type(v)
        if kind in _SCALARS or kind is int:
            return v
        if kind is list or (kind is dict and len(v) == 1 and next(iter(v)) in ("t", "s", "f", "d")):
            if depth >= max_depth:
                raise ValueError(f"nested deeper than {max_depth}")
        if kind is list:
            return [walk(x, depth + 1) for x in v]
        if kind is not dict or len(v) != 1:
            raise ValueError(f"not a tagged value: {str(v)[:80]}")
        (tag, body), = v.items()
        if tag in ("t", "s", "f") and type(body) is list:
            items = [walk(x, depth + 1) for x in body]
            try:
                return tuple(items) if tag == "t" else set(items) if tag == "s" else frozenset(items)
            except TypeError as error:
                raise ValueError(f"bad set: {error}") from None
        if tag == "d" and type(body) is list:
            out = {}
            for pair in body:
                if type(pair) is not list or len(pair) != 2:
                    raise ValueError("bad dict item")
                key = walk(pair[0], depth + 1)
                try:
                    out[key] = walk(pair[1], depth + 1)
                except TypeError as error:
                    raise ValueError(f"bad dict key: {error}") from None
            return out
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
            return complex(body[0], body[1])
        if tag == "i" and type(body) is str and body.lstrip("-").startswith("0x"):
            return int(body, 16)
        raise ValueError(f"bad tagged value: {str(v)[:80]}")

    return walk(data, 0)

