"""OPSDModule: a one-step fit where the teacher (and only the teacher) reads the reference solution,
the reference lookup, the loss against a naive generalized JSD, the frozen teacher, rows without a
reference dropped; with ``privileged_context: retrieved``, the framed trace of the bank's nearest
experience instead, its one-line refusals, and ``lopd build-memory`` on such a config.

Everything runs on the tiny random Llama (``model: tiny``) and the toy task, on CPU, in seconds.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from lopd_lightning.cli import main
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.losses import generalized_jsd
from lopd_lightning.memory import Experience, ExperienceBank
from lopd_lightning.memory.embed import get_embedder
from lopd_lightning.modules.opsd import OPSD_REFERENCE_TEMPLATE, OPSDModule
from lopd_lightning.rollout import batch_from_conversations
from lopd_lightning.tasks import Example
from lopd_lightning.tasks.toy import ToyTask
from lopd_lightning.teacher import DEFAULT_FRAMING_PREFIX, DEFAULT_FRAMING_SUFFIX
from helpers import assert_one_line_error, quiet_trainer, run_main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def make_module(**overrides) -> OPSDModule:
    options = dict(max_new_tokens=8, learning_rate=1e-3)
    options.update(overrides)
    return OPSDModule("tiny", **options)


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


class NoReferenceToy(ToyTask):
    """The toy task without ground truth for odd examples."""

    def reference_solution(self, example: Example) -> str:
        return "" if int(example.id.split("/")[1]) % 2 else super().reference_solution(example)

    def reference_replies(self, example: Example) -> list[str]:
        return [] if int(example.id.split("/")[1]) % 2 else super().reference_replies(example)


def test_bad_divergence_raises_before_loading():
    with pytest.raises(ValueError, match="divergence"):
        OPSDModule("no-such-model", divergence="kl")
    with pytest.raises(ValueError, match="jsd_beta"):
        OPSDModule("no-such-model", jsd_beta=1.5)


def test_reference_text_lookup():
    module = make_module()
    task = ToyTask(multi_turn=True)
    ex = task.all_examples()[0]
    assert module.reference_text(task, ex) == task.reference_solution(ex)
    nr = NoReferenceToy()
    assert module.reference_text(nr, nr.all_examples()[1]) is None

    class RepliesOnly(ToyTask):
        def reference_solution(self, example):
            return ""

        def reference_replies(self, example):
            return ["first", "second"]

    assert module.reference_text(RepliesOnly(), ex) == "first\n\nsecond"


def test_one_step_fit_teacher_sees_the_reference_and_the_student_does_not(tmp_path):
    module = make_module(lora=LORA)
    teacher_ids, student_ids = [], []
    insert, student_forward = module.teacher.insert_context, module.student_forward

    def record_insert(*args, **kwargs):
        out = insert(*args, **kwargs)
        teacher_ids.append(out.input_ids.clone())
        return out

    def record_student(batch, positions, **kwargs):
        student_ids.append(batch.input_ids.clone())
        return student_forward(batch, positions, **kwargs)

    module.teacher.insert_context = record_insert
    module.student_forward = record_student
    seen = {}

    class Rec(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["logged"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
            seen["batch"] = batch
            seen["refs"] = pl_module.reference_texts(batch)

    dm = OnPolicyDataModule(NoReferenceToy(), examples_per_step=4, val_limit=2, val_batch_size=2)
    L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, limit_val_batches=0,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[Rec()],
    ).fit(module, dm)
    assert module.global_step == 1
    batch, refs = seen["batch"], seen["refs"]
    assert len(batch) == 4  # group_size defaults to 1
    for example_id, ref in zip(batch.example_ids, refs, strict=True):
        odd = int(example_id.split("/")[1]) % 2
        assert (ref is None) == bool(odd)
    assert len(teacher_ids) == 1 and len(student_ids) == 1
    kept = [b for b, ref in enumerate(refs) if ref is not None]
    assert kept, "the draw held no example with a reference"
    for b, ref in enumerate(refs):
        student_row = student_ids[0][b].tolist()
        teacher_row = teacher_ids[0][b].tolist()
        if ref is None:
            # no context: the teacher's row is the student's (plus padding)
            assert teacher_row[: len(student_row)] == student_row
            continue
        framed = module.tokenizer(OPSD_REFERENCE_TEMPLATE.format(reference=ref), add_special_tokens=False)["input_ids"]
        assert contains(teacher_row, framed)
        assert not contains(student_row, framed)
        # the rest of the teacher's sequence is the student's
        pos = int(batch.context_position[b])
        n = int(batch.attention_mask[b].sum())
        assert teacher_row[:pos] + teacher_row[pos + len(framed) : n + len(framed)] == student_row[:n]
    logged = seen["logged"]
    for tag in ["train/loss", "train/rows_with_reference", "train/grad_norm",
                "train/reward_mean", "train/success_rate", "time/teacher", "time/student_step"]:
        assert tag in logged, tag
    assert logged["train/rows_with_reference"] == pytest.approx(len(kept) / 4)
    assert logged["train/loss"] > 0


def test_teacher_is_frozen_initial_weights(tmp_path):
    module = make_module(lora=None)
    shadow = module.teacher.shadow
    assert shadow is not None and not any(p.requires_grad for p in shadow.parameters())
    before = [p.detach().clone() for p in shadow.parameters()]
    student_before = [p.detach().clone() for p in module.student_parameters()]
    dm = OnPolicyDataModule(ToyTask(), examples_per_step=2, val_limit=2, val_batch_size=2)
    L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, limit_val_batches=0,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    ).fit(module, dm)
    assert all(torch.equal(a, p) for a, p in zip(before, shadow.parameters(), strict=True))
    assert not all(torch.equal(a, p) for a, p in zip(student_before, module.student_parameters(), strict=True))


@pytest.mark.parametrize("divergence, beta", [("jsd", 0.5), ("forward_kl", 0.0)])
def test_loss_equals_naive_generalized_jsd(divergence, beta):
    module = make_module(lora=None, divergence=divergence)
    with torch.no_grad():  # the student differs from the frozen teacher beyond the context
        for p in module.student_parameters():
            p.add_(0.05 * torch.randn_like(p))
    task = ToyTask()
    examples = task.all_examples()[:3]
    conversations = [[*task.initial_messages(ex), {"role": "assistant", "content": f"reply {i}"}] for i, ex in enumerate(examples)]
    batch = batch_from_conversations(
        module.tokenizer, conversations, rewards=[0.0] * 3, group_ids=[0, 1, 2], example_ids=[ex.id for ex in examples]
    )
    refs = [task.reference_solution(examples[0]), None, task.reference_solution(examples[2])]  # row 1: none
    module.reference_texts = lambda batch: refs

    _, mask = module.shifted(batch)
    student, teacher = [], []
    for b, ref in enumerate(refs):
        if ref is None:
            continue
        n = int(batch.attention_mask[b].sum())
        ids, pos = batch.input_ids[b, :n], int(batch.context_position[b])
        ctx = torch.tensor(
            module.tokenizer(OPSD_REFERENCE_TEMPLATE.format(reference=ref), add_special_tokens=False)["input_ids"]
        )
        with torch.no_grad():
            s = module.backbone(input_ids=ids[None]).logits[0]
            t = module.teacher.shadow(input_ids=torch.cat([ids[:pos], ctx, ids[pos:]])[None]).logits[0]
        where = mask[b, : n - 1].nonzero().flatten()
        student.append(s[where])
        teacher.append(t[where + len(ctx)])
    student, teacher = torch.cat(student)[None], torch.cat(teacher)[None]
    expected = generalized_jsd(student, teacher, beta=beta).sum() / student.shape[1]

    captured = {}
    optimizer = torch.optim.AdamW(module.student_parameters(), lr=1e-3)
    module.optimizers = lambda: optimizer
    module.manual_backward = lambda loss: (captured.setdefault("loss", loss.detach().clone()), loss.backward())
    module.log_rollout_metrics = lambda batch, metrics: captured.update(metrics)
    module.training_step(batch, 0)
    assert float(expected) > 0
    assert float(captured["loss"]) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
    assert captured["train/rows_with_reference"] == pytest.approx(2 / 3)


def test_teacher_contexts_frame_the_references_and_keep_the_rows_that_have_one():
    module = make_module()
    task = ToyTask()
    examples = task.all_examples()[:2]
    conversations = [[*task.initial_messages(ex), {"role": "assistant", "content": "x"}] for ex in examples]
    batch = batch_from_conversations(module.tokenizer, conversations, rewards=[0.0, 0.0], group_ids=[0, 1],
                                     example_ids=[ex.id for ex in examples])
    module.reference_texts = lambda batch: ["the answer", None]
    contexts = module.teacher_contexts(batch)
    assert contexts.texts == [OPSD_REFERENCE_TEMPLATE.format(reference="the answer"), None]
    assert contexts.kept.tolist() == [True, False]
    assert module.teacher_context_ids(["the answer", None]) == module.teacher.encode_text_context(
        contexts.texts, prefix="", suffix="")


class PlainReferenceOPSD(OPSDModule):
    """``teacher_context_ids`` as an override written for the previous release: the teacher reads the
    reference text without OPSD's template."""

    def teacher_context_ids(self, texts):
        self.seen = list(texts)
        return self.teacher.encode_text_context(texts, prefix="", suffix="")


