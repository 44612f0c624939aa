"""The vLLM rollout backend against the HF reference (rollout/vllm_backend.py).

The engine tests need vLLM (``make test-vllm`` builds ``.venv-vllm`` with the ``vllm`` extra and runs every
test whose name contains ``vllm``); in the main environment they are skipped and the weight-merging test,
which needs no engine, runs. The model is a small random Llama whose attention head size vLLM's CPU
kernels support (64) and whose output head is scaled so that greedy decoding has no near-ties: the two
backends then agree token for token.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os

import pytest
import torch

from lopd_lightning.adapters import STUDENT, prepare_backbone, use_adapter
from lopd_lightning.models import tiny_tokenizer
from lopd_lightning.rollout import SamplingSettings, generate_rollouts
from lopd_lightning.rollout.backends import HFGenerateBackend
from lopd_lightning.rollout.registry import make_backend
from lopd_lightning.rollout.vllm_backend import RELOAD_LOGGER, DropRotaryReloadWarning, check_mergeable, merged_weights
from lopd_lightning.tasks.toy import ToyTask

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here: make test-vllm runs these")
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def peaked_model(seed: int = 0):
    """A 2-layer Llama (head size 64) with a sharp, untied output head and a weak EOS row."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=None, eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # logit gaps of several units: no near-ties in greedy decoding
        model.lm_head.weight[1].mul_(0.1)  # EOS rarely wins: replies run to their token limit
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def peaked():
    return peaked_model()


@pytest.fixture(scope="module")
def engine(peaked):
    pytest.importorskip("vllm")
    model, tokenizer = peaked
    return make_backend("vllm", model, tokenizer, options={"max_model_len": 1024, "kv_cache_gib": 1})


def rollouts(model, tokenizer, backend, task, **options):
    return generate_rollouts(model, tokenizer, task, task.examples("train")[:4], backend=backend, seed=3, **options)


def test_merged_weights_for_vllm_equal_peft_merge_and_leave_the_model_unchanged():
    model, _ = peaked_model()
    backbone = prepare_backbone(model, student_lora=LORA)
    for name, p in backbone.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a non-zero update to merge
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    merged = dict(merged_weights(backbone, STUDENT))
    reference = copy.deepcopy(backbone).merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6)
    assert all(torch.equal(before[k], v) for k, v in backbone.state_dict().items())
    plain = dict(merged_weights(backbone, None))  # a full student: the base weights, no update merged
    assert torch.equal(plain["model.layers.0.self_attn.q_proj.weight"],
                       backbone.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight)


@pytest.mark.parametrize("lora, message", [
    ({**LORA, "use_dora": True}, "use_dora: a DoRA student cannot be synced into vLLM"),
    ({**LORA, "target_modules": ["q_proj", "embed_tokens"]}, "a LoRA on the embeddings"),
    ({**LORA, "target_modules": ["q_proj", "lm_head"]},
     "a LoRA on lm_head, whose weight is tied to model.embed_tokens.weight, is not synced into vLLM; remove lm_head"),
])
def test_a_student_lora_vllm_cannot_carry_is_refused_in_one_line(lora, message):
    from lopd_lightning.models import tiny_model  # tied embeddings, as SmolLM2

    tokenizer = tiny_tokenizer()
    backbone = prepare_backbone(tiny_model(vocab_size=len(tokenizer)), student_lora=lora)
    with pytest.raises(ValueError, match=message):
        check_mergeable(backbone, STUDENT)
    check_mergeable(prepare_backbone(tiny_model(vocab_size=len(tokenizer)), student_lora=LORA), STUDENT)  # fine
    untied, _ = peaked_model()  # a head of its own: its LoRA merges like any linear layer's
    check_mergeable(prepare_backbone(untied, student_lora={**LORA, "target_modules": ["lm_head"]}), STUDENT)


def test_unknown_backend_and_options_name_the_config_key(peaked):
    model, tokenizer = peaked
    with pytest.raises(ValueError, match="unknown generation backend 'vlm'; choose one of hf, vllm"):
        make_backend("vlm", model, tokenizer)
    with pytest.raises(ValueError, match="the hf backend takes no options"):
        make_backend("hf", model, tokenizer, options={"max_model_len": 8})


