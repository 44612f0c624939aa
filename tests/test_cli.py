"""The ``lopd`` command: ``--print_config`` of every shipped config (without loading any model),
``lopd tasks verify|list``, ``lopd build-memory``, one-line errors naming the key (``--debug`` for the
traceback), checks before the weights load, and the help, warnings and logs a new user sees."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import yaml

from lopd_lightning.cli import lightning_cli, main
from lopd_lightning.memory.bank import ExperienceBank
from lopd_lightning.memory.embed import get_embedder
from lopd_lightning.modules import LOPDModule
from lopd_lightning.tasks import TASK_NAMES
from lopd_lightning.tasks.toy import ToyTask
from helpers import TINY_BANK, assert_one_line_error, run_main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("**/*.yaml"))
TINY_YAML = ROOT / "configs" / "tiny.yaml"





def print_config(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        lightning_cli(["fit", *args, "--print_config"])
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
    # min reward above 1: nothing can be kept, so nothing is written (the bank there stays)
    with pytest.raises(SystemExit):
        main([*args, "--min-reward", "1.5"])
    assert len(ExperienceBank.load(out, get_embedder("hashing"))) == 4
    assert "none of the 4 train examples gave a trajectory with reward >= 1.5" in capsys.readouterr().err


@pytest.mark.parametrize("subcommand, prefix", [("validate", "val"), ("test", "test")])
def test_validate_and_test_subcommands_run_greedy_episodes(tmp_path, subcommand, prefix, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    cli = lightning_cli([
        subcommand, "-c", str(TINY_YAML), "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false", f"--model.init_args.bank_path={TINY_BANK}",
    ])
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert metrics[f"{prefix}/turns_mean"] == 1.0  # the toy task is single-turn
    assert 0.0 <= metrics[f"{prefix}/success_rate"] <= metrics[f"{prefix}/reward_mean"] <= 1.0
    # without a logger the run's config.yaml has no folder to go to: none in the root dir or the current one
    assert not (tmp_path / "config.yaml").exists() and list((tmp_path / "cwd").iterdir()) == []


def test_build_memory_writes_to_the_configured_bank_path_then_fit_loads_it(tmp_path, capsys):
    """The config's bank_path is where build-memory writes (it need not exist yet); a module then loads it."""
    bank = tmp_path / "bank"
    overrides = [f"--model.init_args.bank_path={bank}"]
    assert main(["build-memory", "-c", str(TINY_YAML), "--from-references", *overrides]) == 0
    assert f"-> {bank}" in capsys.readouterr().out
    cli = lightning_cli(["-c", str(TINY_YAML), *overrides, "--trainer.logger=false"], run=False)
    assert len(cli.model.bank) == 24


def test_missing_bank_folder_names_the_fix(tmp_path):
    with pytest.raises(Exception, match="lopd build-memory"):
        lightning_cli(["-c", str(TINY_YAML), f"--model.init_args.bank_path={tmp_path / 'none'}",
                        "--trainer.logger=false"], run=False)


def test_build_memory_from_references_replays_and_scores_each_reference(tmp_path, capsys):
    """References are scored through the task, not assumed correct: above every reachable reward none is kept."""
    out = tmp_path / "bank"
    with pytest.raises(SystemExit):
        main(["build-memory", "-c", str(TINY_YAML), "--from-references", "--min-reward", "1.5", "--out", str(out)])
    printed = capsys.readouterr()
    assert "skipped toy/" in printed.out and "its reference solution scores 1.0" in printed.out
    assert "nothing was written" in printed.err and not out.exists()