def test_a_teacher_context_ids_override_is_what_the_teacher_reads():
    module = PlainReferenceOPSD("tiny", lora=None, max_new_tokens=8, learning_rate=1e-3)
    task = ToyTask()
    examples = task.all_examples()[:2]
    conversations = [[*task.initial_messages(ex), {"role": "assistant", "content": "x"}] for ex in examples]
    batch = batch_from_conversations(module.tokenizer, conversations, rewards=[0.0, 0.0], group_ids=[0, 1],
                                     example_ids=[ex.id for ex in examples])
    module.reference_texts = lambda batch: ["the answer", None]
    given = {}
    teacher_pass = module.teacher.logits_on_student_positions

    def recorded(*args, **kwargs):
        given["context_ids"] = kwargs["context_ids"]
        return teacher_pass(*args, **kwargs)

    module.teacher.logits_on_student_positions = recorded
    optimizer = torch.optim.AdamW(module.student_parameters(), lr=1e-3)
    module.optimizers = lambda: optimizer
    module.manual_backward = lambda loss: loss.backward()  # no Trainer
    module.log_rollout_metrics = lambda batch, metrics: None
    module.training_step(batch, 0)
    assert module.seen == ["the answer", None]  # the reference texts, before the template
    assert given["context_ids"] == module.teacher.encode_text_context(["the answer", None], prefix="", suffix="")
    assert given["context_ids"] != OPSDModule.teacher_context_ids(module, ["the answer", None])  # not the template's


