"""Shared helpers of the benchmarks: the run's metadata (versions, hardware, seed, git sha) and atomic JSON.

Every benchmark writes one JSON file whose top level holds its own results plus :func:`run_metadata`, so
that a number can always be traced to the code (git sha), the software (versions) and the machine.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Packages whose versions every benchmark records (import name -> key in the JSON).
PACKAGES: dict[str, str] = {
    "torch": "torch",
    "transformers": "transformers",
    "lightning": "lightning",
    "peft": "peft",
    "faiss": "faiss",
}

REPO_ROOT = Path(__file__).resolve().parent.parent


def package_versions() -> dict[str, str | None]:
    """``{name: version}`` of :data:`PACKAGES` and ``python``; None for a package that is not installed."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for module_name, key in PACKAGES.items():
        try:
            module = importlib.import_module(module_name)
            versions[key] = str(getattr(module, "__version__", None))
        except Exception:  # not installed, or broken: record, never fail a benchmark over it
            versions[key] = None
    return versions


def cpu_model() -> str | None:
    """The CPU model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere), or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def cpu_capability() -> str | None:
    """The instruction set torch's vectorised ATen kernels dispatch to on the CPU
    (``torch.backends.cpu.get_cpu_capability()``: ``"DEFAULT"``, ``"AVX2"``, ``"AVX512"``; ``ATEN_CPU_CAPABILITY``
    lowers it), or None without torch. Float results differ between capabilities, so two results are
    bit-comparable only with the same one; it is not enough (MKL and oneDNN choose their own kernels)."""
    try:
        import torch

        return torch.backends.cpu.get_cpu_capability()
    except Exception:
        return None


def gpu_name() -> str | None:
    """The name of CUDA device 0 (and the count when more than one), or None without CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            name = torch.cuda.get_device_name(0)
            return name if n == 1 else f"{name} x{n}"
    except Exception:
        pass
    return None


#: where results are written: a change there does not change the code that measures, so it is not dirt
RESULTS_PATHSPEC = ":(exclude)benchmarks/results"


def git_sha(root: Path = REPO_ROOT) -> str | None:
    """``git rev-parse HEAD`` of ``root``, with ``-dirty`` when ``git status --porcelain`` lists changes
    (untracked files included) outside ``benchmarks/results/``: a result file written there, new or again,
    is not dirt (it made every first write of a result record its own absence); None when git or the
    repository is unavailable."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", RESULTS_PATHSPEC], cwd=root, capture_output=True,
            text=True, timeout=60, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if status.strip() else sha


def run_metadata(*, seed: int, argv: list[str] | None = None) -> dict[str, Any]:
    """The metadata every benchmark JSON carries.

    Args:
        seed: the run's seed.
        argv: the benchmark's arguments (default ``sys.argv[1:]``), recorded as given.

    Returns:
        ``{"versions", "hardware": {"platform", "cpu", "cpu_count", "cpu_capability", "gpu"}, "seed", "git_sha",
        "timestamp" (UTC, ISO 8601), "argv"}``.
    """
    return {
        "versions": package_versions(),
        "hardware": {
            "platform": platform.platform(),
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "cpu_capability": cpu_capability(),
            "gpu": gpu_name(),
        },
        "seed": seed,
        "git_sha": git_sha(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv[1:] if argv is None else argv),
    }


def write_json_atomic(data: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``data`` as indented JSON to ``path`` atomically (:func:`lopd_lightning.io.write_json`: a temporary
    file in the same folder, fsynced, then ``os.replace``; an interrupted write leaves the previous file),
    creating the folder. Returns the path."""
    from lopd_lightning.io import write_json

    return write_json(path, data, indent=2)
