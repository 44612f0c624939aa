"""This project's GRPO and SDPO against TRL's ``GRPOTrainer`` and ``trl.experimental.sdpo.SDPOTrainer``, side by side.

Measures trajectories per second of real training steps and each process's peak RSS, with the two sides set
the same wherever TRL's options allow (issue 34, item 4):

- the same student (``--student``: the packaged SmolLM2-135M-Instruct by default; the quickstart's SFT
  student or any folder this project saves, loaded by :func:`lopd_lightning.models.load_student` on both
  sides), the same LoRA (``step_cost.LORA``: r16 / alpha 32 on every projection), float32, no gradient
  checkpointing, HF ``generate`` on both sides, the same torch thread count (``--threads``);
- the same task and prompts (BFCL live_simple; the examples this project's DataModule serves, in its order,
  given to TRL as a conversational dataset that it does not shuffle) and the same rewards (this project's
  checker, :class:`TaskReward`, wrapped as a TRL reward function);
- the same layout (``--tasks-per-step`` tasks x ``--group`` rollouts), ``--max-new-tokens``, sampling
  (T 0.7, top_p 0.95, top_k 20), optimiser (AdamW lr 1e-4, no weight decay, constant, clip 1.0);
- GRPO: PPO-clip eps 0.2 both sides, one pass (TRL ``num_iterations=1``: ratio 1), no reference (TRL
  ``beta=0``), group-std advantages with eps 1e-4 (TRL ``scale_rewards="group"``), the global token mean
  (TRL ``loss_type="dapo"``), log-probs at the sampling temperature (TRL's; here ``logps_temperature``);
- SDPO: an EMA teacher at rate 0.05 updated each step, reprompted with the first other successful sibling
  (reward >= 1) in this project's words (TRL's ``reprompt_template`` / ``solution_template`` set to
  ``SDPO_DEMO_TEMPLATE`` + ``SDPO_CONTEXT_SUFFIX`` before the task), no environment feedback on either side,
  reverse KL on the student's top-20 plus a tail bucket, importance clip 2.0, pure distillation
  (TRL ``distillation_weight=1``), logits at the sampling temperature (here ``distill_temperature``).

What cannot be matched is listed in the JSON's ``settings.unmatched`` (:data:`UNMATCHED`).

Protocol: ``--pairings`` pairings; in each, per method, the two sides run one after the other, each in a fresh
subprocess (``--child``), the order alternating between pairings (this project first in even pairings).
Each child trains ``--warmup + --steps`` steps from the same seed (``--seed`` + pairing) and measures
trajectories/s over the measured steps: ``steps x tasks_per_step x group`` over the wall time from the end of
the last warm-up step to the end of the last step (everything in between: generation, rewards, teacher,
update, the frameworks' own work). Peak RSS: the child's ``ru_maxrss`` (model loading included, both sides).
``--methods`` may add ``lopd`` (this project's LOPD with ``step_cost``'s settings, ``--group`` rollouts per
task, reported beside TRL's SDPO: LOPD has no TRL counterpart).

Resuming: each finished child's result is kept as ``<--runs-dir>/p<k>_<method>_<side>_<key hash>.json``
(default ``runs/vs_trl``) with the key it ran under (:func:`resume_fields`: the interpreter, the child's
arguments, a hash of ``src/`` and the benchmark's files, the start student's weights hash, the library
versions, the CPU model and torch's CPU capability) and the id of the call that ran it. A call that is cut (a
session's end) is continued by the same command: a pairing's method whose sides are all kept with a matching
key from one call is read back; otherwise both sides run again, back to back (:func:`run_children`; a line
says why). ``--no-resume`` runs every child again. A child during which the code or the student changed is
not kept.

Run (in the environment of ``make bench-peer``, which holds trl; the library never imports it)::

    python benchmarks/vs_trl.py [--student smollm2-135m-instruct|FOLDER] [--task bfcl_live_simple]
                                [--methods grpo,sdpo,lopd] [--pairings 3] [--steps 3] [--warmup 1]
                                [--tasks-per-step 2] [--group 4] [--max-new-tokens 96] [--threads 1]
                                [--runs-dir runs/vs_trl] [--no-resume] [--out benchmarks/results/vs_trl.json]

The JSON is ``{"benchmark": "vs_trl", "student", "task", "settings", "speedup_over_trl": {method: {"median",
"per_pairing"}}, "peak_rss_mb": {method: {"ours", "trl"}}, "trajectories_per_s", "lopd_beside_trl_sdpo",
"reward_curves", "runs", "resumed_runs"}`` plus :func:`common.run_metadata`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common`, `step_cost` next to this file
from common import REPO_ROOT, cpu_capability, cpu_model, run_metadata, write_json_atomic  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "vs_trl.json"
DEFAULT_RUNS_DIR = REPO_ROOT / "runs" / "vs_trl"
#: the benchmark's own files whose bytes enter the code hash beside src/ (:func:`code_hash`).
BENCHMARK_FILES = ("vs_trl.py", "step_cost.py", "common.py")
METHODS = ("grpo", "sdpo", "lopd")
#: methods with a TRL side (lopd is reported beside TRL's SDPO).
PEERS = ("grpo", "sdpo")
TRL_VERSION = "1.16.0"
#: sampling and optimiser of both sides (configs/compare's).
SAMPLING = {"temperature": 0.7, "top_p": 0.95, "top_k": 20}
OPTIMISER = {"learning_rate": 1e-4, "weight_decay": 0.0, "max_grad_norm": 1.0, "adam_betas": [0.9, 0.999],
             "adam_epsilon": 1e-8, "lr_schedule": "constant"}
#: GRPO's loss settings (this project's names); TRL's equivalents in :func:`trl_config_kwargs`.
GRPO_LOSS = {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "kl_coef": 0.0, "ppo_epochs": 1, "advantage_eps": 1e-4}
#: SDPO's loss and teacher settings (this project's names).
SDPO_LOSS = {"teacher_ema_rate": 0.05, "divergence": "topk_reverse_kl", "distill_top_k": 20, "topk_support": "student",
             "is_clip": 2.0, "allow_self_demo": False, "include_feedback": False, "success_threshold": 1.0}
#: What the two sides do differently whatever the options (recorded in settings.unmatched).
UNMATCHED = [
    "prompt tokenization: this project tokenizes the rendered prompt in two pieces split where the first user "
    "message's content starts (rollout.chat.encode_prompt), TRL in one piece; settings.prompt_tokens_equal "
    "gives the fraction of the run's prompts whose ids agree",
    "SDPO loss aggregation: this project takes the global token mean over the kept rows (those shown a "
    "sibling); TRL takes each row's token mean, then the mean over all rows (rows without a sibling add 0). "
    "The gradient's scale differs, not the work done",
    "SDPO demonstration text: this project shows the sibling's reply text (truncated to max_demo_chars 4000); "
    "TRL decodes the sibling's completion ids without special tokens (cut at max_reprompt_len tokens)",
    "SDPO rows without a sibling: this project leaves them out of the teacher's forward; TRL runs the teacher "
    "on every row (with the plain prompt) and masks the loss",
    "generation: this project samples each group's rollouts from one shared prompt prefill; TRL repeats the "
    "prompt G times in the generate batch. Both stop at EOS or max_new_tokens",
    "framework: Lightning manual optimisation here, transformers.Trainer + accelerate in TRL (its per-step "
    "metrics are gathered even with logging off)",
    "random streams: the seeds are the same, but the two sides draw their samples in different orders, so the "
    "rollouts (and the reward curves) differ",
]


# ------------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file to write")
    p.add_argument("--student", default="smollm2-135m-instruct",
                   help="'smollm2-135m-instruct' (packaged), 'tiny', a Hugging Face folder or an adapter folder")
    p.add_argument("--task", default=None, help="task name (default: bfcl_live_simple; toy for --student tiny)")
    p.add_argument("--methods", default="grpo,sdpo,lopd", help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--pairings", type=int, default=3, help="pairings of fresh processes per method (median)")
    p.add_argument("--steps", type=int, default=3, help="measured training steps per run")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them (>= 1)")
    p.add_argument("--tasks-per-step", type=int, default=2, help="tasks per step")
    p.add_argument("--group", type=int, default=4, help="rollouts per task G (>= 2), both sides")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per reply (default 96; 16 for tiny)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of every run")
    p.add_argument("--seed", type=int, default=0, help="pairing k runs both sides with seed + k")
    p.add_argument("--runs-dir", type=Path, default=DEFAULT_RUNS_DIR,
                   help="each finished child's result, read back by a later call with the same key (resuming)")
    p.add_argument("--no-resume", action="store_true", help="run every child again, whatever --runs-dir holds")
    p.add_argument("--quick", action="store_true", help="tests: tiny student, toy task, 1 pairing, 1+1 steps")
    p.add_argument("--child", nargs=2, metavar=("SIDE", "METHOD"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-seed", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.student, args.pairings, args.steps, args.warmup = "tiny", 1, 1, 1
        args.max_new_tokens = args.max_new_tokens or 8
    if args.student not in ("tiny", "smollm2-135m-instruct") and not Path(args.student).is_dir():
        p.error(f"--student {args.student!r} is no folder; give a Hugging Face or adapter folder (make quickstart "
                "writes runs/quickstart/sft_student), 'smollm2-135m-instruct' or 'tiny'")
    if Path(args.student).is_dir():  # one absolute path: the children and the resume key's weights hash read it
        args.student = str(Path(args.student).resolve())
    if args.runs_dir.exists() and not args.runs_dir.is_dir():
        p.error(f"--runs-dir {args.runs_dir} is a file: give a folder (default {DEFAULT_RUNS_DIR})")
    tiny = args.student == "tiny"
    args.task = args.task or ("toy" if tiny else "bfcl_live_simple")
    args.max_new_tokens = args.max_new_tokens or (16 if tiny else 96)
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown or not args.method_list:
        p.error(f"--methods {args.methods!r}: give a comma-separated list of {', '.join(METHODS)}")
    for name, low in (("pairings", 1), ("steps", 1), ("warmup", 1), ("tasks_per_step", 1), ("threads", 1),
                      ("max_new_tokens", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}"
                    + (" (the timing starts at the end of a warm-up step)" if name == "warmup" else ""))
    if args.group < 2:
        p.error(f"--group must be >= 2 (GRPO and SDPO compare rollouts of one task), got {args.group}")
    if args.child is not None:
        side, method = args.child
        if side not in ("ours", "trl") or method not in METHODS or (side == "trl" and method not in PEERS):
            p.error(f"--child {side} {method}: side is ours or trl, method one of {METHODS} (trl: {PEERS})")
        if args.child_out is None:
            p.error("--child needs --child-out FILE")
    return args


def child_argv(args: argparse.Namespace, side: str, method: str, seed: int, out: Path) -> list[str]:
    """The command line of one run: this script with the parent's settings (``--methods``: the child's own
    method) and ``--child SIDE METHOD``."""
    return [sys.executable, str(Path(__file__).resolve()), "--student", str(args.student), "--task", args.task,
            "--methods", method, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--tasks-per-step", str(args.tasks_per_step), "--group", str(args.group),
            "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads), "--seed", str(args.seed),
            "--child", side, method, "--child-out", str(out), "--child-seed", str(seed)]


def run_order(pairings: int, methods: list[str]) -> list[tuple[int, str, str]]:
    """``(pairing, method, side)`` in the order the runs go: per pairing and method, this project first in
    even pairings and TRL first in odd ones; ``lopd`` (no TRL side) right after SDPO's pair."""
    order = []
    for k in range(pairings):
        for method in methods:
            if method not in PEERS:
                continue
            sides = ("ours", "trl") if k % 2 == 0 else ("trl", "ours")
            order += [(k, method, side) for side in sides]
            if method == "sdpo" and "lopd" in methods:
                order.append((k, "lopd", "ours"))
        if "lopd" in methods and "sdpo" not in methods:
            order.append((k, "lopd", "ours"))
    return order


