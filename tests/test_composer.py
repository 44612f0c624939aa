"""The latent composer: shapes, masking, gradient routing, weight sharing, no backbone copy."""

from __future__ import annotations

import pytest
import torch

from lopd_lightning.adapters import (
    COMPOSER,
    STUDENT,
    adapter_parameters,
    base_parameters,
    parameter_storage,
    default_lora_config,
    prepare_backbone,
    student_parameters,
    use_adapter,
)
from lopd_lightning.memory.composer import (
    LatentComposer,
    PerceiverResampler,
    clip_composer_grads,
    composer_parameter_groups,
    experience_prompt,
)
from lopd_lightning.models import tiny_model, tiny_tokenizer

K = 4
STUDENT_LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
EXPERIENCES = [
    [("add two numbers", "call add(1, 2) -> 3"), ("sort a list", "call sorted([3, 1]) -> [1, 3]")],
    [("reverse a string", "s[::-1]")],  # one experience fewer: padded and masked
]


def perturb(peft_model, name: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(peft_model, name):
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)


def make(student_lora=STUDENT_LORA, **kwargs):
    torch.manual_seed(0)
    backbone = prepare_backbone(tiny_model(), student_lora=student_lora, composer_lora=default_lora_config())
    perturb(backbone, COMPOSER, 1)
    if student_lora is not None:
        perturb(backbone, STUDENT, 2)
    kwargs.setdefault("num_latents", K)
    kwargs.setdefault("depth", 2)
    return backbone, LatentComposer(backbone, tiny_tokenizer(), **kwargs)


def test_experience_prompt():
    assert experience_prompt("x", "m") == "Task to solve:\nx\n\nReference past trajectory:\nm"


def test_tokenize_experiences_pads_and_masks():
    _, composer = make(max_experience_tokens=40)
    batch = composer.tokenize_experiences(EXPERIENCES)
    assert batch.input_ids.shape[:2] == (2, 2) and batch.input_ids.shape == batch.attention_mask.shape
    assert batch.input_ids.shape[2] == 40  # truncated to max_experience_tokens
    assert batch.experience_mask.tolist() == [[True, True], [True, False]]
    assert batch.attention_mask[1, 1].sum() == 0 and (batch.input_ids[1, 1] == 0).all()
    assert batch.attention_mask[0, 0, 0] == 1  # right padding
    empty = composer.tokenize_experiences([[], []])
    assert empty.input_ids.shape == (2, 0, 1) and empty.experience_mask.shape == (2, 0)


def test_output_shape_and_missing_experiences_masked():
    backbone, composer = make()
    out = composer.compose(EXPERIENCES)
    d = backbone.get_base_model().config.hidden_size
    assert out.latents.shape == (2, 2 * K, d)
    assert out.latent_mask.tolist() == [[True] * 2 * K, [True] * K + [False] * K]
    assert (out.latents[1, K:] == 0).all()
    assert out.latents[0].abs().sum(dim=-1).gt(0).all()
    # the same row alone gives the same latents (the padding experience does not leak)
    alone = composer.compose([EXPERIENCES[1]])
    torch.testing.assert_close(alone.latents[0], out.latents[1, :K], atol=1e-5, rtol=1e-5)
    none = composer.compose([[], []])
    assert none.latents.shape == (2, 0, d) and none.latent_mask.shape == (2, 0)


def test_encoder_runs_on_present_rows_only(monkeypatch):
    _, composer = make()
    seen = []
    original = composer.encode

    def spy(input_ids, attention_mask):
        seen.append(tuple(input_ids.shape))
        return original(input_ids, attention_mask)

    monkeypatch.setattr(composer, "encode", spy)
    batch = composer.tokenize_experiences(EXPERIENCES)
    composer(*batch)
    assert len(seen) == 1 and seen[0][0] == 3  # 3 present experiences of B*J = 4
    assert seen[0][1] == int(batch.attention_mask.sum(-1).max())


