"""Files that appear whole or not at all, and folders checked before a run writes into them.

Every file the project writes goes through here: the experience bank's files
(:mod:`lopd_lightning.memory.persistence`), checkpoints (:class:`~lopd_lightning.callbacks.AtomicCheckpointIO`),
the run summary (:class:`~lopd_lightning.callbacks.RunSummary`), the validation generations and the
benchmarks' JSON results (``benchmarks/common.write_json_atomic``).

A write goes to a temporary file beside its target (``.<name>.<random>.tmp``: the same folder, so the same
filesystem), is flushed and ``fsync``-ed, then renamed over the target with ``os.replace`` (atomic on
POSIX), and the folder is ``fsync``-ed so that the rename survives a power cut. An exception while writing
(a full disk, a serialiser that raises, Ctrl-C) removes the temporary file and leaves the previous file, if
any, as it was. A process killed while writing can leave a ``.*.tmp`` file beside the target, never a
truncated target.

Lightning's own checkpoint writer (``TorchCheckpointIO``, through fsspec) writes the file into the system's
temporary folder and moves it into place: a rename where both are on one filesystem, but elsewhere (a
``/tmp`` on local disk, checkpoints on a network filesystem) a copy into the target, which a full disk or a
kill leaves truncated in place of the previous checkpoint. :class:`~lopd_lightning.callbacks.AtomicCheckpointIO`
writes beside the target instead; every on-policy module installs it in place of Lightning's default.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

__all__ = [
    "atomic_write",
    "replace_files",
    "unwritable_folder_reason",
    "write_json",
    "write_text",
]


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temporary_beside(path: Path, mode: str, encoding: str | None) -> tuple[IO[Any], Path]:
    """An open temporary file in ``path``'s folder (created), with the permissions a new file gets."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(name, 0o666 & ~umask)  # mkstemp makes 0600
    return os.fdopen(fd, mode, encoding=encoding), Path(name)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w", *, encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """Open ``path`` for writing so that it appears whole or not at all (see the module docstring).

    Args:
        path: the file to write (its folder is created).
        mode: ``"w"`` (text) or ``"wb"`` (bytes).
        encoding: of a text file (ignored for bytes).

    Yields:
        The open temporary file; on a normal exit of the ``with`` block it is fsynced and renamed to ``path``.

    Raises:
        ValueError: a mode other than ``"w"`` or ``"wb"``. Whatever the block or the filesystem raises (the
            previous ``path`` is then untouched and the temporary file removed).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes a whole file: mode 'w' or 'wb', got {mode!r}")
    path = Path(path)
    f, tmp = _temporary_beside(path, mode, None if "b" in mode else encoding)
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    _fsync_folder(path.parent)


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write`); returns the path."""
    with atomic_write(path, "w") as f:
        f.write(text)
    return Path(path)


def write_json(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2, **dumps: Any) -> Path:
    """Write ``data`` as JSON (indented, a final newline) to ``path`` atomically; returns the path.

    ``dumps``: more options of ``json.dump`` (``default``, ``ensure_ascii``, ``sort_keys``). The data is
    serialised before the file is opened, so a value JSON cannot hold raises with nothing written.
    """
    return write_text(path, json.dumps(data, indent=indent, **dumps) + "\n")


def replace_files(contents: Mapping[str | os.PathLike[str], bytes]) -> list[Path]:
    """Replace several files with new contents: all are written (fsynced) beside their targets first, then
    renamed into place in the order given.

    An error while writing (a full disk) removes what was written and leaves every target as it was. The
    renames need no space and cannot fail that way, but they are one after another: a process killed
    between two leaves some files new and some old. A caller that must tell (the experience bank) names
    first a file that records the others' checksums (its manifest), so that any mix is detected.

    Args:
        contents: target path -> its new bytes, in the order of the renames.

    Returns:
        The paths written, in that order.
    """
    written: list[tuple[Path, Path]] = []
    try:
        for target, data in contents.items():
            target = Path(target)
            f, tmp = _temporary_beside(target, "wb", None)
            written.append((tmp, target))
            with f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for tmp, target in written:
            os.replace(tmp, target)
    except BaseException:
        for tmp, _ in written:
            _unlink(tmp)
        raise
    for folder in dict.fromkeys(target.parent for _, target in written):
        _fsync_folder(folder)
    return [target for _, target in written]


def unwritable_folder_reason(folder: str | os.PathLike[str]) -> str | None:
    """Why a run could not create or write into ``folder``, or None when it can; nothing is created.

    The folder itself or its nearest existing parent is checked: it must be a folder (not a file) in which
    this process may create files.

    Returns:
        A clause for a message (``"'runs' is a file, not a folder"``, ``"no permission to write in '/'"``),
        or None.
    """
    folder = Path(os.path.expanduser(os.fspath(folder)))
    probe = folder if folder.is_absolute() else Path.cwd() / folder
    while not probe.exists():
        if probe.is_symlink():
            return f"{str(probe)!r} is a broken symbolic link"
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{str(probe)!r} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"no permission to write in {str(probe)!r}"
    return None
