"""Running one program (:func:`run_code`) and many on a bounded thread pool (:func:`run_many`; the pool,
:func:`_pool`, also runs :func:`~lopd_lightning.sandbox.run_many_checked`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lopd_lightning.sandbox.isolation import _bwrap_for, _hidden
from lopd_lightning.sandbox.limits import SandboxLimits, _resolve_limits
from lopd_lightning.sandbox.results import SandboxResult
from lopd_lightning.sandbox.spawn import _Child
from lopd_lightning.sandbox.supervise import _supervise

__all__ = ["run_code", "run_many"]


def run_code(
    code: str, *, limits: SandboxLimits | None = None, hide: Iterable[str] = (), **options: Any
) -> SandboxResult:
    """Run the Python program ``code`` in a limited child process and wait for it.

    See :mod:`lopd_lightning.sandbox` for what the sandbox promises and what it does not.

    Args:
        code: Python source, run as the ``__main__`` module (``__name__ == "__main__"``) in a fresh
            temporary working directory; ``sys.argv == ["<sandbox>"]``; stdin is empty.
        limits: the limits and isolation options (:class:`SandboxLimits`; default ``SandboxLimits()``: 10 s,
            1024 MiB, ...).
        hide: files and folders the program must not read (e.g. the data of the task it is scored on):
            in its private mount namespace (root) or under bubblewrap, each folder is covered by an
            empty, read-only tmpfs and each file by an unreadable read-only one; paths that do not exist
            are skipped (never hide the interpreter's folders or this package's). Where no mount
            namespace can be made ("process-only", "uid-only"), it covers nothing
            (``isolation_report()["hides_paths"]``).
        **options: any field of :class:`SandboxLimits` (``timeout_s=``, ``memory_mb=``, ``max_output_bytes=``,
            ``max_processes=``, ``max_file_mb=``, ``max_disk_mb=``, ``isolate_network=``, ``private_tmp=``,
            ``python_guards=``, ``bwrap=``, ``python=``), replacing that field of ``limits``.

    Returns:
        The :class:`SandboxResult`. A failing program never raises: it gives status "error". When the
        child cannot set the limits up, the program does not run and the result is "error" with
        returncode ``SETUP_FAILED_EXIT`` (125) and a stderr starting with "lopd sandbox: setup failed".

    Raises:
        ValueError: a non-positive limit.
        TypeError: an unknown option, or ``limits`` that is not a :class:`SandboxLimits`.
        RuntimeError: ``bwrap=True`` where bubblewrap does not work.
        OSError: the interpreter cannot be started (e.g. ``python`` does not exist).
    """
    limits = _resolve_limits(limits, options)
    tool = _bwrap_for(limits.bwrap)
    cover = _hidden(hide)
    start = time.monotonic()
    child = _Child("program", code, limits, bwrap=tool, cover=cover)
    try:
        timed_out = _supervise([child], start + limits.timeout_s, child)
        duration = time.monotonic() - start
    finally:
        child.cleanup()
    return child.result(timed_out, duration)


def run_many(codes: Iterable[str], *, max_workers: int | None = None, **options: Any) -> list[SandboxResult]:
    """Run many programs with :func:`run_code`, at most ``max_workers`` at a time.

    A run that the sandbox itself loses (its worker raised: e.g. no free process slot, a full disk for
    the working directory) does not stop the others: it is reported as a failed result, status
    "error", returncode -1 and a ``reason`` starting "sandbox failure:". A program killed from outside
    (its process lost mid-run) is an ordinary failed result ("killed by signal SIGKILL ...").

    Args:
        codes: the programs.
        max_workers: concurrent programs (threads, each waiting on one child process); default
            ``min(4, os.cpu_count())``.
        **options: keyword options of :func:`run_code` (``limits=``, ``hide=``, ``timeout_s=``, ...), the same
            for all.

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

    # run_code is looked up on the package at call time: replacing lopd_lightning.sandbox.run_code (as tests do
    # to simulate a lost worker) replaces what the pool runs
    api = sys.modules[__package__]
    return _pool(lambda code, **kw: api.run_code(code, **kw), list(codes), lost, max_workers, options,
                 own=("hide",))


def _pool(run: Callable[..., Any], items: list, lost: Callable[[str, float], Any], max_workers: int | None,
          options: dict[str, Any], *, own: tuple[str, ...]) -> list:
    """``run(item, limits=..., **own options)`` for each item on at most ``max_workers`` threads, in input
    order; ``lost(reason, seconds)`` makes the failed result of a run whose worker raised. ``options``:
    ``limits=``, the options named in ``own`` (passed on as they are) and fields of :class:`SandboxLimits`.

    Raises (once, before any run): ValueError, TypeError, FileNotFoundError, RuntimeError as :func:`run_many`.
    """
    if max_workers is None:
        max_workers = min(4, os.cpu_count() or 1)
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    if not items:
        return []
    # Configuration errors raise here, once, instead of turning every program into a failed result.
    options = dict(options)
    passed_on = {name: options.pop(name) for name in own if name in options}
    limits = _resolve_limits(options.pop("limits", None), options)
    if not (os.path.isfile(limits.python) and os.access(limits.python, os.X_OK)):
        raise FileNotFoundError(f"sandbox interpreter {limits.python!r} does not exist or is not executable")
    _bwrap_for(limits.bwrap)  # bwrap=True where it does not work raises here

    def one(item):
        start = time.monotonic()
        try:
            return run(item, limits=limits, **passed_on)
        except Exception as error:  # noqa: BLE001 - one lost run must not lose the others
            return lost(f"sandbox failure: {type(error).__name__}: {error}", time.monotonic() - start)

    if max_workers == 1 or len(items) == 1:
        return [one(item) for item in items]
    workers = min(max_workers, len(items))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lopd-sandbox") as pool:
        return list(pool.map(one, items))
