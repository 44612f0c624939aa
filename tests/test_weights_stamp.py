"""The prefix cache's weights stamp reads a model's peft adapter state in one call (adapters.tuner_states),
and still sees what decides a forward: the active adapter, a parameter replaced, an in-place update (the
stamp tests of tests/test_rollout.py cover disabling, merging, rescaling and an update inside a session)."""

from __future__ import annotations

import pytest
import torch

from lopd_lightning.adapters import COMPOSER, STUDENT, add_composer_adapter, prepare_backbone, tuner_layers, tuner_states
from lopd_lightning.models import tiny_model
from lopd_lightning.rollout.kv_reuse import weights_stamp

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture
def backbone():
    """The tiny model with the student's LoRA and the composer's (LOPD's backbone)."""
    student = prepare_backbone(tiny_model(seed=0), student_lora=LORA)
    return add_composer_adapter(student, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj"]})


def test_tuner_states_reads_every_adapter_layer_in_module_order(backbone):
    layers = tuner_layers(backbone)
    assert len(layers) == 6  # 2 decoder layers x (q, k, v)
    states = tuner_states(backbone.modules())
    assert states == tuner_states(layers) and len(states) == len(layers)
    active, disabled, scaling, merged = states[0]
    assert active == [STUDENT] or active == STUDENT
    assert disabled is False and merged == () and scaling == {STUDENT: 2.0, COMPOSER: 2.0}
    assert tuner_states([torch.nn.Linear(2, 2)]) == []


def test_the_stamp_reads_the_adapter_state_in_one_call(backbone, monkeypatch):
    import lopd_lightning.adapters as adapters

    calls = []
    real = adapters.tuner_states
    monkeypatch.setattr(adapters, "tuner_states", lambda modules: calls.append(1) or real(modules))
    stamp = weights_stamp(backbone)
    assert calls == [1]
    assert len(stamp) == len(list(backbone.parameters())) + len(tuner_layers(backbone))


def test_the_stamp_sees_a_switch_of_the_active_adapter(backbone):
    backbone.set_adapter(STUDENT)
    before = weights_stamp(backbone)
    backbone.set_adapter(COMPOSER)
    assert weights_stamp(backbone) != before
    backbone.set_adapter(STUDENT)
    assert weights_stamp(backbone) == before


def test_the_stamp_sees_a_replaced_parameter_and_an_in_place_update():
    model = tiny_model(seed=0)
    before = weights_stamp(model)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
    model.lm_head = head  # same numbers, another tensor: the cached rows cannot tell, the stamp does
    replaced = weights_stamp(model)
    assert replaced != before
    with torch.no_grad():
        next(model.parameters()).add_(0.0)  # bumps the version counter
    assert weights_stamp(model) != replaced
