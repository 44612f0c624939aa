"""The ``lopd`` command: ``--print_config`` of every shipped config (without loading any model),
``lopd tasks verify|list`` and ``lopd build-memory``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lopd_lightning.cli import _lightning_cli, main
from lopd_lightning.memory.bank import ExperienceBank
from lopd_lightning.memory.embed import get_embedder
from lopd_lightning.tasks import TASK_NAMES
from lopd_lightning.tasks.toy import ToyTask

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("**/*.yaml"))
TINY_YAML = ROOT / "configs" / "tiny.yaml"




@pytest.fixture
def no_model_loading(monkeypatch):
    """--print_config must exit before any class is instantiated: loading a student fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a student was loaded")

    monkeypatch.setattr("lopd_lightning.modules.base.load_student", refuse)


def print_config(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        _lightning_cli(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_there_are_configs_to_check():
    assert TINY_YAML in CONFIGS


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c.relative_to(ROOT / "configs")) for c in CONFIGS])
def test_print_config_parses_every_shipped_config(config, capsys, no_model_loading):
    printed = print_config(["-c", str(config)], capsys)
    assert {"trainer", "model", "data"} <= set(printed)
    source = yaml.safe_load(config.read_text())
    if isinstance(source.get("model"), dict) and "class_path" in source["model"]:
        assert printed["model"]["class_path"].split(".")[-1] == source["model"]["class_path"].split(".")[-1]


def test_print_config_needs_neither_the_model_nor_the_bank_folder(tmp_path, capsys, no_model_loading):
    """A config naming the packaged SmolLM2 and a bank folder that does not exist still prints."""
    missing = tmp_path / "no_such_bank"
    printed = print_config(
        ["-c", str(TINY_YAML), "--model.init_args.model=smollm2-135m-instruct", f"--model.init_args.bank_path={missing}"],
        capsys,
    )
    assert printed["model"]["init_args"]["model"] == "smollm2-135m-instruct"
    assert printed["model"]["init_args"]["bank_path"] == str(missing)
    assert printed["model"]["init_args"]["num_latents"] == 4  # from tiny.yaml
    assert not missing.exists()


def test_tasks_verify_toy_gives_full_marks(capsys):
    assert main(["tasks", "verify", "toy"]) == 0
    out = capsys.readouterr().out
    assert "toy: 32/32 reference solutions score 1.0" in out  # ToyTask has 32 examples
    assert "FAIL" not in out
    assert main(["tasks", "verify", "toy", "--split", "train", "--limit", "5"]) == 0
    assert "toy: 5/5 reference solutions score 1.0" in capsys.readouterr().out


def test_tasks_verify_reports_broken_references(monkeypatch, capsys):
    class BrokenToy(ToyTask):
        def reference_replies(self, example):  # wrong on the odd-numbered examples
            return ["wrong"] if int(example.id.split("/")[1]) % 2 else super().reference_replies(example)

    monkeypatch.setattr("lopd_lightning.tasks.get_task", lambda name, **kw: BrokenToy())
    assert main(["tasks", "verify", "toy"]) == 1
    out = capsys.readouterr().out
    assert "toy: 16/32 reference solutions score 1.0" in out
    assert "FAIL toy/1: reward 0.0" in out


def test_tasks_list_prints_every_registered_name(capsys):
    assert main(["tasks", "list"]) == 0
    assert capsys.readouterr().out.split() == list(TASK_NAMES)


def test_build_memory_from_references_writes_a_loadable_bank(tmp_path, capsys):
    out = tmp_path / "bank"
    assert main(["build-memory", "-c", str(TINY_YAML), "--from-references", "--out", str(out)]) == 0
    assert "bank: 24 experiences from 24 train examples (reference solutions)" in capsys.readouterr().out
    bank = ExperienceBank.load(out, get_embedder("hashing"))
    task = ToyTask()
    train = task.examples("train")
    assert len(bank) == len(train) == 24  # 32 toy examples minus ceil(0.25 * 32) = 8 for val
    by_id = {r.task_id: r for r in bank.records}
    assert set(by_id) == {ex.id for ex in train}
    for ex in train:
        record = by_id[ex.id]
        assert record.reward == 1.0 and record.task_text == ex.text
        assert record.trace.endswith(f"[action] {ex.data['answer']}")


def test_build_memory_from_rollouts_keeps_what_reaches_min_reward(tmp_path, capsys):
    out = tmp_path / "bank"
    args = ["build-memory", "-c", str(TINY_YAML), "--out", str(out), "--limit", "4", "--rollouts", "1"]
    # min reward 0: every rollout is kept, one per example (distinct task ids, so no de-duplication)
    assert main([*args, "--min-reward", "0"]) == 0
    assert len(ExperienceBank.load(out, get_embedder("hashing"))) == 4
    # min reward above 1: nothing can be kept
    assert main([*args, "--min-reward", "1.5"]) == 0
    assert len(ExperienceBank.load(out, get_embedder("hashing"))) == 0
    assert "bank: 0 experiences from 4 train examples (rollouts)" in capsys.readouterr().out


@pytest.mark.parametrize("subcommand, prefix", [("validate", "val"), ("test", "test")])
def test_validate_and_test_subcommands_run_greedy_episodes(tmp_path, subcommand, prefix):
    cli = _lightning_cli([
        subcommand, "-c", str(TINY_YAML), "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ])
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert metrics[f"{prefix}/turns_mean"] == 1.0  # the toy task is single-turn
    assert 0.0 <= metrics[f"{prefix}/success_rate"] <= metrics[f"{prefix}/reward_mean"] <= 1.0


def test_build_memory_writes_to_the_configured_bank_path_then_fit_loads_it(tmp_path, capsys):
    """The config's bank_path is where build-memory writes (it need not exist yet); a module then loads it."""
    bank = tmp_path / "bank"
    overrides = [f"--model.init_args.bank_path={bank}"]
    assert main(["build-memory", "-c", str(TINY_YAML), "--from-references", *overrides]) == 0
    assert f"-> {bank}" in capsys.readouterr().out
    cli = _lightning_cli(["-c", str(TINY_YAML), *overrides, "--trainer.logger=false"], run=False)
    assert len(cli.model.bank) == 24


def test_missing_bank_folder_names_the_fix(tmp_path):
    with pytest.raises(Exception, match="lopd build-memory"):
        _lightning_cli(["-c", str(TINY_YAML), f"--model.init_args.bank_path={tmp_path / 'none'}",
                        "--trainer.logger=false"], run=False)


def test_build_memory_from_references_replays_and_scores_each_reference(tmp_path, capsys):
    """References are scored through the task, not assumed correct: above every reachable reward none is kept."""
    out = tmp_path / "bank"
    assert main(["build-memory", "-c", str(TINY_YAML), "--from-references", "--min-reward", "1.5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipped toy/" in printed and "its reference solution scores 1.0" in printed
    assert len(ExperienceBank.load(out, get_embedder("hashing"))) == 0
