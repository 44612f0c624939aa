"""A fuzz of ``lopd fit|validate|test``: every mistake ends in one ``error:`` line naming its key, before the model loads.

Cases (drawn by hypothesis, seeded, over the tiny configs of every method: LOPD ``configs/tiny.yaml``, GRPO,
SDPO, OPSD, Skill-SD ``configs/compare_tiny/``, SFT on ``configs/compare_tiny/common.yaml``), one mistake each,
on the command line of ``fit``, ``validate`` or ``test``:

- ``unknown_key``: a key the section does not have (``model.init_args``, ``data.init_args``, ``trainer``);
- ``wrong_type``: a number or bool option of the method, the DataModule or the Trainer given a value of
  another type (``abc``, ``[1, 2]``, ``{a: 1}``, ``1.5`` for an int);
- ``out_of_range``: a documented option given a number outside its range (:data:`OUT_OF_RANGE`: negative
  counts, ``top_p`` above 1, ``jsd_beta`` outside [0, 1], ``trainer.max_steps`` below -1, ...);
- ``missing_path``: a file or folder that is not there (``model.init_args.model``, ``bank_path``,
  ``composer_path``, ``ckpt_path``, a ``-c`` file, a task class's module);
- ``unwritable_folder``: an output folder under a regular file (``trainer.default_root_dir``, the logger's
  ``save_dir``, SFT's ``save_dir``);
- ``bad_choice``: an option that takes one of a few names given another (``teacher_mode``,
  ``generation_backend``, ``embedder``, ``context_framing``, ``divergence``, ``trainer.accelerator``...);
- ``broken_config``: a further ``-c`` file that is not a YAML mapping with each key once (a bracket left open,
  a tab, a list, a scalar, an empty file, a repeated key, a bad indent), named by the file.

Each case must end with exit status 1 or 2, the last line of stderr ``error: ...`` naming the key (the only
``error:`` line), no traceback (an exception out of ``main``), and no started run: loading the student's weights
or starting a Trainer stage raises :class:`RunStarted`, counted as a failure. ``tests/test_cli_fuzz.py`` runs a
few dozen of the same cases; this script runs many and records the count::

    python benchmarks/cli_fuzz.py [--cases 400] [--seed 0] [--out benchmarks/results/cli_fuzz.json]

The JSON is ``{"benchmark": "cli_fuzz", "settings", "cases", "distinct_cases", "failures", "tracebacks",
"started_runs", "by_kind", "by_method", "by_subcommand", "exit_codes", "seconds", "failed": [...]}`` plus
:func:`common.run_metadata`.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import logging
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` next to this file, when imported too
from common import REPO_ROOT, run_metadata, write_json_atomic  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cli_fuzz.json"
COMMON = "configs/compare_tiny/common.yaml"

#: method -> the command line of its tiny config (paths relative to the repository, where the cases run)
METHODS: dict[str, tuple[str, ...]] = {
    "lopd": ("-c", "configs/tiny.yaml"),
    "grpo": ("-c", COMMON, "-c", "configs/compare_tiny/grpo.yaml"),
    "sdpo": ("-c", COMMON, "-c", "configs/compare_tiny/sdpo.yaml"),
    "opsd": ("-c", COMMON, "-c", "configs/compare_tiny/opsd.yaml"),
    "skill_sd": ("-c", COMMON, "-c", "configs/compare_tiny/skill_sd.yaml"),
    "sft": ("-c", COMMON, "--model.class_path=lopd_lightning.modules.SFTModule"),
}
CLASSES = {"lopd": "LOPDModule", "grpo": "GRPOModule", "sdpo": "SDPOModule", "opsd": "OPSDModule",
           "skill_sd": "SkillSDModule", "sft": "SFTModule"}
SUBCOMMANDS = ("fit", "validate", "test")

#: a placeholder in a case's arguments for a regular file (made once per run of the cases)
A_FILE = "{A_FILE}"
#: a placeholder for the fresh folder a case's ``files`` are written into
A_DIR = "{DIR}"


class RunStarted(BaseException):
    """Raised where a case would start a run: the student's weights load, or a Trainer stage starts."""


