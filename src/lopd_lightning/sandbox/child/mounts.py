"""The private mount namespace of a root trainer (stage 1, before the one-off uid): what the program sees of the
file system.

:func:`_private_mounts` covers the directories on the way to the interpreter that other users may not cross
(``/root`` for ``/root/.pyenv``) with a small tmpfs and binds back only the interpreter's own directories and
this folder (:func:`_needed_paths`), covers the ``hide=`` paths (:func:`_cover`), makes every mount read-only
(:func:`_read_only_everything`), then mounts fresh, size-limited tmpfs on ``/tmp``, ``/var/tmp``, ``/dev/shm``
and the working directory. The constants are Linux's (``<sys/mount.h>``).
"""

from __future__ import annotations

import os
import sys


def _needed_paths(cfg) -> list[str]:
    """What the program needs to see: the interpreter's own directories (its prefixes, executable and
    import path, as the trainer found them: ``cfg["paths"]``) and this folder (the child program, which stage 2
    runs again under bubblewrap), outermost only."""
    paths = set(cfg["paths"]) | {os.path.dirname(os.path.realpath(__file__))}
    if not cfg["paths"]:  # the trainer could not ask the interpreter: what this process sees of itself
        paths |= {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
                  os.path.dirname(os.path.realpath(sys.executable))}
        paths.update(p for p in sys.path if p)
    out = []
    for p in paths:
        p = os.path.realpath(p)
        if os.path.exists(p) and p != cfg["tmp"]:
            out.append(p)
    out.sort()
    return [p for i, p in enumerate(out) if not any(p.startswith(q.rstrip("/") + "/") for q in out[:i])]


def _closed_ancestor(path: str) -> str | None:
    """The outermost directory on the way to ``path`` (``path`` included) that other users may not
    cross (no ``o+x``), or None."""
    import stat

    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        d = "/" + "/".join(parts[:i])
        try:
            st = os.stat(d)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
            return d
    return None