# ------------------------------------------------------- privileged_context: retrieved (the bank's nearest trace)
def copy_bank(folder, task: ToyTask):
    """A hand-built bank (hashing embedder) where every train example's nearest record is known: per distinct
    task text of the train split (toy examples may share one), a record of another task (``copy/<i>``) with
    that text, so cosine 1 with the query, and the trace ``solved: <text>``."""
    bank = ExperienceBank(get_embedder("hashing"))
    texts = sorted({ex.text for ex in task.examples("train")})
    records = [Experience(task_id=f"copy/{i}", task_text=t, trace=f"solved: {t}", reward=1.0) for i, t in enumerate(texts)]
    assert bank.add(records) == len(records) > 1
    bank.save(folder)
    return folder


def test_retrieved_context_is_the_framed_trace_of_the_nearest_experience_and_a_fit_trains(tmp_path):
    bank = copy_bank(tmp_path / "bank", ToyTask())
    module = make_module(lora=LORA, privileged_context="retrieved", bank_path=str(bank), embedder="hashing")
    assert len(module.bank) == len({ex.text for ex in ToyTask().examples("train")}) and not module.bank.allow_self_retrieval
    teacher_ids = []
    insert = module.teacher.insert_context

    def record_insert(*args, **kwargs):
        out = insert(*args, **kwargs)
        teacher_ids.append(out.input_ids.clone())
        return out

    module.teacher.insert_context = record_insert
    seen = []

    class Rec(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((batch, {k: float(v) for k, v in trainer.callback_metrics.items()}))

    student_before = [p.detach().clone() for p in module.student_parameters()]
    dm = OnPolicyDataModule(ToyTask(), examples_per_step=2, val_limit=2, val_batch_size=2)
    quiet_trainer(tmp_path, max_steps=2, callbacks=[Rec()]).fit(module, dm)
    assert module.global_step == 2 and len(seen) == len(teacher_ids) == 2
    assert not all(torch.equal(a, p) for a, p in zip(student_before, module.student_parameters(), strict=True))
    for (batch, logged), ids in zip(seen, teacher_ids, strict=True):
        assert logged["train/rows_with_reference"] == 1.0 and logged["train/loss"] > 0
        contexts = module.teacher_contexts(batch)
        for b, example_id in enumerate(batch.example_ids):
            trace = f"solved: {dm.example(example_id).text}"  # the copy of the row's task text
            assert [e.trace for e in batch.experiences[b]] == [trace]
            text = ("Here is a reference example of a different, already solved task:\n" + trace
                    + "\nNow complete your task.\n\n")
            assert text == DEFAULT_FRAMING_PREFIX + trace + DEFAULT_FRAMING_SUFFIX and contexts.texts[b] == text
            framed = module.tokenizer(text, add_special_tokens=False)["input_ids"]
            # what benchmarks/privileged_margin.py's text_nearest gives the same row
            assert module.context_ids(contexts)[b] == framed == module.teacher.encode_text_context([trace])[0]
            # the teacher's row is the student's with the framed trace at the context position
            student_row, teacher_row = batch.input_ids[b].tolist(), ids[b].tolist()
            pos, n = int(batch.context_position[b]), int(batch.attention_mask[b].sum())
            assert teacher_row[pos : pos + len(framed)] == framed
            assert teacher_row[:pos] + teacher_row[pos + len(framed) : n + len(framed)] == student_row[:n]
            reference = OPSD_REFERENCE_TEMPLATE.format(reference=ToyTask().reference_solution(dm.example(example_id)))
            assert not contains(teacher_row, module.tokenizer(reference, add_special_tokens=False)["input_ids"])


def test_the_default_context_is_still_the_reference_and_a_row_that_retrieves_nothing_gets_no_context(tmp_path):
    task = ToyTask()
    examples = task.all_examples()[:2]
    conversations = [[*task.initial_messages(ex), {"role": "assistant", "content": "x"}] for ex in examples]
    default = make_module(bank_path=str(copy_bank(tmp_path / "bank", task)))  # reference: the bank is not read
    assert default.hparams.privileged_context == "reference" and default.bank is None
    assert default.retrieve(task, examples) is None
    batch = batch_from_conversations(default.tokenizer, conversations, rewards=[0.0, 0.0], group_ids=[0, 1],
                                     example_ids=[ex.id for ex in examples])
    default.reference_texts = lambda batch: ["the answer", None]
    contexts = default.teacher_contexts(batch)
    assert contexts.texts == [OPSD_REFERENCE_TEMPLATE.format(reference="the answer"), None]
    assert contexts.references == ["the answer", None]

    only_first = ExperienceBank(get_embedder("hashing"))  # the first example's own record only
    only_first.add([Experience(task_id=examples[0].id, task_text=examples[0].text, trace="own", reward=1.0)])
    only_first.save(tmp_path / "own")
    module = make_module(privileged_context="retrieved", bank_path=str(tmp_path / "own"), embedder="hashing")
    batch.experiences = module.retrieve(task, examples)  # row 0: its own record is not retrieved; row 1: another task's
    assert [[e.trace for e in exps] for exps in batch.experiences] == [[], ["own"]]
    contexts = module.teacher_contexts(batch)
    assert contexts.texts == [None, DEFAULT_FRAMING_PREFIX + "own" + DEFAULT_FRAMING_SUFFIX]
    assert contexts.kept.tolist() == [False, True] and contexts.references is None


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        ({"privileged_context": "retreived"}, ValueError,
         r"^model.init_args.privileged_context 'retreived' is not a context; did you mean 'retrieved'\? "
         r"choose one of reference, retrieved$"),
        ({"privileged_context": "retrieved"}, ValueError,
         r"^model.init_args.privileged_context 'retrieved' needs a bank to retrieve from and "
         r"model.init_args.bank_path is null; build one with `lopd build-memory -c CONFIG --from-references` "
         r"and set model.init_args.bank_path to its folder$"),
        ({"privileged_context": "retrieved", "bank_path": "BANK", "embedder": "hashng"}, ValueError,
         r"^model.init_args.embedder 'hashng' is not an embedder; did you mean 'hashing'\?"),
        ({"privileged_context": "retrieved", "bank_path": "NONE"}, FileNotFoundError,
         r"^model.init_args.bank_path '.*none' holds no experience bank \(privileged_context: retrieved reads it\); "
         r"build one with `lopd build-memory"),
        ({"privileged_context": "retrieved", "bank_path": "EMPTY"}, ValueError,
         r"^the bank at model.init_args.bank_path '.*empty' is empty, so no row would get a context"),
    ],
)
def test_privileged_context_options_are_refused_in_one_line_before_the_weights_load(tmp_path, overrides, error, message):
    ExperienceBank(get_embedder("hashing")).save(tmp_path / "empty")
    copy_bank(tmp_path / "bank", ToyTask())
    folders = {"BANK": tmp_path / "bank", "NONE": tmp_path / "none", "EMPTY": tmp_path / "empty"}
    if "bank_path" in overrides:
        overrides = {**overrides, "bank_path": str(folders[overrides["bank_path"]])}
    with pytest.raises(error, match=message) as info:
        OPSDModule("no-such-model", **overrides)  # a model that cannot load: the check runs first
    assert "\n" not in str(info.value)