def test_encoder_hidden_state_is_final_normed_state():
    backbone, composer = make()
    batch = composer.tokenize_experiences([EXPERIENCES[0]])
    ids, mask = batch.input_ids[0], batch.attention_mask[0]
    with torch.no_grad():
        hidden = composer.encode(ids, mask)
        with use_adapter(backbone, COMPOSER):
            reference = backbone.get_base_model().model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(hidden, reference)


@pytest.mark.parametrize("student_lora", [STUDENT_LORA, None], ids=["lora_student", "full_student"])
def test_gradients_reach_composer_only(student_lora):
    backbone, composer = make(student_lora=student_lora)
    out = composer.compose(EXPERIENCES)
    (out.latents * torch.randn_like(out.latents)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in composer.resampler_parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in composer.lora_parameters())
    assert all(p.grad is None for p in base_parameters(backbone))
    if student_lora is not None:
        assert all(p.grad is None for p in student_parameters(backbone))
    else:
        assert all(p.requires_grad for p in student_parameters(backbone))  # still the student's


def test_parameter_count_independent_of_depth():
    def count(depth: int) -> int:
        return sum(p.numel() for p in PerceiverResampler(64, num_latents=K, depth=depth, num_heads=4).parameters())

    assert count(1) == count(8)
    _, shallow = make(depth=1)
    _, deep = make(depth=8)
    assert sum(p.numel() for p in shallow.parameters()) == sum(p.numel() for p in deep.parameters())


def test_resampler_parameter_count_exact():
    d, ff, inner = 64, 4, 64
    expected = (
        K * d  # queries
        + d * d + d  # proj_in
        + 2 * (2 * d)  # norm_media, norm_latents
        + d * inner + d * 2 * inner + inner * d  # to_q, to_kv, to_out (no bias)
        + 2 * d + d * ff * d + ff * d + ff * d * d + d  # ff: LayerNorm, Linear, Linear
        + d * d + d  # proj_out
        + 2 * d  # norm_out
    )
    assert sum(p.numel() for p in PerceiverResampler(d, num_latents=K, depth=8, num_heads=4).parameters()) == expected


def test_backbone_not_copied_nor_registered():
    backbone, composer = make()
    storage = parameter_storage(backbone)
    own = {p.data_ptr() for p in composer.parameters()}
    assert not own & storage  # composer.parameters() is the resampler only
    assert all(k.startswith("resampler.") for k in composer.state_dict())
    assert {p.data_ptr() for p in composer.lora_parameters()} <= storage  # psi lives in the shared backbone
    assert composer.backbone is backbone
    assert parameter_storage(backbone) == storage
    assert composer.lora_state_dict()  # peft names, adapter name stripped
    assert all("lora_" in k for k in composer.lora_state_dict())


def test_parameter_groups_and_separate_clipping():
    _, composer = make()
    groups = composer_parameter_groups(composer, lr=1e-5)
    assert [g["name"] for g in groups] == ["resampler", "composer_lora"]
    assert [g["clip_norm"] for g in groups] == [30.0, 3.0]
    optimizer = torch.optim.AdamW(groups)
    assert optimizer.param_groups[1]["clip_norm"] == 3.0
    for p in composer.trainable_parameters():
        p.grad = torch.full_like(p, 10.0)
    norms = clip_composer_grads(composer)
    chi = torch.sqrt(sum(torch.tensor(100.0 * p.numel()) for p in composer.resampler_parameters()))
    psi = torch.sqrt(sum(torch.tensor(100.0 * p.numel()) for p in composer.lora_parameters()))
    torch.testing.assert_close(norms.resampler, chi)
    torch.testing.assert_close(norms.lora, psi)
    after_chi = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in composer.resampler_parameters()]))
    after_psi = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in composer.lora_parameters()]))
    assert after_chi == pytest.approx(30.0, rel=1e-4)
    assert after_psi == pytest.approx(3.0, rel=1e-4)
    optimizer.step()


def test_embedding_scaled_output_gain():
    backbone, composer = make(output_gain="embedding")
    rms = backbone.get_input_embeddings().weight.pow(2).mean().sqrt()
    torch.testing.assert_close(composer.resampler.norm_out.weight, torch.full((64,), float(rms)))
