"""The experience bank's folder as a store a user can trust (issue 57, items 1, 2 and 6): a save that fails or is
cut short never leaves a folder that loads silently wrong, a damaged line is named by file and line, a manifest
that does not match its files is refused in one line, a bank without a manifest (written before there was one)
still loads, and records that repeat an earlier one are dropped on load with their count logged."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import lightning.pytorch  # noqa: F401  (imported here, not under capsys: its log handler keeps the real stderr)
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import TINY_BANK, assert_one_line_error, run_main
from lopd_lightning.memory import Experience, ExperienceBank, get_embedder
from lopd_lightning.memory.persistence import MANIFEST, BankFileError, read_bank_folder
from lopd_lightning.tasks.toy import ToyTask

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"
ONE_STEP = ["--trainer.max_steps=1", "--trainer.logger=false", "--trainer.enable_checkpointing=false"]
REBUILD = ("rebuild the bank with `lopd build-memory -c CONFIG` (add --from-references to seed it from the reference "
           "solutions; it writes model.init_args.bank_path)")


def legacy_copy(folder: Path) -> Path:
    """configs/tiny_bank's three files (a bank written before manifests) copied into ``folder``."""
    folder.mkdir(parents=True)
    for name in ("experiences.jsonl", "embeddings.npy", "meta.json"):
        shutil.copy(TINY_BANK / name, folder / name)
    return folder


def banks() -> tuple[ExperienceBank, ExperienceBank]:
    """Two banks of the same size and embedder (so a loader could take either's vectors for the other's): A, the
    toy task's 24 reference solutions (configs/tiny_bank), and B, 24 records of other tasks (and another capacity,
    so that its meta.json differs too)."""
    embedder = get_embedder("hashing")
    a = ExperienceBank.load(TINY_BANK, embedder)
    b = ExperienceBank(embedder, capacity=100)
    b.add([Experience(f"other/{i}", f"Spell the word number {i} backwards", f"trace {i}", 1.0) for i in range(24)])
    assert len(a) == len(b) == 24
    return a, b


def top2(bank: ExperienceBank) -> list[list[tuple[str, str]]]:
    """(task id, trace) of the top-2 experiences of every toy train task."""
    examples = ToyTask().examples("train")
    found = bank.search([e.id for e in examples], [e.text for e in examples], 2)
    return [[(x.task_id, x.trace) for x in row] for row in found.experiences]


def same_bank(loaded: ExperienceBank, expected: ExperienceBank) -> None:
    assert loaded.records == expected.records and loaded.ids.tolist() == expected.ids.tolist()
    assert np.array_equal(loaded.embeddings, expected.embeddings)
    assert top2(loaded) == top2(expected)