@dataclass(frozen=True)
class Case:
    """One mistake: ``lopd <subcommand> <the method's config> <args>``, whose error line must name ``key``."""

    method: str
    subcommand: str
    kind: str
    key: str
    args: tuple[str, ...]
    #: (name, text) of the files the case writes into a fresh folder first (``{DIR}`` in ``args`` and ``key``)
    files: tuple[tuple[str, str], ...] = ()

    def argv(self, a_file: str, folder: str = "") -> list[str]:
        return [self.subcommand, *METHODS[self.method],
                *(a.replace(A_FILE, a_file).replace(A_DIR, folder) for a in self.args)]


@dataclass
class Outcome:
    """What one case did: its exit status, stderr's ``error:`` lines and last line, a run started, an exception."""

    code: Any
    errors: list[str]
    last: str
    started: bool = False
    exception: str | None = None
    folder: str = ""

    def problem(self, case: Case) -> str | None:
        """Why the outcome breaks the contract (None: it keeps it)."""
        if self.started:
            return "a run started (the model loaded or a Trainer stage began)"
        if self.exception is not None:
            return f"a traceback: {self.exception}"
        if self.code not in (1, 2):
            return f"exit status {self.code!r}"
        if len(self.errors) != 1 or not self.last.startswith("error: "):
            return f"{len(self.errors)} error lines, last line {self.last!r}"
        if case.key.replace(A_DIR, self.folder) not in self.last:
            return f"the error line does not name {case.key}: {self.last!r}"
        return None


# ----------------------------------------------------------------------------------------- the keys
def _init_parameters(cls: type) -> dict[str, Any]:
    """name -> annotation (a string: the modules use ``from __future__ import annotations``) of ``cls``'s
    constructor chain."""
    out: dict[str, Any] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        for name, parameter in inspect.signature(klass.__init__).parameters.items():
            if name not in ("self", "args", "kwargs") and name not in out:
                out[name] = str(parameter.annotation)
    return out


def _kind_of(annotation: str) -> str | None:
    """"int", "float" or "bool" for an option of that type (optional or not), else None."""
    text = annotation.replace("typing.", "").replace("Optional[", "").replace("]", "").replace(" | None", "")
    return text if text in ("int", "float", "bool") else None


def module_keys(method: str) -> dict[str, str]:
    """``model.init_args`` option -> "int" | "float" | "bool", of the method's class (its documented arguments)."""
    import lopd_lightning.modules as modules

    params = _init_parameters(getattr(modules, CLASSES[method]))
    return {name: kind for name, annotation in params.items() if (kind := _kind_of(annotation))}


DATA_KEYS = {"examples_per_step": "int", "val_limit": "int", "val_batch_size": "int", "train_limit": "int",
             "seed": "int", "dev_slice": "int", "dev_slice_seed": "int"}
TRAINER_KEYS = {"max_steps": "int", "max_epochs": "int", "num_nodes": "int", "log_every_n_steps": "int",
                "num_sanity_val_steps": "int", "enable_checkpointing": "bool", "enable_progress_bar": "bool"}

_negative = st.integers(min_value=-10**6, max_value=-1)
_not_positive = st.integers(min_value=-10**6, max_value=0)
_negative_float = st.floats(min_value=-1e6, max_value=-1e-3)
_not_positive_float = st.one_of(st.just(0.0), _negative_float)
_above_one = st.floats(min_value=1.001, max_value=1e6)
_outside_unit = st.one_of(_negative_float, _above_one)

