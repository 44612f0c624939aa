"""Peak memory of the distillation loss (top-M + tail reverse KL) against sequence length, chunked vs not.

Measures one thing: the extra peak memory of one forward + backward of the LOPD distillation loss on N
token rows, from the final hidden states (N, d) of student and teacher through the LM head (V, d):

- ``unchunked``: ``topk_tail_reverse_kl(h_s @ W.T, h_t @ W.T)``, the (N, V) logits of both sides and
  their log-softmaxes alive at once.
- ``chunked``: ``chunked_topk_tail_reverse_kl(h_s, h_t, W, chunk_size=C)``, (C, V) at a time, recomputed
  in backward.

Setting of a student step: the student hidden states require grad, the teacher's are detached, the head
is frozen (LoRA leaves it untouched); ``--grad-teacher`` / ``--grad-head`` add those gradients. Defaults:
SmolLM2-135M sizes (V = 49,152, d = 576), k = 20, temperature 1, float32.

How memory is measured (the number is "extra" bytes: what the loss adds on top of its inputs):

- CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated()`` minus the allocated bytes before the
  step (inputs already allocated), after ``reset_peak_memory_stats``.
- CPU: every case runs in a fresh Python process (no allocator state carried between cases); after the
  inputs are built, the process's peak resident set is reset (Linux: ``/proc/self/clear_refs`` <- 5) and
  the result is ``VmHWM - VmRSS`` before the step (peak RSS during forward + backward minus RSS before
  it). torch's CPU allocator returns large blocks to the OS, so this follows the live tensors; it also
  counts the few MB of transient allocator / library buffers. Where clear_refs is not writable, the
  process-lifetime ``ru_maxrss`` is used (noted in the JSON as ``memory_method``).

Run::

    python benchmarks/loss_memory.py [--lengths 256,1024,4096,8192] [--chunk-size 256] [--device cpu|cuda]
                                     [--max-unchunked-gib 8] [--out benchmarks/results/loss_memory.json] [--quick]

The JSON is ``{"benchmark": "loss_memory", "settings", "memory_method", "cases": [{"length", "method",
"peak_extra_bytes", "seconds", "skipped"?}], "by_length": {T: {"chunked", "unchunked", "ratio"}},
"target": {...}}`` plus :func:`common.run_metadata`.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` next to this file, when imported too
from common import run_metadata, write_json_atomic  # noqa: E402

from lopd_lightning.losses.lm_head import chunked_topk_tail_reverse_kl  # noqa: E402
from lopd_lightning.losses import topk_tail_reverse_kl  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "loss_memory.json"
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file to write")
    p.add_argument("--lengths", default="256,1024,4096,8192", help="comma-separated N (token rows)")
    p.add_argument("--vocab", type=int, default=49152, help="V (SmolLM2: 49,152)")
    p.add_argument("--hidden", type=int, default=576, help="d (SmolLM2-135M: 576)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--grad-teacher", action="store_true", help="teacher hidden states require grad too")
    p.add_argument("--grad-head", action="store_true", help="the LM head weight requires grad too")
    p.add_argument("--device", default="cpu", help="'cpu', 'cuda' or 'auto'")
    p.add_argument("--max-unchunked-gib", type=float, default=8.0,
                   help="skip an unchunked case whose peak, extrapolated linearly from the largest one run, "
                        "exceeds this (default 8: the 23 GB of RAM here are shared with other jobs)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in-process", action="store_true",
                   help="run the CPU cases in this process (faster, less isolated; implied by --quick)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (tests): N 64,256, V 512, d 32, chunk 32")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.vocab, args.hidden, args.chunk_size = "64,256", 512, 32, 32
        args.in_process = True
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x.strip()]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    return args


# ------------------------------------------------------------------ one case
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_case(args: argparse.Namespace, length: int, method: str) -> dict[str, Any]:
    """One forward + backward of ``method`` ("chunked"/"unchunked") on ``length`` rows, in this process."""
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    d, v = args.hidden, args.vocab
    weight = (torch.randn(v, d, generator=gen) * d**-0.5).to(device).requires_grad_(args.grad_head)
    student = (torch.randn(length, d, generator=gen) * 2).to(device).requires_grad_(True)
    noise = torch.randn(length, d, generator=gen).to(device)
    teacher = (student.detach() + 0.5 * noise).requires_grad_(args.grad_teacher)
    grad_inputs = [x for x in (student, teacher, weight) if x.requires_grad]

    def step() -> float:
        if method == "chunked":
            kl = chunked_topk_tail_reverse_kl(student, teacher, weight, top_k=args.k, chunk_size=args.chunk_size)
        else:
            kl = topk_tail_reverse_kl(F.linear(student, weight), F.linear(teacher, weight), top_k=args.k)
        loss = kl.mean()
        grads = torch.autograd.grad(loss, grad_inputs)
        value = float(loss.detach()) + sum(float(g.sum()) * 0.0 for g in grads)
        del grads, kl, loss
        return value

    # Warm-up on 8 rows: lazy imports and library code pages (checkpoint, BLAS) are not the loss's memory.
    full = (student, teacher)
    student, teacher = student[:8].detach().requires_grad_(True), teacher[:8].detach().requires_grad_(args.grad_teacher)
    grad_inputs = [x for x in (student, teacher, weight) if x.requires_grad]
    step()
    student, teacher = full
    grad_inputs = [x for x in (student, teacher, weight) if x.requires_grad]
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        value = step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - before
        memory_method = "cuda max_memory_allocated - allocated before"
    else:
        reset = _reset_peak_rss()
        before_kib = _status_kib("VmRSS") or 0
        t0 = time.perf_counter()
        value = step()
        seconds = time.perf_counter() - t0
        if reset:
            peak_kib = _status_kib("VmHWM") or 0
            memory_method = "cpu subprocess: VmHWM after clear_refs - VmRSS before"
        else:  # lifetime peak (includes setup): an upper bound
            peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            memory_method = "cpu subprocess: ru_maxrss - VmRSS before (upper bound)"
        peak = max(0, peak_kib - before_kib) * 1024
    return {"length": length, "method": method, "peak_extra_bytes": int(peak),
            "peak_extra_mib": round(peak / 2**20, 1), "seconds": round(seconds, 3), "loss": value,
            "memory_method": memory_method}


def _case_in_subprocess(argv: list[str], length: int, method: str) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--case", f"{length}:{method}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"length": length, "method": method, "error": proc.stderr[-2000:], "returncode": proc.returncode}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.case is not None:
        length, method = args.case.split(":")
        result = run_case(args, int(length), method)
        print(json.dumps(result))
        return result

    child_argv = argv  # each child re-parses the same options, plus --case
    t_start = time.perf_counter()
    cases: list[dict[str, Any]] = []
    per_row_unchunked: float | None = None  # bytes per row, from the largest unchunked case so far
    for length in args.lengths:
        for method in ("chunked", "unchunked"):
            if method == "unchunked" and per_row_unchunked is not None:
                estimate = per_row_unchunked * length
                if estimate > args.max_unchunked_gib * GIB:
                    cases.append({"length": length, "method": method, "skipped": True,
                                  "estimated_peak_extra_bytes": int(estimate),
                                  "reason": f"extrapolated {estimate / GIB:.1f} GiB > --max-unchunked-gib "
                                            f"{args.max_unchunked_gib}"})
                    continue
            if args.device == "cuda" or args.in_process:
                case = run_case(args, length, method)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            else:
                case = _case_in_subprocess(child_argv, length, method)
            cases.append(case)
            if method == "unchunked" and "peak_extra_bytes" in case:
                per_row_unchunked = case["peak_extra_bytes"] / length
            print(json.dumps(case), file=sys.stderr)

    by_length: dict[str, dict[str, Any]] = {}
    for case in cases:
        entry = by_length.setdefault(str(case["length"]), {})
        entry[case["method"]] = case.get("peak_extra_bytes")
    for entry in by_length.values():
        c, u = entry.get("chunked"), entry.get("unchunked")
        entry["unchunked_over_chunked"] = round(u / c, 2) if c and u else None
    chunked = [c for c in cases if c["method"] == "chunked" and "peak_extra_bytes" in c]
    beyond = [c for c in chunked if c["length"] >= 2 * args.chunk_size]
    flat = None
    if len(beyond) >= 2:
        flat = {"lengths": [c["length"] for c in beyond],
                "max_over_min": round(max(c["peak_extra_bytes"] for c in beyond)
                                      / max(1, min(c["peak_extra_bytes"] for c in beyond)), 3)}
    methods = sorted({c["memory_method"] for c in cases if "memory_method" in c})
    report: dict[str, Any] = {
        "benchmark": "loss_memory",
        "settings": {"lengths": args.lengths, "vocab": args.vocab, "hidden": args.hidden,
                     "chunk_size": args.chunk_size, "k": args.k, "temperature": 1.0, "dtype": "float32",
                     "device": args.device, "in_process": args.in_process, "threads": args.threads,
                     "grad_student": True,
                     "grad_teacher": args.grad_teacher, "grad_head": args.grad_head, "quick": args.quick,
                     "logits_bytes_per_row": 4 * args.vocab},
        "memory_method": methods[0] if len(methods) == 1 else methods,
        "cases": cases,
        "by_length": by_length,
        "chunked_flatness": flat,
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        **run_metadata(seed=args.seed, argv=argv),
    }
    write_json_atomic(report, args.out)
    return report


if __name__ == "__main__":
    main()
