"""Shared fixtures: a tiny random Llama and the byte-level ChatML tokenizer, seeded, CPU only."""

from __future__ import annotations

import pytest
import torch

from lopd_lightning.models import tiny_model, tiny_tokenizer


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same global torch seed (tests must not depend on it, but it helps)."""
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on 2 shared cores (with sandboxed child
    processes) extra threads oversubscribe the CPU and make tests several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tokenizer():
    """A fresh tiny tokenizer (ByT5 bytes, ChatML template; pad 0, EOS 1): tests may mutate it."""
    return tiny_tokenizer()


@pytest.fixture
def model():
    """A fresh tiny random ``LlamaForCausalLM`` (2 layers, hidden 64, vocab 259, seed 0), float32, CPU."""
    return tiny_model(seed=0)


@pytest.fixture
def eos_model():
    """The tiny model with a +1 bias on the EOS logit, so that sampled replies end at varied lengths."""
    m = tiny_model(seed=0)
    head = torch.nn.Linear(m.lm_head.in_features, m.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(m.lm_head.weight)
        head.bias.zero_()
        head.bias[m.config.eos_token_id] = 1.0
    m.lm_head = head
    return m


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fails a test whose module loads the student: its config error (or ``--print_config``) must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the student was loaded before the config error was raised")

    monkeypatch.setattr("lopd_lightning.modules.base.load_student", refuse)

