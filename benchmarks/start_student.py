"""The start student of the evidence runs: a LoRA SFT of SmolLM2-135M-Instruct on a task's references (BFCL live_simple by default).

    python benchmarks/start_student.py                      # -> runs/evidence/sft_student + results/start_student.json
    python benchmarks/start_student.py --steps 12,24,36,48   # the step counts compared on the dev slice

The recipe is chosen on a **dev slice of the train split**, never on the held-out questions:

1. ``--dev`` train questions (a seeded sample) are set aside as the dev slice; SFT trains on the rest of
   the train split's reference solutions (``SFTModule``: LoRA rank 16 / alpha 32 on every projection,
   AdamW ``--lr``, ``--examples-per-step`` questions a step).
2. After each step count of ``--steps`` the student answers the dev slice greedily; the LoRA weights
   of the best step count (highest dev success, the earliest on ties) are kept.
3. That student, LoRA merged, is saved as a Hugging Face folder (``--out``) and answers every held-out
   question (the val split, 65 for live_simple) greedily once. The held-out number is reported, never
   used to choose.

The result is cached: when ``--out`` holds a student made by the same recipe (``recipe.json`` there), the
script only re-reads its result. The JSON (``--results``) holds the recipe, the dev curve, the chosen
step count, the held-out success (count and fraction, per question), timings and the run's metadata.

``--task-options JSON`` passes keyword options to the task's constructor (``get_task(task, **options)``) and
is recorded in the recipe (``task_options``; absent when none are given, so a recipe cached before the
option existed still matches). The hidden-rules start student (issue 33) learns the call format only:

    python benchmarks/start_student.py --task hidden_rules --task-options '{"references": "format_only"}' \
        --out runs/hidden_rules/sft_student --results benchmarks/results/start_student_hidden_rules.json

Its dev and held-out numbers are still the real reward: ``hidden_rules`` scores a reply against the calls
that keep the hidden rule whatever ``references`` says (the option only chooses the SFT targets): the
format-only references themselves score 0 on the rule tools and 1 on the plain ones under that checker.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, run_metadata, write_json_atomic  # noqa: E402

LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def dev_split_task(task, dev: int, seed: int):
    """A view of ``task`` whose "train" split is the train split without ``dev`` seeded-sampled questions
    and whose "val" split is those questions (the dev slice); "heldout" is the task's own val split.
    Messages, tools, references, episodes and rewards are the task's own."""
    from lopd_lightning.data import dev_slice_indices
    from lopd_lightning.tasks import Task

    train = task.examples("train")
    if not 0 < dev < len(train):
        raise ValueError(f"--dev must be in [1, {len(train) - 1}] (the train split has {len(train)} questions), got {dev}")
    chosen = set(dev_slice_indices(len(train), dev, seed))  # the slice OnPolicyDataModule(dev_slice=) serves

    class DevSplit(Task):
        name, multi_turn = task.name, task.multi_turn
        max_turns = getattr(task, "max_turns", None)

        def all_examples(self):
            return task.all_examples()

        def examples(self, split: str = "train"):
            if split == "train":
                return [ex for i, ex in enumerate(train) if i not in chosen]
            if split == "val":
                return [ex for i, ex in enumerate(train) if i in chosen]
            return task.examples("val" if split == "heldout" else split)

        def initial_messages(self, example):
            return task.initial_messages(example)

        def tools(self, example):
            return task.tools(example)

        def reference_solution(self, example):
            return task.reference_solution(example)

        def reference_replies(self, example):
            return task.reference_replies(example)

        def start(self, example):
            return task.start(example)

        def experience_text(self, example, messages):
            return task.experience_text(example, messages)

    return DevSplit()


def greedy_batches(module, task, examples, *, batch_size: int):
    """The greedy episodes of ``examples``, ``batch_size`` at a time, without gradients
    (``module.evaluate_examples``: the rollout code): yields (the examples, their RolloutBatch) per chunk."""
    import torch

    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        with torch.no_grad():
            batch = module.evaluate_examples(task, chunk)
        yield chunk, batch


def greedy_success(module, task, examples, *, batch_size: int) -> tuple[list[float], float]:
    """Greedy rewards of ``examples`` (one episode each, batched: :func:`greedy_batches`, in eval mode) and the
    wall seconds."""
    start = time.perf_counter()
    module.eval()
    rewards = [float(r) for _, batch in greedy_batches(module, task, examples, batch_size=batch_size) for r in batch.rewards]
    module.train()
    return rewards, time.perf_counter() - start


