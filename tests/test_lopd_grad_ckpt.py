"""LOPDModule(gradient_checkpointing=True): the checkpointed step equals the plain one.

One LOPD backward runs through passes made under different LoRA adapters and ``requires_grad`` flags
(the student's pass under ``"student"``, the composer's encoder under ``"composer"`` with only psi
trainable, the teacher under its mode's weights, every backbone weight constant, in eval mode). With
activation checkpointing each decoder layer run in train mode with gradients is recomputed in that
backward, after the contexts have switched back; :class:`~lopd_lightning.checkpointing.ForwardStateRecompute`
recomputes it under the state its forward had. These tests check, on the tiny model and the toy task
(CPU, float32, seeded), that one training step logs the same losses and produces the same gradient for
every trainable parameter (student LoRA or every base weight, composer LoRA, resampler) with and
without checkpointing, LoRA dropout included; and that without the recompute context it does not. On the
bare two-adapter backbone: a retained graph's second backward recomputes again with the plain model's
gradients, and a recomputation that raises leaves the backward-time state.

The LoRAs start random (``init_lora_weights: false``): peft's default B = 0 makes every adapter the base
model at the first step, and a recomputation under the wrong adapter would then go unseen.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from lopd_lightning import checkpointing
from lopd_lightning.composer import latent_nll
from lopd_lightning.modules import LOPDModule
from lopd_lightning.tasks.toy import ToyTask
from lopd_lightning.teacher import weights as teacher_weights

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
    "full_base_teacher": dict(lora=None, composer_lora=COMPOSER_LORA, teacher_mode="base"),  # a frozen deepcopy
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


def recording_nothing(self: checkpointing.ForwardStateRecompute) -> tuple[nullcontext, nullcontext]:
    """A context_fn that counts the checkpointed forward (LOPD checks that some ran) and restores nothing."""
    self.forwards += 1
    return nullcontext(), nullcontext()


@pytest.mark.parametrize("shapes", ["other", "same"])
def test_without_the_recompute_context_the_step_fails_or_its_gradients_differ(tmp_path, bank_dir, monkeypatch, shapes):
    """The test above can fail: without the recompute context the composer's encoder layers are recomputed
    in the backward under the backward-time state (the student's adapter active, every adapter trainable).
    With a student LoRA on other layers than the composer's, the recomputation saves other tensors and
    torch's checkpoint raises CheckpointError; with one shaped like the composer's, it is silently
    recomputed under the student's LoRA: the same losses, other composer gradients. (The teacher's layers,
    checkpointed with every weight constant, would save other tensors when recomputed with trainable ones
    and raise too; the silent case is shown with them not checkpointed.)"""
    case = "lora" if shapes == "other" else "same_shapes"
    if shapes == "same":
        monkeypatch.setattr(teacher_weights, "layers_checkpointed_in_eval", lambda model: nullcontext(0))
    ref = checkpointed_step(tmp_path, bank_dir, False, case)
    if shapes == "same":
        assert_same_step(ref, checkpointed_step(tmp_path, bank_dir, True, case))  # with the context: the same
    monkeypatch.setattr(checkpointing.ForwardStateRecompute, "__call__", recording_nothing)
    if shapes == "other":
        with pytest.raises(torch.utils.checkpoint.CheckpointError, match="different (number of tensors|metadata)"):
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
    loss = latent_nll(module.teacher, module.batch_latents(batch), batch.input_ids, batch.attention_mask,
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


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def two_adapter_backbone(checkpointed: bool):
    """The tiny model with random student and composer LoRAs on every projection, in train mode."""
    from lopd_lightning.adapters import add_composer_adapter, prepare_backbone
    from lopd_lightning.models import tiny_model

    torch.manual_seed(1)
    model = tiny_model(seed=0)
    if checkpointed:
        assert checkpointing.enable_activation_checkpointing(model) == len(model.model.layers)
    model.config.use_cache = False
    model.train()
    lora = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": TARGETS, "init_lora_weights": False}
    return add_composer_adapter(prepare_backbone(model, student_lora=lora), lora)


def composer_loss(backbone, ids: torch.Tensor) -> torch.Tensor:
    from lopd_lightning.adapters import COMPOSER, use_adapter

    with use_adapter(backbone, COMPOSER, grads="adapter"):  # switched back to the student's before the backward
        return backbone(input_ids=ids).logits.float().pow(2).mean()


def grads_of(backbone) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in backbone.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("second", ["backward", "autograd.grad"])
def test_a_retained_graph_recomputes_each_layer_again_under_its_forward_state(second):
    """Each backward through a retained graph recomputes the checkpointed layers once more: the recompute
    context is entered again (it was a single-use generator context: AttributeError on the second use) and
    gives the gradients of the plain model doing the same two backward passes."""
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    results = []
    for checkpointed in (False, True):
        backbone = two_adapter_backbone(checkpointed)
        loss = composer_loss(backbone, ids)
        psi = [p for name, p in backbone.named_parameters() if ".composer." in name]
        first = torch.autograd.grad(loss, psi, retain_graph=True) if second == "autograd.grad" else None
        if first is None:
            loss.backward(retain_graph=True)
        loss.backward()
        results.append((first, grads_of(backbone)))
    (ref_first, ref), (got_first, got) = results
    assert ref and set(ref) == set(got) and all(".composer." in name for name in ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)
    for a, b in zip(ref_first or [], got_first or [], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_a_recomputation_that_raises_restores_the_backward_time_state():
    backbone = two_adapter_backbone(True)
    layer = backbone.get_base_model().model.layers[0]
    q_proj = layer.self_attn.q_proj

    def state():
        return (list(q_proj.active_adapters), q_proj.disable_adapters, [p.requires_grad for p in layer.parameters()],
                [m.training for m in layer.modules()])

    before = state()
    loss = composer_loss(backbone, torch.randint(3, 200, (2, 12)))

    def boom(*args, **kwargs):
        raise RuntimeError("boom in the recomputation")

    q_proj.forward = boom
    try:
        with pytest.raises(RuntimeError, match="boom in the recomputation"):
            loss.backward()
    finally:
        del q_proj.forward
    assert state() == before


def test_the_recorded_layout_follows_added_adapters_and_no_grad_records_nothing():
    """The layer's tuner layers and parameters are listed once and again after an adapter is added (here
    copied); without grad mode the checkpointed layers record nothing (transformers 5.19 still calls
    the checkpoint there, 5.24 does not)."""
    from lopd_lightning.adapters import COMPOSER, copy_adapter

    backbone = two_adapter_backbone(True)
    layers = backbone.get_base_model().model.layers
    context = layers[0]._gradient_checkpointing_func.keywords["context_fn"]
    ids = torch.randint(3, 200, (2, 12))
    composer_loss(backbone, ids).backward()
    assert checkpointing.recorded_forwards(backbone) == len(layers) and context.layout() is context.layout()
    with torch.no_grad():
        composer_loss(backbone, ids)
    assert checkpointing.recorded_forwards(backbone) == len(layers)
    copied = {id(p) for p in copy_adapter(backbone, COMPOSER, "snapshot") if any(p is q for q in layers[0].parameters())}
    assert copied and copied <= {id(p) for p in context.layout().params}


def test_a_training_step_that_checkpointed_no_layer_is_an_error(tmp_path, bank_dir):
    """The count at construction is not enough: a model whose forward skips the layers' checkpoint (here
    switched off after construction) would recompute nothing under the right adapter, or not checkpoint."""
    from test_lopd_module import EvenToy, make_dm, make_trainer

    module = make_module(bank_dir, gradient_checkpointing=True, lora=LORA)
    for layer in module.backbone.get_base_model().model.layers:
        layer.gradient_checkpointing = False
    with pytest.raises(RuntimeError, match="ran no layer through the checkpoint"):
        make_trainer(tmp_path, max_steps=1).fit(module, make_dm(EvenToy(), examples_per_step=2))


def teacher_pass(module: LOPDModule, batch, *, prefix: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The teacher's logits at the student's positions with the composer's latents, the latents' gradient of
    their squared sum, and the bytes autograd saved outside checkpointed layers during the teacher's pass."""
    targets, mask = module.shifted(batch)
    composed = module.batch_latents(batch)
    latents = composed.latents.detach().requires_grad_(True)
    n = module._prefix_length(batch) if not prefix else 3
    cache = module.teacher.own_prefix(batch.input_ids, batch.attention_mask, n) if prefix else None
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = module.teacher.on_student_positions(
            batch.input_ids, batch.attention_mask, batch.context_position, positions=module.unshift(mask),
            latents=latents, latent_mask=composed.latent_mask, prefix=cache)
    logits.float().pow(2).sum().backward()
    return logits.detach(), latents.grad, sum(saved)


