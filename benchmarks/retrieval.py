"""Retrieval: FAISS index types against exact NumPy search, and the embedder's cost, by bank size.

Measures one thing: what top-k cosine retrieval over N unit vectors (dim 384, MiniLM's) costs, and how
exact it is, for each index type the experience bank can use (``ExperienceBank(index=...)``):

- ``numpy``: the exact reference, ``Q @ X.T`` then ``argpartition`` + sort of the top k.
- ``flat``: ``faiss.IndexFlatIP`` (exact).
- ``ivf``: ``faiss.IndexIVFFlat`` as the bank builds it (:func:`lopd_lightning.memory.faiss_index.build_ivf`:
  sqrt(N) lists, k-means of 10 iterations on <= 64 points per list), at several ``nprobe``.
- ``hnsw``: ``faiss.IndexHNSWFlat`` with the bank's M and efConstruction, at several ``efSearch``.

Per (data, N, index): build seconds (training included), index memory (``len(faiss.serialize_index)``;
the float32 matrix for NumPy), latency per query (median over ``--repeats`` of a batch of ``--queries``
queries, divided by the batch; and of single queries), recall@k against the NumPy top-k (the mean over
queries of |found & exact| / k).

Data: ``uniform`` (random unit vectors: the hardest case for IVF/HNSW, no structure) and ``clustered``
(a mixture of 500 random unit centres with Gaussian spread 0.6/sqrt(d) per coordinate, renormalised:
closer to real text embeddings, whose neighbours concentrate); queries are fresh draws from the same
distribution. Embedder: seconds per text of ``get_embedder("minilm")`` and ``"hashing"`` on ``--texts``
short task-like texts (batch, median of 3 after a warm-up).

Run::

    python benchmarks/retrieval.py [--sizes 1000,10000,100000] [--k 10] [--queries 64] [--threads 1]
                                   [--out benchmarks/results/retrieval.json] [--quick]

The JSON is ``{"benchmark": "retrieval", "settings", "results": [{"data", "n", "index", "param", "build_seconds",
"memory_bytes", "latency_ms_per_query_batch", "latency_ms_single", "recall_at_k"}], "embedders": {...},
"auto": {...}}`` plus :func:`common.run_metadata`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` next to this file, when imported too
from common import run_metadata, write_json_atomic  # noqa: E402

from lopd_lightning.memory import faiss_index  # noqa: E402
from lopd_lightning.memory.embed import get_embedder  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "retrieval.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file to write")
    p.add_argument("--sizes", default="1000,10000,100000", help="comma-separated N")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--queries", type=int, default=64, help="queries per batch")
    p.add_argument("--single", type=int, default=16, help="single queries timed (median)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--data", default="uniform,clustered")
    p.add_argument("--nprobe", default="4,16,64", help="IVF nprobe values")
    p.add_argument("--ef-search", default="32,128", help="HNSW efSearch values")
    p.add_argument("--hnsw-max-n", type=int, default=100_000, help="skip HNSW above this N (build time)")
    p.add_argument("--embedders", default="hashing,minilm")
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="FAISS (OpenMP) and torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tests: N 500,2000, dim 32, hashing embedder only")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.dim, args.queries, args.single, args.repeats = "500,2000", 32, 16, 4, 2
        args.embedders, args.texts = "hashing", 8
    args.sizes = [int(x) for x in str(args.sizes).split(",") if x.strip()]
    args.data = [x.strip() for x in args.data.split(",") if x.strip()]
    args.nprobe = [int(x) for x in str(args.nprobe).split(",") if x.strip()]
    args.ef_search = [int(x) for x in str(args.ef_search).split(",") if x.strip()]
    args.embedders = [x.strip() for x in args.embedders.split(",") if x.strip()]
    return args


# ------------------------------------------------------------------ data
def _unit(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x / np.linalg.norm(x, axis=1, keepdims=True), dtype=np.float32)


def make_data(kind: str, n: int, n_queries: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(N, dim) unit data and (Q, dim) unit queries of ``kind`` ("uniform" or "clustered")."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return _unit(rng.standard_normal((n, dim))), _unit(rng.standard_normal((n_queries, dim)))
    if kind == "clustered":
        centres = _unit(rng.standard_normal((500, dim)))
        spread = 0.6 / np.sqrt(dim)

        def draw(m: int) -> np.ndarray:
            return _unit(centres[rng.integers(0, len(centres), m)] + spread * rng.standard_normal((m, dim)))

        return draw(n), draw(n_queries)
    raise ValueError(f"unknown data {kind!r}")


def exact_top_k(data: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """(Q, k) positions of the k largest inner products, best first (NumPy, exact)."""
    sims = queries @ data.T  # [Q, N]
    k = min(k, data.shape[0])
    part = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(sims, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)


def recall(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean over rows of |found & exact| / k (-1 entries of ``found`` never match)."""
    k = exact.shape[1]
    return float(np.mean([len(set(f.tolist()) & set(e.tolist())) / k for f, e in zip(found, exact)]))


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------ one size
def bench_size(args: argparse.Namespace, kind: str, n: int) -> list[dict[str, Any]]:
    data, queries = make_data(kind, n, args.queries, args.dim, args.seed + n)
    k = args.k
    exact = exact_top_k(data, queries, k)
    rows: list[dict[str, Any]] = []

    def single_ms(search) -> float:
        times = []
        for q in queries[: args.single]:
            t0 = time.perf_counter()
            search(q[None])
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times)

    def row(index_name: str, param: dict, build: float, memory: int, search) -> dict[str, Any]:
        search(queries[:1])  # warm-up
        batch_s = _median_seconds(lambda: search(queries), args.repeats)
        found = search(queries)
        out = {"data": kind, "n": n, "index": index_name, "param": param, "build_seconds": round(build, 4),
               "memory_bytes": int(memory), "latency_ms_per_query_batch": round(1000 * batch_s / len(queries), 4),
               "latency_ms_single": round(single_ms(search), 4), "recall_at_k": round(recall(found, exact), 4)}
        print(out, file=sys.stderr)
        return out

    rows.append(row("numpy", {}, 0.0, data.nbytes, lambda q: exact_top_k(data, q, k)))

    t0 = time.perf_counter()
    flat = faiss.IndexFlatIP(args.dim)
    flat.add(data)
    build = time.perf_counter() - t0
    rows.append(row("flat", {}, build, len(faiss.serialize_index(flat)), lambda q: flat.search(q, k)[1]))

    t0 = time.perf_counter()
    ivf = faiss_index.build_ivf(data)
    ivf.add(data)
    build = time.perf_counter() - t0
    memory = len(faiss.serialize_index(ivf))
    for nprobe in args.nprobe:
        ivf.nprobe = min(nprobe, ivf.nlist)
        rows.append(row("ivf", {"nlist": int(ivf.nlist), "nprobe": int(ivf.nprobe)}, build, memory,
                        lambda q: ivf.search(q, k)[1]))

    if n <= args.hnsw_max_n:
        t0 = time.perf_counter()
        hnsw = faiss.IndexHNSWFlat(args.dim, faiss_index.HNSW_M, faiss.METRIC_INNER_PRODUCT)
        hnsw.hnsw.efConstruction = faiss_index.HNSW_EF_CONSTRUCTION
        hnsw.add(data)
        build = time.perf_counter() - t0
        memory = len(faiss.serialize_index(hnsw))
        for ef in args.ef_search:
            hnsw.hnsw.efSearch = ef
            rows.append(row("hnsw", {"M": faiss_index.HNSW_M, "efConstruction": faiss_index.HNSW_EF_CONSTRUCTION,
                                     "efSearch": ef}, build, memory, lambda q: hnsw.search(q, k)[1]))
        return rows