@needs_vllm
@pytest.mark.parametrize("multi_turn", [False, True], ids=["single_turn", "multi_turn"])
def test_vllm_greedy_rollouts_equal_hf_tokens_masks_and_rewards(peaked, engine, multi_turn):
    model, tokenizer = peaked
    task = ToyTask(multi_turn=multi_turn)
    hf = rollouts(model, tokenizer, HFGenerateBackend(model, tokenizer), task, greedy=True, max_new_tokens=12)
    vl = rollouts(model, tokenizer, engine, task, greedy=True, max_new_tokens=12)
    assert torch.equal(hf.input_ids, vl.input_ids)
    assert torch.equal(hf.attention_mask, vl.attention_mask)
    assert torch.equal(hf.assistant_mask, vl.assistant_mask)
    assert torch.equal(hf.rewards, vl.rewards)
    assert hf.messages == vl.messages
    assert int(hf.assistant_mask.sum()) == 12 * 4 * task.max_turns  # every reply ran to its limit (no early EOS)


@needs_vllm
def test_vllm_sampled_logps_equal_a_teacher_forced_recompute_and_seeds_reproduce(peaked, engine):
    model, tokenizer = peaked
    prompts = [tokenizer("Repeat the word: apple")["input_ids"], tokenizer("What is 3+4?")["input_ids"]]
    settings = SamplingSettings(temperature=0.7, max_new_tokens=16)  # no top-k/top-p: the contract's logps
    first = engine.generate(prompts, settings, [11, 12])
    assert [c.token_ids for c in engine.generate(prompts, settings, [11, 12])] == [c.token_ids for c in first]
    assert [c.token_ids for c in engine.generate(prompts, settings, [13, 14])] != [c.token_ids for c in first]
    for prompt, completion in zip(prompts, first, strict=True):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logps = torch.log_softmax(model(ids).logits[0].float() / 0.7, dim=-1)
        n = len(prompt)
        expected = torch.stack([logps[n - 1 + j, t] for j, t in enumerate(completion.token_ids)])
        torch.testing.assert_close(torch.tensor(completion.logps), expected, rtol=0, atol=1e-4)
    # with top-k the log-probs are those of the distribution the token was drawn from (renormalised)
    filtered = engine.generate(prompts, SamplingSettings(temperature=0.7, top_k=5, max_new_tokens=8), [11, 12])
    for prompt, completion in zip(prompts, filtered, strict=True):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            z = model(ids).logits[0].float() / 0.7
        n = len(prompt)
        for j, token in enumerate(completion.token_ids):
            top = torch.topk(z[n - 1 + j], 5)
            assert token in top.indices.tolist()
            expected = torch.log_softmax(top.values, dim=-1)[top.indices.tolist().index(token)]
            assert abs(completion.logps[j] - float(expected)) < 1e-4


@pytest.fixture(scope="module")
def small_batch_engine(peaked):
    """A second engine whose scheduler takes 256 tokens a step. Module-scoped on purpose: tearing an engine
    down in the middle of the module resets vLLM's process-wide parallel state under the other engine."""
    pytest.importorskip("vllm")
    model, tokenizer = peaked
    return make_backend("vllm", model, tokenizer, options={
        "max_model_len": 256, "kv_cache_gib": 1, "engine_options": {"max_num_batched_tokens": 256}})