# ---------------------------------------------------------------------- one-line errors (issue 14, item 1)
def test_a_missing_model_folder_is_one_line_naming_the_key(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    code, err = run_main(["fit", "-c", str(TINY_YAML), f"--model.init_args.model={missing}", "--trainer.logger=false"], capsys)
    assert code == 1
    assert_one_line_error(err, f"model folder '{missing}' does not exist (model.init_args.model); give a local "
                               f"Hugging Face folder, 'smollm2-135m-instruct' (packaged) or 'tiny'")


def test_num_latents_zero_is_one_line_naming_the_key_before_the_model_loads(capsys, no_model_loading):
    code, err = run_main(["fit", "-c", str(TINY_YAML), "--model.init_args.num_latents=0", "--trainer.logger=false"], capsys)
    assert code == 1
    assert_one_line_error(err, "model.init_args.num_latents must be >= 1 (latent tokens per experience), got 0")


def test_a_module_check_without_the_key_in_its_message_gets_the_key_named(capsys, no_model_loading):
    """GRPO's "ppo_epochs must be >= 1" is shown as model.init_args.ppo_epochs ..."""
    config = ROOT / "configs" / "compare_tiny" / "grpo.yaml"
    code, err = run_main(["fit", "-c", str(config), "--model.init_args.ppo_epochs=0", "--trainer.logger=false"], capsys)
    assert code == 1
    assert_one_line_error(err, "model.init_args.ppo_epochs must be >= 1, got 0")


def test_the_base_checks_name_their_keys(capsys, no_model_loading):
    code, err = run_main(["fit", "-c", str(TINY_YAML), "--model.init_args.group_size=0"], capsys)
    assert code == 1
    assert_one_line_error(err, "model.init_args.group_size must be >= 1, got 0")
    code, err = run_main(["fit", "-c", str(TINY_YAML), "--model.init_args.lora={r: 4, lora_alfa: 8}"], capsys)
    assert code == 1
    assert_one_line_error(err, "model.init_args.lora.lora_alfa is not a LoraConfig field; did you mean 'lora_alpha'?")


def test_a_misspelt_task_is_one_line_with_did_you_mean(capsys, no_model_loading):
    code, err = run_main(["fit", "-c", str(TINY_YAML), "--data.init_args.task=tyo", "--trainer.logger=false"], capsys)
    assert code == 1
    assert_one_line_error(err, f"unknown task 'tyo' (data.init_args.task); did you mean 'toy'? known tasks: "
                               f"{', '.join(TASK_NAMES)} (or give a Task subclass as data.init_args.task: "
                               f"{{class_path: module.Class}})")
    code, err = run_main(["tasks", "verify", "bfcl_simpel_python"], capsys)
    assert code == 2
    assert err.startswith("error: unknown task 'bfcl_simpel_python'; did you mean 'bfcl_simple_python'?")
    assert len(err.strip().splitlines()) == 1


def test_a_task_class_path_given_as_a_name_shows_the_form_that_works(tmp_path, monkeypatch, capsys, no_model_loading):
    (tmp_path / "mymod.py").write_text("from lopd_lightning.tasks.toy import ToyTask\n\n\nclass GuessTask(ToyTask):\n    name = 'guess'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = run_main(["fit", "-c", str(TINY_YAML), "--data.init_args.task=mymod.GuessTask", "--trainer.logger=false"],
                         capsys)
    assert code == 1
    assert_one_line_error(err, "data.init_args.task 'mymod.GuessTask' is not a task name; to use a Task subclass give "
                               "its class path as data.init_args.task: {class_path: mymod.GuessTask} (command line: "
                               f"--data.init_args.task.class_path=mymod.GuessTask); known task names: {', '.join(TASK_NAMES)}")
    # the form the message shows is accepted (parsed and checked; the run itself is not started here)
    cli = lightning_cli(["-c", str(TINY_YAML), "--data.init_args.task.class_path=mymod.GuessTask"], run=False,
                         instantiate=False)
    assert cli.config.data.init_args.task.class_path == "mymod.GuessTask"


@pytest.mark.parametrize(
    "lora, expected",
    [
        ("{r: 0}", "model.init_args.lora.r must be a positive integer (the LoRA rank, e.g. 8), got 0"),
        ("{r: 4, lora_dropout: 2}",
         "model.init_args.lora.lora_dropout must be a probability in [0, 1] (e.g. 0.05), got 2"),
        ("{r: 4, layers_pattern: layers}",
         "model.init_args.lora.layers_pattern: When `layers_pattern` is specified, `layers_to_transform` must also "
         "be specified. (peft's LoraConfig refused it; fix or remove the value)"),
    ],
    ids=["r_zero", "dropout", "peft_refuses"],
)
def test_a_lora_value_peft_refuses_names_the_key_before_the_model_loads(lora, expected, capsys, no_model_loading):
    """peft said "model: `r` should be a positive integer ..." once the student had loaded."""
    code, err = run_main(["fit", "-c", str(TINY_YAML), f"--model.init_args.lora={lora}", "--trainer.logger=false"], capsys)
    assert code == 1
    assert_one_line_error(err, expected)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model.init_args.num_latens=3"],
         "unknown key model.init_args.num_latens (LOPDModule has no argument 'num_latens'); "
         "did you mean model.init_args.num_latents?"),
        (["--data.init_args.taks=toy"],
         "unknown key data.init_args.taks (OnPolicyDataModule has no argument 'taks'); did you mean data.init_args.task?"),
        (["--trainer.max_stepz=3"],
         "unknown option --trainer.max_stepz=3; did you mean --trainer.max_steps? (see `lopd fit --help`)"),
        (["--model.init_args.num_latents=abc"], "model.init_args.num_latents: expected int, got 'abc'"),
        (["--model=LOPDModul"],
         "model: no class 'LOPDModul'; give a class path such as lopd_lightning.modules.LOPDModule; "
         "did you mean 'LOPDModule'?"),
    ],
    ids=["model_key", "data_key", "trainer_key", "wrong_type", "class_name"],
)
def test_a_wrong_key_on_the_command_line_is_one_line_with_did_you_mean(args, expected, capsys, no_model_loading):
    code, err = run_main(["fit", "-c", str(TINY_YAML), *args], capsys)
    assert code == 2
    assert_one_line_error(err, expected)


