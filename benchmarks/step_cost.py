"""Step cost by phase: one LOPD training step against one GRPO step at the same number of trajectories.

Measures one thing: the wall time of real training steps (a Lightning ``Trainer``, manual optimisation,
the modules' own code) split by phase, for :class:`LOPDModule` and :class:`GRPOModule`, and how far LOPD is
from its floor.

- Phases come from ``pl_module.step_timings``: ``retrieval`` and ``generation`` (timed by ``make_batch``,
  which the DataModule calls in ``on_before_batch_transfer``, i.e. BEFORE ``on_train_batch_start``),
  ``teacher``, ``student_step``, ``backward``, ``composer_step`` (LOPD), ``student_step`` (GRPO), plus
  ``memory_refresh`` (LOPD's MemoryRefresh callback, every step as in configs/compare/lopd.yaml).
  ``step_total`` runs from the start of ``make_batch`` to the end of ``on_train_batch_end`` (generation
  included); ``other`` is what the phases leave of it (Lightning, logging, batch transfer).
- Layout: ``--trajectories`` per step (8): LOPD ``trajectories / --lopd-group`` tasks x ``--lopd-group``
  rollouts (1: the paper's one rollout per task), GRPO ``trajectories / --grpo-group`` tasks x G
  (``--grpo-group`` 4); ``--lopd-group 4`` gives both the same layout. Same seeds for both methods.
- Settings of configs/compare: LoRA r16 on all projections (``--no-lora``: full student), lr 1e-4,
  T 0.7 / top_p 0.95 / top_k 20, LOPD K 8, J 2, depth 8, max_experience_tokens 192, distill_top_k 20, live
  teacher, no composer warm start (its cost is once per run, not per step). The bank is the task's train
  reference solutions replayed and scored, as ``lopd build-memory --from-references`` does (embedder
  ``hashing`` for the tiny model, ``minilm`` otherwise).
- Floor: LOPD needs at least what GRPO does plus one teacher forward and one composer backward, which
  reaches the composer through the teacher's pass (the frozen backbone). On the last LOPD batch,
  ``composer_path_s`` = the composer's forward + the teacher's forward with the latents + the backward to
  the composer, as the module runs them (median of ``--floor-repeats``). ``floor_lopd_s`` = GRPO's median
  step + ``composer_path_s``; ``distance_to_floor`` compares LOPD's phase groups with their floor shares.
  Reference units: one no-grad student forward, the composer's own graph, the anchor composer's forward;
  warm on the same batch, a GRPO-like student update and LOPD's whole update (``update_warm_ratio_to_floor``).

Run::

    python benchmarks/step_cost.py [--model smollm2-135m-instruct|tiny|FOLDER] [--task bfcl_live_simple]
                                   [--trajectories 8] [--steps 3] [--warmup 1] [--threads 1]
                                   [--device cpu|cuda] [--max-new-tokens 96] [--generation-backend hf|vllm]
                                   [--out benchmarks/results/step_cost.json]

The JSON is ``{"benchmark": "step_cost", "model", "task", "settings", "methods": {"lopd", "grpo"},
"ratio_lopd_over_grpo", "ratio_excluding_generation", "floor", "distance_to_floor", "target"}`` plus
:func:`common.run_metadata`.
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` next to this file, when imported too
from common import run_metadata, write_json_atomic  # noqa: E402

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from lopd_lightning.modules.lopd_callbacks import MarginSchedule, MemoryRefresh  # noqa: E402
from lopd_lightning.data import OnPolicyDataModule  # noqa: E402
from lopd_lightning.modules import GRPOModule, LOPDModule  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "step_cost.json"
TARGET_RATIO = 1.6
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
#: LOPD settings of configs/compare/lopd.yaml (warm start off: a once-per-run cost).
LOPD_SETTINGS = dict(composer_lr=1e-4, num_latents=8, num_experiences=2, composer_depth=8, max_experience_tokens=192,
                     distill_top_k=20, margin=0.05, anchor_weight=0.2, dual_lr=0.5, teacher_mode="live", warm_start_steps=0)
GRPO_SETTINGS = dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, ppo_epochs=1)
#: the LOPD phases compared with a floor share (the rest: retrieval, memory_refresh, other).
UPDATE_PHASES = ("student_step", "backward", "composer_step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file to write")
    p.add_argument("--model", default="smollm2-135m-instruct", help="'smollm2-135m-instruct', 'tiny' or a folder")
    p.add_argument("--task", default=None, help="task name (default: bfcl_live_simple; toy for --model tiny)")
    p.add_argument("--trajectories", type=int, default=8, help="trajectories per step, both methods")
    p.add_argument("--lopd-group", type=int, default=1, help="LOPD rollouts per task (1: the paper's)")
    p.add_argument("--grpo-group", type=int, default=4, help="GRPO group size G (>= 2)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per method (median)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the CPU is shared)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", help="weights dtype (bfloat16 on a GPU)")
    p.add_argument("--no-lora", dest="lora", action="store_false", help="full-parameter student")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per reply (default 96; 16 for tiny)")
    p.add_argument("--embedder", default=None, help="bank embedder (default: hashing for tiny, minilm otherwise)")
    p.add_argument("--bank-limit", type=int, default=None, help="bank from the first N train examples only")
    p.add_argument("--floor-repeats", type=int, default=3, help="repeats of each floor measurement (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gradient-checkpointing", action="store_true", help="both methods: recompute activations")
    p.add_argument("--distill-chunk-size", type=int, default=None, help="LOPD: chunked distillation loss")
    p.add_argument("--no-teacher-prefix-cache", dest="teacher_prefix_cache", action="store_false",
                   help="LOPD: the teacher recomputes the whole sequence (teacher_prefix_cache=False)")
    p.add_argument("--generation-backend", default="hf", choices=["hf", "vllm"],
                   help="how rollouts are generated (vllm: run in the environment of make test-vllm)")
    p.add_argument("--quick", action="store_true", help="tests: tiny model, toy task, 4 trajectories, 1+1 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.trajectories, args.steps, args.warmup = "tiny", 4, 1, 1
        args.max_new_tokens, args.floor_repeats = args.max_new_tokens or 8, 1
    tiny = args.model == "tiny"
    args.task = args.task or ("toy" if tiny else "bfcl_live_simple")
    args.max_new_tokens = args.max_new_tokens or (16 if tiny else 96)
    args.embedder = args.embedder or ("hashing" if tiny else "minilm")
    if args.steps < 1 or args.warmup < 0 or args.trajectories < 1 or args.floor_repeats < 1:
        p.error("need --steps >= 1, --warmup >= 0, --trajectories >= 1, --floor-repeats >= 1")
    if args.grpo_group < 2:
        p.error("--grpo-group must be >= 2 (GRPO compares rollouts of one task)")
    for name in ("lopd_group", "grpo_group"):
        if args.trajectories % getattr(args, name):
            p.error(f"--trajectories {args.trajectories} is not a multiple of --{name.replace('_', '-')}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    return args


# ------------------------------------------------------------------------------------- timing
class TimedMemoryRefresh(MemoryRefresh):
    """MemoryRefresh whose cost is added to the step's ``step_timings["memory_refresh"]``."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        start = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        pl_module.step_timings["memory_refresh"] = time.perf_counter() - start


