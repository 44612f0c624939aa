"""The outcome of one sandboxed process, :class:`SandboxResult`, and how a finished process is classified:
its status and the one-line reason of a failure (:func:`_classify`).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Literal

from lopd_lightning.sandbox.child import SETUP_FAILED_EXIT

__all__ = ["SandboxResult", "Status"]

Status = Literal["ok", "error", "timeout", "memory_limit"]


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
            when the sandbox itself could not run it (see :func:`~lopd_lightning.sandbox.run_many`).
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


#: what ends the stderr of a program that died of its address-space limit
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
