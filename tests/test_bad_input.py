"""Bad input and faults in training: a clear error before heavy work, or a recovery that loses nothing.

- configs: a missing model folder, a tokenizer that does not match the model, top-k larger than the
  vocabulary, J larger than the bank (group size 1 and unknown task names: tests/test_grpo.py,
  tests/test_sdpo.py, tests/test_lopd_module.py);
- numbers: a non-finite loss skips the step's update on every optimiser (weights and beta unchanged),
  logs a warning and counts it; training then goes on;
- text: a privileged context that does not fit the model's context is cut, never the student's tokens.
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from lopd_lightning.adapters import default_lora_config, prepare_backbone
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.memory import Experience, ExperienceBank
from lopd_lightning.memory.embed import get_embedder
from lopd_lightning.models import load_student, tiny_model, tiny_tokenizer
from lopd_lightning.modules import GRPOModule, LOPDModule, OPSDModule, SDPOModule
from lopd_lightning.teacher import SelfTeacher
from lopd_lightning.tasks.toy import ToyTask
from helpers import ParityToy, fill_disk

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
TINY_LOPD = dict(lora=LORA, group_size=2, max_new_tokens=8, num_latents=4, num_experiences=2,
                 composer_depth=2, max_experience_tokens=64, embedder="hashing", distill_top_k=8)


# ------------------------------------------------------------------------------------------ configs
def test_missing_model_folder_names_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist \(model.init_args.model\)"):
        GRPOModule(str(tmp_path / "no_such_model"))


def test_tokenizer_that_does_not_match_the_model_fails_before_the_weights_load(tmp_path, monkeypatch):
    folder = tmp_path / "mismatch"
    tiny_model(vocab_size=200).save_pretrained(folder)  # 200 rows, the tokenizer has 259 tokens
    tiny_tokenizer().save_pretrained(folder)
    import transformers

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the vocabulary check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(ValueError, match=r"259 tokens but the model has 200 embedding rows.*model.init_args.model"):
        load_student(str(folder))


@pytest.mark.parametrize(
    "make",
    [
        lambda: LOPDModule("tiny", **{**TINY_LOPD, "distill_top_k": 1000}),
        lambda: SDPOModule("tiny", distill_top_k=1000),
        lambda: OPSDModule("tiny", divergence="topk_reverse_kl", distill_top_k=1000),
    ],
    ids=["lopd_top_m", "sdpo_top_k", "opsd_top_k"],
)
def test_top_k_larger_than_the_vocabulary_names_the_field(make):
    with pytest.raises(ValueError, match=r"=1000 is larger than the vocabulary \(259 tokens\); set model.init_args.distill_top_k"):
        make()


def test_lopd_refuses_gradient_checkpointing_only_on_a_model_it_cannot_recompute_right(monkeypatch):
    """LOPD checkpoints through transformers' per-layer checkpoint function (tests/test_lopd_grad_ckpt.py);
    a model that checkpoints some other way (an old remote-code format: layers flagged, no such function)
    would recompute under the backward-time adapter, and is refused with the key to change."""
    assert LOPDModule("tiny", **TINY_LOPD, gradient_checkpointing=True).checkpointed_modules > 0

    def old_format(self, *args, **kwargs):
        for module in self.modules():
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = True

    import transformers

    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        monkeypatch.setattr(transformers.PreTrainedModel, name, old_format, raising=False)
    with pytest.raises(ValueError, match=r"^model.init_args.gradient_checkpointing: 'tiny' checkpoints its layers in a "
                                         r"way LOPD cannot recompute under the right LoRA adapter.*set it to false"):
        LOPDModule("tiny", **TINY_LOPD, gradient_checkpointing=True)


def test_an_unknown_margin_weighting_names_the_field_and_the_choices(no_model_loading):
    with pytest.raises(ValueError, match=r"model.init_args.margin_weighting 'balance' is not a weighting; did you mean "
                                         r"'balanced'\? choose one of paper, balanced"):
        LOPDModule("tiny", **TINY_LOPD, margin_weighting="balance")


def test_more_experiences_than_the_bank_holds_names_the_field(tmp_path):
    """Refused when fit starts, before the first step, unless a MemoryRefresh fills the bank (``lopd fit`` says it
    before the weights load: tests/test_cli.py); a bank_capacity below J is refused at once."""
    task = ToyTask()
    bank = ExperienceBank(get_embedder("hashing"))
    ex = task.examples("train")[0]
    bank.add([Experience(task_id=ex.id, task_text=ex.text, trace="answer", reward=1.0)])
    bank.save(tmp_path / "bank")
    module = LOPDModule("tiny", **TINY_LOPD, bank_path=str(tmp_path / "bank"))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"num_experiences J=2 is larger than the bank .* \(1 experiences\); set "
                                         r"model.init_args.num_experiences <= 1, build a larger bank"):
        trainer.fit(module, OnPolicyDataModule(task, examples_per_step=1))
    assert trainer.global_step == 0
    with pytest.raises(ValueError, match=r"^model.init_args.bank_capacity=1 is smaller than num_experiences J=2"):
        LOPDModule("no-such-model", **TINY_LOPD, bank_path=str(tmp_path / "bank"), bank_capacity=1)


# ------------------------------------------------------------------------------------------ numbers

class NaNAtStep(L.Callback):
    """Makes the student's forward (logits or hidden states) NaN during the given step (a stand-in for an overflow)."""

    def __init__(self, step: int):
        self.step = step
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.betas: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.snapshots[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters() if p.requires_grad]
        self.betas[trainer.global_step] = getattr(pl_module, "beta", 0.0)
        original = type(pl_module).student_forward
        def nan_forward(*args, **kwargs):
            out = original(pl_module, *args, **kwargs)  # StudentForward(values: logits or hidden states, cache)
            return out._replace(values=out.values * float("nan"))

        if trainer.global_step == self.step:
            pl_module.student_forward = nan_forward
        else:
            pl_module.__dict__.pop("student_forward", None)


