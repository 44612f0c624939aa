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

The hidden-rules student's dev and held-out numbers are still the real reward: ``hidden_rules`` scores a
reply against the calls that keep the hidden rule whatever ``references`` says (the option only chooses the
SFT targets): the format-only references themselves score 0 on the rule tools and 1 on the plain ones under
that checker.

``--in-context-fraction F`` (default 0, today's recipe; recorded in the recipe only when non-zero, so a
cached recipe still matches) makes a seeded fraction F of the SFT rows in-context rows (:func:`in_context_task`):
the request is preceded, in the teacher's framing of text contexts, by the bank's trace of another train
request of the same tool in an environment whose rule for that tool is not seed 0's (``HiddenRulesTask(
rule_offset=k)``), and the target is that environment's rule-keeping reply; plain tools show another
request's call and keep the plain reply. It teaches reading an example (the rule from it, the values from the
request) without ever showing seed 0's rules; it needs ``"references": "format_only"`` (the other rows'
targets), and the dev slice is answered as before (greedy, no context). The result's ``in_context_rows``
counts the rows by group (rule or plain tools), kind and offset:

    python benchmarks/start_student.py --task hidden_rules --task-options '{"references": "format_only"}' \
        --in-context-fraction 0.5 --out runs/hidden_rules/sft_student_in_context \
        --results benchmarks/results/start_student_hidden_rules_in_context.json
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

from lopd_lightning.tasks import Task  # noqa: E402

LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


class TaskView(Task):
    """A task that answers every call with ``inner``'s: a subclass overrides what differs (a split, the rows
    that see another environment's trace)."""

    def __init__(self, inner: Task):
        self.inner = inner
        self.name, self.multi_turn = inner.name, inner.multi_turn
        self.max_turns = getattr(inner, "max_turns", None)

    def all_examples(self):
        return self.inner.all_examples()

    def examples(self, split: str = "train"):
        return self.inner.examples(split)

    def initial_messages(self, example):
        return self.inner.initial_messages(example)

    def tools(self, example):
        return self.inner.tools(example)

    def reference_solution(self, example):
        return self.inner.reference_solution(example)

    def reference_replies(self, example):
        return self.inner.reference_replies(example)

    def start(self, example):
        return self.inner.start(example)

    def experience_text(self, example, messages):
        return self.inner.experience_text(example, messages)


def dev_split_task(task, dev: int, seed: int):
    """A view of ``task`` whose "train" split is the train split without ``dev`` seeded-sampled questions
    and whose "val" split is those questions (the dev slice); "heldout" is the task's own val split.
    Messages, tools, references, episodes and rewards are the task's own."""
    from lopd_lightning.data import dev_slice_indices

    train = task.examples("train")
    if not 0 < dev < len(train):
        raise ValueError(f"--dev must be in [1, {len(train) - 1}] (the train split has {len(train)} questions), got {dev}")
    chosen = set(dev_slice_indices(len(train), dev, seed))  # the slice OnPolicyDataModule(dev_slice=) serves

    class DevSplit(TaskView):
        def examples(self, split: str = "train"):
            if split == "train":
                return [ex for i, ex in enumerate(train) if i not in chosen]
            if split == "val":
                return [ex for i, ex in enumerate(train) if i in chosen]
            return task.examples("val" if split == "heldout" else split)

    return DevSplit(task)


def _replayed(task, example) -> list[dict[str, Any]]:
    """``example``'s reference trajectory in ``task``: the initial messages, each reference reply and the
    episode's observations (``BaseMethodModule.reference_trajectory``'s conversation, what the bank's
    experiences are made of).

    Raises:
        ValueError: the replayed references do not score 1 (the bank would not keep them).
    """
    from lopd_lightning.tasks import replay_references

    messages, reward = replay_references(task, example, task.initial_messages(example))
    if reward < 1.0:
        raise ValueError(f"the reference of {example.id} scores below 1 in its environment")
    return messages


class _Environments:
    """``env(offset)`` made once per offset, with its train examples by id."""

    def __init__(self, env):
        self.env, self.made = env, {}

    def get(self, offset: int):
        if offset not in self.made:
            task = self.env(offset)
            self.made[offset] = (task, {ex.id: ex for ex in task.examples("train")})
        return self.made[offset]

    def task(self, offset: int):
        return self.get(offset)[0]

    def changed(self, offset: int, example) -> bool:
        """Whether ``example``'s expected call under ``env(offset)`` is not its seed's (``example.data["expected"]``)."""
        return self.get(offset)[1][example.id].data["expected"] != example.data["expected"]