def test_build_memory_builds_the_bank_of_an_opsd_config_that_retrieves(tmp_path, capsys):
    """An OPSD config with privileged_context: retrieved and a bank_path that does not exist yet: build-memory
    (rollouts: the whole module, built without the bank; --from-references: its hooks) writes the bank it reads."""
    config = tmp_path / "opsd.yaml"
    bank = tmp_path / "bank"
    config.write_text(yaml.safe_dump({
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 1},
        "model": {"class_path": "lopd_lightning.modules.OPSDModule", "init_args": {
            "model": "tiny", "max_new_tokens": 8, "privileged_context": "retrieved", "embedder": "hashing",
            "bank_path": str(bank)}},
        "data": {"class_path": "lopd_lightning.data.OnPolicyDataModule", "init_args": {"task": "toy"}},
    }))
    assert main(["build-memory", "-c", str(config), "--limit", "2", "--rollouts", "1", "--min-reward", "0"]) == 0
    assert len(ExperienceBank.load(bank, get_embedder("hashing"))) == 2
    assert main(["build-memory", "-c", str(config), "--from-references"]) == 0
    assert "bank: 24 experiences from 24 train examples (reference solutions)" in capsys.readouterr().out
    module = OPSDModule("tiny", privileged_context="retrieved", bank_path=str(bank), embedder="hashing")
    assert len(module.bank) == 24


def test_lopd_fit_prints_the_privileged_context_refusals_in_one_line(capsys, no_model_loading):
    configs = ["-c", str(CONFIGS / "compare_tiny" / "common.yaml"), "-c", str(CONFIGS / "compare_tiny" / "opsd.yaml")]
    code, err = run_main(["fit", *configs, "--model.init_args.privileged_context=retreived"], capsys)
    assert code == 1
    assert_one_line_error(err, "model.init_args.privileged_context 'retreived' is not a context; did you mean "
                               "'retrieved'? choose one of reference, retrieved")
    code, err = run_main(["fit", *configs, "--model.init_args.privileged_context=retrieved"], capsys)
    assert code == 1
    assert_one_line_error(err, "model.init_args.privileged_context 'retrieved' needs a bank to retrieve from and "
                               "model.init_args.bank_path is null; build one with `lopd build-memory -c CONFIG "
                               "--from-references` and set model.init_args.bank_path to its folder")
