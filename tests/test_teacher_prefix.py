"""The teacher's shared prefix (``teacher_prefix_cache``): a pass that starts after the tokens before the context.

The teacher's sequence is the student's with a context inserted at ``context_position``; the tokens before
it are the student's own, and the causal mask makes their states independent of the context. These tests
check, on the tiny model (CPU, seeded), that starting the teacher's pass after them, with their keys and
values from the student's forward (``live``) or from one no-grad teacher pass (any mode), gives the same
logits, hidden states and latent gradients as the whole pass; that a prefix that does not fit is refused;
and that one LOPD training step logs the same losses and produces the same gradients with and without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lopd_lightning.adapters import STUDENT, default_lora_config, prepare_backbone, use_adapter
from lopd_lightning.lm import position_ids_from_mask, selected_logits
from lopd_lightning.teacher import SelfTeacher, TeacherPrefix, has_dropout, prefix_length, supports_prefix_cache

from test_lopd_chunked import assert_same_step, bank_dir, one_step  # noqa: F401  (bank_dir is a fixture)
from test_lopd_module import LORA
from test_teacher import STUDENT_LORA, TOKENIZER, backbone_for, batch, latents_for


def assistant_positions(assistant: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the positions whose logits score an assistant token (position t predicts t+1)."""
    out = torch.zeros_like(assistant, dtype=torch.bool)
    out[:, :-1] = assistant[:, 1:].bool()
    return out


def student_prefix(backbone, ids, mask, length: int) -> TeacherPrefix:
    """The student's forward with its cache, as LOPDModule.losses runs it."""
    adapter = STUDENT if STUDENT in backbone.peft_config else None
    with use_adapter(backbone, adapter):
        _, cache = selected_logits(backbone, None, return_cache=True, input_ids=ids, attention_mask=mask,
                                   position_ids=position_ids_from_mask(mask))
    return TeacherPrefix.from_cache(cache, length)


def run(teacher, ids, mask, pos, positions, prefix, what: str):
    latents, latent_mask = latents_for()
    kwargs = dict(latents=latents, latent_mask=latent_mask, positions=positions, prefix=prefix)
    if what == "logits":
        out = teacher.logits_on_student_positions(ids, mask, pos, **kwargs)
    else:
        out = teacher.hidden_on_student_positions(ids, mask, pos, **kwargs)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)  # a loss that touches every value
    (out * weights).sum().backward()
    return out.detach(), latents.grad


def test_prefix_length_is_the_first_context_position_of_a_right_padded_batch():
    ids, mask, pos, _ = batch("right")
    assert prefix_length(mask, pos) == int(pos.min()) > 0
    ids, mask, pos, _ = batch("left")
    assert prefix_length(mask, pos) == 0  # left-padded rows are shifted by different amounts
    assert prefix_length(torch.ones(2, 0, dtype=torch.long), torch.tensor([0, 0])) == 0


@pytest.mark.parametrize("what", ["logits", "hidden"])
@pytest.mark.parametrize("student", ["lora", "full"])
@pytest.mark.parametrize("source", ["student", "own"])
def test_prefixed_pass_equals_the_whole_pass(student, source, what):
    backbone = backbone_for(student)
    teacher = SelfTeacher(backbone, TOKENIZER, mode="live")
    ids, mask, pos, assistant = batch("right")
    positions = assistant_positions(assistant)
    n = prefix_length(mask, pos)
    ref, ref_grad = run(teacher, ids, mask, pos, positions, None, what)
    prefix = student_prefix(backbone, ids, mask, n) if source == "student" else teacher.own_prefix(ids, mask, n)
    assert prefix.length == n and prefix.key_values[0][0].shape[2] == n and not prefix.key_values[0][0].requires_grad
    got, got_grad = run(teacher, ids, mask, pos, positions, prefix, what)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, ref_grad, atol=1e-6, rtol=1e-5)
    assert ref_grad.abs().sum() > 0
    assert all(p.grad is None for p in backbone.parameters())  # the backbone stays constant
    # the prefix is reusable: a pass does not append to it
    again, _ = run(teacher, ids, mask, pos, positions, prefix, what)
    torch.testing.assert_close(again, got, atol=0, rtol=0)


