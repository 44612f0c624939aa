"""The Python-level guards (``python_guards=True``): defence in depth only.

``open``/``os.open`` and the path functions of ``os`` (``mkdir``, ``remove``, ``rename``, ...) refuse to write
outside the working directory, and ``os.fork``, ``os.system``, ``os.exec*``, ``os.spawn*``,
``os.posix_spawn*`` and ``subprocess`` refuse to start processes. Any program can undo monkeypatches
(``ctypes``, ``_io``): the OS-level limits of :mod:`.stages` and :mod:`.mounts` are what hold.
"""

from __future__ import annotations

import os

#: path functions of ``os`` guarded: (names, positions of their path arguments, their keyword names)
_PATH_FUNCTIONS = (
    (("mkdir", "rmdir", "remove", "unlink", "chmod", "chown", "lchown", "truncate", "utime", "mkfifo", "mknod"),
     (0,), ("path",)),
    (("rename", "replace", "link"), (0, 1), ("src", "dst")),
    (("symlink",), (1,), ("dst",)),
)
#: functions of ``os`` (and ``posix``) that start processes
_PROCESS_FUNCTIONS = (
    "fork", "forkpty", "system", "popen", "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp",
    "execvpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
    "posix_spawn", "posix_spawnp",
)


def _guards(root):
    """Install the guards for a program whose working directory is ``root``."""
    inside = _inside(root)
    _guard_open(inside)
    _guard_path_functions(inside)
    _refuse_processes()


def _inside(root):
    """``inside(path, dir_fd=None)``: True when writing ``path`` stays under ``root`` (fds and ``os.devnull``
    are allowed). The path functions it uses are bound now, before the program can replace them."""
    root = os.path.realpath(root)
    realpath, join, fsdecode, fspath = os.path.realpath, os.path.join, os.fsdecode, os.fspath
    readlink = os.readlink

    def inside(p, dir_fd=None):
        if isinstance(p, int):
            return True
        try:
            p = fsdecode(fspath(p))
        except TypeError:
            return True
        if p == os.devnull:
            return True
        if dir_fd is not None and not p.startswith("/"):
            p = join(readlink("/proc/self/fd/%d" % dir_fd), p)
        p = realpath(p)
        return p == root or p.startswith(root + "/")

    return inside


def _deny(what, p):
    raise PermissionError(13, "sandbox: %s outside the working directory is refused" % what, str(p))


def _guard_open(inside) -> None:
    """``open`` (``builtins``, ``io``) and ``os.open`` refuse to open for writing outside the working directory."""
    import builtins
    import io
    import posix

    _open = io.open

    def open(file, mode="r", *args, **kwargs):  # noqa: A001
        if isinstance(mode, str) and any(c in mode for c in "wax+") and not inside(file):
            _deny("writing", file)
        return _open(file, mode, *args, **kwargs)

    builtins.open = io.open = open
    _os_open = os.open
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & write_flags and not inside(path, dir_fd):
            _deny("writing", path)
        return _os_open(path, flags, mode, dir_fd=dir_fd)

    os.open = posix.open = os_open


def _guard_path_functions(inside) -> None:
    """The path functions of ``os`` (:data:`_PATH_FUNCTIONS`) refuse paths outside the working directory."""
    import posix

    def wrap(name, positions, keywords):
        real = getattr(os, name, None)
        if real is None:
            return

        def guarded(*args, **kwargs):
            fds = (kwargs.get("dir_fd"), kwargs.get("src_dir_fd"), kwargs.get("dst_dir_fd"))
            paths = [args[i] for i in positions if i < len(args)] + [kwargs[k] for k in keywords if k in kwargs]
            for p in paths:
                if not inside(p, next((f for f in fds if f is not None), None)):
                    _deny(name, p)
            return real(*args, **kwargs)

        setattr(os, name, guarded)
        setattr(posix, name, guarded)

    for names, positions, keywords in _PATH_FUNCTIONS:
        for name in names:
            wrap(name, positions, keywords)


def _refuse_processes() -> None:
    """Every function of ``os``/``posix`` that starts a process, and ``subprocess``'s ``fork_exec``, raise."""
    import posix

    def refuse(*args, **kwargs):
        raise PermissionError(1, "sandbox: starting processes is refused")

    for name in _PROCESS_FUNCTIONS:
        if hasattr(os, name):
            setattr(os, name, refuse)
        if hasattr(posix, name):
            setattr(posix, name, refuse)
    import _posixsubprocess

    _posixsubprocess.fork_exec = refuse
