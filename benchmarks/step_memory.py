"""Where one training step's memory goes: live tensor bytes by phase, against the process's peak RSS.

    python benchmarks/step_memory.py --model runs/quickstart/sft_student --threads 2   # -> results/step_memory.json
    python benchmarks/step_memory.py --quick                                            # tests: tiny model, toy task

Each case (method x activation checkpointing) runs in a fresh process, so no case inherits another's heap:
the modules and settings of ``step_cost.py`` (LOPD 4 tasks x 1 rollout, GRPO 1 task x G = 4, LoRA r16, the
HF backend), ``--warmup`` steps, then one measured step. During the measured step a ``TorchDispatchMode``
(:class:`LiveBytes`) counts the bytes of every tensor storage an operator creates on the CPU until that
storage is freed, labelled with the phase that is running: ``generation`` (``make_batch``), the module's
``timed`` phases (``student_step``, ``teacher``, ``composer_step``, ``backward``, ...), ``other`` outside them.
Per case:

* ``rss_peak_mb``: the kernel's peak RSS (VmHWM) over the measured step, reset at its start;
  ``rss_start_mb``: the RSS then (weights, optimiser state, the allocator's retained heap, libraries);
  ``rss_hwm_after_phase_mb``: VmHWM read as each phase last ends, so the phase where the peak grew shows.
* ``live_peak_mb``: the most bytes of step-created storages alive at once; ``live_peak_phase``: the phase
  at that moment; ``live_peak_by_phase_mb``: the most alive during each phase; ``live_end_mb``: still alive
  at the step's end (new optimiser state, caches).
* ``resident_mb``: parameters, their gradients and optimiser state at the step's start (unique storages).
  ``rss_start_mb`` minus it is the libraries plus the heap the allocator kept from the warm-up steps.

``settings.allocator_env`` records the allocator settings the run had (``MALLOC_*``, ``LD_PRELOAD``,
``GLIBC_TUNABLES``). Storages created outside an operator (``torch.empty`` inside a C++ kernel that returns no tensor, numpy)
are not seen; an output on one of its operator's input storages (a view, an in-place or ``out=`` result)
is not a new storage, whenever that storage was made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_metadata, write_json_atomic  # noqa: E402
import step_cost  # noqa: E402  (its modules and settings, its VmHWM reset and /proc/self/status reader)
from step_cost import _reset_peak_rss, status_mb  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "step_memory.json"
CASES = ("grpo:off", "lopd:off", "grpo:on", "lopd:on")
MIB = 2**20


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of CPU tensor storages created by operators while active, until each is freed.

    ``phase`` labels what runs now; ``peak`` / ``peak_phase`` the most bytes alive at once and the phase at
    that moment; ``peak_by_phase`` the most alive during each phase. Units: bytes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # storage data_ptr -> nbytes
        self.current = 0
        self.peak = 0
        self.peak_phase: str | None = None
        self.peak_by_phase: dict[str, int] = {}
        self.phase = "other"

    def set_phase(self, phase: str) -> str:
        previous, self.phase = self.phase, phase
        self.peak_by_phase[phase] = max(self.peak_by_phase.get(phase, 0), self.current)
        return previous

    def _freed(self, ptr: int) -> None:
        self.current -= self.live.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # an output on an input's storage (a view, an in-place or out= result) is not a new storage, whether
        # that storage was created before the tracking began (a parameter, optimiser state) or during it
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if not nbytes or ptr in self.live or ptr in inputs:
                continue
            self.live[ptr] = nbytes
            self.current += nbytes
            # storages keep their Python object while the C++ storage lives: the finalizer runs at the free
            weakref.finalize(storage, self._freed, ptr)
        if self.current > self.peak:
            self.peak, self.peak_phase = self.current, self.phase
        if self.current > self.peak_by_phase.get(self.phase, 0):
            self.peak_by_phase[self.phase] = self.current
        return out


def resident_bytes(module: torch.nn.Module, optimizers: list[Any]) -> int:
    """Bytes of the unique storages of ``module``'s parameters, their gradients and the optimisers' state."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.numel():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()

    for p in module.parameters():
        add(p)
        add(p.grad)
    for opt in optimizers:
        for state in getattr(opt, "state", {}).values():
            for v in state.values():
                add(v)
    return sum(seen.values())


