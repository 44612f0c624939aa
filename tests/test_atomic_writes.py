"""Every file the project writes appears whole or not at all (issue 57): lopd_lightning.io, then each writer with
a full disk injected part-way through its write: the previous file is intact and no temporary file is left.
(The experience bank's four files: tests/test_bank_files.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import pytest
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

import lopd_lightning.io as lio
from helpers import EvenToy, fill_disk, load_benchmark, quiet_trainer
from lopd_lightning.callbacks import AtomicCheckpointIO, RunSummary
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.modules import GRPOModule

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(room)``: from now on every file lopd_lightning.io opens has ``room`` bytes of space."""

    return lambda room: fill_disk(monkeypatch, room)


def only(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------------------------- lopd_lightning.io
@pytest.mark.parametrize("mode", ["w", "wb"])
def test_atomic_write_under_a_full_disk_leaves_the_previous_file_and_no_temporary(tmp_path, full_disk, mode):
    path = tmp_path / "out" / "file.txt"
    lio.write_text(path, "previous\n")
    full_disk(3)
    with pytest.raises(OSError, match="No space left"), lio.atomic_write(path, mode) as f:
        f.write("the new contents" if mode == "w" else b"the new contents")
    assert path.read_text() == "previous\n" and only(path.parent) == ["file.txt"]


def test_atomic_write_replaces_a_file_whole_with_the_usual_permissions(tmp_path):
    path = lio.write_json(tmp_path / "a" / "b.json", {"x": [1, 2]})
    assert json.loads(path.read_text()) == {"x": [1, 2]} and path.read_text().endswith("\n")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    with pytest.raises(TypeError), lio.atomic_write(path) as f:  # the block raises: nothing replaced
        f.write("{")
        raise TypeError("a value JSON cannot hold")
    assert json.loads(path.read_text()) == {"x": [1, 2]} and only(path.parent) == ["b.json"]
    with pytest.raises(ValueError, match="mode 'w' or 'wb'"), lio.atomic_write(path, "a"):
        pass


def test_replace_files_under_a_full_disk_replaces_none_of_them(tmp_path, full_disk):
    first, second = lio.write_text(tmp_path / "one", "1"), lio.write_text(tmp_path / "two", "2")
    full_disk(4)
    with pytest.raises(OSError, match="No space left"):
        lio.replace_files({first: b"new", second: b"a longer new content"})
    assert (first.read_text(), second.read_text()) == ("1", "2") and only(tmp_path) == ["one", "two"]


def test_unwritable_folder_reason(tmp_path):
    (tmp_path / "file").write_text("x")
    assert lio.unwritable_folder_reason(tmp_path / "new" / "deeper") is None
    assert lio.unwritable_folder_reason(tmp_path / "file" / "x") == f"{str(tmp_path / 'file')!r} is a file, not a folder"
    assert lio.unwritable_folder_reason(tmp_path / "file") == f"{str(tmp_path / 'file')!r} is a file, not a folder"
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "at_all")
    assert lio.unwritable_folder_reason(tmp_path / "dangling" / "x") == (f"{str(tmp_path / 'dangling')!r} is a broken "
                                                                         f"symbolic link")
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------------- checkpoints
def grpo() -> GRPOModule:
    return GRPOModule("tiny", lora=LORA, group_size=2, max_new_tokens=4, learning_rate=1e-3)


def test_checkpoints_are_written_by_atomic_checkpoint_io_and_a_full_disk_keeps_the_previous_one(tmp_path, full_disk):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = quiet_trainer(tmp_path, max_steps=1, enable_checkpointing=True, callbacks=[checkpoints])
    trainer.fit(grpo(), OnPolicyDataModule(EvenToy(num_examples=8), examples_per_step=1))
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO
    last = tmp_path / "ckpt" / "last.ckpt"
    before = last.read_bytes()
    full_disk(1000)  # the checkpoint is some MB: the disk fills part-way
    with pytest.raises(OSError, match="No space left on device"):
        trainer.save_checkpoint(last)
    assert last.read_bytes() == before
    assert not [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]  # no temporary file left


def test_a_checkpoint_writer_the_user_chose_is_left_alone(tmp_path):
    class Mine(TorchCheckpointIO):
        pass

    trainer = quiet_trainer(tmp_path, max_steps=1, plugins=[Mine()])
    trainer.fit(grpo(), OnPolicyDataModule(EvenToy(num_examples=8), examples_per_step=1))
    assert type(trainer.strategy.checkpoint_io) is Mine
    assert AtomicCheckpointIO.install(L.Trainer(accelerator="cpu", logger=False)) is True  # Lightning's default


def test_atomic_checkpoint_io_writes_what_lightning_loads(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 3, "state_dict": {}}, tmp_path / "sub" / "x.ckpt")
    assert io.load_checkpoint(tmp_path / "sub" / "x.ckpt")["global_step"] == 3
    io.save_checkpoint({"global_step": 4}, f"file://{tmp_path / 'y.ckpt'}")
    assert io.load_checkpoint(tmp_path / "y.ckpt")["global_step"] == 4
    with pytest.raises(TypeError):  # Lightning's refusal of storage_options, unchanged
        io.save_checkpoint({}, tmp_path / "z.ckpt", storage_options={"a": 1})


# ---------------------------------------------------------------------------------- run summary, generations
class FixedSummary(RunSummary):
    def summary(self, trainer, pl_module):
        return {"method": "M", "metric": self.metric, "before": 0.1, "after": 0.2, "history": [], "steps": 2,
                "rollouts": 4, "train_seconds": 1.0, "seconds_per_step_median": {}, "peak_rss_mb": 1.0,
                "log_dir": None, "generations": None, "checkpoint": None, "padding": "x" * 5000}


def test_run_summary_under_a_full_disk_leaves_the_previous_summary(tmp_path, full_disk, capsys):
    path = tmp_path / "summary.json"
    path.write_text('{"previous": true}\n')

    class Rank0:
        global_rank = 0

    full_disk(100)
    with pytest.raises(OSError, match="No space left"):
        FixedSummary(json_path=str(path)).on_fit_end(Rank0(), None)
    assert json.loads(path.read_text()) == {"previous": True} and only(tmp_path) == ["summary.json"]


def test_a_generations_file_under_a_full_disk_leaves_the_previous_one(tmp_path, full_disk, monkeypatch):
    module = grpo()
    monkeypatch.setattr(type(module), "generations_dir", lambda self: tmp_path / "generations")
    records = [{"example_id": i, "reward": 1.0, "text": "y" * 200} for i in range(4)]
    path = module.write_generations("val", 3, records[:1])
    before = path.read_bytes()
    full_disk(300)
    with pytest.raises(OSError, match="No space left"):
        module.write_generations("val", 3, records)
    assert path.read_bytes() == before and only(tmp_path / "generations") == ["val_step_3.jsonl"]


# ---------------------------------------------------------------------------------- benchmarks/results/*.json
def test_a_benchmark_result_under_a_full_disk_leaves_the_previous_one(tmp_path, full_disk):
    common = load_benchmark("common")
    path = common.write_json_atomic({"cases": 1}, tmp_path / "results" / "x.json")
    assert path.read_text() == '{\n  "cases": 1\n}\n'
    full_disk(10)
    with pytest.raises(OSError, match="No space left"):
        common.write_json_atomic({"cases": 2, "tracebacks": 0}, path)
    assert json.loads(path.read_text()) == {"cases": 1} and only(path.parent) == ["x.json"]
