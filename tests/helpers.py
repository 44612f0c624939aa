"""Shared test helpers (imported by the test files and tests/scripts/): toy tasks with rewards the tests
control, a quiet CPU Trainer, the loader of benchmark scripts, and the live-process probe of the sandbox
tests."""

from __future__ import annotations

import errno
import importlib.util
import os
import sys
from pathlib import Path

import lightning as L

from lopd_lightning.tasks import Example
from lopd_lightning.tasks.toy import ToyTask

#: the bank that ships with configs/tiny.yaml: the toy train split's 24 reference solutions, hashing embedder
TINY_BANK = Path(__file__).resolve().parents[1] / "configs" / "tiny_bank"


class EvenToy(ToyTask):
    """Rewards we control: 1 for the even-numbered examples ("toy/0", "toy/2", ...), 0 for the others."""

    def score(self, example: Example, completion: str) -> float:
        return 1.0 if int(example.id.split("/")[1]) % 2 == 0 else 0.0


class ParityToy(ToyTask):
    """Reward 1 when the reply's character codes sum to an even number: rewards vary within a group."""

    def score(self, example: Example, completion: str) -> float:
        return 1.0 if sum(map(ord, completion)) % 2 == 0 else 0.0


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def quiet_trainer(root, *, max_steps: int = 1, callbacks=(), **overrides) -> L.Trainer:
    """A CPU Trainer without logger, checkpoints, validation or progress bar (tests)."""
    options = dict(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(root), callbacks=list(callbacks),
    )
    options.update(overrides)
    return L.Trainer(**options)


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` (the folder is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def alive(*, pgid: int, uid: int | None) -> list[int]:
    """Live (non-zombie) processes in process group / session ``pgid`` or of user ``uid``, from /proc."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/status") as f:
                real_uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        state, _ppid, pgrp, session = stat[stat.rfind(")") + 2 :].split()[:4]
        if state not in ("Z", "X") and (int(pgrp) == pgid or int(session) == pgid or real_uid == uid):
            found.append(int(name))
    return found


def run_main(args: list[str], capsys) -> tuple[int, str]:
    """``lopd <args>`` in process: (exit status, stderr)."""
    from lopd_lightning.cli import main

    try:
        code = main(args)
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


def assert_one_line_error(err: str, expected: str) -> None:
    """stderr ends with exactly ``error: <expected>``: one error line, no traceback, no usage or union dump."""
    lines = err.strip().splitlines()
    assert lines[-1] == f"error: {expected}", err
    assert sum(line.startswith("error:") for line in lines) == 1, err
    for noise in ("Traceback", "usage:", "Given value", "Does not validate", "Subtypes", "full_key"):
        assert noise not in err, err


class FullDiskFile:
    """A file on a disk with ``room`` bytes left: a write past it writes what fits, then raises ENOSPC."""

    def __init__(self, f, room: int):
        self._f, self._room = f, room

    def write(self, data):
        if len(data) > self._room:
            self._f.write(data[: self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False


def fill_disk(monkeypatch, room: int) -> None:
    """From now on every file ``lopd_lightning.io`` writes (checkpoints, summaries, results, the bank) has
    ``room`` bytes of disk left (:class:`FullDiskFile`)."""
    import lopd_lightning.io as lio

    real = lio._temporary_beside

    def temporary_beside(path, mode, encoding):
        f, tmp = real(path, mode, encoding)
        return FullDiskFile(f, room), tmp

    monkeypatch.setattr(lio, "_temporary_beside", temporary_beside)