def _in_context_rows(rows, envs: _Environments, fraction: float, seed: int, frame):
    """:func:`in_context_task`'s rows (example id -> row) and counts; ``frame(trace)`` is the framed text."""
    import random

    from lopd_lightning.tasks.hidden_rules.tools import offsets_changing, tool_by_name

    rng = random.Random(f"start_student/in_context/{seed}")
    chosen = sorted(rng.sample(range(len(rows)), round(fraction * len(rows))))
    by_tool: dict[str, list] = {}
    for ex in rows:
        by_tool.setdefault(ex.data["tool"], []).append(ex)
    turn: dict[str, int] = {}
    in_context: dict[str, dict[str, Any]] = {}
    counts: dict[str, Any] = {"fraction": fraction, "sft_rows": len(rows), "in_context": 0,
                              "by_group": {"rule_tools": 0, "plain_tools": 0}, "by_kind": {}, "by_offset": {},
                              "without_example": 0}
    for i in chosen:
        ex = rows[i]
        tool, plain = ex.data["tool"], ex.data["plain"]
        offset: int | None = 0
        if not plain:  # the tool's next offset in its cycle under which this request's call is not the seed's
            cycle, first = offsets_changing(tool_by_name(tool)), turn.get(tool, 0)
            turn[tool] = first + 1
            offset = next((k for k in (cycle[(first + j) % len(cycle)] for j in range(len(cycle)))
                           if envs.changed(k, ex)), None)
        candidates = [other for other in by_tool[tool] if other.id != ex.id
                      and (plain or (offset is not None and envs.changed(offset, other)))]
        if offset is None or not candidates:
            counts["without_example"] += 1
            continue
        made, by_id = envs.get(offset)
        shown, target = by_id[rng.choice(candidates).id], by_id[ex.id]
        framed = frame(made.experience_text(shown, _replayed(made, shown)))
        messages = [dict(m) for m in made.initial_messages(target)]
        first_user = next(k for k, m in enumerate(messages) if m["role"] == "user")
        messages[first_user]["content"] = framed + messages[first_user]["content"]
        in_context[ex.id] = {"offset": offset, "example_id": shown.id, "prefix": framed, "messages": messages,
                             "replies": list(made.reference_replies(target)), "env": made, "env_example": target}
        kind = ex.data["rule"]["kind"]
        counts["in_context"] += 1
        counts["by_group"]["plain_tools" if plain else "rule_tools"] += 1
        counts["by_kind"][kind] = counts["by_kind"].get(kind, 0) + 1
        counts["by_offset"][str(offset)] = counts["by_offset"].get(str(offset), 0) + 1
    counts["by_kind"] = dict(sorted(counts["by_kind"].items()))
    counts["by_offset"] = dict(sorted(counts["by_offset"].items()))
    return in_context, counts


