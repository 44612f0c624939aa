"""The sandbox's child program: trusted code that runs first in every sandboxed process.

:mod:`lopd_lightning.sandbox` starts it by path (``python -s .../sandbox_child.py CONFIG``, the
configuration as JSON in ``argv[1]``, the program on stdin). It imports only the standard library,
never ``lopd_lightning`` or torch, and it only runs its :func:`main` when it is that ``__main__``: the
trainer and the tests import it for the plain-data codec (:func:`encode`, :func:`decode`).

What it does, in order (the promises are in :mod:`lopd_lightning.sandbox`):

1. reads the program from stdin to the end and replaces stdin with ``/dev/null``;
2. *stage 1*: as root, a private mount namespace in which the directories on the way to the
   interpreter that other users may not cross (``/root`` for ``/root/.pyenv``) are covered by a small
   tmpfs with only the interpreter's own directories bound back, read-only (so the one-off user id
   needs no capability to import its standard library), the ``cover`` paths (``hide=``) covered by
   nothing, every mount made read-only, then fresh size-limited tmpfs on the working directory,
   ``/tmp``, ``/var/tmp`` and ``/dev/shm``; an empty network namespace and an IPC namespace of its own;
   in every mode, the resource limits but the address space, and ``PR_SET_PDEATHSIG``;
3. with bubblewrap: stage 1 executes ``bwrap`` (new PID, IPC and UTS namespaces, a read-only view of
   the file system but the temporary directories, a fresh ``/dev`` and ``/proc``, the ``cover`` paths
   covered; when not root, also a user and network namespace and the trainer's home covered), which
   starts *stage 2* of this program (the program travels in a memfd on stdin);
4. the last stage drops to the one-off user id with no capability (root), sets ``PR_SET_PDEATHSIG``,
   the Python-level guards and the address-space limit, and runs the program in its *role*:

   * ``"program"``: the program as ``__main__`` (:func:`lopd_lightning.sandbox.run_code`);
   * ``"candidate"``: the program as module ``module`` (its functions), then answers calls from the
     checker process on its channel, one line per call, with results encoded as plain data;
   * ``"checker"``: made non-dumpable first (``PR_SET_DUMPABLE 0``: a same-uid process cannot trace it
     or read its memory), it runs the checks with ``candidate_function(name)`` in their globals: a
     proxy that sends the arguments to the candidate process and decodes its answer with
     :func:`decode` (``json.loads`` of a tagged encoding: never ``pickle``, ``marshal`` or ``eval``).
     Any breach of the protocol by the candidate process (an answer that is not plain data, garbage,
     an answer too long, an answer before the question, a closed channel) ends the checker at once
     with exit status 3 and a line ``lopd checker: <why>`` on stderr; an exception of the candidate's
     function is raised in the checks as its nearest built-in exception class (looked up by name in
     ``builtins``; a ``SystemExit`` or ``KeyboardInterrupt`` ends the run), else ``RuntimeError``.

The protocol on the channel (a pipe pair that only these two processes hold), one JSON object a line:
the checker first sends ``{"hello": 1}`` (after it made itself non-dumpable; the candidate's program
runs only after it); then ``{"n": N, "call": [name, args, kwargs]}`` (encoded), answered by
``{"n": N, "ok": value}``, ``{"n": N, "raise": [exception name, message]}`` or
``{"n": N, "fatal": why}``.
"""

from __future__ import annotations

import json
import os
import sys

#: Exit status when the limits could not be set up (the program never ran).
SETUP_FAILED_EXIT = 125
#: Exit status of the checker when the candidate's process broke the protocol.
PROTOCOL_EXIT = 3

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


