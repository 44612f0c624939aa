"""The shared backbone with named adapters: switching, requires_grad protection, gradient isolation."""

from __future__ import annotations

import pytest
import torch

from lopd_lightning.adapters import (
    COMPOSER,
    STUDENT,
    add_composer_adapter,
    adapter_names,
    adapter_parameters,
    base_parameters,
    composer_lora_parameters,
    default_lora_config,
    parameter_storage,
    prepare_backbone,
    student_adapter_name,
    student_parameters,
    use_adapter,
)
from lopd_lightning.models import tiny_model

STUDENT_LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def perturb(peft_model, name: str, seed: int, scale: float = 0.5) -> None:
    """Give adapter ``name`` non-zero LoRA B weights (peft initialises B to 0: no effect until trained)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(peft_model, name):
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def ids(batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 259, (batch, length), generator=torch.Generator().manual_seed(seed))


def flags(model) -> dict[str, bool]:
    return {n: p.requires_grad for n, p in model.named_parameters()}


@pytest.fixture
def lora_backbone():
    model = tiny_model()
    reference = model(ids()).logits.detach()
    pm = prepare_backbone(model, student_lora=STUDENT_LORA, composer_lora=default_lora_config())
    perturb(pm, STUDENT, 1)
    perturb(pm, COMPOSER, 2)
    return pm, reference


@pytest.fixture
def full_backbone():
    model = tiny_model()
    pm = prepare_backbone(model, student_lora=None, composer_lora=default_lora_config(r=4, lora_alpha=8))
    perturb(pm, COMPOSER, 2)
    return pm


def test_prepare_backbone_lora_student_flags_and_no_copy():
    model = tiny_model()
    storage = parameter_storage(model)
    pm = prepare_backbone(model, student_lora=STUDENT_LORA, composer_lora=default_lora_config())
    assert adapter_names(pm) == [STUDENT, COMPOSER]
    assert student_adapter_name(pm) == STUDENT
    assert storage == {p.data_ptr() for p in base_parameters(pm)}  # base weights are the original tensors
    assert all(not p.requires_grad for p in base_parameters(pm))
    assert all(p.requires_grad for p in student_parameters(pm))
    assert all(p.requires_grad for p in composer_lora_parameters(pm))
    # default composer LoRA: rank 8 on the seven projections (2 layers x 7 modules x (A, B))
    assert pm.peft_config[COMPOSER].r == 8 and pm.peft_config[COMPOSER].lora_alpha == 16
    assert len(composer_lora_parameters(pm)) == 2 * 7 * 2
    assert len(student_parameters(pm)) == 2 * 3 * 2


def test_prepare_backbone_full_student_keeps_base_trainable():
    model = tiny_model()
    model.model.embed_tokens.weight.requires_grad_(False)  # a flag the user set stays as it was
    pm = prepare_backbone(model, student_lora=None, composer_lora=default_lora_config())
    assert adapter_names(pm) == [COMPOSER]
    assert student_adapter_name(pm) is None
    base = base_parameters(pm)
    assert student_parameters(pm) == base
    assert not model.model.embed_tokens.weight.requires_grad
    assert all(p.requires_grad for p in base if p is not model.model.embed_tokens.weight)
    # the student's forward (adapters disabled) is the plain model
    with use_adapter(pm, None):
        out = pm(ids()).logits
    assert out.shape == (2, 9, 259)


def test_prepare_backbone_without_a_composer_adds_no_composer_parameter():
    # a LoRA student: only the student's adapter; every trainable parameter is the student's
    pm = prepare_backbone(tiny_model(), student_lora=STUDENT_LORA, composer_lora=None)
    assert adapter_names(pm) == [STUDENT]
    assert {id(p) for p in pm.parameters() if p.requires_grad} == {id(p) for p in student_parameters(pm)}
    # a full student: no adapter at all, the model itself, every weight trainable
    model = tiny_model()
    plain = prepare_backbone(model, student_lora=None, composer_lora=None)
    assert plain is model and adapter_names(plain) == [] and student_adapter_name(plain) is None
    assert student_parameters(plain) == list(model.parameters())
    with use_adapter(plain, None, grads="none"):  # only the gradient mode acts on a plain model
        assert not any(p.requires_grad for p in plain.parameters())
    assert all(p.requires_grad for p in plain.parameters())
    with pytest.raises(ValueError, match="unknown adapter 'composer'"):
        with use_adapter(plain, COMPOSER):
            pass


@pytest.mark.parametrize("method", ["GRPOModule", "SDPOModule", "OPSDModule", "SkillSDModule", "SFTModule", "LOPDModule"])
@pytest.mark.parametrize("lora", [STUDENT_LORA, None], ids=["lora", "full"])
def test_every_trainable_parameter_of_a_method_is_in_its_optimisers(method, lora):
    # a trainable parameter no optimiser owns never gets a gradient: DDP then skips its all-reduce and
    # fails on the next step (issue: GRPO under DDP carried an unused composer adapter)
    import lopd_lightning.modules as modules

    options = {"group_size": 2} if method in ("GRPOModule", "SDPOModule", "SkillSDModule") else {}
    if method == "LOPDModule":
        options.update(num_latents=2, composer_depth=1, embedder="hashing", distill_top_k=8)
    module = getattr(modules, method)("tiny", lora=lora, **options)
    optimisers = module.configure_optimizers()
    optimisers = optimisers if isinstance(optimisers, (list, tuple)) else [optimisers]
    owned = {id(p) for opt in optimisers for group in opt.param_groups for p in group["params"]}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert {n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owned} == set()
    has_composer = any("composer" in n for n in trainable)
    assert has_composer == (method == "LOPDModule")


@pytest.mark.parametrize("key", ["lora", "composer_lora"])
@pytest.mark.parametrize("field, value", [("modules_to_save", ["lm_head"]), ("trainable_token_indices", [5, 6])])
def test_a_lora_config_the_backbone_cannot_honour_is_refused_before_the_weights_load(key, field, value):
    # peft would add a trainable copy outside the LoRA layers, frozen here and shared by every role
    options = {key: {**STUDENT_LORA, field: value}}
    if key == "lora":
        from lopd_lightning.modules import GRPOModule as method
        options["group_size"] = 2
    else:
        from lopd_lightning.modules import LOPDModule as method
        options["lora"] = STUDENT_LORA
    with pytest.raises(ValueError) as info:
        method("no-such-model", **options)  # refused before the (missing) model is looked for
    message = str(info.value)
    assert f"model.init_args.{key}.{field}=" in message and "not supported" in message and "\n" not in message


@pytest.mark.parametrize(
    "targets, expected",
    [(["q_prj"], "names ['q_prj'], which this model does not have"), (["norm"], "'norm', a LlamaRMSNorm, which LoRA cannot wrap")],
)
def test_lora_target_modules_must_be_layers_lora_can_wrap(targets, expected):
    with pytest.raises(ValueError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        prepare_backbone(tiny_model(), student_lora={**STUDENT_LORA, "target_modules": targets}, composer_lora=None)
    with pytest.raises(ValueError, match="model.init_args.composer_lora.target_modules"):
        prepare_backbone(tiny_model(), student_lora=None, composer_lora={"r": 2, "target_modules": targets})
    # a dotted suffix (peft's rule) is a valid name
    pm = prepare_backbone(tiny_model(), student_lora={**STUDENT_LORA, "target_modules": ["self_attn.q_proj"]})
    assert adapter_names(pm) == [STUDENT]


def test_use_adapter_switches_outputs(lora_backbone):
    pm, reference = lora_backbone
    x = ids()
    with torch.no_grad():
        with use_adapter(pm, STUDENT):
            student = pm(x).logits
        with use_adapter(pm, COMPOSER):
            composer = pm(x).logits
        with use_adapter(pm, None):
            base = pm(x).logits
    assert not torch.allclose(student, base, atol=1e-4)
    assert not torch.allclose(composer, base, atol=1e-4)
    assert not torch.allclose(student, composer, atol=1e-4)
    torch.testing.assert_close(base, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", [STUDENT, COMPOSER, None])
@pytest.mark.parametrize("grads", ["keep", "adapter", "none"])
def test_use_adapter_preserves_flags_and_active_adapter(lora_backbone, name, grads):
    pm, _ = lora_backbone
    before = flags(pm)
    active = pm.active_adapter
    with use_adapter(pm, name, grads=grads):
        inside = flags(pm)
        if grads == "keep":
            assert inside == before
        elif grads == "none":
            assert not any(inside.values())
        else:
            own = {id(p) for p in adapter_parameters(pm, name)} if name else set()
            for n, p in pm.named_parameters():
                assert p.requires_grad == (before[n] and id(p) in own)
    assert flags(pm) == before
    assert pm.active_adapter == active
    with torch.no_grad():
        after = pm(ids()).logits
        with use_adapter(pm, STUDENT):
            student = pm(ids()).logits
    torch.testing.assert_close(after, student)  # STUDENT was active before: it is again


def test_use_adapter_restores_disabled_state_nested_and_on_error(full_backbone):
    pm = full_backbone
    before = flags(pm)
    x = ids()
    with torch.no_grad():
        plain = pm(x).logits  # full student: adapters disabled by prepare_backbone
        with use_adapter(pm, COMPOSER):
            composed = pm(x).logits
            with use_adapter(pm, None):
                torch.testing.assert_close(pm(x).logits, plain)
            torch.testing.assert_close(pm(x).logits, composed)
        with pytest.raises(RuntimeError), use_adapter(pm, COMPOSER):
            raise RuntimeError("boom")
        torch.testing.assert_close(pm(x).logits, plain)
    assert flags(pm) == before
    with pytest.raises(ValueError):
        with use_adapter(pm, STUDENT):  # no student adapter for a full student
            pass


def test_gradient_isolation_lora_student(lora_backbone):
    pm, _ = lora_backbone
    x = ids()
    with use_adapter(pm, COMPOSER, grads="adapter"):
        loss = pm(x).logits.square().mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in composer_lora_parameters(pm))
    assert all(p.grad is None for p in student_parameters(pm))
    assert all(p.grad is None for p in base_parameters(pm))
    pm.zero_grad(set_to_none=True)
    with use_adapter(pm, STUDENT):
        loss = pm(x).logits.square().mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in student_parameters(pm))
    assert all(p.grad is None for p in composer_lora_parameters(pm))
    assert all(p.grad is None for p in base_parameters(pm))


def test_gradient_isolation_full_student(full_backbone):
    pm = full_backbone
    x = ids()
    # composer pass: base weights require grad (they are the student) but get none from this pass
    with use_adapter(pm, COMPOSER, grads="adapter"):
        loss = pm(x).logits.square().mean()
    assert all(p.requires_grad for p in base_parameters(pm))
    loss.backward()  # after the context: the flags are back on, the graph still excludes the base
    assert all(p.grad is None for p in base_parameters(pm))
    assert all(p.grad is not None for p in composer_lora_parameters(pm))
    pm.zero_grad(set_to_none=True)
    # teacher-like pass: no parameter gets a gradient, the input embeddings do
    embeds = pm.get_input_embeddings()(x).detach().requires_grad_(True)
    with use_adapter(pm, None, grads="none"):
        loss = pm(inputs_embeds=embeds).logits.square().mean()
    loss.backward()
    assert all(p.grad is None for p in pm.parameters())
    assert embeds.grad is not None and embeds.grad.abs().sum() > 0
    # student pass: the base weights get gradients, the composer LoRA does not
    with use_adapter(pm, None):
        loss = pm(x).logits.square().mean()
    loss.backward()
    trainable = [p for p in base_parameters(pm)]
    assert all(p.grad is not None for p in trainable)
    assert all(p.grad is None for p in composer_lora_parameters(pm))


def test_a_misspelt_lora_field_names_the_config_key_and_the_closest_field():
    from lopd_lightning.adapters import as_lora_config

    with pytest.raises(ValueError, match=r"^model.init_args.composer_lora.lora_alfa is not a LoraConfig field; did you mean 'lora_alpha'\?$"):
        as_lora_config({"r": 4, "lora_alfa": 8}, key="composer_lora")
    with pytest.raises(TypeError, match="model.init_args.lora must be a dict"):
        as_lora_config(8)
    assert as_lora_config({"r": 4, "target_modules": ("q_proj",)}).target_modules == {"q_proj"}


# ------------------------------------------------------------------------ the composer adapter, added later
def _old_prepare_backbone(model, student_lora, composer_lora):
    """prepare_backbone as it was before add_composer_adapter existed (both adapters in one call): the reference."""
    from peft import get_peft_model

    from lopd_lightning.adapters import as_lora_config

    student_cfg, composer_cfg = as_lora_config(student_lora), as_lora_config(composer_lora)
    base_flags = {id(p): p.requires_grad for p in model.parameters()}
    if student_cfg is not None:
        pm = get_peft_model(model, student_cfg, adapter_name=STUDENT)
        pm.add_adapter(COMPOSER, composer_cfg)
        pm.set_adapter(STUDENT)
        for p in base_parameters(pm):
            p.requires_grad_(False)
    else:
        pm = get_peft_model(model, composer_cfg, adapter_name=COMPOSER)
        pm.base_model.disable_adapter_layers()
        for p in base_parameters(pm):
            p.requires_grad_(base_flags.get(id(p), True))
    for name in adapter_names(pm):
        for p in adapter_parameters(pm, name):
            p.requires_grad_(True)
    return pm


def _adapter_state(pm):
    from lopd_lightning.adapters import _current_state

    return {
        "names": adapter_names(pm),
        "flags": flags(pm),
        "active": pm.active_adapter,
        "state": _current_state(pm),
        "tensors": {n: p.detach().clone() for n, p in pm.named_parameters()},
    }


@pytest.mark.parametrize("lora", [STUDENT_LORA, None], ids=["lora", "full"])
def test_add_composer_adapter_after_the_student_equals_the_one_call_wrapping(lora):
    """LOPD adds psi after the base constructor: the same adapters, flags, active adapter and random LoRA
    initialisation as the former one-call prepare_backbone(student_lora, composer_lora)."""
    composer = default_lora_config(r=4, lora_alpha=8)
    torch.manual_seed(3)
    want = _old_prepare_backbone(tiny_model(), lora, composer)
    torch.manual_seed(3)
    got = add_composer_adapter(prepare_backbone(tiny_model(), student_lora=lora), composer)
    a, b = _adapter_state(want), _adapter_state(got)
    assert b["names"] == a["names"] == ([STUDENT, COMPOSER] if lora else [COMPOSER])
    assert b["flags"] == a["flags"] and b["active"] == a["active"] and b["state"] == a["state"]
    assert b["tensors"].keys() == a["tensors"].keys()
    for name, tensor in a["tensors"].items():
        assert torch.equal(b["tensors"][name], tensor), name  # the LoRA A matrices drew the same numbers
    perturb(got, COMPOSER, 2)
    perturb(want, COMPOSER, 2)
    with torch.no_grad():
        torch.testing.assert_close(got(ids()).logits, want(ids()).logits, rtol=0, atol=0)  # the student's forward
    # and prepare_backbone(composer_lora=...) is this same call
    torch.manual_seed(3)
    one_call = prepare_backbone(tiny_model(), student_lora=lora, composer_lora=composer)
    c = _adapter_state(one_call)
    assert c["flags"] == a["flags"] and c["state"] == a["state"]
    assert all(torch.equal(c["tensors"][n], t) for n, t in a["tensors"].items())


def test_add_composer_adapter_keeps_a_full_students_own_flags_and_refuses_bad_input():
    model = tiny_model()
    model.model.embed_tokens.weight.requires_grad_(False)
    plain = prepare_backbone(model, student_lora=None)
    pm = add_composer_adapter(plain, {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    assert pm is not plain and pm.get_base_model() is model  # wrapped, not copied
    assert not model.model.embed_tokens.weight.requires_grad  # a flag the user set stays as it was
    assert all(p.requires_grad for p in base_parameters(pm) if p is not model.model.embed_tokens.weight)
    lora_pm = prepare_backbone(tiny_model(), student_lora=STUDENT_LORA)
    assert add_composer_adapter(lora_pm, {"r": 2, "target_modules": ["q_proj", "v_proj"]}) is lora_pm  # through LoRA layers
    with pytest.raises(ValueError, match="already has an adapter 'composer'"):
        add_composer_adapter(lora_pm, default_lora_config())
    with pytest.raises(ValueError, match="needs a LoRA config"):
        add_composer_adapter(prepare_backbone(tiny_model(), student_lora=STUDENT_LORA), None)
    with pytest.raises(ValueError, match="'norm', a LlamaRMSNorm, which LoRA cannot wrap"):
        add_composer_adapter(prepare_backbone(tiny_model(), student_lora=STUDENT_LORA), {"r": 2, "target_modules": ["norm"]})
    with pytest.raises(ValueError, match=r"names \['q_prj'\], which this model does not have"):
        add_composer_adapter(tiny_model(), {"r": 2, "target_modules": ["q_prj"]})


def test_a_student_lora_on_a_weight_tied_other_than_as_the_word_embeddings_is_refused_in_one_line():
    """Only the word embeddings' tie is declared by the config (tie_word_embeddings), so only that one can be
    merged apart and saved (merged_student unties it); a LoRA on a weight two layers share otherwise is refused
    when the backbone is built, not at export."""
    model = tiny_model()
    layers = model.model.layers
    layers[1].self_attn.q_proj.weight = layers[0].self_attn.q_proj.weight  # one matrix, two layers
    with pytest.raises(ValueError) as error:
        prepare_backbone(model, student_lora={**STUDENT_LORA, "target_modules": ["q_proj"]})
    assert str(error.value) == (
        "model.init_args.lora.target_modules: 'model.layers.0.self_attn.q_proj' shares its weight with "
        "['model.layers.1.self_attn.q_proj.base_layer.weight'] (tied weights other than the word embeddings), "
        "which a merged student cannot keep apart; remove it from target_modules")
    tied = prepare_backbone(tiny_model(), student_lora={**STUDENT_LORA, "target_modules": ["embed_tokens", "lm_head"]})
    assert tied.base_model.model.config.tie_word_embeddings  # the word embeddings' tie: accepted, kept in training
