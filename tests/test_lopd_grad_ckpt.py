"""LOPDModule(gradient_checkpointing=True): the checkpointed step equals the plain one.

One LOPD backward runs through passes made under different LoRA adapters and ``requires_grad`` flags
(the student's pass under ``"student"``, the composer's encoder under ``"composer"`` with only psi
trainable, the teacher under its mode's weights, every backbone weight constant, in eval mode). With
activation checkpointing each decoder layer run in train mode with gradients is recomputed in that
backward, after the contexts have switched back; :class:`~lopd_lightning.checkpointing.ForwardStateRecompute`
recomputes it under the state its forward had. These tests check, on the tiny model and the toy task
(CPU, float32, seeded), that one training step logs the same losses and produces the same gradient for
every trainable parameter (student LoRA or every base weight, composer LoRA, resampler) with and
without checkpointing, LoRA dropout included; and that without the recompute context it does not.

The LoRAs start random (``init_lora_weights: false``): peft's default B = 0 makes every adapter the base
model at the first step, and a recomputation under the wrong adapter would then go unseen.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from lopd_lightning import checkpointing
from lopd_lightning.memory.composer import warm_start_loss
from lopd_lightning.modules import LOPDModule
from lopd_lightning.tasks.toy import ToyTask

from test_lopd_chunked import LOGGED, assert_same_step, bank_dir, one_step  # noqa: F401 (bank_dir: a fixture)
from test_lopd_module import LORA, make_module

RANDOM_LORA = {**LORA, "target_modules": ["q_proj", "v_proj", "down_proj"], "init_lora_weights": False}
COMPOSER_LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "init_lora_weights": False,
                 "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
CASES = {
    "lora": dict(lora=RANDOM_LORA, composer_lora=COMPOSER_LORA),
    "lora_dropout": dict(lora={**RANDOM_LORA, "lora_dropout": 0.2}, composer_lora={**COMPOSER_LORA, "lora_dropout": 0.1}),
    "full": dict(lora=None, composer_lora=COMPOSER_LORA),
    "ema_teacher": dict(lora=RANDOM_LORA, composer_lora=COMPOSER_LORA, teacher_mode="ema"),
}
#: a student LoRA shaped like the composer's: a recomputation under the wrong one saves the same tensors
SAME_SHAPES = dict(lora=COMPOSER_LORA, composer_lora=COMPOSER_LORA)


def checkpointed_step(tmp_path, bank_dir, checkpointing: bool, case: str) -> dict:
    return one_step(tmp_path / f"ckpt_{checkpointing}", bank_dir, None, gradient_checkpointing=checkpointing,
                    **(SAME_SHAPES if case == "same_shapes" else CASES[case]))


@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_step_equals_the_plain_step(tmp_path, bank_dir, case):
    ref = checkpointed_step(tmp_path, bank_dir, False, case)
    got = checkpointed_step(tmp_path, bank_dir, True, case)
    assert torch.equal(ref["batch"].input_ids, got["batch"].input_ids)  # the same rollouts
    assert ref["logged"]["train/margin_delta"] != 0.0 and ref["logged"]["train/loss"] > 0
    assert_same_step(ref, got, rtol=1e-5, atol=1e-7, loss_atol=1e-7)


@pytest.mark.parametrize("shapes", ["other", "same"])
def test_without_the_recompute_context_the_step_fails_or_its_gradients_differ(tmp_path, bank_dir, monkeypatch, shapes):
    """The test above can fail: without the recompute context the composer's encoder layers are recomputed
    in the backward under the backward-time state (the student's adapter active, every adapter trainable).
    With a student LoRA on other layers than the composer's, the recomputation saves other tensors and
    torch's checkpoint raises CheckpointError; with one shaped like the composer's, it is silently
    recomputed under the student's LoRA: the same losses, other composer gradients."""
    case = "lora" if shapes == "other" else "same_shapes"
    ref = checkpointed_step(tmp_path, bank_dir, False, case)
    if shapes == "same":
        assert_same_step(ref, checkpointed_step(tmp_path, bank_dir, True, case))  # with the context: the same
    monkeypatch.setattr(checkpointing.ForwardStateRecompute, "__call__", lambda self: (nullcontext(), nullcontext()))
    if shapes == "other":
        with pytest.raises(torch.utils.checkpoint.CheckpointError, match="different number of tensors"):
            checkpointed_step(tmp_path, bank_dir, True, case)
        return
    got = checkpointed_step(tmp_path, bank_dir, True, case)
    for tag in LOGGED:  # the forward is right, the recomputation is not
        assert got["logged"][tag] == pytest.approx(ref["logged"][tag], rel=1e-5, abs=1e-7), tag
    with pytest.raises(AssertionError, match="composer_lora"):
        assert_same_step(ref, got)


def test_every_decoder_layer_carries_the_recompute_context():
    module = LOPDModule("tiny", lora=LORA, num_latents=2, num_experiences=1, composer_depth=1, embedder="hashing",
                        distill_top_k=8, gradient_checkpointing=True)
    layers = module.backbone.get_base_model().model.layers
    for layer in layers:
        context = layer._gradient_checkpointing_func.keywords["context_fn"]
        assert isinstance(context, checkpointing.ForwardStateRecompute) and context.scope is layer
    assert module.checkpointed_modules >= len(layers)


def warm_start_grads(bank_dir, checkpointing: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """L_init of the composer's warm start on two reference batches' rows, and psi's and the resampler's gradients."""
    torch.manual_seed(0)
    module = make_module(bank_dir, gradient_checkpointing=checkpointing, **CASES["lora"])
    task = ToyTask()
    examples = task.examples("train")[:2]
    batch = module.reference_batch(task, examples)
    batch.experiences = module.retrieve(task, examples)
    loss = warm_start_loss(module.teacher, module.compose(batch), batch.input_ids, batch.attention_mask,
                           batch.context_position, batch.assistant_mask)
    loss.backward()
    return loss.detach(), [p.grad for p in module.composer.trainable_parameters()]


def test_the_composer_warm_start_gives_the_same_gradients_checkpointed(bank_dir):
    """The warm start's backward also runs after the composer's adapter switched back (to the student's)."""
    ref_loss, ref = warm_start_grads(bank_dir, False)
    loss, got = warm_start_grads(bank_dir, True)
    assert loss == ref_loss
    assert all(g is not None for g in ref) and any(g.abs().sum() > 0 for g in ref)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_a_checkpointed_student_forward_refuses_to_keep_its_cache(bank_dir):
    """Checkpointed layers keep no key/value cache: asking for it is an error, not an empty cache (LOPD's
    teacher then computes its prefix itself)."""
    module = make_module(bank_dir, gradient_checkpointing=True, lora=LORA)
    task = ToyTask()
    batch = module.reference_batch(task, task.examples("train")[:2])
    with pytest.raises(ValueError, match=r"keep_cache=True\) under gradient_checkpointing"):
        module.student_forward(batch, module.shifted(batch)[1], keep_cache=True)
