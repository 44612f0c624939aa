"""Field faults of ``lopd fit``: ``${...}`` interpolation resolved after every source is merged, and the
mistakes that were still tracebacks (a negative learning rate, Lightning's gradient accumulation, an
LOPD-only callback on another method, a task class that does not import, a misspelt class_path), each one
``error:`` line naming the config key and the fix, before the student loads."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch  # noqa: F401  (imported here, not under capsys: its log handler keeps the real stderr)
import pytest
import yaml

from lopd_lightning.cli import lightning_cli
from helpers import assert_one_line_error, run_main

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"
QUICKSTART_LOPD = ROOT / "configs" / "quickstart" / "lopd.yaml"


def printed_config(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        lightning_cli(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


# ----------------------------------------------------------------------------- ${...} interpolation
INTERPOLATING = """\
trainer:
  max_steps: 3
  val_check_interval: ${trainer.max_steps}
model:
  init_args:
    max_new_tokens: 8
    max_experience_tokens: ${model.init_args.max_new_tokens}
"""


@pytest.fixture
def interpolating(tmp_path) -> Path:
    path = tmp_path / "interpolating.yaml"
    path.write_text(INTERPOLATING)
    return path


def test_an_interpolation_follows_a_command_line_override_of_its_source(interpolating, capsys, no_model_loading):
    """It kept the value of the file that held the ${...} (3 and 8), silently."""
    printed = printed_config(["-c", str(TINY_YAML), "-c", str(interpolating), "--trainer.max_steps=7",
                              "--model.init_args.max_new_tokens=12"], capsys)
    assert printed["trainer"]["val_check_interval"] == 7
    assert printed["model"]["init_args"]["max_experience_tokens"] == 12
    printed = printed_config(["-c", str(TINY_YAML), "-c", str(interpolating)], capsys)  # no override: the file's
    assert (printed["trainer"]["val_check_interval"], printed["model"]["init_args"]["max_experience_tokens"]) == (3, 8)


def test_an_interpolation_follows_a_later_config_file(interpolating, tmp_path, capsys, no_model_loading):
    later = tmp_path / "later.yaml"
    later.write_text("trainer:\n  max_steps: 5\nmodel:\n  init_args:\n    max_new_tokens: 16\n")
    printed = printed_config(["-c", str(TINY_YAML), "-c", str(interpolating), "-c", str(later)], capsys)
    assert printed["trainer"]["val_check_interval"] == 5
    assert printed["model"]["init_args"]["max_experience_tokens"] == 16


def test_an_interpolation_on_the_command_line_uses_the_same_absolute_paths(capsys, no_model_loading):
    printed = printed_config(["-c", str(TINY_YAML), "--model.init_args.max_new_tokens=12",
                              "--model.init_args.max_experience_tokens=${model.init_args.max_new_tokens}"], capsys)
    assert printed["model"]["init_args"]["max_experience_tokens"] == 12


def test_an_interpolation_of_no_key_is_one_line_with_did_you_mean(interpolating, tmp_path, capsys, no_model_loading):
    bad = tmp_path / "bad.yaml"
    bad.write_text(INTERPOLATING.replace("${model.init_args.max_new_tokens}", "${model.init_args.max_new_token}"))
    code, err = run_main(["fit", "-c", str(TINY_YAML), "-c", str(bad), "--trainer.logger=false"], capsys)
    assert code == 2
    assert_one_line_error(err, "model.init_args.max_experience_tokens: ${model.init_args.max_new_token} names no "
                               "key; did you mean ${model.init_args.max_new_tokens}?")


# ------------------------------------------------------------------ one line, before the student loads
ONE_STEP = ["--trainer.max_steps=1", "--trainer.logger=false", "--trainer.enable_checkpointing=false"]


@pytest.mark.parametrize("key", ["learning_rate", "composer_lr", "dual_lr"])
def test_a_negative_learning_rate_is_one_line_before_the_model_loads(key, capsys, no_model_loading):
    """It was 49 lines of traceback from torch's optimizer, after the student had loaded."""
    code, err = run_main(["fit", "-c", str(TINY_YAML), *ONE_STEP, f"--model.init_args.{key}=-1"], capsys)
    assert code == 1
    assert_one_line_error(err, f"model.init_args.{key} must be a finite number >= 0 (a learning rate or, for "
                               f"dual_lr, the dual step size), got -1.0")


def test_gradient_accumulation_is_one_line_before_the_model_loads(capsys, no_model_loading):
    """Lightning refused it in 36 lines, after the student had loaded."""
    code, err = run_main(["fit", "-c", str(TINY_YAML), *ONE_STEP, "--trainer.accumulate_grad_batches=4"], capsys)
    assert code == 1
    assert_one_line_error(err, "trainer.accumulate_grad_batches=4: every method steps its optimizers itself "
                               "(manual optimization), so Lightning cannot accumulate gradients; remove "
                               "trainer.accumulate_grad_batches (or set it to 1) and raise "
                               "data.init_args.examples_per_step for more examples per update")


