"""SDPOModule: a one-step fit, the sibling choice of the teacher's context, the loss against a naive
recomputation, the EMA teacher's update, and the early G >= 2 check.

Everything runs on the tiny random Llama (``model: tiny``) and the toy task, on CPU, in seconds.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.losses import generalized_jsd, topk_tail_reverse_kl
from lopd_lightning.modules.sdpo import (
    SDPO_CONTEXT_SUFFIX,
    SDPO_DEMO_TEMPLATE,
    SDPOContexts,
    SDPOModule,
    successful_sibling,
)
from lopd_lightning.modules.self_distillation import SelfDistillationModule, TeacherContexts
from lopd_lightning.rollout import batch_from_conversations
from lopd_lightning.tasks import Example
from lopd_lightning.tasks.toy import ToyTask
from lopd_lightning.teacher import SelfTeacher

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


class AlwaysToy(ToyTask):
    """The toy task where every reply succeeds (every row has a successful sibling)."""

    def score(self, example: Example, completion: str) -> float:
        return 1.0


def make_module(**overrides) -> SDPOModule:
    options = dict(group_size=4, max_new_tokens=8, distill_top_k=8, learning_rate=1e-3)
    options.update(overrides)
    return SDPOModule("tiny", **options)


def make_trainer(root, callbacks=()) -> L.Trainer:
    return L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(root), callbacks=list(callbacks),
    )


def hand_batch(tokenizer, rewards, group_ids):
    """One row per reward: a user turn and the reply "reply <i>" (distinct per row)."""
    conversations = [
        [{"role": "user", "content": "Repeat the word: apple"}, {"role": "assistant", "content": f"reply {i}"}]
        for i in range(len(rewards))
    ]
    return batch_from_conversations(
        tokenizer, conversations, rewards=rewards, group_ids=group_ids, example_ids=[f"toy/{g}" for g in group_ids]
    )


def test_group_size_below_two_raises_before_loading():
    with pytest.raises(ValueError, match="group_size"):
        SDPOModule("no-such-model", group_size=1)


def test_successful_sibling_choice():
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 0, 1, 0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    # group 0: successes 0 and 3 demonstrate to each other, the failures get the first success (0)
    # group 1: no success; group 2: row 8 is the only success (no demo unless allow_self)
    assert successful_sibling(rewards, groups, success_threshold=1.0) == [3, 0, 0, 0, None, None, None, None, None, 8]
    with_self = successful_sibling(rewards, groups, success_threshold=1.0, allow_self=True)
    assert with_self == [3, 0, 0, 0, None, None, None, None, 8, 8]


def test_teacher_context_uses_successful_siblings_only():
    module = make_module()
    batch = hand_batch(module.tokenizer, [1.0, 0, 0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1])
    contexts = module.teacher_contexts(batch)
    assert isinstance(contexts, SDPOContexts) and isinstance(contexts, TeacherContexts)
    texts, has_demo, kept = contexts.texts, contexts.has_demo, contexts.kept
    demo = lambda i: SDPO_DEMO_TEMPLATE.format(demo=f"reply {i}") + SDPO_CONTEXT_SUFFIX  # noqa: E731
    assert texts[:4] == [demo(3), demo(0), demo(0), demo(0)]  # self excluded: row 0 sees row 3
    assert texts[4:] == [None] * 4  # a group without success: no context
    assert has_demo.tolist() == kept.tolist() == [True] * 4 + [False] * 4
    joined = "".join(t for t in texts if t)
    assert "reply 1" not in joined and "reply 2" not in joined  # failures never demonstrate
    assert "reply 3" not in texts[3]


def test_feedback_of_the_rows_own_attempt():
    module = make_module()
    conv = lambda i: [  # noqa: E731
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": f"try {i}"},
        {"role": "tool", "content": f"hint {i}"},
        {"role": "assistant", "content": f"answer {i}"},
    ]
    batch = batch_from_conversations(
        module.tokenizer, [conv(0), conv(1)], rewards=[1.0, 0.0], group_ids=[0, 0], example_ids=["a", "a"]
    )
    batch.metadata[1]["errors"] = ["bad call"]
    contexts = module.teacher_contexts(batch)
    texts, kept = contexts.texts, contexts.kept
    assert texts[0] is None and kept.tolist() == [False, True]  # row 0 is the only success
    assert "[action] try 0\n[result] hint 0\n[action] answer 0" in texts[1]
    assert "hint 1\nerror: bad call" in texts[1]
    module.hparams.include_feedback = False
    assert "hint 1" not in module.teacher_contexts(batch).texts[1]


def naive_inputs(module: SDPOModule, batch, texts):
    """Per kept row, student and teacher logits at its assistant positions, computed row by row."""
    student, teacher = [], []
    _, mask = module.shifted(batch)
    for b, text in enumerate(texts):
        if text is None:
            continue
        n = int(batch.attention_mask[b].sum())
        ids = batch.input_ids[b, :n]
        pos = int(batch.context_position[b])
        ctx = torch.tensor(module.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        with torch.no_grad():
            s = module.backbone(input_ids=ids[None]).logits[0]  # [n, V]
            t = module.teacher.shadow(input_ids=torch.cat([ids[:pos], ctx, ids[pos:]])[None]).logits[0]
        where = mask[b, : n - 1].nonzero().flatten()  # shifted positions t predict token t+1
        assert bool((where >= pos).all())
        student.append(s[where])
        teacher.append(t[where + len(ctx)])
    return torch.cat(student)[None], torch.cat(teacher)[None]


def run_step(module, batch):
    """training_step without a Trainer: capture the loss and the logged values."""
    captured = {}
    optimizer = torch.optim.AdamW(module.student_parameters(), lr=1e-3)
    module.optimizers = lambda: optimizer
    module.manual_backward = lambda loss: (captured.setdefault("loss", loss.detach().clone()), loss.backward())
    module.log_rollout_metrics = lambda batch, metrics: captured.update(metrics)
    module.training_step(batch, 0)
    return captured


@pytest.mark.parametrize("divergence", ["topk_reverse_kl", "jsd"])
def test_loss_equals_naive_divergence_over_kept_rows(divergence):
    module = make_module(lora=None, divergence=divergence, jsd_beta=0.3)
    # perturb the student so that the EMA teacher (a copy at init) differs from it beyond the context
    with torch.no_grad():
        for p in module.student_parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = hand_batch(module.tokenizer, [1.0, 0, 0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1])
    contexts = module.teacher_contexts(batch)
    texts, kept = contexts.texts, contexts.kept
    student, teacher = naive_inputs(module, batch, texts)
    if divergence == "jsd":
        expected = generalized_jsd(student, teacher, beta=0.3).sum() / student.shape[1]
    else:
        # SDPO's support: the student's top-k
        expected = topk_tail_reverse_kl(student, teacher, top_k=8, support="student").sum() / student.shape[1]
    _, mask = module.shifted(batch)
    assert student.shape[1] == int((mask & kept[:, None]).sum())  # the kept rows' tokens only
    logged = run_step(module, batch)
    assert float(logged["loss"]) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
    assert float(expected) > 0
    assert logged["train/rows_with_demo"] == pytest.approx(0.5)
    assert logged["train/groups_without_success"] == pytest.approx(0.5)


def test_no_kept_row_gives_a_zero_loss_that_still_steps():
    module = make_module(lora=None)
    batch = hand_batch(module.tokenizer, [0.0, 0, 0, 0], [0, 0, 0, 0])
    logged = run_step(module, batch)
    assert float(logged["loss"]) == 0.0 and logged["train/rows_with_demo"] == 0.0


def test_one_step_fit_logs_tags_and_moves_the_ema_teacher(tmp_path):
    module = make_module(lora=LORA)
    pairs = module.teacher.ema_parameter_pairs()
    assert pairs
    seen = {}

    class Rec(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["ema_before"] = [e.detach().clone() for e, _ in pairs]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["logged"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
            seen["batch"] = batch

    dm = OnPolicyDataModule(AlwaysToy(), examples_per_step=2, val_limit=2, val_batch_size=2)
    make_trainer(tmp_path, [Rec()]).fit(module, dm)
    assert module.global_step == 1
    assert len(seen["batch"]) == 8  # 2 examples x G = 4
    logged = seen["logged"]
    for tag in ["train/loss", "train/rows_with_demo", "train/groups_without_success",
                "train/grad_norm", "train/reward_mean", "time/teacher", "time/student_step", "time/generation"]:
        assert tag in logged, tag
    assert logged["train/rows_with_demo"] == 1.0 and logged["train/groups_without_success"] == 0.0
    assert logged["train/loss"] > 0
    # ema_after = 0.95 ema_before + 0.05 student_after, for one parameter the student moved
    moved = [i for i, (e, s) in enumerate(pairs) if not torch.equal(seen["ema_before"][i], s.detach())]
    assert moved, "the student did not move"
    i = moved[0]
    ema, student = pairs[i]
    expected = 0.95 * seen["ema_before"][i] + 0.05 * student.detach()
    torch.testing.assert_close(ema.detach(), expected)
    assert not torch.equal(ema.detach(), seen["ema_before"][i])  # it moved towards the student


def test_a_divergence_sdpo_does_not_take_fails_before_loading():
    with pytest.raises(ValueError, match=r"divergence must be one of 'topk_reverse_kl', 'jsd', got 'forward_kl'"):
        SDPOModule("no-such-model", divergence="forward_kl")


# ------------------------------------------------------------------------------ the shared skeleton
class HintedDistillation(SelfDistillationModule):
    """A method of its own on the skeleton: the frozen base reads a fixed hint on the even rows, every kept
    token weighs 2, and the hooks record that they ran."""

    HINT = "Hint: answer briefly.\n\n"

    def __init__(self, model="tiny", **kwargs):
        super().__init__(model, **kwargs)
        self.teacher = SelfTeacher(self.backbone, self.tokenizer, mode="base")
        self.updates = 0

    def teacher_contexts(self, batch):
        texts = [self.HINT if i % 2 == 0 else None for i in range(len(batch))]
        kept = torch.tensor([t is not None for t in texts], dtype=torch.bool)
        return TeacherContexts(texts=texts, kept=kept)

    def token_weights(self, batch, student_logits, targets):
        assert student_logits.shape[0] == targets.shape[0]
        return torch.full((targets.shape[0],), 2.0)

    def distillation_metrics(self, batch, contexts):
        return {"train/rows_hinted": self.row_fraction(contexts.kept, batch)}

    def after_update(self):
        self.updates += 1


def test_a_subclass_with_its_own_teacher_contexts_and_weights_trains_on_the_skeleton():
    module = HintedDistillation(lora=None, max_new_tokens=8, divergence="forward_kl", learning_rate=1e-3)
    with torch.no_grad():  # the student differs from the frozen teacher beyond the context
        for p in module.student_parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = hand_batch(module.tokenizer, [0.0, 1.0, 0.0, 1.0], [0, 0, 1, 1])
    texts = module.teacher_contexts(batch).texts
    student, teacher = naive_inputs(module, batch, texts)  # the even rows' tokens, the hint in the teacher
    expected = 2.0 * generalized_jsd(student, teacher, beta=0.0).sum() / student.shape[1]
    logged = run_step(module, batch)
    assert float(expected) > 0
    assert float(logged["loss"]) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
    assert logged["train/rows_hinted"] == pytest.approx(0.5) and "train/loss" in logged
    assert module.updates == 1


# ------------------------------------------------------------------------------ the hook's return type
@pytest.mark.parametrize("returned, name", [(["a text"], "list"), ((["a text"], None, None), "tuple")])
def test_a_teacher_contexts_override_returning_something_else_is_a_type_error(returned, name):
    module = make_module(lora=None)
    module.teacher_contexts = lambda batch: returned
    batch = hand_batch(module.tokenizer, [1.0, 0], [0, 0])
    with pytest.raises(TypeError, match=f"SDPOModule.teacher_contexts must return a TeacherContexts record, got {name}"):
        run_step(module, batch)


@pytest.mark.parametrize(
    "options, message",
    [({"topk_support": "both"}, r"topk_support must be 'student' or 'teacher', got 'both'; set model.init_args.topk_support to student"),
     ({"distill_temperature": 0.0}, r"distill_temperature must be > 0, got 0.0; set model.init_args.distill_temperature to a positive"),
     ({"distill_temperature": float("nan")}, r"distill_temperature must be > 0, got nan; set model.init_args.distill_temperature")],
)
def test_the_skeletons_checks_name_their_keys_and_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        SDPOModule("no-such-model", **options)