def test_the_teachers_pass_is_checkpointed_in_eval_mode_with_the_same_values_and_gradients(bank_dir):
    """With gradient_checkpointing the teacher's layers keep only their inputs (autograd saves far fewer
    bytes during its pass), its values and the latents' gradient are the plain pass's (eval mode: no dropout,
    the LoRA dropout of this case included), every train flag is restored, and LOPD's step no longer uses the
    prefix cache (a checkpointed layer would drop it)."""
    module = make_module(bank_dir, gradient_checkpointing=True, **CASES["lora_dropout"])
    module.train()
    assert module.teacher.checkpoint_layers and module._prefix_length(object()) == 0
    task = ToyTask()
    examples = task.examples("train")[:2]
    batch = module.reference_batch(task, examples)
    batch.experiences = module.retrieve(task, examples)
    flags = [m.training for m in module.backbone.modules()]
    torch.manual_seed(0)
    logits, grad, saved = teacher_pass(module, batch, prefix=False)
    assert [m.training for m in module.backbone.modules()] == flags
    module.teacher.checkpoint_layers = False
    torch.manual_seed(0)
    ref_logits, ref_grad, ref_saved = teacher_pass(module, batch, prefix=False)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert grad.abs().sum() > 0 and saved < ref_saved / 4, (saved, ref_saved)
    # a pass that reads a prefix cache is not checkpointed (the layers would drop the cache): the same bytes
    module.teacher.checkpoint_layers = True
    torch.manual_seed(0)
    with_prefix = teacher_pass(module, batch, prefix=True)
    module.teacher.checkpoint_layers = False
    torch.manual_seed(0)
    plain_prefix = teacher_pass(module, batch, prefix=True)
    torch.testing.assert_close(with_prefix[0], plain_prefix[0], rtol=0, atol=0)
    assert with_prefix[2] == plain_prefix[2]