# ------------------------------------------------------------------------------------- matched settings
def our_module_kwargs(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of this project's module for ``method`` (grpo or sdpo), the matched settings."""
    from step_cost import LORA

    common = dict(dtype="float32", lora=LORA, learning_rate=OPTIMISER["learning_rate"],
                  weight_decay=OPTIMISER["weight_decay"], grad_clip=OPTIMISER["max_grad_norm"], **SAMPLING,
                  max_new_tokens=args.max_new_tokens, gradient_checkpointing=False, generation_backend="hf",
                  group_size=args.group)
    if method == "grpo":  # TRL scores its log-probs at the sampling temperature
        return {**common, **GRPO_LOSS, "logps_temperature": SAMPLING["temperature"]}
    if method == "sdpo":
        return {**common, **SDPO_LOSS, "distill_temperature": SAMPLING["temperature"]}
    raise ValueError(f"no matched module settings for method {method!r}; give grpo or sdpo")


def trl_config_kwargs(method: str, args: argparse.Namespace, *, seed: int, output_dir: str) -> dict[str, Any]:
    """Keyword arguments of TRL's ``GRPOConfig`` / ``SDPOConfig`` matching :func:`our_module_kwargs` (TRL
    1.16.0's option names; bf16 and gradient checkpointing, on by TRL's defaults, set off)."""
    from lopd_lightning.modules.sdpo import SDPO_CONTEXT_SUFFIX, SDPO_DEMO_TEMPLATE

    batch = args.tasks_per_step * args.group
    kw: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=args.group, max_completion_length=args.max_new_tokens, **SAMPLING,
        learning_rate=OPTIMISER["learning_rate"], weight_decay=OPTIMISER["weight_decay"],
        max_grad_norm=OPTIMISER["max_grad_norm"], adam_beta1=OPTIMISER["adam_betas"][0],
        adam_beta2=OPTIMISER["adam_betas"][1], adam_epsilon=OPTIMISER["adam_epsilon"], optim="adamw_torch",
        lr_scheduler_type="constant", warmup_steps=0, max_steps=args.warmup + args.steps,
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, use_vllm=False,
        beta=0.0, num_iterations=1, epsilon=GRPO_LOSS["clip_eps_low"], epsilon_high=GRPO_LOSS["clip_eps_high"],
        scale_rewards="group", loss_type="dapo", importance_sampling_level="token", mask_truncated_completions=False,
        shuffle_dataset=False, seed=seed, data_seed=seed, report_to="none", save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False,
        remove_unused_columns=False,
    )
    if method == "sdpo":
        kw.update(
            max_prompt_length=None,  # this project never truncates prompts
            distillation_weight=1.0, distillation_mode="topk_logits", distillation_topk=SDPO_LOSS["distill_top_k"],
            distillation_add_tail=True, distillation_alpha=1.0, distillation_is_clip=SDPO_LOSS["is_clip"],
            teacher_model_kind="ema", teacher_update_rate=SDPO_LOSS["teacher_ema_rate"], teacher_sync_steps=1,
            use_successful_as_teacher=True, success_reward_threshold=SDPO_LOSS["success_threshold"],
            dont_reprompt_on_self_success=not SDPO_LOSS["allow_self_demo"],
            include_environment_feedback=SDPO_LOSS["include_feedback"],
            solution_template=SDPO_DEMO_TEMPLATE.replace("{demo}", "{successful_previous_attempt}"),
            reprompt_template="{solution}{feedback}" + SDPO_CONTEXT_SUFFIX + "{prompt}",
            diagnostics_warning_interval=0,
        )
    elif method != "grpo":
        raise ValueError(f"TRL has no trainer matched to method {method!r} here; give grpo or sdpo")
    return kw


