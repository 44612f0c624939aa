"""GRPOModule: the loss against a by-hand computation, one-step fits, PPO epochs and global_step, early errors.

Tiny random Llama (``model: tiny``) and the toy task on CPU; a toy variant whose reward depends on the
sampled reply gives groups with different rewards (a non-zero advantage).
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lopd_lightning.advantages import group_advantages
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.losses import grpo_loss, k3_kl
from lopd_lightning.modules.grpo import GRPOModule, GRPOStepInputs
from lopd_lightning.rollout import batch_from_conversations
from helpers import ParityToy, quiet_trainer

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}



def make_module(**overrides) -> GRPOModule:
    options = dict(lora=LORA, group_size=4, max_new_tokens=6, learning_rate=1e-2)
    options.update(overrides)
    return GRPOModule("tiny", **options)


def make_dm(task=None, **overrides) -> OnPolicyDataModule:
    options = dict(examples_per_step=2, val_limit=2, val_batch_size=2)
    options.update(overrides)
    return OnPolicyDataModule(task if task is not None else ParityToy(), **options)



class Recorder(Callback):
    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append({"global_step": trainer.global_step})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[-1].update(logged={k: float(v) for k, v in trainer.callback_metrics.items()}, batch=batch)


# ------------------------------------------------------------------------------ the loss by hand
def naive_grpo(logps, old, adv, mask, eps_low, eps_high, num_tokens, ref=None, kl_coef=0.0):
    """Scalar loops: -min(rho A, clip(rho) A) and exp(ref - lp) - (ref - lp) - 1, summed over mask / num_tokens."""
    pg = kl = clipped = 0.0
    for b in range(len(logps)):
        for t in range(len(logps[b])):
            if not mask[b][t]:
                continue
            rho = math.exp(logps[b][t] - old[b][t])
            a = adv[b]
            pg += -min(rho * a, min(max(rho, 1 - eps_low), 1 + eps_high) * a)
            clipped += float((a > 0 and rho > 1 + eps_high) or (a < 0 and rho < 1 - eps_low))
            if ref is not None:
                d = ref[b][t] - logps[b][t]
                kl += math.exp(d) - d - 1
    return pg / num_tokens, kl / num_tokens, clipped / num_tokens, (pg + kl_coef * kl) / num_tokens


@pytest.mark.parametrize("eps_low, eps_high, kl_coef", [(0.2, 0.2, 0.0), (0.1, 0.3, 0.5)])
def test_grpo_loss_matches_a_naive_computation(eps_low, eps_high, kl_coef):
    # ratios exp(0.5) = 1.65 (clipped above for A > 0), exp(-0.5) = 0.61 (clipped below for A < 0 with
    # eps_low 0.2 or 0.1), exp(0.1) = 1.105 (inside), one masked token with a huge ratio (ignored)
    logps = torch.tensor([[-1.0, -0.5, -2.0, -0.3], [-1.2, -0.7, -0.4, -3.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -0.6, -1.5, -9.0], [-0.7, -0.8, -0.9, -3.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.1, -0.4, -2.5, -0.2], [-1.0, -1.0, -0.1, -2.0]], dtype=torch.float64)
    adv = torch.tensor([0.8, -1.3], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    num_tokens = 10  # a global denominator larger than this rank's 7 tokens
    logps.requires_grad_(True)
    out = grpo_loss(
        logps, old, adv, mask, eps_low=eps_low, eps_high=eps_high, num_tokens=num_tokens,
        ref_logps=ref if kl_coef > 0 else None, kl_coef=kl_coef,
    )
    pg, kl, clip, loss = naive_grpo(
        logps.tolist(), old.tolist(), adv.tolist(), mask.tolist(), eps_low, eps_high, num_tokens,
        ref.tolist() if kl_coef > 0 else None, kl_coef,
    )
    out = out._replace(loss=out.loss, pg_loss=out.pg_loss.detach())
    assert float(out.pg_loss) == pytest.approx(pg, rel=1e-12)
    assert float(out.loss) == pytest.approx(loss, rel=1e-12)
    assert float(out.clip_fraction) == pytest.approx(clip, rel=1e-12)
    assert clip > 0  # some token is clipped in both settings
    if kl_coef > 0:
        assert float(out.kl) == pytest.approx(kl, rel=1e-12) and kl > 0
    else:
        assert out.kl is None
    out.loss.backward()
    assert logps.grad[0, 3] == 0  # masked out
    # the token with rho = exp(0.5) and A = 0.8 > 0 is clipped above: no policy gradient (KL aside)
    if kl_coef == 0:
        assert logps.grad[0, 0] == 0


def test_k3_kl_is_zero_at_equality_and_positive_elsewhere():
    lp = torch.tensor([[-1.0, -2.0]])
    assert torch.equal(k3_kl(lp, lp), torch.zeros(1, 2))
    d = -0.5  # ref - logp
    assert float(k3_kl(torch.tensor([[-1.0]]), torch.tensor([[-1.5]]))) == pytest.approx(math.exp(d) - d - 1)


# ------------------------------------------------------------------------------- fits
@pytest.mark.parametrize("student", ["lora", "full"])
def test_one_step_fit_moves_the_student_and_logs_the_tags(tmp_path, student):
    module = make_module(lora=LORA if student == "lora" else None)
    params = module.student_parameters()
    before = [p.detach().clone() for p in params]
    rec = Recorder()
    trainer = quiet_trainer(tmp_path, callbacks=[rec])
    trainer.fit(module, make_dm())
    assert trainer.global_step == 1
    logged = rec.steps[0]["logged"]
    for tag in ["train/loss", "train/pg_loss", "train/clip_fraction", "train/advantage_abs_mean",
                "train/zero_std_groups", "train/grad_norm", "train/reward_mean", "time/student_step"]:
        assert tag in logged, tag
    assert "train/kl" not in logged
    assert logged["train/clip_fraction"] == 0.0  # one pass: the ratio is exactly 1
    batch = rec.steps[0]["batch"]
    assert len(batch) == 8  # 2 tasks x G = 4
    rewards = batch.rewards.view(-1, 4)
    zero_std = float((rewards == rewards[:, :1]).all(-1).float().mean())
    assert logged["train/zero_std_groups"] == pytest.approx(zero_std)
    assert zero_std < 1  # ParityToy gives a signal
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True))


def test_kl_to_the_base_is_logged_and_zero_at_the_first_step(tmp_path):
    module = make_module(kl_coef=0.1)
    assert module.reference is not None and module.reference.shadow is None  # LoRA: adapters disabled, no copy
    rec = Recorder()
    quiet_trainer(tmp_path, max_steps=2, callbacks=[rec]).fit(module, make_dm())
    kls = [s["logged"]["train/kl"] for s in rec.steps]
    # LoRA B starts at 0: at step 1 the student IS the base (KL 0); after one update it is not
    assert kls[0] == pytest.approx(0.0, abs=1e-7)
    assert kls[1] > 0


def test_full_student_reference_is_a_frozen_copy_made_only_with_kl(caplog):
    assert make_module(lora=None).reference is None
    with caplog.at_level("WARNING"):
        module = make_module(lora=None, kl_coef=0.1)
    assert module.reference.shadow is not None
    assert not any(p.requires_grad for p in module.reference.shadow.parameters())
    assert "second full copy" in caplog.text


def test_ppo_epochs_step_global_step_once_per_batch_and_move_the_ratio(tmp_path):
    module = make_module(ppo_epochs=2)
    ratios = []
    original = module.loss_terms

    def loss_terms(logps, old_logps, inputs):
        mask = inputs.mask
        ratios.append(float((logps.detach() - old_logps)[mask].abs().max()))
        return original(logps, old_logps, inputs)

    module.loss_terms = loss_terms
    rec = Recorder()
    trainer = quiet_trainer(tmp_path, max_steps=2, callbacks=[rec])
    trainer.fit(module, make_dm())
    assert trainer.global_step == 2
    assert [s["global_step"] for s in rec.steps] == [0, 1]
    assert len(ratios) == 4  # 2 batches x 2 passes
    assert ratios[0] == 0.0 and ratios[2] == 0.0  # pass 1: the ratio is exactly 1
    assert ratios[1] > 0 and ratios[3] > 0  # pass 2: the first update moved the policy
    # the optimiser stepped once per pass
    assert {float(s["step"]) for s in trainer.optimizers[0].state.values()} == {4.0}


# ------------------------------------------------------------------------------- errors
def test_group_of_one_fails_before_loading_the_model(no_model_loading):
    with pytest.raises(ValueError, match=r"group_size >= 2.*got 1.*set model\.init_args\.group_size"):
        GRPOModule("tiny", group_size=1)


@pytest.mark.parametrize(
    "overrides, message",
    [({"ppo_epochs": 0}, "ppo_epochs"), ({"kl_coef": -1.0}, "kl_coef"), ({"clip_eps_low": 1.0}, "clip_eps_low"),
     ({"logps_temperature": 0.0}, "logps_temperature"),
     ({"temperature": float("nan")}, r"model\.init_args\.temperature must be > 0 .*got nan")],
)
def test_bad_options_fail_before_loading_the_model(no_model_loading, overrides, message):
    with pytest.raises(ValueError, match=message):
        GRPOModule("tiny", **overrides)


# ------------------------------------------------------------------------------- step inputs
def test_step_inputs_are_a_typed_record_that_subclasses_extend():
    module = make_module(kl_coef=0.1)
    conversations = [[{"role": "user", "content": "Repeat: a"}, {"role": "assistant", "content": f"r{i}"}] for i in range(8)]
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # group 1 has no signal
    batch = batch_from_conversations(module.tokenizer, conversations, rewards=rewards, group_ids=[0] * 4 + [1] * 4,
                                     example_ids=["a"] * 4 + ["b"] * 4)
    inputs = module.step_inputs(batch)
    assert isinstance(inputs, GRPOStepInputs)
    _, mask = module.shifted(batch)
    assert torch.equal(inputs.mask, mask)
    torch.testing.assert_close(inputs.advantages, group_advantages(batch.rewards.float(), group_size=4, eps=1e-4))
    assert inputs.num_tokens == int(mask.sum())
    assert inputs.ref_logps.shape == mask.shape and bool((inputs.ref_logps[~mask] == 0).all())
    assert float(inputs.metrics["train/zero_std_groups"]) == 0.5
    assert set(inputs.metrics) == {"train/advantage_abs_mean", "train/zero_std_groups"}

    from dataclasses import dataclass

    @dataclass
    class WithExtra(GRPOStepInputs):
        extra: int = 0

    extended = inputs.extend(WithExtra, extra=3)
    assert isinstance(extended, WithExtra) and extended.extra == 3 and extended.advantages is inputs.advantages
    # the loss reads the record: the same terms from the original and the extended one
    logps = module.student_logps(batch).detach()
    assert float(module.loss_terms(logps, logps, extended)["train/loss"]) == float(module.loss_terms(logps, logps, inputs)["train/loss"])


def test_generation_batch_size_changes_the_calls_not_the_rollouts():
    """Episodes in calls of at most 2 rows (longest contexts first) sample the same tokens as all at once."""
    task = ParityToy()
    examples = task.examples("train")[:3]
    batches = []
    for size in (None, 2):
        module = GRPOModule("tiny", group_size=2, max_new_tokens=6, generation_batch_size=size)
        module._trainer = None
        batches.append(module.make_batch(task, examples))
    assert torch.equal(batches[0].input_ids, batches[1].input_ids)
    assert batches[0].messages == batches[1].messages
    assert batches[0].stats.generate_calls == 1 and batches[1].stats.generate_calls == 3


@pytest.mark.parametrize("bad", [0, -1, True])
def test_bad_generation_batch_size_names_the_key(no_model_loading, bad):
    with pytest.raises(ValueError, match="model.init_args.generation_batch_size must be null or an int >= 1"):
        GRPOModule("tiny", generation_batch_size=bad)