class StepTimer(Callback):
    """Per step: the module's phase timings and the whole step from the start of ``make_batch`` (generation
    runs in the DataModule's ``on_before_batch_transfer``, before ``on_train_batch_start``) to the end of
    ``on_train_batch_end``. Put it last among the callbacks."""

    def __init__(self, module):
        self.steps: list[dict[str, float]] = []
        self.batch_start: float | None = None
        self.last_batch = None
        original = module.make_batch

        def make_batch(task, examples):  # an instance attribute: the DataModule calls it like the method
            self.batch_start = time.perf_counter()
            return original(task, examples)

        module.make_batch = make_batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        total = time.perf_counter() - self.batch_start
        phases = {k: float(v) for k, v in pl_module.step_timings.items()}
        phases["other"] = max(0.0, total - sum(phases.values()))
        self.steps.append({**phases, "step_total": total, "trajectories": len(batch),
                           "assistant_tokens": int(batch.assistant_mask.sum())})
        self.last_batch = batch


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS of this process (VmHWM), so that a later read is one method's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def status_mb(field: str) -> float | None:
    """A memory field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``, ...) in MiB; None where unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


# ------------------------------------------------------------------------------------- runs
def reference_bank(module: LOPDModule, dm: OnPolicyDataModule, limit: int | None) -> int:
    """Fill the module's bank with the train split's reference solutions, replayed and scored (as
    ``lopd build-memory --from-references``): only those whose reward reaches the success threshold."""
    examples = dm.train_examples[:limit] if limit else dm.train_examples
    experiences = []
    for ex in examples:
        messages, reward = module.reference_trajectory(dm.task, ex)
        if reward >= module.hparams.success_threshold:
            exp = module.experience_from_trajectory(dm.task, ex, messages, reward)
            if exp is not None:
                experiences.append(exp)
    return module.bank.add(experiences)


def build(method: str, args: argparse.Namespace) -> tuple[Any, OnPolicyDataModule, list[Callback], dict[str, Any]]:
    common = dict(dtype=args.dtype, lora=LORA if args.lora else None, learning_rate=1e-4, grad_clip=1.0,
                  temperature=0.7, top_p=0.95, top_k=20, max_new_tokens=args.max_new_tokens, seed=args.seed,
                  gradient_checkpointing=bool(getattr(args, "gradient_checkpointing", False)),
                  generation_backend=getattr(args, "generation_backend", "hf"))
    info: dict[str, Any] = {}
    if method == "lopd":
        group = args.lopd_group
        module = LOPDModule(args.model, group_size=group, embedder=args.embedder, bank_path=None,
                            distill_chunk_size=getattr(args, "distill_chunk_size", None),
                            teacher_prefix_cache=getattr(args, "teacher_prefix_cache", True), **LOPD_SETTINGS, **common)
        callbacks: list[Callback] = [MarginSchedule(schedule="constant"), TimedMemoryRefresh(every_n_steps=1, min_reward=1.0)]
    else:
        group = args.grpo_group
        module = GRPOModule(args.model, group_size=group, **GRPO_SETTINGS, **common)
        callbacks = []
    dm = OnPolicyDataModule(args.task, examples_per_step=args.trajectories // group, val_limit=1, seed=args.seed)
    if method == "lopd":
        start = time.perf_counter()
        info["bank_size"] = reference_bank(module, dm, args.bank_limit)
        info["bank_build_s"] = round(time.perf_counter() - start, 3)
        if info["bank_size"] < module.hparams.num_experiences:
            raise SystemExit(f"the reference bank holds {info['bank_size']} experiences, fewer than J")
    info.update(tasks_per_step=args.trajectories // group, rollouts_per_task=group)
    return module, dm, callbacks, info


def run_method(method: str, args: argparse.Namespace) -> tuple[dict[str, Any], Any, Any]:
    """Train ``warmup + steps`` steps; the per-step timings of the measured ones and their medians."""
    L.seed_everything(args.seed, workers=False, verbose=False)
    module, dm, callbacks, info = build(method, args)
    timer = StepTimer(module)
    trainer = L.Trainer(
        max_steps=args.warmup + args.steps, accelerator="gpu" if args.device == "cuda" else "cpu", devices=1,
        precision="32-true" if args.dtype == "float32" else "bf16-true", logger=False, enable_checkpointing=False,
        limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, timer], default_root_dir=None,
    )
    rss_reset = _reset_peak_rss()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    fit_s = time.perf_counter() - start
    measured = timer.steps[args.warmup:]
    phases = sorted({k for s in measured for k in s} - {"step_total", "trajectories", "assistant_tokens"})
    # GRPO has no bank: make_batch times no retrieval for it (only phases that ran are timed)
    median = {k: round(_median([s.get(k, 0.0) for s in measured]), 6) for k in phases}
    result = {
        **info,
        "steps_measured": len(measured),
        "phases_median_s": median,
        "step_total_median_s": round(_median([s["step_total"] for s in measured]), 4),
        "step_excluding_generation_median_s": round(
            _median([s["step_total"] - s.get("generation", 0.0) for s in measured]), 4),
        "per_step": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()} for s in measured],
        "warmup_steps": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}
                         for s in timer.steps[: args.warmup]],
        "fit_s": round(fit_s, 2),
        "peak_rss_mb": status_mb("VmHWM") if rss_reset else None,
        "peak_rss_mb_process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "cuda_max_memory_allocated_mb": (round(torch.cuda.max_memory_allocated() / 2**20, 1)
                                         if args.device == "cuda" else None),
    }
    return result, module, timer.last_batch


def _timed(fn, repeats: int, device: str) -> float:
    runs = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def floor_units(module: LOPDModule, batch, args: argparse.Namespace) -> dict[str, float]:
    """Cost units measured on ``batch`` (LOPD's last), median of ``--floor-repeats``:

    - ``composer_path_s``: what LOPD must add to a GRPO step at least: the composer's forward, one teacher
      forward with the latents and the composer's backward through it (the frozen backbone), as the
      module's settings run them (logits, or hidden states with ``distill_chunk_size``; with
      ``teacher_prefix_cache`` the teacher's pass starts after the shared prompt, whose keys and values
      come with the student's forward in ``live`` mode, which GRPO runs too, so they are made outside the
      timed call, and inside it otherwise);
    - ``teacher_forward_unit_s``: one plain no-grad student forward of the batch (a whole-sequence teacher
      forward without context);
    - ``composer_forward_s`` / ``composer_fwd_bwd_s``: the composer's own graph (encoder pass and
      resampler), without and with its backward, no teacher pass;
    - ``anchor_forward_s``: the frozen anchor composer's forward (the anchor term's c_phi0);
    - ``student_update_warm_s`` / ``lopd_update_warm_s``: a GRPO-like student forward + backward, and
      LOPD's ``losses`` + backward, repeated on this batch (warm: the same shapes again, the memory of the
      previous repeat reused), to compare the update with its floor (``student_update_warm_s`` +
      ``composer_path_s``) without the in-run cost of new batches.
    """
    from lopd_lightning.teacher import prefix_length

    from lopd_lightning.losses import token_logps

    module.train()
    batch = batch.to(module.device)
    targets, mask = module.shifted(batch)
    positions = module.unshift(mask)
    n_prefix = prefix_length(batch.attention_mask, batch.context_position) if module.hparams.teacher_prefix_cache else 0
    shared = module.teacher.shares_student_weights  # the prefix comes with the student's forward, else it is extra
    prefix = module.teacher.own_prefix(batch.input_ids, batch.attention_mask, n_prefix) if n_prefix and shared else None

    def zero_composer_grads():
        for p in module.composer.trainable_parameters():
            p.grad = None

    def forward():
        with torch.no_grad():
            module.student_forward(batch, mask).values

    def composer_forward():
        with torch.no_grad():
            module.batch_latents(batch)

    def composer():
        composed = module.batch_latents(batch)
        (composed.latents.float() ** 2).mean().backward()
        zero_composer_grads()

    def composer_path():
        own = module.teacher.own_prefix(batch.input_ids, batch.attention_mask, n_prefix) if n_prefix and not shared else None
        composed = module.batch_latents(batch)
        teacher = (module.teacher.hidden_on_student_positions if module.hparams.get("distill_chunk_size")
                   else module.teacher.logits_on_student_positions)
        out = teacher(batch.input_ids, batch.attention_mask, batch.context_position, positions=positions,
                      latents=composed.latents, latent_mask=composed.latent_mask, prefix=prefix or own)
        out.float().logsumexp(-1).mean().backward()
        zero_composer_grads()

    def anchor():
        module.anchor_latents(batch)

    def student_update():  # a GRPO-like update of the student on this batch: forward + backward, no step
        logits = module.student_forward(batch, mask).values
        token_logps(logits[None], targets[mask][None])[0].mean().backward()
        module.zero_grad(set_to_none=True)

    def lopd_update():  # LOPD's forwards, losses and one backward on this batch, no step
        out = module.losses(batch)
        (out.loss_student + out.loss_composer).backward()
        module.zero_grad(set_to_none=True)

    units = {"composer_path_s": composer_path, "teacher_forward_unit_s": forward,
             "composer_forward_s": composer_forward, "composer_fwd_bwd_s": composer, "anchor_forward_s": anchor,
             "student_update_warm_s": student_update, "lopd_update_warm_s": lopd_update}
    for fn in units.values():  # one untimed call each
        fn()
    return {name: round(_timed(fn, args.floor_repeats, args.device), 4) for name, fn in units.items()}


def _distance(measured: float, floor: float) -> dict[str, Any]:
    return {"measured_s": round(measured, 4), "floor_s": round(floor, 4), "excess_s": round(measured - floor, 4),
            "ratio": round(measured / floor, 3) if floor > 0 else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    t_start = time.perf_counter()

    methods: dict[str, Any] = {}
    grpo, _, _ = run_method("grpo", args)
    methods["grpo"] = grpo
    print({"grpo": grpo["phases_median_s"], "step": grpo["step_total_median_s"]}, file=sys.stderr)
    lopd, module, batch = run_method("lopd", args)
    methods["lopd"] = lopd
    print({"lopd": lopd["phases_median_s"], "step": lopd["step_total_median_s"]}, file=sys.stderr)
    units = floor_units(module, batch, args)

    ratio = lopd["step_total_median_s"] / grpo["step_total_median_s"]
    ratio_ex = lopd["step_excluding_generation_median_s"] / grpo["step_excluding_generation_median_s"]
    lp, gp = lopd["phases_median_s"], grpo["phases_median_s"]
    grpo_update = sum(v for k, v in gp.items() if k not in ("generation", "retrieval", "other"))
    floor_lopd = grpo["step_total_median_s"] + units["composer_path_s"]
    distance = {
        "generation": _distance(lp.get("generation", 0.0), gp.get("generation", 0.0)),
        "retrieval": _distance(lp.get("retrieval", 0.0), 0.0),
        "teacher_and_update": _distance(sum(lp.get(k, 0.0) for k in ("teacher", *UPDATE_PHASES)),
                                        grpo_update + units["composer_path_s"]),
        "memory_refresh": _distance(lp.get("memory_refresh", 0.0), 0.0),
        "other": _distance(lp.get("other", 0.0), gp.get("other", 0.0)),
        "step_total": _distance(lopd["step_total_median_s"], floor_lopd),
    }
    report: dict[str, Any] = {
        "benchmark": "step_cost",
        "model": args.model,
        "task": args.task,
        "settings": {"trajectories": args.trajectories, "lopd_layout": f"{lopd['tasks_per_step']}x{lopd['rollouts_per_task']}",
                     "grpo_layout": f"{grpo['tasks_per_step']}x{grpo['rollouts_per_task']}", "steps": args.steps,
                     "warmup": args.warmup, "threads": args.threads, "device": args.device, "dtype": args.dtype,
                     "generation_backend": args.generation_backend,
                     "lora": LORA if args.lora else None, "max_new_tokens": args.max_new_tokens,
                     "embedder": args.embedder, "lopd": LOPD_SETTINGS, "grpo": GRPO_SETTINGS,
                     "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 20}, "quick": args.quick,
                     "gradient_checkpointing": bool(getattr(args, "gradient_checkpointing", False)),
                     "distill_chunk_size": getattr(args, "distill_chunk_size", None),
                     "teacher_prefix_cache": getattr(args, "teacher_prefix_cache", True)},
        "methods": methods,
        "ratio_lopd_over_grpo": round(ratio, 4),
        "ratio_excluding_generation": round(ratio_ex, 4),
        "floor": {**units, "grpo_step_s": grpo["step_total_median_s"], "floor_lopd_s": round(floor_lopd, 4),
                  "floor_ratio": round(floor_lopd / grpo["step_total_median_s"], 4),
                  "update_warm_ratio_to_floor": round(
                      units["lopd_update_warm_s"] / (units["student_update_warm_s"] + units["composer_path_s"]), 4)},
        "distance_to_floor": distance,
        "floor_explanation": (
            "floor_lopd_s = GRPO's median step + composer_path_s: the composer's forward, one teacher forward "
            "with the latents and the composer's backward through the frozen backbone, on LOPD's last batch "
            "with the module's settings (teacher_prefix_cache: the teacher's pass starts after the prompt "
            "it shares with the student). That is the issue's floor: one extra teacher forward and one "
            "composer backward, which reaches the composer through the teacher's pass. Not in it: the anchor "
            "composer's forward (anchor_forward_s, the anchor term) and the optimiser steps. distance_to_floor: "
            "generation vs GRPO's generation (same trajectory count); teacher_and_update (teacher + "
            "student_step + backward + composer_step) vs GRPO's update + composer_path_s; retrieval and "
            "memory_refresh vs 0; other (Lightning, logging, transfer) vs GRPO's; ratio = measured / floor "
            "(null for a 0 floor). teacher_forward_unit_s (a plain no-grad whole-sequence forward) and "
            "composer_fwd_bwd_s (the composer's own graph) are reference units. update_warm_ratio_to_floor = "
            "lopd_update_warm_s / (student_update_warm_s + composer_path_s): LOPD's update against its floor "
            "on one batch, both repeated warm (in a run every step's batch is new, which costs more)."
        ),
        "target": {"ratio_lopd_over_grpo": TARGET_RATIO, "met": bool(ratio <= TARGET_RATIO)},
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        **run_metadata(seed=args.seed, argv=argv),
    }
    write_json_atomic(report, args.out)
    return report


if __name__ == "__main__":
    main()
