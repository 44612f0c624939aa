"""Compute (and, run as a script, rewrite) the pinned step values of tests/test_pinned_steps.py.

    python tests/scripts/pin_steps.py            # rewrites tests/pinned/step_values.json and fit_values.json
    python tests/scripts/pin_steps.py --check    # prints the largest relative differences, writes nothing

Two kinds of values, float32 on CPU with one torch thread:

* ``teacher_forced_values()``: per method, the loss pieces of one fixed teacher-forced batch (no generation) through
  the method's own public functions: GRPO (``step_inputs`` / ``loss_terms``, at the pass-1 ratio and at shifted old
  log-probs), SDPO and OPSD (``teacher_contexts`` / ``teacher_logits`` / ``student_forward`` / ``distillation_loss``),
  Skill-SD (``loss_terms`` with a skill), SFT (the masked NLL of its step) and LOPD (``LOPDModule.losses``, with
  experiences from a hand-built bank of the toy task's reference solutions).
* ``fit_values()``: per method, the logged values after each of 2 steps of a seeded tiny-model ``fit`` on the toy
  task whose reward is the parity of the reply's character codes (``tests/helpers.ParityToy``: rewards vary within
  a group), SFT on the toy task's references (LOPD: configs/tiny.yaml's module with its shipped bank
  configs/tiny_bank/).

The test module's docstring says when regenerating is legitimate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PINNED = ROOT / "tests" / "pinned"
STEP_VALUES = PINNED / "step_values.json"
FIT_VALUES = PINNED / "fit_values.json"
TINY_BANK = ROOT / "configs" / "tiny_bank"
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
SKILL = "Answer with the requested word only, nothing else."

# the logged tags pinned after each fit step
FIT_TAGS = {
    "lopd": ["train/loss", "train/reward_mean", "train/beta", "train/margin_delta", "train/composer_loss"],
    "grpo": ["train/loss", "train/reward_mean", "train/clip_fraction"],
    "sdpo": ["train/loss", "train/reward_mean"],
    "opsd": ["train/loss", "train/reward_mean"],
    "skill_sd": ["train/loss", "train/reward_mean", "train/sdl"],
    "sft": ["train/loss", "train/reward_mean"],
}
FIT_STEPS = 2


def _f(x) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


# ------------------------------------------------------------------------------ teacher-forced batch
def _toy_batch(tokenizer, *, group_size: int = 2, n_examples: int = 2):
    """A fixed batch: ``n_examples`` toy examples x ``group_size`` hand-written replies, rewards 1/0 alternating."""
    from lopd_lightning.modules.base import OnPolicyModule
    from lopd_lightning.rollout import batch_from_conversations
    from lopd_lightning.tasks.toy import ToyTask

    task = ToyTask()
    examples = task.examples("train")[:n_examples]
    conversations, rewards, groups, ids = [], [], [], []
    for e, ex in enumerate(examples):
        for i in range(group_size):
            reply = task.reference_solution(ex) if i % 2 == 0 else f"wrong {e}{i}"
            conversations.append([*task.initial_messages(ex), {"role": "assistant", "content": reply}])
            rewards.append(1.0 if i % 2 == 0 else 0.0)
            groups.append(e)
            ids.append(ex.id)
    batch = batch_from_conversations(tokenizer, conversations, rewards=rewards, group_ids=groups, example_ids=ids)
    OnPolicyModule.annotate(batch, examples)
    return task, examples, batch


def _hand_bank(task, examples, batch, per_row: int = 2):
    """Per row, ``per_row`` reference experiences of other train examples (a small hand-built bank)."""
    from lopd_lightning.memory import Experience

    others = [ex for ex in task.examples("train") if ex.id not in {e.id for e in examples}][: per_row * len(examples)]
    bank = []
    for ex in others:
        messages = [*task.initial_messages(ex), {"role": "assistant", "content": task.reference_solution(ex)}]
        bank.append(Experience(task_id=ex.id, task_text=ex.text, trace=task.experience_text(ex, messages), reward=1.0))
    index = {ex.id: i for i, ex in enumerate(examples)}
    return [bank[per_row * index[eid]: per_row * (index[eid] + 1)] for eid in batch.example_ids]


def _perturb(module, scale: float = 0.05) -> None:
    """Move the student's trainable weights (seeded) so that it differs from its frozen teacher."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.student_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def _grpo_like(module, batch) -> dict[str, float]:
    inputs = module.step_inputs(batch)
    logps = module.student_logps(batch, temperature=module.hparams.logps_temperature)
    same = module.loss_terms(logps, logps.detach(), inputs)
    # old log-probs shifted by a fixed +-0.3 pattern: ratios outside the clip range, a non-zero clip fraction
    sign = torch.where(torch.arange(logps.shape[-1]) % 2 == 0, 1.0, -1.0)
    old = (logps.detach() + 0.3 * sign) * inputs.mask
    shifted = module.loss_terms(logps, old, inputs)
    out = {f"ratio1/{k}": _f(v) for k, v in same.items()}
    out.update({f"shifted_old/{k}": _f(v) for k, v in shifted.items()})
    out["advantage_abs_mean"] = _f(inputs.metrics["train/advantage_abs_mean"])
    out["sum_logps"] = _f(logps.sum())
    return out