# --------------------------------------------------------------------------------------------------
# The codec: plain built-in data <-> one line of JSON, tagged so that tuple/list/set/frozenset/dict
# keys/bytes/complex/big ints survive. Only exact built-in types are plain: no subclass, no object with
# methods of its own, so nothing decoded can override __eq__.
# --------------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------------
# The channel between the checker and the candidate.
# --------------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------------
# Set-up.
# --------------------------------------------------------------------------------------------------
def _guards(root):
    import builtins
    import io
    import posix

    root = os.path.realpath(root)
    realpath, join, fsdecode, fspath = os.path.realpath, os.path.join, os.fsdecode, os.fspath
    readlink = os.readlink

    def inside(p, dir_fd=None):
        if isinstance(p, int):
            return True
        try:
            p = fsdecode(fspath(p))
        except TypeError:
            return True
        if p == os.devnull:
            return True
        if dir_fd is not None and not p.startswith("/"):
            p = join(readlink("/proc/self/fd/%d" % dir_fd), p)
        p = realpath(p)
        return p == root or p.startswith(root + "/")

    def deny(what, p):
        raise PermissionError(13, "sandbox: %s outside the working directory is refused" % what, str(p))

    _open = io.open

    def open(file, mode="r", *args, **kwargs):  # noqa: A001
        if isinstance(mode, str) and any(c in mode for c in "wax+") and not inside(file):
            deny("writing", file)
        return _open(file, mode, *args, **kwargs)

    builtins.open = io.open = open
    _os_open = os.open
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & write_flags and not inside(path, dir_fd):
            deny("writing", path)
        return _os_open(path, flags, mode, dir_fd=dir_fd)

    os.open = posix.open = os_open

    def wrap(name, positions, keywords):
        real = getattr(os, name, None)
        if real is None:
            return

        def guarded(*args, **kwargs):
            fds = (kwargs.get("dir_fd"), kwargs.get("src_dir_fd"), kwargs.get("dst_dir_fd"))
            paths = [args[i] for i in positions if i < len(args)] + [kwargs[k] for k in keywords if k in kwargs]
            for p in paths:
                if not inside(p, next((f for f in fds if f is not None), None)):
                    deny(name, p)
            return real(*args, **kwargs)

        setattr(os, name, guarded)
        setattr(posix, name, guarded)

    for name in ("mkdir", "rmdir", "remove", "unlink", "chmod", "chown", "lchown", "truncate", "utime",
                 "mkfifo", "mknod"):
        wrap(name, (0,), ("path",))
    for name in ("rename", "replace", "link"):
        wrap(name, (0, 1), ("src", "dst"))
    wrap("symlink", (1,), ("dst",))

    def refuse(*args, **kwargs):
        raise PermissionError(1, "sandbox: starting processes is refused")

    for name in ("fork", "forkpty", "system", "popen", "execv", "execve", "execl", "execle", "execlp",
                 "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
                 "spawnle", "spawnlp", "spawnlpe", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, refuse)
        if hasattr(posix, name):
            setattr(posix, name, refuse)
    import _posixsubprocess

    _posixsubprocess.fork_exec = refuse


def _drop_privileges(libc, uid, read_search):
    import ctypes

    PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 8, 38
    if libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    CAP_DAC_READ_SEARCH = 2
    data[0].effective = data[0].permitted = (1 << CAP_DAC_READ_SEARCH) if read_search else 0
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        raise OSError("could become root again")


def _needed_paths(cfg) -> list[str]:
    """What the program needs to see: the interpreter's own directories (its prefixes, executable and
    import path, as the trainer found them: ``cfg["paths"]``) and this file's directory, outermost only."""
    paths = set(cfg["paths"]) | {os.path.dirname(os.path.realpath(__file__))}
    if not cfg["paths"]:  # the trainer could not ask the interpreter: what this process sees of itself
        paths |= {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
                  os.path.dirname(os.path.realpath(sys.executable))}
        paths.update(p for p in sys.path if p)
    out = []
    for p in paths:
        p = os.path.realpath(p)
        if os.path.exists(p) and p != cfg["tmp"]:
            out.append(p)
    out.sort()
    return [p for i, p in enumerate(out) if not any(p.startswith(q.rstrip("/") + "/") for q in out[:i])]


