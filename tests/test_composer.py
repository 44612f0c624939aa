"""The latent composer: shapes, masking, gradient routing, weight sharing, no backbone copy, both compressors,
saving and loading."""

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
from lopd_lightning.composer import (
    LatentComposer,
    MemoryTokens,
    PerceiverResampler,
    clip_composer_grads,
    composer_parameter_groups,
    experience_prompt,
    load_composer,
    save_composer,
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
    backbone, composer = make(architecture="perceiver")
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
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in composer.compressor_parameters())
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
    _, shallow = make(depth=1, architecture="perceiver")
    _, deep = make(depth=8, architecture="perceiver")
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
    assert not own & storage  # composer.parameters() is the compressor only
    assert all(k.startswith("compressor.") for k in composer.state_dict())
    assert {p.data_ptr() for p in composer.lora_parameters()} <= storage  # psi lives in the shared backbone
    assert composer.backbone is backbone
    assert parameter_storage(backbone) == storage
    assert composer.lora_state_dict()  # peft names, adapter name stripped
    assert all("lora_" in k for k in composer.lora_state_dict())


def test_parameter_groups_and_separate_clipping():
    _, composer = make()
    groups = composer_parameter_groups(composer, lr=1e-5)
    assert [g["name"] for g in groups] == ["compressor", "composer_lora"]
    assert [g["clip_norm"] for g in groups] == [30.0, 3.0]
    optimizer = torch.optim.AdamW(groups)
    assert optimizer.param_groups[1]["clip_norm"] == 3.0
    for p in composer.trainable_parameters():
        p.grad = torch.full_like(p, 10.0)
    norms = clip_composer_grads(composer)
    chi = torch.sqrt(sum(torch.tensor(100.0 * p.numel()) for p in composer.compressor_parameters()))
    psi = torch.sqrt(sum(torch.tensor(100.0 * p.numel()) for p in composer.lora_parameters()))
    torch.testing.assert_close(norms.compressor, chi)
    torch.testing.assert_close(norms.lora, psi)
    after_chi = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in composer.compressor_parameters()]))
    after_psi = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in composer.lora_parameters()]))
    assert after_chi == pytest.approx(30.0, rel=1e-4)
    assert after_psi == pytest.approx(3.0, rel=1e-4)
    optimizer.step()


@pytest.mark.parametrize("architecture", ["memory_tokens", "perceiver", "pointer"])
def test_embedding_scaled_output_gain(architecture):
    backbone, composer = make(output_gain="embedding", architecture=architecture)
    rms = backbone.get_input_embeddings().weight.pow(2).mean().sqrt()
    torch.testing.assert_close(composer.compressor.norm_out.weight, torch.full((64,), float(rms)))
    _, unit = make(output_gain=1.0, architecture=architecture)
    torch.testing.assert_close(unit.compressor.norm_out.weight, torch.ones(64))


def test_memory_tokens_are_the_backbones_states_after_each_rows_tokens():
    """The memory compressor's encoder output equals a hand-built pass: each row's token embeddings, then the K
    memory embeddings, run through the base model under the composer LoRA; read at the K memory positions."""
    backbone, composer = make(architecture="memory_tokens")
    batch = composer.tokenize_experiences([EXPERIENCES[0]])
    ids, mask = batch.input_ids[0], batch.attention_mask[0]  # two rows of different lengths (right padding)
    with torch.no_grad():
        got = composer.encode(ids, mask)
        assert got.shape == (2, K, 64)
        with use_adapter(backbone, COMPOSER):
            for row in range(2):
                n = int(mask[row].sum())
                embeds = torch.cat([backbone.get_input_embeddings()(ids[row, :n]), composer.compressor.memory])[None]
                hidden = backbone.get_base_model().model(inputs_embeds=embeds).last_hidden_state[0, n:]
                torch.testing.assert_close(got[row], hidden, atol=1e-5, rtol=1e-4)


def test_memory_tokens_append_to_places_memory_after_each_row():
    memory = MemoryTokens(4, num_latents=2, init_embeddings=torch.randn(10, 4))
    embeds = torch.arange(24, dtype=torch.float32).view(2, 3, 4) + 1.0
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    out, attention, slots = memory.append_to(embeds, mask)
    assert attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert slots.tolist() == [[False, False, False, True, True], [False, True, True, False, False]]
    torch.testing.assert_close(out[0, :3], embeds[0])
    torch.testing.assert_close(out[0, 3:], memory.memory.detach())
    torch.testing.assert_close(out[1, 1:3], memory.memory.detach())
    assert (out[1, 3:] == 0).all()
    proj = memory(torch.randn(2, 2, 4))
    assert proj.shape == (2, 2, 4)
    with pytest.raises(ValueError, match="init_embeddings"):
        MemoryTokens(4, num_latents=2, init_embeddings=torch.randn(10, 5))


@pytest.mark.parametrize("architecture", ["memory_tokens", "perceiver", "pointer"])
def test_save_and_load_restore_the_same_latents(tmp_path, architecture):
    backbone, composer = make(architecture=architecture)
    before = composer.compose(EXPERIENCES).latents.detach()
    save_composer(composer, tmp_path, info={"steps": 3})
    with torch.no_grad():
        for p in composer.trainable_parameters():
            p.add_(1.0)
    assert not torch.allclose(composer.compose(EXPERIENCES).latents, before)
    assert load_composer(composer, tmp_path) == {"steps": 3}
    torch.testing.assert_close(composer.compose(EXPERIENCES).latents.detach(), before)


def test_load_refuses_a_missing_file_and_another_shape(tmp_path):
    _, composer = make()
    with pytest.raises(FileNotFoundError, match="composer_path .*lopd pretrain-composer"):
        load_composer(composer, tmp_path / "nothing")
    save_composer(composer, tmp_path)
    _, other = make(num_latents=K + 1)
    with pytest.raises(ValueError, match="num_latents 4 \\(this run: 5\\)"):
        load_composer(other, tmp_path)
    _, perceiver = make(architecture="perceiver")
    with pytest.raises(ValueError, match="architecture 'memory_tokens'"):
        load_composer(perceiver, tmp_path)


def test_load_refuses_another_encoder_lora(tmp_path):
    from lopd_lightning.adapters import as_lora_config

    _, composer = make()
    save_composer(composer, tmp_path)
    torch.manual_seed(0)
    backbone = prepare_backbone(tiny_model(), student_lora=STUDENT_LORA,
                                composer_lora=as_lora_config({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    other = LatentComposer(backbone, tiny_tokenizer(), num_latents=K, depth=2)
    with pytest.raises(ValueError, match="lora_r 8 \\(this run: 4\\)"):
        load_composer(other, tmp_path)


def test_unknown_architecture_is_refused():
    with pytest.raises(ValueError, match="architecture 'resampler' is not one of memory_tokens, perceiver"):
        make(architecture="resampler")


def test_a_long_task_text_is_cut_before_the_experience():
    _, composer = make(max_experience_tokens=70)
    tokenizer = composer.tokenizer
    ids = composer.experience_ids("describe " * 40, "call f(1)")
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) <= 70 and text.endswith("Reference past trajectory:\ncall f(1)") and "describe" in text
    short = composer.experience_ids("add", "call f(1)")
    assert tokenizer.decode(short, skip_special_tokens=True) == experience_prompt("add", "call f(1)")
    long_trace = composer.experience_ids("add", "step " * 40)  # the trace alone is too long: its beginning stays
    assert len(long_trace) == 70
    assert tokenizer.decode(long_trace, skip_special_tokens=True).startswith("Task to solve:\n\n\nReference past")
