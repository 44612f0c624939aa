"""The experience bank on disk: ``experiences.jsonl``, ``embeddings.npy`` and ``meta.json`` in one folder.

:meth:`ExperienceBank.save <lopd_lightning.memory.bank.ExperienceBank.save>` writes the folder from the
bank's :meth:`~lopd_lightning.memory.bank.ExperienceBank.state_dict`, and
:meth:`~lopd_lightning.memory.bank.ExperienceBank.load` restores a bank from what :func:`read_bank_folder`
reads. ``lopd build-memory`` writes such folders; ``model.init_args.bank_path`` names one.

Files:
    experiences.jsonl  one record a line: ``{"id", "task_id", "task_text", "trace", "reward", "step"}``
    embeddings.npy     (N, dim) float32, row i embeds line i
    meta.json          ``{"version", "embedder_name", "dim", "size", "next_id", "settings", "counters"}``
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["STATE_VERSION", "read_bank_folder", "write_bank_folder"]

#: Format version of ``ExperienceBank.state_dict()`` and of ``meta.json``.
STATE_VERSION = 1


def write_bank_folder(folder: str | Path, state: dict[str, Any]) -> Path:
    """Write a bank's state into ``folder`` (created): ``experiences.jsonl``, ``embeddings.npy``, ``meta.json``.

    Args:
        folder: the bank folder.
        state: ``ExperienceBank.state_dict()``: ``records`` (dicts), ``ids`` ((N,) int64), ``embeddings``
            ((N, dim) float32; tensors or arrays), ``embedder_name``, ``dim``, ``next_id``, ``settings``,
            ``counters``.

    Returns:
        The folder.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = np.asarray(state["ids"]).tolist()
    with open(folder / "experiences.jsonl", "w", encoding="utf-8") as fh:
        for rid, record in zip(ids, state["records"]):
            fh.write(json.dumps({"id": rid, **record}, ensure_ascii=False) + "\n")
    np.save(folder / "embeddings.npy", np.asarray(state["embeddings"], dtype=np.float32))
    meta = {
        "version": STATE_VERSION,
        "embedder_name": state["embedder_name"],
        "dim": state["dim"],
        "size": len(state["records"]),
        "next_id": state["next_id"],
        "settings": state["settings"],
        "counters": state["counters"],
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return folder


def read_bank_folder(folder: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a folder written by :func:`write_bank_folder`: ``(stored settings, state)``.

    Returns:
        The constructor settings the bank was saved with, and a state for
        ``ExperienceBank.load_state_dict`` (``records``, ``ids`` (N,) int64 (line numbers where a line has
        no ``id``), ``embeddings`` (N, dim) float32, ``embedder_name``, ``next_id``, ``settings``,
        ``counters``).

    Raises:
        FileNotFoundError: a file is missing.
    """
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    with open(folder / "experiences.jsonl", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    embeddings = np.load(folder / "embeddings.npy")
    state = {
        "records": rows,
        "ids": np.array([r.get("id", i) for i, r in enumerate(rows)], dtype=np.int64),
        "embeddings": embeddings,
        "embedder_name": meta.get("embedder_name"),
        "next_id": meta.get("next_id", 0),
        "settings": meta.get("settings", {}),
        "counters": meta.get("counters", {}),
    }
    return meta.get("settings", {}), state


def check_bank(bank_path: str, num_experiences: int, *, capacity: int | None = None, size: int | None = None) -> None:
    """Refuse a ``bank_path`` that holds no bank, or a bank smaller than J, naming the config keys.

    Args:
        size: the bank's size (default: read from its ``meta.json``, capped at ``capacity``), so the check
            runs before anything is loaded.

    Raises:
        FileNotFoundError: no ``meta.json`` in ``bank_path``.
        ValueError: the bank holds fewer than ``num_experiences`` experiences.
    """
    meta = Path(bank_path) / "meta.json"
    if not meta.exists():
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
    if size is None:
        size = json.loads(meta.read_text(encoding="utf-8")).get("size")
        if size is None:
            return  # a bank written without its size: checked once it is loaded
        size = int(size) if capacity is None else min(int(size), int(capacity))
    if size < num_experiences:
        raise ValueError(
            f"num_experiences J={num_experiences} is larger than the bank at {bank_path!r} "
            f"({size} experiences); set model.init_args.num_experiences <= {size} "
            f"or build a larger bank (`lopd build-memory`)"
        )


def check_bank_fills(size: int, num_experiences: int, bank_path: str | None, *, refresh: bool) -> None:
    """Refuse to train LOPD on an empty bank that nothing will fill: with no experience the teacher sees no
    latents, the loss, Delta and beta stay 0, and the run trains nothing.

    Args:
        size: the bank's size when ``fit`` starts.
        num_experiences: J; 0 (no retrieval, the ablation) needs no bank.
        bank_path: the config's ``bank_path`` (named in the message).
        refresh: a MemoryRefresh callback will add the run's successful trajectories; the bank may then start
            empty, and the callback says how many steps ran before the first experience.

    Raises:
        ValueError: ``size`` is 0, ``num_experiences`` > 0 and ``refresh`` is False.
    """
    if size or not num_experiences:
        return
    where = f"the bank at {bank_path!r} is empty" if bank_path else "model.init_args.bank_path is null"
    if not refresh:
        raise ValueError(
            f"{where}, so LOPD's teacher has no experiences and every step would train nothing (loss 0); build a "
            f"bank with `lopd build-memory -c CONFIG --from-references` and set model.init_args.bank_path to its "
            f"folder, or add lopd_lightning.modules.lopd_callbacks.MemoryRefresh to trainer.callbacks to fill it "
            f"from the run's own successes"
        )
    log.warning("%s: LOPD trains nothing until MemoryRefresh adds the run's first successful trajectory", where)
