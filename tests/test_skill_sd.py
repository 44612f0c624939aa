"""SkillSDModule: UCB1 by hand, the SDL term by hand, the skill in the teacher's context only, skill
summarisation by the policy itself, one-step fits and the method state.

Tiny random Llama (``model: tiny``) and the toy task on CPU, seconds each.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.losses import grpo_loss
from lopd_lightning.modules.skill_sd import (
    SKILL_CONTEXT_PREFIX,
    SKILL_CONTEXT_SUFFIX,
    SKILL_PROMPTS,
    SkillSDModule,
    SkillSDStepInputs,
    sdl_per_token,
    ucb1_select,
)
from helpers import ParityToy, quiet_trainer

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
SKILL = "Say the answer ONLY"



def make_module(**overrides) -> SkillSDModule:
    options = dict(
        lora=LORA, group_size=2, max_new_tokens=6, learning_rate=1e-2, skill_refresh_every=0,
        skill_max_new_tokens=8,
    )
    options.update(overrides)
    return SkillSDModule("tiny", **options)


def favour_a_letter(module: SkillSDModule, letter: str = "k") -> None:
    """Give the tiny model's head a +5 bias on one letter (ByT5 id = byte + 3), so greedy text is not
    empty (the random model otherwise prints newlines, which a refresh skips as an empty skill)."""
    base = module.backbone.get_base_model()
    head = torch.nn.Linear(base.lm_head.in_features, base.lm_head.out_features, bias=True)
    head.weight = base.lm_head.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[ord(letter) + 3] = 5.0
    head.bias.requires_grad_(False)
    base.lm_head = head


def make_dm(**overrides) -> OnPolicyDataModule:
    options = dict(examples_per_step=2, val_limit=2, val_batch_size=2)
    options.update(overrides)
    return OnPolicyDataModule(ParityToy(), **options)



class Recorder(Callback):
    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({"logged": {k: float(v) for k, v in trainer.callback_metrics.items()}, "batch": batch})


# ------------------------------------------------------------------------------------ UCB1
def test_ucb1_plays_unplayed_arms_first_then_the_formula():
    assert ucb1_select([0, 0, 0], [0.0, 0.0, 0.0]) == 0
    assert ucb1_select([3, 0, 1], [0.9, 0.0, 0.1]) == 1
    # counts (3, 1, 2), N = 6, values (0.6, 0.2, 0.5), c = sqrt 2:
    #   0.6 + sqrt(2 ln 6 / 3) = 0.6 + 1.0926 = 1.6926
    #   0.2 + sqrt(2 ln 6 / 1) = 0.2 + 1.8930 = 2.0930   <- argmax (exploration wins)
    #   0.5 + sqrt(2 ln 6 / 2) = 0.5 + 1.3386 = 1.8386
    assert ucb1_select([3, 1, 2], [0.6, 0.2, 0.5]) == 1
    # with c = 0.1 the value dominates: 0.6 + 0.0773 > 0.5 + 0.0947 > 0.2 + 0.1339
    assert ucb1_select([3, 1, 2], [0.6, 0.2, 0.5], c=0.1) == 0
    assert 0.2 + math.sqrt(2 * math.log(6)) > 0.6 + math.sqrt(2 * math.log(6) / 3)


def test_select_skills_explores_each_new_skill_then_follows_values():
    module = make_module()
    assert module.select_skills(2) == [None, None]  # empty library: no context
    for i in range(3):
        module.add_skill("workflow", f"skill {i}")
    chosen = module.select_skills(3)
    assert [s["id"] for s in chosen] == [0, 1, 2]  # each unplayed arm once, in order
    # credit: skill 2 earned 1.0, the others 0 -> with equal counts UCB picks skill 2
    module.skills[2]["reward_sum"], module.skills[2]["reward_n"] = 1.0, 1
    module.skills[0]["reward_n"] = module.skills[1]["reward_n"] = 1
    assert module.select_skills(1)[0]["id"] == 2
    assert [s["count"] for s in module.skills] == [1, 1, 2]


# ------------------------------------------------------------------------------------ SDL
def test_sdl_matches_the_formula_by_hand():
    logps = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.3, -0.5]], dtype=torch.float64)
    # l = (0.5, -1.0, 0.0); rho = (1, exp(0.3), 1)
    expected = [
        1.0 * (math.exp(-0.5) - 1 + 0.5),
        math.exp(0.3) * (math.exp(1.0) - 1 - 1.0),
        0.0,
    ]
    out = sdl_per_token(logps, teacher, old)
    assert out.detach().tolist()[0] == pytest.approx(expected, rel=1e-12)
    out.sum().backward()
    # d/dlogp = rho (1 - exp(-l)): rho is a constant
    assert logps.grad.tolist()[0] == pytest.approx(
        [1 - math.exp(-0.5), math.exp(0.3) * (1 - math.exp(1.0)), 0.0], rel=1e-12
    )


def test_sdl_term_is_never_negative_for_near_equal_log_probs():
    # exp(-l) - 1 + l cancels in float32 for tiny l; the term must stay >= 0 (it is k3, evaluated stably)
    g = torch.Generator().manual_seed(1)
    logps = -torch.rand(100, 400, generator=g) * 4
    teacher = logps + torch.logspace(-9, -2, 400) * torch.randn(100, 400, generator=g)
    out = sdl_per_token(logps, teacher, logps)  # rho = 1
    assert bool((out >= 0).all())
    l = (logps.double() - teacher.double())  # noqa: E741
    expected = torch.where(l.abs() < 1e-3, l**2 / 2 - l**3 / 6 + l**4 / 24, torch.expm1(-l) + l)
    torch.testing.assert_close(out.double(), expected, rtol=5e-5, atol=1e-30)


def test_loss_terms_add_sdl_coef_times_the_sdl_on_rows_with_a_skill():
    module = make_module(sdl_coef=0.5)
    logps = torch.tensor([[-1.0, -2.0], [-0.3, -0.7]], dtype=torch.float64)
    old = torch.tensor([[-1.1, -2.0], [-0.3, -0.9]], dtype=torch.float64)
    teacher = torch.tensor([[-0.5, -2.5], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, True]])
    sdl_mask = torch.tensor([[True, True], [False, False]])  # row 1 has no skill
    inputs = SkillSDStepInputs(
        mask=mask, sdl_mask=sdl_mask, advantages=torch.tensor([1.0, -1.0], dtype=torch.float64), num_tokens=4,
        ref_logps=None, teacher_logps=teacher, metrics={},
    )
    terms = module.loss_terms(logps, old, inputs)
    # row 0: l = (-0.5, 0.5), rho = (exp(0.1), 1)
    sdl = (math.exp(0.1) * (math.exp(0.5) - 1 - 0.5) + (math.exp(-0.5) - 1 + 0.5)) / 4
    grpo = grpo_loss(logps, old, inputs.advantages, mask, num_tokens=4).loss
    assert float(terms["train/sdl"]) == pytest.approx(sdl, rel=1e-12)
    assert float(terms["train/loss"]) == pytest.approx(float(grpo) + 0.5 * sdl, rel=1e-12)


def test_step_inputs_extend_grpos_record_with_the_teacher_and_the_sdl_mask():
    from lopd_lightning.modules.grpo import GRPOStepInputs
    from lopd_lightning.rollout import batch_from_conversations

    module = make_module()
    conversations = [[{"role": "user", "content": "Repeat: a"}, {"role": "assistant", "content": f"r{i}"}] for i in range(4)]
    batch = batch_from_conversations(module.tokenizer, conversations, rewards=[1.0, 0.0, 0.0, 1.0], group_ids=[0, 0, 1, 1],
                                     example_ids=["a", "a", "b", "b"])
    for i, meta in enumerate(batch.metadata):
        meta["skill_text"] = SKILL if i < 2 else None  # example "a" has a skill, "b" none
    inputs = module.step_inputs(batch)
    assert isinstance(inputs, SkillSDStepInputs) and isinstance(inputs, GRPOStepInputs)
    _, mask = module.shifted(batch)
    has_skill = torch.tensor([True, True, False, False])
    assert torch.equal(inputs.sdl_mask, mask & has_skill[:, None])
    assert bool((inputs.teacher_logps[inputs.sdl_mask] < 0).all()) and bool((inputs.teacher_logps[~inputs.sdl_mask] == 0).all())
    assert float(inputs.metrics["train/skill_rows"]) == 0.5 and inputs.metrics["train/num_skills"] == 0.0
    assert "train/zero_std_groups" in inputs.metrics  # GRPO's metrics are kept


# ------------------------------------------------------------------------ the teacher's context
def test_the_teacher_sees_the_skill_and_the_student_does_not(tmp_path):
    module = make_module()
    module.add_skill("success", SKILL)
    skill_ids = module.teacher.encode_text_context([SKILL], prefix=SKILL_CONTEXT_PREFIX, suffix=SKILL_CONTEXT_SUFFIX)[0]
    seen = {}
    insert = module.teacher.insert_context

    def spy(input_ids, attention_mask, context_position, **kwargs):
        out = insert(input_ids, attention_mask, context_position, **kwargs)
        seen.update(student_ids=input_ids.clone(), position=torch.as_tensor(context_position).clone(), teacher=out)
        return out

    module.teacher.insert_context = spy
    student_inputs = []
    student_forward = module.student_forward

    def spy_student(batch, positions, **kwargs):
        student_inputs.append(batch.input_ids.clone())
        return student_forward(batch, positions, **kwargs)

    module.student_forward = spy_student
    rec = Recorder()
    quiet_trainer(tmp_path, callbacks=[rec]).fit(module, make_dm())
    batch = rec.steps[0]["batch"]
    assert [m["skill_text"] for m in batch.metadata] == [SKILL] * 4
    assert torch.equal(seen["student_ids"], batch.input_ids)
    t = seen["teacher"]
    for b in range(len(batch)):
        # the teacher's sequence = the student's with the framed skill inserted at context_position
        assert t.input_ids[b][t.context_mask[b]].tolist() == skill_ids
        assert torch.equal(t.input_ids[b][t.index_map[b]], batch.input_ids[b])
        pos = int(seen["position"][b])
        assert int(t.index_map[b, pos]) - int(t.index_map[b, pos - 1]) == len(skill_ids) + 1
        # the student's sequence holds no trace of the skill
        row = batch.input_ids[b].tolist()
        n = len(skill_ids)
        assert not any(row[i : i + n] == skill_ids for i in range(len(row) - n + 1))
    assert student_inputs and all(torch.equal(x, batch.input_ids) for x in student_inputs)
    logged = rec.steps[0]["logged"]
    assert logged["train/skill_rows"] == 1.0 and logged["train/num_skills"] == 1.0
    assert logged["train/sdl"] > 0  # the skill makes the base teacher differ from the (base) student
    # the bandit credited the skill with the tasks' mean rewards
    (skill,) = module.skills
    assert skill["count"] == 2 and skill["reward_n"] == 2
    assert skill["reward_sum"] == pytest.approx(float(batch.rewards.sum()) / 2)


# ------------------------------------------------------------------------ summarisation and fit
def test_first_step_without_skills_then_the_policy_writes_them(tmp_path):
    module = make_module(skill_refresh_every=1, max_skills=2, skill_examples=4)
    favour_a_letter(module)
    prompts, replies = [], []
    generate = module.generate_text

    def spy(batch_prompts):
        out = generate(batch_prompts)
        prompts.extend(batch_prompts)
        replies.extend(out)
        return out

    module.generate_text = spy
    rec = Recorder()
    trainer = quiet_trainer(tmp_path, max_steps=2, callbacks=[rec])
    trainer.fit(module, make_dm())
    first, second = rec.steps[0], rec.steps[1]
    # step 1: an empty library: no row has a skill, no SDL, GRPO only
    assert first["logged"]["train/skill_rows"] == 0.0 and first["logged"]["train/sdl"] == 0.0
    assert all(m["skill_id"] is None for m in first["batch"].metadata)
    assert "time/skill_refresh" in first["logged"]
    # the prompts carry the buffered trajectories: task text and the student's reply
    batch = first["batch"]
    assert prompts, "no summarisation prompt"
    assert any(SKILL_PROMPTS["workflow"].split("{")[0] in p for p in prompts)
    for meta, messages in zip(batch.metadata, batch.messages, strict=True):
        reply = next(m["content"] for m in messages if m["role"] == "assistant")
        assert any(meta["task_text"] in p and reply[:20] in p for p in prompts)
    # the generated skills are stored verbatim (capped at max_skills)
    texts = [s["text"] for s in module.skills]
    assert len(texts) <= 2 and all(t in replies for t in texts) and texts
    assert second["logged"]["train/skill_rows"] == 1.0
    assert trainer.global_step == 2


def test_an_empty_generation_adds_no_skill():
    module = make_module()  # the random tiny model greedily prints newlines only
    module.trajectory_buffer.append({"task_text": "t", "trajectory": "assistant: x", "reward": 0.0})
    assert module.generate_text(["hello"]) == [""]
    assert module.refresh_skills() == [] and module.skills == []


def test_skill_prompt_formats_records():
    module = make_module()
    records = [{"task_text": "Repeat the word: apple", "trajectory": "assistant: apple", "reward": 1.0}]
    prompt = module.skill_prompt("success", records)
    assert "Repeat the word: apple" in prompt and "assistant: apple" in prompt and "Reward: 1.00" in prompt
    assert prompt.startswith("Below are attempts at tasks that succeeded.")


def test_eviction_keeps_the_cap_and_drops_the_worst_played_skill():
    module = make_module(max_skills=2)
    a, b = module.add_skill("success", "a"), module.add_skill("mistake", "b")
    a.update(count=1, reward_sum=0.9, reward_n=1)
    b.update(count=1, reward_sum=0.1, reward_n=1)
    c = module.add_skill("workflow", "c")
    module.evict_skills({c["id"]})
    assert [s["text"] for s in module.skills] == ["a", "c"]


# ------------------------------------------------------------------------------------ state
def test_method_state_round_trips_the_library_the_bandit_and_the_buffer():
    module = make_module()
    s = module.add_skill("workflow", "first plan, then answer")
    s.update(count=3, reward_sum=1.5, reward_n=3)
    module.add_skill("mistake", "do not ramble")
    module.trajectory_buffer.append({"task_text": "t", "trajectory": "assistant: x", "reward": 0.0})
    state = module.method_state()
    buffer = io.BytesIO()
    torch.save(state, buffer)  # plain Python types: loadable with weights_only
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = make_module()
    fresh.load_method_state(state)
    assert fresh.skills == module.skills
    assert fresh.next_skill_id == 2
    assert list(fresh.trajectory_buffer) == list(module.trajectory_buffer)
    assert fresh.trajectory_buffer.maxlen == module.hparams.skill_buffer_size
    assert len(fresh.skills) == 2
    # through the checkpoint hooks
    ckpt: dict = {}
    module.on_save_checkpoint(ckpt)
    again = make_module()
    again.on_load_checkpoint(ckpt)
    assert again.skills == module.skills and list(again.trajectory_buffer) == list(module.trajectory_buffer)


def test_full_student_with_kl_shares_one_frozen_copy_as_reference_and_teacher(tmp_path):
    module = make_module(lora=None, kl_coef=0.1, ppo_epochs=2)
    assert module.teacher is module.reference and module.teacher.shadow is not None
    module.add_skill("workflow", SKILL)
    rec = Recorder()
    trainer = quiet_trainer(tmp_path, callbacks=[rec])
    trainer.fit(module, make_dm())
    logged = rec.steps[0]["logged"]
    assert trainer.global_step == 1 and logged["train/sdl"] > 0 and "train/kl" in logged


def test_ema_teacher_follows_the_student(tmp_path):
    from lopd_lightning.adapters import TEACHER_EMA, adapter_parameters

    module = make_module(teacher_mode="ema", teacher_ema_rate=0.5)
    module.add_skill("workflow", SKILL)
    before = [p.detach().clone() for p in adapter_parameters(module.backbone, TEACHER_EMA)]
    quiet_trainer(tmp_path).fit(module, make_dm())
    after = adapter_parameters(module.backbone, TEACHER_EMA)
    assert any(not torch.equal(b, a.detach()) for b, a in zip(before, after, strict=True))


def test_bad_teacher_mode_fails_before_loading_the_model(monkeypatch):
    monkeypatch.setattr("lopd_lightning.modules.base.load_student", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    with pytest.raises(ValueError, match="teacher_mode"):
        SkillSDModule("tiny", teacher_mode="frozen")
    with pytest.raises(ValueError, match="group_size >= 2"):
        SkillSDModule("tiny", group_size=1)
