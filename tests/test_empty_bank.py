"""An empty (or small) bank that MemoryRefresh fills trains LOPD, with retrieval starting once the bank holds J
experiences; without MemoryRefresh such a bank is refused with advice that works (issue 57, item 4)."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import lightning.pytorch  # noqa: F401  (imported here, not under capsys: its log handler keeps the real stderr)
import pytest
import yaml

from helpers import assert_one_line_error, run_main
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.memory import Experience, ExperienceBank, get_embedder, retrieve_from
from lopd_lightning.modules import LOPDModule
from lopd_lightning.modules.lopd_callbacks import MemoryRefresh
from lopd_lightning.tasks.toy import ToyTask

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"  # J = 2, MemoryRefresh every step
QUIET = ["--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0",
         "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
EMPTY_BANK_ADVICE = ("is empty, so LOPD's teacher has no experiences and every step would train nothing (loss 0); "
                     "build it with `lopd build-memory -c CONFIG --from-references` (it writes "
                     "model.init_args.bank_path), or add lopd_lightning.modules.lopd_callbacks.MemoryRefresh to "
                     "trainer.callbacks to fill it from the run's own successes")


def empty_bank(folder: Path) -> Path:
    return ExperienceBank(get_embedder("hashing")).save(folder)


@pytest.mark.parametrize("kind", ["a bank of 0 records", "an empty folder"])
def test_an_empty_bank_with_memory_refresh_trains(tmp_path, capsys, caplog, kind):
    """It was refused: "J=2 is larger than the bank (0 experiences)"; ``bank_path: null`` with the same callback
    trained, since the check that knows MemoryRefresh was skipped whenever bank_path was set."""
    folder = empty_bank(tmp_path / "bank") if kind == "a bank of 0 records" else tmp_path / "bank"
    folder.mkdir(exist_ok=True)
    with caplog.at_level(logging.WARNING):
        code, err = run_main(["fit", "-c", str(TINY_YAML), f"--model.init_args.bank_path={folder}",
                              "--trainer.max_steps=1", *QUIET], capsys)
    assert code in (0, None), err
    assert "error:" not in err
    assert (f"the bank at model.init_args.bank_path {str(folder)!r} is empty: LOPD's teacher reads no experience, and "
            f"LOPD trains nothing, until MemoryRefresh has filled the bank to J=2") in caplog.messages


@pytest.mark.parametrize("kind", ["a bank of 0 records", "an empty folder"])
def test_an_empty_bank_that_nothing_fills_is_refused_with_advice_that_works(tmp_path, capsys, no_model_loading, kind):
    """The refusal advised ``num_experiences <= 0``, which turns retrieval off."""
    folder = empty_bank(tmp_path / "bank") if kind == "a bank of 0 records" else tmp_path / "bank"
    folder.mkdir(exist_ok=True)
    no_refresh = tmp_path / "no_refresh.yaml"
    no_refresh.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "lopd_lightning.modules.lopd_callbacks.MemoryRefresh", "init_args": {"every_n_steps": 0}}]}}))
    code, err = run_main(["fit", "-c", str(TINY_YAML), "-c", str(no_refresh), f"--model.init_args.bank_path={folder}",
                          *QUIET], capsys)
    assert code == 1
    assert_one_line_error(err, f"the bank at model.init_args.bank_path {str(folder)!r} {EMPTY_BANK_ADVICE}")
    assert "<= 0" not in err


def test_an_empty_bank_that_nothing_fills_is_refused_when_fit_starts_in_python(tmp_path):
    folder = empty_bank(tmp_path / "bank")
    module = LOPDModule("tiny", group_size=2, max_new_tokens=4, num_latents=2, num_experiences=2, composer_depth=1,
                        max_experience_tokens=16, embedder="hashing", distill_top_k=4, bank_path=str(folder))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError) as raised:
        trainer.fit(module, OnPolicyDataModule("toy", examples_per_step=1))
    assert str(raised.value) == f"the bank at model.init_args.bank_path {str(folder)!r} {EMPTY_BANK_ADVICE}"
    assert trainer.global_step == 0


def test_retrieval_starts_once_the_bank_holds_j_records():
    """Below J records nothing is retrieved (a teacher context of fewer than J experiences, or of the same few for
    every task, is not what the config asked for); from J on, the search as before."""
    bank = ExperienceBank(get_embedder("hashing"))
    examples = ToyTask().examples("train")[:4]
    bank.add([Experience("other/0", "What is 1+1? Answer with the number only.", "2", 1.0)])
    assert retrieve_from(bank, examples, 2).experiences == [[], [], [], []]
    assert [len(row) for row in retrieve_from(bank, examples, 1).experiences] == [1, 1, 1, 1]
    bank.add([Experience("other/1", "Repeat the word: sun", "sun", 1.0)])
    found = retrieve_from(bank, examples, 2)
    assert [len(row) for row in found.experiences] == [2, 2, 2, 2]
    assert found.experiences == bank.search([e.id for e in examples], [e.text for e in examples], 2).experiences


class Solves(L.Callback):
    """Marks every rollout of the given steps successful (the tiny random model solves nothing), before
    MemoryRefresh reads them; records per step the bank's size before the step and the experiences retrieved."""

    def __init__(self, steps: set[int]):
        self.steps = steps
        self.seen: list[tuple[int, int]] = []
        self.size = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.size = len(pl_module.bank)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((self.size, sum(len(row) for row in batch.experiences or [])))
        if trainer.global_step in self.steps:
            batch.rewards.fill_(1.0)


def test_memory_refresh_from_an_empty_bank_retrieves_nothing_below_j_then_retrieves(tmp_path, caplog):
    """J = 3: each of the first steps' refreshes adds up to two experiences (one example, two rollouts); while the
    bank holds fewer than three the teacher reads none, from then on it retrieves."""
    module = LOPDModule("tiny", group_size=2, max_new_tokens=4, num_latents=2, num_experiences=3, composer_depth=1,
                        max_experience_tokens=16, embedder="hashing", distill_top_k=4,
                        bank_path=str(empty_bank(tmp_path / "bank")), temperature=1.0)
    solves = Solves({1, 2, 3})
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[solves, MemoryRefresh(every_n_steps=1)])
    with caplog.at_level(logging.WARNING):
        trainer.fit(module, OnPolicyDataModule("toy", examples_per_step=1))
    sizes = [size for size, _ in solves.seen]
    assert [found for size, found in solves.seen if size < 3] == [0] * sum(size < 3 for size in sizes)
    assert sizes[-1] >= 3 and solves.seen[-1][1] > 0, solves.seen
    assert any(m.startswith("the bank held fewer than J=3 experiences for the first ") and m.endswith(
        "and retrieval starts") for m in caplog.messages), caplog.messages
