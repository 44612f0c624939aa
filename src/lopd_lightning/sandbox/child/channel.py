"""The channel between the checker's and the candidate's processes (a pipe pair only these two hold): one JSON
object a line, arguments and results as plain data (:mod:`.codec`). The protocol is in the package's docstring
(:mod:`lopd_lightning.sandbox.child`).

:func:`_serve` is the candidate's side: it answers calls until the checker closes the channel. :class:`_Checker`
is the checker's side: ``candidate_function(name)`` of the checks; every breach of the protocol by the
candidate's process ends the checker at once with exit status ``PROTOCOL_EXIT``.
"""

from __future__ import annotations

import json
import os
import sys

from . import PROTOCOL_EXIT
from .codec import MAX_LINE, NotPlainData, encode, from_json

# The candidate's program runs in the process of _serve and may replace anything there (e.g. this module's
# ``encode``, through the frame of _serve): the checker trusts nothing it receives but plain data.


class _Lines:
    """Reads lines (at most ``cap`` bytes each) from a pipe fd."""

    def __init__(self, fd: int, cap: int = MAX_LINE):
        self.fd, self.cap, self.buffer = fd, cap, bytearray()

    def pending(self) -> bool:
        """True when a byte (or end of file) is waiting, without blocking."""
        import select

        return bool(self.buffer) or bool(select.select([self.fd], [], [], 0)[0])

    def readline(self):
        """The next line without its newline; None at end of file; raises OverflowError when longer
        than ``cap``."""
        start = 0
        while True:
            end = self.buffer.find(b"\n", start)
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[: end + 1]
                return line
            if len(self.buffer) > self.cap:
                raise OverflowError(f"a line longer than {self.cap} bytes")
            start = len(self.buffer)
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                return None
            self.buffer += chunk


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


def _builtin_exception_name(kind) -> str:
    """The name of the nearest built-in exception class of ``kind`` (``Exception`` at worst)."""
    import builtins

    for base in getattr(kind, "__mro__", ()):
        if getattr(builtins, getattr(base, "__name__", ""), None) is base:
            return base.__name__
    return "Exception"


def _serve(namespace: dict, lines: _Lines, wfd: int) -> None:
    """The candidate's side: answer the checker's calls (read from ``lines``) until it closes the
    channel."""

    def reply(message: dict) -> None:
        _write_all(wfd, json.dumps(message, ensure_ascii=True, separators=(",", ":")).encode() + b"\n")

    while True:
        line = lines.readline()
        if line is None:
            os._exit(0)
        request = json.loads(line)
        n = request["n"]
        name, args, kwargs = from_json(request["call"])
        function = namespace.get(name)
        if not callable(function):
            reply({"n": n, "fatal": f"the program does not define {name}"})
            os._exit(1)
        try:
            result = function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - sent to the checker, which raises it there
            try:
                message = str(error)[:2000]
            except Exception:  # noqa: BLE001
                message = ""
            reply({"n": n, "raise": [_builtin_exception_name(type(error)), message]})
            continue
        except BaseException as error:  # SystemExit, KeyboardInterrupt, GeneratorExit: no answer
            reply({"n": n, "fatal": f"{name} raised {type(error).__name__}"})
            os._exit(1)
        try:
            payload = encode(result)
        except NotPlainData as error:
            reply({"n": n, "fatal": f"{name} returned {error}"})
            os._exit(1)
        except (RecursionError, MemoryError, ValueError) as error:
            reply({"n": n, "fatal": f"{name} returned data that cannot be sent ({type(error).__name__})"})
            os._exit(1)
        _write_all(wfd, b'{"n":%d,"ok":%s}\n' % (n, payload.encode()))


class _Checker:
    """The checker's side of the channel: every breach by the candidate's process ends the checker."""

    def __init__(self, rfd: int, wfd: int):
        self.lines, self.wfd, self.n = _Lines(rfd), wfd, 0

    @staticmethod
    def fatal(why: str) -> None:
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001
            pass
        os.write(2, ("lopd checker: " + _one_line(why, 500) + "\n").encode("utf-8", "replace"))
        os._exit(PROTOCOL_EXIT)

    def send(self, message: bytes) -> None:
        try:
            _write_all(self.wfd, message)
        except BrokenPipeError:
            self.fatal(f"the candidate's process ended (or closed its channel) before call {self.n}")

    def call(self, name: str, args: tuple, kwargs: dict):
        self.n += 1
        n = self.n
        try:
            payload = encode([name, list(args), kwargs])
        except NotPlainData as error:
            self.fatal(f"call {n} of {name}: the checks pass {error}, which cannot be sent")
        if self.lines.pending():
            if not self.lines.buffer and not os.read(self.lines.fd, 1):
                self.fatal(f"the candidate's process ended (or closed its channel) before call {n}")
            self.fatal(f"the candidate's process wrote on its channel before call {n} was made")
        self.send(b'{"n":%d,"call":%s}\n' % (n, payload.encode()))
        try:
            line = self.lines.readline()
        except OverflowError:
            self.fatal(f"the answer to call {n} of {name} is longer than {self.lines.cap} bytes")
        if line is None:
            self.fatal(f"the candidate's process ended (or closed its channel) before answering call {n} of {name}")
        if self.lines.buffer:
            self.fatal(f"the candidate's process sent more than one answer to call {n} of {name}")
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            self.fatal(f"the answer to call {n} of {name} is not a valid message")
        if type(message) is not dict or len(message) != 2:
            self.fatal(f"the answer to call {n} of {name} is not a valid message")
        if message.get("n") != n:
            self.fatal(f"the candidate's process answered call {_one_line(repr(message.get('n')), 40)} "
                       f"when call {n} of {name} was made")
        if "ok" in message:
            try:
                return from_json(message["ok"])
            except (ValueError, RecursionError, MemoryError) as error:
                self.fatal(f"the answer to call {n} of {name} is not plain data: {error}")
        if "fatal" in message:
            self.fatal(f"call {n}: {message['fatal']}")
        if "raise" in message:
            raised = message["raise"]
            if type(raised) is list and len(raised) == 2 and all(type(x) is str for x in raised):
                raise _exception(*raised)
        self.fatal(f"the answer to call {n} of {name} is not a valid message")

    def function(self, name: str):
        """A proxy of the candidate's function ``name``."""

        def candidate(*args, **kwargs):
            return self.call(name, args, kwargs)

        candidate.__name__ = candidate.__qualname__ = name
        return candidate


def _exception(name: str, message: str) -> Exception:
    """The built-in exception ``name`` (an ``Exception`` subclass) with ``message``, else a RuntimeError."""
    import builtins

    kind = getattr(builtins, name, None) if name.isidentifier() else None
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError needs five arguments
            pass
    return RuntimeError(f"{name}: {message}")

