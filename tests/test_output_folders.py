"""Every folder a run writes into is checked before the model loads (issue 57, item 5): a logger's save_dir under
a regular file ended, after the student loaded, in a ~40-line traceback ending in NotADirectoryError; now each
such folder is one ``error:`` line naming its key, and nothing is created."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch  # noqa: F401  (imported here, not under capsys: its log handler keeps the real stderr)
import pytest
import yaml

from helpers import assert_one_line_error, run_main

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"


@pytest.fixture
def a_file(tmp_path) -> Path:
    """A regular file where a folder is expected (``save_dir: results.txt/runs``)."""
    path = tmp_path / "results.txt"
    path.write_text("not a folder\n")
    return path


def refusal(key: str, folder: Path, blocker: Path, what: str = "folder") -> str:
    return (f"{key} {str(folder)!r}: the run cannot create or write this {what} ({str(blocker)!r} is a file, not a "
            f"folder); set {key} to a folder it can write")


def test_a_logger_folder_under_a_regular_file_is_one_line_before_the_model_loads(tmp_path, a_file, capsys,
                                                                                no_model_loading):
    folder = a_file / "runs"
    code, err = run_main(["fit", "-c", str(TINY_YAML), f"--trainer.logger.init_args.save_dir={folder}"], capsys)
    assert code == 1
    assert_one_line_error(err, refusal("trainer.logger.init_args.save_dir", folder, a_file))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]


def callbacks_config(tmp_path: Path, callbacks: list[dict]) -> Path:
    path = tmp_path / "callbacks.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    return path


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test"])
@pytest.mark.parametrize("case", ["default_root_dir", "loggers", "checkpoints", "run summary", "deep"])
def test_every_folder_a_run_writes_is_checked_before_the_model_loads(tmp_path, a_file, capsys, no_model_loading,
                                                                     case, subcommand):
    """The keys a run writes under: Lightning's default_root_dir, a list of loggers, ModelCheckpoint's dirpath,
    RunSummary's json_path (its folder), a file further up than the folder's parent."""
    args = ["-c", str(TINY_YAML)]
    if case == "default_root_dir":
        folder, key = a_file / "root", "trainer.default_root_dir"
        args.append(f"--trainer.default_root_dir={folder}")
    elif case == "loggers":
        folder, key = a_file / "csv", "trainer.logger[1].init_args.save_dir"
        config = tmp_path / "loggers.yaml"
        config.write_text(yaml.safe_dump({"trainer": {"logger": [
            {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(tmp_path / "tb")}},
            {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(folder)}}]}}))
        args += ["-c", str(config)]
    elif case == "checkpoints":
        folder, key = a_file / "ckpts", "trainer.callbacks[2].init_args.dirpath"
        args += ["-c", str(callbacks_config(tmp_path, [
            {"class_path": "lopd_lightning.modules.lopd_callbacks.MarginSchedule"},
            {"class_path": "lopd_lightning.modules.lopd_callbacks.MemoryRefresh", "init_args": {"every_n_steps": 1}},
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": str(folder)}}]))]
    elif case == "run summary":
        folder, key = a_file / "out", "trainer.callbacks[2].init_args.json_path"
        args += ["-c", str(callbacks_config(tmp_path, [
            {"class_path": "lopd_lightning.modules.lopd_callbacks.MarginSchedule"},
            {"class_path": "lopd_lightning.modules.lopd_callbacks.MemoryRefresh", "init_args": {"every_n_steps": 1}},
            {"class_path": "lopd_lightning.callbacks.RunSummary", "init_args": {"json_path": str(folder / "s.json")}}]))]
    else:
        folder, key = a_file / "a" / "b" / "c", "trainer.logger.init_args.save_dir"
        args.append(f"--trainer.logger.init_args.save_dir={folder}")
    code, err = run_main([subcommand, *args], capsys)
    assert code == 1
    what = "file's folder" if case == "run summary" else "folder"
    assert_one_line_error(err, refusal(key, folder, a_file, what))
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".yaml") == ["results.txt"]


def test_build_memory_and_pretrain_composer_check_their_out_folder_first(tmp_path, a_file, capsys, no_model_loading):
    out = a_file / "bank"
    code, err = run_main(["build-memory", "-c", str(TINY_YAML), "--from-references", f"--out={out}"], capsys)
    assert code == 1
    assert_one_line_error(err, refusal("--out", out, a_file))
    code, err = run_main(["build-memory", "-c", str(TINY_YAML), f"--model.init_args.bank_path={out}"], capsys)
    assert code == 1
    assert_one_line_error(err, refusal("model.init_args.bank_path", out, a_file))
    out = a_file / "composer"
    code, err = run_main(["pretrain-composer", "-c", str(TINY_YAML), "--steps=1", f"--out={out}"], capsys)
    assert code == 1
    assert_one_line_error(err, refusal("--out", out, a_file))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any folder")
def test_a_folder_without_write_permission_is_refused(tmp_path, capsys, no_model_loading):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, err = run_main(["fit", "-c", str(TINY_YAML), f"--trainer.logger.init_args.save_dir={locked / 'runs'}"], capsys)
    assert code == 1
    assert_one_line_error(err, f"trainer.logger.init_args.save_dir {str(locked / 'runs')!r}: the run cannot create or "
                               f"write this folder (no permission to write in {str(locked)!r}); set "
                               f"trainer.logger.init_args.save_dir to a folder it can write")