#: (section, key) -> (the values out of its range, the methods that have it (None: all), fit only)
OUT_OF_RANGE: dict[tuple[str, str], tuple[Any, tuple[str, ...] | None, bool]] = {
    # every method (OnPolicyModule)
    ("model.init_args", "group_size"): (_not_positive, None, False),
    ("model.init_args", "temperature"): (_not_positive_float, None, False),
    ("model.init_args", "top_p"): (st.one_of(_not_positive_float, _above_one), None, False),
    ("model.init_args", "max_new_tokens"): (_not_positive, None, False),
    ("model.init_args", "max_turns"): (_not_positive, None, False),
    ("model.init_args", "max_prompt_tokens"): (_not_positive, None, False),
    ("model.init_args", "val_max_new_tokens"): (_not_positive, None, False),
    ("model.init_args", "generation_batch_size"): (_not_positive, None, False),
    ("model.init_args", "weight_decay"): (_negative_float, None, False),
    ("model.init_args", "grad_clip"): (_negative_float, None, False),
    ("model.init_args", "log_samples"): (_negative, None, False),
    ("model.init_args", "log_samples_every_n_steps"): (_negative, None, False),
    ("model.init_args", "sample_prompt_chars"): (_negative, None, False),
    ("model.init_args", "progress_every_n_steps"): (_negative, None, False),
    ("model.init_args", "learning_rate"): (_negative_float, None, True),
    # GRPO and Skill-SD (a group needs two rollouts to compare), SDPO
    ("model.init_args", "clip_eps_low"): (_negative_float, ("grpo", "skill_sd"), False),
    ("model.init_args", "clip_eps_high"): (_negative_float, ("grpo", "skill_sd"), False),
    ("model.init_args", "kl_coef"): (_negative_float, ("grpo", "skill_sd"), False),
    ("model.init_args", "ppo_epochs"): (_not_positive, ("grpo", "skill_sd"), False),
    ("model.init_args", "logps_temperature"): (_not_positive_float, ("grpo", "skill_sd"), False),
    ("model.init_args", "jsd_beta"): (_outside_unit, ("sdpo", "opsd"), False),
    ("model.init_args", "max_demo_chars"): (_negative, ("sdpo",), False),
    ("model.init_args", "max_feedback_chars"): (_negative, ("sdpo",), False),
    ("model.init_args", "max_reference_chars"): (_negative, ("opsd",), False),
    ("model.init_args", "distill_top_k"): (_not_positive, ("lopd", "sdpo", "opsd"), False),
    ("model.init_args", "distill_temperature"): (_not_positive_float, ("lopd", "sdpo", "opsd"), False),
    ("model.init_args", "teacher_ema_rate"): (_outside_unit, ("lopd", "sdpo", "skill_sd"), False),
    ("model.init_args", "sdl_coef"): (_negative_float, ("skill_sd",), False),
    ("model.init_args", "max_skills"): (_not_positive, ("skill_sd",), False),
    ("model.init_args", "skill_max_new_tokens"): (_not_positive, ("skill_sd",), False),
    ("model.init_args", "skill_buffer_size"): (_not_positive, ("skill_sd",), False),
    ("model.init_args", "skill_trajectory_chars"): (_negative, ("skill_sd",), False),
    ("model.init_args", "ucb_c"): (_negative_float, ("skill_sd",), False),
    # LOPD
    ("model.init_args", "num_latents"): (_not_positive, ("lopd",), False),
    ("model.init_args", "num_experiences"): (_negative, ("lopd",), False),
    ("model.init_args", "composer_depth"): (_not_positive, ("lopd",), False),
    ("model.init_args", "composer_lr"): (_negative_float, ("lopd",), True),
    ("model.init_args", "composer_clip_compressor"): (_negative_float, ("lopd",), False),
    ("model.init_args", "composer_clip_lora"): (_negative_float, ("lopd",), False),
    ("model.init_args", "margin"): (_negative_float, ("lopd",), False),
    ("model.init_args", "anchor_weight"): (_negative_float, ("lopd",), False),
    ("model.init_args", "dual_lr"): (_negative_float, ("lopd",), False),
    ("model.init_args", "beta_init"): (_negative_float, ("lopd",), False),
    ("model.init_args", "bank_capacity"): (_not_positive, ("lopd",), False),
    ("model.init_args", "max_experience_tokens"): (_not_positive, ("lopd",), False),
    ("model.init_args", "warm_start_steps"): (_negative, ("lopd",), False),
    ("model.init_args", "warm_start_batch_size"): (_not_positive, ("lopd",), False),
    ("model.init_args", "warm_start_lr"): (_negative_float, ("lopd",), False),
    ("model.init_args", "warm_start_reconstruction_noise"): (_negative_float, ("lopd",), False),
    ("model.init_args", "distill_chunk_size"): (_not_positive, ("lopd",), False),
    ("model.init_args", "latent_probe_every_n_steps"): (_negative, ("lopd",), False),
    # the DataModule
    ("data.init_args", "examples_per_step"): (_not_positive, None, False),
    ("data.init_args", "val_batch_size"): (_not_positive, None, False),
    ("data.init_args", "val_limit"): (_not_positive, None, False),
    ("data.init_args", "train_limit"): (_not_positive, None, False),
    ("data.init_args", "dev_slice"): (_not_positive, None, False),
    # the Trainer (-1 is Lightning's "no limit" for max_steps, max_epochs and devices)
    ("trainer", "max_steps"): (st.integers(min_value=-10**6, max_value=-2), None, False),
    ("trainer", "max_epochs"): (st.integers(min_value=-10**6, max_value=-2), None, False),
    ("trainer", "devices"): (st.one_of(st.just(0), st.integers(min_value=-10**6, max_value=-2)), None, False),
    ("trainer", "num_nodes"): (_not_positive, None, False),
    ("trainer", "limit_val_batches"): (st.one_of(_negative_float, st.floats(min_value=1.001, max_value=1.999)), None,
                                       False),
    ("trainer", "limit_train_batches"): (st.one_of(_negative_float, st.floats(min_value=1.001, max_value=1.999)),
                                         None, False),
    ("trainer", "val_check_interval"): (_negative_float, None, False),
}