def uneven_batch(lengths=(20, 14, 26, 9), context=(5, 9, 7, 6), seed=0):
    """Right-padded random rows of different lengths and context positions; positions after each row's
    first token past the shared prefix, some of them before the row's own context."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    positions = torch.zeros_like(ids, dtype=torch.bool)
    n = min(context)
    for b, length in enumerate(lengths):
        ids[b, :length] = torch.randint(3, 259, (length,), generator=gen)
        mask[b, :length] = 1
        positions[b, n:length - 1] = torch.rand(length - 1 - n, generator=gen) > 0.3
    return ids, mask, torch.tensor(context), positions


@pytest.mark.parametrize("student", ["lora", "full"])
@pytest.mark.parametrize("mode", ["live", "base", "ema"])
def test_uneven_rows_a_row_without_latents_and_one_row(student, mode):
    """Rows of different lengths and context positions, one row with every latent masked, and a batch of
    one row whose prefix is its whole prompt before the context: the prefixed pass equals the whole pass."""
    teacher = SelfTeacher(backbone_for(student), TOKENIZER, mode=mode)
    ids, mask, pos, positions = uneven_batch()
    gen = torch.Generator().manual_seed(5)
    for rows in ([0, 1, 2, 3], [2]):
        latents = torch.randn(len(rows), 6, 64, generator=gen).requires_grad_(True)
        latent_mask = torch.ones(len(rows), 6, dtype=torch.bool)
        if len(rows) > 1:
            latent_mask[1] = False  # row 1: no latents at all (its teacher row is its student row)
            latent_mask[3, 2:] = False
        args = (ids[rows], mask[rows], pos[rows])
        n = prefix_length(mask[rows], pos[rows])
        assert n == int(pos[rows].min()) > 0
        wanted = positions[rows] & (torch.arange(ids.shape[1]) >= n)  # none inside the prefix
        outs, grads = [], []
        for prefix in (None, teacher.own_prefix(ids[rows], mask[rows], n)):
            latents.grad = None
            out = teacher.logits_on_student_positions(*args, latents=latents, latent_mask=latent_mask,
                                                      positions=wanted, prefix=prefix)
            (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
            outs.append(out.detach())
            grads.append(latents.grad.clone())
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)
        assert grads[0][latent_mask].abs().sum() > 0


@pytest.mark.parametrize("mode", ["base", "ema"])
def test_own_prefix_in_the_frozen_and_ema_modes(mode):
    backbone = backbone_for("lora")
    teacher = SelfTeacher(backbone, TOKENIZER, mode=mode)
    assert not teacher.shares_student_weights  # their weights are not the student's
    ids, mask, pos, assistant = batch("right")
    positions = assistant_positions(assistant)
    ref, ref_grad = run(teacher, ids, mask, pos, positions, None, "logits")
    got, got_grad = run(teacher, ids, mask, pos, positions, teacher.own_prefix(ids, mask, prefix_length(mask, pos)), "logits")
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, ref_grad, atol=1e-6, rtol=1e-5)


def test_the_student_cache_is_shared_only_with_the_same_weights_and_no_dropout():
    from lopd_lightning.models import tiny_model

    assert SelfTeacher(backbone_for("lora"), TOKENIZER, mode="live").shares_student_weights
    assert SelfTeacher(backbone_for("full"), TOKENIZER, mode="live").shares_student_weights
    dropout = prepare_backbone(tiny_model(), student_lora={**STUDENT_LORA, "lora_dropout": 0.1}, composer_lora=default_lora_config())
    assert has_dropout(dropout)
    assert not SelfTeacher(dropout, TOKENIZER, mode="live").shares_student_weights
    attention_dropout = tiny_model()
    attention_dropout.config.attention_dropout = 0.1  # a config rate, no Dropout module
    assert has_dropout(attention_dropout) and not has_dropout(tiny_model())


def test_only_plain_full_attention_caches_support_a_prefix():
    from transformers import MistralConfig, MistralForCausalLM

    from lopd_lightning.models import tiny_model

    assert supports_prefix_cache(backbone_for("lora")) and supports_prefix_cache(tiny_model())
    config = MistralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=300, sliding_window=4)
    assert not supports_prefix_cache(MistralForCausalLM(config))


def test_a_prefix_that_does_not_fit_is_refused():
    backbone = backbone_for("lora")
    teacher = SelfTeacher(backbone, TOKENIZER, mode="live")
    ids, mask, pos, assistant = batch("right")
    positions = assistant_positions(assistant)
    latents, latent_mask = latents_for()
    n = prefix_length(mask, pos)
    call = dict(latents=latents, latent_mask=latent_mask)
    # a prefix longer than the first context position: a context is inserted inside it
    with pytest.raises(ValueError, match="not shared by the teacher's rows"):
        teacher.logits_on_student_positions(ids, mask, pos, positions=positions,
                                            prefix=teacher.own_prefix(ids, mask, n + 2), **call)
    # a wanted position inside the prefix
    early = positions.clone()
    early[0, 1] = True
    with pytest.raises(ValueError, match="positions fall inside"):
        teacher.logits_on_student_positions(ids, mask, pos, positions=early, prefix=teacher.own_prefix(ids, mask, n), **call)
    # a prefix of another batch size
    with pytest.raises(ValueError, match="the prefix holds 1 rows"):
        teacher.logits_on_student_positions(ids, mask, pos, positions=positions,
                                            prefix=teacher.own_prefix(ids[:1], mask[:1], n), **call)
    # the whole (B, T, V) output computes the prefix's logits too
    with pytest.raises(ValueError, match="prefix needs positions"):
        teacher.logits_on_student_positions(ids, mask, pos, prefix=teacher.own_prefix(ids, mask, n), **call)
    # a left-padded batch shares no prefix: its rows are shifted by different amounts
    left_ids, left_mask, left_pos, left_assistant = batch("left")
    with pytest.raises(ValueError, match="not shared by the teacher's rows"):
        teacher.logits_on_student_positions(left_ids, left_mask, left_pos, positions=assistant_positions(left_assistant),
                                            prefix=teacher.own_prefix(left_ids, left_mask, 3), **call)
    with pytest.raises(ValueError, match="prefix length must be in"):
        teacher.own_prefix(ids, mask, 0)


def test_a_sliding_window_cache_is_refused():
    from transformers import DynamicCache, MistralConfig

    config = MistralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=300, sliding_window=4)
    cache = DynamicCache(config=config)
    cache.update(torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8), 0)
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer"):
        TeacherPrefix.from_cache(cache, 2)


@pytest.mark.parametrize(
    ("options", "path"),
    [(dict(), "student"), (dict(lora=None), "student"), (dict(distill_chunk_size=5), "student"),
     (dict(teacher_mode="base"), "own"), (dict(lora={**LORA, "lora_dropout": 0.1}), "own")],
    ids=["lora", "full", "chunked", "base", "dropout"],
)
def test_lopd_step_with_the_prefix_equals_the_step_without(tmp_path: Path, bank_dir, monkeypatch, options, path):  # noqa: F811
    """One step with teacher_prefix_cache=True logs the losses and makes the gradients of one without; the
    prefix comes from the student's forward in live mode and from the teacher's own pass otherwise."""
    options = dict(options)
    chunk = options.pop("distill_chunk_size", None)
    dropout = "lora" in options and options["lora"] and options["lora"].get("lora_dropout")
    calls = {"student": 0, "own": 0}
    from_cache, own_prefix = TeacherPrefix.from_cache.__func__, SelfTeacher.own_prefix

    def spy_from_cache(cls, *args, **kwargs):
        calls["student"] += 1
        return from_cache(cls, *args, **kwargs)

    def spy_own(self, *args, **kwargs):
        calls["own"] += 1
        return own_prefix(self, *args, **kwargs)

    monkeypatch.setattr(TeacherPrefix, "from_cache", classmethod(spy_from_cache))
    monkeypatch.setattr(SelfTeacher, "own_prefix", spy_own)
    ref = one_step(tmp_path / "ref", bank_dir, chunk, teacher_prefix_cache=False, **options)
    assert calls == {"student": 0, "own": 0}
    got = one_step(tmp_path / "got", bank_dir, chunk, teacher_prefix_cache=True, **options)
    assert calls[path] == 1 and calls["own" if path == "student" else "student"] <= (1 if path == "own" else 0)
    if dropout:  # dropout draws differ between the two runs: only the path is checked
        return
    batch_ = got["batch"]
    assert prefix_length(batch_.attention_mask, batch_.context_position) > 0  # the prefix is used
    assert torch.equal(ref["batch"].input_ids, batch_.input_ids)
    assert ref["logged"]["train/margin_delta"] != 0.0
    # losses to rel 1e-5, gradients to 1e-4 (the suffix pass sums in another order)
    assert_same_step(ref, got, rtol=1e-4, atol=1e-6, loss_atol=1e-6)


def test_lopd_turns_the_prefix_off_for_a_cache_it_cannot_share(monkeypatch, caplog):
    from test_lopd_module import make_module

    monkeypatch.setattr("lopd_lightning.modules.lopd.supports_prefix_cache", lambda model: False)
    with caplog.at_level("WARNING", logger="lopd_lightning.modules.lopd"):
        module = make_module(None, teacher_prefix_cache=True)
    assert module.hparams.teacher_prefix_cache is False
    assert "teacher_prefix_cache is off" in caplog.text