# ------------------------------------------------------------------ embedders
TEXT_TEMPLATES = (
    "Repeat the word: {w}",
    "Write a Python function that returns the {w} of a list of integers.",
    "Call the weather API for the city of {w} and report the temperature in Celsius.",
    "What is the capital of {w}? Answer with one word.",
)
WORDS = ("apple", "river", "median", "Paris", "maximum", "cloud", "sum", "Tokyo")


def bench_embedders(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    texts = [TEXT_TEMPLATES[i % len(TEXT_TEMPLATES)].format(w=WORDS[(i // 4) % len(WORDS)]) + f" (#{i})"
             for i in range(args.texts)]
    out: dict[str, Any] = {}
    for name in args.embedders:
        try:
            t0 = time.perf_counter()
            embedder = get_embedder(name)
            load = time.perf_counter() - t0
        except Exception as err:  # e.g. the MiniLM wheel is not installed: record, do not fail
            out[name] = {"error": f"{type(err).__name__}: {err}"}
            continue
        embedder.embed(texts[:2])  # warm-up
        batch = _median_seconds(lambda: embedder.embed(texts), 3)
        single = statistics.median(_median_seconds(lambda t=t: embedder.embed([t]), 1) for t in texts[:8])
        out[name] = {"name": str(getattr(embedder, "name", name)), "dim": int(embedder.dim), "texts": len(texts),
                     "load_seconds": round(load, 3), "ms_per_text_batch": round(1000 * batch / len(texts), 4),
                     "ms_single_text": round(1000 * single, 4)}
        print(name, out[name], file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    faiss.omp_set_num_threads(args.threads)
    t_start = time.perf_counter()
    results: list[dict[str, Any]] = []
    for kind in args.data:
        for n in args.sizes:
            results.extend(bench_size(args, kind, n))
    embedders = bench_embedders(args)
    report: dict[str, Any] = {
        "benchmark": "retrieval",
        "settings": {"sizes": args.sizes, "dim": args.dim, "k": args.k, "queries": args.queries,
                     "single_queries": args.single, "repeats": args.repeats, "data": args.data,
                     "nprobe": args.nprobe, "ef_search": args.ef_search, "threads": args.threads,
                     "faiss_gpu": False, "quick": args.quick},
        "results": results,
        "embedders": embedders,
        "auto": {"approximate_above": faiss_index.AUTO_APPROXIMATE_ABOVE,
                 "approximate_kind": faiss_index.AUTO_APPROXIMATE_KIND, "ivf_nprobe": faiss_index.IVF_NPROBE,
                 "hnsw": {"M": faiss_index.HNSW_M, "efSearch": faiss_index.HNSW_EF_SEARCH,
                          "efConstruction": faiss_index.HNSW_EF_CONSTRUCTION}},
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        **run_metadata(seed=args.seed, argv=argv),
    }
    write_json_atomic(report, args.out)
    return report


if __name__ == "__main__":
    main()