#: TRL config fields read back into settings.trl (after the trainer is built).
TRL_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "num_generations",
              "max_completion_length", "temperature", "top_p", "top_k", "learning_rate", "weight_decay",
              "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon", "optim", "lr_scheduler_type", "max_steps",
              "bf16", "fp16", "gradient_checkpointing", "use_cpu", "use_vllm", "beta", "num_iterations", "epsilon",
              "epsilon_high", "scale_rewards", "loss_type", "importance_sampling_level", "mask_truncated_completions",
              "shuffle_dataset", "seed", "max_prompt_length", "distillation_weight", "distillation_mode",
              "distillation_topk", "distillation_add_tail", "distillation_alpha", "distillation_is_clip",
              "teacher_model_kind", "teacher_update_rate", "teacher_sync_steps", "success_reward_threshold",
              "dont_reprompt_on_self_success", "include_environment_feedback", "solution_template",
              "reprompt_template")


def _plain(value: Any) -> Any:
    """A JSON-able form of a config value (enums by value, sets and tuples as lists, others as str)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "value"):
        return _plain(value.value)
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in sorted(value, key=str)] if isinstance(value, set | frozenset) else [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def lora_read_back(model: Any) -> dict[str, Any] | None:
    """The trained LoRA's settings as the wrapped model holds them (``peft_config``'s active adapter)."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    name = getattr(model, "active_adapter", None)
    name = name if isinstance(name, str) and name in configs else next(iter(configs))
    c = configs[name]
    return {"adapter": name, "r": c.r, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
            "target_modules": sorted(_plain(c.target_modules))}