@pytest.mark.parametrize(
    "old, new, expected",
    [
        ("num_latents: 4", "num_latens: 4",
         "unknown key model.init_args.num_latens (LOPDModule has no argument 'num_latens'); "
         "did you mean model.init_args.num_latents?"),
        ("max_steps: 2", "max_step: 2", "unknown key trainer.max_step (lopd fit has no such option); did you mean trainer.max_steps?"),
    ],
    ids=["model_key", "trainer_key"],
)
def test_a_wrong_key_in_a_config_file_is_one_line_with_did_you_mean(tmp_path, old, new, expected, capsys, no_model_loading):
    config = tmp_path / "bad.yaml"
    config.write_text(TINY_YAML.read_text().replace(old, new))
    code, err = run_main(["fit", "-c", str(config)], capsys)
    assert code == 2
    assert_one_line_error(err, expected)


def test_unknown_commands_and_missing_config_files_are_one_line(tmp_path, capsys):
    code, err = run_main(["fitt", "-c", str(TINY_YAML)], capsys)
    assert code == 2
    assert_one_line_error(err, "unknown command 'fitt'; did you mean 'fit'? (commands: fit, validate, test, "
                               "build-memory, pretrain-composer, privilege-check, tasks, export; see `lopd --help`)")
    code, err = run_main(["fit", "-c", str(tmp_path / "none.yaml")], capsys)
    assert code == 2
    assert_one_line_error(err, f"-c/--config: File does not exist: '{tmp_path / 'none.yaml'}'")


def test_debug_flag_and_environment_variable_show_the_traceback(tmp_path, monkeypatch, capsys):
    def root_cause(error: BaseException) -> BaseException:
        while error.__cause__ or error.__context__:
            error = error.__cause__ or error.__context__
        return error

    args = ["fit", "-c", str(TINY_YAML), f"--model.init_args.model={tmp_path / 'none'}", "--trainer.logger=false"]
    with pytest.raises(Exception) as raised:  # the whole chain, as Python prints it: jsonargparse's wrapper too
        main([*args, "--debug"])
    assert isinstance(root_cause(raised.value), FileNotFoundError)
    monkeypatch.setenv("LOPD_DEBUG", "1")
    with pytest.raises(Exception) as raised:
        main(args)
    assert isinstance(root_cause(raised.value), FileNotFoundError)
    monkeypatch.setenv("LOPD_DEBUG", "0")
    assert run_main(args, capsys)[0] == 1


def test_the_console_command_prints_two_lines_for_a_config_error(tmp_path):
    """The real process: no LightningCLI warning about `args`, Lightning's INFO line once, then the error."""
    script = Path(sys.executable).parent / "lopd"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lopd_lightning.cli"]
    result = subprocess.run(
        [*command, "fit", "-c", str(TINY_YAML), "--model.init_args.num_latents=0", "--trainer.logger=false"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "LOPD_DEBUG")},
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == "error: model.init_args.num_latents must be >= 1 (latent tokens per experience), got 0"
    assert "args parameter" not in result.stderr
    assert result.stderr.count("Seed set to 0") == 1, result.stderr  # was printed twice (two handlers)
    assert len(lines) == 2, result.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- fail fast (issue 14, item 6)
