"""benchmarks/latent_capacity.py: the format-free score of the code, against a naive forward pass."""

from __future__ import annotations

import argparse

import pytest
import torch
from helpers import load_benchmark


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    capacity = load_benchmark("latent_capacity")
    args = argparse.Namespace(student="tiny", facts=6, heldout=2, num_latents=2, steps=1, batch_size=2, seed=0,
                              paper=False, architecture=None, lr=None, reconstruction_weight=None, self_retrieval=None,
                              reconstruction_noise=None, lr_schedule=None)
    module, _, task = capacity.build(args)
    module.eval()
    return capacity, module, task


def naive_code_nll(module, task, example) -> float:
    """The code's NLL after "The access code of project X is", from one plain forward pass of the teacher's model
    (no context) over the chat-templated conversation."""
    tokenizer = module.tokenizer
    conversation, _ = module.reference_trajectory(task, example)
    prefix = f"The access code of project {example.data['name']} is"
    head = conversation[:-1]
    full_ids = tokenizer.apply_chat_template([*head, {"role": "assistant", "content": f"{prefix} {example.data['code']}"}],
                                             tokenize=True, return_dict=True)["input_ids"]
    prefix_ids = tokenizer.apply_chat_template([*head, {"role": "assistant", "content": prefix}], tokenize=True,
                                               return_dict=True)["input_ids"]
    shared = next(i for i, (a, b) in enumerate(zip(full_ids, prefix_ids, strict=False)) if a != b)
    end = len(full_ids) - (len(prefix_ids) - shared)  # the code's tokens: full_ids[shared:end]
    assert end > shared
    ids = torch.tensor(full_ids)
    with module.teacher.teacher_scope() as model, torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    logps = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
    return -float(logps[shared - 1:end - 1].sum())


def test_code_nll_is_the_code_tokens_nll_after_the_sentence_prefix(setup):
    capacity, module, task = setup
    examples = task.examples("val")
    sentence = capacity.sentence_batches(module, task, examples)
    got = capacity.code_nll(module, sentence)
    want = [naive_code_nll(module, task, ex) for ex in examples]
    assert got == pytest.approx(want, abs=1e-4)


def test_the_format_free_score_gives_every_condition_and_both_ratios(setup):
    capacity, module, task = setup
    result = capacity.evaluate(module, task, task.examples("val"))
    sentence = result["sentence"]
    assert set(sentence) >= {"none", "text", "text_wrong", "latent", "latent_wrong", "info_ratio", "closing_ratio"}
    assert all(v == v and abs(v) < float("inf") for v in sentence.values())  # finite
    expected = (sentence["none"] - sentence["latent"]) / (sentence["none"] - sentence["text"])
    assert sentence["closing_ratio"] == pytest.approx(expected)
    # measured once, the text conditions come back unchanged when handed in again
    again = capacity.evaluate(module, task, task.examples("val"),
                              text={"none": result["none"], "text": result["text"], "text_wrong": result["text_wrong"],
                                    "sentence": {k: sentence[k] for k in ("none", "text", "text_wrong")}})
    assert again["sentence"]["text"] == result["sentence"]["text"]
    assert again["sentence"]["latent"] == pytest.approx(result["sentence"]["latent"], abs=1e-5)