def _self_distillation(module, batch) -> dict[str, float]:
    _, mask = module.shifted(batch)
    contexts = module.teacher_contexts(batch)
    kept_mask = mask & contexts.kept[:, None]
    num_tokens = module.num_loss_tokens(batch, kept_mask)
    teacher = module.teacher_logits(batch, contexts, kept_mask)
    student = module.student_forward(batch, mask).values
    loss = module.distillation_loss(batch, student, teacher, contexts.kept, num_tokens)
    return {"loss": _f(loss), "kept_rows": _f(contexts.kept.sum()), "num_tokens": float(num_tokens)}


def _build(cls, **options):
    torch.set_num_threads(1)
    torch.manual_seed(0)  # LoRA's and the composer's initialisation draw from the global generator
    return cls("tiny", lora=LORA, **options)


def _tf_grpo() -> dict[str, float]:
    """GRPO with a reference (kl_coef > 0), the student moved away from it."""
    from lopd_lightning.modules import GRPOModule

    module = _build(GRPOModule, group_size=2, kl_coef=0.1)
    _perturb(module)
    _, _, batch = _toy_batch(module.tokenizer)
    return _grpo_like(module, batch)


def _tf_skill_sd() -> dict[str, float]:
    """Skill-SD: GRPO + the SDL to the skill-conditioned teacher (the first example's rows have the skill)."""
    from lopd_lightning.modules import SkillSDModule

    module = _build(SkillSDModule, group_size=2)
    _perturb(module)
    _, _, batch = _toy_batch(module.tokenizer)
    for i, meta in enumerate(batch.metadata):
        meta["skill_text"] = SKILL if i < 2 else None
    return _grpo_like(module, batch)


def _tf_sdpo() -> dict[str, float]:
    """SDPO: the successful sibling demonstrates to the failed rows of its group."""
    from lopd_lightning.modules import SDPOModule

    module = _build(SDPOModule, group_size=2, distill_top_k=8)
    _perturb(module)
    _, _, batch = _toy_batch(module.tokenizer)
    return _self_distillation(module, batch)


def _tf_opsd() -> dict[str, float]:
    """OPSD: the reference solution is the teacher's privileged context."""
    from lopd_lightning.modules import OPSDModule

    module = _build(OPSDModule, group_size=2)
    _perturb(module)
    task, examples, batch = _toy_batch(module.tokenizer)
    refs = {ex.id: task.reference_solution(ex) for ex in examples}
    module.reference_texts = lambda b: [refs[eid] for eid in b.example_ids]
    return _self_distillation(module, batch)


def _tf_sft() -> dict[str, float]:
    """SFT: the masked NLL of its training step."""
    from lopd_lightning.losses import masked_mean
    from lopd_lightning.modules import SFTModule

    module = _build(SFTModule)
    _perturb(module)
    _, _, batch = _toy_batch(module.tokenizer)
    _, mask = module.shifted(batch)
    return {"loss": _f(masked_mean(-module.student_logps(batch), mask, num_tokens=module.num_loss_tokens(batch)))}


def _tf_lopd() -> dict[str, float]:
    """LOPD: configs/tiny.yaml's module, experiences from a hand-built bank (no retrieval, no bank on disk); the
    student and the composer moved (seeded) so that the distillation and the anchor terms are not 0."""
    from lopd_lightning.modules import LOPDModule

    module = _build(LOPDModule, group_size=2, max_new_tokens=8, num_latents=4, num_experiences=2, composer_depth=2,
                    max_experience_tokens=64, embedder="hashing", distill_top_k=8, learning_rate=1e-3,
                    composer_lr=1e-3, beta_init=0.5)
    _perturb(module)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in module.composer.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    task, examples, batch = _toy_batch(module.tokenizer)
    batch.experiences = _hand_bank(task, examples, batch)
    out = module.losses(batch)
    return {
        "loss_student": _f(out.loss_student), "loss_composer": _f(out.loss_composer), "distill_c": _f(out.distill_c),
        "delta": _f(out.delta), "anchor": _f(out.anchor), "rows_with_latents": _f(out.has_latents.sum()),
        "beta": float(module.beta), "margin": float(module.margin),
    }