@needs_vllm
def test_vllm_seeded_prompts_beyond_one_scheduler_batch_complete_as_if_sent_alone(peaked, small_batch_engine):
    """Prompts that do not fit one scheduler step (here 4 x 120 tokens against 256 batched tokens) once made
    vLLM's CPU runner chunk a prefill and fail on the seeded generator; now they run whole, in turn."""
    _, tokenizer = peaked
    backend = small_batch_engine
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, len(tokenizer), (120,), generator=generator).tolist() for _ in range(4)]
    settings = SamplingSettings(temperature=0.7, max_new_tokens=8)
    together = backend.generate(prompts, settings, [21, 22, 23, 24])
    alone = [backend.generate([p], settings, [s])[0] for p, s in zip(prompts, [21, 22, 23, 24], strict=True)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert all(len(c.token_ids) == 8 for c in together)


@needs_vllm
def test_vllm_samples_from_new_weights_after_sync_not_from_its_prefix_cache(peaked, engine):
    model, tokenizer = peaked
    model = copy.deepcopy(model)
    hf = HFGenerateBackend(model, tokenizer)
    prompts = [tokenizer("Repeat the word: apple. " * 8)["input_ids"], tokenizer("What is 3+4? " * 8)["input_ids"]]
    greedy = SamplingSettings(max_new_tokens=10, greedy=True)
    engine.sync_weights(model)
    old = engine.generate(prompts, greedy, [0, 1])  # the prompts' blocks are now in the prefix cache
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(-3.0)  # changes every prompt position's key/value cache
        model.lm_head.weight.copy_(model.lm_head.weight.roll(1, dims=0))
    warned: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            warned.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger(RELOAD_LOGGER).addHandler(handler)
    try:
        engine.sync_weights(model)
    finally:
        logging.getLogger(RELOAD_LOGGER).removeHandler(handler)
    assert not [m for m in warned if "Failed to load weights" in m], warned  # the rotary one dropped, no other
    import inspect

    from vllm.model_executor.model_loader.reload import layerwise

    # the filter matches the installed vLLM's message: a reworded one would come back, not pass unseen
    assert 'logger.warning("%s: Failed to load weights", layer.__class__.__name__)' in inspect.getsource(layerwise)
    new = engine.generate(prompts, greedy, [0, 1])
    reference = hf.generate(prompts, greedy, [0, 1])
    assert [c.token_ids for c in new] == [c.token_ids for c in reference]
    assert [c.token_ids for c in new] != [c.token_ids for c in old]


def test_the_rotary_embeddings_reload_warning_is_dropped_and_any_other_layers_kept():
    """vLLM warns "RotaryEmbedding: Failed to load weights" at every sync (a rotary embedding has no checkpoint
    weights; its cache is put back unchanged); the same warning of another layer means a missing weight."""
    def record(layer):
        return logging.LogRecord(RELOAD_LOGGER, logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,), None)

    keep = DropRotaryReloadWarning()
    assert keep.filter(record("RotaryEmbedding")) is False
    assert keep.filter(record("QKVParallelLinear")) is True


@needs_vllm
def test_vllm_module_syncs_the_lora_student_after_each_step(tmp_path, peaked):
    from helpers import ParityToy, quiet_trainer

    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.modules import GRPOModule

    model, tokenizer = peaked
    folder = tmp_path / "student"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    module = GRPOModule(str(folder), lora=LORA, group_size=2, max_new_tokens=6, learning_rate=0.05, grad_clip=0.0,
                        generation_backend="vllm", vllm_options={"max_model_len": 1024, "kv_cache_gib": 1})
    data = OnPolicyDataModule(ParityToy(), examples_per_step=2, val_limit=4, val_batch_size=4)
    quiet_trainer(tmp_path, max_steps=2).fit(module, data)
    assert module.global_step == 2 and module.step_timings.get("weight_sync", 0) > 0  # step 2's rollouts synced
    with torch.no_grad():  # an update of the LoRA student (GRPO's may be zero here: equal rewards in a group)
        for name, p in module.backbone.named_parameters():
            if "lora_B" in name and ".student" in name:
                p.normal_(std=0.5)
    examples = ParityToy().examples("val")[:4]
    vl = module.evaluate_examples(ParityToy(), examples)  # syncs: the weights moved since the last rollouts
    with use_adapter(module.backbone, STUDENT):
        hf = generate_rollouts(module.backbone, module.tokenizer, ParityToy(), examples, seed=module.hparams.seed,
                               backend=HFGenerateBackend(module.backbone, module.tokenizer),
                               **module.sampling_options(greedy=True))
    assert vl.messages == hf.messages
    assert module.step_timings.get("weight_sync", 0) > 0
    with use_adapter(module.backbone, None):  # the base weights alone answer differently: the LoRA was merged
        base = generate_rollouts(module.backbone, module.tokenizer, ParityToy(), examples, seed=module.hparams.seed,
                                 backend=HFGenerateBackend(module.backbone, module.tokenizer),
                                 **module.sampling_options(greedy=True))
    assert base.messages != vl.messages


