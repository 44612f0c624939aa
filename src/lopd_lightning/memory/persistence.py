"""The experience bank on disk: ``experiences.jsonl``, ``embeddings.npy``, ``meta.json`` and ``manifest.json`` in
one folder.

:meth:`ExperienceBank.save <lopd_lightning.memory.bank.ExperienceBank.save>` writes the folder from the
bank's :meth:`~lopd_lightning.memory.bank.ExperienceBank.state_dict`, and
:meth:`~lopd_lightning.memory.bank.ExperienceBank.load` restores a bank from what :func:`read_bank_folder`
reads. ``lopd build-memory`` writes such folders; ``model.init_args.bank_path`` names one.

Files:
    experiences.jsonl  one record a line: ``{"id", "task_id", "task_text", "trace", "reward", "step"}``
    embeddings.npy     (N, dim) float32, row i embeds line i
    meta.json          ``{"version", "embedder_name", "dim", "size", "next_id", "settings", "counters"}``
    manifest.json      ``{"format", "records", "dim", "sha256": {file name: hex digest}}`` of the three above

A save is a store a reader can trust (:func:`write_bank_folder`): the four files are written beside their
targets first (a full disk stops it there, with the previous bank untouched), then renamed into place,
``manifest.json`` first, so that a folder whose renames were cut short (a kill between two) holds a manifest
that does not match its files. A read (:func:`read_bank_folder`) checks the manifest and refuses a mismatch
in one line naming the folder and the fix; a line of ``experiences.jsonl`` that is not a record is named by
its number. A folder without ``manifest.json`` (written before lopd_lightning wrote one) is read unchecked,
said once. Records that repeat an earlier one (same ``task_id`` and ``trace``: two banks concatenated) are
dropped as the file is read, with their count logged, as :meth:`ExperienceBank.add` skips them.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lopd_lightning.io import replace_files

log = logging.getLogger(__name__)

__all__ = [
    "BANK_FILES",
    "MANIFEST",
    "STATE_VERSION",
    "BankFileError",
    "check_bank",
    "check_bank_fills",
    "is_empty_folder",
    "read_bank_folder",
    "write_bank_folder",
]

#: Format version of ``ExperienceBank.state_dict()`` and of ``meta.json``.
STATE_VERSION = 1

#: The files a manifest covers, in the order :func:`write_bank_folder` renames them (after the manifest).
BANK_FILES = ("experiences.jsonl", "embeddings.npy", "meta.json")

#: The file holding the record count and the checksums of :data:`BANK_FILES`.
MANIFEST = "manifest.json"

#: Format version of ``manifest.json``.
MANIFEST_FORMAT = 1

#: what to do with a bank folder that cannot be read as it is
REBUILD = ("rebuild the bank with `lopd build-memory -c CONFIG` (add --from-references to seed it from the "
           "reference solutions; it writes model.init_args.bank_path)")

#: folders whose missing manifest was already said (once per folder and process)
_UNCHECKED: set[str] = set()


class BankFileError(ValueError):
    """A bank folder whose files are damaged (a line that is not a record, a vector file that does not load) or do
    not match its ``manifest.json``. The message is one line naming the folder, the file and the fix."""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_bank_folder(folder: str | Path, state: dict[str, Any]) -> Path:
    """Write a bank's state into ``folder`` (created): ``experiences.jsonl``, ``embeddings.npy``, ``meta.json`` and
    their ``manifest.json``, replacing a bank that is there only once every new file is on disk (module
    docstring). Other files in the folder are left alone.

    Args:
        folder: the bank folder.
        state: ``ExperienceBank.state_dict()``: ``records`` (dicts), ``ids`` ((N,) int64), ``embeddings``
            ((N, dim) float32; tensors or arrays), ``embedder_name``, ``dim``, ``next_id``, ``settings``,
            ``counters``.

    Returns:
        The folder.

    Raises:
        OSError: a file could not be written (the previous bank, if any, is then as it was).
    """
    folder = Path(folder)
    ids = np.asarray(state["ids"]).tolist()
    lines = [json.dumps({"id": rid, **record}, ensure_ascii=False) + "\n" for rid, record in zip(ids, state["records"])]
    records = "".join(lines).encode("utf-8")
    vectors = io.BytesIO()
    np.save(vectors, np.asarray(state["embeddings"], dtype=np.float32))
    meta = {
        "version": STATE_VERSION,
        "embedder_name": state["embedder_name"],
        "dim": state["dim"],
        "size": len(state["records"]),
        "next_id": state["next_id"],
        "settings": state["settings"],
        "counters": state["counters"],
    }
    contents = dict(zip(BANK_FILES, (records, vectors.getvalue(), (json.dumps(meta, indent=2) + "\n").encode("utf-8"))))
    manifest = {"format": MANIFEST_FORMAT, "records": len(lines), "dim": int(state["dim"]),
                "sha256": {name: _digest(data) for name, data in contents.items()}}
    replace_files({folder / MANIFEST: (json.dumps(manifest, indent=2) + "\n").encode("utf-8"),
                   **{folder / name: data for name, data in contents.items()}})
    return folder


@dataclass
class _Contents:
    """A bank folder as read and checked: its meta, records (duplicates dropped), ids and vectors."""

    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    ids: np.ndarray
    embeddings: np.ndarray
    checked: bool  # it had a manifest, and matched it
    duplicates: int  # records dropped as repeats of an earlier one
    renumbered: bool  # the ids repeated (after the duplicates were dropped) and were given anew


def _where(folder: Path) -> str:
    return f"model.init_args.bank_path {str(folder)!r}"


def _records(folder: Path, data: bytes) -> list[dict[str, Any]]:
    """The records of ``experiences.jsonl``; a line that is not one is named by its number (1-based)."""
    from lopd_lightning.memory.experience import Experience

    rows = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8-sig" if number == 1 else "utf-8"))  # an editor's byte order mark
            if not isinstance(row, dict):
                raise ValueError(f"a JSON {type(row).__name__}, not an object")
            Experience.from_dict(row)
            if not math.isfinite(float(row["reward"])):
                raise ValueError(f"reward {row['reward']!r} is not finite")
        except json.JSONDecodeError as error:  # "Expecting ',' delimiter", "Unterminated string starting at"
            reason = f"{error.msg}{'' if error.msg.endswith(' at') else ' at'} column {error.colno}"
        except UnicodeDecodeError as error:
            reason = f"not UTF-8 at byte {error.start}"
        except KeyError as error:
            reason = f"no field {error.args[0]!r}"
        except (TypeError, ValueError) as error:
            reason = " ".join(str(error).split())
        else:
            rows.append(row)
            continue
        raise BankFileError(f"{_where(folder)}: line {number} of experiences.jsonl is not an experience record "
                            f"({reason}); the file is damaged (cut short, or edited): {REBUILD}, or restore the file")
    return rows


def _vectors(folder: Path, data: bytes) -> np.ndarray:
    try:
        vectors = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, EOFError, OSError) as error:
        raise BankFileError(f"{_where(folder)}: embeddings.npy is damaged ({' '.join(str(error).split())}); "
                            f"{REBUILD}") from None
    if vectors.ndim != 2:
        raise BankFileError(f"{_where(folder)}: embeddings.npy holds an array of shape {vectors.shape}, not "
                            f"(records, dim); {REBUILD}")
    return vectors


def _check_manifest(folder: Path, data: dict[str, bytes], rows: int) -> bool:
    """Whether ``folder`` has a manifest (False: none); a manifest that does not match its files is refused."""
    path = folder / MANIFEST
    if not path.exists():
        return False
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        sums, count = manifest["sha256"], int(manifest["records"])
    except (ValueError, KeyError, TypeError) as error:
        raise BankFileError(f"{_where(folder)}: manifest.json is damaged ({' '.join(str(error).split())}); "
                            f"{REBUILD}") from None
    wrong = [name for name in BANK_FILES if sums.get(name) != _digest(data[name])]
    if count != rows:
        wrong.insert(0, f"experiences.jsonl has {rows} records, the manifest {count}")
    if wrong:
        differ = [w for w in wrong if w in BANK_FILES]
        what = [w for w in wrong if w not in BANK_FILES]
        if differ:
            what.append(f"{', '.join(differ)} not the file{'s' if len(differ) > 1 else ''} it records")
        raise BankFileError(f"{_where(folder)}: the bank's files do not match its manifest.json ({'; '.join(what)}): "
                            f"a save was cut short or a file was changed by hand; {REBUILD}")
    return True


def _read(folder: str | Path) -> _Contents:
    """Read and check a bank folder (module docstring); nothing is logged."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{_where(folder)} holds no experience bank (no meta.json); {REBUILD}")
    data: dict[str, bytes] = {}
    for name in BANK_FILES:
        try:
            data[name] = (folder / name).read_bytes()
        except FileNotFoundError:
            raise BankFileError(f"{_where(folder)} has a meta.json but no {name}; {REBUILD}") from None
    try:
        meta = json.loads(data["meta.json"].decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (ValueError, UnicodeDecodeError) as error:
        raise BankFileError(f"{_where(folder)}: meta.json is damaged ({' '.join(str(error).split())}); "
                            f"{REBUILD}") from None
    rows = _records(folder, data["experiences.jsonl"])
    embeddings = _vectors(folder, data["embeddings.npy"])
    checked = _check_manifest(folder, data, len(rows))
    ids = np.array([r.get("id", i) for i, r in enumerate(rows)], dtype=np.int64)
    seen: set[tuple[str, str]] = set()
    keep = []
    for i, row in enumerate(rows):
        key = (str(row["task_id"]), str(row["trace"]))
        if key not in seen:
            seen.add(key)
            keep.append(i)
    duplicates = len(rows) - len(keep)
    if duplicates:
        rows = [rows[i] for i in keep]
        ids = ids[keep]
        if len(embeddings) == len(ids) + duplicates:  # else the bank re-embeds them all (another count)
            embeddings = embeddings[keep]
    renumbered = len(np.unique(ids)) != len(ids)
    if renumbered:
        ids = np.arange(len(rows), dtype=np.int64)
    return _Contents(meta, rows, ids, embeddings, checked, duplicates, renumbered)


def read_bank_folder(folder: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a folder written by :func:`write_bank_folder`: ``(stored settings, state)``, checked against its
    manifest, with the records that repeat an earlier one dropped (logged; module docstring).

    Returns:
        The constructor settings the bank was saved with, and a state for
        ``ExperienceBank.load_state_dict`` (``records``, ``ids`` (N,) int64 (line numbers where a line has
        no ``id``, or where ids repeat), ``embeddings`` (N, dim) float32, ``embedder_name``, ``next_id``,
        ``settings``, ``counters``).

    Raises:
        FileNotFoundError: no ``meta.json`` in the folder.
        BankFileError: a file is missing or damaged, or the files do not match ``manifest.json``.
    """
    contents = _read(folder)
    where = str(Path(folder))
    if not contents.checked and where not in _UNCHECKED:
        _UNCHECKED.add(where)
        log.info("experience bank %s has no manifest.json (written before lopd_lightning wrote one), so its files "
                 "are read unchecked; `lopd build-memory` writes banks with one", where)
    if contents.duplicates:
        log.warning("experience bank %s: %d records repeat an earlier one (same task_id and trace) and were dropped; "
                    "%d kept", where, contents.duplicates, len(contents.rows))
    if contents.renumbered:
        log.warning("experience bank %s: its records' ids repeat; they are numbered again in file order", where)
    meta = contents.meta
    state = {
        "records": contents.rows,
        "ids": contents.ids,
        "embeddings": contents.embeddings,
        "embedder_name": meta.get("embedder_name"),
        "next_id": meta.get("next_id", 0),
        "settings": meta.get("settings", {}),
        "counters": meta.get("counters", {}),
    }
    return meta.get("settings", {}), state


def is_empty_folder(bank_path: str | Path) -> bool:
    """True when ``bank_path`` is an existing folder with nothing in it (dot files aside): a bank to start empty."""
    folder = Path(bank_path)
    return folder.is_dir() and not any(not p.name.startswith(".") for p in folder.iterdir())


def check_bank(bank_path: str, *, capacity: int | None = None) -> int:
    """Refuse a ``bank_path`` that holds no bank, or a damaged one (:func:`read_bank_folder`'s checks), naming the
    config key; return its size (distinct records, capped at ``capacity``), so that the checks run before
    anything else is loaded. An existing empty folder is an empty bank (size 0).

    Raises:
        FileNotFoundError: no ``meta.json`` in ``bank_path`` (and it is not an empty folder).
        BankFileError: a file is missing or damaged, or the files do not match ``manifest.json``.
    """
    if is_empty_folder(bank_path):
        return 0
    if not (Path(bank_path) / "meta.json").exists():
        where = ""
        if not Path(bank_path).is_absolute() and not Path(bank_path).exists():
            where = (f" (no such folder in the working directory {str(Path.cwd())!r}: a relative path is read from "
                     f"where lopd runs, not from the config file's folder; run lopd from the folder it is relative "
                     f"to, or give an absolute path)")
        raise FileNotFoundError(
            f"model.init_args.bank_path {bank_path!r} holds no experience bank{where}; build it first with "
            f"`lopd build-memory -c CONFIG` (add --from-references for a base model that rarely succeeds), "
            f"or set model.init_args.bank_path to null to start with an empty bank that a MemoryRefresh "
            f"callback fills from the run's own successes"
        )
    size = len(_read(bank_path).rows)
    return size if capacity is None else min(size, int(capacity))


def check_bank_fills(size: int, num_experiences: int, bank_path: str | None, *, refresh: bool) -> None:
    """Refuse to train LOPD on a bank of fewer than J experiences that nothing will fill: with no experience the
    teacher sees no latents, the loss, Delta and beta stay 0, and the run trains nothing.

    With a MemoryRefresh callback (``refresh``) the bank may start empty or small: the teacher reads no
    experience until the bank holds J (:func:`~lopd_lightning.memory.module_bank.retrieve_from`), said once here
    and again by the callback when retrieval starts.

    Args:
        size: the bank's size when ``fit`` starts.
        num_experiences: J; 0 (no retrieval, the ablation) needs no bank.
        bank_path: the config's ``bank_path`` (named in the message).
        refresh: a MemoryRefresh callback will add the run's successful trajectories.

    Raises:
        ValueError: ``size`` < ``num_experiences`` and ``refresh`` is False; the message says how to fill it.
    """
    if size >= num_experiences:
        return
    refresh_fix = ("add lopd_lightning.modules.lopd_callbacks.MemoryRefresh to trainer.callbacks to fill it from the "
                   "run's own successes")
    if size == 0:
        where = f"the bank at model.init_args.bank_path {bank_path!r} is empty" if bank_path else \
            "model.init_args.bank_path is null"
        build = (f"build it with `lopd build-memory -c CONFIG --from-references` (it writes model.init_args.bank_path)"
                 if bank_path else "build a bank with `lopd build-memory -c CONFIG --from-references` and set "
                 "model.init_args.bank_path to its folder")
        if not refresh:
            raise ValueError(f"{where}, so LOPD's teacher has no experiences and every step would train nothing "
                             f"(loss 0); {build}, or {refresh_fix}")
    else:
        where = f"the bank at {bank_path!r}" if bank_path else "the bank"
        if not refresh:
            raise ValueError(
                f"num_experiences J={num_experiences} is larger than {where} ({size} experiences); set "
                f"model.init_args.num_experiences <= {size}, build a larger bank (`lopd build-memory`), or "
                f"{refresh_fix} (retrieval then starts once it holds J)"
            )
        where = f"{where} holds {size} experiences"
    log.warning("%s: LOPD's teacher reads no experience, and LOPD trains nothing, until MemoryRefresh has filled the "
                "bank to J=%d", where, num_experiences)
