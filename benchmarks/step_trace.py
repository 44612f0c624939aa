"""The path of one training step through the project's files: which files it enters, in which order, how often.

Measures one thing: the call-by-call path of one training step of a tiny LOPD module and a tiny GRPO module
(CPU, float32, one torch thread; the tiny random Llama and byte tokenizer of ``lopd_lightning.models``, the
toy task with parity rewards, ``tests/helpers.ParityToy``, so that rewards vary within a group; no
network, no real model). LOPD is configs/tiny.yaml's module and callbacks, read from the file (MarginSchedule,
MemoryRefresh every step, a copy of the shipped bank configs/tiny_bank/, hashing embedder; 2 examples x G 2);
GRPO is tests/scripts/pin_steps.py's (G 4, one example a step, the config's LoRA and reply length).

The step traced is step ``--step`` (default 2: the first one has the one-time work, lazy imports and the
like) of a seeded ``Trainer.fit``: everything that runs in the main thread from the end of the previous
step (the LightningModule's ``on_train_batch_end``, the batch's last hook) to the end of this one, i.e.
the fetch of the examples, ``on_before_batch_transfer`` (rollouts, retrieval), ``on_train_batch_start``,
``training_step`` and every ``on_train_batch_end``. ``sys.setprofile`` sees every Python call and return;
only frames whose code lives under ``src/lopd_lightning/`` (a "project file", named relative to that
folder, e.g. ``rollout/kv_reuse.py``) are counted:

- ``calls``: Python ``call`` events of project frames (a generator's every resumption counts; the
  code objects of comprehensions and generator expressions, ``<listcomp>``, ``<genexpr>`` ..., do not:
  Python 3.12 inlines comprehensions, and they are expressions of their function, not calls).
- the step's POSITION at any moment is the file of the innermost project frame on the stack (none when
  only Lightning, torch or this script run). It changes only when a project frame is called or returns.
  The file PATH is the sequence of positions, leaving out the moments with none and merging repeats:
  ``transitions`` counts its changes A -> B (A != B, both project files).
- ``returns_to_a_file_already_left``: the transitions A -> B of the path whose B was entered before in
  the step (the return from a callee to its caller counts when the callee is in another file; so does a
  second call into a file the step already left: ``of_which_by_a_call`` counts those; the others are
  returns of a frame). Even a step whose every file is called once scores one per cross-file call that
  returns (its return to the caller's file), so the count is a measure of back-and-forth, not a target of 0.
- ``files_entered``: the project files in the order of their first entry; ``packages_entered`` the same
  for their folders (``.`` for the package root).
- ``calls_per_file``: the calls into each file (whoever called); ``top_pairs``: the ``--top`` (caller
  file -> callee file) pairs with the most calls, the caller being the file of the innermost project frame
  below the callee on the stack (project files only, caller != callee); ``entries_from_outside``: calls of
  a project frame with no project frame below it (hooks Lightning calls, the data loader's iterator).
- ``cross_file_calls``: the calls whose caller is another project file (the sum over every pair);
  ``adapters_calls``: ``calls_per_file["adapters.py"]``, and ``adapters_calls_from_other_files`` those
  of them made from another project file.

Run::

    python benchmarks/step_trace.py [--methods lopd,grpo] [--step 2] [--top 10]
                                    [--before EARLIER.json [--before-note TEXT]]
                                    [--out benchmarks/results/step_trace.json]

The JSON is ``{"benchmark": "step_trace", "settings", "methods": {"lopd", "grpo"}}`` plus
:func:`common.run_metadata`; ``--before FILE`` keeps that earlier result's per-method counts, its git sha
and ``--before-note`` under ``"before"`` (read before ``--out`` is written, so it may be the same file).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import torch
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # `common` next to this file, when imported too
sys.path.insert(0, str(ROOT / "tests"))  # helpers.ParityToy: the tests' toy task with varying rewards
from common import run_metadata, write_json_atomic  # noqa: E402

import lightning as L  # noqa: E402

import lopd_lightning  # noqa: E402

DEFAULT_OUT = HERE / "results" / "step_trace.json"
SRC = Path(lopd_lightning.__file__).resolve().parent
TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
TINY_BANK = ROOT / "configs" / "tiny_bank"
#: code objects that are expressions of their function, not calls (their own frames in Python <= 3.11)
EXPRESSIONS = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}
#: the per-method counts ``--before`` keeps
SUMMARY_KEYS = ("n_files", "n_packages", "calls", "cross_file_calls", "transitions", "returns_to_a_file_already_left",
                "of_which_by_a_call", "adapters_calls", "adapters_calls_from_other_files")


class StepTrace:
    """The profile function that records the project's calls and file path (the module docstring's terms).

    Use :meth:`start` and :meth:`stop` from code outside ``src/lopd_lightning/`` (no project frame on the
    stack), then :meth:`summary`. Main thread only (``sys.setprofile``).
    """

    def __init__(self, src: Path = SRC) -> None:
        self.src = str(src) + "/"
        self._files: dict[CodeType, str | None] = {}  # code object -> project file, or None
        self.calls = 0
        self.calls_per_file: Counter[str] = Counter()
        self.pairs: Counter[tuple[str, str]] = Counter()
        self.entries_from_outside = 0
        self.files_entered: list[str] = []
        self.transitions = 0
        self.returns = 0
        self.returns_by_call = 0
        self._position: str | None = None  # the path's last project file

    def _file(self, code: CodeType) -> str | None:
        try:
            return self._files[code]
        except KeyError:
            name = code.co_filename
            file = name[len(self.src):] if name.startswith(self.src) else None
            self._files[code] = file
            return file

    def _below(self, frame: FrameType | None) -> str | None:
        """The file of the innermost project frame from ``frame`` down the stack (None: none)."""
        while frame is not None:
            file = self._file(frame.f_code)
            if file is not None:
                return file
            frame = frame.f_back
        return None

    def _move(self, file: str | None, *, by_call: bool) -> None:
        if file is None or file == self._position:
            return
        if self._position is not None:
            self.transitions += 1
            back = file in self.files_entered
            self.returns += back
            self.returns_by_call += back and by_call
        if file not in self.files_entered:
            self.files_entered.append(file)
        self._position = file

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            file = self._file(frame.f_code)
            if file is None:
                return
            if frame.f_code.co_name not in EXPRESSIONS:
                self.calls += 1
                self.calls_per_file[file] += 1
                caller = self._below(frame.f_back)
                if caller is None:
                    self.entries_from_outside += 1
                elif caller != file:
                    self.pairs[(caller, file)] += 1
            self._move(file, by_call=True)
        elif event == "return":
            if self._file(frame.f_code) is not None:
                self._move(self._below(frame.f_back), by_call=False)

    def start(self) -> None:
        sys.setprofile(self)

    def stop(self) -> None:
        sys.setprofile(None)

    def summary(self, top: int = 10) -> dict[str, Any]:
        """The counts of the module docstring, as a JSON-ready dict."""
        packages: list[str] = []
        for file in self.files_entered:
            package = file.rpartition("/")[0] or "."
            if package not in packages:
                packages.append(package)
        return {
            "n_files": len(self.files_entered),
            "n_packages": len(packages),
            "calls": self.calls,
            "transitions": self.transitions,
            "returns_to_a_file_already_left": self.returns,
            "of_which_by_a_call": self.returns_by_call,
            "cross_file_calls": sum(self.pairs.values()),
            "adapters_calls": self.calls_per_file.get("adapters.py", 0),
            "adapters_calls_from_other_files": sum(n for (_, b), n in self.pairs.items() if b == "adapters.py"),
            "entries_from_outside": self.entries_from_outside,
            "files_entered": list(self.files_entered),
            "packages_entered": packages,
            "calls_per_file": dict(self.calls_per_file.most_common()),
            "top_pairs": [{"caller": a, "callee": b, "calls": n} for (a, b), n in self.pairs.most_common(top)],
        }


def instantiate(spec: dict[str, Any], **override: Any) -> Any:
    """``class_path(**init_args, **override)`` of a config entry."""
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**{**spec.get("init_args", {}), **override})


def build(method: str, bank: Path) -> tuple[Any, Any, list[Any]]:
    """The seeded module, data module and callbacks of ``method`` (the module docstring's settings): LOPD's
    module and callbacks as configs/tiny.yaml names them (its bank at ``bank``), GRPO with that config's LoRA,
    learning rate and reply length."""
    from helpers import ParityToy

    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.modules import GRPOModule

    config = yaml.safe_load(TINY_CONFIG.read_text())
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    if method == "lopd":
        module = instantiate(config["model"], bank_path=str(bank))
        callbacks = [instantiate(spec) for spec in config["trainer"]["callbacks"]]
        per_step = config["data"]["init_args"]["examples_per_step"]
    elif method == "grpo":  # tests/scripts/pin_steps.py's GRPO
        tiny = config["model"]["init_args"]
        module = GRPOModule("tiny", group_size=4, lora=tiny["lora"], learning_rate=tiny["learning_rate"],
                            max_new_tokens=tiny["max_new_tokens"])
        callbacks, per_step = [], 1
    else:
        raise ValueError(f"unknown method {method!r}: lopd or grpo")
    data = OnPolicyDataModule(ParityToy(), examples_per_step=per_step)  # no validation: limit_val_batches=0
    return module, data, callbacks


def trace_method(method: str, *, step: int = 2, top: int = 10) -> dict[str, Any]:
    """Trace step ``step`` (>= 2) of a tiny ``method`` fit; returns :meth:`StepTrace.summary` plus ``step``.

    Raises:
        ValueError: ``step`` < 2, or an unknown method.
    """
    if step < 2:
        raise ValueError(f"--step must be >= 2 (the trace starts at the end of the step before), got {step}")
    tracer = StepTrace()
    with tempfile.TemporaryDirectory() as root:
        bank = Path(root) / "bank"
        shutil.copytree(TINY_BANK, bank)  # MemoryRefresh adds to the bank in memory; the shipped one stays as is
        module, data, callbacks = build(method, bank)
        hook = module.on_train_batch_end
        ended = 0

        def on_train_batch_end(*args: Any, **kwargs: Any) -> Any:  # Lightning calls the module's hook last
            nonlocal ended
            out = hook(*args, **kwargs)
            ended += 1
            if ended == step - 1:
                tracer.start()
            elif ended == step:
                tracer.stop()
            return out

        module.on_train_batch_end = on_train_batch_end
        trainer = L.Trainer(max_steps=step, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=root, callbacks=callbacks)
        try:
            trainer.fit(module, data)
        finally:
            tracer.stop()
    if ended < step:
        raise RuntimeError(f"{method}: the fit ended after {ended} steps, {step} wanted")
    return {"step": step, **tracer.summary(top)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file to write")
    p.add_argument("--methods", default="lopd,grpo", help="comma-separated: lopd, grpo")
    p.add_argument("--step", type=int, default=2, help="the step traced (>= 2)")
    p.add_argument("--top", type=int, default=10, help="how many (caller, callee) file pairs to keep")
    p.add_argument("--before", type=Path, default=None,
                   help="an earlier result of this script whose counts are kept under 'before'")
    p.add_argument("--before-note", default=None, help="what the earlier result measured (kept as before.note)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    before = None
    if args.before is not None:
        earlier = json.loads(args.before.read_text())
        before = {"git_sha": earlier.get("git_sha"), "timestamp": earlier.get("timestamp"),
                  "note": args.before_note,
                  "methods": {m: {k: r[k] for k in SUMMARY_KEYS if k in r} for m, r in earlier["methods"].items()}}
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    methods = {m: trace_method(m, step=args.step, top=args.top) for m in args.methods.split(",")}
    report: dict[str, Any] = {
        "benchmark": "step_trace",
        "settings": {"step": args.step, "top": args.top, "device": "cpu", "dtype": "float32", "threads": 1,
                     "model": "tiny", "task": "ParityToy (tests/helpers.py)", "src": str(SRC.relative_to(ROOT))},
        "methods": methods,
        **run_metadata(seed=0, argv=argv),
    }
    if before is not None:
        report["before"] = before
    write_json_atomic(report, args.out)
    for m, r in methods.items():
        print(f"{m}: {r['n_files']} files, {r['calls']} calls, {r['transitions']} transitions, "
              f"{r['returns_to_a_file_already_left']} returns to a file already left, "
              f"adapters.py {r['adapters_calls']} calls ({r['adapters_calls_from_other_files']} from other files)")
    return report


if __name__ == "__main__":
    main()