def test_generation_backend_vllm_fails_before_the_weights_load_with_one_line(no_model_loading):
    from lopd_lightning.modules import GRPOModule

    if HAS_VLLM:
        with pytest.raises(ValueError, match=r"model.init_args.vllm_options has unknown keys \['kv_cache'\]"):
            GRPOModule("tiny", generation_backend="vllm", vllm_options={"kv_cache": 1})
        with pytest.raises(ValueError, match=r"^model.init_args.vllm_options.dtype: 'bfloat16' cannot hold"):
            GRPOModule("tiny", dtype="bfloat16", lora=LORA, generation_backend="vllm", vllm_options={"dtype": "bfloat16"})
        with pytest.raises(ValueError, match=r"model.init_args.vllm_options has unknown keys \['local_rank'\]"):
            GRPOModule("tiny", generation_backend="vllm", vllm_options={"local_rank": 1})  # the module's to give
        # vLLM's SamplingParams refused it at the first rollouts ("temperature must be in [0, 2]")
        with pytest.raises(ValueError, match=r"^model.init_args.temperature=3.0: vLLM samples at temperatures up to 2; "
                                             r"set it <= 2 or use generation_backend: hf$"):
            GRPOModule("tiny", temperature=3.0, generation_backend="vllm")
    else:
        with pytest.raises(ValueError, match="generation_backend: vllm needs vLLM, which this environment lacks"):
            GRPOModule("tiny", generation_backend="vllm")


def test_vllm_engine_resyncs_after_a_checkpoint_load_or_a_marked_change():
    from lopd_lightning.modules import GRPOModule

    module = GRPOModule("tiny", group_size=2, max_new_tokens=4, generation_backend="hf")
    module._backend, module._backend_step = object(), 0  # a built backend at step 0
    assert module.generation_backend() is module._backend  # no sync needed (would fail on object())
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    module.on_load_checkpoint(checkpoint)
    assert module._backend_step == -1  # the next rollouts sync first
    module._backend_step = 0
    module.mark_weights_changed()
    assert module._backend_step == -1


# ------------------------------------------------------------- a bfloat16 student: no update lost to the grid
def small_update_student(model, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
    """``model`` in bfloat16 with a student LoRA whose update is below bfloat16's resolution relative to the
    weights it is added to (||scale B A|| / ||W|| about 1.5e-3, against bfloat16's relative step of 4e-3 to 8e-3):
    rounded onto the grid, about 70% of its elements vanish and the others grow to a whole step."""
    backbone = prepare_backbone(model.to(torch.bfloat16), student_lora={**LORA, "target_modules": list(targets)})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 1e-4)
    return backbone


def effect_error(logits, student, base) -> float:
    """|| (logits - base) - (student - base) || / || student - base ||: 0 when ``logits`` carry the LoRA's effect
    exactly, about 1 when they lost it."""
    return float(((logits - student).norm() / (student - base).norm()).item())


def float32_student_and_base_logits(backbone, ids):
    """The LoRA student's and its base's logits in float32 arithmetic on the student's own weights (the bfloat16
    base weights and the float32 LoRA, upcast exactly): the policy the trainer holds. A bfloat16 forward adds
    rounding noise larger than such a small update, so it cannot be the reference."""
    exact = copy.deepcopy(backbone).float()
    with torch.no_grad():
        with use_adapter(exact, STUDENT):
            student = exact(input_ids=ids).logits
        with use_adapter(exact, None):
            base = exact(input_ids=ids).logits
    return student, base


def test_merged_weights_of_a_bfloat16_lora_student_keep_an_update_below_bfloat16s_resolution():
    """The copy vLLM samples from (merged_weights) was the base weights plus the update rounded onto the
    bfloat16 grid: its logits missed the LoRA's effect by 0.86 of the effect (here). The LoRA-touched weights
    are float32 now."""
    from lopd_lightning.models import tiny_model

    backbone = small_update_student(tiny_model())
    ids = torch.tensor([[60, 105, 110, 32, 116, 104, 101, 32, 119, 111, 114, 100, 1]])
    student, base = float32_student_and_base_logits(backbone, ids)
    merged = dict(merged_weights(backbone, STUDENT))
    sampler = tiny_model()  # float32, as the engine runs (VLLMBackend's dtype)
    sampler.load_state_dict({k: v.float() for k, v in merged.items()}, strict=False)
    with torch.no_grad():
        logits = sampler(input_ids=ids).logits
    assert effect_error(logits, student, base) < 0.1
    assert merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32  # LoRA-touched: float32
    assert merged["model.embed_tokens.weight"].dtype == torch.bfloat16  # the others as the student holds them