def no_temporary_files(folder: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == ["embeddings.npy", "experiences.jsonl", MANIFEST, "meta.json"]


# ---------------------------------------------------------------------- item 1: a damaged line is named
def cut_mid_record(folder: Path, line: int) -> None:
    """``experiences.jsonl`` cut in the middle of its ``line``-th record (1-based), as a copy that ran out of space."""
    path = folder / "experiences.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_text("".join(lines[: line - 1]) + lines[line - 1][:100], encoding="utf-8")


def test_a_truncated_bank_file_names_the_bank_the_file_and_the_cut_line(tmp_path, capsys, no_model_loading):
    """It said `error: model: Unterminated string ... line 1 column 100`: neither the bank nor the file, and the
    line of the JSON parser (each line parsed alone), not of the file."""
    bank = legacy_copy(tmp_path / "bank")
    cut_mid_record(bank, 7)
    code, err = run_main(["fit", "-c", str(TINY_YAML), f"--model.init_args.bank_path={bank}", *ONE_STEP], capsys)
    assert code == 1
    assert_one_line_error(err, f"model.init_args.bank_path {str(bank)!r}: line 7 of experiences.jsonl is not an "
                               f"experience record (Unterminated string starting at column 99); the file is damaged "
                               f"(cut short, or edited): {REBUILD}, or restore the file")


BANK_BYTES = (TINY_BANK / "experiences.jsonl").read_bytes()
FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(cut=st.integers(min_value=1, max_value=len(BANK_BYTES) - 1))
def test_wherever_the_file_is_cut_the_cut_line_is_named(tmp_path_factory, cut):
    """A cut inside a record names that record's line; a cut at a line's end leaves whole records, which a bank
    without a manifest loads (its vectors then recomputed: their count differs)."""
    folder = legacy_copy(tmp_path_factory.mktemp("bank") / "bank")
    (folder / "experiences.jsonl").write_bytes(BANK_BYTES[:cut])
    line = BANK_BYTES[:cut].count(b"\n") + 1
    if BANK_BYTES[cut - 1 : cut] == b"\n" or BANK_BYTES[cut : cut + 1] == b"\n":  # every line left is whole
        assert len(ExperienceBank.load(folder, get_embedder("hashing"))) == BANK_BYTES[:cut].strip().count(b"\n") + 1
        return
    with pytest.raises(BankFileError, match=rf": line {line} of experiences.jsonl is not an experience record \("):
        read_bank_folder(folder)


@FUZZ
@given(at=st.sampled_from([i for i, byte in enumerate(BANK_BYTES) if byte != ord("\n")]))
def test_a_damaged_byte_names_its_line(tmp_path_factory, at):
    """A NUL byte anywhere in a record (in a string, JSON refuses the control character; elsewhere, the syntax)."""
    folder = legacy_copy(tmp_path_factory.mktemp("bank") / "bank")
    (folder / "experiences.jsonl").write_bytes(BANK_BYTES[:at] + b"\0" + BANK_BYTES[at + 1 :])
    line = BANK_BYTES[:at].count(b"\n") + 1
    with pytest.raises(BankFileError, match=rf": line {line} of experiences.jsonl is not an experience record \("):
        read_bank_folder(folder)


@pytest.mark.parametrize("line, reason", [
    ('{"id": 3, "task_text": "x", "trace": "y", "reward": 1.0}', "no field 'task_id'"),
    ('[1, 2]', "a JSON list, not an object"),
    ('{"task_id": "a", "task_text": "x", "trace": "y", "reward": "high"}', "could not convert string to float: 'high'"),
    ('{"task_id": "a", "task_text": "x", "trace": "y", "reward": NaN}', "reward nan is not finite"),
])
def test_a_line_that_is_json_but_no_record_is_named(tmp_path, line, reason):
    folder = legacy_copy(tmp_path / "bank")
    lines = (folder / "experiences.jsonl").read_text(encoding="utf-8").splitlines()
    lines[4] = line
    (folder / "experiences.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(BankFileError) as raised:
        read_bank_folder(folder)
    assert str(raised.value) == (f"model.init_args.bank_path {str(folder)!r}: line 5 of experiences.jsonl is not an "
                                 f"experience record ({reason}); the file is damaged (cut short, or edited): {REBUILD}, "
                                 f"or restore the file")


def test_a_byte_order_mark_and_windows_line_ends_are_read(tmp_path):
    """A bank opened and saved in an editor that adds a BOM and CRLF line ends holds the same records."""
    folder = legacy_copy(tmp_path / "bank")
    text = (folder / "experiences.jsonl").read_text(encoding="utf-8")
    (folder / "experiences.jsonl").write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode("utf-8"))
    assert ExperienceBank.load(folder, get_embedder("hashing")).records == ExperienceBank.load(
        TINY_BANK, get_embedder("hashing")).records


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "embeddings.npy").write_bytes((f / "embeddings.npy").read_bytes()[:200]), "embeddings.npy is damaged"),
    (lambda f: (f / "embeddings.npy").unlink(), "has a meta.json but no embeddings.npy"),
    (lambda f: (f / "meta.json").write_text('{"version": 1,'), "meta.json is damaged"),
])
def test_a_damaged_or_missing_vector_or_meta_file_is_one_line_naming_it(tmp_path, capsys, no_model_loading, damage,
                                                                        message):
    folder = legacy_copy(tmp_path / "bank")
    damage(folder)
    code, err = run_main(["fit", "-c", str(TINY_YAML), f"--model.init_args.bank_path={folder}", *ONE_STEP], capsys)
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: model.init_args.bank_path {str(folder)!r}: " if ":" in message[:20] else
                           f"error: model.init_args.bank_path {str(folder)!r}"), err
    assert message in line and line.endswith(REBUILD), err
    assert_one_line_error(err, line.removeprefix("error: "))


