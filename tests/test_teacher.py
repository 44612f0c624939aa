"""The self-teacher: context insertion, alignment with the student, padding, gradients, modes, EMA."""

from __future__ import annotations

import logging

import pytest
import torch

from lopd_lightning.adapters import (
    COMPOSER,
    STUDENT,
    TEACHER_EMA,
    adapter_parameters,
    base_parameters,
    parameter_storage,
    default_lora_config,
    prepare_backbone,
    use_adapter,
)
from lopd_lightning.lm import position_ids_from_mask
from lopd_lightning.losses import shifted_token_logps
from lopd_lightning.composer import ComposerOutput, LatentComposer, latent_nll
from lopd_lightning.models import tiny_model, tiny_tokenizer
from lopd_lightning.teacher import SelfTeacher, frame_text

STUDENT_LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
D = 64
TOKENIZER = tiny_tokenizer()
# ChatML: "<|im_start|>user\n" is 17 bytes, so the user's content starts at index 17 of an unpadded row
USER_START = len(TOKENIZER("<|im_start|>user\n", add_special_tokens=False)["input_ids"])
CONVERSATIONS = [
    [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "5"}],
    [{"role": "user", "content": "reverse 'abc', please"}, {"role": "assistant", "content": "cba is the answer"}],
]


def teacher_logps(teacher: SelfTeacher, ids, mask, pos, **context) -> torch.Tensor:
    """log pi_T(ids[:, t+1] | s_<=t, context): (B, T-1), the teacher's logits on the student's positions."""
    return shifted_token_logps(teacher.logits_on_student_positions(ids, mask, pos, **context), ids)