TEACHER_FORCED = {"lopd": _tf_lopd, "grpo": _tf_grpo, "sdpo": _tf_sdpo, "opsd": _tf_opsd, "skill_sd": _tf_skill_sd,
                  "sft": _tf_sft}


def teacher_forced_values() -> dict[str, dict[str, float]]:
    """Per method, its loss pieces on the fixed teacher-forced batch (see the module docstring)."""
    return {method: compute() for method, compute in TEACHER_FORCED.items()}


# ------------------------------------------------------------------------------ end-to-end fits
def fit_method(method: str, root: str | Path, steps: int = FIT_STEPS) -> list[dict[str, float]]:
    """The pinned tags of ``method`` logged after each of ``steps`` seeded tiny-model steps on the toy task."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lopd_lightning.modules.lopd_callbacks import MarginSchedule
    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.modules import GRPOModule, LOPDModule, OPSDModule, SDPOModule, SFTModule, SkillSDModule

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import ParityToy

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    common = dict(lora=LORA, learning_rate=1e-3, max_new_tokens=8)
    callbacks: list = []
    if method == "lopd":  # configs/tiny.yaml's module with its shipped bank (read only: no MemoryRefresh)
        module = LOPDModule("tiny", group_size=2, num_latents=4, num_experiences=2, composer_depth=2,
                            max_experience_tokens=64, embedder="hashing", bank_path=str(TINY_BANK), distill_top_k=8,
                            composer_lr=1e-3, **common)
        callbacks.append(MarginSchedule(schedule="constant"))
        per_step = 2
    elif method == "grpo":
        module, per_step = GRPOModule("tiny", group_size=4, **common), 1
    elif method == "sdpo":
        module, per_step = SDPOModule("tiny", group_size=4, distill_top_k=8, **common), 1
    elif method == "opsd":
        module, per_step = OPSDModule("tiny", group_size=1, **common), 4
    elif method == "skill_sd":
        module, per_step = SkillSDModule("tiny", group_size=4, skill_refresh_every=1, skill_max_new_tokens=8,
                                         **common), 1
        module.add_skill("success", SKILL)  # the random student summarises no skill: seed the library with one
    elif method == "sft":
        common.pop("max_new_tokens")
        module, per_step = SFTModule("tiny", **common), 2
    else:
        raise ValueError(f"unknown method {method!r}")
    # rewards that vary within a group (ParityToy), so that GRPO's advantages and SDPO's demonstrations exist; SFT
    # trains on the toy task's references
    task = "toy" if method == "sft" else ParityToy()
    dm = OnPolicyDataModule(task, examples_per_step=per_step, val_limit=4, val_batch_size=4)

    records: list[dict[str, float]] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged = trainer.callback_metrics
            records.append({tag: float(logged[tag]) for tag in FIT_TAGS[method] if tag in logged})

    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, limit_val_batches=0,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
        callbacks=[*callbacks, Record()],
    )
    trainer.fit(module, dm)
    return records


def fit_values(root: str | Path) -> dict[str, list[dict[str, float]]]:
    return {method: fit_method(method, Path(root) / method) for method in FIT_TAGS}


# ------------------------------------------------------------------------------ the command
def _max_rel(a, b, path="") -> list[tuple[float, str]]:
    if isinstance(a, dict):
        return [d for k in a for d in _max_rel(a[k], b.get(k, float("nan")), f"{path}/{k}")]
    if isinstance(a, list):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _max_rel(x, y, f"{path}[{i}]")]
    return [(abs(a - b) / max(abs(a), 1e-12), path)]


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed values, write nothing")
    args = parser.parse_args(argv)
    step = teacher_forced_values()
    with tempfile.TemporaryDirectory() as root:
        fit = fit_values(root)
    if args.check:
        for name, new, path in (("step", step, STEP_VALUES), ("fit", fit, FIT_VALUES)):
            old = json.loads(path.read_text())
            worst = sorted(_max_rel(old, new), reverse=True)[:5]
            print(name, worst)
        return 0
    PINNED.mkdir(parents=True, exist_ok=True)
    STEP_VALUES.write_text(json.dumps(step, indent=2, sort_keys=True) + "\n")
    FIT_VALUES.write_text(json.dumps(fit, indent=2, sort_keys=True) + "\n")
    print(f"wrote {STEP_VALUES.relative_to(ROOT)} and {FIT_VALUES.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