#: values of another type than the option's (YAML on the command line: a string, a list, a mapping)
WRONG_VALUES = {"int": ("abc", "1.5", "[1, 2]", "{a: 1}", "x1"), "float": ("abc", "1,5", "[0.5]", "{a: 1}"),
                "bool": ("maybe", "[true]", "{a: 1}")}


def _number(value: Any) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4f}"


def _section_keys(method: str, section: str) -> dict[str, str]:
    if section == "model.init_args":
        return module_keys(method)
    return DATA_KEYS if section == "data.init_args" else TRAINER_KEYS


def _all_keys(method: str, section: str) -> set[str]:
    import lightning.pytorch as pl

    import lopd_lightning.modules as modules
    from lopd_lightning.data import OnPolicyDataModule

    cls = {"model.init_args": getattr(modules, CLASSES[method]), "data.init_args": OnPolicyDataModule,
           "trainer": pl.Trainer}[section]
    return set(_init_parameters(cls))


# ----------------------------------------------------------------------------------------- the cases
@st.composite
def unknown_key(draw, method: str) -> Case:
    section = draw(st.sampled_from(("model.init_args", "data.init_args", "trainer")))
    known = _all_keys(method, section)
    name = draw(st.from_regex(r"[a-z]{3,9}(_[a-z]{2,8}){0,2}", fullmatch=True).filter(lambda n: n not in known))
    return Case(method, draw(st.sampled_from(SUBCOMMANDS)), "unknown_key", f"{section}.{name}",
                (f"--{section}.{name}=1",))


@st.composite
def wrong_type(draw, method: str) -> Case:
    section = draw(st.sampled_from(("model.init_args", "data.init_args", "trainer")))
    keys = _section_keys(method, section)
    key = draw(st.sampled_from(sorted(keys)))
    value = draw(st.sampled_from(WRONG_VALUES[keys[key]]))
    return Case(method, draw(st.sampled_from(SUBCOMMANDS)), "wrong_type", f"{section}.{key}",
                (f"--{section}.{key}={value}",))


@st.composite
def out_of_range(draw, method: str) -> Case:
    choices = sorted(k for k, (_, methods, _) in OUT_OF_RANGE.items() if methods is None or method in methods)
    section, key = draw(st.sampled_from(choices))
    values, _, fit_only = OUT_OF_RANGE[(section, key)]
    value = _number(draw(values))
    subcommand = "fit" if fit_only else draw(st.sampled_from(SUBCOMMANDS))
    return Case(method, subcommand, "out_of_range", f"{section}.{key}", (f"--{section}.{key}={value}",))


@st.composite
def missing_path(draw, method: str) -> Case:
    token = draw(st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True))
    where = f"/nonexistent_{token}"
    options = [("model.init_args.model", (f"--model.init_args.model={where}/model",)),
               ("ckpt_path", (f"--ckpt_path={where}/last.ckpt",)),
               ("-c/--config", ("-c", f"{where}/more.yaml")),
               ("data.init_args.task.class_path", (f"--data.init_args.task.class_path=nomodule_{token}.Task",))]
    if method == "lopd":
        options += [("model.init_args.bank_path", (f"--model.init_args.bank_path={where}/bank",)),
                    ("model.init_args.composer_path", (f"--model.init_args.composer_path={where}/composer",))]
    if method == "opsd":
        options.append(("model.init_args.bank_path", ("--model.init_args.privileged_context=retrieved",
                                                      "--model.init_args.embedder=hashing",
                                                      f"--model.init_args.bank_path={where}/bank")))
    key, args = draw(st.sampled_from(options))
    return Case(method, draw(st.sampled_from(SUBCOMMANDS)), "missing_path", key, args)