# ---------------------------------------------------------------------- item 2: a save that fails half-way
def test_a_save_that_fails_while_writing_the_vectors_leaves_the_previous_bank(tmp_path, monkeypatch):
    """Disk full while a rebuilt bank was written over the old one: the folder ended with the new records and the
    old vectors, and the next load reused those (same embedder name and shape): retrieval silently wrong."""
    a, b = banks()
    folder = tmp_path / "bank"
    a.save(folder)
    real_save = np.save

    def disk_full(file, array, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        b.save(folder)
    monkeypatch.setattr(np, "save", real_save)
    same_bank(ExperienceBank.load(folder, get_embedder("hashing")), a)
    no_temporary_files(folder)


@pytest.mark.parametrize("failing_write", [1, 2, 3, 4])
def test_a_save_whose_nth_file_does_not_fit_on_the_disk_leaves_the_previous_bank(tmp_path, monkeypatch, failing_write):
    """The disk fills while the n-th of the four files is written (its fsync reports it): nothing of the new bank is
    in place, the old one loads as it was, and no temporary file is left."""
    a, b = banks()
    folder = tmp_path / "bank"
    a.save(folder)
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        if os.path.isfile(f"/proc/self/fd/{fd}"):  # a file's (not a folder's) fsync: its data reaches the disk
            calls.append(fd)
            if len(calls) == failing_write:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="No space left"):
        b.save(folder)
    monkeypatch.setattr(os, "fsync", real_fsync)
    same_bank(ExperienceBank.load(folder, get_embedder("hashing")), a)
    no_temporary_files(folder)


def cut_short_save(monkeypatch, bank: ExperienceBank, folder: Path, renames: int) -> None:
    """``bank.save(folder)`` killed after its first ``renames`` renames (the files already renamed are new)."""
    real_replace, done = os.replace, []

    class Killed(BaseException):
        pass

    def replace(src, dst):
        if len(done) == renames:
            raise Killed
        done.append(dst)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Killed):
        bank.save(folder)
    monkeypatch.setattr(os, "replace", real_replace)


@pytest.mark.parametrize("legacy", [False, True], ids=["over a bank with a manifest", "over a bank without one"])
@pytest.mark.parametrize("renames", [1, 2, 3])
def test_a_save_killed_between_its_renames_is_refused_on_load_naming_the_folder_and_the_fix(
        tmp_path, monkeypatch, renames, legacy):
    """Some files new, some old: every such mix is refused in one line (the manifest is renamed first, so even a
    bank that had none is caught); a kill before the first rename leaves the old bank, after the last the new."""
    a, b = banks()
    folder = legacy_copy(tmp_path / "bank") if legacy else a.save(tmp_path / "bank")
    cut_short_save(monkeypatch, b, folder, renames)
    with pytest.raises(BankFileError) as raised:
        ExperienceBank.load(folder, get_embedder("hashing"))
    message = str(raised.value)
    assert message.startswith(f"model.init_args.bank_path {str(folder)!r}: the bank's files do not match its "
                              f"manifest.json (") and "\n" not in message
    assert message.endswith(f"): a save was cut short or a file was changed by hand; {REBUILD}")


@pytest.mark.parametrize("renames, expected", [(0, "a"), (4, "b")])
def test_a_save_killed_before_its_first_rename_or_after_its_last_leaves_a_whole_bank(tmp_path, monkeypatch, renames,
                                                                                     expected):
    a, b = banks()
    folder = a.save(tmp_path / "bank")
    if renames < 4:
        cut_short_save(monkeypatch, b, folder, renames)
    else:
        b.save(folder)
    same_bank(ExperienceBank.load(folder, get_embedder("hashing")), {"a": a, "b": b}[expected])


def test_a_mixed_bank_is_one_line_from_lopd_fit_before_the_student_loads(tmp_path, monkeypatch, capsys,
                                                                         no_model_loading):
    a, b = banks()
    folder = a.save(tmp_path / "bank")
    cut_short_save(monkeypatch, b, folder, 2)  # the manifest and the records new, the vectors and meta old
    code, err = run_main(["fit", "-c", str(TINY_YAML), f"--model.init_args.bank_path={folder}", *ONE_STEP], capsys)
    assert code == 1
    assert_one_line_error(err, f"model.init_args.bank_path {str(folder)!r}: the bank's files do not match its "
                               f"manifest.json (embeddings.npy, meta.json not the files it records): a save was cut "
                               f"short or a file was changed by hand; {REBUILD}")


