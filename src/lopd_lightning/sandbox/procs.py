"""The processes of a sandboxed run as the trainer sees them in ``/proc``, and how every one of them is killed:
its process group, its one-off user id (root), its session, and under bubblewrap its PID namespace.
"""

from __future__ import annotations

import os
import signal
import time


def _proc_statuses():
    """``(pid as a string, the bytes of /proc/<pid>/status)`` of every live process (gone ones skipped)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                yield name, f.read()
        except OSError:
            continue


def _proc_table() -> list[tuple[int, str, int, int, int, int]]:
    """Live processes as (pid, state, ppid, pgid, sid, real uid), read from /proc (one file each)."""
    rows = []
    for name, status in _proc_statuses():
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
    """The PID namespace of ``pid`` as ``/proc/<pid>/ns/pid`` names it (``"pid:[N]"``); None when gone."""
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
    for _name, status in _proc_statuses():
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
