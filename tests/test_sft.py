"""SFTModule: NLL of the references goes down, and the saved Hugging Face folder is the student."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.models import load_student, tiny_model
from lopd_lightning.modules import SFTModule

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}




def reference_nll(module: SFTModule, batch) -> float:
    """-sum omega log pi(y* | s) / sum omega, recomputed from the student's logits at the assistant tokens."""
    targets, mask = module.shifted(batch)
    with torch.no_grad():
        logits = module.student_forward(batch, mask).values  # [N, V]
    logps = torch.log_softmax(logits.float(), -1).gather(-1, targets[mask][:, None])[:, 0]
    return float(-logps.mean())


def test_reference_batch_is_the_replayed_reference_conversation():
    module = SFTModule("tiny", lora=LORA)
    dm = OnPolicyDataModule("toy")
    ex = dm.train_examples[0]
    batch = module.reference_batch(dm.task, [ex])
    answer = ex.data["answer"]
    assert batch.messages[0] == [{"role": "user", "content": ex.text}, {"role": "assistant", "content": answer}]
    # the trained tokens are exactly the answer's bytes and the EOS
    assert int(batch.assistant_mask.sum()) == len(answer.encode()) + 1
    assert batch.rewards.tolist() == [1.0]
    assert module.tokenizer.decode(batch.input_ids[0][batch.assistant_mask[0]]) == answer + "</s>"


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_two_sft_steps_reduce_the_reference_nll_and_save_a_loadable_student(tmp_path, lora):
    save_dir = tmp_path / "student"
    module = SFTModule("tiny", lora=lora, learning_rate=1e-2, save_dir=str(save_dir))
    # 4 train examples, 4 per step: both steps train on exactly the batch we measure
    dm = OnPolicyDataModule("toy", examples_per_step=4, train_limit=4)
    batch = module.reference_batch(dm.task, dm.train_examples)
    before = reference_nll(module, batch)
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, limit_val_batches=0,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(module, dm)
    assert trainer.global_step == 2
    after = reference_nll(module, batch)
    assert after < before - 0.01, (before, after)
    assert float(trainer.callback_metrics["train/nll"]) > 0

    # save_dir: a Hugging Face folder written at the end of fit
    assert (save_dir / "config.json").exists()
    assert any(save_dir.glob("*.safetensors"))
    model, tokenizer = load_student(str(save_dir))
    assert not hasattr(model, "peft_config")  # a plain model: the LoRA is merged in
    real = batch.attention_mask[:, :-1].bool()  # padding positions carry no meaning: compare real tokens
    with torch.no_grad():
        expected = module.student_forward(batch, real).values  # [N, V] at the real tokens
        got = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        untrained = tiny_model(seed=0)(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    torch.testing.assert_close(got[real], expected, atol=1e-5, rtol=1e-5)
    assert (got[real] - untrained[real]).abs().max() > 1e-3  # the saved weights are the trained ones
    # the saved tokenizer encodes the conversation the same way
    assert tokenizer.apply_chat_template(batch.messages[0], tokenize=False) == module.tokenizer.apply_chat_template(
        batch.messages[0], tokenize=False
    )