def one_experience_bank(folder: Path) -> Path:
    from lopd_lightning.memory import Experience

    task = ToyTask()
    bank = ExperienceBank(get_embedder("hashing"))
    ex = task.examples("train")[0]
    bank.add([Experience(task_id=ex.id, task_text=ex.text, trace="answer", reward=1.0)])
    return bank.save(folder)


def test_a_missing_or_too_small_bank_fails_before_the_student_loads(tmp_path, capsys, no_model_loading):
    """A bank smaller than J is refused by lopd fit when no MemoryRefresh fills it (tiny.yaml's is turned off here)."""
    from lopd_lightning.modules import LOPDModule

    with pytest.raises(FileNotFoundError, match=r"model.init_args.bank_path '.*none' holds no experience bank"):
        LOPDModule("tiny", bank_path=str(tmp_path / "none"))
    bank = one_experience_bank(tmp_path / "bank")
    with pytest.raises(ValueError, match=r"model.init_args.bank_capacity=1 is smaller than num_experiences J=2"):
        LOPDModule("tiny", bank_path=str(bank), num_experiences=2, bank_capacity=1)
    no_refresh = tmp_path / "no_refresh.yaml"
    no_refresh.write_text("trainer:\n  callbacks:\n    - class_path: lopd_lightning.modules.lopd_callbacks.MemoryRefresh\n"
                          "      init_args: {every_n_steps: 0}\n")
    code, err = run_main(["fit", "-c", str(TINY_YAML), "-c", str(no_refresh), f"--model.init_args.bank_path={bank}"],
                         capsys)
    assert code == 1
    assert_one_line_error(err, f"num_experiences J=2 is larger than the bank at '{bank}' (1 experiences); "
                               f"set model.init_args.num_experiences <= 1, build a larger bank (`lopd build-memory`), or "
                               f"add lopd_lightning.modules.lopd_callbacks.MemoryRefresh to trainer.callbacks to fill it "
                               f"from the run's own successes (retrieval then starts once it holds J)")


def test_tiny_yaml_outside_the_repository_says_its_relative_bank_path_is_read_from_the_working_directory(
        tmp_path, capsys, monkeypatch, no_model_loading):
    """configs/tiny.yaml names its bank configs/tiny_bank, relative to where lopd runs: from another folder it
    said only that the folder "holds no experience bank", as if the shipped bank were missing or broken."""
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["fit", "-c", str(TINY_YAML), "--trainer.max_steps=1"], capsys)
    assert code == 1
    assert_one_line_error(err, (
        f"model.init_args.bank_path 'configs/tiny_bank' holds no experience bank (no such folder in the working "
        f"directory {str(tmp_path)!r}: a relative path is read from where lopd runs, not from the config file's "
        f"folder; run lopd from the folder it is relative to, or give an absolute path); build it first with "
        f"`lopd build-memory -c CONFIG` (add --from-references for a base model that rarely succeeds), or set "
        f"model.init_args.bank_path to null to start with an empty bank that a MemoryRefresh callback fills from "
        f"the run's own successes"))


def test_build_memory_from_references_does_not_load_the_student(tmp_path, capsys, no_model_loading):
    out = tmp_path / "bank"
    assert main(["build-memory", "-c", str(TINY_YAML), "--from-references", "--out", str(out), "--limit", "3"]) == 0
    assert "bank: 3 experiences from 3 train examples (reference solutions)" in capsys.readouterr().out
    assert len(ExperienceBank.load(out, get_embedder("hashing"))) == 3


class ShoutingLOPD(LOPDModule):
    """A subclass whose experience hook build-memory --from-references must use (no weights needed)."""

    def experience_from_trajectory(self, task, example, messages, reward):
        exp = super().experience_from_trajectory(task, example, messages, reward)
        return dataclasses.replace(exp, trace=exp.trace.upper())


class BackboneReadingLOPD(LOPDModule):
    """A hook that reads the backbone: build-memory falls back to the whole module."""

    def experience_from_trajectory(self, task, example, messages, reward):
        exp = super().experience_from_trajectory(task, example, messages, reward)
        return dataclasses.replace(exp, trace=f"{exp.trace} [{type(self.backbone).__name__}]")