def test_a_file_changed_by_hand_or_a_record_count_that_differs_is_refused(tmp_path):
    a, _ = banks()
    folder = a.save(tmp_path / "bank")
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["records"] == 24 and manifest["dim"] == 64 and manifest["format"] == 1
    lines = (folder / "experiences.jsonl").read_text().splitlines(keepends=True)
    (folder / "experiences.jsonl").write_text("".join(lines[:-1]))  # cut at a line's end: every line a record
    with pytest.raises(BankFileError, match=r"\(experiences.jsonl has 23 records, the manifest 24; experiences.jsonl "
                                            r"not the file it records\)"):
        read_bank_folder(folder)
    (folder / MANIFEST).write_text('{"format": 1')
    with pytest.raises(BankFileError, match=r"manifest.json is damaged"):
        read_bank_folder(folder)


def test_build_memory_writes_a_manifest_that_a_load_checks(tmp_path, capsys, no_model_loading):
    out = tmp_path / "bank"
    assert run_main(["build-memory", "-c", str(TINY_YAML), "--from-references", "--out", str(out), "--limit", "3"],
                    capsys)[0] == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["records"] == 3 and set(manifest["sha256"]) == {"experiences.jsonl", "embeddings.npy", "meta.json"}
    assert len(ExperienceBank.load(out, get_embedder("hashing"))) == 3


# ---------------------------------------------------------------------- banks written before manifests
def test_a_bank_without_a_manifest_loads_as_before_and_says_so_once(tmp_path, caplog):
    folder = legacy_copy(tmp_path / "legacy")
    with caplog.at_level(logging.INFO, logger="lopd_lightning.memory.persistence"):
        first = ExperienceBank.load(folder, get_embedder("hashing"))
        second = ExperienceBank.load(folder, get_embedder("hashing"))
    notes = [r.getMessage() for r in caplog.records if "no manifest.json" in r.getMessage()]
    assert notes == [f"experience bank {folder} has no manifest.json (written before lopd_lightning wrote one), so its "
                     f"files are read unchecked; `lopd build-memory` writes banks with one"]
    assert len(first) == 24 and first.records == second.records
    resaved = first.save(tmp_path / "resaved")  # the same bank with a manifest: the same retrieval
    assert top2(ExperienceBank.load(resaved, get_embedder("hashing"))) == top2(first)
    for name in ("experiences.jsonl", "embeddings.npy", "meta.json"):
        assert (resaved / name).read_bytes() == (folder / name).read_bytes(), name


# ---------------------------------------------------------------------- item 6: duplicates on load
def test_a_bank_with_every_record_twice_keeps_each_once_and_logs_the_count(tmp_path, caplog):
    """Two banks concatenated: 48 records for 24 distinct, and 6 of 8 top-2 searches handed the teacher the same
    experience twice."""
    folder = legacy_copy(tmp_path / "twice")
    (folder / "experiences.jsonl").write_text((TINY_BANK / "experiences.jsonl").read_text() * 2)
    vectors = np.load(TINY_BANK / "embeddings.npy")
    np.save(folder / "embeddings.npy", np.concatenate([vectors, vectors]))
    with caplog.at_level(logging.WARNING, logger="lopd_lightning.memory.persistence"):
        bank = ExperienceBank.load(folder, get_embedder("hashing"))
    assert len(bank) == 24
    assert [r.getMessage() for r in caplog.records] == [
        f"experience bank {folder}: 24 records repeat an earlier one (same task_id and trace) and were dropped; 24 kept"]
    same_bank(bank, ExperienceBank.load(TINY_BANK, get_embedder("hashing")))
    for row in top2(bank):
        assert len(row) == len(set(row)) == 2


def test_two_different_banks_concatenated_keep_every_distinct_record_with_ids_of_their_own(tmp_path, caplog):
    """The second bank's ids repeat the first's (both count from 0): they are numbered again, so that an id names
    one record; vectors are kept (the counts match)."""
    a, b = banks()
    first, second = a.save(tmp_path / "a"), b.save(tmp_path / "b")
    folder = legacy_copy(tmp_path / "both")
    (folder / "experiences.jsonl").write_text((first / "experiences.jsonl").read_text()
                                              + (second / "experiences.jsonl").read_text())
    np.save(folder / "embeddings.npy", np.concatenate([a.embeddings, b.embeddings]))
    with caplog.at_level(logging.WARNING, logger="lopd_lightning.memory.persistence"):
        both = ExperienceBank.load(folder, get_embedder("hashing"))
    assert len(both) == 48 and both.ids.tolist() == list(range(48))
    assert np.array_equal(both.embeddings, np.concatenate([a.embeddings, b.embeddings]))
    assert any("ids repeat" in r.getMessage() for r in caplog.records)
