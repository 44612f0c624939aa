"""The limits and isolation options of a sandboxed process as one record, :class:`SandboxLimits`.

:func:`~lopd_lightning.sandbox.run_code`, :func:`~lopd_lightning.sandbox.run_checked` and their pools take it
as ``limits=``; each of its fields may also be given as a keyword of its own (``run_code(code, timeout_s=2)``),
which overrides the record's field (:func:`_resolve_limits`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SandboxLimits"]


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed process may use, and how it is isolated (see :mod:`lopd_lightning.sandbox` for what
    each mode gives). In :func:`~lopd_lightning.sandbox.run_checked`, each of the two processes gets them,
    with one shared wall-clock limit.

    Attributes:
        timeout_s: wall-clock limit in seconds (interpreter start, ~50 ms, included); the CPU-time limit is
            ``ceil(timeout_s) + 1`` seconds (:attr:`cpu_s`).
        memory_mb: address-space limit (RLIMIT_AS) in MiB.
        max_output_bytes: bytes of stdout and of stderr kept (first and last half when cut).
        max_processes: processes and threads the program may add (RLIMIT_NPROC of its one-off user id as
            root; when not root, RLIMIT_NPROC is the user's current count plus this, see
            :mod:`lopd_lightning.sandbox`).
        max_file_mb: RLIMIT_FSIZE in MiB: the largest file the program may write.
        max_disk_mb: size in MiB of each private tmpfs (working directory, ``/tmp``, ``/var/tmp``,
            ``/dev/shm``) when ``private_tmp`` takes effect; 1024 inodes per MiB.
        isolate_network: run in a new, empty network namespace when the privilege (or bubblewrap) allows it.
        private_tmp: fresh, size-limited tmpfs on the working directory and the world-writable directories,
            when the privilege (root) or bubblewrap allows it.
        python_guards: install the Python-level guards (defence in depth; see :mod:`lopd_lightning.sandbox`).
        bwrap: run under bubblewrap: None (default) when it is installed and works, unless the environment
            variable ``LOPD_SANDBOX_BWRAP`` is ``0``; True to require it; False never.
        python: the interpreter to run (default: this one).

    Raises:
        ValueError: a non-positive limit (``max_output_bytes`` may be 0).
    """

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 64_000
    max_processes: int = 32
    max_file_mb: int = 16
    max_disk_mb: int = 64
    isolate_network: bool = True
    private_tmp: bool = True
    python_guards: bool = True
    bwrap: bool | None = None
    python: str = sys.executable

    def __post_init__(self) -> None:
        if (
            not self.timeout_s > 0
            or self.memory_mb <= 0
            or self.max_output_bytes < 0
            or self.max_processes <= 0
            or self.max_file_mb <= 0
            or self.max_disk_mb <= 0
        ):
            raise ValueError(
                f"sandbox limits must be positive: timeout_s={self.timeout_s}, memory_mb={self.memory_mb}, "
                f"max_output_bytes={self.max_output_bytes}, max_processes={self.max_processes}, "
                f"max_file_mb={self.max_file_mb}, max_disk_mb={self.max_disk_mb}"
            )

    @property
    def cpu_s(self) -> int:
        """The CPU-time limit (RLIMIT_CPU), seconds: ``ceil(timeout_s) + 1``."""
        return math.ceil(self.timeout_s) + 1


_FIELDS = frozenset(f.name for f in dataclasses.fields(SandboxLimits))


def _resolve_limits(limits: SandboxLimits | None, options: Mapping[str, Any]) -> SandboxLimits:
    """``limits`` (default ``SandboxLimits()``) with the fields named in ``options`` replaced.

    Raises:
        TypeError: ``limits`` is not a :class:`SandboxLimits`, or ``options`` names no field of it.
        ValueError: a non-positive limit.
    """
    unknown = sorted(set(options) - _FIELDS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}: the sandbox's options "
                        f"are {', '.join(sorted(_FIELDS))}, module (run_checked) and hide")
    if limits is None:
        return SandboxLimits(**options)
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be a SandboxLimits, not {type(limits).__name__}")
    return dataclasses.replace(limits, **options) if options else limits
