"""The pointer compressor (``composer_architecture: pointer``): its home positions, its pointers against a naive
loop, latents that start as the experience's own last K token embeddings, gradients into every parameter, and
latents that depend on the experience."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lopd_lightning.adapters import default_lora_config, prepare_backbone
from lopd_lightning.composer import LatentComposer, TokenPointer
from lopd_lightning.models import tiny_model, tiny_tokenizer

D = 8


def naive_pointers(pointer: TokenPointer, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """a_kt by loops: softmax over row n's real tokens of (W_q h_tau) . h_t / sqrt(d) - beta |t - tau|."""
    n_rows, t_max, d = hidden.shape
    k_max = pointer.num_latents
    beta = float(F.softplus(pointer.sharpness_raw))
    out = torch.zeros(n_rows, k_max, t_max)
    for n in range(n_rows):
        length = int(mask[n].sum())
        for k in range(k_max):
            tau = min(max(length - k_max, 0) + k, length - 1)
            query = pointer.query.weight @ hidden[n, tau]
            scores = [float(query @ hidden[n, t]) / math.sqrt(d) - beta * abs(t - tau) for t in range(length)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for t in range(length):
                out[n, k, t] = weights[t] / total
    return out


def test_homes_are_the_last_k_real_tokens():
    pointer = TokenPointer(D, num_latents=3)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]])
    assert pointer.homes(mask).tolist() == [[2, 3, 4], [0, 1, 1], [0, 1, 2]]


def test_pointers_match_a_naive_loop_and_skip_padding():
    torch.manual_seed(0)
    pointer = TokenPointer(D, num_latents=3, sharpness=1.5)
    with torch.no_grad():
        pointer.query.weight.normal_()
    hidden = torch.randn(2, 6, D)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    got = pointer.pointers(hidden, mask)
    torch.testing.assert_close(got, naive_pointers(pointer, hidden, mask), atol=1e-6, rtol=1e-5)
    assert (got[1, :, 4:] == 0).all()
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 3))
    # padding is invisible: the same row with more padding (and garbage states there) points the same way
    longer = torch.cat([hidden, torch.randn(2, 3, D)], dim=1)
    wider = torch.cat([mask, torch.zeros(2, 3, dtype=mask.dtype)], dim=1)
    torch.testing.assert_close(pointer.pointers(longer, wider)[..., :6], got)


def test_latents_start_as_the_experiences_last_k_token_embeddings():
    """At its start (W_q = 0, gate 0), latent k is the softmax of -beta |t - tau_k| over the token embeddings; a
    sharp start gives exactly the embeddings of the last K tokens, which the frozen teacher reads as text."""
    torch.manual_seed(0)
    hidden, embeds = torch.randn(1, 5, D), torch.randn(1, 5, D)
    mask = torch.ones(1, 5, dtype=torch.long)
    pointer = TokenPointer(D, num_latents=2, sharpness=4.0)
    weights = torch.tensor([[math.exp(-4.0 * abs(t - tau)) for t in range(5)] for tau in (3, 4)])
    weights = weights / weights.sum(-1, keepdim=True)
    torch.testing.assert_close(pointer(hidden, mask, embeds)[0], weights @ embeds[0])
    assert float(weights[1, 4]) > 0.96
    sharp = TokenPointer(D, num_latents=2, sharpness=60.0)
    torch.testing.assert_close(sharp(hidden, mask, embeds)[0], embeds[0, 3:], atol=1e-6, rtol=0)


def test_every_parameter_gets_a_gradient_from_the_start():
    """Zero-initialised W_q and gate still receive gradients (no saddle at the start)."""
    torch.manual_seed(0)
    pointer = TokenPointer(D, num_latents=3)
    hidden, embeds = torch.randn(2, 6, D), torch.randn(2, 6, D)
    mask = torch.ones(2, 6, dtype=torch.long)
    pointer(hidden, mask, embeds).pow(2).sum().backward()
    grads = {name: p.grad for name, p in pointer.named_parameters()}
    for name in ("query.weight", "sharpness_raw", "gate"):
        assert grads[name] is not None and float(grads[name].abs().sum()) > 0, name
    # proj and the residual's LayerNorm are behind tanh(0) = 0: they start learning once the gate opens
    assert float(grads["proj.weight"].abs().sum()) == 0


def test_options_are_checked():
    with pytest.raises(ValueError, match="sharpness"):
        TokenPointer(D, num_latents=2, sharpness=0.0)
    with pytest.raises(ValueError, match="positive"):
        TokenPointer(D, num_latents=0)


def test_a_composer_with_pointers_carries_each_experience():
    """Through LatentComposer on a tiny backbone: latents of a row are (nearly) the token embeddings of the end
    of its own experience prompt, and another experience gives other latents."""
    torch.manual_seed(0)
    backbone = prepare_backbone(tiny_model(), student_lora=None, composer_lora=default_lora_config())
    composer = LatentComposer(backbone, tiny_tokenizer(), architecture="pointer", num_latents=4)
    with torch.no_grad():
        composer.compressor.sharpness_raw.fill_(60.0)
    experiences = [[("add two numbers", "call add(1, 2) -> 3")], [("sort a list", "call sorted([3, 1]) -> [1, 3]")]]
    out = composer.compose(experiences)
    assert out.latents.shape == (2, 4, 64)
    batch = composer.tokenize_experiences(experiences)
    embeddings = backbone.get_input_embeddings()
    for row in range(2):
        n = int(batch.attention_mask[row, 0].sum())
        tail = embeddings(batch.input_ids[row, 0, n - 4:n])
        torch.testing.assert_close(out.latents[row].detach(), tail.detach(), atol=1e-5, rtol=0)
    assert not torch.allclose(out.latents[0], out.latents[1])


def test_no_scalar_parameters_and_scalar_ones_still_load():
    """FSDP2's fully_shard refuses 0-dim parameters: the pointer's two scalars are (1,) tensors; a composer saved
    while they were 0-dim loads into them."""
    pointer = TokenPointer(D, num_latents=2)
    assert all(p.dim() >= 1 for p in pointer.parameters())
    state = {k: (v.reshape(()) if k in ("sharpness_raw", "gate") else v) for k, v in pointer.state_dict().items()}
    state["gate"] = torch.tensor(0.25)
    fresh = TokenPointer(D, num_latents=2)
    fresh.load_state_dict(state)
    assert fresh.gate.shape == (1,) and float(fresh.gate) == 0.25
