"""What isolation this machine gives, as a run sees it: :func:`isolation_report` runs a tiny program in the
sandbox and reports what it saw (its uid, its namespaces, its capabilities) and the mode of the runs.
"""

from __future__ import annotations

import json
import os
import sys

from lopd_lightning.sandbox.isolation import _bwrap_for, _mode_name
from lopd_lightning.sandbox.run import run_code

__all__ = ["isolation_report"]

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
        python: the interpreter. bwrap: as in :class:`~lopd_lightning.sandbox.SandboxLimits`.

    Returns:
        ``{"mode": str, "bwrap": bool, "uid": int, "root": bool, "user_switch": bool,
        "network_isolated": bool | None, "private_tmp": bool | None, "pid_isolated": bool | None,
        "reads_all_files": bool | None, "hides_paths": bool, "checker_protected": bool}``: ``mode`` is
        "bwrap", "namespaces+uid", "uid-only" or "process-only" (see :mod:`lopd_lightning.sandbox`);
        ``user_switch`` is True when the program ran under a one-off user id (trainer is root);
        ``private_tmp`` when it ran in a mount namespace of its own; ``pid_isolated`` in a PID namespace
        of its own (bubblewrap); ``reads_all_files`` when it kept ``CAP_DAC_READ_SEARCH`` or
        ``CAP_DAC_OVERRIDE`` (None: unknown); ``hides_paths`` when ``hide=`` takes effect (False in
        "process-only" and "uid-only": there the program reads the task's data, e.g. HumanEval's tests
        and reference solutions, if it can find them); ``checker_protected`` is False in "process-only",
        where the program runs under the trainer's own uid and can rewrite the checker's program
        (:mod:`lopd_lightning.sandbox.child`) or any file of the trainer's, so no verdict of
        :func:`~lopd_lightning.sandbox.run_checked` can be trusted there.

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
