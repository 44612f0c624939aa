"""The FAISS indexes of the experience bank: exact (flat) and approximate (IVF, HNSW) inner-product search.

Every index searches unit vectors by inner product, i.e. by cosine (docs/METHOD.md section 2: FAISS
``IndexFlatIP``, exact). The approximate kinds and their settings were chosen from
``benchmarks/results/retrieval.json`` (recall@10 and latency per size, README); see
:mod:`lopd_lightning.memory.bank` for when the bank uses which.
"""

from __future__ import annotations

import math
from typing import Any

import faiss
import numpy as np

__all__ = [
    "AUTO_APPROXIMATE_ABOVE",
    "AUTO_APPROXIMATE_KIND",
    "GPU_MAX_K",
    "HNSW_EF_CONSTRUCTION",
    "HNSW_EF_SEARCH",
    "HNSW_M",
    "IVF_NPROBE",
    "build_ivf",
    "make_index",
]

#: ``index="auto"``: exact flat search below this many records, :data:`AUTO_APPROXIMATE_KIND` from here.
AUTO_APPROXIMATE_ABOVE = 20_000
#: The approximate index of ``index="auto"``: IVF builds far faster than HNSW, refills cheaply after
#: eviction (no retraining) and runs on FAISS GPU (HNSW does not); build and search times per size are in
#: benchmarks/results/retrieval.json (benchmarks/retrieval.py).
AUTO_APPROXIMATE_KIND = "ivf"
#: IVF lists probed per query. Recall is high on clustered data and low on structureless random unit
#: vectors (the worst case; use ``index="flat"`` for exactness); recall@10 per size and data kind:
#: benchmarks/results/retrieval.json.
IVF_NPROBE = 16
#: HNSW graph degree and search breadth.
HNSW_M = 32
HNSW_EF_SEARCH = 128
HNSW_EF_CONSTRUCTION = 80
#: Largest k that FAISS GPU indexes accept in one search; larger over-fetches are done in NumPy (exact).
GPU_MAX_K = 2048


def make_index(kind: str, vectors: np.ndarray, *, dim: int, nprobe: int, gpu_resources: Any = None) -> Any:
    """An empty inner-product index of ``kind``, ready for ``add``.

    Args:
        kind: ``"flat"`` (``IndexFlatIP``, exact), ``"ivf"`` (:func:`build_ivf`, trained on ``vectors``) or
            ``"hnsw"`` (``IndexHNSWFlat``, M = :data:`HNSW_M`).
        vectors: (N, dim) float32 unit rows; the training set of an IVF index (N >= 1), unused otherwise.
        dim: the vectors' dimension.
        nprobe: IVF lists searched per query.
        gpu_resources: a ``faiss.StandardGpuResources`` to put the index on GPU 0, or None (CPU). FAISS has
            no GPU HNSW: an ``"hnsw"`` index stays on the CPU whatever is given.

    Returns:
        The index (a FAISS CPU or GPU index), with no vectors added.
    """
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        index.hnsw.efSearch = HNSW_EF_SEARCH
        return index  # FAISS has no GPU HNSW
    index = build_ivf(vectors, nprobe=nprobe) if kind == "ivf" else faiss.IndexFlatIP(dim)
    if gpu_resources is not None:
        index = faiss.index_cpu_to_gpu(gpu_resources, 0, index)
        if kind == "ivf":
            faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", nprobe)
    return index


def build_ivf(vectors: np.ndarray, *, nprobe: int = IVF_NPROBE, nlist: int | None = None, seed: int = 0) -> Any:
    """An empty, trained ``faiss.IndexIVFFlat`` (inner product) for ``vectors``.

    Args:
        vectors: (N, dim) float32 unit rows, N >= 1; the k-means training set (at most 64 per list are
            sampled, 10 iterations; build times: benchmarks/results/retrieval.json).
        nprobe: lists searched per query (clipped to ``nlist``).
        nlist: inverted lists; default ``round(sqrt(N))``, at most ``N // 39`` (FAISS's minimum of 39
            training points per list), at least 1 (one list: exact search).
        seed: k-means seed.

    Returns:
        The CPU index, trained, with no vectors added.
    """
    n, dim = vectors.shape
    if nlist is None:
        nlist = max(1, min(int(round(math.sqrt(n))), n // 39))
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.cp.niter = 10
    index.cp.max_points_per_centroid = 64
    index.cp.seed = seed
    index.train(np.ascontiguousarray(vectors, dtype=np.float32))
    index.nprobe = min(int(nprobe), nlist)
    return index
