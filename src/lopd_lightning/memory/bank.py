"""The experience bank: past (task, trace, reward) records and cosine retrieval with FAISS (exact by default).

docs/METHOD.md section 2: entries are (task text x_i, observation-lite trace tau_i, reward); retrieval is a
text embedder with unit-normalised vectors and a FAISS ``IndexFlatIP`` (exact cosine), top-J (J = 3);
a task does not retrieve its own records unless asked (the paper's code allows it: a switch, default
off). The paper freezes the bank after building it offline; the project may also refresh it online
(``add`` with a ``capacity`` and an eviction rule, driven by a callback).

Choices (documented once here, repeated where they act):

* What is embedded: ``embed_field="task"`` (default) embeds ``task_text`` only, so retrieval is by
  task similarity, matching queries that are task texts. ``"task_and_trace"`` embeds
  ``task_text + "\\n\\n" + trace``. Queries are always embedded as given.
* De-duplication: a record whose (task_id, trace) equals one in the bank or earlier in the same call is
  skipped. An evicted record may be added again later.
* Eviction (when ``len > capacity`` after an ``add``): ``"lowest_reward"`` drops the lowest rewards
  first, ties broken oldest first; ``"oldest"`` drops the oldest first. Age is ``(step, insertion
  order)``: a smaller ``Experience.step`` is older, equal steps fall back to the order of insertion.
  New records can be evicted by the same rule as old ones.
* Missing results: index -1, id -1, score -1.0 (the smallest cosine; use ``num_found`` or
  ``indices >= 0`` as the mask, never the score). No nan or inf.
* Index type (``index=``): ``"flat"`` is exact (``IndexFlatIP``); ``"ivf"`` (``IndexIVFFlat``, inner
  product, ``nlist = sqrt(N)`` lists, ``nprobe`` probed) and ``"hnsw"`` (``IndexHNSWFlat``, M = 32) are
  approximate; ``"auto"`` (default) is flat below ``approximate_above`` records (20,000) and IVF from
  there, chosen from ``benchmarks/results/retrieval.json`` (recall@10 and latency per size, README).
  So every bank below the threshold retrieves exactly, as before. An approximate index may miss a true
  top-k record (recall < 1): self-exclusion then filters what it found, and a row can come back short.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np
import torch

from lopd_lightning.memory.embed import TextEmbedder, embed_texts
from lopd_lightning.memory.experience import Experience, SearchResult
from lopd_lightning.memory.faiss_index import (
    AUTO_APPROXIMATE_ABOVE,
    AUTO_APPROXIMATE_KIND,
    GPU_MAX_K,
    IVF_NPROBE,
    make_index,
)
from lopd_lightning.memory.persistence import (
    STATE_VERSION,
    read_bank_folder,
    write_bank_folder,
)

__all__ = ["ExperienceBank"]

log = logging.getLogger(__name__)

EvictionRule = Literal["oldest", "lowest_reward"]
EmbedField = Literal["task", "task_and_trace"]
IndexKind = Literal["auto", "flat", "ivf", "hnsw"]


class ExperienceBank:
    """Records of past experiences with a cosine index over their embeddings (exact below ``approximate_above``).

    Args:
        embedder: a :class:`~lopd_lightning.memory.embed.TextEmbedder` (used for records and queries).
        capacity: most records kept; None = unbounded (the paper's frozen bank).
        eviction: ``"lowest_reward"`` (ties -> oldest first) or ``"oldest"``; age is ``(step, insertion
            order)``.
        allow_self_retrieval: let a query retrieve records with its own ``task_id`` (the paper's code
            does; default off, docs/METHOD.md section 2).
        min_reward: ``add`` skips experiences whose reward is below this (the paper keeps successful
            rollouts only: set it to the success threshold, e.g. 1.0 for code). Default 0.0 keeps all.
        embed_field: ``"task"`` embeds ``task_text`` (retrieval by task similarity), ``"task_and_trace"``
            embeds ``task_text + "\\n\\n" + trace``.
        use_gpu: put the FAISS index on GPU 0. None: when ``faiss.get_num_gpus() > 0``. FAISS has no GPU
            HNSW: an ``"hnsw"`` index stays on the CPU.
        index: ``"auto"`` (flat below ``approximate_above`` records, else IVF), ``"flat"`` (exact),
            ``"ivf"`` or ``"hnsw"`` (approximate). See the module docstring.
        approximate_above: the record count from which ``"auto"`` switches to the approximate index.
        nprobe: IVF lists searched per query (more: higher recall, slower).

    Raises:
        ValueError: invalid capacity, eviction, embed_field, index, approximate_above or nprobe;
            ``use_gpu=True`` without a FAISS GPU build.

    Row i of the index is record i. ``add`` appends to it (re-building when ``"auto"`` crosses the
    threshold, or an IVF index has grown to 4x the size it was trained at); eviction rebuilds it from the
    kept embeddings (no cheap delete; a trained IVF index is emptied and refilled without retraining).
    """

    def __init__(
        self,
        embedder: TextEmbedder,
        *,
        capacity: int | None = None,
        eviction: EvictionRule = "lowest_reward",
        allow_self_retrieval: bool = False,
        min_reward: float = 0.0,
        embed_field: EmbedField = "task",
        use_gpu: bool | None = None,
        index: IndexKind = "auto",
        approximate_above: int = AUTO_APPROXIMATE_ABOVE,
        nprobe: int = IVF_NPROBE,
    ) -> None:
        if capacity is not None and int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {capacity}")
        if eviction not in ("oldest", "lowest_reward"):
            raise ValueError(f"eviction must be 'oldest' or 'lowest_reward', got {eviction!r}")
        if embed_field not in ("task", "task_and_trace"):
            raise ValueError(f"embed_field must be 'task' or 'task_and_trace', got {embed_field!r}")
        if index not in ("auto", "flat", "ivf", "hnsw"):
            raise ValueError(f"index must be 'auto', 'flat', 'ivf' or 'hnsw', got {index!r}")
        if int(approximate_above) < 1 or int(nprobe) < 1:
            raise ValueError(f"approximate_above and nprobe must be >= 1, got {approximate_above}, {nprobe}")
        num_gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
        if use_gpu and num_gpus == 0:
            raise ValueError("use_gpu=True but FAISS sees no GPU (faiss-cpu build or no CUDA device)")
        self.embedder = embedder
        self.capacity = None if capacity is None else int(capacity)
        self.eviction: EvictionRule = eviction
        self.allow_self_retrieval = bool(allow_self_retrieval)
        self.min_reward = float(min_reward)
        self.embed_field: EmbedField = embed_field
        self.index: IndexKind = index
        self.approximate_above = int(approximate_above)
        self.nprobe = int(nprobe)
        self.use_gpu = num_gpus > 0 if use_gpu is None else bool(use_gpu)
        self.dim = int(embedder.dim)
        self._records: list[Experience] = []
        self._ids = np.zeros(0, dtype=np.int64)
        self._embeddings = np.zeros((0, self.dim), dtype=np.float32)
        self._keys: set[tuple[str, str]] = set()
        self._task_counts: Counter[str] = Counter()
        self._next_id = 0
        self._total_added = 0
        self._total_evicted = 0
        self._gpu_resources: Any = None
        self._last_warning = -math.inf
        self._suppressed_warnings = 0
        #: seconds between two "fewer than k" warnings (others go to DEBUG and are counted).
        self.warning_interval_s = 60.0
        self._index_kind = "flat"  # the kind of self._index ("flat", "ivf", "hnsw")
        self._trained_size = 0  # records an IVF index was trained on
        self._index = self._new_index(self._embeddings)

    # ------------------------------------------------------------------ index
    def _kind_for(self, n: int) -> str:
        """The index kind for ``n`` records."""
        if self.index == "auto":
            return "flat" if n < self.approximate_above else AUTO_APPROXIMATE_KIND
        return self.index

    @property
    def index_kind(self) -> str:
        """The kind of the index in use now: ``"flat"``, ``"ivf"`` or ``"hnsw"``."""
        return self._index_kind

    def _new_index(self, vectors: np.ndarray) -> Any:
        """A fresh index of the kind for ``len(vectors)`` (trained on them for IVF), empty."""
        kind = self._kind_for(len(vectors))
        if kind == "ivf" and len(vectors) == 0:
            kind = "flat"  # nothing to train on yet; built again once records arrive
        on_gpu = self.use_gpu and kind != "hnsw"  # FAISS has no GPU HNSW
        if on_gpu and self._gpu_resources is None:
            self._gpu_resources = faiss.StandardGpuResources()
        index = make_index(kind, vectors, dim=self.dim, nprobe=self.nprobe,
                           gpu_resources=self._gpu_resources if on_gpu else None)
        if kind == "ivf":
            self._trained_size = len(vectors)
        self._index_kind = kind
        return index

    def _needs_new_index(self, n: int) -> bool:
        kind = self._kind_for(n)
        if kind != self._index_kind:
            return not (kind == "ivf" and n == 0)
        return kind == "ivf" and (n > 4 * self._trained_size or 4 * n < self._trained_size)

    def _rebuild_index(self) -> None:
        n = len(self._records)
        if self._index_kind == "ivf" and not self._needs_new_index(n):
            self._index.reset()  # keeps the trained centroids
        else:
            self._index = self._new_index(self._embeddings)
        if n:
            self._index.add(self._embeddings)

    def _text_of(self, experience: Experience) -> str:
        if self.embed_field == "task":
            return experience.task_text
        return f"{experience.task_text}\n\n{experience.trace}"

    def _embed(self, texts: list[str]) -> np.ndarray:
        return embed_texts(self.embedder, texts)

    # ------------------------------------------------------------------ accessors
    def __len__(self) -> int:
        return len(self._records)

    @property
    def records(self) -> list[Experience]:
        """The stored experiences in insertion order (a new list; the records themselves are frozen)."""
        return list(self._records)

    @property
    def ids(self) -> np.ndarray:
        """(N,) int64 stable ids of ``records`` (assigned in insertion order, never reused)."""
        return self._ids.copy()

    @property
    def embeddings(self) -> np.ndarray:
        """(N, dim) float32 unit rows, row i embeds ``records[i]`` (a copy)."""
        return self._embeddings.copy()

    @property
    def embedder_name(self) -> str:
        return str(self.embedder.name)

    # ------------------------------------------------------------------ add / evict
    def add(self, experiences: list[Experience]) -> int:
        """Add experiences, then enforce ``capacity``.

        Skipped: rewards below ``min_reward``, and exact duplicates on (task_id, trace) of a stored
        record or of an earlier experience in the same call. The kept ones are embedded in one
        ``embed`` call and appended; if the bank then exceeds ``capacity``, records are evicted by
        the eviction rule (new ones included) and the index is rebuilt.

        Args:
            experiences: records to add (a single :class:`Experience` is accepted too).

        Returns:
            How many of ``experiences`` are in the bank after the call (not skipped, not evicted).

        Raises:
            ValueError: a reward is not finite.
            EmbedderError: the embedder failed (the bank is left unchanged).
        """
        if isinstance(experiences, Experience):
            experiences = [experiences]
        fresh: list[Experience] = []
        seen = set(self._keys)
        for exp in experiences:
            if not math.isfinite(float(exp.reward)):
                raise ValueError(f"experience of task {exp.task_id!r} has a non-finite reward {exp.reward!r}")
            if exp.reward < self.min_reward:
                continue
            key = (exp.task_id, exp.trace)
            if key in seen:
                continue
            seen.add(key)
            fresh.append(exp)
        if not fresh:
            return 0
        vectors = self._embed([self._text_of(e) for e in fresh])  # [n, dim]; raises before any change
        new_ids = np.arange(self._next_id, self._next_id + len(fresh), dtype=np.int64)
        self._next_id += len(fresh)
        self._records.extend(fresh)
        self._ids = np.concatenate([self._ids, new_ids])
        self._embeddings = np.ascontiguousarray(np.concatenate([self._embeddings, vectors]))
        self._keys.update((e.task_id, e.trace) for e in fresh)
        self._task_counts.update(e.task_id for e in fresh)
        self._total_added += len(fresh)
        if self._needs_new_index(len(self._records)):
            self._index = self._new_index(self._embeddings)
            self._index.add(self._embeddings)
        else:
            self._index.add(vectors)
        self._enforce_capacity()
        return int(np.isin(new_ids, self._ids).sum())

    def _eviction_order(self) -> list[int]:
        """Positions sorted from first-to-evict to last."""
        ids = self._ids.tolist()
        if self.eviction == "oldest":
            key = lambda i: (self._records[i].step, ids[i])  # noqa: E731
        else:
            key = lambda i: (self._records[i].reward, self._records[i].step, ids[i])  # noqa: E731
        return sorted(range(len(self._records)), key=key)

    def _enforce_capacity(self) -> int:
        if self.capacity is None or len(self._records) <= self.capacity:
            return 0
        excess = len(self._records) - self.capacity
        drop = set(self._eviction_order()[:excess])
        keep = np.array([i for i in range(len(self._records)) if i not in drop], dtype=np.int64)
        self._records = [self._records[i] for i in keep]
        self._ids = self._ids[keep]
        self._embeddings = np.ascontiguousarray(self._embeddings[keep])
        self._keys = {(e.task_id, e.trace) for e in self._records}
        self._task_counts = Counter(e.task_id for e in self._records)
        self._total_evicted += excess
        self._rebuild_index()
        log.debug("bank evicted %d record(s) (%s); %d kept", excess, self.eviction, len(self._records))
        return excess

    def reembed(self) -> None:
        """Recompute every embedding with the current embedder and rebuild the index.

        Use after the embedder's weights changed under the same ``name`` (a trained backbone).

        Raises:
            EmbedderError: the embedder failed (the bank is left unchanged).
        """
        vectors = self._embed([self._text_of(e) for e in self._records])
        self._embeddings = vectors
        self._rebuild_index()

    # ------------------------------------------------------------------ search
    def _top(self, queries: np.ndarray, fetch: int) -> tuple[np.ndarray, np.ndarray]:
        """(B, dim) unit queries -> (B, fetch) scores and positions, best first (exact for a flat index)."""
        if self.use_gpu and fetch > GPU_MAX_K:
            sims = queries @ self._embeddings.T  # [B, N]
            order = np.argsort(-sims, axis=1, kind="stable")[:, :fetch]
            return np.take_along_axis(sims, order, axis=1).astype(np.float32), order.astype(np.int64)
        scores, positions = self._index.search(queries, fetch)
        return scores, positions

    def _warn_missing(self, short: int, batch: int, k: int) -> None:
        now = time.monotonic()
        if now - self._last_warning >= self.warning_interval_s:
            extra = f" ({self._suppressed_warnings} similar warnings suppressed)" if self._suppressed_warnings else ""
            log.warning(
                "experience bank (%d records) returned fewer than k=%d results for %d of %d queries%s",
                len(self._records), k, short, batch, extra,
            )
            self._last_warning = now
            self._suppressed_warnings = 0
        else:
            self._suppressed_warnings += 1
            log.debug("bank: fewer than k=%d results for %d of %d queries", k, short, batch)

    def search(self, task_ids: list[str], queries: list[str], k: int) -> SearchResult:
        """Top-k records by cosine similarity of ``embed(query)`` with the stored embeddings (exact with a flat
        index: always below ``approximate_above`` records with ``index="auto"``; approximate with IVF/HNSW).

        Records whose ``task_id`` equals the query's are excluded unless ``allow_self_retrieval``; the
        search over-fetches ``k + max_b (records of task b)`` and filters, so the result is (flat index) the exact
        top-k among the allowed records. When fewer than k are allowed (small or empty bank), the row
        is padded (index -1, score -1.0), ``num_found`` says how many are real, and one warning is
        logged for the call (at most one per ``warning_interval_s``; the rest at DEBUG).

        Args:
            task_ids: B task ids of the queries.
            queries: B query texts (task texts), embedded with the bank's embedder.
            k: results per query (J in the paper, 3).

        Returns:
            :class:`SearchResult` with (B, k) ``indices``/``ids`` int64, (B, k) ``scores`` float32,
            ``experiences`` and (B,) ``num_found``.

        Raises:
            ValueError: ``k <= 0`` or ``task_ids`` and ``queries`` differ in length.
            EmbedderError: the embedder failed on the queries.
        """
        k = int(k)
        if k <= 0:
            raise ValueError(f"k must be >= 1, got {k}")
        if len(task_ids) != len(queries):
            raise ValueError(f"{len(task_ids)} task_ids but {len(queries)} queries")
        batch = len(queries)
        result = SearchResult.empty(batch, k)  # filled in place below
        indices, ids, scores, found, num_found = result.indices, result.ids, result.scores, result.experiences, result.num_found
        if batch == 0:
            return result
        n = len(self._records)
        if n > 0:
            vectors = self._embed(list(queries))  # [B, dim]
            own = [0 if self.allow_self_retrieval else self._task_counts.get(t, 0) for t in task_ids]
            fetch = min(n, k + max(own))
            top_scores, top_pos = self._top(vectors, fetch)  # [B, fetch]
            for b, task in enumerate(task_ids):
                j = 0
                for score, pos in zip(top_scores[b].tolist(), top_pos[b].tolist()):
                    if j == k:
                        break
                    if pos < 0:
                        continue
                    record = self._records[pos]
                    if not self.allow_self_retrieval and record.task_id == task:
                        continue
                    indices[b, j] = pos
                    ids[b, j] = self._ids[pos]
                    scores[b, j] = score
                    found[b].append(record)
                    j += 1
                num_found[b] = j
        short = int((num_found < k).sum())
        if short:
            self._warn_missing(short, batch, k)
        return result

    # ------------------------------------------------------------------ state
    def settings(self) -> dict[str, Any]:
        """The constructor options (except the embedder) as plain Python values."""
        return {
            "capacity": self.capacity,
            "eviction": self.eviction,
            "allow_self_retrieval": self.allow_self_retrieval,
            "min_reward": self.min_reward,
            "embed_field": self.embed_field,
            "index": self.index,
            "approximate_above": self.approximate_above,
            "nprobe": self.nprobe,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the bank, in types ``torch.load(weights_only=True)`` accepts.

        Returns:
            ``{"version": 1, "records": [Experience dicts], "ids": (N,) int64 tensor, "embeddings":
            (N, dim) float32 tensor, "embedder_name": str, "dim": int, "next_id": int, "settings": dict,
            "counters": {"total_added", "total_evicted"}}``.
        """
        return {
            "version": STATE_VERSION,
            "records": [e.to_dict() for e in self._records],
            "ids": torch.from_numpy(self._ids.copy()),
            "embeddings": torch.from_numpy(self._embeddings.copy()),
            "embedder_name": self.embedder_name,
            "dim": self.dim,
            "next_id": int(self._next_id),
            "settings": self.settings(),
            "counters": {"total_added": int(self._total_added), "total_evicted": int(self._total_evicted)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore records and embeddings from :meth:`state_dict` (or :meth:`load`'s files).

        The stored vectors are reused when they were made by an embedder of the same ``name``, with the
        same ``embed_field`` and dimension; otherwise every record is re-embedded with the current
        embedder (one ``embed`` call). This bank's own settings are kept (the stored ones are not
        applied, so a config can change them on resume); ``capacity`` is enforced afterwards.

        Args:
            state: a dict from :meth:`state_dict`; ``embeddings``/``ids`` may be tensors or arrays.

        Raises:
            KeyError: a required entry is missing.
            ValueError: lengths of records, ids and embeddings disagree.
            EmbedderError: re-embedding failed (the bank is left unchanged).
        """
        records = [Experience.from_dict(r) for r in state["records"]]
        n = len(records)
        ids = state.get("ids")
        ids = np.arange(n, dtype=np.int64) if ids is None else _as_numpy(ids).astype(np.int64).reshape(-1)
        if ids.shape != (n,):
            raise ValueError(f"state has {n} records but {ids.shape[0]} ids")
        stored = state.get("embeddings")
        stored = None if stored is None else _as_numpy(stored).astype(np.float32)
        stored_field = state.get("settings", {}).get("embed_field", "task")
        reuse = (
            stored is not None
            and state.get("embedder_name") == self.embedder_name
            and stored_field == self.embed_field
            and stored.shape == (n, self.dim)
        )
        if reuse:
            vectors = np.ascontiguousarray(stored)
        else:
            if stored is not None and n:
                log.info(
                    "bank: re-embedding %d records (stored embedder %r, field %r; now %r, field %r)",
                    n, state.get("embedder_name"), stored_field, self.embedder_name, self.embed_field,
                )
            vectors = self._embed([self._text_of(e) for e in records])
        self._records = records
        self._ids = ids
        self._embeddings = vectors
        self._keys = {(e.task_id, e.trace) for e in records}
        self._task_counts = Counter(e.task_id for e in records)
        self._next_id = max(int(state.get("next_id", 0)), int(ids.max()) + 1 if n else 0)
        counters = state.get("counters", {})
        self._total_added = int(counters.get("total_added", n))
        self._total_evicted = int(counters.get("total_evicted", 0))
        self._rebuild_index()
        self._enforce_capacity()

    def save(self, folder: str | Path) -> Path:
        """Write ``experiences.jsonl`` (one record a line, with its ``id``), ``embeddings.npy`` ((N, dim)
        float32), ``meta.json`` (embedder name, dim, settings, counters) and their ``manifest.json`` (record count,
        checksums) into ``folder`` (created; :func:`~lopd_lightning.memory.persistence.write_bank_folder`: a save
        that fails leaves the bank that was there).

        Returns:
            The folder.

        Raises:
            OSError: a file could not be written.
        """
        return write_bank_folder(folder, self.state_dict())

    @classmethod
    def load(cls, folder: str | Path, embedder: TextEmbedder, **settings: Any) -> ExperienceBank:
        """Read a bank written by :meth:`save`, checked against its ``manifest.json`` (a folder without one is read
        unchecked), records that repeat an earlier one dropped
        (:func:`~lopd_lightning.memory.persistence.read_bank_folder`).

        Args:
            folder: the folder of ``experiences.jsonl``, ``embeddings.npy``, ``meta.json``.
            embedder: the embedder to use from now on; stored vectors are reused when its ``name``
                matches the stored one, recomputed otherwise.
            **settings: constructor options overriding the stored ones (``capacity``, ``eviction``, ...).

        Raises:
            FileNotFoundError: no ``meta.json``.
            BankFileError: a file is missing or damaged (a line that is not a record is named by its number),
                or the files do not match ``manifest.json``.
        """
        stored, state = read_bank_folder(folder)
        bank = cls(embedder, **{**stored, **settings})
        bank.load_state_dict(state)
        return bank

    def stats(self) -> dict[str, Any]:
        """``{"size", "mean_reward" (0.0 when empty), "num_tasks", "capacity", "total_added",
        "total_evicted"}`` as plain Python numbers (for logging)."""
        rewards = [e.reward for e in self._records]
        return {
            "size": len(self._records),
            "mean_reward": float(np.mean(rewards)) if rewards else 0.0,
            "num_tasks": len(self._task_counts),
            "capacity": self.capacity,
            "total_added": int(self._total_added),
            "total_evicted": int(self._total_evicted),
        }

    def __repr__(self) -> str:
        return (
            f"ExperienceBank(size={len(self)}, embedder={self.embedder_name!r}, capacity={self.capacity}, "
            f"eviction={self.eviction!r}, embed_field={self.embed_field!r}, index={self._index_kind!r}, "
            f"gpu={self.use_gpu})"
        )


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)
