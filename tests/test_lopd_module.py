"""LOPDModule: an end-to-end fit from YAML, the two updates' isolation, the dual ascent of beta, the
logged margin and KL against a naive recomputation, checkpoints and resume, and early config errors.

Everything runs on the tiny random Llama (``model: tiny``) and the toy task, on CPU, in seconds.
The bank is seeded with the toy task's reference solutions so that every row retrieves experiences
and the composer's latents exist (an empty bank would make the teacher equal the student).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lopd_lightning.adapters import adapter_parameters, base_parameters
from lopd_lightning.modules.lopd_callbacks import MarginSchedule, MemoryRefresh
from lopd_lightning.cli import lightning_cli
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.memory import Experience, ExperienceBank
from lopd_lightning.memory.embed import get_embedder
from lopd_lightning.modules import LOPDModule
from lopd_lightning.modules.lopd import ANCHOR_ADAPTER, COMPOSER_ADAPTER
from lopd_lightning.tasks.toy import ToyTask
from helpers import EvenToy

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY_YAML = CONFIGS / "tiny.yaml"
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


# ---------------------------------------------------------------------------------------- helpers

def reference_experiences(task: ToyTask) -> list[Experience]:
    """One successful experience per train example: its reference solution replayed as a trace."""
    out = []
    for ex in task.examples("train"):
        messages = [*task.initial_messages(ex), {"role": "assistant", "content": task.reference_solution(ex)}]
        out.append(Experience(task_id=ex.id, task_text=ex.text, trace=task.experience_text(ex, messages), reward=1.0))
    return out


@pytest.fixture(scope="module")
def bank_dir(tmp_path_factory) -> Path:
    """A saved bank (hashing embedder) of the toy train split's 24 reference solutions."""
    folder = tmp_path_factory.mktemp("bank")
    bank = ExperienceBank(get_embedder("hashing"))
    assert bank.add(reference_experiences(ToyTask())) == 24  # 32 examples, ceil(0.25 * 32) = 8 in val
    bank.save(folder)
    return folder


def make_module(bank_dir: Path | None, **overrides) -> LOPDModule:
    """configs/tiny.yaml's module (LoRA student, K=4, J=2, depth 2, hashing embedder, distill_top_k 8)."""
    options = dict(
        lora=LORA,
        group_size=2,
        max_new_tokens=8,
        num_latents=4,
        num_experiences=2,
        composer_depth=2,
        max_experience_tokens=64,
        embedder="hashing",
        distill_top_k=8,
        learning_rate=1e-3,
        composer_lr=1e-3,
        bank_path=None if bank_dir is None else str(bank_dir),
    )
    options.update(overrides)
    return LOPDModule("tiny", **options)


def make_dm(task="toy", **overrides) -> OnPolicyDataModule:
    options = dict(examples_per_step=2, val_limit=4, val_batch_size=4)
    options.update(overrides)
    return OnPolicyDataModule(task, **options)


def make_trainer(root: Path, *, max_steps: int = 2, callbacks=(), **overrides) -> L.Trainer:
    options = dict(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=list(callbacks),
    )
    options.update(overrides)
    return L.Trainer(**options)


class Recorder(Callback):
    """Per step: beta and margin before, beta after, the logged scalars, the batch."""

    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append({"global_step": trainer.global_step, "beta_before": pl_module.beta, "margin": pl_module.margin})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.steps[-1].update(beta_after=pl_module.beta, logged=logged, batch=batch)


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def same(before: list[torch.Tensor], params) -> bool:
    return all(torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True))


def parameter_groups(module: LOPDModule) -> dict[str, list[torch.nn.Parameter]]:
    """The disjoint parameter sets of the module (found by identity, not by name)."""
    groups = {
        "base": base_parameters(module.backbone),
        "composer_lora": module.composer.lora_parameters(),
        "resampler": module.composer.compressor_parameters(),
        "anchor": adapter_parameters(module.backbone, ANCHOR_ADAPTER) + list(module.anchor_composer.compressor.parameters()),
    }
    if module.is_lora_student:
        groups["student_lora"] = adapter_parameters(module.backbone, "student")
    ids = [id(p) for ps in groups.values() for p in ps]
    assert len(ids) == len(set(ids)), "parameter groups overlap"
    return groups


# --------------------------------------------------------------------------------- 1. fit from YAML
REQUIRED_TAGS = [
    "train/loss", "train/margin_delta", "train/margin_m", "train/beta",
    "train/composer_anchor", "train/reward_mean", "train/success_rate", "train/rollouts",
    "time/generation", "time/teacher", "time/student_step", "time/composer_step", "by_rollouts/reward_mean",
    "train/latent_spread", "train/latent_swap_effect", "train/latent_own_minus_other",  # the probe, at step 0
]


