"""The authors' setting as options (issue 56): the framing shared by text and latent contexts, the per-rollout
composer KL, the joint composer clip, self-retrieval reaching the teacher at LOPD, and the two presets.

Tiny random Llama, the toy task, a hashing-embedder bank of its reference solutions; CPU, seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lopd_lightning.cli import lightning_cli
from lopd_lightning.losses.lm_head import rollout_mean
from lopd_lightning.modules import LOPDModule, OPSDModule
from lopd_lightning.rollout import batch_from_conversations
from lopd_lightning.tasks.toy import ToyTask
from lopd_lightning.teacher import FRAMINGS, resolve_framing
from helpers import EvenToy, quiet_trainer
from test_lopd_module import bank_dir, capture_student_and_teacher, make_dm, make_module  # noqa: F401  (bank_dir: a fixture)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


class Recorder(Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(batch)


# ------------------------------------------------------------------------------------------------ framing
def test_a_framing_is_a_name_or_a_prefix_and_suffix_and_a_mistake_names_the_key():
    assert resolve_framing(None) == resolve_framing("short") == FRAMINGS["short"]
    assert resolve_framing({"prefix": "<", "suffix": ">"}) == ("<", ">")
    prefix, suffix = resolve_framing("from_scratch")
    assert "already been carried out" in prefix and "from the first one" in suffix and "starts now" in suffix
    with pytest.raises(ValueError, match=r"model.init_args.context_framing 'from_scrach' is not a framing; did you "
                                         r"mean 'from_scratch'\?"):
        resolve_framing("from_scrach")
    with pytest.raises(ValueError, match="needs exactly the string keys prefix and suffix"):
        resolve_framing({"prefix": "a"})
    with pytest.raises(ValueError, match="must be a framing name"):
        resolve_framing(3)


def test_the_framing_surrounds_the_latents_in_the_teachers_input(bank_dir):
    module = make_module(bank_dir, context_framing="from_scratch")
    prefix, suffix = FRAMINGS["from_scratch"]
    ids = lambda text: module.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert module.teacher.prefix_ids == ids(prefix) and module.teacher.suffix_ids == ids(suffix)
    task = ToyTask()
    example = task.examples("train")[0]
    batch = batch_from_conversations(module.tokenizer, [[*task.initial_messages(example),
                                                         {"role": "assistant", "content": "x"}]],
                                     rewards=[1.0], group_ids=[0], example_ids=[example.id])
    k = module.composer.num_latents
    latents = torch.randn(1, 2 * k, module.composer.hidden_size)
    inputs = module.teacher.insert_context(batch.input_ids, batch.attention_mask, batch.context_position,
                                           latents=latents)
    pos = int(batch.context_position[0])
    row = inputs.input_ids[0].tolist()
    n_pre, n_suf = len(ids(prefix)), len(ids(suffix))
    assert row[pos:pos + n_pre] == ids(prefix)
    assert row[pos + n_pre + 2 * k:pos + n_pre + 2 * k + n_suf] == ids(suffix)
    assert inputs.latent_slots[0].nonzero().squeeze(-1).tolist() == list(range(pos + n_pre, pos + n_pre + 2 * k))
    # the default framing is unchanged
    assert make_module(bank_dir).teacher.prefix_ids == ids(FRAMINGS["short"][0])


@pytest.mark.parametrize("privileged_context", ["reference", "retrieved"])
def test_opsd_frames_its_text_with_the_same_option_as_lopds_latents(bank_dir, privileged_context):
    module = OPSDModule("tiny", max_new_tokens=8, learning_rate=1e-3, context_framing="from_scratch",
                        privileged_context=privileged_context, bank_path=str(bank_dir), embedder="hashing")
    lopd = make_module(bank_dir, context_framing="from_scratch")
    assert (module.teacher.framing_prefix, module.teacher.framing_suffix) == \
        (lopd.teacher.framing_prefix, lopd.teacher.framing_suffix) == FRAMINGS["from_scratch"]
    task = ToyTask()
    examples = task.examples("train")[:2]
    batch = batch_from_conversations(
        module.tokenizer, [[*task.initial_messages(ex), {"role": "assistant", "content": "x"}] for ex in examples],
        rewards=[0.0, 0.0], group_ids=[0, 1], example_ids=[ex.id for ex in examples])
    texts = ["the answer", None]
    if privileged_context == "reference":
        module.reference_texts = lambda batch: texts
    else:
        module.retrieved_texts = lambda batch: texts
    contexts = module.teacher_contexts(batch)
    prefix, suffix = FRAMINGS["from_scratch"]
    assert contexts.texts == [prefix + "the answer" + suffix, None]
    assert module.context_ids(contexts)[0] == module.tokenizer(prefix + "the answer" + suffix,
                                                               add_special_tokens=False)["input_ids"]


def test_opsd_without_a_framing_keeps_its_reference_template(bank_dir):
    from lopd_lightning.modules.opsd import OPSD_REFERENCE_TEMPLATE

    module = OPSDModule("tiny", max_new_tokens=8)
    task = ToyTask()
    example = task.examples("train")[0]
    batch = batch_from_conversations(module.tokenizer, [[*task.initial_messages(example),
                                                         {"role": "assistant", "content": "x"}]],
                                     rewards=[0.0], group_ids=[0], example_ids=[example.id])
    module.reference_texts = lambda batch: ["the answer"]
    assert module.teacher_contexts(batch).texts == [OPSD_REFERENCE_TEMPLATE.format(reference="the answer")]


# ------------------------------------------------------------------------------------- per-rollout KL mean
def test_rollout_mean_is_the_mean_over_rollouts_of_each_rollouts_token_mean():
    mask = torch.tensor([[True, True, True, False], [False, False, False, False], [False, True, False, False]])
    per_token = torch.tensor([1.0, 2.0, 6.0, 10.0])  # rollout 0: 1, 2, 6 (mean 3); rollout 2: 10
    assert float(rollout_mean(per_token, mask, num_rollouts=2)) == pytest.approx((3.0 + 10.0) / 2)
    assert float(rollout_mean(per_token, mask, num_rollouts=4)) == pytest.approx(13.0 / 4)  # a DDP share
    assert float(rollout_mean(per_token, mask, num_rollouts=0)) == 0.0
    with pytest.raises(ValueError, match="3 entries for 4 loss tokens"):
        rollout_mean(per_token[:3], mask, num_rollouts=2)


@pytest.mark.parametrize("kl_mean", ["token", "rollout"])
def test_the_composers_kl_is_the_chosen_mean_of_a_naive_per_token_kl(tmp_path, bank_dir, kl_mean):
    top_m = 8
    module = make_module(bank_dir, distill_top_k=top_m, composer_kl_mean=kl_mean)
    captured = {}
    capture_student_and_teacher(module, captured)
    composer_kl = module._composer_distillation

    def grab_kl(*args, **kwargs):
        out = composer_kl(*args, **kwargs)
        captured["distill_c"] = float(out.detach())
        return out

    module._composer_distillation = grab_kl
    rec = Recorder()
    quiet_trainer(tmp_path, max_steps=1, callbacks=[rec]).fit(module, make_dm(EvenToy(), examples_per_step=4))
    batch = rec.batches[0]
    mask = batch.assistant_mask[:, 1:].bool()
    s, t = captured["student"], captured["teacher"]
    assert s.shape[0] == t.shape[0] == int(mask.sum())  # packed at the loss positions
    per_row: dict[int, list[float]] = {}
    for n, (b, _) in enumerate(mask.nonzero().tolist()):
        log_pt, log_ps = torch.log_softmax(t[n], -1), torch.log_softmax(s[n], -1)
        support = torch.topk(log_pt, top_m).indices
        ps, pt = log_ps.exp()[support], log_pt.exp()[support]
        ps = torch.cat([ps, (1 - ps.sum()).clamp_min(1e-12)[None]])
        pt = torch.cat([pt, (1 - pt.sum()).clamp_min(1e-12)[None]])
        per_row.setdefault(b, []).append(float((ps * (ps / pt).log()).sum()))
    lengths = {len(v) for v in per_row.values()}
    if kl_mean == "token":
        expected = sum(sum(v) for v in per_row.values()) / sum(len(v) for v in per_row.values())
    else:
        expected = sum(sum(v) / len(v) for v in per_row.values()) / len(per_row)
    assert captured["distill_c"] == pytest.approx(expected, rel=1e-4, abs=1e-7)
    assert lengths  # (the rollouts here are all cut at max_new_tokens; the next test has unequal lengths)


def test_the_rollout_mean_of_rollouts_of_unequal_lengths_differs_from_the_token_mean(bank_dir):
    task = ToyTask()
    examples = task.examples("train")[:3]
    replies = ["a", "a much longer reply than the others", "mid length"]
    means = {}
    for kl_mean in ("token", "rollout"):
        module = make_module(bank_dir, distill_top_k=8, composer_kl_mean=kl_mean)
        batch = batch_from_conversations(
            module.tokenizer, [[*task.initial_messages(ex), {"role": "assistant", "content": r}]
                               for ex, r in zip(examples, replies)],
            rewards=[1.0, 0.0, 1.0], group_ids=[0, 1, 2], example_ids=[ex.id for ex in examples])
        mask = batch.assistant_mask[:, 1:].bool()
        generator = torch.Generator().manual_seed(1)
        student = torch.randn(int(mask.sum()), 259, generator=generator, dtype=torch.float64)
        teacher = torch.randn(int(mask.sum()), 259, generator=generator, dtype=torch.float64)
        means[kl_mean] = float(module._composer_distillation(mask, student, teacher, float(mask.sum())))
        per_token = module.lm_head.reverse_kl(student, teacher, top_k=8)
        rows = mask.nonzero()[:, 0]
        lengths = mask.sum(dim=1)
        assert len(set(lengths.tolist())) == 3
        by_row = [float(per_token[rows == b].mean()) for b in range(3)]
        expected = sum(by_row) / 3 if kl_mean == "rollout" else float(per_token.sum()) / int(mask.sum())
        assert means[kl_mean] == pytest.approx(expected, rel=1e-9)
    assert abs(means["token"] - means["rollout"]) > 1e-4


# ---------------------------------------------------------------------------------------- joint clip
def test_the_joint_clip_bounds_the_composers_whole_gradient_and_the_default_clips_each_part(bank_dir):
    def with_gradients(module):
        generator = torch.Generator().manual_seed(0)
        for p in module.composer.trainable_parameters():
            p.grad = torch.randn(p.shape, generator=generator) * 10.0
        return module

    def total(params):
        return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)))

    joint = with_gradients(make_module(bank_dir, composer_clip_joint=1.0))
    before = total(joint.composer.trainable_parameters())
    norm = joint.clip_composer_gradients()
    assert float(norm) == pytest.approx(before, rel=1e-5) and before > 1.0
    assert total(joint.composer.trainable_parameters()) == pytest.approx(1.0, rel=1e-4)
    separate = with_gradients(make_module(bank_dir, composer_clip_compressor=2.0, composer_clip_lora=0.5))
    separate.clip_composer_gradients()
    assert total(separate.composer.compressor_parameters()) == pytest.approx(2.0, rel=1e-4)
    assert total(separate.composer.lora_parameters()) == pytest.approx(0.5, rel=1e-4)


@pytest.mark.parametrize("overrides, message", [
    ({"composer_kl_mean": "rollouts"}, r"model.init_args.composer_kl_mean 'rollouts' is not a mean; did you mean "
                                       r"'rollout'\?"),
    ({"composer_clip_joint": 0.0}, r"model.init_args.composer_clip_joint must be null \(separate clips\) or a number"),
    ({"composer_clip_joint": True}, "model.init_args.composer_clip_joint must be null"),
    ({"context_framing": "long"}, "model.init_args.context_framing 'long' is not a framing"),
])
def test_the_new_options_are_refused_before_the_model_loads(no_model_loading, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_module(None, **overrides)


# ------------------------------------------------------------------------------------ self-retrieval at LOPD
def test_self_retrieval_hands_the_teacher_the_requests_own_trajectory_at_lopd(tmp_path, bank_dir):
    module = make_module(bank_dir, allow_self_retrieval=True, latent_probe_every_n_steps=0)
    composed = []
    batch_latents = module.batch_latents

    def record(batch, composer=None):
        if composer is None:
            composed.append([[e.task_id for e in row] for row in batch.experiences])
        return batch_latents(batch, composer)

    module.batch_latents = record
    rec = Recorder()
    quiet_trainer(tmp_path, max_steps=2, callbacks=[rec]).fit(module, make_dm())
    assert len(rec.batches) == 2
    assert len(composed) == 2  # one composition per step: the teacher's
    for batch, ids in zip(rec.batches, composed, strict=True):
        for b, example_id in enumerate(batch.example_ids):
            assert batch.experiences[b][0].task_id == example_id  # its own record first (cosine 1)
            assert ids[b][0] == example_id  # and the latents the teacher read are composed from it
    other = make_module(bank_dir)  # the default: other tasks only
    task = ToyTask()
    examples = task.examples("train")[:4]
    assert all(e.task_id != ex.id for ex, row in zip(examples, other.retrieve(task, examples)) for e in row)


# --------------------------------------------------------------------------------------------- presets
def preset_options(preset: str, bank_dir: Path) -> dict:
    """The preset's model.init_args over the comparison's common ones, on the tiny model, the toy bank and the
    HF backend (the files the preset names exist only after its stages)."""
    import yaml

    common = yaml.safe_load((CONFIGS / "experience/common.yaml").read_text())["model"]["init_args"]
    config = yaml.safe_load((CONFIGS / f"experience/{preset}.yaml").read_text())
    options = {**common, **config["model"]["init_args"]}
    options.update(model="tiny", lora=LORA, generation_backend="hf", max_new_tokens=8, generation_batch_size=2)
    if "bank_path" in options or preset == "opsd_reference":
        options.update(bank_path=str(bank_dir), embedder="hashing")
    if "composer_path" in options:
        options.update(composer_path=None, warm_start_steps=2, warm_start_batch_size=2)
    return config["model"]["class_path"], options


@pytest.mark.parametrize("preset", ["lopd_paper", "opsd_reference"])
def test_the_presets_build_and_train_a_step(tmp_path, bank_dir, preset):
    class_path, options = preset_options(preset, bank_dir)
    cls = {"lopd_lightning.modules.LOPDModule": LOPDModule, "lopd_lightning.modules.OPSDModule": OPSDModule}[class_path]
    module = cls(options.pop("model"), **options)
    assert (module.teacher.framing_prefix, module.teacher.framing_suffix) == FRAMINGS["from_scratch"]
    if cls is LOPDModule:
        hp = module.hparams
        assert hp.allow_self_retrieval and hp.warm_start_self_retrieval and hp.warm_start_reconstruction_weight == 0
        assert (hp.num_latents, hp.num_experiences, hp.teacher_mode) == (32, 3, "base")
        assert (hp.composer_kl_mean, hp.composer_clip_joint) == ("rollout", 1.0)
    else:
        assert module.hparams.privileged_context == "reference"
    quiet_trainer(tmp_path, max_steps=1).fit(module, make_dm())
    assert module.global_step == 1