def in_context_task(task, env, fraction: float, seed: int, *, framing_prefix: str | None = None,
                    framing_suffix: str | None = None):
    """A view of ``task`` in which a seeded ``fraction`` of its "train" rows (the SFT rows) are in-context rows.

    An in-context row of a **rule tool** gets an environment whose rule for that tool differs from the seed's:
    ``env(k)`` with ``k`` from ``offsets_changing`` of the tool (1 to n - 1, cycled over the tool's in-context
    rows in row order; an offset under which this request's call equals the seed's, a day whose day equals its
    month between DD/MM and MM/DD, is passed over). Its first user message is prefixed with
    ``frame_text(trace)`` (the teacher's framing of text contexts: "Here is a reference example of a
    different, already solved task:\n" + trace + "\nNow complete your task.\n\n", placed where
    ``SelfTeacher.insert_context`` places it, at the start of the first user message's content), where
    ``trace`` is ``experience_text`` of the replayed ``references="rules"`` trajectory of ANOTHER train row of
    the same tool in that environment (a seeded choice among those whose call differs from the seed's), as the
    bank stores it; its target is that environment's rule-keeping reply to this request. A **plain tool**'s
    row shows another request's call of the same tool (``env(0)``: plain tools have no rule) and keeps the
    plain reply as its target. The other rows, and the "val" (dev) and "heldout" splits, are ``task``'s as they
    are (no context; ``task``'s references: ``format_only`` for the start student).

    SFT reads a row through ``initial_messages``, ``start`` and ``reference_replies`` (its reference
    trajectory), so ``SFTModule`` is unchanged. Token ids equal the calibration's except at the seam: the
    framed text ends in "\n\n", which SmolLM2's tokenizer writes as one token when the context is tokenised
    alone (the teacher's ``encode_text_context``) and as two ("\n", "\n") before the request's first word.

    Args:
        task: a hidden-rules task or ``dev_split_task``'s view of one (its "train" split is the SFT rows;
            examples and calls never come from its "val" or held-out split).
        env: ``offset -> `` the same task (seed, sizes, prompts) with ``rule_offset=offset`` and
            ``references="rules"``; called once per offset used.
        fraction: in [0, 1]; ``round(fraction * rows)`` rows, a sample of ``random.Random(f"start_student/
            in_context/{seed}")`` (the same rows, contexts and offsets for the same seed).
        seed: the seed of the choice of rows and examples.
        framing_prefix, framing_suffix: the framing (``teacher.DEFAULT_FRAMING_PREFIX`` / ``_SUFFIX`` when None,
            the LOPD teacher's default and the calibration's).

    Returns:
        ``(view, counts)``: the Task view (``view.in_context``: example id -> ``{"offset", "example_id" (the
        shown request), "prefix" (the framed trace), "messages", "replies", "env", "env_example"}``) and ``{"fraction", "sft_rows", "in_context",
        "by_group" ({"rule_tools", "plain_tools"}), "by_kind" (rule kind or "none" -> rows), "by_offset",
        "without_example"}`` (``without_example``: rows left without context because no other row of their
        tool qualifies).

    Raises:
        ValueError: ``fraction`` outside [0, 1], or examples without hidden-rules data (``tool``, ``plain``).
    """
    from lopd_lightning.teacher import DEFAULT_FRAMING_PREFIX, DEFAULT_FRAMING_SUFFIX, frame_text

    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--in-context-fraction must be in [0, 1], got {fraction}")
    prefix = DEFAULT_FRAMING_PREFIX if framing_prefix is None else framing_prefix
    suffix = DEFAULT_FRAMING_SUFFIX if framing_suffix is None else framing_suffix
    rows = task.examples("train")
    if any(not isinstance(ex.data, dict) or "tool" not in ex.data or "plain" not in ex.data for ex in rows):
        raise ValueError("--in-context-fraction needs a hidden-rules task (examples with a tool and a rule)")
    envs = _Environments(env)
    in_context, counts = _in_context_rows(rows, envs, fraction, seed, lambda trace: frame_text(trace, prefix, suffix))
    seed_env = envs.task(0) if rows else None  # the real reward of the rows without context

    class InContext(TaskView):
        def initial_messages(self, example):
            row = in_context.get(example.id)
            return [dict(m) for m in row["messages"]] if row else task.initial_messages(example)

        def reference_solution(self, example):
            row = in_context.get(example.id)
            return row["env"].reference_solution(row["env_example"]) if row else task.reference_solution(example)

        def reference_replies(self, example):
            row = in_context.get(example.id)
            return list(row["replies"]) if row else task.reference_replies(example)

        def start(self, example):
            row = in_context.get(example.id)
            return row["env"].start(row["env_example"]) if row else task.start(example)

        def score_with_info(self, example, completion):
            row = in_context.get(example.id)
            if row:
                return row["env"].score_with_info(row["env_example"], completion)
            return seed_env.score_with_info(example, completion)

        def experience_text(self, example, messages):
            row = in_context.get(example.id)
            return row["env"].experience_text(row["env_example"], messages) if row else task.experience_text(example, messages)

    view = InContext(task)
    view.in_context = in_context
    return view, counts


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
    if getattr(args, "in_context_fraction", 0.0):  # likewise: only when non-zero
        recipe["in_context_fraction"] = args.in_context_fraction
    return recipe


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="bfcl_live_simple")
    parser.add_argument("--task-options", type=task_options, default={},
                        help="JSON object of the task's constructor options, e.g. '{\"references\": \"format_only\"}'")
    parser.add_argument("--in-context-fraction", type=float, default=0.0,
                        help="hidden_rules: the fraction of SFT rows given another request's experience under other "
                        "rules than the seed's, and that environment's reply (0: none)")
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
    if not 0.0 <= args.in_context_fraction <= 1.0:
        parser.error(f"--in-context-fraction must be in [0, 1], got {args.in_context_fraction}")
    if args.in_context_fraction:
        if args.task not in ("hidden_rules", "hidden_rules_multi_turn"):
            parser.error(f"--in-context-fraction needs a task with rule_offset (hidden_rules, "
                         f"hidden_rules_multi_turn), got --task {args.task}")
        if args.task_options.get("references") != "format_only" or "rule_offset" in args.task_options:
            parser.error("--in-context-fraction: the rows without context must never show seed 0's rules; give "
                         "--task-options '{\"references\": \"format_only\"}' (and no rule_offset)")

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

    sft_task, in_context = task, None
    if args.in_context_fraction:  # the dev slice stays task's: greedy, no context
        sft_task, in_context = in_context_task(
            task, lambda k: get_task(args.task, **{**args.task_options, "references": "rules", "rule_offset": k}),
            args.in_context_fraction, args.seed)
        print(f"in-context rows: {in_context['in_context']} of {in_context['sft_rows']} ({in_context['by_group']})",
              flush=True)
    dm = OnPolicyDataModule(sft_task, examples_per_step=args.examples_per_step, val_limit=None, seed=args.seed)
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
        **({"in_context_rows": in_context} if in_context is not None else {}),
        **run_metadata(seed=args.seed, argv=argv),
    }
    write_json_atomic(result, args.results)
    write_json_atomic(recipe, cached)
    print(f"start student {args.out}: {best['steps']} steps (dev {best['dev_success']:.3f}); held-out "
          f"{len(solved)}/{len(heldout)} = {result['heldout_success']:.3f} greedily ({heldout_s:.0f} s)")
    return result


if __name__ == "__main__":
    main()