def test_build_memory_from_references_runs_a_subclass_hooks(tmp_path, capsys, monkeypatch):
    out = tmp_path / "bank"
    with monkeypatch.context() as m:
        m.setattr("lopd_lightning.modules.base.load_student", lambda *a, **k: pytest.fail("the student was loaded"))
        assert main(["build-memory", "-c", str(TINY_YAML), "--from-references", "--out", str(out), "--limit", "2",
                     f"--model.class_path={__name__}.ShoutingLOPD"]) == 0
    traces = [r.trace for r in ExperienceBank.load(out, get_embedder("hashing")).records]
    assert len(traces) == 2 and all(t == t.upper() and "[ACTION]" in t for t in traces)
    assert main(["build-memory", "-c", str(TINY_YAML), "--from-references", "--out", str(out), "--limit", "2",
                 f"--model.class_path={__name__}.BackboneReadingLOPD"]) == 0
    traces = [r.trace for r in ExperienceBank.load(out, get_embedder("hashing")).records]
    assert len(traces) == 2 and all(t.endswith("[PeftModelForCausalLM]") for t in traces)


def test_build_memory_refuses_a_module_without_a_bank(tmp_path, capsys, no_model_loading):
    code, err = run_main(["build-memory", "-c", str(TINY_YAML), "--from-references", "--out", str(tmp_path / "b"),
                          "--model.class_path=lopd_lightning.modules.SFTModule"], capsys)
    assert code == 2
    assert_one_line_error(err, "model.class_path lopd_lightning.modules.SFTModule has no experience bank; "
                               "build-memory is for LOPDModule (or a subclass)")