@pytest.mark.parametrize("engine_dtype, student_dtype, lora, refused", [
    ("float32", "bfloat16", True, False),
    (torch.float32, torch.bfloat16, True, False),
    ("bfloat16", "bfloat16", True, True),   # a LoRA merged onto the bfloat16 grid: the update rounded away
    ("auto", "bfloat16", True, True),       # vLLM's auto: the checkpoint's bfloat16
    ("half", "float16", True, True),
    ("bfloat16", "bfloat16", False, False),  # a full-parameter bfloat16 student: its weights are bfloat16
    ("auto", "bfloat16", False, False),
    ("bfloat16", "float32", False, True),   # a float32 student's steps below bfloat16's resolution
    ("float16", "bfloat16", False, True),
])
def test_an_engine_dtype_that_cannot_hold_the_merged_weights_is_refused_in_one_line(engine_dtype, student_dtype,
                                                                                     lora, refused):
    from lopd_lightning.rollout.vllm_backend import check_engine_dtype

    if not refused:
        check_engine_dtype(engine_dtype, student_dtype, lora=lora)
        return
    with pytest.raises(ValueError, match=r"^model.init_args.vllm_options.dtype: ") as error:
        check_engine_dtype(engine_dtype, student_dtype, lora=lora)
    assert "\n" not in str(error.value) and "the engine would sample from another policy" in str(error.value)


def test_an_unknown_dtype_names_its_own_key():
    """An unknown student dtype was reported as model.init_args.vllm_options.dtype's."""
    from lopd_lightning.rollout.vllm_backend import check_engine_dtype

    with pytest.raises(ValueError, match=r"^model.init_args.dtype: unknown dtype 'fp16'; use float32 or bfloat16$"):
        check_engine_dtype("float32", "fp16", lora=True)
    with pytest.raises(ValueError, match=r"^model.init_args.vllm_options.dtype: unknown dtype 'fp16'; use float32$"):
        check_engine_dtype("fp16", "float32", lora=True)


@pytest.fixture(scope="module")
def bfloat16_lora_engine(peaked):
    """A bfloat16 LoRA student with a small update and its engine (float32, the default). Module-scoped, as the
    other engines: an engine torn down mid-module resets vLLM's process-wide state under the others."""
    pytest.importorskip("vllm")
    model, tokenizer = peaked
    backbone = small_update_student(copy.deepcopy(model))
    return backbone, make_backend("vllm", backbone, tokenizer, adapter=STUDENT,
                                  options={"max_model_len": 1024, "kv_cache_gib": 1})


@needs_vllm
def test_vllm_samples_a_bfloat16_lora_students_small_update(peaked, bfloat16_lora_engine):
    """Engine level (make test-vllm): the engine's log-probs of its own samples differ from the base's by what the
    student's do (float32 arithmetic on the student's weights), within 10% of that effect (about 0.09 in norm
    over 16 tokens; float32 arithmetic alone differs from float64 by 2e-5)."""
    _, tokenizer = peaked
    backbone, engine = bfloat16_lora_engine
    prompt = tokenizer("Repeat the word: apple")["input_ids"]
    completion = engine.generate([prompt], SamplingSettings(temperature=1.0, max_new_tokens=16), [5])[0]
    ids = torch.tensor([prompt + completion.token_ids])
    student, base = float32_student_and_base_logits(backbone, ids)
    n, tokens = len(prompt), torch.tensor(completion.token_ids)
    rows = torch.arange(n - 1, n - 1 + len(tokens))

    def logps(logits):
        return torch.log_softmax(logits[0], dim=-1)[rows, tokens]

    sampled = torch.tensor(completion.logps)
    effect = logps(student) - logps(base)
    assert float((sampled - logps(student)).norm() / effect.norm()) < 0.1


