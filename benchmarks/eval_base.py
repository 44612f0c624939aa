"""Greedy evaluation of a base (untrained) student on the val splits: what training has to improve on.

Measures one thing: the task metric of greedy decoding, with its cost (seconds, generated tokens).

- ``humaneval``: the val split (41 problems), chat format, 384 new tokens; pass@1 (greedy, one sample:
  the mean of the all-tests-pass reward).
- ``bfcl_simple_python``: the val split (100), 128 new tokens; accuracy (mean reward).
- ``bfcl_multi_turn_base``: the first 20 of the val split, 128 new tokens per reply, the task's default
  turn limits (``max_steps_per_turn`` of the task, ``max_turns`` of :func:`generate_rollouts`); success
  rate (mean reward: every user turn passed) and the mean fraction of user turns passed (the episode's
  ``fraction_passed``, recomputed by replaying the replies in a fresh episode).

Run::

    python benchmarks/eval_base.py [--model smollm2-135m-instruct] [--out benchmarks/results/eval_base.json]
                                   [--limit N] [--tasks humaneval,bfcl_simple_python,bfcl_multi_turn_base]

The JSON (written atomically, also after each task so a long run keeps what it finished) is
``{"benchmark": "eval_base", "model", "complete", "settings", "tasks": {name: {...}}}`` plus
:func:`common.run_metadata` (versions, hardware, seed, git sha, timestamp). Each task's entry carries its
own ``run`` (git sha, timestamp, argv, settings). ``--merge`` keeps the other tasks of an existing
``--out`` file (same model), so one long task can be run again alone; the top-level metadata is then the
newest run's and ``complete`` says that run finished.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` next to this file, when imported too
from common import run_metadata, write_json_atomic  # noqa: E402

from lopd_lightning.models import load_student  # noqa: E402
from lopd_lightning.rollout import RolloutBatch, generate_rollouts  # noqa: E402
from lopd_lightning.tasks import Example, Task, episode_reward, get_task  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "eval_base.json"


@dataclass(frozen=True)
class TaskSpec:
    """How one task is evaluated.

    Attributes:
        metric: the name of the mean reward in the JSON ("pass@1", "accuracy", "success_rate").
        max_new_tokens: limit per reply.
        max_examples: the first this many of the val split (None = all of it).
    """

    metric: str
    max_new_tokens: int
    max_examples: int | None = None


SPECS: dict[str, TaskSpec] = {
    "humaneval": TaskSpec(metric="pass@1", max_new_tokens=384),
    "bfcl_simple_python": TaskSpec(metric="accuracy", max_new_tokens=128),
    "bfcl_multi_turn_base": TaskSpec(metric="success_rate", max_new_tokens=128, max_examples=20),
    "toy": TaskSpec(metric="accuracy", max_new_tokens=16),  # smoke tests only
}
DEFAULT_TASKS = ("humaneval", "bfcl_simple_python", "bfcl_multi_turn_base")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="'smollm2-135m-instruct', 'tiny' or a folder")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file to write")
    p.add_argument("--limit", type=int, default=None, help="at most N examples per task (smoke runs)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help=f"comma-separated, of {', '.join(SPECS)}")
    p.add_argument("--multi-turn-examples", type=int, default=None,
                   help="examples of bfcl_multi_turn_base (default %d)" % SPECS["bfcl_multi_turn_base"].max_examples)
    p.add_argument("--generation-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="seed of generate_rollouts (greedy: unused by sampling)")
    p.add_argument("--dtype", default="float32", help="weights dtype (float32, bfloat16)")
    p.add_argument("--device", default="auto", help="'auto' (cuda when available), 'cpu', 'cuda'")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's); 1 is fastest on a CPU shared with other work")
    p.add_argument("--merge", action="store_true",
                   help="keep the other tasks of an existing --out file (same model); replace only these")
    args = p.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in args.tasks if t not in SPECS]
    if unknown:
        p.error(f"unknown task(s) {unknown}; known: {list(SPECS)}")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    return args


def kept_tasks(path: Path, model: str, replaced: list[str]) -> dict[str, Any]:
    """The task entries of an earlier result file at ``path`` other than ``replaced``, each with its ``run``
    (an entry written before runs were recorded per task gets its file's metadata). Nothing when the
    file does not exist.

    Raises:
        SystemExit: the file is unreadable or holds another model's results.
    """
    if not path.exists():
        return {}
    try:
        old = json.loads(path.read_text())
        tasks = old["tasks"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"eval_base: --merge cannot read {path} ({err}); drop --merge or fix the file")
    if old.get("model") != model:
        raise SystemExit(f"eval_base: --merge into {path}, which holds model {old.get('model')!r}, not {model!r}; "
                         "use another --out")
    fallback = {"settings": old.get("settings"), **{k: old.get(k) for k in ("git_sha", "timestamp", "argv")}}
    return {name: {"run": fallback, **entry} for name, entry in tasks.items() if name not in replaced}


def replay_turns(task: Task, example: Example, messages: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Replay a finished conversation's assistant replies in a fresh episode of ``task``.

    Returns:
        (fraction of user turns passed, reward) of the replayed episode, or None when the episode has
        no ``fraction_passed`` (tasks other than BFCL multi-turn).
    """
    episode = task.start(example)
    if not hasattr(episode, "fraction_passed"):
        return None
    n_initial = len(task.initial_messages(example))
    for message in messages[n_initial:]:
        if message["role"] == "assistant":
            if getattr(episode, "done", False):
                break
            episode.step(message["content"])
    return float(episode.fraction_passed), episode_reward(task, example, episode)


def summarize(spec: TaskSpec, task: Task, examples: list[Example], batch: RolloutBatch,
              seconds: float, n_available: int, max_turns: int | None) -> dict[str, Any]:
    """The per-task JSON entry from a batch of greedy rollouts (one per example)."""
    n = len(batch)
    rewards = batch.rewards.tolist()
    reply_tokens = [m["reply_tokens"] for m in batch.metadata]
    stop_reasons = [m["stop_reasons"] for m in batch.metadata]
    tokens_per_example = [sum(t) for t in reply_tokens]
    replies = sum(len(t) for t in reply_tokens)
    length_stops = [sum(r == "length" for r in reasons) for reasons in stop_reasons]
    truncation_reasons: dict[str, int] = {}
    for m in batch.metadata:
        if m["truncation"] is not None:
            truncation_reasons[m["truncation"]] = truncation_reasons.get(m["truncation"], 0) + 1
    stats = batch.stats.as_dict() if batch.stats is not None else {}

    per_example = []
    fractions: list[float] = []
    replay_mismatches = 0
    for i, example in enumerate(examples):
        entry: dict[str, Any] = {
            "id": example.id,
            "reward": rewards[i],
            "turns": batch.metadata[i]["turns"],
            "generated_tokens": tokens_per_example[i],
            "stop_reasons": stop_reasons[i],
            "truncation": batch.metadata[i]["truncation"],
        }
        if batch.metadata[i]["errors"]:
            entry["env_errors"] = len(batch.metadata[i]["errors"])
        replayed = replay_turns(task, example, batch.messages[i]) if task.multi_turn else None
        if replayed is not None:
            fraction, reward = replayed
            fractions.append(fraction)
            entry["fraction_turns_passed"] = fraction
            replay_mismatches += int(not math.isclose(reward, rewards[i]))
        per_example.append(entry)

    out: dict[str, Any] = {
        "split": "val",
        "examples": f"first {n} of {n_available}" if n < n_available else f"all {n}",
        "n": n,
        "metric": spec.metric,
        spec.metric: sum(rewards) / n if n else float("nan"),
        "correct": sum(rewards),
        "max_new_tokens": spec.max_new_tokens,
        "max_turns": max_turns,
        "seconds_total": seconds,
        "seconds_per_example": seconds / n if n else float("nan"),
        "mean_generated_tokens": sum(tokens_per_example) / n if n else float("nan"),
        "replies": replies,
        "mean_reply_tokens": sum(tokens_per_example) / replies if replies else float("nan"),
        # examples with a reply cut at max_new_tokens or an episode cut by max_turns / context
        "truncated": sum(1 for i in range(n) if length_stops[i] or batch.metadata[i]["truncated"]),
        "truncated_replies": sum(length_stops),
        "truncated_episodes": truncation_reasons,
        "episodes_with_env_errors": sum(1 for m in batch.metadata if m["errors"]),
        "rollout_stats": stats,
        "per_example": per_example,
    }
    if task.multi_turn:
        out["mean_turns"] = sum(m["turns"] for m in batch.metadata) / n if n else float("nan")
        out["max_steps_per_turn"] = getattr(task, "max_steps_per_turn", None)
    if fractions:
        out["mean_fraction_turns_passed"] = sum(fractions) / len(fractions)
        out["replay_reward_mismatches"] = replay_mismatches
    return out


def print_table(model: str, results: dict[str, dict[str, Any]]) -> None:
    print(f"\neval_base: {model} (greedy)")
    print(f"{'task':<22} {'n':>4} {'metric':<13} {'value':>7} {'s/ex':>7} {'tok/ex':>7} {'trunc':>5}")
    for name, r in results.items():
        print(f"{name:<22} {r['n']:>4} {r['metric']:<13} {r[r['metric']]:>7.3f} {r['seconds_per_example']:>7.2f} "
              f"{r['mean_generated_tokens']:>7.1f} {r['truncated']:>5}")
        if "mean_fraction_turns_passed" in r:
            print(f"{'':<22} {'':>4} {'turns passed':<13} {r['mean_fraction_turns_passed']:>7.3f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the evaluation, write the JSON, print the table; returns the JSON object."""
    args = parse_args(argv)
    t_run = time.perf_counter()
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")

    t0 = time.perf_counter()
    model, tokenizer = load_student(args.model, dtype=args.dtype, seed=args.seed)
    model.to(device)
    load_seconds = time.perf_counter() - t0

    report: dict[str, Any] = {
        "benchmark": "eval_base",
        "model": args.model,
        "complete": False,
        "settings": {
            "decoding": "greedy",
            "generation_batch_size": args.generation_batch_size,
            "dtype": args.dtype,
            "device": device,
            "limit": args.limit,
            "torch_threads": torch.get_num_threads(),
            "model_load_seconds": load_seconds,
        },
        "tasks": {},
        **run_metadata(seed=args.seed, argv=sys.argv[1:] if argv is None else argv),
    }
    run = {"settings": report["settings"], **{k: report[k] for k in ("git_sha", "timestamp", "argv")}}
    if args.merge:
        report["tasks"] = kept_tasks(args.out, args.model, args.tasks)
    for name in args.tasks:
        spec = SPECS[name]
        task = get_task(name)
        val = task.examples("val")
        n = len(val) if spec.max_examples is None else min(spec.max_examples, len(val))
        if name == "bfcl_multi_turn_base" and args.multi_turn_examples is not None:
            n = min(args.multi_turn_examples, len(val))
        if args.limit is not None:
            n = min(n, args.limit)
        examples = val[:n]
        max_turns = None if task.multi_turn else 1
        print(f"[eval_base] {name}: {n} examples, max_new_tokens {spec.max_new_tokens}", flush=True)
        t0 = time.perf_counter()
        batch = generate_rollouts(
            model, tokenizer, task, examples, greedy=True, max_new_tokens=spec.max_new_tokens,
            max_turns=max_turns, generation_batch_size=args.generation_batch_size, seed=args.seed,
        )
        seconds = time.perf_counter() - t0
        # the limit generate_rollouts applied (its documented default when max_turns is None)
        effective_turns = max_turns or getattr(task, "max_turns", None) or (8 if task.multi_turn else 1)
        report["tasks"][name] = summarize(spec, task, examples, batch, seconds, len(val), effective_turns)
        r = report["tasks"][name]
        r["run"] = run
        planned = len(val) if spec.max_examples is None else min(spec.max_examples, len(val))
        if n < planned:  # fewer than the benchmark's definition: say so in the JSON
            r["planned_n"] = planned
            r["reduced_by"] = "--limit" if args.limit is not None and n == args.limit else "--multi-turn-examples"
        print(f"[eval_base] {name}: {spec.metric} {r[spec.metric]:.3f} in {seconds:.1f} s", flush=True)
        report["wall_seconds"] = time.perf_counter() - t_run
        write_json_atomic(report, args.out)
    report["complete"] = True
    report["wall_seconds"] = time.perf_counter() - t_run
    write_json_atomic(report, args.out)
    print_table(args.model, report["tasks"])
    print(f"wall {report['wall_seconds']:.1f} s -> {args.out}")
    return report


if __name__ == "__main__":
    main()