def _hide_closed_directories(libc, cfg) -> bool:
    """In the private mount namespace (root): cover each directory on the way to the interpreter that
    other users may not cross (``/root`` for ``/root/.pyenv``) with a small tmpfs, and bind the needed
    directories back read-only at their own paths. Returns True when every needed path is then readable
    by any user, so the one-off uid needs no CAP_DAC_READ_SEARCH."""
    import ctypes
    import stat

    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 0x1, 0x2, 0x4, 0x20, 0x1000, 0x4000
    needed = _needed_paths(cfg)
    if not cfg["private_tmp"]:
        needed.append(cfg["tmp"])  # no tmpfs for it: bind it back if it lies under a covered directory
    covers: dict[str, list[str]] = {}  # outermost closed directory -> the needed paths under it
    for p in needed:
        top = _closed_ancestor(p)
        if top is not None:
            covers.setdefault(top, []).append(p)
    for top, paths in sorted(covers.items()):
        binds = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC), os.path.isdir(p)) for p in sorted(paths)]
        if libc.mount(b"lopd-sandbox", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                      b"size=1m,nr_inodes=4096,mode=755") != 0:
            raise OSError(ctypes.get_errno(), "mount tmpfs on " + top)
        for p, fd, is_dir in binds:
            if is_dir:
                os.makedirs(p, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
                os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
            source = ("/proc/self/fd/%d" % fd).encode()
            if libc.mount(source, p.encode(), None, MS_BIND | MS_REC, None) != 0:
                raise OSError(ctypes.get_errno(), "bind " + p)
            os.close(fd)
            if p != cfg["tmp"]:
                libc.mount(None, p.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    for p in _needed_paths(cfg):
        try:
            mode = os.stat(p).st_mode
        except OSError:
            continue
        if not mode & stat.S_IROTH or (stat.S_ISDIR(mode) and not mode & stat.S_IXOTH):
            return False
    return True


def _cover(libc, cfg) -> None:
    """Cover each path of ``cfg["cover"]`` (the ``hide=`` of the run: e.g. the folder of the task's data)
    with nothing: a folder with an empty read-only tmpfs, a file with ``/dev/null`` bound read-only.
    Mounts made here are locked in any user namespace the program makes later: it can neither unmount
    them nor bind their parent without them."""
    import ctypes

    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
    flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
    for p in cfg.get("cover") or ():
        if os.path.islink(p) or not os.path.exists(p):
            continue  # not there in this namespace (e.g. under a covered root-only folder): nothing to see
        if os.path.isdir(p):
            if libc.mount(b"lopd-hidden", p.encode(), b"tmpfs", flags, b"size=4k,nr_inodes=2,mode=555") != 0:
                raise OSError(ctypes.get_errno(), "cannot hide " + p)
        else:
            if libc.mount(b"/dev/null", p.encode(), None, MS_BIND, None) != 0:
                raise OSError(ctypes.get_errno(), "cannot hide " + p)
            if libc.mount(None, p.encode(), None, MS_BIND | MS_REMOUNT | flags, None) != 0:
                raise OSError(ctypes.get_errno(), "cannot make read-only the cover of " + p)


def _mount_setattr(libc, path: str, *, set_attr: int = 0, clear_attr: int = 0, recursive: bool) -> int:
    """``mount_setattr(2)`` (Linux 5.12): 0, else the errno (ENOSYS on older kernels)."""
    import ctypes

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    SYS_mount_setattr, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000  # the same number on every architecture
    attr = MountAttr(set_attr, clear_attr, 0, 0)
    done = libc.syscall(SYS_mount_setattr, AT_FDCWD, path.encode(), AT_RECURSIVE if recursive else 0,
                        ctypes.byref(attr), ctypes.sizeof(attr))
    return 0 if done == 0 else ctypes.get_errno()


def _kept_flags(path: str) -> int:
    """The per-mount flags of the mount at ``path`` that a bind remount must keep (they may be locked)."""
    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 0x2, 0x4, 0x8, 0x400, 0x800, 0x200000
    got = os.statvfs(path).f_flag
    kept = got & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)  # ST_* == MS_* for these
    return kept | (MS_RELATIME if got & 0x1000 else 0)  # ST_RELATIME


def _read_only_everything(libc) -> None:
    """Make every mount of this (private) namespace read-only, so that the one-off uid can write nowhere
    but in the private tmpfs mounted afterwards: not in ``/run/lock``, ``/var/mail`` or any other
    world-writable directory or file of the host (device files such as ``/dev/null`` stay writable)."""
    import ctypes

    MS_RDONLY, MS_REMOUNT, MS_BIND, MOUNT_ATTR_RDONLY = 0x1, 0x20, 0x1000, 0x1
    error = _mount_setattr(libc, "/", set_attr=MOUNT_ATTR_RDONLY, recursive=True)
    if error == 0:
        return
    if error not in (38, 22):  # ENOSYS (Linux < 5.12), EINVAL: remount each mount by itself
        raise OSError(error, "mount_setattr(/, MOUNT_ATTR_RDONLY, AT_RECURSIVE)")
    with open("/proc/self/mountinfo", "rb") as f:
        points = [line.split()[4] for line in f if line.strip()]
    seen = set()
    for raw in points:
        point = raw.decode("utf-8", "surrogateescape")
        for code in ("\\040", "\\011", "\\012", "\\134"):
            point = point.replace(code, chr(int(code[1:], 8)))
        if point in seen:
            continue
        seen.add(point)
        try:
            flags = _kept_flags(point)
        except OSError:
            continue  # covered by a later mount, or gone
        if libc.mount(None, point.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags, None) != 0:
            raise OSError(ctypes.get_errno(), "remount read-only " + point)


def _writable_again(libc, path: str) -> None:
    """Bind ``path`` onto itself, writable (after :func:`_read_only_everything`): the host's directory
    when ``private_tmp=False``."""
    import ctypes

    MS_REMOUNT, MS_BIND, MOUNT_ATTR_RDONLY = 0x20, 0x1000, 0x1
    if libc.mount(path.encode(), path.encode(), None, MS_BIND, None) != 0:
        raise OSError(ctypes.get_errno(), "bind " + path)
    error = _mount_setattr(libc, path, clear_attr=MOUNT_ATTR_RDONLY, recursive=False)
    if error in (38, 22):
        error = 0
        if libc.mount(None, path.encode(), None, MS_BIND | MS_REMOUNT | _kept_flags(path), None) != 0:
            error = ctypes.get_errno()
    if error:
        raise OSError(error, "make writable " + path)


def _private_mounts(libc, cfg) -> bool:
    """A private mount namespace (root only): the closed directories covered (see
    :func:`_hide_closed_directories`), the ``hide=`` paths covered (:func:`_cover`), every mount made
    read-only (:func:`_read_only_everything`), then fresh, size-limited tmpfs on /tmp, /var/tmp, /dev/shm
    and the working directory (with ``private_tmp=False``: the host's ones, writable again), so that
    nothing the program writes outlives it or fills the host's disk.
    Returns True when the program needs no CAP_DAC_READ_SEARCH to import its standard library."""
    import ctypes

    CLONE_NEWNS, MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x20000, 0x2, 0x4, 0x4000, 0x40000
    if libc.unshare(CLONE_NEWNS) != 0:
        return False  # no privilege: the host's directories stay as they are
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    readable = _hide_closed_directories(libc, cfg)
    _cover(libc, cfg)
    tmp = cfg["tmp"]
    os.makedirs(tmp, exist_ok=True)  # e.g. under a covered root-only folder: made while it is writable
    _read_only_everything(libc)
    if cfg["private_tmp"]:
        opts = ("size=%d,nr_inodes=%d,mode=1777" % (cfg["disk"], cfg["inodes"])).encode()
        covered = False
        for d in ("/tmp", "/var/tmp", "/dev/shm", tmp):
            if d == tmp and covered:
                break
            if not os.path.isdir(d) or os.path.islink(d):
                continue
            if libc.mount(b"lopd-sandbox", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
                raise OSError(ctypes.get_errno(), "mount tmpfs on " + d)
            covered = covered or tmp.startswith(d + "/")
        os.makedirs(tmp, exist_ok=True)
        os.chmod(tmp, 0o700)
        if cfg["uid"] is not None:
            os.chown(tmp, cfg["uid"], cfg["uid"])
    else:
        for d in ("/tmp", "/var/tmp", "/dev/shm", tmp):
            if os.path.isdir(d) and not os.path.islink(d):
                _writable_again(libc, d)
    return readable