@pytest.mark.parametrize("config", [TINY_YAML, QUICKSTART_LOPD], ids=["tiny", "quickstart"])
def test_switching_the_method_of_an_lopd_config_names_the_lopd_only_callback(config, capsys, no_model_loading):
    """It ended in 76 lines at callbacks.py (AttributeDict has no attribute 'margin')."""
    code, err = run_main(["fit", "-c", str(config), *ONE_STEP, "--model.init_args.model=tiny",
                          "--model.class_path=lopd_lightning.modules.GRPOModule"], capsys)
    assert code == 1
    assert_one_line_error(err, "trainer.callbacks: MarginSchedule (it sets LOPDModule's privileged margin) and "
                               "MemoryRefresh (it adds successful rollouts to LOPDModule's experience bank) work only "
                               "with LOPDModule, and GRPOModule is not one; drop them from trainer.callbacks")


@pytest.mark.parametrize("module, source, reason", [
    # it said `expected str, got "{'class_path': ...}"`; `lopd tasks verify` said the right thing
    ("nomod", None, "No module named 'nomod' (is its folder on PYTHONPATH?)"),
    # jsonargparse reports only the module's own message ("boom") among the Union's subtype errors: it said
    # `data.init_args.task: expected str, got "NestedArg(key='class_path', val='broken_task.MyTask')"`
    ("broken_task", "raise RuntimeError('boom')\n",
     "RuntimeError: boom; fix the module (lopd --debug tasks verify broken_task.MyTask shows the traceback)"),
], ids=["missing", "raises"])
def test_a_task_class_whose_module_does_not_import_says_what_tasks_verify_says(module, source, reason, tmp_path,
                                                                              capsys, monkeypatch, no_model_loading):
    if source is not None:
        (tmp_path / f"{module}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
    expected = f"cannot import '{module}' for task '{module}.MyTask': {reason}"
    code, err = run_main(["tasks", "verify", f"{module}.MyTask"], capsys)
    assert_one_line_error(err, expected)
    config = tmp_path / "task.yaml"
    config.write_text(f"data:\n  init_args:\n    task:\n      class_path: {module}.MyTask\n")
    for args in ([f"--data.init_args.task.class_path={module}.MyTask"], ["-c", str(config)]):
        code, err = run_main(["fit", "-c", str(TINY_YAML), *ONE_STEP, *args], capsys)
        assert code == 2
        assert_one_line_error(err, f"data.init_args.task.class_path: {expected}")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model.class_path=lopd_lightning.modules.GRPOModul"],
         "model.class_path: no class 'lopd_lightning.modules.GRPOModul' (module 'lopd_lightning.modules' has no "
         "attribute 'GRPOModul'); did you mean 'lopd_lightning.modules.GRPOModule'?"),
        (["--model.class_path=lopd_lightning.modles.GRPOModule"],
         "model.class_path: no class 'lopd_lightning.modles.GRPOModule' (No module named 'lopd_lightning.modles'); "
         "did you mean 'lopd_lightning.modules.GRPOModule'?"),
        (["--data.class_path=lopd_lightning.data.OnPolicyDataModul"],
         "data.class_path: no class 'lopd_lightning.data.OnPolicyDataModul' (module 'lopd_lightning.data' has no "
         "attribute 'OnPolicyDataModul'); did you mean 'lopd_lightning.data.OnPolicyDataModule'?"),
    ],
    ids=["class", "module", "data"],
)
def test_a_class_path_typo_names_class_path_and_the_closest_class(args, expected, capsys, no_model_loading):
    """It named model.init_args, with no suggestion."""
    code, err = run_main(["fit", "-c", str(TINY_YAML), *ONE_STEP, *args], capsys)
    assert code == 2
    assert_one_line_error(err, expected)


def test_a_class_path_typo_in_a_config_file_names_class_path(tmp_path, capsys, no_model_loading):
    config = tmp_path / "typo.yaml"
    config.write_text(TINY_YAML.read_text().replace("lopd_lightning.modules.LOPDModule", "lopd_lightning.modules.LOPDModle"))
    code, err = run_main(["fit", "-c", str(config), *ONE_STEP], capsys)
    assert code == 2
    assert_one_line_error(err, "model.class_path: no class 'lopd_lightning.modules.LOPDModle' (module "
                               "'lopd_lightning.modules' has no attribute 'LOPDModle'); did you mean "
                               "'lopd_lightning.modules.LOPDModule'?")