@pytest.mark.parametrize("method", ["lopd", "grpo"])
def test_non_finite_loss_skips_the_update_and_training_goes_on(method, tmp_path, caplog):
    L.seed_everything(0)
    if method == "lopd":
        module = LOPDModule("tiny", **TINY_LOPD, learning_rate=1e-2, composer_lr=1e-2, margin=0.5)
        task = ToyTask()
        module.bank.add([Experience(task_id=e.id, task_text=e.text, trace=task.reference_solution(e), reward=1.0)
                         for e in task.examples("train")[:4]])
    else:
        module = GRPOModule("tiny", lora=LORA, group_size=4, max_new_tokens=8, learning_rate=1e-2,
                            temperature=1.5, top_k=0, top_p=1.0)
    hook = NaNAtStep(step=1)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[hook], default_root_dir=str(tmp_path))
    dm = OnPolicyDataModule(ParityToy(), examples_per_step=2, val_limit=4, val_batch_size=4)
    with caplog.at_level(logging.WARNING):
        trainer.fit(module, dm)
    assert trainer.global_step == 3  # the skipped step still counts
    assert module.non_finite_steps == 1
    assert any("non-finite loss at step 1" in r.getMessage() for r in caplog.records)
    before, after = hook.snapshots[1], hook.snapshots[2]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # nothing reached the weights
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert hook.betas[2] == hook.betas[1]  # beta is not moved by a NaN margin
    # the steps around it trained
    assert not all(torch.equal(a, b) for a, b in zip(hook.snapshots[0], hook.snapshots[1], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(after, [p.detach() for p in module.parameters() if p.requires_grad], strict=True))
    assert float(trainer.callback_metrics["train/non_finite_steps"]) == 1.0


# ------------------------------------------------------------------------------------------ text
def test_privileged_context_is_cut_before_the_students_tokens():
    model, tokenizer = tiny_model(max_position_embeddings=48), tiny_tokenizer()
    backbone = prepare_backbone(model, student_lora=LORA, composer_lora=default_lora_config())
    teacher = SelfTeacher(backbone, tokenizer, framing_prefix="<", framing_suffix=">")
    assert teacher.max_length == 48
    ids = torch.arange(10, 50).reshape(1, 40)  # 40 student tokens: 8 positions left
    mask = torch.ones_like(ids)
    # text: 20 context tokens, 8 fit: its first 4 and last 4 (the framing at both ends), the middle cut
    inputs = teacher.insert_context(ids, mask, [2], context_ids=[list(range(100, 120))])
    assert inputs.input_ids.shape[1] == 48
    assert inputs.input_ids[0, 2:10].tolist() == [100, 101, 102, 103, 116, 117, 118, 119]
    assert inputs.input_ids[0][inputs.index_map[0]].tolist() == ids[0].tolist()  # every student token kept
    # latents: 2 experiences x 4 slots + framing 2 = 10 > 8: the framing and the first 6 slots stay
    latents = torch.randn(1, 8, 64)
    full_mask = torch.ones(1, 8, dtype=torch.bool)
    inputs = teacher.insert_context(ids, mask, [2], latents=latents, latent_mask=full_mask)
    assert inputs.input_ids.shape[1] == 48 and int(inputs.latent_slots.sum()) == 6
    torch.testing.assert_close(inputs.inputs_embeds[0, inputs.latent_slots[0]], latents[0, :6])
    assert full_mask.all()  # the caller's mask is untouched
    assert teacher.contexts_cut == 2
    # a row with room for everything is not cut
    short = ids[:, :20]
    inputs = teacher.insert_context(short, torch.ones_like(short), [2], latents=latents, latent_mask=full_mask)
    assert int(inputs.latent_slots.sum()) == 8 and teacher.contexts_cut == 2


# ------------------------------------------------------------------------------------------ faults
class DiskFullOnStep(L.Callback):
    """From ``step`` on, every checkpoint write fills the disk a few bytes in (ENOSPC)."""

    def __init__(self, step: int, monkeypatch):
        self.step, self.monkeypatch = step, monkeypatch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            fill_disk(self.monkeypatch, 64)


def test_disk_full_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(0)
    module = GRPOModule("tiny", lora=LORA, group_size=2, max_new_tokens=8)
    ckpt_dir = tmp_path / "ckpt"
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", devices=1, logger=False, limit_val_batches=0, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1, save_top_k=0),
                   DiskFullOnStep(1, monkeypatch)],
    )
    dm = OnPolicyDataModule("toy", examples_per_step=2, val_limit=4, val_batch_size=4)
    with pytest.raises(OSError, match="No space left on device"):
        trainer.fit(module, dm)
    monkeypatch.undo()
    # the checkpoint of step 1 is intact and complete: it loads, and it resumes
    ckpt = torch.load(ckpt_dir / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["global_step"] == 1 and ckpt["lopd_state"]["rollouts_consumed"] == 4
    assert not [p for p in ckpt_dir.iterdir() if p.name != "last.ckpt"]  # no half-written file left beside it
    resumed = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    fresh = GRPOModule("tiny", lora=LORA, group_size=2, max_new_tokens=8)
    resumed.fit(fresh, OnPolicyDataModule("toy", examples_per_step=2, val_limit=4, val_batch_size=4),
                ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert resumed.global_step == 2


def test_lopd_under_deepspeed_names_the_fix():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DeepSpeedStrategy

    module = LOPDModule("tiny", **TINY_LOPD)
    module._trainer = SimpleNamespace(strategy=object.__new__(DeepSpeedStrategy))  # no deepspeed install needed
    with pytest.raises(ValueError, match="two optimisers .* use configs/trainer/fsdp.yaml"):
        module.setup("fit")


@pytest.mark.parametrize("sharded", [False, True])
def test_teacher_pass_runs_on_every_rank_under_a_sharded_strategy(sharded, tmp_path, monkeypatch):
    """FSDP/DeepSpeed all-gather each layer in every forward: a rank with no row to distil must still
    run the teacher pass (on no positions), or the other ranks would wait for it forever."""
    monkeypatch.setattr(OPSDModule, "sharded", property(lambda self: sharded))
    module = OPSDModule("tiny", lora=LORA, max_new_tokens=8)
    monkeypatch.setattr(module, "reference_texts", lambda batch: [None] * len(batch))  # nothing to distil
    calls = []
    original = module.teacher.logits_on_student_positions
    monkeypatch.setattr(module.teacher, "logits_on_student_positions", lambda *a, **k: calls.append(1) or original(*a, **k))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(module, OnPolicyDataModule("toy", examples_per_step=2, val_limit=4, val_batch_size=4))
    assert len(calls) == (1 if sharded else 0)
    assert float(trainer.callback_metrics["train/loss"]) == 0.0
    assert float(trainer.callback_metrics["train/rows_with_reference"]) == 0.0
