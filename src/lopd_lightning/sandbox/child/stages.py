"""The set-up stages of a sandboxed process (see the order in :mod:`lopd_lightning.sandbox.child`).

:func:`_stage1` runs with the trainer's privilege: the private mount namespace (root, :mod:`.mounts`), the
network and IPC namespaces, the resource limits but the address space. :func:`_exec_bwrap` then hands over to
bubblewrap (:func:`_bwrap_argv`), which starts stage 2 of the child program. :func:`_confine` is the last
step before the program, in either stage: the one-off uid without any capability (:func:`_drop_privileges`),
the death signal, the Python-level guards and the address-space limit.
"""

from __future__ import annotations

import json
import os
import sys

from .channel import _write_all
from .guards import _guards
from .mounts import _needed_paths, _private_mounts

#: the file that starts the child program (run by path again by bubblewrap, as stage 2)
_ENTRY = os.path.join(os.path.dirname(os.path.realpath(__file__)), "__main__.py")


def _limit(which, soft, hard=None):
    """``setrlimit(which, (soft, hard))``, each at most the current hard limit."""
    import resource as R

    hard = soft if hard is None else hard
    cur_soft, cur_hard = R.getrlimit(which)
    if cur_hard != R.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    R.setrlimit(which, (soft, hard))


def _stage1(libc, cfg) -> None:
    """Namespaces and limits that need the trainer's privilege (root) or hold across bubblewrap."""
    import resource as R

    tmp = cfg["tmp"]
    cfg["read_search"] = bool(cfg["read_search"])
    if cfg["uid"] is not None and _private_mounts(libc, cfg):
        cfg["read_search"] = False
    if cfg["net"] and cfg["uid"] is not None:
        libc.unshare(0x40000000)  # CLONE_NEWNET; without the privilege the network stays as it is
    if cfg["uid"] is not None:
        # CLONE_NEWIPC: System V shared memory, semaphores and message queues of its own, gone with it
        # (they would outlive the run and its one-off uid); without the privilege they stay the host's
        libc.unshare(0x08000000)
    os.chdir(tmp)
    _limit(R.RLIMIT_CORE, 0)
    _limit(R.RLIMIT_FSIZE, cfg["fsize"])
    _limit(R.RLIMIT_NOFILE, 256)
    _limit(R.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1)
    if cfg["nproc"] is not None:
        _limit(R.RLIMIT_NPROC, cfg["nproc"])
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != cfg["ppid"]:
        os._exit(137)  # the trainer is already gone


def _bwrap_argv(cfg) -> list[str]:
    """The bubblewrap command line that runs stage 2 of the child program (see the package docstring)."""
    root = cfg["uid"] is not None
    tmp = cfg["tmp"]
    argv = [cfg["bwrap"], "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try"]
    if cfg.get("info_fd") is not None:  # bwrap tells the trainer its namespace there, then closes it
        argv += ["--info-fd", str(cfg["info_fd"])]
    if not root:  # bwrap makes a user namespace (the trainer's uid inside) and drops every capability
        argv += ["--unshare-user", "--disable-userns"]
        if cfg["net"]:
            argv += ["--unshare-net"]
    argv += ["--ro-bind", "/", "/"]
    if not root:
        hidden = [d for d in cfg["hide"] if os.path.isdir(d) and not os.path.islink(d)]
        for d in hidden:
            argv += ["--tmpfs", d]
        for p in _needed_paths(cfg):
            if any(p == d or p.startswith(d + "/") for d in hidden):
                argv += ["--ro-bind", p, p]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if not os.path.isdir(d) or os.path.islink(d):
            continue
        if cfg["private_tmp"] and not root:
            argv += ["--size", str(cfg["disk"]), "--tmpfs", d]
        else:  # root: stage 1's private tmpfs; private_tmp=False: the host's directory, writable again
            argv += ["--bind", d, d]
    argv += ["--bind", tmp, tmp, "--chdir", tmp]
    for p in cfg.get("cover") or ():  # hide=: last, over whatever was bound back above
        if os.path.islink(p) or not os.path.exists(p):
            continue
        if os.path.isdir(p):
            argv += ["--size", "4096", "--tmpfs", p, "--remount-ro", p]
        else:
            argv += ["--ro-bind", "/dev/null", p]
    stage2 = dict(cfg, stage=2)
    return argv + ["--", sys.executable, "-s", _ENTRY, json.dumps(stage2)]


def _exec_bwrap(cfg, source: bytes) -> None:
    """Replace this process with bubblewrap running stage 2, the program ``source`` in a memfd on its stdin."""
    fd = os.memfd_create("program", 0)  # not close-on-exec: it becomes stage 2's stdin
    _write_all(fd, source)
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)
    argv = _bwrap_argv(cfg)
    os.execv(argv[0], argv)


def _drop_privileges(libc, uid, read_search):
    """Become the one-off user id ``uid`` (root trainer only) with no capability but, when ``read_search``,
    ``CAP_DAC_READ_SEARCH``; set ``PR_SET_NO_NEW_PRIVS``; check that root cannot come back."""
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


def _confine(libc, cfg) -> None:
    """The last steps before the program: one-off uid, death signal, guards, address-space limit."""
    import resource as R

    if cfg["role"] == "checker":
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    if cfg["uid"] is not None:
        _drop_privileges(libc, cfg["uid"], cfg["read_search"])
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL (after the uid change, which clears it)
    if cfg["role"] == "checker":
        libc.prctl(4, 0, 0, 0, 0)  # again: a change of uid resets it to fs.suid_dumpable
    if cfg["stage"] == 1 and os.getppid() != cfg["ppid"]:
        os._exit(137)
    if cfg["guards"]:
        _guards(cfg["tmp"])
    _limit(R.RLIMIT_AS, cfg["as"])