def task_options(text: str) -> dict[str, Any]:
    """``--task-options``: a JSON object of the task constructor's keyword options."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): {text!r}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, e.g. '{{\"references\": \"format_only\"}}'; got {text!r}")
    return options


def recipe_of(args: argparse.Namespace) -> dict[str, Any]:
    recipe = {
        "task": args.task, "model": args.model, "lora": LORA, "learning_rate": args.lr,
        "examples_per_step": args.examples_per_step, "steps_compared": args.steps, "dev_questions": args.dev,
        "seed": args.seed, "max_new_tokens": args.max_new_tokens, "grad_clip": 1.0,
    }
    if args.task_options:  # only when given: the recipes cached before --task-options existed still match
        recipe["task_options"] = args.task_options
    return recipe


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="bfcl_live_simple")
    parser.add_argument("--task-options", type=task_options, default={},
                        help="JSON object of the task's constructor options, e.g. '{\"references\": \"format_only\"}'")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=lambda s: sorted({int(x) for x in s.split(",")}), default=[24, 36, 48, 64],
                        help="step counts compared on the dev slice (comma-separated)")
    parser.add_argument("--dev", type=int, default=32, help="train questions set aside as the dev slice")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--examples-per-step", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="greedy reply limit of the evaluations")
    parser.add_argument("--batch-size", type=int, default=16, help="questions answered at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "evidence" / "sft_student")
    parser.add_argument("--results", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "start_student.json")
    args = parser.parse_args(argv)

    recipe = recipe_of(args)
    cached = args.out / "recipe.json"
    student_name = str(args.out.relative_to(REPO_ROOT) if args.out.is_relative_to(REPO_ROOT) else args.out)
    if cached.exists() and args.results.exists() and json.loads(cached.read_text()) == recipe:
        result = json.loads(args.results.read_text())
        if result.get("recipe") == recipe and result.get("student") == student_name:  # this student's result
            print(f"cached start student {args.out}: held-out {result['heldout_success']:.3f}")
            return result

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.modules import SFTModule
    from lopd_lightning.tasks import get_task

    if args.threads:
        torch.set_num_threads(args.threads)
    L.seed_everything(args.seed)
    task = dev_split_task(get_task(args.task, **args.task_options), args.dev, args.seed)
    dev, heldout = task.examples("val"), task.examples("heldout")
    module = SFTModule(args.model, lora=LORA, learning_rate=args.lr, grad_clip=1.0, max_new_tokens=args.max_new_tokens,
                       seed=args.seed)
    curve: list[dict[str, Any]] = []
    best: dict[str, Any] = {}

    class DevEvaluation(Callback):
        """Greedy dev success after each compared step count; keeps the best step's student LoRA."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step not in args.steps:
                return
            rewards, seconds = greedy_success(pl_module, task, dev, batch_size=args.batch_size)
            success = sum(r >= 1.0 for r in rewards) / len(rewards)
            curve.append({"steps": step, "dev_success": success, "dev_solved": int(sum(r >= 1.0 for r in rewards)),
                          "eval_s": round(seconds, 1)})
            print(f"step {step}: dev {curve[-1]['dev_solved']}/{len(dev)} ({seconds:.0f} s)", flush=True)
            if not best or success > best["dev_success"]:
                best.update(steps=step, dev_success=success,
                            weights=[p.detach().clone() for p in pl_module.student_parameters()])

    dm = OnPolicyDataModule(task, examples_per_step=args.examples_per_step, val_limit=None, seed=args.seed)
    trainer = L.Trainer(max_steps=max(args.steps), accelerator="cpu", devices=1, precision=32, logger=False,
                        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[DevEvaluation()],
                        default_root_dir=str(args.out.parent))
    start = time.perf_counter()
    trainer.fit(module, dm)
    train_s = time.perf_counter() - start
    with torch.no_grad():
        for p, saved in zip(module.student_parameters(), best["weights"], strict=True):
            p.copy_(saved)
    rewards, heldout_s = greedy_success(module, get_task(args.task, **args.task_options), heldout, batch_size=args.batch_size)
    solved = [ex.id for ex, r in zip(heldout, rewards, strict=True) if r >= 1.0]
    module.save_student(args.out)
    result = {
        "recipe": recipe,
        "dev_curve": curve,
        "chosen_steps": best["steps"],
        "dev_success": best["dev_success"],
        "heldout_questions": len(heldout),
        "heldout_solved": len(solved),
        "heldout_success": len(solved) / len(heldout),
        "heldout_rewards": {ex.id: r for ex, r in zip(heldout, rewards, strict=True)},
        "train_and_dev_eval_s": round(train_s, 1),
        "heldout_eval_s": round(heldout_s, 1),
        "student": student_name,
        **run_metadata(seed=args.seed, argv=argv),
    }
    write_json_atomic(result, args.results)
    write_json_atomic(recipe, cached)
    print(f"start student {args.out}: {best['steps']} steps (dev {best['dev_success']:.3f}); held-out "
          f"{len(solved)}/{len(heldout)} = {result['heldout_success']:.3f} greedily ({heldout_s:.0f} s)")
    return result


if __name__ == "__main__":
    main()