def test_two_step_fit_from_yaml_logs_every_tag(tmp_path, bank_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli = lightning_cli([
        "fit", "-c", str(TINY_YAML),
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'tb'}",
        f"--model.init_args.bank_path={bank_dir}",
        "--trainer.enable_progress_bar=false",
    ])
    # two optimisers but one training step = one global step (the composer steps the raw optimizer)
    assert cli.trainer.global_step == 2
    assert len(cli.model.bank) >= 24
    events = sorted((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    scalars: dict[str, list] = {}
    for path in events:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(acc.Scalars(tag))
    missing = [t for t in REQUIRED_TAGS if t not in scalars]
    assert not missing, f"missing tags {missing}; have {sorted(scalars)}"
    assert [e.step for e in scalars["train/loss"]] == [1, 2]  # one point per step, step k at x = k
    assert [e.step for e in scalars["time/retrieval"]] == [1, 2]  # LOPD retrieves from its bank every step
    assert "train/distill_kl" not in scalars  # L_distill has one tag: train/loss
    # 2 examples x 2 rollouts per step: 4 then 8 trajectories consumed
    assert [e.value for e in scalars["train/rollouts"]] == [4.0, 8.0]
    assert sorted(e.step for e in scalars["by_rollouts/reward_mean"]) == [4, 8]
    assert all(e.value > 0 for e in scalars["time/generation"])
    # the margin of tiny.yaml's MarginSchedule (constant 0.05)
    assert [round(e.value, 6) for e in scalars["train/margin_m"]] == [0.05, 0.05]


# ------------------------------------------------------------------ 2. the two updates are separate
@pytest.mark.parametrize("student", ["lora", "full"])
def test_student_step_and_composer_step_touch_disjoint_parameters(tmp_path, bank_dir, student):
    """Instrumented: snapshots at the start, right after the student's optimiser step, and at the end."""
    module = make_module(bank_dir, lora=LORA if student == "lora" else None)
    groups = parameter_groups(module)
    snaps: dict[str, dict[str, list[torch.Tensor]]] = {}
    original = module.clip_and_step

    def clip_and_step(*args, **kwargs):  # the student's optimiser step
        norm = original(*args, **kwargs)
        snaps["after_student"] = {k: snapshot(v) for k, v in groups.items()}
        return norm

    module.clip_and_step = clip_and_step

    class Snap(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            snaps["start"] = {k: snapshot(v) for k, v in groups.items()}
            assert batch.experiences is not None and all(len(e) == 2 for e in batch.experiences)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snaps["end"] = {k: snapshot(v) for k, v in groups.items()}

    make_trainer(tmp_path, max_steps=1, callbacks=[Snap()]).fit(module, make_dm())
    start, mid, end = snaps["start"], snaps["after_student"], snaps["end"]

    def changed(a, b, key):
        return not all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True))

    student_keys = ["student_lora"] if student == "lora" else ["base"]
    backbone_keys = ["base", "student_lora"] if student == "lora" else ["base"]
    composer_keys = ["composer_lora", "resampler"]
    # the student step: the student moved, nothing of the composer (nor the anchor) did
    assert all(changed(start, mid, k) for k in student_keys)
    assert not any(changed(start, mid, k) for k in composer_keys + ["anchor"])
    if student == "lora":
        assert not changed(start, mid, "base")
    # the composer step: the composer moved (both parts), no backbone parameter did
    assert all(changed(mid, end, k) for k in composer_keys)
    assert not any(changed(mid, end, k) for k in backbone_keys + ["anchor"])


@pytest.mark.parametrize("frozen_side", ["composer", "student"])
def test_zero_learning_rate_freezes_one_side_only(tmp_path, bank_dir, frozen_side):
    """composer_lr=0: composer unchanged AND student changed; learning_rate=0: the reverse."""
    lr = {"composer_lr": 0.0} if frozen_side == "composer" else {"learning_rate": 0.0}
    module = make_module(bank_dir, **lr)
    groups = parameter_groups(module)
    before = {k: snapshot(v) for k, v in groups.items()}
    make_trainer(tmp_path, max_steps=1).fit(module, make_dm())
    moved = {k: not same(before[k], v) for k, v in groups.items()}
    assert not moved["base"] and not moved["anchor"]
    if frozen_side == "composer":
        assert moved["student_lora"] and not moved["composer_lora"] and not moved["resampler"]
    else:
        assert not moved["student_lora"] and moved["composer_lora"] and moved["resampler"]


# -------------------------------------------------------------------------- 3. dual ascent of beta
@pytest.mark.parametrize(
    "margin, beta_init, case",
    [(1.0, 0.0, "growth"), (-5.0, 0.3, "clamp")],
)
def test_beta_follows_projected_dual_ascent(tmp_path, bank_dir, margin, beta_init, case):
    """beta_{t+1} = max(0, beta_t + eta (m - Delta_t)), Delta_t the logged train/margin_delta."""
    eta = 0.5
    module = make_module(bank_dir, margin=max(margin, 0.0), beta_init=beta_init, dual_lr=eta)
    module.margin = margin  # m in effect; below 0 (refused as an option) only to drive beta into the clamp
    rec = Recorder()
    make_trainer(tmp_path, max_steps=2, callbacks=[rec]).fit(module, make_dm())
    assert len(rec.steps) == 2
    beta = beta_init
    for step in rec.steps:
        delta = step["logged"]["train/margin_delta"]
        assert delta != 0.0  # latents exist: the teacher differs from the student
        assert step["beta_before"] == pytest.approx(beta)
        assert step["logged"]["train/beta"] == pytest.approx(beta)  # logged: the beta used in this step
        beta = max(0.0, beta + eta * (margin - delta))
        assert step["beta_after"] == pytest.approx(beta, abs=1e-6)
    if case == "growth":
        # |Delta| is small on a random model, so m = 1 makes beta grow by about eta * m each step
        assert rec.steps[0]["beta_after"] > 0.4 and rec.steps[1]["beta_after"] > rec.steps[0]["beta_after"]
    else:
        assert rec.steps[0]["beta_after"] == 0.0 and rec.steps[1]["beta_after"] == 0.0


# --------------------------------------------------- the logged margin and KL against a naive reference
def at_loss_positions(logits: torch.Tensor, mask: torch.Tensor, *, full_length: bool) -> torch.Tensor:
    """(N, V) logits at the N loss positions (row-major order of ``mask``, (B, T-1) shifted coordinates).

    Accepts packed (N, V) logits as they are, or dense ones: (B, T-1, V), or (B, T, V) when ``full_length``.
    """
    if logits.ndim == 2:
        assert logits.shape[0] == int(mask.sum())
        return logits
    return (logits[:, :-1] if full_length else logits)[mask]


def capture_student_and_teacher(module: LOPDModule, captured: dict) -> None:
    """Wrap the student's and the teacher's passes of ``module`` so that each call leaves its outputs (float64
    copies) in ``captured["student"]`` and ``captured["teacher"]``."""
    student_forward, teacher_logits = module.student_forward, module.teacher.on_student_positions

    def grab_student(*args, **kwargs):
        out = student_forward(*args, **kwargs)  # StudentForward(logits, cache or None)
        captured["student"] = out.values.detach().double().clone()
        return out

    def grab_teacher(*args, **kwargs):
        out = teacher_logits(*args, **kwargs)
        captured["teacher"] = out.detach().double().clone()
        return out

    module.student_forward = grab_student
    module.teacher.on_student_positions = grab_teacher


@pytest.mark.parametrize("weighting", ["paper", "balanced"])
def test_logged_margin_and_kl_match_a_naive_recomputation(tmp_path, bank_dir, weighting):
    """Delta = mean_b [sum_t w (2 r_b - 1)(log pT - log pS) / sum_t w] (balanced: half the mean over the
    successes plus half that over the failures); KL on top-M(teacher) + tail."""
    top_m = 8
    module = make_module(bank_dir, distill_top_k=top_m, margin_weighting=weighting)
    captured = {}
    capture_student_and_teacher(module, captured)
    rec = Recorder()
    # EvenToy: rows of even examples have reward 1 (A = +1), the others 0 (A = -1)
    make_trainer(tmp_path, max_steps=1, callbacks=[rec]).fit(module, make_dm(EvenToy(), examples_per_step=4))
    batch = rec.steps[0]["batch"]
    rewards = batch.rewards.tolist()
    assert 0.0 in rewards and 1.0 in rewards
    mask = batch.assistant_mask[:, 1:]  # position j predicts token j + 1
    s = at_loss_positions(captured["student"], mask, full_length=False)
    t = at_loss_positions(captured["teacher"], mask, full_length=True)
    rows: dict[int, list[float]] = {}
    kl_sum = 0.0
    for n, (b, j) in enumerate(mask.nonzero().tolist()):
        tok = int(batch.input_ids[b, j + 1])
        log_pt, log_ps = torch.log_softmax(t[n], -1), torch.log_softmax(s[n], -1)
        rows.setdefault(b, []).append((2 * rewards[b] - 1) * float(log_pt[tok] - log_ps[tok]))
        support = torch.topk(log_pt, top_m).indices  # the teacher's top-M tokens
        ps, pt = log_ps.exp()[support], log_pt.exp()[support]
        ps = torch.cat([ps, (1 - ps.sum()).clamp_min(1e-12)[None]])  # + the tail bucket
        pt = torch.cat([pt, (1 - pt.sum()).clamp_min(1e-12)[None]])
        kl_sum += float((ps * (ps / pt).log()).sum())  # reverse KL(p~_S || p~_T)
    per_row = {b: sum(v) / len(v) for b, v in rows.items()}
    if weighting == "paper":
        delta = sum(per_row.values()) / len(per_row)
    else:
        sides = [[d for b, d in per_row.items() if rewards[b] == r] for r in (1.0, 0.0)]
        delta = sum(0.5 * sum(side) / len(side) for side in sides)
    logged = rec.steps[0]["logged"]
    assert logged["train/margin_delta"] == pytest.approx(delta, rel=1e-4, abs=1e-6)
    assert logged["train/loss"] == pytest.approx(kl_sum / int(mask.sum()), rel=1e-4, abs=1e-6)
    assert logged["train/loss"] > 0 and "train/distill_kl" not in logged  # one tag for L_distill


class FailingToy(EvenToy):
    """Every trajectory fails (reward 0)."""

    def score(self, example, completion: str) -> float:
        return 0.0


@pytest.mark.parametrize("weighting", ["paper", "balanced"])
def test_a_batch_with_one_outcome_moves_beta_only_under_the_paper_weighting(tmp_path, bank_dir, weighting):
    module = make_module(bank_dir, margin=1.0, beta_init=0.2, dual_lr=0.5, margin_weighting=weighting)
    rec = Recorder()
    make_trainer(tmp_path, max_steps=1, callbacks=[rec]).fit(module, make_dm(FailingToy(), examples_per_step=2))
    step = rec.steps[0]
    assert step["batch"].rewards.sum() == 0.0
    if weighting == "paper":  # every rollout counts with A = -1: a Delta and a dual step
        delta = step["logged"]["train/margin_delta"]
        assert delta != 0.0 and step["beta_after"] == pytest.approx(0.2 + 0.5 * (1.0 - delta), abs=1e-6)
    else:  # no success to weigh against: Delta 0, beta unchanged
        assert step["logged"]["train/margin_delta"] == 0.0 and step["beta_after"] == 0.2


# ----------------------------------------------------------------------- 6. checkpoints and resume
def test_checkpoint_holds_the_method_state_and_resume_continues(tmp_path, bank_dir):
    ckpt_dir = tmp_path / "ckpt"
    module = make_module(bank_dir, margin=0.5)
    rec = Recorder()
    callbacks = [
        MarginSchedule(),
        MemoryRefresh(every_n_steps=1, min_reward=1.0),
        ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, save_last=False),
        rec,
    ]
    dm = make_dm(EvenToy())  # even examples succeed: the refresh grows the bank
    make_trainer(tmp_path, max_steps=2, callbacks=callbacks, enable_checkpointing=True).fit(module, dm)
    (path,) = sorted(ckpt_dir.glob("*.ckpt"))
    ckpt = torch.load(path, weights_only=False, map_location="cpu")

    # the schedule position and the method's state
    assert ckpt["global_step"] == 2
    state = ckpt["lopd_state"]
    assert state["beta"] == pytest.approx(module.beta) and module.beta > 0
    assert state["rollouts_consumed"] == 8
    assert len(state["bank"]["records"]) == len(module.bank) > 24  # the refresh added to the 24 references
    assert ckpt["OnPolicyDataModule"]["position"] == 4
    # the composer: resampler and composer LoRA (and the anchor) inside the state dict
    sd = ckpt["state_dict"]
    for name, p in module.named_parameters():
        assert torch.equal(sd[name], p.detach().cpu()), name
    assert any(k.startswith("composer.compressor.") for k in sd)
    assert any(f".lora_B.{COMPOSER_ADAPTER}." in k for k in sd)
    assert any(f".lora_B.{ANCHOR_ADAPTER}." in k for k in sd)
    # both optimisers, each stepped twice
    opt_student, opt_composer = ckpt["optimizer_states"]
    assert len(opt_student["state"]) == len(module.student_parameters())
    assert len(opt_composer["state"]) == len(module.composer.trainable_parameters())
    assert all(float(s["step"]) == 2 for s in opt_student["state"].values())
    assert all(float(s["step"]) == 2 for s in opt_composer["state"].values())

    # resume into a fresh module with an EMPTY bank and beta 0: everything must come from the checkpoint
    fresh = make_module(None, margin=0.5)
    assert len(fresh.bank) == 0 and fresh.beta == 0.0
    seen = {}

    class AtResume(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if "beta" in seen:
                return
            seen.update(
                step=trainer.global_step,
                beta=pl_module.beta,
                bank=len(pl_module.bank),
                example_ids=list(dict.fromkeys(batch.example_ids)),
                params_equal=all(torch.equal(sd[n], p.detach().cpu()) for n, p in pl_module.named_parameters()),
                composer_steps={float(s["step"]) for s in trainer.optimizers[1].state.values()},
            )

    callbacks2 = [MarginSchedule(), MemoryRefresh(every_n_steps=0), AtResume()]
    trainer2 = make_trainer(tmp_path / "resume", max_steps=3, callbacks=callbacks2)
    dm2 = make_dm(EvenToy())
    trainer2.fit(fresh, dm2, ckpt_path=str(path))
    assert trainer2.global_step == 3
    assert seen["step"] == 2
    assert seen["beta"] == pytest.approx(state["beta"])
    assert seen["bank"] == len(state["bank"]["records"])
    assert seen["params_equal"]
    assert seen["composer_steps"] == {2.0}
    # the data position continues: step 3 trains on positions 4 and 5 of the permutation
    assert seen["example_ids"] == [ex.id for ex in dm2.examples_at(4)]
    assert dm2.position == 6 and fresh.rollouts_consumed == 12


# ------------------------------------------------------------------------- composer warm start
def test_warm_start_trains_the_composer_and_freezes_it_as_the_anchor(tmp_path, bank_dir):
    module = make_module(bank_dir, warm_start_steps=2, warm_start_batch_size=2)
    assert not module.warm_started
    fresh = snapshot(module.composer.trainable_parameters())
    seen = {}

    class AtFirstStep(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            anchor_lora = adapter_parameters(pl_module.backbone, ANCHOR_ADAPTER)
            seen["anchor_is_composer"] = same(snapshot(pl_module.composer.lora_parameters()), anchor_lora) and same(
                snapshot(pl_module.composer.compressor_parameters()), list(pl_module.anchor_composer.compressor.parameters())
            )
            seen["composer_moved"] = not same(fresh, pl_module.composer.trainable_parameters())
            seen["anchor_frozen"] = not any(p.requires_grad for p in anchor_lora)

    rec = Recorder()
    make_trainer(tmp_path, max_steps=1, callbacks=[AtFirstStep(), rec]).fit(module, make_dm())
    assert module.warm_started
    assert seen == {"anchor_is_composer": True, "composer_moved": True, "anchor_frozen": True}
    # the anchor term is 0 at the first step: the composer has not moved from its snapshot yet
    assert rec.steps[0]["logged"]["train/composer_anchor"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("freeze", [True, False], ids=["freeze_composer", "default"])
def test_freeze_composer_keeps_the_warm_started_composer_bit_identical_while_the_student_trains(tmp_path, bank_dir, freeze):
    """freeze_composer (the paper's frozen-composer ablation): the warm start still runs in fit, then a 2-step fit
    leaves the composer (LoRA and compressor) bit-identical to what it was at fit start and beta at beta_init,
    while the student moves; Delta is still logged, the composer's loss and anchor are not. The default moves
    the composer."""
    module = make_module(bank_dir, freeze_composer=freeze, warm_start_steps=1, warm_start_batch_size=2,
                         beta_init=0.3, margin=1.0)  # margin 1: an active dual step would move beta
    groups = parameter_groups(module)
    fresh = {k: snapshot(v) for k, v in groups.items()}
    at_start = {}

    class AtTrainStart(Callback):
        def on_train_start(self, trainer, pl_module):  # after on_fit_start's warm start
            at_start.update({k: snapshot(v) for k, v in groups.items()})

    recorder = Recorder()
    make_trainer(tmp_path, max_steps=2, callbacks=[AtTrainStart(), recorder]).fit(module, make_dm())
    assert module.global_step == 2 and len(recorder.steps) == 2
    assert not any(same(fresh[k], at_start[k]) for k in ("composer_lora", "resampler"))  # the warm start ran first
    moved = {k: not same(at_start[k], v) for k, v in groups.items()}
    assert moved["student_lora"] and not moved["base"] and not moved["anchor"]
    assert moved["composer_lora"] == moved["resampler"] == (not freeze)
    logged = [step["logged"] for step in recorder.steps]
    assert all("train/margin_delta" in log and "train/beta" in log for log in logged)
    if freeze:
        assert [step["beta_after"] for step in recorder.steps] == [0.3, 0.3]
        assert not any("train/composer_loss" in log or "train/composer_anchor" in log for log in logged)
    else:
        assert recorder.steps[-1]["beta_after"] > 0.3
        assert all("train/composer_loss" in log for log in logged)


def test_warm_start_draws_are_seeded_successful_train_records_and_are_what_it_trains_on(bank_dir):
    module = make_module(bank_dir, warm_start_steps=3, warm_start_batch_size=2)
    dm = make_dm()
    draws = module.warm_start_draws(dm)
    train_ids = {ex.id for ex in dm.train_examples}
    assert [len(batch) for batch in draws] == [2, 2, 2]
    assert all(r.reward >= module.hparams.success_threshold and r.task_id in train_ids for b in draws for r in b)
    assert [[r.task_id for r in b] for b in module.warm_start_draws(dm)] == [[r.task_id for r in b] for b in draws]
    trained_on = []
    reference_batch = type(module).reference_batch

    def recording(self, task, examples):
        trained_on.append([ex.id for ex in examples])
        return reference_batch(self, task, examples)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(module), "reference_batch", recording)
        module.warm_start_composer(dm)
    assert trained_on == [[r.task_id for r in b] for b in draws] and module.warm_started


def test_warm_start_without_successful_records_is_skipped(tmp_path):
    module = make_module(None, warm_start_steps=3)  # an empty bank that MemoryRefresh may fill
    fresh = snapshot(module.composer.trainable_parameters())
    make_trainer(tmp_path, max_steps=1, limit_train_batches=0, callbacks=[MemoryRefresh(1)]).fit(module, make_dm())
    assert module.warm_started
    assert same(fresh, module.composer.trainable_parameters())


# ------------------------------------------------------------------- validation before training
def test_validate_before_training_records_step_zero(tmp_path, bank_dir):
    module = make_module(bank_dir, validate_before_training=True)
    make_trainer(tmp_path, max_steps=1).fit(module, make_dm(val_limit=3))
    step, values = module.val_history[0]
    assert step == 0
    assert set(values) == {"val/reward_mean", "val/success_rate", "val/turns_mean", "val/reply_tokens_mean",
                           "val/cut_at_length_rate"}
    assert values["val/turns_mean"] == 1.0  # single-turn toy episodes


def test_the_evaluation_tags_sync_dist_warning_under_an_initialised_process_group_is_dropped_and_others_kept(
        tmp_path, bank_dir):
    """vLLM in process (and DDP) bring torch.distributed up, and Lightning then warns at each validation tag to
    log it with sync_dist; those tags are torchmetrics values already reduced over the ranks, so the CLI drops
    that warning for them (cli.EVALUATION_SYNC_DIST_WARNING), and for no other tag."""
    import re
    import warnings

    import torch.distributed as dist

    from lopd_lightning.cli import EVALUATION_SYNC_DIST_WARNING, configure_logging

    def caught_messages(filtered):
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()
            warnings.simplefilter("always")
            if filtered:
                configure_logging()
            module = make_module(bank_dir)
            trainer = make_trainer(tmp_path / str(filtered), max_steps=1, limit_val_batches=1.0, val_check_interval=1)
            trainer.fit(module, make_dm(val_limit=3))
        assert [step for step, _ in module.val_history] == [1]
        return [str(w.message) for w in caught if "sync_dist=True" in str(w.message)]

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        unfiltered, filtered = caught_messages(False), caught_messages(True)
    finally:
        dist.destroy_process_group()
    # the installed Lightning does warn, at every evaluation tag: the filter matches real messages
    assert {re.search(r"'(val/\w+)'", m).group(1) for m in unfiltered} == {
        "val/reward_mean", "val/success_rate", "val/turns_mean", "val/reply_tokens_mean", "val/cut_at_length_rate"}
    assert filtered == []
    ours = next(m for m in unfiltered if "'val/reward_mean'" in m)
    other = ours.replace("val/reward_mean", "val/my_metric")  # a subclass's own tag keeps its warning
    assert re.match(EVALUATION_SYNC_DIST_WARNING, ours) and not re.match(EVALUATION_SYNC_DIST_WARNING, other)


# ------------------------------------------------------------------ 12. bad config fails early
def test_unknown_task_name_lists_known_ones(no_model_loading):
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*toy"):
        OnPolicyDataModule("nope")
    # through the CLI: LightningCLI instantiates the model first, so the name is checked before that
    with pytest.raises(ValueError, match=r"unknown task 'nope' \(data.init_args.task\); known tasks: .*bfcl_simple_python.*toy"):
        lightning_cli(["-c", str(TINY_YAML), "--data.init_args.task=nope", "--trainer.logger=false"], run=False)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"group_size": 0}, "group_size must be >= 1"),
        ({"num_experiences": -1}, "model.init_args.num_experiences must be >= 0"),
        ({"num_latents": 0}, "model.init_args.num_latents must be >= 1"),
        ({"distill_top_k": 0}, "model.init_args.distill_top_k must be >= 1"),
        ({"beta_init": -1.0}, r"model.init_args.beta_init must be >= 0 \(beta_0.*got -1.0"),
        ({"beta_init": float("nan")}, "model.init_args.beta_init must be >= 0"),
        ({"dual_lr": -0.5}, r"model.init_args.dual_lr must be >= 0 \(eta_beta.*got -0.5"),
    ],
)
def test_bad_module_options_fail_before_loading_the_model(no_model_loading, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_module(None, **overrides)


def test_distill_top_k_larger_than_vocabulary_fails_before_the_composer(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the composer was built before the distill_top_k check")

    monkeypatch.setattr("lopd_lightning.modules.lopd.LatentComposer", refuse)
    # the tiny tokenizer has 259 ids: distill_top_k = 259 is allowed, 260 is not
    with pytest.raises(
        ValueError,
        match=r"distill_top_k=260 is larger than the vocabulary \(259 tokens\); set model.init_args.distill_top_k <= 259",
    ):
        make_module(None, distill_top_k=260)
    with pytest.raises(AssertionError, match="composer was built"):
        make_module(None, distill_top_k=259)


def test_bad_option_through_the_cli_names_the_option(no_model_loading):
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        lightning_cli(
            ["-c", str(TINY_YAML), "--model.init_args.group_size=0", "--trainer.logger=false"], run=False
        )


def test_beta_stays_put_without_latents(tmp_path):
    """An empty bank gives no latents: delta is 0 by construction, so the dual step is skipped (no wind-up:
    the rule would otherwise add eta * m = 0.025 per step) and beta keeps its value."""
    module = make_module(None, beta_init=0.3)
    recorder = Recorder()  # MemoryRefresh may fill the bank; the tiny random model solves nothing, so it stays empty
    make_trainer(tmp_path, max_steps=2, callbacks=[recorder, MemoryRefresh(1)]).fit(module, datamodule=make_dm())
    assert [s["beta_after"] for s in recorder.steps] == [0.3, 0.3]


def test_a_misspelt_embedder_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match=r"^model.init_args.embedder 'hashng' is not an embedder; did you mean 'hashing'\? choose one of minilm, backbone, hashing$"):
        LOPDModule("no-such-model", embedder="hashng")


# ------------------------------------------------------------------- the dual variable's controller
def test_dual_ascent_follows_the_hand_computed_sequence_and_clamps_at_zero():
    from lopd_lightning.losses.dual import DualAscent

    dual = DualAscent(0.25, lr=0.5)
    # beta <- max(0, beta + 0.5 (m - Delta))
    assert dual.update(0.01, 0.05) == pytest.approx(0.25 + 0.5 * 0.04)  # 0.27
    assert dual.update(torch.tensor(-0.11), 0.05) == pytest.approx(0.27 + 0.5 * 0.16)  # 0.35, a 0-d tensor
    assert dual.update(0.45, 0.05) == pytest.approx(0.15)  # 0.35 - 0.2
    assert dual.update(1.05, 0.05) == 0.0  # 0.15 - 0.5 < 0: projected to 0
    assert dual.update(0.06, 0.05) == 0.0  # stays at the floor
    assert dual.update(-0.95, 0.05) == pytest.approx(0.5)  # the margin moved (a MarginSchedule): same rule
    assert dual.value == pytest.approx(0.5)


def test_dual_ascent_skips_without_signal_and_on_a_non_finite_margin():
    from lopd_lightning.losses.dual import DualAscent

    dual = DualAscent(0.3, lr=0.5)
    assert dual.update(-1.0, 0.05, active=False) == 0.3  # no teacher saw latents, or the step was skipped
    assert dual.update(float("nan"), 0.05) == 0.3
    assert dual.update(torch.tensor(float("inf")), 0.05) == 0.3
    assert dual.update(float("-inf"), 0.05) == 0.3
    assert dual.value == 0.3


def test_dual_ascent_state_dict_round_trip_and_lopds_method_state():
    from lopd_lightning.losses.dual import DualAscent

    dual = DualAscent(0.0, lr=0.5)
    dual.update(-0.4, 0.1)
    state = dual.state_dict()
    assert state == {"beta": pytest.approx(0.25)}
    fresh = DualAscent(0.0, lr=0.5)
    fresh.load_state_dict(state)
    assert fresh.value == dual.value and fresh.update(0.0, 0.1) == dual.update(0.0, 0.1)
    method_state = {"beta": 1.5, "margin": 0.05, "warm_started": True, "bank": {}}  # LOPD's: beta among the rest
    fresh.load_state_dict(method_state)
    assert fresh.value == 1.5
    assert "DualAscent(value=1.5" in repr(fresh)


def test_dual_ascent_refuses_a_negative_start_or_step_size():
    from lopd_lightning.losses.dual import DualAscent

    for init, lr, key in ((-0.1, 0.5, "beta_init"), (0.0, -1.0, "dual_lr")):
        with pytest.raises(ValueError, match=f"model.init_args.{key} must be >= 0"):
            DualAscent(init, lr=lr)
    assert DualAscent(0.0, lr=0.0).update(0.0, 0.05) == 0.0  # both 0: allowed, beta stays


def test_module_beta_is_the_controllers_value_and_a_method_state_of_plain_floats_resumes():
    module = make_module(None, beta_init=0.4, dual_lr=0.25)
    assert module.beta == 0.4 and module.dual.value == 0.4 and module.dual.lr == 0.25
    module.beta = 0.9  # the property writes through
    assert module.dual.value == 0.9
    state = module.method_state()
    assert list(state)[:3] == ["beta", "margin", "warm_started"] and state["beta"] == 0.9
    plain = {"beta": 1.25, "margin": 0.3, "warm_started": True, "bank": module.bank.state_dict()}
    fresh = make_module(None)
    fresh.load_method_state(plain)
    assert fresh.beta == 1.25 and fresh.dual.value == 1.25 and fresh.margin == 0.3 and fresh.warm_started
    assert fresh.dual.update(0.3, fresh.margin) == 1.25  # m - Delta = 0: beta unchanged, the rule still applies


def test_student_forward_gives_the_hidden_states_with_or_without_the_cache(tmp_path, bank_dir):
    module = make_module(bank_dir)
    rec = Recorder()
    make_trainer(tmp_path, max_steps=1, callbacks=[rec]).fit(module, make_dm())
    batch = rec.steps[0]["batch"]
    _, mask = module.shifted(batch)
    with torch.no_grad():
        with_cache = module.student_forward(batch, mask, output="hidden", keep_cache=True)
        hidden = module.student_forward(batch, mask, output="hidden")
    assert hidden.values.shape == (int(mask.sum()), 64) and hidden.cache is None
    torch.testing.assert_close(hidden.values, with_cache.values)
    assert with_cache.cache.get_seq_length() == batch.input_ids.shape[1]


def test_the_composer_adapter_comes_after_the_base_constructor_with_its_config(monkeypatch):
    """LOPD adds psi with adapters.add_composer_adapter once the base module built the student (no override
    of the base constructor); a bad composer LoRA still fails before the weights load."""
    def refuse(*args, **kwargs):
        raise AssertionError("the student was loaded before the config error was raised")

    module = make_module(None, composer_lora={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    assert module.backbone.peft_config[COMPOSER_ADAPTER].r == 2
    assert "composer_lora_config" not in LOPDModule.__dict__  # no override of a base-class hook
    monkeypatch.setattr("lopd_lightning.modules.base.load_student", refuse)
    with pytest.raises(ValueError, match=r"model.init_args.composer_lora.rank is not a LoraConfig field"):
        make_module(None, composer_lora={"rank": 2})


# ------------------------------------------------------------------- an empty bank trains nothing
def test_an_empty_bank_that_nothing_fills_is_refused_before_the_first_step(tmp_path):
    module = make_module(None)
    recorder = Recorder()
    with pytest.raises(ValueError, match=r"^model.init_args.bank_path is null, so LOPD's teacher has no experiences.*"
                                         r"lopd build-memory.*MemoryRefresh") as raised:
        make_trainer(tmp_path, max_steps=2, callbacks=[recorder]).fit(module, datamodule=make_dm())
    assert "\n" not in str(raised.value) and recorder.steps == []
    # MemoryRefresh turned off (every_n_steps 0) fills nothing either; J = 0 (no retrieval) needs no bank
    with pytest.raises(ValueError, match="bank_path is null"):
        make_trainer(tmp_path, max_steps=1, callbacks=[MemoryRefresh(0)]).fit(make_module(None), make_dm())
    make_trainer(tmp_path, max_steps=1).fit(make_module(None, num_experiences=0), make_dm())


def test_an_empty_bank_that_memory_refresh_fills_says_how_many_steps_trained_nothing(tmp_path, caplog):
    """The tiny random model solves nothing, so a callback marks the rollouts of step 2 successful: MemoryRefresh
    fills the bank after that step, and its warning counts the two steps that ran on the empty bank."""
    class Solves(Callback):  # placed before MemoryRefresh, so the refresh sees the changed rewards
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                batch.rewards.fill_(1.0)

    refresh = MemoryRefresh(every_n_steps=1)
    with caplog.at_level("WARNING"):
        make_trainer(tmp_path, max_steps=3, callbacks=[Solves(), refresh]).fit(make_module(None), make_dm())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings[0] == ("model.init_args.bank_path is null: LOPD's teacher reads no experience, and LOPD trains "
                           "nothing, until MemoryRefresh has filled the bank to J=2")
    assert any("the bank held fewer than J=2 experiences for the first 2 steps, which retrieved nothing and trained "
               "nothing; it now holds" in w for w in warnings)
    assert refresh.empty_steps == 2 and refresh.state_dict()["empty_steps"] == 2
    caplog.clear()
    with caplog.at_level("WARNING"):  # never filled: said once at the end
        make_trainer(tmp_path, max_steps=2, callbacks=[MemoryRefresh(1)]).fit(make_module(None), make_dm())
    ends = [r.getMessage() for r in caplog.records if "the bank stayed empty" in r.getMessage()]
    assert ends == ["the bank stayed empty: all 2 steps ran without experiences and trained nothing; build one with "
                    "`lopd build-memory -c CONFIG --from-references` (model.init_args.bank_path)"]


def test_the_smoke_config_ships_its_bank_and_trains_lopd(tmp_path, monkeypatch):
    """configs/tiny.yaml (the README's smoke test) reads configs/tiny_bank/, which is exactly what build-memory
    makes from the toy task's references today, and its steps train: loss, Delta and beta are not 0."""
    from lopd_lightning.cli import main

    monkeypatch.chdir(CONFIGS.parent)
    out = tmp_path / "bank"
    assert main(["build-memory", "-c", str(TINY_YAML), "--from-references", f"--out={out}"]) == 0
    shipped = CONFIGS / "tiny_bank"
    for name in ("experiences.jsonl", "meta.json"):
        assert (out / name).read_text() == (shipped / name).read_text(), name
    assert (out / "embeddings.npy").read_bytes() == (shipped / "embeddings.npy").read_bytes()
    recorder = Recorder()
    cli = lightning_cli(["-c", str(TINY_YAML), "--trainer.logger=false", "--trainer.enable_checkpointing=false",
                          f"--trainer.default_root_dir={tmp_path}", "--trainer.limit_val_batches=0"], run=False)
    assert len(cli.model.bank) == 24
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert [s["batch"].experiences is not None and all(len(e) == 2 for e in s["batch"].experiences)
            for s in recorder.steps] == [True, True]
    assert all(s["logged"]["train/loss"] > 0 and s["logged"]["train/margin_delta"] != 0 for s in recorder.steps)
    assert recorder.steps[-1]["beta_after"] > 0  # Delta below m moved beta
