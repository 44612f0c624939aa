"""Checks in another process: a program (the *candidate*) and the checks of its functions (the *checker*) in two
sandboxed processes, :func:`run_checked`, and many such pairs on the pool, :func:`run_many_checked`. The verdict
is the checker's alone (see :mod:`lopd_lightning.sandbox`, "Checks in another process").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lopd_lightning.sandbox.isolation import _bwrap_for, _hidden, _mode_name
from lopd_lightning.sandbox.limits import SandboxLimits, _resolve_limits
from lopd_lightning.sandbox.results import SandboxResult, Status
from lopd_lightning.sandbox.run import _pool
from lopd_lightning.sandbox.spawn import _CHILD, _Child
from lopd_lightning.sandbox.supervise import _supervise

__all__ = ["CheckedResult", "run_checked", "run_many_checked"]

log = logging.getLogger(__name__)


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
        isolation: the isolation mode the pair ran in (see :mod:`lopd_lightning.sandbox`).
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


def run_checked(
    program: str,
    checker: str,
    *,
    module: str = "__main__",
    limits: SandboxLimits | None = None,
    hide: Iterable[str] = (),
    **options: Any,
) -> CheckedResult:
    """Run ``program`` (the candidate) and ``checker`` (the checks of its functions) in two sandboxed
    processes that share one wall-clock limit, and return the checker's verdict.

    The candidate's process runs ``program`` as module ``module`` and then answers calls to its
    top-level functions. The checker's process runs ``checker`` as ``__main__`` with, in its globals,
    ``candidate_function(name)``: a proxy that calls the candidate's function ``name`` in the other
    process with plain-data arguments and returns its plain-data result (an exception of the function is
    raised as the built-in exception of the same name, else ``RuntimeError``). The checks pass when
    ``checker`` runs to its end (exit status 0). See :mod:`lopd_lightning.sandbox`, "Checks in another process".

    Args:
        program: the candidate's Python source.
        checker: the checks' Python source (trusted code, but run with the same limits).
        module: the module name ``program`` runs as (e.g. "solution", so that its
            ``if __name__ == "__main__":`` block does not run).
        limits: as :func:`~lopd_lightning.sandbox.run_code`, applied to each process; ``timeout_s`` is the
            wall-clock limit of the pair, each process gets the CPU limit of one run.
        hide: files and folders covered in the *candidate's* view only (as in
            :func:`~lopd_lightning.sandbox.run_code`): e.g. the task's tests and reference solutions. The
            checker, which gets its checks on its own pipe, sees the file system as it is.
        **options: fields of :class:`SandboxLimits`, as :func:`~lopd_lightning.sandbox.run_code`.

    Returns:
        The :class:`CheckedResult`; never raises for anything the programs do.

    Raises:
        ValueError, TypeError, RuntimeError, OSError: as :func:`~lopd_lightning.sandbox.run_code`.
    """
    limits = _resolve_limits(limits, options)
    tool = _bwrap_for(limits.bwrap)
    mode = _mode_name(tool)
    if mode == "process-only":
        _warn_process_only()
    cover = _hidden(hide)
    start = time.monotonic()
    children: list[_Child] = []
    try:
        judge, candidate = _start_pair(children, program, checker, limits, tool, module=module, cover=cover)
        timed_out = _supervise([judge, candidate], start + limits.timeout_s, judge, linger=0.25)
        duration = time.monotonic() - start
    finally:
        for child in children:
            child.cleanup()
    return _verdict(judge, candidate, timed_out, duration, mode)


def _start_pair(children: list[_Child], program: str, checker: str, limits: SandboxLimits, tool: str | None, *,
                module: str, cover: tuple[str, ...]) -> tuple[_Child, _Child]:
    """Start the checker's and the candidate's processes joined by a pipe pair that only they hold (the
    trainer closes its copies), appending each to ``children`` as it starts (the caller cleans them up)."""
    requests = os.pipe()  # checker -> candidate
    answers = os.pipe()  # candidate -> checker
    try:
        children.append(_Child("checker", checker, limits, bwrap=tool, channel=(answers[0], requests[1])))
        children.append(
            _Child("candidate", program, limits, bwrap=tool, module=module, channel=(requests[0], answers[1]),
                   cover=cover)
        )
    finally:
        for fd in (*requests, *answers):
            os.close(fd)
    judge, candidate = children
    return judge, candidate


def _verdict(judge: _Child, candidate: _Child, timed_out: bool, duration: float, mode: str) -> CheckedResult:
    """The :class:`CheckedResult` of a reaped pair: the checker's verdict, with the candidate's reason when it
    ended by itself first."""
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


def run_many_checked(
    pairs: Iterable[tuple[str, str]], *, max_workers: int | None = None, **options: Any
) -> list[CheckedResult]:
    """:func:`run_checked` for many (program, checker) pairs, at most ``max_workers`` pairs at a time
    (each pair is two processes). A pair the sandbox itself loses is a failed result whose reason
    starts "sandbox failure:" (as in :func:`~lopd_lightning.sandbox.run_many`).

    Args:
        pairs: (program, checker) sources.
        max_workers: concurrent pairs; default ``min(4, os.cpu_count())``.
        **options: keyword options of :func:`run_checked` (``module=``, ``limits=``, ``hide=``,
            ``timeout_s=``, ...), the same for all.

    Returns:
        One :class:`CheckedResult` per pair, in input order.

    Raises:
        As :func:`~lopd_lightning.sandbox.run_many`.
    """

    def lost(reason: str, duration: float) -> CheckedResult:
        failed = SandboxResult("error", -1, "", reason, duration, reason)
        return CheckedResult(False, "error", reason, failed, failed, duration, "")

    return _pool(lambda pair, **kw: run_checked(pair[0], pair[1], **kw), list(pairs), lost, max_workers, options,
                 own=("hide", "module"))


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
        "before training on these rewards.", os.path.dirname(_CHILD),
    )