def test_lopd_with_no_bank_and_nothing_to_fill_it_is_one_line_before_the_model_loads(tmp_path, capsys,
                                                                                     no_model_loading):
    """It trained 2 steps of loss 0 (tiny.yaml without its bank); with MemoryRefresh off it is refused, with it on
    (or with J = 0) the check lets the fit through."""
    no_refresh = tmp_path / "no_refresh.yaml"
    no_refresh.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "lopd_lightning.modules.lopd_callbacks.MarginSchedule"},
        {"class_path": "lopd_lightning.modules.lopd_callbacks.MemoryRefresh", "init_args": {"every_n_steps": 0}},
    ]}}))
    code, err = run_main(["fit", "-c", str(TINY_YAML), "-c", str(no_refresh), *ONE_STEP,
                          "--model.init_args.bank_path=null"], capsys)
    assert code == 1
    assert_one_line_error(err, "model.init_args.bank_path is null, so LOPD's teacher has no experiences and every "
                               "step would train nothing (loss 0); build a bank with `lopd build-memory -c CONFIG "
                               "--from-references` and set model.init_args.bank_path to its folder, or add "
                               "lopd_lightning.modules.lopd_callbacks.MemoryRefresh to trainer.callbacks to fill it "
                               "from the run's own successes")
    from lopd_lightning.cli.checks import check_fit_config
    from lopd_lightning.cli.errors import CLIError

    def config(callbacks, **init_args):
        return {"model": {"class_path": "lopd_lightning.modules.LOPDModule", "init_args": init_args},
                "trainer": {"callbacks": callbacks}}

    refresh = {"class_path": "lopd_lightning.modules.lopd_callbacks.MemoryRefresh"}  # every_n_steps: its default, 10
    check_fit_config(config([refresh], bank_path=None))  # MemoryRefresh will fill it: fit warns instead
    check_fit_config(config([], bank_path=None, num_experiences=0))  # no retrieval: no bank needed
    check_fit_config(config([], bank_path="configs/tiny_bank"))  # a bank: the module's own checks read it
    with pytest.raises(CLIError, match="bank_path is null"):
        check_fit_config(config([], num_experiences=2))  # bank_path's default, null


def test_build_memory_that_keeps_nothing_writes_nothing(tmp_path, capsys):
    """`lopd build-memory -c configs/tiny.yaml` (rollouts of the tiny random model, which solves nothing) wrote an
    empty bank over the shipped configs/tiny_bank/; now it refuses in one line and the folder keeps its bank."""
    import shutil

    from lopd_lightning.memory.bank import ExperienceBank
    from lopd_lightning.memory.embed import get_embedder
    from helpers import TINY_BANK

    out = tmp_path / "bank"
    shutil.copytree(TINY_BANK, out)
    code, err = run_main(["build-memory", "-c", str(TINY_YAML), "--out", str(out), "--limit", "2", "--rollouts", "1"],
                         capsys)
    assert code == 1
    assert_one_line_error(err, f"build-memory: none of the 2 train examples gave a trajectory with reward >= 1 "
                               f"(rollouts), so nothing was written to {out}; add --from-references (the tasks' "
                               f"reference solutions), or lower --min-reward")
    assert len(ExperienceBank.load(out, get_embedder("hashing"))) == 24
    code, err = run_main(["build-memory", "-c", str(TINY_YAML), "--from-references", "--min-reward", "1.5",
                          "--out", str(tmp_path / "new")], capsys)
    assert code == 1 and err.strip().endswith("lower --min-reward") and not (tmp_path / "new").exists()


@pytest.mark.parametrize("text, expected", [
    ("model: [unclosed\n", "not valid YAML (line 2, column 1: expected ',' or ']', but got '<stream end>'); fix the file"),
    ("trainer: {max_steps: 3}\ntrainer: {max_steps: 4}\n",
     "repeats the key 'trainer' (lines 1 and 2; YAML would keep the last one); give each key once"),
    ("data:\n  init_args:\n    val_limit: 2\n    val_limit: 3\n",
     "repeats the key 'val_limit' (lines 3 and 4; YAML would keep the last one); give each key once"),
    ("- a\n- b\n", "a YAML list, not a mapping; a config maps keys (model:, data:, trainer:...) to values"),
    ("", "the file is empty; give a YAML mapping (model:, data:, trainer:...) or leave the -c out"),
])
def test_a_config_file_that_is_not_a_mapping_of_each_key_once_is_named_with_its_line(text, expected, tmp_path, capsys,
                                                                                     no_model_loading):
    """jsonargparse named neither the file nor the line ("error: while parsing a flow sequence", "Unexpected
    config: - a") and let a repeated key's last value win without a word (issue 57's fuzz)."""
    broken = tmp_path / "more.yaml"
    broken.write_text(text)
    code, err = run_main(["fit", "-c", str(TINY_YAML), "-c", str(broken)], capsys)
    assert code == 2
    assert_one_line_error(err, f"-c {broken}: {expected}")


@pytest.mark.parametrize("args, expected", [
    (["--model.init_args.teacher_mode=frozen"],
     "model.init_args.teacher_mode 'frozen' is not a teacher mode; choose one of live, base, ema"),
    (["--trainer.logger.class_path=Foo"],
     "trainer.logger: no class 'Foo'; give a class path such as lightning.pytorch.loggers.TensorBoardLogger"),
])
def test_a_bad_name_is_refused_before_the_model_loads_with_an_example_of_its_own_kind(args, expected, capsys,
                                                                                     no_model_loading):
    """LOPD's teacher_mode was checked only once the student had loaded (a run started); a logger's bad
    class_path was given a LightningModule as the example."""
    code, err = run_main(["fit", "-c", str(TINY_YAML), *args], capsys)
    assert code in (1, 2)
    assert_one_line_error(err, expected)