def model_dtype(model: Any) -> str:
    return str(next(model.parameters()).dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------- the task's reward
class TaskReward:
    """This project's checker as a TRL reward function: ``(prompts, completions, example_id, ...) -> [float]``.

    Each completion (conversational: ``[{"role": "assistant", "content": text}]``, or a string) is played as
    the one reply of a fresh episode of its example (``task.start``) and scored through
    :func:`lopd_lightning.tasks.base.episode_reward`, as this project's rollouts score a single-turn reply.
    Every call's rewards are kept in :attr:`calls` (one call per TRL step), the completion lengths in tokens
    in :attr:`completion_tokens`.
    """

    __name__ = "task_reward"  # TRL names its reward metrics by the function's __name__

    def __init__(self, task: Any, examples: dict[str, Any]):
        self.task, self.examples = task, examples
        self.calls: list[list[float]] = []
        self.completion_tokens: list[int] = []

    def __call__(self, prompts: list[Any], completions: list[Any], example_id: list[str],
                 completion_ids: list[list[int]] | None = None, **_: Any) -> list[float]:
        from lopd_lightning.tasks.base import episode_reward

        rewards = []
        for completion, eid in zip(completions, example_id, strict=True):
            text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
            example = self.examples[eid]
            episode = self.task.start(example)
            episode.step(text)
            rewards.append(episode_reward(self.task, example, episode))
        self.calls.append(rewards)
        self.completion_tokens.append(sum(len(ids) for ids in completion_ids or []))
        return rewards


def step_examples(args: argparse.Namespace, seed: int):
    """(task, the examples this project's DataModule serves over the run's steps, in order, ``tasks_per_step``
    a step). The TRL side gets the same rows, unshuffled."""
    from lopd_lightning.data import OnPolicyDataModule

    dm = OnPolicyDataModule(args.task, examples_per_step=args.tasks_per_step, val_limit=1, seed=seed)
    if getattr(dm.task, "multi_turn", False):
        raise SystemExit(f"--task {args.task!r} is multi-turn; TRL's trainers here play one reply: give a single-turn task")
    steps = args.warmup + args.steps
    return dm.task, [ex for s in range(steps) for ex in dm.examples_at(s * args.tasks_per_step)]


def prompt_tokens_equal(task: Any, tokenizer: Any, examples: list[Any]) -> float:
    """The fraction of ``examples`` whose prompt ids agree between this project's encoding
    (:func:`lopd_lightning.rollout.chat.encode_prompt`) and TRL's (``apply_chat_template(tokenize=True)``)."""
    from lopd_lightning.rollout.chat import encode_prompt

    same = 0
    for ex in examples:
        messages = task.initial_messages(ex)
        ours = encode_prompt(tokenizer, messages, tools=task.tools(ex)).input_ids
        theirs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        same += list(ours) == list(theirs["input_ids"])
    return same / max(1, len(examples))


# ------------------------------------------------------------------------------------- one run (a child)
def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _throughput(step_ends: list[float], warmup: int, trajectories: int) -> float:
    """Trajectories per second from the end of step ``warmup`` (1-based) to the last step's end."""
    measured = len(step_ends) - warmup
    span = step_ends[-1] - step_ends[warmup - 1]
    return measured * trajectories / span if measured > 0 and span > 0 else 0.0


def run_ours(method: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Train this project's ``method`` module ``warmup + steps`` steps with the Lightning Trainer of
    ``step_cost``; step end times, per-step rewards and completion tokens, the module's settings read back."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.modules import GRPOModule, SDPOModule

    class Recorder(Callback):
        def __init__(self):
            self.ends: list[float] = []
            self.rewards: list[list[float]] = []
            self.tokens: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())
            self.rewards.append([float(r) for r in batch.rewards.tolist()])
            self.tokens.append(int(batch.assistant_mask.sum()))

    L.seed_everything(seed, workers=False, verbose=False)
    info: dict[str, Any] = {}
    if method == "lopd":
        import step_cost

        ns = argparse.Namespace(model=args.student, task=args.task, trajectories=args.tasks_per_step * args.group,
                                lopd_group=args.group, grpo_group=args.group, dtype="float32", lora=True,
                                max_new_tokens=args.max_new_tokens, seed=seed, embedder="hashing" if args.student == "tiny" else "minilm",
                                bank_limit=None, gradient_checkpointing=False, generation_backend="hf",
                                distill_chunk_size=None, teacher_prefix_cache=True)
        module, dm, callbacks, info = step_cost.build("lopd", ns)
    else:
        cls = GRPOModule if method == "grpo" else SDPOModule
        module = cls(args.student, seed=seed, **our_module_kwargs(method, args))
        dm = OnPolicyDataModule(args.task, examples_per_step=args.tasks_per_step, val_limit=1, seed=seed)
        callbacks = []
    recorder = Recorder()
    trainer = L.Trainer(max_steps=args.warmup + args.steps, accelerator="cpu", devices=1, precision="32-true",
                        logger=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[*callbacks, recorder])
    trainer.fit(module, datamodule=dm)
    hp = dict(module.hparams)
    settings = {k: _plain(hp.get(k)) for k in sorted(hp) if k not in ("model",)}
    settings.update(torch_threads=__import__("torch").get_num_threads(), dtype_read_back=model_dtype(module.backbone),
                    lora_read_back=lora_read_back(module.backbone), student=str(args.student))
    return {"ends": recorder.ends, "rewards": recorder.rewards, "completion_tokens": recorder.tokens,
            "settings": settings, "info": info}


def run_trl(method: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Train TRL's trainer for ``method`` (``GRPOTrainer`` or ``trl.experimental.sdpo.SDPOTrainer``) the same
    ``warmup + steps`` steps on the same student, LoRA, prompts and rewards; its config read back."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    import trl
    from lopd_lightning.models import load_student
    from step_cost import LORA

    class Recorder(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, targs, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    task, examples = step_examples(args, seed)
    reward = TaskReward(task, {ex.id: ex for ex in examples})
    dataset = Dataset.from_list([{"prompt": task.initial_messages(ex), "example_id": ex.id} for ex in examples])
    model, tokenizer = load_student(str(args.student), dtype="float32", seed=seed)
    lora = LoraConfig(task_type="CAUSAL_LM", **LORA)
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as out_dir:
        kwargs = trl_config_kwargs(method, args, seed=seed, output_dir=out_dir)
        if method == "grpo":
            from trl import GRPOConfig, GRPOTrainer

            config_cls, trainer_cls = GRPOConfig, GRPOTrainer
        else:
            from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

            config_cls, trainer_cls = SDPOConfig, SDPOTrainer
        config = config_cls(**kwargs)
        recorder = Recorder()
        trainer = trainer_cls(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, peft_config=lora, callbacks=[recorder])
        torch.set_num_threads(args.threads)  # after TRL's set-up, in case it changed them
        read_back = {k: _plain(getattr(trainer.args, k)) for k in TRL_FIELDS if hasattr(trainer.args, k)}
        gen = getattr(trainer, "generation_config", None)
        read_back.update(
            trl_version=trl.__version__, trainer=type(trainer).__name__,
            dtype_read_back=model_dtype(trainer.model), lora_read_back=lora_read_back(trainer.model),
            generation_config={k: _plain(getattr(gen, k, None)) for k in
                               ("do_sample", "temperature", "top_p", "top_k", "max_new_tokens")} if gen else None,
            prompt_tokens_equal=round(prompt_tokens_equal(task, tokenizer, examples), 4),
            has_reference_model=getattr(trainer, "ref_model", None) is not None)
        trainer.train()
        read_back["torch_threads"] = torch.get_num_threads()
    return {"ends": recorder.ends, "rewards": reward.calls, "completion_tokens": reward.completion_tokens,
            "settings": read_back, "info": {}}


def child_main(args: argparse.Namespace) -> None:
    """One side of one method in this process: the result JSON to ``--child-out``."""
    import logging
    import warnings

    import torch

    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    side, method = args.child
    seed = args.seed if args.child_seed is None else args.child_seed
    start = time.perf_counter()
    out = (run_ours if side == "ours" else run_trl)(method, args, seed)
    trajectories = args.tasks_per_step * args.group
    ends = out["ends"]
    if len(ends) != args.warmup + args.steps:
        raise SystemExit(f"{side} {method}: {len(ends)} steps ran, expected {args.warmup + args.steps}")
    span = ends[-1] - ends[args.warmup - 1]
    result = {
        "side": side, "method": method, "seed": seed, "steps_measured": args.steps, "warmup": args.warmup,
        "trajectories_per_step": trajectories,
        "trajectories_per_s": round(_throughput(ends, args.warmup, trajectories), 5),
        "completion_tokens_per_s": round(sum(out["completion_tokens"][args.warmup:]) / span, 3) if span > 0 else 0.0,
        "step_s": [round(b - a, 4) for a, b in zip(ends, ends[1:])],
        "mean_reward_per_step": [round(statistics.fmean(r), 4) if r else None for r in out["rewards"]],
        "rewards_per_step": out["rewards"], "completion_tokens_per_step": out["completion_tokens"],
        "peak_rss_mb": _peak_rss_mb(), "wall_s": round(time.perf_counter() - start, 2),
        "settings": out["settings"], **out["info"],
    }
    write_json_atomic(result, args.child_out)


# ------------------------------------------------------------------------------------- running and resuming
def code_hash(root: Path = REPO_ROOT) -> str:
    """16 hex digits over ``src/`` (``compare_runs.src_provenance``'s ``src_hash``: committed or not) and the
    bytes of :data:`BENCHMARK_FILES`: the code a child runs."""
    from compare_runs import src_provenance

    digest = hashlib.sha256(src_provenance(root)["src_hash"].encode())
    for name in BENCHMARK_FILES:
        digest.update(name.encode() + b"\0" + (root / "benchmarks" / name).read_bytes())
    return digest.hexdigest()[:16]


def _key_libraries() -> tuple[str, ...]:
    """What the versions in a resume key cover: ``compare_provenance.LIBRARIES`` plus TRL and accelerate."""
    from compare_provenance import LIBRARIES

    return (*LIBRARIES, "trl", "accelerate")


def machine_fields(student: str) -> dict[str, Any]:
    """The part of :func:`resume_fields` that every child of a call shares: :func:`code_hash`, the start
    student's weights (``compare_provenance.student_hash``: None for a packaged name), the library versions of
    this interpreter (:func:`_key_libraries`, from package metadata), the CPU model and torch's CPU capability
    (float kernels and speed differ between them)."""
    from compare_provenance import library_versions, student_hash

    return {"code_hash": code_hash(), "student_hash": student_hash(student),
            "versions": library_versions(sys.executable, _key_libraries()), "cpu": cpu_model(),
            "cpu_capability": cpu_capability()}


def resume_fields(cmd: list[str], machine: dict[str, Any]) -> dict[str, Any]:
    """What a kept child result must share with a child about to run to stand in for it: the interpreter
    (``cmd[0]``), the child's arguments (``cmd`` without the interpreter, the script's path and ``--child-out``)
    and :func:`machine_fields`."""
    settings = list(cmd[2:])
    if "--child-out" in settings:
        i = settings.index("--child-out")
        del settings[i:i + 2]
    return {"python": cmd[0], "child_argv": settings, **machine}


def kept_path(runs_dir: Path, k: int, method: str, side: str, fields: dict[str, Any]) -> Path:
    """``<runs_dir>/p<k>_<method>_<side>_<12 hex of fields>.json``: results of other settings (a ``--quick``
    check, another student) live beside it instead of replacing it."""
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    return runs_dir / f"p{k}_{method}_{side}_{digest}.json"


def _differing(before: dict[str, Any], fields: dict[str, Any]) -> list[str]:
    """The names of ``fields`` whose values ``before`` does not share."""
    return [name for name in fields if before.get(name) != fields[name]]


def kept_result(path: Path, fields: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """``(result, why)``: the kept result at ``path`` when it is a JSON object whose ``resume`` fields equal
    ``fields``; else None and why it cannot stand in: no file (then what the newest kept result of the same
    pairing, method and side ran with differently, if there is one), unreadable, no ``resume`` key, or which
    fields differ."""
    if not path.is_file():
        prefix = path.name.rsplit("_", 1)[0]
        others = sorted(path.parent.glob(f"{prefix}_*.json"), key=lambda q: q.stat().st_mtime)
        if others:
            try:
                differ = _differing(json.loads(others[-1].read_text()).get("resume") or {}, fields)
                return None, f"{others[-1].name} ran with another {', '.join(differ) or 'key'}"
            except (OSError, ValueError, AttributeError):
                pass
        return None, "no kept result"
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return None, f"{path} is unreadable ({error})"
    before = kept.get("resume") if isinstance(kept, dict) else None
    if not isinstance(before, dict):
        return None, f"{path} has no resume key"
    differ = _differing(before, fields)
    if differ:
        return None, f"{path} ran with another {', '.join(differ)}"
    return kept, "same settings, code, libraries and CPU"


def run_units(pairings: int, methods: list[str]) -> list[tuple[int, str, list[str]]]:
    """:func:`run_order` grouped into what is kept or run again together: ``(pairing, method, sides)``, both sides
    of a method's pairing (one for lopd)."""
    units: list[tuple[int, str, list[str]]] = []
    for k, method, side in run_order(pairings, methods):
        if units and units[-1][:2] == (k, method):
            units[-1][2].append(side)
        else:
            units.append((k, method, [side]))
    return units


def run_children(args: argparse.Namespace, env: dict[str, str], launch=subprocess.run) -> list[dict[str, Any]]:
    """Every child of :func:`run_order`. A pairing's method (both sides, :func:`run_units`) is read back from
    ``--runs-dir`` when every side has a kept result whose key matches (:func:`kept_result`) and all were run by
    the same call (never with ``--no-resume``); else all its sides run again, one after the other, each in a
    fresh process (``launch(cmd, env=env)``), and are kept there with their ``resume`` fields and this call's id.
    So the two sides of a pairing always ran back to back. Returns the results, each with ``pairing`` and
    ``resumed``.

    Raises:
        SystemExit: a child fails, or the code or the student changed while it ran (its result is not kept).
    """
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    call = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    runs: list[dict[str, Any]] = []
    for k, method, sides in run_units(args.pairings, args.method_list):
        machine = machine_fields(str(args.student))
        children = []
        for side in sides:
            fields = resume_fields(child_argv(args, side, method, args.seed + k, Path("-")), machine)
            path = kept_path(args.runs_dir, k, method, side, fields)
            children.append((side, fields, path, *((None, "--no-resume") if args.no_resume else kept_result(path, fields))))
        kept = [c[3] for c in children]
        if all(kept) and len({r.get("call") for r in kept}) == 1:
            for side, _, path, result, why in children:
                print(f"pairing {k}: {side} {method}: read back from {path} ({why})", file=sys.stderr, flush=True)
                runs.append({**result, "pairing": k, "resumed": True})
            continue
        for side, fields, path, result, why in children:
            if result is not None:
                why = "its other side is not kept from the same call"
            print(f"pairing {k}: {side} {method} ({why})", file=sys.stderr, flush=True)
            fresh = path.with_suffix(".running.json")
            fresh.unlink(missing_ok=True)  # a cut child's leftover must not pass for this one's result
            cmd = child_argv(args, side, method, args.seed + k, fresh)
            done = launch(cmd, env=env)
            if done.returncode != 0 or not fresh.is_file():
                raise SystemExit(f"the {side} {method} run of pairing {k} failed (exit {done.returncode}): {' '.join(cmd)}")
            after = {key: value for key, value in machine_fields(str(args.student)).items()
                     if key in ("code_hash", "student_hash") and value != fields[key]}
            if after:
                fresh.unlink()
                raise SystemExit(f"the {side} {method} run of pairing {k}: {', '.join(after)} changed while it ran; its "
                                 "result is not kept (run the same command again once the files stay put)")
            result = {**json.loads(fresh.read_text()), "resume": fields, "call": call}
            write_json_atomic(result, path)
            fresh.unlink()
            runs.append({**result, "pairing": k, "resumed": False})
            print({"pairing": k, "side": side, "method": method, "trajectories_per_s": result["trajectories_per_s"],
                   "peak_rss_mb": result["peak_rss_mb"]}, file=sys.stderr, flush=True)
    return runs


# ------------------------------------------------------------------------------------- the report
def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def summarize(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The report's results from the children's results (each with ``pairing``, ``side``, ``method``,
    ``trajectories_per_s``, ``peak_rss_mb``, ``seed``, ``mean_reward_per_step``, ``settings``).

    ``speedup_over_trl[m]``: the median over pairings of ours / TRL's trajectories per second, with the
    per-pairing ratios; ``peak_rss_mb[m]``: each side's largest peak over the pairings and their ratio.
    """
    def pick(method, side):
        return sorted((r for r in runs if r["method"] == method and r["side"] == side), key=lambda r: r["pairing"])

    speedup, rss, tps, curves, settings = {}, {}, {}, {}, {}
    for method in args.method_list:
        ours, trl = pick(method, "ours"), pick(method, "trl")
        tps[method] = {"ours": [r["trajectories_per_s"] for r in ours], "trl": [r["trajectories_per_s"] for r in trl],
                       "ours_median": _median([r["trajectories_per_s"] for r in ours]),
                       "trl_median": _median([r["trajectories_per_s"] for r in trl])}
        curves[method] = {side: [{"pairing": r["pairing"], "seed": r["seed"], "mean_reward_per_step": r["mean_reward_per_step"]}
                                 for r in rs] for side, rs in (("ours", ours), ("trl", trl)) if rs}
        rss[method] = {"ours": max((r["peak_rss_mb"] for r in ours), default=None),
                       "trl": max((r["peak_rss_mb"] for r in trl), default=None)}
        if rss[method]["ours"] and rss[method]["trl"]:
            rss[method]["ours_over_trl"] = round(rss[method]["ours"] / rss[method]["trl"], 4)
        settings[method] = {side: rs[0]["settings"] for side, rs in (("ours", ours), ("trl", trl)) if rs}
        if method in PEERS and ours and trl:
            by_pairing = {r["pairing"]: r for r in trl}
            ratios = [round(o["trajectories_per_s"] / by_pairing[o["pairing"]]["trajectories_per_s"], 4)
                      for o in ours if by_pairing.get(o["pairing"], {}).get("trajectories_per_s")]
            speedup[method] = {"median": _median(ratios), "per_pairing": ratios,
                               "target": 1.5, "met": bool(ratios) and statistics.median(ratios) >= 1.5}
    lopd = None
    if "lopd" in tps and "sdpo" in tps and tps["lopd"]["ours_median"] and tps["sdpo"]["trl_median"]:
        lopd = {"lopd_trajectories_per_s": tps["lopd"]["ours_median"],
                "trl_sdpo_trajectories_per_s": tps["sdpo"]["trl_median"],
                "lopd_over_trl_sdpo": round(tps["lopd"]["ours_median"] / tps["sdpo"]["trl_median"], 4)}
    return {"speedup_over_trl": speedup, "peak_rss_mb": rss, "trajectories_per_s": tps, "lopd_beside_trl_sdpo": lopd,
            "reward_curves": curves, "settings_by_method": settings}


def shared_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings both sides are given (this project's names; TRL's config values are read back per run)."""
    from step_cost import LORA

    return {"student": str(args.student), "task": args.task, "tasks_per_step": args.tasks_per_step,
            "group": args.group, "trajectories_per_step": args.tasks_per_step * args.group,
            "max_new_tokens": args.max_new_tokens, "sampling": SAMPLING, "optimiser": OPTIMISER, "lora": LORA,
            "dtype": "float32", "gradient_checkpointing": False, "generation": "hf generate (both)",
            "threads": args.threads, "pairings": args.pairings, "steps": args.steps, "warmup": args.warmup,
            "grpo": GRPO_LOSS, "sdpo": SDPO_LOSS, "trl_version_pinned": TRL_VERSION, "unmatched": UNMATCHED}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child is not None:
        child_main(args)
        return None
    if any(m in PEERS for m in args.method_list) and importlib.util.find_spec("trl") is None:
        raise SystemExit("trl is not installed in this environment: run `make bench-peer` (it builds .venv-peer)")
    t_start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    runs = run_children(args, env)
    summary = summarize(runs, args)
    report: dict[str, Any] = {
        "benchmark": "vs_trl", "student": str(args.student), "task": args.task,
        "settings": {**shared_settings(args), "read_back": summary.pop("settings_by_method"),
                     "prompt_tokens_equal": next((r["settings"].get("prompt_tokens_equal") for r in runs
                                                  if r["side"] == "trl"), None)},
        **summary,
        "runs": [{k: v for k, v in r.items() if k not in ("settings", "resume")} for r in runs],
        "resumed_runs": sum(bool(r.get("resumed")) for r in runs),
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        **run_metadata(seed=args.seed, argv=argv),
    }
    report["versions"]["trl"] = next((r["settings"].get("trl_version") for r in runs if r["side"] == "trl"), None)
    write_json_atomic(report, args.out)
    return report


if __name__ == "__main__":
    main()
