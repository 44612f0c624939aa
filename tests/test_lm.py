"""selected_logits / unpack: the LM head on selected positions equals the full forward there; the
model-input helpers (position ids, shifted log-probs)."""

import pytest
import torch

from lopd_lightning.adapters import prepare_backbone
from lopd_lightning.lm import position_ids_from_mask, selected_logits, unpack
from lopd_lightning.losses import shifted_token_logps
from lopd_lightning.losses import token_logps
from lopd_lightning.models import tiny_model, tiny_tokenizer
from lopd_lightning.teacher import SelfTeacher


def test_selected_logits_equal_full_forward_at_positions():
    model = tiny_model(seed=1)
    ids = torch.randint(3, 259, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in one row
    positions = torch.rand(3, 11, generator=torch.Generator().manual_seed(1)) > 0.5
    full = model(input_ids=ids, attention_mask=mask).logits
    packed = selected_logits(model, positions, input_ids=ids, attention_mask=mask)
    assert packed.shape == (int(positions.sum()), 259)
    torch.testing.assert_close(packed, full[positions], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(selected_logits(model, None, input_ids=ids, attention_mask=mask), full)


def test_unpack_scatters_in_row_major_order_and_keeps_gradient():
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    out = unpack(values, mask)
    assert out.tolist() == [[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]
    out.sum().backward()
    assert values.grad.tolist() == [1.0, 1.0, 1.0]


def test_teacher_packed_logits_equal_its_full_logits_with_latents():
    torch.manual_seed(0)
    backbone = prepare_backbone(tiny_model(seed=2), student_lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    teacher = SelfTeacher(backbone, tiny_tokenizer(), mode="live")
    ids = torch.randint(3, 259, (2, 9), generator=torch.Generator().manual_seed(3))
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0  # right padding
    latents = torch.randn(2, 4, 64, requires_grad=True)
    positions = torch.zeros(2, 9, dtype=torch.bool)
    positions[0, 4:8] = True
    positions[1, 3:6] = True
    kwargs = dict(latents=latents, latent_mask=torch.ones(2, 4, dtype=torch.bool))
    full = teacher.logits_on_student_positions(ids, attn, torch.tensor([2, 1]), **kwargs)
    packed = teacher.logits_on_student_positions(ids, attn, torch.tensor([2, 1]), positions=positions, **kwargs)
    torch.testing.assert_close(packed, full[positions], atol=1e-5, rtol=1e-5)
    packed.sum().backward()
    assert latents.grad is not None and latents.grad.abs().sum() > 0


def test_position_ids_from_mask_ignore_padding_on_either_side():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 1, 2, 2]]
    assert position_ids_from_mask(mask.bool()).dtype == torch.long


def test_shifted_token_logps_score_the_next_token():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 7, (2, 5), generator=g)
    got = shifted_token_logps(logits, ids, temperature=0.5)
    want = torch.log_softmax(logits[:, :-1] / 0.5, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    assert got.shape == (2, 4)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, token_logps(logits[:, :-1], ids[:, 1:], temperature=0.5))