@st.composite
def unwritable_folder(draw, method: str) -> Case:
    sub = draw(st.from_regex(r"[a-z]{1,8}(/[a-z]{1,8}){0,2}", fullmatch=True))
    options = [("trainer.default_root_dir", (f"--trainer.default_root_dir={A_FILE}/{sub}",))]
    if method == "lopd":
        options.append(("trainer.logger.init_args.save_dir", (f"--trainer.logger.init_args.save_dir={A_FILE}/{sub}",)))
    if method == "sft":
        options.append(("model.init_args.save_dir", (f"--model.init_args.save_dir={A_FILE}/{sub}",)))
    key, args = draw(st.sampled_from(options))
    return Case(method, draw(st.sampled_from(SUBCOMMANDS)), "unwritable_folder", key, args)


#: (key, the methods that have it (None: all), its valid names): options that take one of a few names
CHOICES: tuple[tuple[str, tuple[str, ...] | None, tuple[str, ...]], ...] = (
    ("model.init_args.generation_backend", None, ("hf", "vllm")),
    ("model.init_args.teacher_mode", ("lopd", "skill_sd"), ("live", "base", "ema")),
    ("model.init_args.embedder", ("lopd", "opsd"), ("minilm", "backbone", "hashing")),
    ("model.init_args.context_framing", ("lopd", "opsd"), ("short", "from_scratch")),
    ("model.init_args.margin_weighting", ("lopd",), ("paper", "balanced")),
    ("model.init_args.composer_architecture", ("lopd",), ("memory_tokens", "perceiver", "pointer")),
    ("model.init_args.composer_kl_mean", ("lopd",), ("token", "rollout")),
    ("model.init_args.warm_start_lr_schedule", ("lopd",), ("constant", "cosine")),
    ("model.init_args.privileged_context", ("opsd",), ("reference", "retrieved")),
    ("model.init_args.divergence", ("sdpo", "opsd"), ("jsd", "forward_kl", "topk_reverse_kl")),
    ("trainer.accelerator", None, ("auto", "cpu", "cuda", "gpu", "tpu", "mps")),
    ("trainer.precision", None, ()),
    ("trainer.strategy", None, ()),
)


@st.composite
def bad_choice(draw, method: str) -> Case:
    options = [(key, valid) for key, methods, valid in CHOICES if methods is None or method in methods]
    key, valid = draw(st.sampled_from(options))
    value = draw(st.from_regex(r"[a-z]{2,8}(_[a-z]{2,6})?", fullmatch=True).filter(
        lambda v: v not in valid and v not in ("null", "none", "true", "false", "yes", "no", "on", "off", "auto")
        and not v.startswith(("bf", "fp", "ddp", "fsdp", "deepspeed", "single", "xla"))))
    return Case(method, draw(st.sampled_from(SUBCOMMANDS)), "bad_choice", key, (f"--{key}={value}",))


#: YAML texts that are not a config mapping with each key once
BROKEN_CONFIGS = ("model: [unclosed\n", "\tmodel: 1\n", "- a\n- b\n", "just a string\n", "",
                  "model:\n  init_args: {a: 1\n", "trainer: {max_steps: 3}\ntrainer: {max_steps: 4}\n",
                  "key: value\n  bad indent: 2\n", "model: !!python/object:os.system {}\n",
                  "data:\n  init_args:\n    val_limit: 2\n    val_limit: 3\n", "{a: 1}}\n")


@st.composite
def broken_config(draw, method: str) -> Case:
    text = draw(st.sampled_from(BROKEN_CONFIGS))
    name = draw(st.from_regex(r"[a-z]{1,8}", fullmatch=True)) + ".yaml"
    return Case(method, draw(st.sampled_from(SUBCOMMANDS)), "broken_config", f"-c {A_DIR}/{name}",
                ("-c", f"{A_DIR}/{name}"), files=((name, text),))


KINDS = {"unknown_key": unknown_key, "wrong_type": wrong_type, "out_of_range": out_of_range,
         "missing_path": missing_path, "unwritable_folder": unwritable_folder, "bad_choice": bad_choice,
         "broken_config": broken_config}


def cases(kind: str) -> st.SearchStrategy[Case]:
    """Mistakes of one kind (a name of :data:`KINDS`) on every method's tiny config."""
    return st.sampled_from(sorted(METHODS)).flatmap(KINDS[kind])