# ---------------------------------------------------------------------- papercuts (issue 14, item 7)
def test_help_lists_every_command_and_no_predict(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    commands = [line.split()[0] for line in out.split("commands:\n")[1].split("\n\n")[0].splitlines()]
    assert commands == ["fit", "validate", "test", "build-memory", "pretrain-composer", "privilege-check", "tasks", "export"]
    assert "--debug" in out and "predict" not in out
    code, err = run_main(["predict", "-c", str(TINY_YAML)], capsys)
    assert code == 2 and err.startswith("error: unknown command 'predict'")


def test_no_lightning_cli_warning_about_args(monkeypatch, capsys, no_model_loading):
    """The command line read from sys.argv is passed once: LightningCLI's warning about args does not fire."""
    monkeypatch.setattr(sys, "argv", ["lopd", "fit", "-c", str(TINY_YAML), "--print_config"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(SystemExit) as exit_info:
            main()
    assert exit_info.value.code in (0, None)
    assert not [w for w in caught if "args parameter" in str(w.message)]


def test_lightning_tips_are_not_printed_and_its_info_lines_are_kept():
    import logging

    import lightning as L

    from lopd_lightning.cli import configure_logging

    configure_logging()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler = Keep(level=logging.INFO)
    logger.addHandler(handler)
    try:
        L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)  # "GPU available" + the litlogger tip
    finally:
        logger.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    assert any("GPU available" in m for m in messages)
    assert not [m for m in messages if "Tip" in m], messages
    assert logging.getLogger("lightning").propagate is False  # its own handler only: each line once


def test_the_post_step_checkpoint_warning_of_manual_optimisation_is_dropped_and_others_kept(tmp_path):
    """Lightning 2.6 warns, with a 12-line example, at every every_n_train_steps checkpoint of a manual-
    optimisation module (every method here); the CLI drops that one warning by its opening, nothing else."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lopd_lightning.cli import configure_logging

    class Manual(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(self.layer(batch[0]).pow(2).mean())
            optimizer.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(folder):
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(2, 2)), batch_size=1)
        trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=folder,
                            callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_last=True)])
        trainer.fit(Manual(), data)

    def caught_messages(filtered):
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()  # no filter left from an earlier main() in this process
            warnings.simplefilter("always")
            if filtered:
                configure_logging()
                configure_logging()  # a second call adds no second filter (each change resets "shown once")
                assert sum(f[1] is not None and "pre-optimization" in f[1].pattern for f in warnings.filters) == 1
            fit(tmp_path / str(filtered))
            warnings.warn("another warning", UserWarning)
        return [str(w.message) for w in caught]

    unfiltered = caught_messages(False)  # the installed Lightning does raise it: the filter matches a real message
    assert [m for m in unfiltered if m.startswith("Using ModelCheckpoint with manual optimization")]
    filtered = caught_messages(True)
    assert not [m for m in filtered if "pre-optimization" in m] and "another warning" in filtered


def test_tasks_verify_takes_a_task_class_path(capsys):
    assert main(["tasks", "verify", "lopd_lightning.tasks.toy.ToyTask", "--limit", "4"]) == 0
    assert "lopd_lightning.tasks.toy.ToyTask: 4/4 reference solutions score 1.0" in capsys.readouterr().out
    code, err = run_main(["tasks", "verify", "lopd_lightning.tasks.toy.NoSuchTask"], capsys)
    assert code == 2
    assert_one_line_error(err, "module 'lopd_lightning.tasks.toy' has no 'NoSuchTask' (task 'lopd_lightning.tasks.toy.NoSuchTask')")


# ---------------------------------------------------------------------- a key under another name
SDPO_YAML = ROOT / "configs" / "compare_tiny" / "sdpo.yaml"


def unknown_key(owner: str, key: str, suggested: str | None) -> str:
    name = key.rpartition(".")[2]
    hint = f"; did you mean model.init_args.{suggested}?" if suggested else ""
    return f"unknown key model.init_args.{name} ({owner} has no argument {name!r}){hint}"


@pytest.mark.parametrize(
    "new, old",
    [("group_size", "rollouts_per_example"), ("distill_top_k", "top_m")],
)
@pytest.mark.parametrize("form", ["config_file", "included_file", "flag"])
def test_a_key_under_its_old_name_is_one_line_suggesting_its_name(new, old, form, tmp_path, monkeypatch, capsys,
                                                                  no_model_loading):
    """configs/tiny.yaml with a key under the name it had before the release (a config file, the model
    file it includes with a relative path from another folder, or a flag): jsonargparse's unknown key,
    one line that names it and suggests the argument's name."""
    text = TINY_YAML.read_text().replace("bank_path: configs/tiny_bank", f"bank_path: {TINY_BANK}")
    assert f"    {new}: " in text
    old_text = text.replace(f"    {new}: ", f"    {old}: ")
    folder = tmp_path / "configs"
    folder.mkdir()
    if form == "config_file":
        (folder / "old.yaml").write_text(old_text)
        args = ["-c", str(folder / "old.yaml")]
    elif form == "included_file":
        head, rest = old_text.split("model:\n", 1)
        model_text, data = rest.split("data:\n", 1)
        (folder / "model.yaml").write_text(textwrap.dedent(model_text))
        (folder / "old.yaml").write_text(f"{head}model: model.yaml\ndata:\n{data}")
        (tmp_path / "elsewhere").mkdir()
        monkeypatch.chdir(tmp_path / "elsewhere")
        args = ["-c", "../configs/old.yaml"]
    else:
        args = ["-c", str(TINY_YAML), f"--model.init_args.{old}=2"]
    code, err = run_main(["fit", *args], capsys)
    assert code == 2
    assert_one_line_error(err, unknown_key("LOPDModule", old, new))


@pytest.mark.parametrize(
    "config, flag, expected",
    [
        (TINY_YAML, "--model.init_args.group_sise=3", unknown_key("LOPDModule", "group_sise", "group_size")),
        (SDPO_YAML, "--model.init_args.rollouts_per_example=3", unknown_key("SDPOModule", "rollouts_per_example", "group_size")),
        (SDPO_YAML, "--model.init_args.top_k_distill=3", unknown_key("SDPOModule", "top_k_distill", "distill_top_k")),
        (SDPO_YAML, "--model.init_args.jsd_alpha=0.3", unknown_key("SDPOModule", "jsd_alpha", "jsd_beta")),
        # LOPD has no JSD: no did-you-mean
        (TINY_YAML, "--model.init_args.jsd_alpha=0.3", unknown_key("LOPDModule", "jsd_alpha", None)),
    ],
    ids=["misspelt", "documented_meaning", "words_reordered", "documented_other_name", "nothing_close"],
)
def test_an_unknown_key_suggests_the_closest_argument(config, flag, expected, capsys, no_model_loading):
    """The closest argument: by its spelling, the same words in another order, or every word of the unknown
    name in the argument's name and documentation (group_size: rollouts per example; jsd_beta: SDPO's alpha)."""
    code, err = run_main(["fit", "-c", str(config), flag], capsys)
    assert code == 2
    assert_one_line_error(err, expected)


def test_python_dash_m_runs_the_cli_package(tmp_path):
    """``python -m lopd_lightning.cli`` (torchrun, scripts) is the same command as the ``lopd`` script."""
    result = subprocess.run([sys.executable, "-m", "lopd_lightning.cli", "tasks", "list"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == list(TASK_NAMES)