def perturb(peft_model, name: str, seed: int, scale: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(peft_model, name):
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def backbone_for(student: str):
    model = tiny_model()
    if student == "lora":
        pm = prepare_backbone(model, student_lora=STUDENT_LORA, composer_lora=default_lora_config())
        perturb(pm, STUDENT, 1)
    else:
        pm = prepare_backbone(model, student_lora=None, composer_lora=default_lora_config())
    perturb(pm, COMPOSER, 2)
    return pm


def rows() -> list[list[int]]:
    return [TOKENIZER.apply_chat_template(c, tokenize=True, return_dict=False) for c in CONVERSATIONS]


def batch(side: str):
    """(ids, mask, context_position, assistant_mask) of the two conversations, padded on ``side``."""
    seqs = rows()
    length = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    assistant = torch.zeros_like(ids)
    pos = []
    for b, s in enumerate(seqs):
        start = length - len(s) if side == "left" else 0
        ids[b, start : start + len(s)] = torch.tensor(s)
        mask[b, start : start + len(s)] = 1
        prompt = TOKENIZER.apply_chat_template(
            CONVERSATIONS[b][:1], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        user_len = len(prompt)
        assistant[b, start + user_len : start + len(s)] = 1
        pos.append(start + USER_START)
    return ids, mask, torch.tensor(pos), assistant


def student_logps(backbone, ids, mask):
    with torch.no_grad(), use_adapter(backbone, STUDENT if STUDENT in backbone.peft_config else None):
        logits = backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    return shifted_token_logps(logits, ids)


def valid_pairs(mask):
    """(B, T-1) bool: positions t where both t and t+1 are real tokens."""
    return mask[:, :-1].bool() & mask[:, 1:].bool()


def unpad(values, mask):
    """Per row, the values at valid positions, in order (compare left- and right-padded batches)."""
    keep = valid_pairs(mask)
    return [v[k] for v, k in zip(values, keep, strict=True)]


def latents_for(batch_size: int = 2, length: int = 6, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch_size, length, D, generator=gen).requires_grad_(True)
    latent_mask = torch.ones(batch_size, length, dtype=torch.bool)
    latent_mask[1, 3:] = False  # row 1: one of its two "experiences" is missing
    return latents, latent_mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_latents_sit_at_placeholder_positions(side):
    backbone = backbone_for("lora")
    teacher = SelfTeacher(backbone, TOKENIZER)
    ids, mask, pos, _ = batch(side)
    latents, latent_mask = latents_for()
    ti = teacher.insert_context(ids, mask, pos, latents=latents, latent_mask=latent_mask)
    n_prefix, n_suffix = len(teacher.prefix_ids), len(teacher.suffix_ids)
    counts = latent_mask.sum(1).tolist()
    assert ti.input_ids.shape[1] == ids.shape[1] + n_prefix + n_suffix + max(counts)
    torch.testing.assert_close(ti.inputs_embeds[ti.latent_slots], latents[latent_mask], rtol=0, atol=0)
    for b in range(2):
        # the student's tokens are where index_map says, the context is prefix + placeholders + suffix
        assert torch.equal(ti.input_ids[b, ti.index_map[b]], ids[b])
        assert torch.equal(ti.attention_mask[b, ti.index_map[b]], mask[b])
        expected = teacher.prefix_ids + [teacher.placeholder_id] * counts[b] + teacher.suffix_ids
        assert ti.input_ids[b][ti.context_mask[b]].tolist() == expected
        slots = ti.latent_slots[b].nonzero().squeeze(-1)
        first = int(ti.index_map[b, pos[b]]) - len(expected) + n_prefix  # the context ends where the content starts
        assert slots.tolist() == list(range(first, first + counts[b]))
        # positions count real tokens only, the student's user content follows the context
        real = ti.attention_mask[b].bool()
        assert ti.position_ids[b][real].tolist() == list(range(int(real.sum())))
    # the other embeddings are the token embeddings
    with torch.no_grad():
        token_embeds = backbone.get_input_embeddings()(ti.input_ids)
    keep = ~ti.latent_slots
    torch.testing.assert_close(ti.inputs_embeds[keep], token_embeds[keep], rtol=0, atol=0)


@pytest.mark.parametrize("student", ["lora", "full"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("empty", ["none", "j0", "all_masked", "empty_text"])
def test_no_context_equals_student(student, side, empty):
    backbone = backbone_for(student)
    teacher = SelfTeacher(backbone, TOKENIZER, mode="live")
    ids, mask, pos, _ = batch(side)
    kwargs = {
        "none": {},
        "j0": {"latents": torch.zeros(2, 0, D), "latent_mask": torch.zeros(2, 0, dtype=torch.bool)},
        "all_masked": {"latents": torch.randn(2, 8, D), "latent_mask": torch.zeros(2, 8, dtype=torch.bool)},
        "empty_text": {"context_ids": [[], None]},
    }[empty]
    ti = teacher.insert_context(ids, mask, pos, **kwargs)
    assert ti.input_ids.shape == ids.shape and not ti.context_mask.any()
    got = teacher_logps(teacher, ids, mask, pos, **kwargs)
    want = student_logps(backbone, ids, mask)
    keep = valid_pairs(mask)
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=0)


def test_context_changes_logits_with_right_shape():
    backbone = backbone_for("lora")
    teacher = SelfTeacher(backbone, TOKENIZER)
    ids, mask, pos, _ = batch("left")
    latents, latent_mask = latents_for()
    with torch.no_grad():
        with_ctx = teacher.logits_on_student_positions(ids, mask, pos, latents=latents, latent_mask=latent_mask)
        without = teacher.logits_on_student_positions(ids, mask, pos)
        with use_adapter(backbone, STUDENT):
            student = backbone(ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    assert with_ctx.shape == without.shape == student.shape == (2, ids.shape[1], 259)
    torch.testing.assert_close(without, student, atol=1e-5, rtol=0)
    after = torch.zeros_like(mask, dtype=torch.bool)
    for b in range(2):
        after[b, pos[b] :] = mask[b, pos[b] :].bool()
    assert (with_ctx - without).abs().amax(-1)[after].min() > 1e-4  # every position after the context moves
    before = mask.bool() & ~after
    torch.testing.assert_close(with_ctx[before], without[before], atol=1e-5, rtol=0)  # causal: before it, no change


@pytest.mark.parametrize("student", ["lora", "full"])
@pytest.mark.parametrize("mode", ["live", "base", "ema"])
def test_gradient_reaches_latents_not_backbone(student, mode):
    backbone = backbone_for(student)
    teacher = SelfTeacher(backbone, TOKENIZER, mode=mode)
    flags = {n: p.requires_grad for n, p in backbone.named_parameters()}
    ids, mask, pos, assistant = batch("left")
    latents, latent_mask = latents_for()
    logps = teacher_logps(teacher, ids, mask, pos, latents=latents, latent_mask=latent_mask)
    (logps * assistant[:, 1:]).sum().backward()
    assert latents.grad is not None and torch.isfinite(latents.grad).all()
    assert latents.grad[latent_mask].abs().sum(-1).gt(0).all()  # every used latent gets a gradient
    assert (latents.grad[~latent_mask] == 0).all()  # a dropped latent gets none
    assert all(p.grad is None for p in backbone.parameters())
    assert all(p.grad is None for p in teacher.parameters())
    assert {n: p.requires_grad for n, p in backbone.named_parameters()} == flags


@pytest.mark.parametrize("context", ["latents", "text"])
def test_left_and_right_padding_agree(context):
    backbone = backbone_for("lora")
    teacher = SelfTeacher(backbone, TOKENIZER)
    latents, latent_mask = latents_for()
    texts = teacher.encode_text_context(["the answer is 5", None])
    out = {}
    for side in ("left", "right"):
        ids, mask, pos, _ = batch(side)
        kwargs = {"latents": latents, "latent_mask": latent_mask} if context == "latents" else {"context_ids": texts}
        with torch.no_grad():
            out[side] = unpad(teacher_logps(teacher, ids, mask, pos, **kwargs), mask)
    for left, right in zip(out["left"], out["right"], strict=True):
        torch.testing.assert_close(left, right, atol=1e-5, rtol=0)



def test_a_text_context_is_the_framing_prefix_the_text_and_the_framing_suffix_tokenised_together():
    """The framing of every text context (LOPD's encode_text_context, OPSD's retrieved trace, the benchmarks'
    text_nearest): DEFAULT_FRAMING_PREFIX + text + DEFAULT_FRAMING_SUFFIX, one string, tokenised as data."""
    from lopd_lightning.text import encode_data

    teacher = SelfTeacher(backbone_for("lora"), TOKENIZER)
    framed = teacher.frame_text_context(["x = 1", None, ""])
    assert framed == ["Here is a reference example of a different, already solved task:\nx = 1\nNow complete your task.\n\n",
                      None, None]
    assert teacher.encode_text_context(["x = 1", None, ""]) == [encode_data(TOKENIZER, framed[0]), [], []]
    assert teacher.frame_text_context(["x", ""], prefix="ref: ", suffix="") == ["ref: x", None]
    assert frame_text("x = 1") == framed[0] and frame_text("") is None and frame_text("x", "ref: ", "") == "ref: x"

def test_text_context_equals_manual_concatenation():
    backbone = backbone_for("lora")
    teacher = SelfTeacher(backbone, TOKENIZER)
    ids, mask, pos, _ = batch("right")
    context_ids = teacher.encode_text_context(["a solved example: 2 + 3 = 5", "s[::-1]"])
    assert context_ids[0][: len(teacher.prefix_ids)] == teacher.prefix_ids
    with torch.no_grad():
        got = teacher.logits_on_student_positions(ids, mask, pos, context_ids=context_ids)
        for b, seq in enumerate(rows()):
            p = int(pos[b])
            manual = torch.tensor([seq[:p] + context_ids[b] + seq[p:]])
            with use_adapter(backbone, STUDENT):
                logits = backbone(manual).logits[0]
            student_index = torch.cat([torch.arange(p), torch.arange(p, len(seq)) + len(context_ids[b])])
            torch.testing.assert_close(got[b, : len(seq)], logits[student_index], atol=1e-5, rtol=0)


def test_base_mode_lora_student_equals_disabled_adapters():
    backbone = backbone_for("lora")
    base = SelfTeacher(backbone, TOKENIZER, mode="base")
    live = SelfTeacher(backbone, TOKENIZER, mode="live")
    ids, mask, pos, _ = batch("left")
    with torch.no_grad():
        got = base.logits_on_student_positions(ids, mask, pos)
        with use_adapter(backbone, None):
            want = backbone(ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        live_logits = live.logits_on_student_positions(ids, mask, pos)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=0)
    assert not torch.allclose(live_logits[keep], want[keep], atol=1e-3)  # the student adapter matters


def test_ema_update_math_lora_student():
    backbone = backbone_for("lora")
    teacher = SelfTeacher(backbone, TOKENIZER, mode="ema", ema_rate=0.25)
    assert teacher.adapter == TEACHER_EMA
    ema_params = adapter_parameters(backbone, TEACHER_EMA)
    student = adapter_parameters(backbone, STUDENT)
    assert len(ema_params) == len(student)
    for e, s in zip(ema_params, student, strict=True):
        torch.testing.assert_close(e, s)  # starts at the student
        assert not e.requires_grad and s.requires_grad
    with torch.no_grad():
        for e, s in zip(ema_params, student, strict=True):
            e.fill_(1.0)
            s.fill_(3.0)
    teacher.update_ema()
    # (1 - 0.25) * 1 + 0.25 * 3 = 1.5, then (0.75) * 1.5 + 0.25 * 3 = 1.875
    assert all(torch.allclose(e, torch.full_like(e, 1.5)) for e in ema_params)
    teacher.update_ema()
    assert all(torch.allclose(e, torch.full_like(e, 1.875)) for e in ema_params)
    assert all(torch.allclose(s, torch.full_like(s, 3.0)) for s in student)
    # the EMA teacher runs the EMA adapter: equal to the student when the weights are equal
    ids, mask, pos, _ = batch("right")
    with torch.no_grad():
        for e, s in zip(ema_params, student, strict=True):
            e.copy_(s * 0.5)
        ema_logits = teacher.logits_on_student_positions(ids, mask, pos)
        for s in student:
            s.mul_(0.5)
        with use_adapter(backbone, STUDENT):
            want = backbone(ids, attention_mask=mask).logits
    torch.testing.assert_close(ema_logits[mask.bool()], want[mask.bool()], atol=1e-5, rtol=0)


def test_ema_and_base_full_student_keep_one_logged_copy(caplog):
    backbone = backbone_for("full")
    storage = parameter_storage(backbone)
    with caplog.at_level(logging.WARNING, logger="lopd_lightning.teacher"):
        teacher = SelfTeacher(backbone, TOKENIZER, mode="ema", ema_rate=0.5)
    assert any("deepcopy" in r.message for r in caplog.records)
    assert teacher.shadow is not None
    assert not parameter_storage(teacher.shadow) & storage
    assert all(not p.requires_grad for p in teacher.shadow.parameters())
    pairs = teacher.ema_parameter_pairs()
    assert len(pairs) == len(base_parameters(backbone))
    with torch.no_grad():
        for e, s in pairs:
            e.fill_(0.0)
            s.fill_(2.0)
    teacher.update_ema()
    assert all(torch.allclose(e, torch.ones_like(e)) for e, _ in pairs)  # 0.5 * 0 + 0.5 * 2

    backbone = backbone_for("full")
    ids, mask, pos, _ = batch("left")
    base = SelfTeacher(backbone, TOKENIZER, mode="base")
    with torch.no_grad():
        initial = base.logits_on_student_positions(ids, mask, pos)
        for p in base_parameters(backbone):
            p.mul_(1.1)  # the student moves, the base teacher does not
        later = base.logits_on_student_positions(ids, mask, pos)
        live = SelfTeacher(backbone, TOKENIZER, mode="live").logits_on_student_positions(ids, mask, pos)
    torch.testing.assert_close(initial, later)
    assert not torch.allclose(live[mask.bool()], later[mask.bool()], atol=1e-3)


@pytest.mark.parametrize("mode", ["live", "base", "ema"])
def test_no_second_backbone_copy_for_lora_student(mode):
    backbone = backbone_for("lora")
    storage = {p.data_ptr() for p in base_parameters(backbone)}
    numel = sum(p.numel() for p in backbone.parameters())
    student_numel = sum(p.numel() for p in adapter_parameters(backbone, STUDENT))
    composer = LatentComposer(backbone, TOKENIZER, num_latents=2, depth=1)
    teacher = SelfTeacher(backbone, TOKENIZER, mode=mode)
    assert teacher.shadow is None and list(teacher.parameters()) == []
    assert {p.data_ptr() for p in base_parameters(backbone)} == storage
    extra = sum(p.numel() for p in backbone.parameters()) - numel
    assert extra == (student_numel if mode == "ema" else 0)  # at most one more LoRA, never a backbone
    everything = {p.data_ptr() for m in (backbone, composer, teacher) for p in m.parameters()}
    assert len(everything) == len(list(backbone.parameters())) + len(list(composer.parameters()))


def test_warm_start_loss_trains_composer_only():
    backbone = backbone_for("lora")
    composer = LatentComposer(backbone, TOKENIZER, num_latents=2, depth=2)
    teacher = SelfTeacher(backbone, TOKENIZER, mode="base")
    ids, mask, pos, assistant = batch("left")
    out = composer.compose([[("add 1 and 1", "2")], [("reverse 'xy'", "yx"), ("add 0 and 0", "0")]])
    loss = latent_nll(teacher, out, ids, mask, pos, assistant)
    assert loss.ndim == 0 and loss > 0
    # by hand: the masked token mean of -logp on the assistant tokens
    with torch.no_grad():
        logps = teacher_logps(teacher, ids, mask, pos, latents=out.latents, latent_mask=out.latent_mask)
        m = (assistant[:, 1:] * mask[:, 1:]).float()
        torch.testing.assert_close(loss.detach(), -(logps * m).sum() / m.sum())
    loss.backward()
    assert all(p.grad is not None for p in composer.trainable_parameters())
    assert all(p.grad is None for p in adapter_parameters(backbone, STUDENT))
    assert all(p.grad is None for p in base_parameters(backbone))
    # no latent at all (empty bank): still a tensor that backward() accepts
    empty = ComposerOutput(torch.zeros(2, 0, D, requires_grad=True), torch.zeros(2, 0, dtype=torch.bool))
    latent_nll(teacher, empty, ids, mask, pos, assistant).backward()


def test_insert_context_rejects_bad_input():
    teacher = SelfTeacher(backbone_for("lora"), TOKENIZER)
    ids, mask, pos, _ = batch("right")
    with pytest.raises(ValueError):
        teacher.insert_context(ids, mask, pos, context_ids=[[5]], latents=torch.zeros(2, 1, D))
    with pytest.raises(ValueError):
        teacher.insert_context(ids, mask, torch.tensor([0, ids.shape[1] + 1]))
    with pytest.raises(ValueError):
        SelfTeacher(teacher.backbone, TOKENIZER, mode="frozen")


# ------------------------------------------------------------------------------ the package's names
def test_the_teacher_package_serves_its_public_names():
    import importlib

    package = importlib.import_module("lopd_lightning.teacher")
    for name in package.__all__:
        assert getattr(package, name) is not None, name
    assert package.TeacherWeights in package.SelfTeacher.__mro__


def test_on_student_positions_gives_the_packed_logits_or_hidden_states():
    teacher = SelfTeacher(backbone_for("lora"), TOKENIZER)
    ids, mask, pos, assistant = batch("right")
    latents, latent_mask = latents_for()
    positions = assistant.bool()
    with torch.no_grad():
        full = teacher.logits_on_student_positions(ids, mask, pos, latents=latents, latent_mask=latent_mask)
        logits = teacher.on_student_positions(ids, mask, pos, positions=positions, latents=latents, latent_mask=latent_mask)
        hidden = teacher.on_student_positions(
            ids, mask, pos, positions=positions, output="hidden", latents=latents, latent_mask=latent_mask
        )
    torch.testing.assert_close(logits, full[positions], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.nn.functional.linear(hidden, *teacher.head_parameters()), logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="output must be 'logits' or 'hidden'"):
        teacher.on_student_positions(ids, mask, pos, positions=positions, output="probs")


def test_the_splicing_steps_by_hand():
    from lopd_lightning.teacher.splice import Framing, fit_contexts, place_latents, splice, student_to_teacher_positions

    framing = Framing(prefix_ids=[90], suffix_ids=[91], placeholder_id=0)
    assert framing.around(2) == [90, 0, 0, 91] and framing.around(0) == []
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 1]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # right padded (pad id 1)
    contexts = [framing.around(2), framing.around(1)]
    inputs = splice(ids, mask, torch.tensor([1, 2]), contexts, pad_id=1, slots=(1, [2, 1]))
    assert inputs.input_ids.tolist() == [[5, 90, 0, 0, 91, 6, 7, 8], [5, 6, 90, 0, 91, 7, 1, 1]]
    assert inputs.attention_mask.tolist() == [[1] * 8, [1, 1, 1, 1, 1, 1, 0, 0]]
    assert inputs.index_map.tolist() == [[0, 5, 6, 7], [0, 1, 5, 6]]
    assert inputs.context_mask.long().tolist() == [[0, 1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0]]
    assert inputs.latent_slots.long().tolist() == [[0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0]]
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 5, 5]]
    assert inputs.inputs_embeds is None
    positions = torch.tensor([[0, 1, 0, 1], [1, 0, 1, 0]], dtype=torch.bool)
    assert student_to_teacher_positions(inputs, positions).nonzero().tolist() == [[0, 5], [0, 7], [1, 0], [1, 5]]
    # the latents at the slots, row-major; the token embeddings elsewhere
    embeds = torch.zeros(2, 8, 3)
    latents = torch.arange(12.0).reshape(2, 2, 3).requires_grad_(True)
    latent_mask = torch.tensor([[True, True], [False, True]])
    out = place_latents(embeds, latents, latent_mask, inputs.latent_slots)
    assert out[0, 2:4].tolist() == latents[0].tolist() and out[1, 3].tolist() == latents[1, 1].tolist()
    assert out[~inputs.latent_slots].abs().sum() == 0
    out.sum().backward()
    assert latents.grad.tolist() == [[[1.0] * 3, [1.0] * 3], [[0.0] * 3, [1.0] * 3]]
    # a context that does not fit: latents keep their first slots inside the framing, text its two ends
    cut = fit_contexts([framing.around(2), framing.around(1)], [2, 1], latent_mask.clone(), [4, 3],
                       max_length=7, framing=framing)
    assert cut[0] == [framing.around(1), framing.around(1)] and cut[1] == [1, 1] and cut[3] == 1
    assert cut[2].tolist() == [[True, False], [False, True]]
    text = fit_contexts([[10, 11, 12, 13, 14]], [0], None, [4], max_length=7, framing=framing)
    assert text[0] == [[10, 13, 14]] and text[3] == 1
