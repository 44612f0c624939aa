"""ExperienceBank: exact retrieval against NumPy, self-exclusion, eviction, persistence, caching."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import torch

from lopd_lightning.memory import EmbedderError, Experience, ExperienceBank, HashingEmbedder, SearchResult

DIM = 16


class DictEmbedder:
    """Maps each text to a fixed random unit vector (seeded by a shared generator), counts calls."""

    def __init__(self, dim: int = DIM, *, seed: int = 0, name: str = "dict") -> None:
        self.dim = dim
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.table: dict[str, np.ndarray] = {}
        self.calls = 0
        self.texts_embedded = 0

    def set(self, text: str, vector: np.ndarray) -> None:
        self.table[text] = (vector / np.linalg.norm(vector)).astype(np.float32)

    def vector(self, text: str) -> np.ndarray:
        if text not in self.table:
            self.set(text, self.rng.standard_normal(self.dim))
        return self.table[text]

    def embed(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        self.texts_embedded += len(texts)
        return np.stack([self.vector(t) for t in texts])


class FailingEmbedder(DictEmbedder):
    def embed(self, texts: list[str]) -> np.ndarray:
        raise RuntimeError("CUDA out of memory (simulated)")


def make(n_tasks: int, per_task: int = 1, *, step: int = 0) -> list[Experience]:
    return [
        Experience(f"t{i}", f"task {i}", f"trace {i}.{j}", reward=1.0, step=step)
        for i in range(n_tasks)
        for j in range(per_task)
    ]


def brute_force(emb: DictEmbedder, bank: ExperienceBank, query: str, exclude: str | None, k: int):
    records = bank.records
    mat = np.stack([emb.vector(r.task_text) for r in records]).astype(np.float64)
    sims = mat @ emb.vector(query).astype(np.float64)
    allowed = [i for i, r in enumerate(records) if r.task_id != exclude]
    order = sorted(allowed, key=lambda i: -sims[i])[:k]
    return order, sims[order]


@pytest.mark.parametrize("k", [1, 3, 7, 20])
def test_exact_top_k_matches_numpy(k):
    emb = DictEmbedder(seed=1)
    bank = ExperienceBank(emb, allow_self_retrieval=True)
    assert bank.add(make(30)) == 30
    queries = [f"query {q}" for q in range(5)]
    result = bank.search([f"q{q}" for q in range(5)], queries, k)
    assert result.indices.shape == (5, k) and result.indices.dtype == np.int64
    assert result.scores.shape == (5, k) and result.scores.dtype == np.float32
    for b, query in enumerate(queries):
        order, sims = brute_force(emb, bank, query, None, k)
        assert result.indices[b].tolist() == order
        np.testing.assert_allclose(result.scores[b], sims, atol=1e-5)
        assert [e.task_id for e in result.experiences[b]] == [f"t{i}" for i in order]
    assert result.num_found.tolist() == [k] * 5
    np.testing.assert_array_equal(result.ids, result.indices)  # no eviction yet: ids == positions


@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_exclusion_is_exact(k):
    emb = DictEmbedder(seed=2)
    # Task t0 has 6 records, all near "task 0" (distinct vectors, so no ties): without exclusion
    # they would fill every slot of the t0 query.
    base = emb.vector("task 0")
    for j in range(5):
        emb.set(f"task 0 variant {j}", base + 0.05 * emb.rng.standard_normal(DIM))
    records = make(10) + [Experience("t0", f"task 0 variant {j}", f"extra {j}", 1.0) for j in range(5)]
    bank = ExperienceBank(emb)
    bank.add(records)
    result = bank.search(["t0", "t3"], ["task 0", "task 3"], k)
    for b, (task, query) in enumerate([("t0", "task 0"), ("t3", "task 3")]):
        order, sims = brute_force(emb, bank, query, task, k)
        assert result.indices[b].tolist() == order
        np.testing.assert_allclose(result.scores[b], sims, atol=1e-5)
        assert all(e.task_id != task for e in result.experiences[b])

    allowed = ExperienceBank(emb, allow_self_retrieval=True)
    allowed.add(records)
    res = allowed.search(["t0"], ["task 0"], k)
    assert all(e.task_id == "t0" for e in res.experiences[0])
    assert res.scores[0, 0] == pytest.approx(1.0, abs=1e-5)  # its own text first
    order, sims = brute_force(emb, allowed, "task 0", None, k)
    assert res.indices[0].tolist() == order


def test_empty_bank_and_bank_smaller_than_k(caplog):
    emb = DictEmbedder(seed=3)
    bank = ExperienceBank(emb)
    with caplog.at_level(logging.WARNING, logger="lopd_lightning.memory.bank"):
        empty = bank.search(["a", "b"], ["x", "y"], 3)
    assert empty.num_found.tolist() == [0, 0]
    assert (empty.indices == -1).all() and (empty.ids == -1).all()
    assert (empty.scores == -1.0).all() and np.isfinite(empty.scores).all()
    assert empty.experiences == [[], []]
    assert emb.calls == 0  # nothing to compare against: queries are not embedded
    assert sum("fewer than k=3" in r.getMessage() for r in caplog.records) == 1  # one warning per call

    bank.add(make(3))  # t0, t1, t2
    bank.warning_interval_s = 0.0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lopd_lightning.memory.bank"):
        res = bank.search(["t0", "zz"], ["task 0", "task 9"], 5)
    assert res.num_found.tolist() == [2, 3]  # t0 excludes its own record
    assert (res.indices[0, 2:] == -1).all() and (res.scores[0, 2:] == -1.0).all()
    assert len(res.experiences[0]) == 2 and len(res.experiences[1]) == 3
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1



def test_retrieve_from_searches_the_examples_texts_under_their_ids_and_nothing_when_it_cannot_find_any(caplog):
    """memory.module_bank.retrieve_from, LOPD's and OPSD's retrieval (and task_calibration's): the bank's search
    of the examples' texts under their ids (their own task excluded); with k = 0 or an empty bank no search
    (no embedding, no warning), every row empty; k < 0 refused."""
    from types import SimpleNamespace

    from lopd_lightning.memory import retrieve_from

    emb = DictEmbedder(seed=5)
    bank = ExperienceBank(emb)
    examples = [SimpleNamespace(id="t0", text="task 0"), SimpleNamespace(id="zz", text="task 9")]
    with caplog.at_level(logging.WARNING, logger="lopd_lightning.memory.bank"):
        for k in (0, 2):
            empty = retrieve_from(bank, examples, k)
            assert empty.indices.shape == empty.ids.shape == empty.scores.shape == (2, k)
            assert empty.indices.dtype == empty.ids.dtype == np.int64 and empty.scores.dtype == np.float32
            assert (empty.indices == -1).all() and (empty.scores == -1.0).all()
            assert empty.experiences == [[], []] and empty.num_found.tolist() == [0, 0]
    assert emb.calls == 0 and not caplog.records
    bank.add(make(3))  # embeds the records: one call
    assert retrieve_from(bank, examples, 0).experiences == [[], []] and emb.calls == 1
    found, searched = retrieve_from(bank, examples, 2), bank.search(["t0", "zz"], ["task 0", "task 9"], 2)
    assert found.indices.tolist() == searched.indices.tolist() and found.scores.tolist() == searched.scores.tolist()
    assert [[e.task_id for e in row] for row in found.experiences] == [[e.task_id for e in row] for row in searched.experiences]
    assert "t0" not in [e.task_id for e in found.experiences[0]]
    with pytest.raises(ValueError, match="k must be >= 0"):
        retrieve_from(bank, examples, -1)

def test_warning_is_rate_limited(caplog):
    bank = ExperienceBank(DictEmbedder(seed=4))
    with caplog.at_level(logging.WARNING, logger="lopd_lightning.memory.bank"):
        for _ in range(5):
            bank.search(["a"], ["x"], 2)
    assert len(caplog.records) == 1


def test_invalid_arguments():
    bank = ExperienceBank(DictEmbedder())
    bank.add(make(2))
    with pytest.raises(ValueError, match="k must be"):
        bank.search(["t0"], ["q"], 0)
    with pytest.raises(ValueError, match="k must be"):
        bank.search(["t0"], ["q"], -1)
    with pytest.raises(ValueError, match="task_ids"):
        bank.search(["t0", "t1"], ["q"], 1)
    with pytest.raises(ValueError):
        ExperienceBank(DictEmbedder(), eviction="random")
    with pytest.raises(ValueError):
        ExperienceBank(DictEmbedder(), capacity=0)
    with pytest.raises(ValueError):
        ExperienceBank(DictEmbedder(), embed_field="trace")
    with pytest.raises(ValueError, match="non-finite"):
        bank.add([Experience("t", "x", "y", float("nan"))])
    empty = bank.search([], [], 2)
    assert isinstance(empty, SearchResult) and empty.indices.shape == (0, 2)


def test_deduplication_and_min_reward():
    emb = DictEmbedder()
    bank = ExperienceBank(emb, min_reward=0.5)
    a = Experience("t0", "task 0", "trace A", 1.0)
    dup, other = Experience("t0", "task 0", "trace A", 0.9, step=3), Experience("t0", "task 0", "trace B", 1.0)
    added = bank.add([a, dup, other])
    assert added == 2 and len(bank) == 2  # same (task_id, trace) within the call is skipped
    assert bank.add([a]) == 0  # already stored
    assert bank.add([Experience("t1", "task 1", "trace A", 1.0)]) == 1  # same trace, other task: kept
    assert bank.add([Experience("t2", "task 2", "t", 0.4)]) == 0  # below min_reward
    assert len(bank) == 3
    assert bank.stats() == {
        "size": 3, "mean_reward": 1.0, "num_tasks": 2, "capacity": None, "total_added": 3, "total_evicted": 0,
    }


def test_eviction_lowest_reward_ties_oldest_first():
    emb = DictEmbedder()
    bank = ExperienceBank(emb, capacity=3, eviction="lowest_reward")
    bank.add([
        Experience("a", "A", "1", 0.5, step=0),
        Experience("b", "B", "1", 0.9, step=0),
        Experience("c", "C", "1", 0.5, step=1),
    ])
    # Over capacity by 2: the lowest rewards are a and c (0.5, 0.5) -> a (older) goes first, then c.
    assert bank.add([Experience("d", "D", "1", 0.7, step=2), Experience("e", "E", "1", 0.7, step=2)]) == 2
    assert [e.task_id for e in bank.records] == ["b", "d", "e"]
    # Tie at 0.7 with equal steps: insertion order decides (d before e). A 0.2 newcomer evicts itself.
    assert bank.add([Experience("f", "F", "1", 0.2, step=3)]) == 0
    assert [e.task_id for e in bank.records] == ["b", "d", "e"]
    assert bank.add([Experience("g", "G", "1", 0.8, step=3)]) == 1
    assert [e.task_id for e in bank.records] == ["b", "e", "g"]
    assert len(bank) == 3 and bank.stats()["total_evicted"] == 4
    assert bank.ids.tolist() == [1, 4, 6]
    # The index was rebuilt: search still agrees with brute force and positions map to records.
    res = bank.search(["q"], ["B"], 3)
    assert res.experiences[0][0].task_id == "b" and res.scores[0, 0] == pytest.approx(1.0, abs=1e-5)
    assert [bank.records[i].task_id for i in res.indices[0]] == [e.task_id for e in res.experiences[0]]
    assert res.ids[0].tolist() == [int(bank.ids[i]) for i in res.indices[0]]
    # An evicted record can come back.
    assert bank.add([Experience("a", "A", "1", 1.0, step=9)]) == 1


def test_eviction_oldest():
    bank = ExperienceBank(DictEmbedder(), capacity=2, eviction="oldest")
    bank.add([Experience("a", "A", "1", 1.0, step=5), Experience("b", "B", "1", 0.0, step=1)])
    bank.add([Experience("c", "C", "1", 0.1, step=6)])
    assert [e.task_id for e in bank.records] == ["a", "c"]  # b has the smallest step
    bank.add([Experience("d", "D", "1", 0.1, step=6), Experience("e", "E", "1", 0.1, step=6)])
    assert [e.task_id for e in bank.records] == ["d", "e"]  # a (step 5), then c (step 6, inserted first)
    res = bank.search(["x"], ["D"], 2)
    assert [e.task_id for e in res.experiences[0]] == ["d", "e"]


def _same_result(r1: SearchResult, r2: SearchResult) -> None:
    np.testing.assert_array_equal(r1.indices, r2.indices)
    np.testing.assert_array_equal(r1.ids, r2.ids)
    np.testing.assert_array_equal(r1.scores, r2.scores)
    np.testing.assert_array_equal(r1.num_found, r2.num_found)
    assert r1.experiences == r2.experiences


def test_save_load_round_trip(tmp_path):
    emb = DictEmbedder(seed=5)
    bank = ExperienceBank(emb, capacity=8, eviction="oldest", embed_field="task_and_trace")
    bank.add(make(6, per_task=2, step=1))  # 12 records -> 8 kept, ids 4..11
    queries = ["task 1", "task 4", "something else"]
    before = bank.search(["t1", "t4", "zz"], queries, 3)
    bank.save(tmp_path / "bank")
    assert sorted(p.name for p in (tmp_path / "bank").iterdir()) == ["embeddings.npy", "experiences.jsonl", "manifest.json",
                                                                 "meta.json"]

    calls = emb.calls
    loaded = ExperienceBank.load(tmp_path / "bank", emb)
    assert emb.calls == calls  # same embedder name: stored vectors reused
    assert loaded.settings() == bank.settings()
    assert loaded.records == bank.records and loaded.ids.tolist() == bank.ids.tolist()
    _same_result(before, loaded.search(["t1", "t4", "zz"], queries, 3))
    # Ids keep increasing after a reload.
    loaded.add([Experience("new", "new task", "x", 1.0, step=2)])
    assert loaded.ids.max() == 12

    smaller = ExperienceBank.load(tmp_path / "bank", emb, capacity=4)  # settings can be overridden
    assert len(smaller) == 4 and smaller.capacity == 4


def test_state_dict_round_trip_through_torch_weights_only():
    emb = DictEmbedder(seed=6)
    bank = ExperienceBank(emb, capacity=10)
    bank.add(make(12, step=0))
    state = bank.state_dict()
    buffer = io.BytesIO()
    torch.save({"bank": state}, buffer)
    buffer.seek(0)
    restored_state = torch.load(buffer, weights_only=True)["bank"]
    assert isinstance(restored_state["embeddings"], torch.Tensor)

    other = ExperienceBank(emb, capacity=10)
    calls = emb.calls
    other.load_state_dict(restored_state)
    assert emb.calls == calls
    assert other.records == bank.records
    assert other.stats() == bank.stats()
    _same_result(bank.search(["t3", "x"], ["task 3", "q"], 4), other.search(["t3", "x"], ["task 3", "q"], 4))


def test_embedding_cache_recomputed_when_name_differs(tmp_path):
    emb = DictEmbedder(seed=7, name="dict-v1")
    bank = ExperienceBank(emb)
    bank.add(make(5))
    bank.save(tmp_path / "b")
    state = bank.state_dict()

    renamed = DictEmbedder(seed=7, name="dict-v2")
    fresh = ExperienceBank(renamed)
    fresh.load_state_dict(state)
    assert renamed.calls == 1 and renamed.texts_embedded == 5  # one batched re-embedding

    renamed2 = DictEmbedder(seed=7, name="dict-v2")
    ExperienceBank.load(tmp_path / "b", renamed2)
    assert renamed2.calls == 1 and renamed2.texts_embedded == 5

    same = DictEmbedder(seed=7, name="dict-v1")
    ExperienceBank(same).load_state_dict(state)
    assert same.calls == 0

    # A different embed_field invalidates the vectors too (they embed other text).
    other_field = DictEmbedder(seed=7, name="dict-v1")
    ExperienceBank(other_field, embed_field="task_and_trace").load_state_dict(state)
    assert other_field.calls == 1


def test_embedder_error_surfaces():
    bad = FailingEmbedder(name="flaky")
    bank = ExperienceBank(bad)
    with pytest.raises(EmbedderError, match=r"'flaky'.*3 text") as info:
        bank.add(make(3))
    assert info.value.embedder_name == "flaky" and info.value.num_texts == 3
    assert isinstance(info.value.__cause__, RuntimeError)
    assert len(bank) == 0  # unchanged

    class WrongShape(DictEmbedder):
        def embed(self, texts):
            return np.zeros((len(texts), self.dim + 1), dtype=np.float32)

    with pytest.raises(EmbedderError, match="shape"):
        ExperienceBank(WrongShape(name="wide")).add(make(2))

    good = DictEmbedder(name="ok")
    bank = ExperienceBank(good)
    bank.add(make(2))
    bank.embedder = FailingEmbedder(name="flaky")
    with pytest.raises(EmbedderError, match="2 text"):
        bank.search(["a", "b"], ["x", "y"], 1)


def test_with_hashing_embedder_and_reembed():
    emb = HashingEmbedder(dim=128)
    bank = ExperienceBank(emb)
    bank.add([
        Experience("a", "sort a list of integers in python", "def f(xs): return sorted(xs)", 1.0),
        Experience("b", "book a flight from Paris to Rome", "search_flights(...)", 1.0),
        Experience("c", "reverse a string in python", "def f(s): return s[::-1]", 1.0),
    ])
    res = bank.search(["q"], ["sort a list of numbers in python"], 1)
    assert res.experiences[0][0].task_id == "a"
    before = bank.embeddings
    bank.reembed()
    np.testing.assert_allclose(bank.embeddings, before, atol=1e-6)
    assert len(repr(bank)) > 0


# ---------------------------------------------------------------------- the modules the bank is built from
def test_bank_folder_files_round_trip_without_a_bank(tmp_path):
    """persistence.write_bank_folder / read_bank_folder: the folder format on its own (meta.json, JSON lines, .npy)."""
    import json

    from lopd_lightning.memory.persistence import STATE_VERSION, read_bank_folder, write_bank_folder

    bank = ExperienceBank(DictEmbedder(seed=7), capacity=5, eviction="oldest")
    bank.add(make(7, step=3))  # 7 records -> 5 kept, ids 2..6
    state = bank.state_dict()
    assert write_bank_folder(tmp_path / "b", state) == tmp_path / "b"
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert meta["version"] == STATE_VERSION and meta["size"] == 5 and meta["next_id"] == 7
    assert meta["settings"] == bank.settings() and meta["embedder_name"] == "dict" and meta["dim"] == DIM
    first = json.loads((tmp_path / "b" / "experiences.jsonl").read_text().splitlines()[0])
    assert first == {"id": 2, **bank.records[0].to_dict()}
    settings, read = read_bank_folder(tmp_path / "b")
    assert settings == bank.settings()
    assert read["ids"].dtype == np.int64 and read["ids"].tolist() == [2, 3, 4, 5, 6]
    assert read["embeddings"].dtype == np.float32 and np.array_equal(read["embeddings"], bank.embeddings)
    assert [Experience.from_dict(r) for r in read["records"]] == bank.records
    assert read["counters"] == {"total_added": 7, "total_evicted": 2}
    with pytest.raises(FileNotFoundError):
        read_bank_folder(tmp_path / "nothing_here")


@pytest.mark.parametrize("kind, faiss_class", [("flat", "IndexFlatIP"), ("ivf", "IndexIVFFlat"), ("hnsw", "IndexHNSWFlat")])
def test_make_index_builds_each_kind_empty_and_searchable(kind, faiss_class):
    import faiss

    from lopd_lightning.memory.faiss_index import HNSW_EF_SEARCH, make_index

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((200, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = make_index(kind, vectors, dim=DIM, nprobe=4)
    assert type(index).__name__ == faiss_class and index.ntotal == 0 and index.metric_type == faiss.METRIC_INNER_PRODUCT
    if kind == "ivf":
        assert index.is_trained and index.nprobe == 4
    if kind == "hnsw":
        assert index.hnsw.efSearch == HNSW_EF_SEARCH
    index.add(vectors)
    scores, positions = index.search(vectors[:3], 1)
    assert positions[:, 0].tolist() == [0, 1, 2] and np.allclose(scores[:, 0], 1.0, atol=1e-5)
