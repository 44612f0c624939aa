"""One sandboxed process as the trainer holds it (:class:`_Child`): its private working directory, its one-off
user id, the child program started with the run's settings, its captured output, and its clean-up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from lopd_lightning.sandbox import child as _child_package
from lopd_lightning.sandbox.isolation import (
    _CHILD_ENV,
    _claim_uid,
    _home_directories,
    _interpreter_paths,
    _needs_read_search,
    _release_uid,
)
from lopd_lightning.sandbox.limits import SandboxLimits
from lopd_lightning.sandbox.procs import _kill_everything, _user_tasks
from lopd_lightning.sandbox.results import SandboxResult, _classify

#: The child program, run by path (:mod:`lopd_lightning.sandbox.child`: standard library only).
_CHILD = os.path.join(os.path.dirname(os.path.abspath(_child_package.__file__)), "__main__.py")


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
        """What was kept, decoded (UTF-8, ``errors="replace"``), with a one-line marker where bytes were cut."""
        if self.total <= self.cap:
            return bytes(self.head).decode("utf-8", errors="replace")
        keep_tail = self.cap // 2
        keep_head = self.cap - keep_tail
        rest = bytes(self.head[keep_head:]) + bytes(self.tail)
        tail = rest[len(rest) - keep_tail :] if keep_tail else b""
        cut = self.total - keep_head - len(tail)
        marker = f"\n...[lopd sandbox: {cut} bytes cut]...\n".encode()
        return (bytes(self.head[:keep_head]) + marker + tail).decode("utf-8", errors="replace")


class _Child:
    """One sandboxed process: its working directory, one-off uid, the process and its captured output.

    Args:
        role: "program", "candidate" or "checker" (see :mod:`lopd_lightning.sandbox.child`).
        code: the program's source (sent on the child's stdin by
            :func:`~lopd_lightning.sandbox.supervise._supervise`).
        limits: the run's limits. bwrap: the bwrap to run under, or None.
        module: the module name the candidate's program runs as. channel: the child's (read, write) fds
            of the checker-candidate channel. cover: the paths of ``hide=`` (resolved).
    """

    def __init__(self, role: str, code: str, limits: SandboxLimits, *, bwrap: str | None,
                 module: str | None = None, channel: tuple[int, int] | None = None, cover: tuple[str, ...] = ()):
        self.role, self.limits, self.bwrap = role, limits, bwrap
        self.data = code.encode("utf-8", errors="surrogatepass")
        self.proc: subprocess.Popen | None = None
        self.uid: int | None = None
        self.returncode: int | None = None
        self.rusage = None
        self.exited_itself = False
        self.exit_status: int | None = None
        self.out, self.err = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
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
            nproc = self._nproc()
            os.chmod(self.tmp, 0o700)
            cfg = self._settings(nproc, module=module, channel=channel, cover=cover, info_w=info_w)
            self.proc = self._start(cfg, pass_fds=(*(channel or ()), *(() if info_w is None else (info_w,))))
        except BaseException:
            self.cleanup()
            raise
        finally:
            if info_w is not None:
                os.close(info_w)

    def _nproc(self) -> int | None:
        """RLIMIT_NPROC of the child: ``max_processes`` for a one-off uid; else the user's current task count
        plus it (the kernel counts all of the user's tasks); None off Linux."""
        if self.uid is not None:
            return int(self.limits.max_processes)
        if sys.platform == "linux":
            return _user_tasks(os.getuid()) + int(self.limits.max_processes)
        return None

    def _settings(self, nproc: int | None, *, module, channel, cover, info_w) -> dict:
        """The run's settings as the child program reads them (JSON, ``argv[1]``)."""
        limits, bwrap = self.limits, self.bwrap
        return {
            "role": self.role,
            "stage": 1,
            "tmp": self.tmp,
            "uid": self.uid,
            "ppid": os.getpid(),
            "net": bool(limits.isolate_network),
            "guards": bool(limits.python_guards),
            "cpu": limits.cpu_s,
            "as": int(limits.memory_mb) * 2**20,
            "fsize": int(limits.max_file_mb) * 2**20,
            "disk": int(limits.max_disk_mb) * 2**20,
            "inodes": 1024 * int(limits.max_disk_mb),
            "private_tmp": bool(limits.private_tmp) and (self.uid is not None or bwrap is not None),
            "nproc": nproc,
            "read_search": self.uid is not None and _needs_read_search(limits.python),
            "bwrap": bwrap,
            "hide": _home_directories() if bwrap and self.uid is None else [],
            "paths": list(_interpreter_paths(limits.python)),
            "cover": list(cover),
            "module": module,
            "channel": list(channel) if channel else None,
            "info_fd": info_w,
        }

    def _start(self, cfg: dict, *, pass_fds: tuple[int, ...]) -> subprocess.Popen:
        """Start the child program in its own session, in the working directory, with the clean environment."""
        env = dict(_CHILD_ENV, HOME=self.tmp, TMPDIR=self.tmp)
        # Under bubblewrap this first stage only sets up and runs bwrap: no site-packages needed (-S).
        flags = ["-s", "-S"] if self.bwrap else ["-s"]
        return subprocess.Popen(
            [self.limits.python, *flags, _CHILD, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self.tmp,
            env=env,
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
        )

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
        """The :class:`SandboxResult` of the reaped process; with ``stopped_ok``, "ok" when it was stopped
        while still running (the candidate, serving calls when the checker ended)."""
        stdout, stderr = self.out.text(), self.err.text()
        if stopped_ok and not self.exited_itself and not timed_out:
            return SandboxResult("ok", self.returncode, stdout, stderr, duration, "")
        limits = self.limits
        status, reason = _classify(self.returncode, timed_out, stderr, self.rusage, cpu_s=limits.cpu_s,
                                   timeout_s=limits.timeout_s, memory_mb=limits.memory_mb)
        return SandboxResult(status, self.returncode, stdout, stderr, duration, reason)


def _rmtree(path: str) -> None:
    """Remove the working directory ``path`` of a run, whatever modes the program left on its files."""
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