# ----------------------------------------------------------------------------------------- running one
@contextlib.contextmanager
def no_runs() -> Iterator[None]:
    """Within: loading the student's weights (the tiny model, a Hugging Face folder) or starting a Trainer stage
    raises :class:`RunStarted`; logging is off (what a case prints is its ``error:`` line)."""
    def started(*args: Any, **kwargs: Any) -> None:
        raise RunStarted

    import lightning.pytorch as pl

    import lopd_lightning.models as models

    with mock.patch.object(models, "tiny_model", started), \
            mock.patch.object(models.AutoModelForCausalLM, "from_pretrained", started), \
            mock.patch.object(pl.Trainer, "_run", started):
        previous = logging.root.manager.disable
        logging.disable(logging.CRITICAL)
        try:
            yield
        finally:
            logging.disable(previous)


def run_case(case: Case, a_file: str) -> Outcome:
    """Run ``case`` through ``lopd_lightning.cli.main`` in this process (inside :func:`no_runs`, from the
    repository's folder)."""
    from lopd_lightning.cli import main

    err = io.StringIO()
    outcome = Outcome(code=None, errors=[], last="")
    with tempfile.TemporaryDirectory(prefix="cli_fuzz_case_") as folder, contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()), contextlib.chdir(REPO_ROOT):
        outcome.folder = folder
        for name, text in case.files:
            (Path(folder) / name).write_text(text)
        try:
            outcome.code = main(case.argv(a_file, folder))
        except SystemExit as exit_info:
            outcome.code = exit_info.code
        except RunStarted:
            outcome.started = True
        except BaseException as error:  # noqa: BLE001 (a traceback is what is counted)
            outcome.exception = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    outcome.errors = [line for line in lines if line.startswith("error:")]
    outcome.last = lines[-1] if lines else ""
    if any("Traceback (most recent call last)" in line for line in lines):
        outcome.exception = outcome.exception or "a traceback on stderr"
    return outcome


@contextlib.contextmanager
def a_regular_file() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="cli_fuzz_") as folder:
        path = Path(folder) / "results.txt"
        path.write_text("a file, not a folder\n")
        yield str(path)


# ----------------------------------------------------------------------------------------- the benchmark
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=400, help="cases hypothesis draws, shared evenly by the kinds")
    p.add_argument("--seed", type=int, default=0, help="hypothesis' seed")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file to write")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    seen: list[tuple[Case, Outcome, str | None]] = []
    start = time.perf_counter()
    with a_regular_file() as a_file, no_runs():
        for kind in KINDS:
            @hypothesis_seed(args.seed)
            @settings(max_examples=max(1, args.cases // len(KINDS)), deadline=None, database=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=cases(kind))
            def draw(case: Case) -> None:
                outcome = run_case(case, a_file)
                seen.append((case, outcome, outcome.problem(case)))

            draw()
    seconds = time.perf_counter() - start
    failed = [{"case": vars(case), "problem": problem, "last_line": outcome.last}
              for case, outcome, problem in seen if problem]
    report = {
        "benchmark": "cli_fuzz",
        "settings": {"cases": args.cases, "seed": args.seed, "methods": {m: list(a) for m, a in METHODS.items()},
                     "subcommands": list(SUBCOMMANDS), "kinds": list(KINDS)},
        "cases": len(seen),
        "distinct_cases": len({case for case, _, _ in seen}),
        "failures": len(failed),
        "tracebacks": sum(outcome.exception is not None for _, outcome, _ in seen),
        "started_runs": sum(outcome.started for _, outcome, _ in seen),
        "by_kind": dict(sorted(Counter(case.kind for case, _, _ in seen).items())),
        "by_method": dict(sorted(Counter(case.method for case, _, _ in seen).items())),
        "by_subcommand": dict(sorted(Counter(case.subcommand for case, _, _ in seen).items())),
        "exit_codes": {str(k): v for k, v in sorted(Counter(str(o.code) for _, o, _ in seen).items())},
        "keys_named": len({case.key for case, _, _ in seen}),
        "seconds": round(seconds, 1),
        "failed": failed[:50],
        **run_metadata(seed=args.seed, argv=argv),
    }
    write_json_atomic(report, args.out)
    print(f"cli_fuzz: {report['cases']} cases ({report['distinct_cases']} distinct, {report['keys_named']} keys), "
          f"{report['failures']} failures, {report['tracebacks']} tracebacks, {report['started_runs']} runs started "
          f"({seconds:.0f} s) -> {args.out}")
    for item in failed[:20]:
        print(f"  FAIL {item['case']['method']} {item['case']['subcommand']} {' '.join(item['case']['args'])}: "
              f"{item['problem']}")
    return report


if __name__ == "__main__":
    main()
