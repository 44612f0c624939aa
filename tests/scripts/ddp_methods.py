"""Two-process DDP run of one method on the tiny model (gloo, CPU), for tests/test_ddp.py.

    python tests/scripts/ddp_methods.py --method {lopd,grpo,sdpo,opsd,skill_sd,sft} --out DIR [--steps 2]

Lightning's DDP launcher re-runs this script for rank 1. Each rank writes ``DIR/rank_<r>.pt``: per step
the batch it trained on, the student's gradients as the optimiser saw them (after DDP's all-reduce;
clipping off) and, for LOPD, the composer's gradients, the logged margin, beta, and the bank's ids and
embeddings after the refresh. ``--checkpoint-every N`` adds a ``ModelCheckpoint(every_n_train_steps=N,
save_last=True)`` writing into ``DIR/ckpt``. With ``--single`` the same module trains one step in one process on the
batch ``DIR/combined.pt`` (both ranks' first batches together), the reference for "the DDP gradient
equals one large batch's".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lopd_lightning.modules.lopd_callbacks import MemoryRefresh
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.lm import base_model
from lopd_lightning.memory import Experience
from lopd_lightning.modules import GRPOModule, LOPDModule, OPSDModule, OnPolicyModule, SDPOModule, SFTModule, SkillSDModule
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared toy tasks
from helpers import EvenToy, ParityToy  # noqa: E402

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
#: settings every method shares: a LoRA student, no clipping (the gradients are compared raw)
COMMON = dict(lora=LORA, max_new_tokens=8, learning_rate=1e-3, seed=0, grad_clip=0.0)
METHODS = ("lopd", "grpo", "sdpo", "opsd", "skill_sd", "sft")


def build_module(method: str, model: str = "tiny", *, eos_bias: bool = True, **overrides) -> OnPolicyModule:
    """The method's module on ``model`` (the tiny model; tests/scripts/ddp_vllm_methods.py: a folder) with
    :data:`COMMON` settings (``overrides`` replace some: tests/scripts/fsdp_methods.py trains a full-parameter
    student with ``lora=None``); ``eos_bias``: the LM head gets a +2 bias on the EOS logit (below)."""
    L.seed_everything(0)
    settings = {**COMMON, **overrides}
    if method == "lopd":
        module = LOPDModule(
            model, group_size=2, num_latents=4, num_experiences=2, composer_depth=2,
            max_experience_tokens=64, embedder="hashing", distill_top_k=8, composer_lr=1e-3, margin=0.3,
            composer_clip_compressor=1e9, composer_clip_lora=1e9, **settings,
        )
        task = EvenToy()
        records = []
        for ex in task.examples("train")[:4]:
            messages = [*task.initial_messages(ex), {"role": "assistant", "content": task.reference_solution(ex)}]
            records.append(Experience(task_id=ex.id, task_text=ex.text, trace=task.experience_text(ex, messages), reward=1.0))
        module.bank.add(records)
    elif method == "grpo":
        module = GRPOModule(model, group_size=2, **settings)
    elif method == "sdpo":
        module = SDPOModule(model, group_size=2, distill_top_k=8, **settings)
    elif method == "opsd":
        module = OPSDModule(model, **settings)
    elif method == "skill_sd":
        module = SkillSDModule(model, group_size=2, skill_refresh_every=0, skill_max_new_tokens=8, **settings)
    elif method == "sft":
        module = SFTModule(model, **settings)
    else:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    if not eos_bias:
        return module
    # a +2 bias on the EOS logit: replies end at varied lengths, so the ranks hold different numbers of
    # assistant tokens and the global-token normalisation is actually tested
    inner = base_model(module.backbone)
    old = inner.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[inner.config.eos_token_id] = 2.0
    head.requires_grad_(False)
    inner.lm_head = head
    return module


def task_for(method: str):
    # group methods need rewards that vary inside a group (else every advantage is 0); LOPD's bank and
    # SFT/OPSD need nothing more than the toy's references
    return EvenToy() if method == "lopd" else ParityToy()


class Capture(Callback):
    """Per step: the batch, the gradients the optimisers see, the logged margin, beta and the bank."""

    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append({"batch": batch, "beta_before": getattr(pl_module, "beta", None)})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # the student's optimiser goes through Lightning (this hook); LOPD's composer optimiser does
        # not, so its gradients (already all-reduced by then: both backward passes ran) are read here too
        self.steps[-1]["student_grads"] = [
            p.grad.detach().clone() if p.grad is not None else None for p in pl_module.student_parameters()
        ]
        if isinstance(pl_module, LOPDModule):
            self.steps[-1]["composer_grads"] = [
                p.grad.detach().clone() if p.grad is not None else None for p in pl_module.composer.trainable_parameters()
            ]
        # every trainable parameter of the module, as DDP sees it
        self.steps[-1]["trainable"] = sorted(n for n, p in pl_module.named_parameters() if p.requires_grad)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[-1].update(
            loss=float(trainer.callback_metrics["train/loss"]),
            rollouts_consumed=pl_module.rollouts_consumed,
            num_loss_tokens=float(pl_module.num_loss_tokens(batch)),
            params=[p.detach().clone() for p in pl_module.student_parameters()],
        )
        if trainer.checkpoint_callback is not None:  # (--checkpoint-every) by name, as a checkpoint holds them
            names = {id(p): n for n, p in pl_module.named_parameters()}
            self.steps[-1]["weights"] = {names[id(p)]: p.detach().clone() for p in pl_module.student_parameters()}
        if isinstance(pl_module, LOPDModule):
            bank = pl_module.bank
            self.steps[-1].update(
                beta_after=pl_module.beta,
                margin_delta=float(trainer.callback_metrics["train/margin_delta"]),
                bank_ids=[r.task_id for r in bank.records],
                bank_traces=[r.trace for r in bank.records],
                bank_embeddings=torch.as_tensor(bank.embeddings).clone(),
            )


STUDENTS = ("lora", "full")
MAX_NORM = 1e9  #: the clip is on (its norm is compared) but never scales: the gradients are compared raw


def build_student_module(method: str, student: str) -> OnPolicyModule:
    """:func:`build_module` with a LoRA or full-parameter student, the clip on (the FSDP scripts' module)."""
    return build_module(method, grad_clip=MAX_NORM, **({"lora": None} if student == "full" else {}))


class StepCapture(Callback):
    """Per step (tests/scripts/fsdp_methods.py, fsdp2_methods.py): the batch, the loss, the logged grad norm
    and the trainable weights after the step, as :meth:`params` reads them (a subclass says how)."""

    def __init__(self):
        self.steps: list[dict] = []

    def params(self, trainer, pl_module):
        raise NotImplementedError

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append({"batch": batch})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[-1].update(
            loss=float(trainer.callback_metrics["train/loss"]),
            grad_norm=float(trainer.callback_metrics["train/grad_norm"]),
            params=self.params(trainer, pl_module),
        )


def replay_first(combined, steps: int):
    """The ``--single`` run on one combined batch: ``(make_batch, max_steps)``, one step."""
    return (lambda task, examples: combined), 1


def replay_each(combined, steps: int):
    """The ``--single`` run on a list of combined batches: step k trains on the k-th, ``steps`` steps."""
    batches = list(combined)
    return (lambda task, examples: batches.pop(0)), steps


def main_runs(build, capture_class, strategy, replay) -> None:
    """``main()`` of tests/scripts/fsdp_methods.py and fsdp2_methods.py:

        --out DIR [--runs method:student,...] [--steps 2] [--single]

    Each run (one after another in the same processes) builds ``build(method, student)`` and a
    ``capture_class()`` callback and trains ``--steps`` steps on 2 processes with ``strategy()``, each rank
    saving its capture's steps to ``DIR/<method>_<student>_rank_<r>.pt``; with ``--single`` it trains in one
    process on ``DIR/<method>_<student>_combined.pt``, ``replay(combined, steps)`` giving the module's
    ``make_batch`` and the ``max_steps``, and saves ``DIR/<method>_<student>_single.pt``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", default=",".join(f"{m}:{s}" for m in METHODS for s in STUDENTS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--single", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for run in args.runs.split(","):
        method, student = run.split(":")
        module = build(method, student)
        capture = capture_class()
        dm = OnPolicyDataModule(task_for(method), examples_per_step=2, val_limit=4, val_batch_size=4)
        common = dict(accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(args.out))
        if args.single:
            combined = torch.load(args.out / f"{method}_{student}_combined.pt", weights_only=False)
            module.make_batch, max_steps = replay(combined, args.steps)
            trainer = L.Trainer(max_steps=max_steps, devices=1, callbacks=[capture], **common)
            trainer.fit(module, dm)
            torch.save(capture.steps, args.out / f"{method}_{student}_single.pt")
            continue
        parallel = strategy()
        callbacks = [MemoryRefresh(every_n_steps=1), capture] if method == "lopd" else [capture]
        trainer = L.Trainer(max_steps=args.steps, devices=2, strategy=parallel, callbacks=callbacks, **common)
        trainer.fit(module, dm)
        torch.save(capture.steps, args.out / f"{method}_{student}_rank_{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="N > 0: a ModelCheckpoint(every_n_train_steps=N, save_last=True) into DIR/ckpt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    module = build_module(args.method)
    capture = Capture()
    dm = OnPolicyDataModule(task_for(args.method), examples_per_step=2, val_limit=4, val_batch_size=4)
    common = dict(accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(args.out))
    if args.single:
        combined = torch.load(args.out / "combined.pt", weights_only=False)
        module.make_batch = lambda task, examples: combined  # the DataModule asks the module for the batch
        trainer = L.Trainer(max_steps=1, devices=1, callbacks=[capture], **common)
        trainer.fit(module, dm)
        torch.save(capture.steps, args.out / "single.pt")
        return
    callbacks = [MemoryRefresh(every_n_steps=1), capture] if args.method == "lopd" else [capture]
    if args.checkpoint_every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        common["enable_checkpointing"] = True
        callbacks.append(ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=args.checkpoint_every,
                                         save_last=True, save_top_k=0))
    trainer = L.Trainer(max_steps=args.steps, devices=2, strategy="ddp", callbacks=callbacks, **common)
    trainer.fit(module, dm)
    torch.save(capture.steps, args.out / f"rank_{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