# ------------------------------------------------------------- a second EOS id of the generation config
@pytest.fixture(scope="module")
def second_eos(peaked):
    """The peaked model with a second EOS id, the token its greedy multi-turn toy replies use most, and its engine
    (built after the id is set: vLLM reads the stop ids from the generation config it is given)."""
    pytest.importorskip("vllm")
    import collections

    model, tokenizer = peaked
    model = copy.deepcopy(model)
    task = ToyTask(multi_turn=True)
    plain = rollouts(model, tokenizer, HFGenerateBackend(model, tokenizer), task, greedy=True, max_new_tokens=12)
    counts = collections.Counter(plain.input_ids[plain.assistant_mask].tolist())
    second = next(t for t, _ in counts.most_common() if t not in (0, 1))
    model.generation_config.eos_token_id = [1, second]
    return model, make_backend("vllm", model, tokenizer, options={"max_model_len": 1024, "kv_cache_gib": 1})


@needs_vllm
def test_vllm_stops_on_a_second_eos_id_and_the_loop_writes_the_template_token_as_hf(peaked, second_eos):
    """Engine level (make test-vllm): vLLM stops on the generation config's second EOS id as the HF backend does,
    and the episode loop puts the template's EOS in its place (mask 0): the same ids, masks and messages."""
    _, tokenizer = peaked
    model, engine = second_eos
    task = ToyTask(multi_turn=True)
    hf = rollouts(model, tokenizer, HFGenerateBackend(model, tokenizer), task, greedy=True, max_new_tokens=12)
    vl = rollouts(model, tokenizer, engine, task, greedy=True, max_new_tokens=12)
    assert hf.stats.secondary_eos == vl.stats.secondary_eos > 0
    assert torch.equal(hf.input_ids, vl.input_ids)
    assert torch.equal(hf.assistant_mask, vl.assistant_mask)
    assert torch.equal(hf.rewards, vl.rewards)
    assert hf.messages == vl.messages
    assert [m["stop_reasons"] for m in hf.metadata] == [m["stop_reasons"] for m in vl.metadata]


def test_vllm_kv_cache_size_the_config_gives_wins_over_an_inherited_one_and_is_checked(caplog):
    """``vllm_options.kv_cache_gib`` was silently overridden by an inherited ``VLLM_CPU_KVCACHE_SPACE`` (and by the
    first engine's own value, which it left in ``os.environ``, for every later engine of the process). The value is
    now the engine's for its start only: the config's when given (a warning names an inherited one that differs),
    else the inherited one, else 2. No engine needed."""
    import logging

    from lopd_lightning.rollout.vllm_backend import cpu_environment

    assert cpu_environment(environ={}) == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert cpu_environment(environ={"VLLM_CPU_KVCACHE_SPACE": "5"}) == {"VLLM_CPU_KVCACHE_SPACE": "5"}
    assert cpu_environment(kv_cache_gib=1, environ={}) == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    with caplog.at_level(logging.WARNING, logger="lopd_lightning.rollout"):
        assert cpu_environment(kv_cache_gib=1, environ={"VLLM_CPU_KVCACHE_SPACE": "5"}) == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert "vllm_options.kv_cache_gib=1 wins over the inherited VLLM_CPU_KVCACHE_SPACE=5" in caplog.text
    for bad in (0, -1, "2", 1.5, True):
        with pytest.raises(ValueError, match=r"^model\.init_args\.vllm_options\.kv_cache_gib must be an int >= 1 "):
            cpu_environment(kv_cache_gib=bad, environ={})


def test_vllm_kv_cache_size_other_than_an_int_of_at_least_one_is_refused_before_the_weights_load(
        monkeypatch, no_model_loading):
    from lopd_lightning.modules import GRPOModule

    find_spec = importlib.util.find_spec  # as in .venv-vllm: the refusal needs no engine
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: object() if name == "vllm" else find_spec(name, *a, **k))
    with pytest.raises(ValueError, match=r"^model\.init_args\.vllm_options\.kv_cache_gib must be an int >= 1 .*got 0$"):
        GRPOModule("tiny", generation_backend="vllm", vllm_options={"kv_cache_gib": 0})


@needs_vllm
def test_vllm_engine_sets_its_kv_cache_size_for_its_start_only(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    model, tokenizer = peaked_model()
    make_backend("vllm", model, tokenizer, options={"max_model_len": 256, "kv_cache_gib": 1})
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # a later engine of the process gets its own