class MeasuredStep:
    """Tracks the ``warmup``-th step (0-based) of ``module``: wraps ``make_batch`` and ``timed`` to label phases."""

    def __init__(self, module: Any, warmup: int) -> None:
        self.module, self.warmup, self.calls = module, warmup, 0
        self.tracker: LiveBytes | None = None
        self.result: dict[str, Any] = {}
        self.hwm_after: dict[str, float | None] = {}
        make_batch, timed = module.make_batch, module.timed

        def tracked_make_batch(task, examples):
            if self.calls == self.warmup:
                self.start()
            self.calls += 1
            with self.phase("generation"):
                return make_batch(task, examples)

        @contextmanager
        def tracked_timed(phase: str):
            with timed(phase), self.phase(phase):
                yield

        module.make_batch, module.timed = tracked_make_batch, tracked_timed

    @contextmanager
    def phase(self, name: str):
        if self.tracker is None:
            yield
            return
        previous = self.tracker.set_phase(name)
        try:
            yield
        finally:
            self.hwm_after[name] = status_mb("VmHWM")
            if self.tracker is not None:
                self.tracker.set_phase(previous)

    def start(self) -> None:
        trainer = self.module.trainer
        self.result["resident_mb"] = round(resident_bytes(self.module, list(trainer.optimizers)) / MIB, 1)
        self.result["rss_start_mb"] = status_mb("VmRSS")
        self.result["rss_reset"] = _reset_peak_rss()
        self.t0 = time.perf_counter()
        self.tracker = LiveBytes()
        self.tracker.__enter__()

    def stop(self) -> None:
        if self.tracker is None:
            return
        tracker, self.tracker = self.tracker, None
        tracker.__exit__(None, None, None)
        rss_peak = status_mb("VmHWM") if self.result["rss_reset"] else None
        live_peak = tracker.peak / MIB
        self.result.update(
            step_s=round(time.perf_counter() - self.t0, 2),
            rss_peak_mb=rss_peak,
            rss_hwm_after_phase_mb=self.hwm_after,
            live_peak_mb=round(live_peak, 1),
            live_peak_phase=tracker.peak_phase,
            live_peak_by_phase_mb={k: round(v / MIB, 1) for k, v in sorted(tracker.peak_by_phase.items())},
            live_end_mb=round(tracker.current / MIB, 1),
        )


