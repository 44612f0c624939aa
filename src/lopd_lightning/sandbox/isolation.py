"""What isolation this machine gives, asked once per process: bubblewrap, a one-off user id (root), a mount
namespace; the isolation mode they make (:func:`_mode_name`, see :mod:`lopd_lightning.sandbox`); and what a
sandboxed process must see of the file system (the interpreter's directories) or must not (``hide=``, the
trainer's home directories under bubblewrap).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading

from lopd_lightning.sandbox.procs import _proc_table

__all__ = ["BWRAP_ENV", "bwrap_available"]

#: Set to 0 (or no/false/off) to never use bubblewrap, even when it is installed (``bwrap=None``).
BWRAP_ENV = "LOPD_SANDBOX_BWRAP"

#: The whole environment of a sandboxed process (with ``HOME`` and ``TMPDIR``: its working directory).
_CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


# --------------------------------------------------------------------------------------------------
# Bubblewrap: probed once per process.
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _bwrap_probe() -> str | None:
    """The path of a ``bwrap`` that works here with the options the sandbox uses, else None."""
    if sys.platform != "linux":
        return None
    path = shutil.which("bwrap", path=os.pathsep.join([os.environ.get("PATH", ""), _CHILD_ENV["PATH"]]))
    if path is None:
        return None
    true = shutil.which("true", path=_CHILD_ENV["PATH"]) or "/bin/true"
    argv = [path, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try"]
    if os.geteuid() != 0:
        argv += ["--unshare-user", "--disable-userns", "--unshare-net"]
    argv += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--size", str(1 << 20), "--tmpfs",
             "/tmp", "--", true]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=dict(_CHILD_ENV), timeout=20, close_fds=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return path if done.returncode == 0 else None


def bwrap_available() -> bool:
    """True when bubblewrap is installed and works here with the sandbox's options (probed once per
    process; ``LOPD_SANDBOX_BWRAP=0`` does not change this answer, only whether runs use it)."""
    return _bwrap_probe() is not None


def _bwrap_for(requested: bool | None) -> str | None:
    """The bwrap to use for a run given its ``bwrap=`` option (see :class:`SandboxLimits`); None: none."""
    if requested is False:
        return None
    if requested is None and os.environ.get(BWRAP_ENV, "").strip().lower() in ("0", "no", "false", "off"):
        return None
    path = _bwrap_probe()
    if path is None and requested:
        raise RuntimeError("bwrap=True, but bubblewrap (`bwrap`) is not installed or does not work here")
    return path


# --------------------------------------------------------------------------------------------------
# The modes.
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _mount_namespace_works() -> bool:
    """True when this (root) trainer can make a mount namespace (asked once, in a throw-away process)."""
    probe = "import ctypes, sys\nsys.exit(0 if ctypes.CDLL(None).unshare(0x20000) == 0 else 1)\n"
    try:
        done = subprocess.run([sys.executable, "-S", "-c", probe], stdin=subprocess.DEVNULL,
                              capture_output=True, env=dict(_CHILD_ENV), timeout=60, close_fds=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _mode_name(tool: str | None, *, user_switch: bool | None = None, mount_ns: bool | None = None) -> str:
    """The isolation mode of a run: "bwrap" (``tool``: the bwrap to use), else "namespaces+uid", "uid-only"
    or "process-only", from whether the trainer can switch user and make a mount namespace (asked here when
    not given)."""
    if tool:
        return "bwrap"
    if user_switch is None:
        user_switch = _uid_range() is not None
    if not user_switch:
        return "process-only"
    if mount_ns is None:
        mount_ns = _mount_namespace_works()
    return "namespaces+uid" if mount_ns else "uid-only"


@functools.lru_cache(maxsize=1)
def _uid_range() -> tuple[int, int] | None:
    """[low, high) of user ids to pick from; None when the trainer cannot switch user (not root).

    Ids from 100000 up when this user namespace maps them (a full map on a VM or a root container), else
    from 20000 up within the largest mapped range (e.g. 0..65535 in a user-namespaced container).
    """
    if sys.platform != "linux" or os.geteuid() != 0:
        return None
    best = None
    try:
        with open("/proc/self/uid_map") as f:
            ranges = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    except OSError:
        return None
    for inside, _outside, count in ranges:
        end = min(inside + count, 2**31 - 1)
        lo = max(inside, 100_000) if end - max(inside, 100_000) >= 1000 else max(inside, 20_000)
        if end - lo >= 1000 and (best is None or end - lo > best[1] - best[0]):
            best = (lo, end)
    return best


# Fresh user ids for the child (root only): random, never one in use by a live process or a claimed run.
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _claim_uid() -> int | None:
    """A fresh user id for one sandboxed process (None when not root); release it with :func:`_release_uid`."""
    rng = _uid_range()
    if rng is None:
        return None
    lo, hi = rng
    with _uid_lock:
        live = {row[5] for row in _proc_table()}
        for _ in range(100):
            uid = lo + secrets.randbelow(hi - lo)
            if uid not in _uids_in_use and uid not in live:
                _uids_in_use.add(uid)
                return uid
    raise RuntimeError("sandbox: could not find a free user id")


def _release_uid(uid: int | None) -> None:
    if uid is not None:
        with _uid_lock:
            _uids_in_use.discard(uid)


# --------------------------------------------------------------------------------------------------
# The file system a sandboxed process sees.
# --------------------------------------------------------------------------------------------------
_PATHS_PROGRAM = (
    "import json, os, sys\n"
    "paths = {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix, "
    "os.path.dirname(os.path.realpath(sys.executable))}\n"
    "paths.update(p for p in sys.path if p)\n"
    "print(json.dumps(sorted(paths)))\n"
)


@functools.lru_cache(maxsize=8)
def _interpreter_paths(python: str) -> tuple[str, ...]:
    """The directories ``python`` imports from (prefixes, executable, ``sys.path``), as it sees them in
    the child's clean environment; asked once per interpreter. Under a covered directory (see
    :mod:`lopd_lightning.sandbox.child.mounts`), only these are bound back."""
    try:
        done = subprocess.run([python, "-s", "-c", _PATHS_PROGRAM], stdin=subprocess.DEVNULL,
                              capture_output=True, env=dict(_CHILD_ENV, HOME="/nonexistent"), cwd="/",
                              timeout=60, close_fds=True)
        paths = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return ()
    return tuple(os.path.realpath(p) for p in paths if isinstance(p, str) and p.startswith("/"))


@functools.lru_cache(maxsize=8)
def _needs_read_search(python: str) -> bool:
    """True unless ``python`` is this interpreter and everything it imports from (its executable, its
    prefixes, ``sys.path``) is readable by any user: then the one-off uid needs no CAP_DAC_READ_SEARCH."""
    import stat

    if os.path.realpath(python) != os.path.realpath(sys.executable):
        return True  # another interpreter: its files are unknown, keep the capability
    paths = {os.path.realpath(sys.executable), sys.prefix, sys.base_prefix, sys.exec_prefix}
    paths.update(p for p in sys.path if p and os.path.exists(p))
    for path in paths:
        path = os.path.realpath(path)
        try:
            mode = os.stat(path).st_mode
            if not mode & stat.S_IROTH or (stat.S_ISDIR(mode) and not mode & stat.S_IXOTH):
                return True
            parent = os.path.dirname(path)
            while True:
                if not os.stat(parent).st_mode & stat.S_IXOTH:
                    return True
                if parent == os.path.dirname(parent):
                    break
                parent = os.path.dirname(parent)
        except OSError:
            continue
    return False


def _home_directories() -> list[str]:
    """The trainer's home directories (covered by a tmpfs under bubblewrap when it is not root)."""
    homes = set()
    try:
        import pwd

        homes.add(pwd.getpwuid(os.getuid()).pw_dir)
    except (ImportError, KeyError):
        pass
    homes.add(os.path.expanduser("~"))
    return sorted(os.path.realpath(h) for h in homes if h and os.path.realpath(h) != "/")


def _hidden(hide) -> tuple[str, ...]:
    """The paths of a ``hide=`` option, absolute and with symbolic links resolved (a mount covers the real
    location), those that exist, each once."""
    if hide is None:
        return ()
    if isinstance(hide, (str, bytes, os.PathLike)):
        hide = [hide]
    out: list[str] = []
    for p in hide:
        real = os.path.realpath(os.path.abspath(os.fsdecode(p)))
        if real != "/" and os.path.exists(real) and real not in out:
            out.append(real)
    return tuple(out)