def _closed_ancestor(path: str) -> str | None:
    """The outermost directory on the way to ``path`` (``path`` included) that other users may not
    cross (no ``o+x``), or None."""
    import stat

    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        d = "/" + "/".join(parts[:i])
        try:
            st = os.stat(d)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
            return d
    return None


def _hide_closed_directories(libc, cfg) -> bool:
    """In the private mount namespace (root): cover each directory on the way to the interpreter that
    other users may not cross (``/root`` for ``/root/.pyenv``) with a small tmpfs, and bind the needed
    directories back read-only at their own paths. Returns True when every needed path is then readable
    by any user, so the one-off uid needs no CAP_DAC_READ_SEARCH."""
    import ctypes
    import stat

    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 0x1, 0x2, 0x4, 0x20, 0x1000, 0x4000
    needed = _needed_paths(cfg)
    if not cfg["private_tmp"]:
        needed.append(cfg["tmp"])  # no tmpfs for it: bind it back if it lies under a covered directory
    covers: dict[str, list[str]] = {}  # outermost closed directory -> the needed paths under it
    for p in needed:
        top = _closed_ancestor(p)
        if top is not None:
            covers.setdefault(top, []).append(p)
    for top, paths in sorted(covers.items()):
        binds = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC), os.path.isdir(p)) for p in sorted(paths)]
        if libc.mount(b"lopd-sandbox", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                      b"size=1m,nr_inodes=4096,mode=755") != 0:
            raise OSError(ctypes.get_errno(), "mount tmpfs on " + top)
        for p, fd, is_dir in binds:
            if is_dir:
                os.makedirs(p, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
                os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
            source = ("/proc/self/fd/%d" % fd).encode()
            if libc.mount(source, p.encode(), None, MS_BIND | MS_REC, None) != 0:
                raise OSError(ctypes.get_errno(), "bind " + p)
            os.close(fd)
            if p != cfg["tmp"]:
                libc.mount(None, p.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    for p in _needed_paths(cfg):
        try:
            mode = os.stat(p).st_mode
        except OSError:
            continue
        if not mode & stat.S_IROTH or (stat.S_ISDIR(mode) and not mode & stat.S_IXOTH):
            return False
    return True


def _cover(libc, cfg) -> None:
    """Cover each path of ``cfg["cover"]`` (the ``hide=`` of the run: e.g. the folder of the task's data)
    with nothing: a folder with an empty read-only tmpfs, a file with ``/dev/null`` bound read-only.
    Mounts made here are locked in any user namespace the program makes later: it can neither unmount
    them nor bind their parent without them."""
    import ctypes

    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
    flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
    for p in cfg.get("cover") or ():
        if os.path.islink(p) or not os.path.exists(p):
            continue  # not there in this namespace (e.g. under a covered root-only folder): nothing to see
        if os.path.isdir(p):
            if libc.mount(b"lopd-hidden", p.encode(), b"tmpfs", flags, b"size=4k,nr_inodes=2,mode=555") != 0:
                raise OSError(ctypes.get_errno(), "cannot hide " + p)
        else:
            if libc.mount(b"/dev/null", p.encode(), None, MS_BIND, None) != 0:
                raise OSError(ctypes.get_errno(), "cannot hide " + p)
            if libc.mount(None, p.encode(), None, MS_BIND | MS_REMOUNT | flags, None) != 0:
                raise OSError(ctypes.get_errno(), "cannot make read-only the cover of " + p)


def _mount_setattr(libc, path: str, *, set_attr: int = 0, clear_attr: int = 0, recursive: bool) -> int:
    """``mount_setattr(2)`` (Linux 5.12): 0, else the errno (ENOSYS on older kernels)."""
    import ctypes

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    SYS_mount_setattr, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000  # the same number on every architecture
    attr = MountAttr(set_attr, clear_attr, 0, 0)
    done = libc.syscall(SYS_mount_setattr, AT_FDCWD, path.encode(), AT_RECURSIVE if recursive else 0,
                        ctypes.byref(attr), ctypes.sizeof(attr))
    return 0 if done == 0 else ctypes.get_errno()


def _kept_flags(path: str) -> int:
    """The per-mount flags of the mount at ``path`` that a bind remount must keep (they may be locked)."""
    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 0x2, 0x4, 0x8, 0x400, 0x800, 0x200000
    got = os.statvfs(path).f_flag
    kept = got & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)  # ST_* == MS_* for these
    return kept | (MS_RELATIME if got & 0x1000 else 0)  # ST_RELATIME


def _read_only_everything(libc) -> None:
    """Make every mount of this (private) namespace read-only, so that the one-off uid can write nowhere
    but in the private tmpfs mounted afterwards: not in ``/run/lock``, ``/var/mail`` or any other
    world-writable directory or file of the host (device files such as ``/dev/null`` stay writable)."""
    import ctypes

    MS_RDONLY, MS_REMOUNT, MS_BIND, MOUNT_ATTR_RDONLY = 0x1, 0x20, 0x1000, 0x1
    error = _mount_setattr(libc, "/", set_attr=MOUNT_ATTR_RDONLY, recursive=True)
    if error == 0:
        return
    if error not in (38, 22):  # ENOSYS (Linux < 5.12), EINVAL: remount each mount by itself
        raise OSError(error, "mount_setattr(/, MOUNT_ATTR_RDONLY, AT_RECURSIVE)")
    with open("/proc/self/mountinfo", "rb") as f:
        points = [line.split()[4] for line in f if line.strip()]
    seen = set()
    for raw in points:
        point = raw.decode("utf-8", "surrogateescape")
        for code in ("\\040", "\\011", "\\012", "\\134"):
            point = point.replace(code, chr(int(code[1:], 8)))
        if point in seen:
            continue
        seen.add(point)
        try:
            flags = _kept_flags(point)
        except OSError:
            continue  # covered by a later mount, or gone
        if libc.mount(None, point.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags, None) != 0:
            raise OSError(ctypes.get_errno(), "remount read-only " + point)


def _writable_again(libc, path: str) -> None:
    """Bind ``path`` onto itself, writable (after :func:`_read_only_everything`): the host's directory
    when ``private_tmp=False``."""
    import ctypes

    MS_REMOUNT, MS_BIND, MOUNT_ATTR_RDONLY = 0x20, 0x1000, 0x1
    if libc.mount(path.encode(), path.encode(), None, MS_BIND, None) != 0:
        raise OSError(ctypes.get_errno(), "bind " + path)
    error = _mount_setattr(libc, path, clear_attr=MOUNT_ATTR_RDONLY, recursive=False)
    if error in (38, 22):
        error = 0
        if libc.mount(None, path.encode(), None, MS_BIND | MS_REMOUNT | _kept_flags(path), None) != 0:
            error = ctypes.get_errno()
    if error:
        raise OSError(error, "make writable " + path)


def _private_mounts(libc, cfg) -> bool:
    """A private mount namespace (root only): the closed directories covered (see
    :func:`_hide_closed_directories`), the ``hide=`` paths covered (:func:`_cover`), every mount made
    read-only (:func:`_read_only_everything`), then fresh, size-limited tmpfs on /tmp, /var/tmp, /dev/shm
    and the working directory (with ``private_tmp=False``: the host's ones, writable again), so that
    nothing the program writes outlives it or fills the host's disk.
    Returns True when the program needs no CAP_DAC_READ_SEARCH to import its standard library."""
    import ctypes

    CLONE_NEWNS, MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x20000, 0x2, 0x4, 0x4000, 0x40000
    if libc.unshare(CLONE_NEWNS) != 0:
        return False  # no privilege: the host's directories stay as they are
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    readable = _hide_closed_directories(libc, cfg)
    _cover(libc, cfg)
    tmp = cfg["tmp"]
    os.makedirs(tmp, exist_ok=True)  # e.g. under a covered root-only folder: made while it is writable
    _read_only_everything(libc)
    if cfg["private_tmp"]:
        opts = ("size=%d,nr_inodes=%d,mode=1777" % (cfg["disk"], cfg["inodes"])).encode()
        covered = False
        for d in ("/tmp", "/var/tmp", "/dev/shm", tmp):
            if d == tmp and covered:
                break
            if not os.path.isdir(d) or os.path.islink(d):
                continue
            if libc.mount(b"lopd-sandbox", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
                raise OSError(ctypes.get_errno(), "mount tmpfs on " + d)
            covered = covered or tmp.startswith(d + "/")
        os.makedirs(tmp, exist_ok=True)
        os.chmod(tmp, 0o700)
        if cfg["uid"] is not None:
            os.chown(tmp, cfg["uid"], cfg["uid"])
    else:
        for d in ("/tmp", "/var/tmp", "/dev/shm", tmp):
            if os.path.isdir(d) and not os.path.islink(d):
                _writable_again(libc, d)
    return readable


def _limit(which, soft, hard=None):
    import resource as R

    hard = soft if hard is None else hard
    cur_soft, cur_hard = R.getrlimit(which)
    if cur_hard != R.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    R.setrlimit(which, (soft, hard))


def _read_program() -> bytes:
    chunks = []
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return b"".join(chunks)


def _stage1(libc, cfg) -> None:
    """Namespaces and limits that need the trainer's privilege (root) or hold across bubblewrap."""
    import resource as R

    tmp = cfg["tmp"]
    cfg["read_search"] = bool(cfg["read_search"])
    if cfg["uid"] is not None and _private_mounts(libc, cfg):
        cfg["read_search"] = False
    if cfg["net"] and cfg["uid"] is not None:
        libc.unshare(0x40000000)  # CLONE_NEWNET; without the privilege the network stays as it is
    if cfg["uid"] is not None:
        # CLONE_NEWIPC: System V shared memory, semaphores and message queues of its own, gone with it
        # (they would outlive the run and its one-off uid); without the privilege they stay the host's
        libc.unshare(0x08000000)
    os.chdir(tmp)
    _limit(R.RLIMIT_CORE, 0)
    _limit(R.RLIMIT_FSIZE, cfg["fsize"])
    _limit(R.RLIMIT_NOFILE, 256)
    _limit(R.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1)
    if cfg["nproc"] is not None:
        _limit(R.RLIMIT_NPROC, cfg["nproc"])
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != cfg["ppid"]:
        os._exit(137)  # the trainer is already gone


def _bwrap_argv(cfg) -> list[str]:
    """The bubblewrap command line that runs stage 2 of this program (see the module docstring)."""
    root = cfg["uid"] is not None
    tmp = cfg["tmp"]
    argv = [cfg["bwrap"], "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try"]
    if cfg.get("info_fd") is not None:  # bwrap tells the trainer its namespace there, then closes it
        argv += ["--info-fd", str(cfg["info_fd"])]
    if not root:  # bwrap makes a user namespace (the trainer's uid inside) and drops every capability
        argv += ["--unshare-user", "--disable-userns"]
        if cfg["net"]:
            argv += ["--unshare-net"]
    argv += ["--ro-bind", "/", "/"]
    if not root:
        hidden = [d for d in cfg["hide"] if os.path.isdir(d) and not os.path.islink(d)]
        for d in hidden:
            argv += ["--tmpfs", d]
        for p in _needed_paths(cfg):
            if any(p == d or p.startswith(d + "/") for d in hidden):
                argv += ["--ro-bind", p, p]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if not os.path.isdir(d) or os.path.islink(d):
            continue
        if cfg["private_tmp"] and not root:
            argv += ["--size", str(cfg["disk"]), "--tmpfs", d]
        else:  # root: stage 1's private tmpfs; private_tmp=False: the host's directory, writable again
            argv += ["--bind", d, d]
    argv += ["--bind", tmp, tmp, "--chdir", tmp]
    for p in cfg.get("cover") or ():  # hide=: last, over whatever was bound back above
        if os.path.islink(p) or not os.path.exists(p):
            continue
        if os.path.isdir(p):
            argv += ["--size", "4096", "--tmpfs", p, "--remount-ro", p]
        else:
            argv += ["--ro-bind", "/dev/null", p]
    stage2 = dict(cfg, stage=2)
    return argv + ["--", sys.executable, "-s", os.path.realpath(__file__), json.dumps(stage2)]


def _exec_bwrap(cfg, source: bytes) -> None:
    fd = os.memfd_create("program", 0)  # not close-on-exec: it becomes stage 2's stdin
    _write_all(fd, source)
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)
    argv = _bwrap_argv(cfg)
    os.execv(argv[0], argv)


def _confine(libc, cfg) -> None:
    """The last steps before the program: one-off uid, death signal, guards, address-space limit."""
    import resource as R

    if cfg["role"] == "checker":
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    if cfg["uid"] is not None:
        _drop_privileges(libc, cfg["uid"], cfg["read_search"])
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL (after the uid change, which clears it)
    if cfg["role"] == "checker":
        libc.prctl(4, 0, 0, 0, 0)  # again: a change of uid resets it to fs.suid_dumpable
    if cfg["stage"] == 1 and os.getppid() != cfg["ppid"]:
        os._exit(137)
    if cfg["guards"]:
        _guards(cfg["tmp"])
    _limit(R.RLIMIT_AS, cfg["as"])


def _run(cfg, source: bytes) -> None:
    import types

    role = cfg["role"]
    channel = cfg.get("channel")
    if role == "candidate":
        requests = _Lines(channel[0])
        hello = requests.readline()  # the checker is non-dumpable before this comes
        if hello != b'{"hello":1}':
            os._exit(0)
    elif role == "checker":
        checker = _Checker(channel[0], channel[1])
        checker.send(b'{"hello":1}\n')
    name = cfg.get("module") or "__main__"
    module = types.ModuleType(name)
    module.__builtins__ = __builtins__
    if role == "checker":
        module.candidate_function = checker.function
    sys.modules[name] = module
    if name != "__main__":
        sys.modules["__main__"] = module
    sys.argv[:] = ["<sandbox>"]
    try:
        code = compile(source, "<sandbox>", "exec")
        del source
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        raise SystemExit(1)
    if role == "candidate":
        _serve(module.__dict__, requests, channel[1])
    elif role == "checker":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main() -> None:
    """The child's entry point: read the run's settings (JSON, ``sys.argv[1]``: role, limits, mounts,
    uid), set the limits and isolation up, then run the candidate's program or the checker. Exits with
    ``SETUP_FAILED_EXIT`` (125) when the limits cannot be set (the program never runs)."""
    cfg = json.loads(sys.argv[1])
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if cfg["role"] == "checker":
            libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0, before anything else
        source = _read_program()
        here = os.path.dirname(os.path.realpath(__file__))
        sys.path[:] = [p for p in sys.path if p not in ("", ".", cfg["tmp"], here)]
        if cfg["stage"] == 1:
            _stage1(libc, cfg)
            if cfg["bwrap"]:
                _exec_bwrap(cfg, source)
        _confine(libc, cfg)
    except BaseException as exc:
        os.write(2, ("lopd sandbox: setup failed: %r\n" % (exc,)).encode())
        os._exit(SETUP_FAILED_EXIT)
    _run(cfg, source)


if __name__ == "__main__":
    main()