def allocator_env() -> dict[str, str]:
    """The environment that changes how memory is allocated: glibc's ``MALLOC_*`` tunables and ``LD_PRELOAD``
    (another allocator, e.g. jemalloc); the cases' processes inherit it."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") or k in ("LD_PRELOAD", "GLIBC_TUNABLES")}


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """One method, checkpointing on or off: ``warmup`` steps, then the measured one (in this process)."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    method, ckpt = case.split(":")
    argv = ["--model", args.model, "--trajectories", str(args.trajectories), "--threads", str(args.threads)]
    if args.quick:
        argv.append("--quick")
    if ckpt == "on":
        argv.append("--gradient-checkpointing")
    cost_args = step_cost.parse_args(argv)
    torch.set_num_threads(cost_args.threads)
    L.seed_everything(args.seed, workers=False, verbose=False)
    module, dm, callbacks, info = step_cost.build(method, cost_args)
    measured = MeasuredStep(module, args.warmup)

    class Stop(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if measured.tracker is not None:
                measured.stop()
                measured.result.update(trajectories=len(batch), sequence_tokens=int(batch.input_ids.numel()),
                                       assistant_tokens=int(batch.assistant_mask.sum()))

    trainer = L.Trainer(max_steps=args.warmup + 1, accelerator="cpu", devices=1, precision="32-true", logger=False,
                        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[*callbacks, Stop()])
    trainer.fit(module, datamodule=dm)
    return {"method": method, "gradient_checkpointing": ckpt == "on", **info, **measured.result}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="'smollm2-135m-instruct', 'tiny' or a folder")
    p.add_argument("--trajectories", type=int, default=4, help="trajectories per step, both methods")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps before the measured one")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of method:on|off (default {','.join(CASES)})")
    p.add_argument("--out", type=Path, default=None, help=f"the JSON file to write (default {DEFAULT_OUT.name} in results/)")
    p.add_argument("--quick", action="store_true", help="tests: tiny model, toy task, 4 trajectories (needs --out)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case here, print its JSON
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        method, _, ckpt = c.partition(":")
        if method not in ("lopd", "grpo") or ckpt not in ("on", "off"):
            p.error(f"--cases: {c!r} is not method:on|off with method lopd or grpo")
    if not cases:
        p.error("--cases is empty: give method:on|off, e.g. --cases lopd:on,grpo:on")
    if args.warmup < 0 or args.threads < 1 or args.trajectories < 4 or args.trajectories % 4:
        p.error("need --warmup >= 0, --threads >= 1 and --trajectories a positive multiple of 4 (GRPO's group)")
    if args.quick and args.out is None:
        p.error("--quick needs --out (the default file holds the real model's results)")
    if not args.quick and args.model not in ("smollm2-135m-instruct", "tiny") and not Path(args.model).is_dir():
        p.error(f"--model {args.model}: no such folder (give a Hugging Face folder, 'smollm2-135m-instruct' or 'tiny')")
    args.out = args.out or DEFAULT_OUT
    args.cases = cases
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.case:
        try:
            print("STEP_MEMORY " + json.dumps(run_case(args.case, args)))
        except Exception as err:  # noqa: BLE001 (the parent reports it in one line)
            import traceback

            traceback.print_exc()
            print(f"STEP_MEMORY_ERROR {type(err).__name__}: {' '.join(str(err).split())}")
            raise SystemExit(1) from None
        return {}
    results = []
    for case in args.cases:
        child = [sys.executable, str(Path(__file__).resolve()), *argv, "--case", case]
        proc = subprocess.run(child, capture_output=True, text=True, env=os.environ.copy())
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("STEP_MEMORY ")]
        if proc.returncode or not lines:
            errors = [ln.removeprefix("STEP_MEMORY_ERROR ") for ln in proc.stdout.splitlines()
                      if ln.startswith("STEP_MEMORY_ERROR ")]
            why = errors[-1] if errors else f"exit status {proc.returncode}"
            raise SystemExit(f"error: case {case} failed: {why} (its traceback: {' '.join(child)})")
        results.append(json.loads(lines[-1].removeprefix("STEP_MEMORY ")))
        r = results[-1]
        print(f"{case}: RSS peak {r['rss_peak_mb']} MB (start {r['rss_start_mb']}), live peak {r['live_peak_mb']} MB "
              f"in {r['live_peak_phase']}", flush=True)
    by = {(r["method"], r["gradient_checkpointing"]): r for r in results}
    ratios = {}
    for ckpt, name in ((False, "off"), (True, "on")):
        lopd, grpo = by.get(("lopd", ckpt)), by.get(("grpo", ckpt))
        if lopd and grpo and lopd["rss_peak_mb"] and grpo["rss_peak_mb"]:
            ratios[name] = {"rss_peak": round(lopd["rss_peak_mb"] / grpo["rss_peak_mb"], 3),
                            "live_peak": round(lopd["live_peak_mb"] / grpo["live_peak_mb"], 3)}
    report = {"benchmark": "step_memory", "model": "tiny" if args.quick else args.model,
              "settings": {"trajectories": args.trajectories, "warmup": args.warmup, "threads": args.threads,
                           "quick": args.quick, "step_cost_settings": "step_cost.py's build()",
                           "allocator_env": allocator_env()},
              "cases": results, "ratio_lopd_over_grpo": ratios, **run_metadata(seed=args.seed, argv=argv)}
    write_json_atomic(report, args.out)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
