"""The performance work: the chunked distillation loss (values and gradients equal the unchunked one), the
bank's index choice, and the three benchmarks (loss_memory, rollouts, retrieval) run end to end in quick
mode into tmp_path with their JSON keys checked."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lopd_lightning.losses.lm_head import chunked_topk_tail_reverse_kl
from lopd_lightning.losses import topk_tail_reverse_kl
from lopd_lightning.memory import Experience, ExperienceBank
from lopd_lightning.memory.faiss_index import build_ivf
from helpers import load_benchmark

METADATA_KEYS = ("versions", "hardware", "seed", "git_sha", "timestamp", "argv")


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ------------------------------------------------------------------ chunked loss
def _inputs(n: int, d: int, v: int, dtype: torch.dtype, *, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_(True)  # [N, d]
    teacher = (student.detach() + 0.5 * torch.randn(n, d, generator=g, dtype=dtype)).requires_grad_(True)
    weight = torch.randn(v, d, generator=g, dtype=dtype).requires_grad_(True)  # [V, d]
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_(True) if bias else None
    upstream = torch.rand(n, generator=g, dtype=dtype)  # a non-uniform weight per token
    return student, teacher, weight, b, upstream


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 13, 64])  # 13 divides N = 13; 4 and 7 do not
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_reverse_kl_equals_unchunked_values_and_gradients(chunk_size, dtype):
    student, teacher, weight, bias, upstream = _inputs(13, 8, 40, dtype, bias=chunk_size == 7)
    leaves = [x for x in (student, teacher, weight, bias) if x is not None]
    ref = topk_tail_reverse_kl(F.linear(student, weight, bias), F.linear(teacher, weight, bias), top_k=5,
                               temperature=0.8)  # [N]
    ref_grads = torch.autograd.grad((ref * upstream).sum(), leaves)
    out = chunked_topk_tail_reverse_kl(student, teacher, weight, top_k=5, temperature=0.8, chunk_size=chunk_size,
                                       lm_head_bias=bias)
    grads = torch.autograd.grad((out * upstream).sum(), leaves)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    assert out.shape == ref.shape == (13,) and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **tol)
    for name, g, r in zip(("student", "teacher", "weight", "bias"), grads, ref_grads):
        torch.testing.assert_close(g, r, **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_chunked_reverse_kl_leading_shape_detached_teacher_and_no_grad():
    student, teacher, weight, _, _ = _inputs(12, 8, 30, torch.float64, bias=False)
    s3, t3 = student.reshape(3, 4, 8), teacher.detach().reshape(3, 4, 8)  # (B, T, d)
    out = chunked_topk_tail_reverse_kl(s3, t3, weight.detach(), top_k=3, chunk_size=5)
    ref = topk_tail_reverse_kl(s3 @ weight.detach().T, t3 @ weight.detach().T, top_k=3)
    assert out.shape == (3, 4)
    torch.testing.assert_close(out, ref)
    (g,) = torch.autograd.grad(out.sum(), [student])  # only the student requires grad here
    (r,) = torch.autograd.grad(ref.sum(), [student])
    torch.testing.assert_close(g, r)
    with torch.no_grad():
        torch.testing.assert_close(chunked_topk_tail_reverse_kl(s3, t3, weight, top_k=3, chunk_size=5), ref)
    # k >= V: the exact full-vocabulary reverse KL, as the unchunked function
    full = chunked_topk_tail_reverse_kl(s3, t3, weight.detach(), top_k=30, chunk_size=5)
    torch.testing.assert_close(full, topk_tail_reverse_kl(s3 @ weight.detach().T, t3 @ weight.detach().T, top_k=30))


def test_chunked_reverse_kl_empty_and_errors():
    w = torch.randn(10, 4)
    empty = chunked_topk_tail_reverse_kl(torch.zeros(0, 4), torch.zeros(0, 4), w, top_k=2)
    assert empty.shape == (0,) and empty.dtype == torch.float32
    h = torch.randn(3, 4)
    with pytest.raises(ValueError, match="hidden shape"):
        chunked_topk_tail_reverse_kl(h, torch.randn(2, 4), w)
    with pytest.raises(ValueError, match="lm_head_weight"):
        chunked_topk_tail_reverse_kl(h, h, torch.randn(10, 5))
    with pytest.raises(ValueError, match="lm_head_bias"):
        chunked_topk_tail_reverse_kl(h, h, w, lm_head_bias=torch.zeros(9))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_topk_tail_reverse_kl(h, h, w, chunk_size=0)
    with pytest.raises(ValueError, match="k must"):
        chunked_topk_tail_reverse_kl(h, h, w, top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_topk_tail_reverse_kl(h, h, w, temperature=0.0)


# ------------------------------------------------------------------ bank index choice
class _TableEmbedder:
    """Texts "v<i>" map to row i of a fixed table of unit vectors."""

    name = "table"

    def __init__(self, vectors: np.ndarray) -> None:
        self.vectors = vectors
        self.dim = vectors.shape[1]

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.stack([self.vectors[int(t[1:])] for t in texts])


def _unit_rows(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _records(n: int, offset: int = 0) -> list[Experience]:
    return [Experience(f"t{i}", f"v{i}", f"trace {i}", 1.0) for i in range(offset, offset + n)]


def test_bank_auto_index_switches_to_ivf_above_threshold_and_back_after_eviction():
    vectors = _unit_rows(700, 16, 0)
    bank = ExperienceBank(_TableEmbedder(vectors), approximate_above=400, nprobe=64, capacity=650,
                          eviction="oldest", allow_self_retrieval=True)
    assert bank.index == "auto" and bank.index_kind == "flat"
    bank.add(_records(300))
    assert bank.index_kind == "flat"
    bank.add(_records(300, offset=300))  # 600 >= 400: rebuilt as IVF, trained on all 600
    assert bank.index_kind == "ivf" and bank._index.ntotal == 600
    result = bank.search(["q"], ["v5"], 3)
    assert result.indices[0, 0] == 5  # nprobe covers every list here: exact
    bank.add(_records(100, offset=600))  # 700 > capacity 650: evicts 50, refills the trained IVF
    assert len(bank) == 650 and bank.index_kind == "ivf" and bank._index.ntotal == 650
    assert bank.settings()["index"] == "auto" and bank.settings()["approximate_above"] == 400


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_bank_approximate_indexes_recall(kind):
    vectors = _unit_rows(2000, 16, 1)
    bank = ExperienceBank(_TableEmbedder(vectors), index=kind, allow_self_retrieval=True)
    bank.add(_records(2000))
    assert bank.index_kind == kind
    queries = list(range(0, 2000, 40))  # 50 stored vectors as queries: their own row is the top hit
    result = bank.search([f"q{i}" for i in queries], [f"v{i}" for i in queries], 5)
    hits = np.mean(result.indices[:, 0] == np.array(queries))
    assert hits >= 0.9, hits
    assert (result.num_found == 5).all()


def test_bank_invalid_index_and_flat_is_unchanged():
    emb = _TableEmbedder(_unit_rows(10, 8, 2))
    with pytest.raises(ValueError, match="index"):
        ExperienceBank(emb, index="lsh")
    with pytest.raises(ValueError, match="approximate_above"):
        ExperienceBank(emb, approximate_above=0)
    bank = ExperienceBank(emb, index="flat", approximate_above=1)
    bank.add(_records(10))
    assert bank.index_kind == "flat"


def test_build_ivf_small_n_has_one_list():
    index = build_ivf(_unit_rows(50, 8, 3))
    assert index.nlist == 1 and index.is_trained


# ------------------------------------------------------------------ benchmarks, quick mode
def _check_metadata(data: dict, argv: list[str]) -> None:
    for key in METADATA_KEYS:
        assert key in data, key
    assert data["argv"] == argv and data["seed"] == 0
    assert {"python", "torch", "faiss"} <= set(data["versions"])


def test_loss_memory_quick(tmp_path):
    out = tmp_path / "loss_memory.json"
    argv = ["--quick", "--out", str(out)]
    report = load_benchmark("loss_memory").main(argv)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))
    _check_metadata(data, argv)
    assert data["benchmark"] == "loss_memory" and data["settings"]["lengths"] == [64, 256]
    assert {(c["length"], c["method"]) for c in data["cases"]} == {
        (64, "chunked"), (64, "unchunked"), (256, "chunked"), (256, "unchunked")}
    for case in data["cases"]:
        assert case["peak_extra_bytes"] >= 0 and case["seconds"] >= 0
    by = {c["length"]: {} for c in data["cases"]}
    for c in data["cases"]:
        by[c["length"]][c["method"]] = c["loss"]
    for losses in by.values():  # the same loss value either way
        assert losses["chunked"] == pytest.approx(losses["unchunked"], rel=1e-5)
    assert set(data["by_length"]) == {"64", "256"}


def test_rollouts_quick(tmp_path):
    out = tmp_path / "rollouts.json"
    argv = ["--quick", "--out", str(out)]
    load_benchmark("rollouts").main(argv)
    data = json.loads(out.read_text())
    _check_metadata(data, argv)
    assert data["benchmark"] == "rollouts" and data["model"] == "tiny" and data["settings"]["multi_turn"] is True
    for key in ("speedup_batched", "speedup_batched_no_reuse", "speedup_reuse", "speedup_reuse_one_at_a_time",
                "speedup_cache", "speedup_cache_one_at_a_time", "speedup_batched_no_cache"):
        assert data[key] is not None and data[key] > 0, key
    assert data["target"]["speedup_batched"] == 3.0
    modes = [(c["grid"], c["mode"], c["use_cache"], c["reuse_prefixes"]) for c in data["cases"]]
    assert sorted(modes) == sorted([
        ("target", "batched", True, True), ("target", "batched", True, False),
        ("target", "one_at_a_time", True, True), ("target", "one_at_a_time", True, False),
        ("cache", "batched", True, False), ("cache", "batched", False, False),
        ("cache", "one_at_a_time", True, False), ("cache", "one_at_a_time", False, False),
    ])
    for case in data["cases"]:
        assert case["trajectories"] == 2 and case["trajectories_per_second"] > 0 and case["tokens_per_second"] > 0
        assert case["turns"] >= 2
        # prefix reuse reads fewer prompt tokens (later turns: only their new tokens); without it, all of them
        read, handed = case["prefilled_tokens_per_run"], case["prompt_tokens_per_run"]
        assert read < handed if case["reuse_prefixes"] else read == handed
    bound = data["batching_bound"]
    target = next(c for c in data["cases"] if c["grid"] == "target" and c["mode"] == "batched" and c["reuse_prefixes"])
    assert bound == target["batching_bound"] and bound["generated_tokens"] == target["generated_tokens"]
    assert bound["max_speedup_any_batching"] >= bound["max_speedup_turn_synchronous"] >= 1.0


def test_batching_bound_by_hand():
    bound = load_benchmark("rollouts").batching_bound([[5, 3], [2, 7], [4]])
    # 21 tokens; longest episode 9 (2 + 7); turn-synchronous max(5, 2, 4) + max(3, 7) = 12
    assert bound == {"generated_tokens": 21, "longest_episode_steps": 9, "turn_synchronous_steps": 12,
                     "max_speedup_any_batching": 2.33, "max_speedup_turn_synchronous": 1.75}


def test_retrieval_quick(tmp_path):
    out = tmp_path / "retrieval.json"
    argv = ["--quick", "--out", str(out)]
    load_benchmark("retrieval").main(argv)
    data = json.loads(out.read_text())
    _check_metadata(data, argv)
    assert data["benchmark"] == "retrieval"
    kinds = {(r["data"], r["n"], r["index"]) for r in data["results"]}
    for kind in ("uniform", "clustered"):
        for n in (500, 2000):
            for index in ("numpy", "flat", "ivf", "hnsw"):
                assert (kind, n, index) in kinds
    for r in data["results"]:
        assert 0.0 <= r["recall_at_k"] <= 1.0 and r["memory_bytes"] > 0 and r["latency_ms_per_query_batch"] > 0
        if r["index"] in ("numpy", "flat"):
            assert r["recall_at_k"] == 1.0
    assert data["embedders"]["hashing"]["ms_per_text_batch"] > 0
    assert data["auto"]["approximate_kind"] in ("ivf", "hnsw")
