"""Rollout throughput: batched multi-turn episodes against one at a time, with and without the KV cache.

Measures one thing: trajectories (and generated tokens) per second of :func:`generate_rollouts`, greedy,
on the first ``--batch`` examples of a task's val split, in these ways:

- ``batched``: one call with all examples (``generation_batch_size = --batch``): every turn of every live
  episode goes through one ``generate`` call.
- ``one_at_a_time``: one call per example (batch 1), back to back.
- each with ``use_cache=True`` (the key-value cache, the default) and ``use_cache=False`` (the whole context
  recomputed for every new token);
- and with the cache, with prefix reuse (``reuse_prefixes=True``, the default: each turn reuses the
  keys/values of the turns before it and reads only its new tokens) and without (every turn prefills its
  whole context, the reference path).

Each case runs on one :class:`HFGenerateBackend` kept across its calls (as the training module keeps it),
and reports its ``prefill_stats``: the prompt tokens handed to it and those it read.

Two grids, because decoding without the cache is quadratic and slow on a CPU:

- the target grid (``--max-new-tokens``, default 32, ``--repeats`` runs, median): with the cache, batched
  and one at a time, each with and without prefix reuse -> ``speedup_batched`` (with reuse, the default
  path; the issue's target: >= 3x at batch 8 on CPU), ``speedup_batched_no_reuse`` and ``speedup_reuse``
  (batched, reuse over none) and ``speedup_reuse_one_at_a_time``;
- the cache grid (``--cache-max-new-tokens``, default 8, ``--cache-repeats`` runs), without prefix reuse
  (the key-value cache within one ``generate`` call alone): batched and one at a time, with and without
  the cache -> ``speedup_cache`` (batched, cache over no cache) and ``speedup_cache_one_at_a_time``.

Default: the packaged SmolLM2-135M-Instruct, float32, on the toy task in multi-turn mode (two replies per
episode: a first reply, a hint observation, a scored second reply), 8 examples; one untimed warm-up call
first. ``--model tiny`` (the random tiny model of the tests) runs in seconds.

Run::

    python benchmarks/rollouts.py [--model smollm2-135m-instruct|tiny] [--task toy] [--single-turn] [--batch 8]
                                  [--max-new-tokens 32] [--cache-max-new-tokens 8] [--repeats 3] [--threads 1]
                                  [--out benchmarks/results/rollouts.json] [--quick]

``batching_bound`` (:func:`batching_bound`): from the batched rollouts' own reply lengths, the most any
batching (continuous batching included) could gain over one at a time on these trajectories, when a
decode step of a batch costs at least one of a single row: total reply tokens / the longest episode's.

The JSON is ``{"benchmark": "rollouts", "model", "task", "settings", "cases": [...], "speedup_batched",
"speedup_batched_no_reuse", "speedup_reuse", "speedup_reuse_one_at_a_time", "speedup_batched_no_cache",
"speedup_cache", "speedup_cache_one_at_a_time", "batching_bound", "target"}`` plus
:func:`common.run_metadata`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` next to this file, when imported too
from common import run_metadata, write_json_atomic  # noqa: E402

from lopd_lightning.models import load_student  # noqa: E402
from lopd_lightning.rollout import HFGenerateBackend, generate_rollouts  # noqa: E402
from lopd_lightning.tasks import get_task  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "rollouts.json"
TARGET_SPEEDUP_BATCHED = 3.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file to write")
    p.add_argument("--model", default="smollm2-135m-instruct", help="'smollm2-135m-instruct', 'tiny' or a folder")
    p.add_argument("--task", default="toy", help="a task name of lopd_lightning.tasks (val split)")
    p.add_argument("--single-turn", action="store_true", help="toy task: single-turn episodes (default: multi-turn)")
    p.add_argument("--batch", type=int, default=8, help="examples (= trajectories) per measurement")
    p.add_argument("--max-new-tokens", type=int, default=32, help="per reply, target grid")
    p.add_argument("--cache-max-new-tokens", type=int, default=8, help="per reply, cache grid")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case, target grid (median)")
    p.add_argument("--cache-repeats", type=int, default=1, help="timed runs per case, cache grid")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the CPU is shared)")
    p.add_argument("--device", default="cpu", help="'cpu', 'cuda' or 'auto'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tests: tiny model, batch 2, 4 and 2 new tokens, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.batch, args.max_new_tokens, args.cache_max_new_tokens = "tiny", 2, 4, 2
        args.repeats = args.cache_repeats = 1
    if args.batch < 1 or args.repeats < 1 or args.cache_repeats < 1:
        p.error("--batch, --repeats and --cache-repeats must be >= 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def measure(model: Any, tokenizer: Any, task: Any, examples: list, *, batched: bool, use_cache: bool,
            reuse_prefixes: bool, max_new_tokens: int, repeats: int, seed: int) -> dict[str, Any]:
    """Median over ``repeats`` of one way of rolling out ``examples`` (greedy), on one backend."""
    runs = []
    backend = HFGenerateBackend(model, tokenizer, use_cache=use_cache, reuse_prefixes=reuse_prefixes)
    for _ in range(repeats):
        groups = [examples] if batched else [[e] for e in examples]
        t0 = time.perf_counter()
        trajectories = tokens = turns = generate_calls = 0
        generate_seconds = 0.0
        for group in groups:
            batch = generate_rollouts(
                model, tokenizer, task, group, greedy=True, max_new_tokens=max_new_tokens, seed=seed,
                generation_batch_size=len(group), backend=backend,
            )
            trajectories += len(batch)
            tokens += batch.num_assistant_tokens()
            turns += sum(m["turns"] for m in batch.metadata)
            generate_calls += batch.stats.generate_calls
            generate_seconds += batch.stats.generate_seconds
        seconds = time.perf_counter() - t0
        runs.append({"seconds": seconds, "trajectories": trajectories, "generated_tokens": tokens, "turns": turns,
                     "generate_calls": generate_calls, "generate_seconds": generate_seconds,
                     "reply_tokens": [list(m["reply_tokens"]) for m in batch.metadata] if batched else None})
    seconds = statistics.median(r["seconds"] for r in runs)
    last = runs[-1]
    return {
        "mode": "batched" if batched else "one_at_a_time",
        "use_cache": use_cache,
        "reuse_prefixes": reuse_prefixes,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "seconds_median": round(seconds, 3),
        "seconds_all": [round(r["seconds"], 3) for r in runs],
        "trajectories": last["trajectories"],
        "trajectories_per_second": round(last["trajectories"] / seconds, 4),
        "generated_tokens": last["generated_tokens"],
        "tokens_per_second": round(last["generated_tokens"] / seconds, 2),
        "turns": last["turns"],
        "generate_calls": last["generate_calls"],
        "generate_seconds_share": round(last["generate_seconds"] / max(last["seconds"], 1e-9), 3),
        "prompt_tokens_per_run": backend.prefill_stats["prompt_tokens"] // repeats,
        "prefilled_tokens_per_run": backend.prefill_stats["prefilled_tokens"] // repeats,
        **({"batching_bound": batching_bound(last["reply_tokens"])} if batched else {}),
    }


def batching_bound(reply_tokens: list[list[int]]) -> dict[str, Any]:
    """Upper bounds on the speedup of any batching of these rollouts over one at a time, from their replies.

    One at a time decodes every reply token in sequence: ``generated`` steps. Batched, an episode's tokens
    still come one step after another, so any batcher needs at least ``longest_episode`` steps (the most
    reply tokens of one episode, all its turns) and a turn-synchronous loop (every live episode's turn k
    in one ``generate`` call, this project's) ``sum over k of the longest turn-k reply`` steps. If a decode
    step of a batch costs at least one of a single row (prefill ignored), the speedup is at most
    ``generated / steps``.

    Args:
        reply_tokens: per rollout, its reply lengths per turn (``RolloutBatch.metadata["reply_tokens"]``).
    """
    generated = sum(sum(r) for r in reply_tokens)
    longest = max((sum(r) for r in reply_tokens), default=0)
    turns = max((len(r) for r in reply_tokens), default=0)
    synchronous = sum(max((r[k] for r in reply_tokens if len(r) > k), default=0) for k in range(turns))
    return {
        "generated_tokens": generated,
        "longest_episode_steps": longest,
        "turn_synchronous_steps": synchronous,
        "max_speedup_any_batching": round(generated / longest, 2) if longest else None,
        "max_speedup_turn_synchronous": round(generated / synchronous, 2) if synchronous else None,
    }


def _tps(cases: list[dict[str, Any]], grid: str, mode: str, use_cache: bool, reuse: bool) -> float | None:
    for c in cases:
        if (c["grid"], c["mode"], c["use_cache"], c["reuse_prefixes"]) == (grid, mode, use_cache, reuse):
            return c["trajectories_per_second"]
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    model, tokenizer = load_student(args.model, seed=args.seed)
    model.to(args.device)
    options = {"multi_turn": not args.single_turn} if args.task == "toy" else {}
    task = get_task(args.task, **options)
    examples = task.examples("val")[: args.batch]
    if len(examples) < args.batch:
        examples = (task.examples("val") + task.examples("train"))[: args.batch]
    # warm-up (untimed): first-call costs (kernels, chat template compilation)
    generate_rollouts(model, tokenizer, task, examples[:2], greedy=True, max_new_tokens=2, seed=args.seed)

    cases: list[dict[str, Any]] = []
    for batched in (True, False):
        for reuse in (True, False):
            case = measure(model, tokenizer, task, examples, batched=batched, use_cache=True, reuse_prefixes=reuse,
                           max_new_tokens=args.max_new_tokens, repeats=args.repeats, seed=args.seed)
            cases.append({"grid": "target", **case})
            print(cases[-1], file=sys.stderr)
    for batched in (True, False):
        for use_cache in (True, False):
            case = measure(model, tokenizer, task, examples, batched=batched, use_cache=use_cache, reuse_prefixes=False,
                           max_new_tokens=args.cache_max_new_tokens, repeats=args.cache_repeats, seed=args.seed)
            cases.append({"grid": "cache", **case})
            print(cases[-1], file=sys.stderr)

    def tps(grid: str, mode: str, use_cache: bool = True, reuse: bool = False) -> float | None:
        return _tps(cases, grid, mode, use_cache, reuse)

    speedup_batched = _ratio(tps("target", "batched", reuse=True), tps("target", "one_at_a_time", reuse=True))
    report: dict[str, Any] = {
        "benchmark": "rollouts",
        "model": args.model,
        "task": args.task,
        "settings": {"multi_turn": getattr(task, "multi_turn", False), "batch": len(examples),
                     "example_ids": [e.id for e in examples], "decoding": "greedy",
                     "max_new_tokens": args.max_new_tokens, "cache_max_new_tokens": args.cache_max_new_tokens,
                     "repeats": args.repeats, "cache_repeats": args.cache_repeats, "threads": args.threads,
                     "device": args.device, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                     "quick": args.quick},
        "cases": cases,
        "speedup_batched": speedup_batched,
        "speedup_batched_no_reuse": _ratio(tps("target", "batched"), tps("target", "one_at_a_time")),
        "speedup_reuse": _ratio(tps("target", "batched", reuse=True), tps("target", "batched")),
        "speedup_reuse_one_at_a_time": _ratio(tps("target", "one_at_a_time", reuse=True),
                                              tps("target", "one_at_a_time")),
        "speedup_batched_no_cache": _ratio(tps("cache", "batched", False), tps("cache", "one_at_a_time", False)),
        "speedup_cache": _ratio(tps("cache", "batched"), tps("cache", "batched", False)),
        "speedup_cache_one_at_a_time": _ratio(tps("cache", "one_at_a_time"), tps("cache", "one_at_a_time", False)),
        "batching_bound": next(c["batching_bound"] for c in cases
                               if c["grid"] == "target" and c["mode"] == "batched" and c["reuse_prefixes"]),
        "target": {"speedup_batched": TARGET_SPEEDUP_BATCHED, "batch": 8,
                   "met": None if speedup_batched is None else bool(speedup_batched >= TARGET_SPEEDUP_BATCHED)},
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        **run_metadata(seed=args.seed, argv=argv),
    }
    write_json_atomic(report, args.out)
    return report


if __name__ == "__main__":
    main()
