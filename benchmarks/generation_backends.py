"""Rollout throughput of the generation backends (HF ``generate`` against vLLM) on the quickstart setting.

    .venv-vllm/bin/python benchmarks/generation_backends.py            # -> results/generation_backends.json
    .venv-vllm/bin/python benchmarks/generation_backends.py --repeats 5 --eval-questions 65
    python benchmarks/generation_backends.py --backends hf --repeats 0 --eval-batch-sizes none,8,16 \
        --out benchmarks/results/heldout_eval.json     # the held-out evaluation alone, by batch size

Runs in the environment of ``make test-vllm`` (vLLM installed), both backends in the same process and
software. The student is the evidence runs' SFT student (``benchmarks/start_student.py``; the packaged
SmolLM2-135M-Instruct with ``--student smollm2-135m-instruct``), the task BFCL live_simple, the sampling
the quickstart's (T 0.7, top-p 0.95, top-k 20, 96 new tokens). Two layouts of one step's rollouts:

* ``grpo``: one train question, G = 4 trajectories (a group);
* ``lopd``: four train questions, one trajectory each.

Each repeat uses other questions (the same ones for both backends). vLLM's time of a repeat includes a
full weight sync (``sync_weights``: the student's weights written into the engine, prefix cache reset),
as every training step pays it; its engine start-up is reported apart (once per run). Then both backends
answer the held-out questions greedily (``heldout_eval_s``, and the success each gets: greedy decoding
may differ at near-ties only). Result: ``speedup_vllm_over_hf = {"grpo": x, "lopd": y}``, the ratio of
median trajectories per second, measured in this one run. With ``--backends hf,hf_no_reuse,...`` the HF
backend also runs without prefix reuse (every context prefilled whole): ``speedup_hf_reuse`` = {"grpo": x,
"lopd": y}, HF with reuse over HF without it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, run_metadata, write_json_atomic  # noqa: E402

SAMPLING = dict(temperature=0.7, top_p=0.95, top_k=20, max_new_tokens=96)
LAYOUTS = {"grpo": (1, 4), "lopd": (4, 1)}  # (questions, trajectories per question)
#: ``--backends`` names that are not a registered backend: the HF backend with ``reuse_prefixes=False``.
EXTRA_BACKENDS = ("hf_no_reuse",)


def timed_rollouts(backend_name: str, backend: Any, model: Any, tokenizer: Any, task: Any, examples: list, *,
                   group_size: int, seed: int, greedy: bool = False, sync: bool = False,
                   generation_batch_size: int | None = None) -> tuple[float, Any]:
    """(seconds, RolloutBatch) of one ``generate_rollouts`` call; vLLM's weight sync counted when ``sync``."""
    from lopd_lightning.rollout import generate_rollouts

    start = time.perf_counter()
    if sync and backend_name == "vllm":
        backend.sync_weights(model)
    options = dict(SAMPLING)
    if greedy:
        options.update(greedy=True)
    batch = generate_rollouts(model, tokenizer, task, examples, group_size=group_size, seed=seed, backend=backend,
                              generation_batch_size=generation_batch_size, **options)
    return time.perf_counter() - start, batch


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", default=str(REPO_ROOT / "runs" / "evidence" / "sft_student"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eval-questions", type=int, default=65, help="held-out questions answered greedily (0: none)")
    parser.add_argument("--eval-batch-sizes", default="none",
                        help="comma list of generation_batch_size values for the held-out evaluation (none: all at once)")
    parser.add_argument("--backends", default="hf,vllm", help="comma list of backends to measure: the registered ones (hf, vllm) and hf_no_reuse")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "generation_backends.json")
    args = parser.parse_args(argv)
    from lopd_lightning.rollout.registry import BACKENDS  # the check runs before any model loads

    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    known = (*BACKENDS, *EXTRA_BACKENDS)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"error: --backends: unknown {unknown}; choose from {', '.join(known)}")

    import torch

    from lopd_lightning.models import load_student
    from lopd_lightning.rollout.backends import HFGenerateBackend
    from lopd_lightning.rollout.registry import make_backend
    from lopd_lightning.tasks import get_task

    torch.set_num_threads(args.threads)
    if args.student != "smollm2-135m-instruct" and not Path(args.student).exists():
        raise SystemExit(f"no student at {args.student}: run benchmarks/start_student.py first, or pass "
                         "--student smollm2-135m-instruct")
    model, tokenizer = load_student(args.student)
    model.eval()
    task = get_task("bfcl_live_simple")
    train, held_out = task.examples("train"), task.examples("val")[: args.eval_questions]

    backends: dict[str, Any] = {}
    vllm_start_s = None
    for backend_name in names:
        start = time.perf_counter()
        if backend_name == "hf_no_reuse":  # the HF backend's reference path: every context prefilled whole every turn
            backends[backend_name] = HFGenerateBackend(model, tokenizer, reuse_prefixes=False)
        elif backend_name == "vllm":
            backends[backend_name] = make_backend("vllm", model, tokenizer, options={"max_model_len": 2048, "kv_cache_gib": 2})
            vllm_start_s = time.perf_counter() - start
        else:
            backends[backend_name] = make_backend(backend_name, model, tokenizer)
    eval_sizes = [None if x.strip() == "none" else int(x) for x in args.eval_batch_sizes.split(",")]

    layouts: dict[str, dict[str, Any]] = {}
    for name, (questions, group) in (LAYOUTS.items() if args.repeats else ()):
        rows: dict[str, list[float]] = {b: [] for b in backends}
        for repeat in range(args.repeats + 1):  # repeat 0 warms both backends up and is not counted
            examples = train[repeat * questions:(repeat + 1) * questions]
            for backend_name, backend in backends.items():
                seconds, batch = timed_rollouts(backend_name, backend, model, tokenizer, task, examples,
                                                group_size=group, seed=args.seed + repeat, sync=True)
                if repeat:
                    rows[backend_name].append(len(batch) / seconds)
                print(f"{name} repeat {repeat} {backend_name}: {len(batch)} trajectories in {seconds:.1f} s", flush=True)
        if args.repeats == 0:
            break
        median = {b: statistics.median(v) for b, v in rows.items()}
        layouts[name] = {"trajectories_per_s": rows, "median_trajectories_per_s": median,
                         "speedup_vllm_over_hf": median["vllm"] / median["hf"] if {"vllm", "hf"} <= median.keys() else None,
                         "speedup_hf_reuse": (median["hf"] / median["hf_no_reuse"]
                                              if {"hf", "hf_no_reuse"} <= median.keys() else None)}

    heldout: dict[str, Any] = {}
    for size in eval_sizes if held_out else ():
        for backend_name, backend in backends.items():
            seconds, batch = timed_rollouts(backend_name, backend, model, tokenizer, task, held_out, group_size=1,
                                            seed=args.seed, greedy=True, sync=True, generation_batch_size=size)
            key = backend_name if size is None else f"{backend_name}_batch_{size}"
            heldout[key] = {"seconds": seconds, "success": float((batch.rewards >= 1.0).float().mean()),
                            "generate_calls": batch.stats.generate_calls}
            print(f"held-out {key}: {len(held_out)} questions in {seconds:.1f} s, "
                  f"success {heldout[key]['success']:.3f}", flush=True)

    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = None
    result = {
        "benchmark": "generation_backends",
        "student": args.student,
        "task": "bfcl_live_simple",
        "sampling": SAMPLING,
        "layouts": {k: {"questions": q, "group_size": g} for k, (q, g) in LAYOUTS.items()},
        "repeats": args.repeats,
        "threads": args.threads,
        "speedup_vllm_over_hf": {k: v["speedup_vllm_over_hf"] for k, v in layouts.items()} or None,
        "speedup_hf_reuse": {k: v["speedup_hf_reuse"] for k, v in layouts.items()} or None,
        "by_layout": layouts,
        "vllm_engine_start_s": vllm_start_s,
        "heldout_questions": len(held_out),
        "heldout_eval_s": {k: v["seconds"] for k, v in heldout.items()},
        "heldout_success": {k: v["success"] for k, v in heldout.items()},
        "eval_batch_sizes": eval_sizes,
        "vllm_version": vllm_version,
        **run_metadata(seed=args.seed, argv=argv),
    }
    write_json_atomic(result, args.out)
    print(f"wrote {args.out}: speedup_vllm_over_hf {result['speedup_vllm_over_hf']}, heldout_eval_s "
          f"{result['heldout_eval_s']}")
    return result


if __name__ == "__main__":
    main()
