"""The commands of ``lopd`` outside LightningCLI: ``tasks``, ``build-memory``, ``pretrain-composer``,
``privilege-check`` and ``export``.

- ``lopd build-memory -c CONFIG [--from-references] [--out FOLDER]``: build the experience bank offline.
- ``lopd pretrain-composer -c CONFIG [--out FOLDER] [--steps N] [--resume]``: pretrain LOPD's composer on the
  bank (:mod:`lopd_lightning.composer.pretrain`) and save it where ``model.init_args.composer_path`` reads it.
- ``lopd privilege-check -c CONFIG [--requests N] [--out FILE.json]``: is the configured teacher privileged, with
  its context (LOPD: the latents of ``composer_path``'s composer), on the first N train requests
  (:mod:`lopd_lightning.privilege`)?
- ``lopd tasks verify NAME|module.Class [--limit N] [--max-turns N]``: replay every reference solution
  through the task's reward, with the turn limit of training; ``lopd tasks list``: the registered names.
- ``lopd export CHECKPOINT --out FOLDER [--adapter]``: the student of any method's checkpoint as a
  Hugging Face folder (:mod:`lopd_lightning.export`).

Each command takes the command line after its name and returns the exit status; a mistake the user can
fix raises :class:`~lopd_lightning.cli.errors.CLIError`.
"""

from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path
from typing import Any

from lopd_lightning.cli.checks import check_folder
from lopd_lightning.cli.errors import (
    ArgumentParser,
    CLIError,
    import_class,
    import_task_class,
)
from lopd_lightning.cli.training import lightning_cli
from lopd_lightning.hints import did_you_mean

__all__ = ["build_memory_command", "export_command", "pretrain_composer_command", "privilege_check_command",
           "tasks_command"]

log = logging.getLogger("lopd_lightning")


def _task(name: str):
    """A task by registry name or by ``module.Class`` (a Task subclass built with its defaults)."""
    from lopd_lightning.tasks import TASK_NAMES, Task, get_task

    if name in TASK_NAMES:
        return get_task(name)
    if "." not in name:
        raise CLIError(
            f"unknown task {name!r}{did_you_mean(name, TASK_NAMES, quote=True)} (known tasks: {', '.join(TASK_NAMES)}; "
            f"or a Task subclass as module.Class, importable from PYTHONPATH)", 2
        )
    cls = import_task_class(name)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise CLIError(f"{name!r} is not a lopd_lightning.tasks.Task subclass", 2)
    try:
        inspect.signature(cls).bind()
    except TypeError as error:
        required = [p.name for p in inspect.signature(cls).parameters.values()
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        raise CLIError(
            f"task class {name!r} needs arguments ({', '.join(required) or error}); lopd tasks verify builds it "
            f"without any: give them defaults, or verify a subclass that sets them", 2
        ) from error
    except ValueError:  # no signature to read (a builtin base): the call below tells
        pass
    return cls()


def tasks_command(argv: list[str]) -> int:
    """``lopd tasks verify NAME|module.Class [--limit N] [--max-turns N]`` and ``lopd tasks list``."""
    from lopd_lightning.tasks import TASK_NAMES

    parser = ArgumentParser(prog="lopd tasks")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="list the registered tasks")
    verify = sub.add_parser("verify", help="replay every reference solution through the task's reward")
    verify.add_argument("name", help=f"one of: {', '.join(TASK_NAMES)}; or a Task subclass as module.Class")
    verify.add_argument("--limit", type=int, default=None, help="only the first N examples")
    verify.add_argument("--split", default="all", choices=["train", "val", "all"])
    verify.add_argument("--max-turns", type=int, default=None,
                        help="replies per episode, as model.init_args.max_turns (default: the task's, as in training)")
    args = parser.parse_args(argv)
    if args.action == "list":
        print("\n".join(TASK_NAMES))
        return 0
    for option, value, default in (("--limit", args.limit, "to replay every example"),
                                   ("--max-turns", args.max_turns, "for the task's own turn limit")):
        if value is not None and value < 1:
            raise CLIError(f"lopd tasks verify: {option} must be >= 1, got {value} (leave it out {default})", 2)
    from lopd_lightning.tasks.verify import verify_task

    task = _task(args.name)
    start = time.perf_counter()
    report = verify_task(task, limit=args.limit, split=args.split, max_turns=args.max_turns)
    seconds = time.perf_counter() - start
    print(f"{args.name}: {report.n_full_marks}/{report.n} reference solutions score 1.0 ({seconds:.1f} s)")
    for example_id, reward in report.failures[:20]:
        reason = report.reason(example_id)
        print(f"  FAIL {example_id}: reward {reward}" + (f" ({' '.join(reason.split())[:300]})" if reason else ""))
    if len(report.failures) > 20:
        print(f"  ... and {len(report.failures) - 20} more")
    advice = report.turn_limit_advice()
    if advice:
        print(advice)
    return 0 if report.n_full_marks == report.n else 1


def _hooks_only_module(cli) -> tuple[Any, Any, Any]:
    """(module, datamodule, bank settings) of a parsed config, without the module's weights.

    ``--from-references`` only replays reference solutions through the module's hooks
    (``build_messages``, ``score_trajectory``, ``experience_from_trajectory``) and embeds the results,
    so the module is made without running its constructor (which loads the student): an instance of
    the configured class with its ``hparams`` and tokenizer, and no backbone. A hook that needs more
    makes build-memory fall back to the whole module.
    """
    from lightning.pytorch import LightningModule

    from lopd_lightning.memory.bank import ExperienceBank
    from lopd_lightning.memory.embed import get_embedder
    from lopd_lightning.models import load_tokenizer

    config = cli.config.clone()
    model_config = config.model
    cls = import_class(model_config.class_path)
    init = model_config.init_args.as_dict() if hasattr(model_config.init_args, "as_dict") else dict(model_config.init_args)
    config.model = None
    datamodule = cli.parser.instantiate_classes(config).data
    module = cls.__new__(cls)
    LightningModule.__init__(module)
    module.hparams.update(init)
    module.model_name = init.get("model")
    module.tokenizer = load_tokenizer(init.get("model"))
    bank = ExperienceBank(
        get_embedder(init["embedder"]),
        capacity=init.get("bank_capacity"),
        eviction=init.get("bank_eviction", "lowest_reward"),
        allow_self_retrieval=init.get("allow_self_retrieval", False),
    )
    return module, datamodule, bank


def _reference_experiences(module, task, examples, min_reward: float) -> list:
    experiences = []
    for ex in examples:  # replayed and scored: a reference the checker rejects is reported, not kept
        messages, reward = module.reference_trajectory(task, ex)
        if reward < min_reward:
            print(f"  skipped {ex.id}: its reference solution scores {reward}", flush=True)
            continue
        exp = module.experience_from_trajectory(task, ex, messages, reward)
        if exp is not None:
            experiences.append(exp)
    return experiences


def build_memory_command(argv: list[str]) -> int:
    """``lopd build-memory -c CONFIG``: roll out the model on the train split, keep the successes.

    The bank is built as the paper does: rollouts of the configured model (the ``model`` section) on the
    train split, sampled with the module's settings, kept when the reward reaches ``--min-reward``.
    ``--from-references`` seeds it with the tasks' reference solutions instead (for base models too
    weak to succeed on their own); it needs the tokenizer and the embedder, not the student's weights,
    which it does not load (but with ``embedder: backbone``). The folder is the module's ``bank_path``
    unless ``--out`` is given. An OPSDModule config (its ``privileged_context: retrieved`` reads such a bank)
    builds it the same way.
    """
    parser = ArgumentParser(prog="lopd build-memory")
    parser.add_argument("-c", "--config", action="append", required=True, help="the fit config(s)")
    parser.add_argument("--out", default=None, help="bank folder (default: model.init_args.bank_path)")
    parser.add_argument("--from-references", action="store_true", help="seed from reference solutions")
    parser.add_argument("--min-reward", type=float, default=1.0, help="keep trajectories with reward >= this")
    parser.add_argument("--rollouts", type=int, default=None, help="rollouts per example (default: the module's)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N train examples")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per generation batch")
    args, rest = parser.parse_known_args(argv)

    from lopd_lightning.memory.bank import ExperienceBank
    from lopd_lightning.memory.module_bank import build_bank

    config_args = ["--trainer.logger=false", *[a for c in args.config for a in ("-c", c)], *rest]
    parsed = lightning_cli(config_args, run=False, instantiate=False)  # the config only: nothing is built yet
    model_config = parsed.config.model
    init = model_config.init_args
    if "embedder" not in init or "bank_path" not in init:
        raise CLIError(f"model.class_path {model_config.class_path} has no experience bank; "
                       f"build-memory is for LOPDModule (or a subclass)", 2)
    # the configured bank_path is where the bank goes, not a bank to load: read it, then build without it
    out = args.out or init.bank_path
    if not out:
        raise CLIError("give --out FOLDER or set model.init_args.bank_path in the config", 2)
    check_folder("--out" if args.out else "model.init_args.bank_path", out)  # before anything loads
    start = time.perf_counter()
    experiences = None
    if args.from_references and init.embedder != "backbone":
        module, dm, bank = _hooks_only_module(parsed)
        examples = dm.train_examples[: args.limit] if args.limit else dm.train_examples
        try:
            experiences = _reference_experiences(module, dm.task, examples, args.min_reward)
        except AttributeError as error:  # a hook that reads what only the whole module has
            log.info("build-memory: a hook needs the whole module (%s); loading it", error)
    if experiences is None:
        nothing_to_load = ["--model.init_args.bank_path=null"]  # and no pretrained composer (stage 3 comes later)
        if "composer_path" in init:
            nothing_to_load.append("--model.init_args.composer_path=null")
        if init.get("privileged_context") == "retrieved":  # OPSD: retrieval needs the bank being built
            nothing_to_load.append("--model.init_args.privileged_context=reference")
        cli = lightning_cli([*config_args, *nothing_to_load], run=False)
        module, dm = cli.model, cli.datamodule
        bank = getattr(module, "bank", None)
        if bank is None:  # a module that builds its bank only to retrieve (OPSD): the same bank, empty
            bank = build_bank(None, init.embedder, num_experiences=0, capacity=init.get("bank_capacity"),
                              allow_self_retrieval=init.get("allow_self_retrieval", False), model=module.backbone,
                              tokenizer=module.tokenizer)
        examples = dm.train_examples[: args.limit] if args.limit else dm.train_examples
        if args.from_references:
            experiences = _reference_experiences(module, dm.task, examples, args.min_reward)
        else:
            experiences = _rollout_experiences(module, dm, examples, args)
    fresh = ExperienceBank(bank.embedder, **bank.settings())
    fresh.add(experiences)
    source = "reference solutions" if args.from_references else "rollouts"
    if not len(fresh):  # an empty bank trains nothing, and writing it would replace a bank that is there
        hint = ("lower --min-reward" if args.from_references else
                "add --from-references (the tasks' reference solutions), or lower --min-reward")
        raise CLIError(f"build-memory: none of the {len(examples)} train examples gave a trajectory with reward >= "
                       f"{args.min_reward:g} ({source}), so nothing was written to {out}; {hint}", 1)
    fresh.save(out)
    seconds = time.perf_counter() - start
    print(f"bank: {len(fresh)} experiences from {len(examples)} train examples ({source}) -> {out} ({seconds:.1f} s)")
    return 0


def pretrain_composer_command(argv: list[str]) -> int:
    """``lopd pretrain-composer -c CONFIG``: the composer's pretraining as a stage of its own.

    Builds the configured LOPDModule with a fresh composer (``composer_path`` ignored) and its DataModule, runs
    ``warm_start_steps`` steps of :func:`~lopd_lightning.composer.pretrain.pretrain_composer` under Lightning
    (checkpoints every 10% of the steps in ``OUT/checkpoints``, TensorBoard in ``OUT/tensorboard``) and saves
    the composer to ``OUT/composer.pt``. OUT is ``model.init_args.composer_path`` unless ``--out`` is given;
    ``--resume`` continues from ``OUT/checkpoints/last.ckpt``.
    """
    parser = ArgumentParser(prog="lopd pretrain-composer")
    parser.add_argument("-c", "--config", action="append", required=True, help="the LOPD fit config(s)")
    parser.add_argument("--out", default=None, help="composer folder (default: model.init_args.composer_path)")
    parser.add_argument("--steps", type=int, default=None,
                        help="pretraining steps (default: model.init_args.warm_start_steps)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/last.ckpt")
    args, rest = parser.parse_known_args(argv)
    if args.steps is not None and args.steps < 1:
        raise CLIError(f"lopd pretrain-composer: --steps must be >= 1, got {args.steps}", 2)

    from lopd_lightning.composer.pretrain import pretrain_composer

    config_args = ["--trainer.logger=false", *[a for c in args.config for a in ("-c", c)], *rest]
    parsed = lightning_cli(config_args, run=False, instantiate=False)  # the config only: nothing is built yet
    model_config = parsed.config.model
    init = model_config.init_args
    if "composer_path" not in init:
        raise CLIError(f"model.class_path {model_config.class_path} has no composer; pretrain-composer is for "
                       f"LOPDModule (or a subclass)", 2)
    out = args.out or init.composer_path
    if not out:
        raise CLIError("give --out FOLDER or set model.init_args.composer_path in the config", 2)
    check_folder("--out" if args.out else "model.init_args.composer_path", out)  # before anything loads
    if args.resume and not (Path(out) / "checkpoints" / "last.ckpt").is_file():
        raise CLIError(f"--resume: {out}/checkpoints/last.ckpt does not exist (check --out, or leave --resume out "
                       f"to start over)", 2)
    if args.steps is None and int(init.get("warm_start_steps") or 0) < 1:
        raise CLIError("model.init_args.warm_start_steps is 0: give --steps N or set warm_start_steps >= 1", 2)
    overrides = ["--model.init_args.composer_path=null"]  # the folder is where the composer goes, not one to load
    if args.steps is not None:
        overrides.append(f"--model.init_args.warm_start_steps={args.steps}")
    cli = lightning_cli([*config_args, *overrides], run=False)
    trainer = parsed.config.trainer
    options = {"accelerator": trainer.get("accelerator") or "auto", "precision": trainer.get("precision")}
    info = pretrain_composer(cli.model, cli.datamodule, out, resume=args.resume,
                             trainer_options={k: v for k, v in options.items() if v is not None})
    metrics = info["metrics"]
    print(f"composer: {info['steps']} steps on {info['records']} bank trajectories ({info['seconds']:.1f} s); "
          f"L_init {metrics.get('pretrain/task_nll', float('nan')):.3f}, "
          f"L_rec {metrics.get('pretrain/reconstruction_nll', float('nan')):.3f}, "
          f"latent spread {metrics.get('pretrain/latent_spread', float('nan')):.3f} -> {out}")
    return 0


def _git_sha() -> str | None:
    """The commit of the package's checkout (None: not a git checkout, or git missing)."""
    import subprocess

    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def privilege_check_command(argv: list[str]) -> int:
    """``lopd privilege-check -c CONFIG [--requests N] [--out FILE.json]``: is the teacher privileged?

    Builds the configured LOPDModule or OPSDModule and its DataModule (the config is read as ``lopd
    pretrain-composer`` reads it; an LOPD composer comes from ``model.init_args.composer_path``, a fresh one
    without it: the command runs no warm start), runs :func:`~lopd_lightning.privilege.check_privilege` once on
    the first ``--requests`` train requests (on the GPU when the trainer's accelerator allows one), prints
    :meth:`~lopd_lightning.privilege.PrivilegeReport.line` (and, for an LOPD teacher no better than its student,
    the warning naming the keys to look at) and writes the report with the config, the package versions and
    the git commit to ``--out``. The exit status is 0 whether or not the teacher is privileged.
    """
    parser = ArgumentParser(prog="lopd privilege-check")
    parser.add_argument("-c", "--config", action="append", required=True, help="the LOPD or OPSD fit config(s)")
    parser.add_argument("--requests", type=int, default=32, help="the first N train requests (default 32)")
    parser.add_argument("--out", default=None, help="write the report as JSON to this file")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="token limit of the greedy replies (default: the module's greedy validation's)")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per decoding batch (default 8)")
    args, rest = parser.parse_known_args(argv)
    for option, value in (("--requests", args.requests), ("--batch-size", args.batch_size),
                          ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value < 1:
            raise CLIError(f"lopd privilege-check: {option} must be >= 1, got {value}", 2)
    if args.out is not None and Path(args.out).is_dir():
        raise CLIError(f"lopd privilege-check: --out {args.out} is a folder; give a file name "
                       f"(e.g. {args.out}/privilege.json)", 2)

    import json

    import torch

    from lopd_lightning.modules import LOPDModule, OPSDModule
    from lopd_lightning.privilege import check_privilege, not_privileged_warning

    config_args = ["--trainer.logger=false", *[a for c in args.config for a in ("-c", c)], *rest]
    parsed = lightning_cli(config_args, run=False, instantiate=False)  # the config only: nothing is built yet
    model_config = parsed.config.model
    cls = import_class(model_config.class_path)
    if not (isinstance(cls, type) and issubclass(cls, (LOPDModule, OPSDModule))):
        raise CLIError(f"model.class_path {model_config.class_path} has no privileged teacher to check; "
                       f"privilege-check is for LOPDModule or OPSDModule (or a subclass)", 2)
    cli = lightning_cli(config_args, run=False)
    module, dm = cli.model, cli.datamodule
    if getattr(dm.task, "multi_turn", False):
        raise CLIError(f"data.init_args.task {getattr(dm.task, 'name', type(dm.task).__name__)!r} is multi-turn; "
                       f"privilege-check scores one greedy reply per request (single-turn tasks only)", 2)
    accelerator = str(parsed.config.trainer.get("accelerator") or "auto")
    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        module.to("cuda")
    examples = dm.train_examples[: args.requests]
    composer_path = model_config.init_args.get("composer_path") if issubclass(cls, LOPDModule) else None
    if issubclass(cls, LOPDModule) and not composer_path:
        print("note: model.init_args.composer_path is null, so this checks a fresh composer (fit would warm-start it "
              "first when warm_start_steps > 0); `lopd pretrain-composer` makes one to check", flush=True)
    report = check_privilege(module, dm.task, examples, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    print(report.line(), flush=True)
    warning = not_privileged_warning(module, report)
    if warning:
        log.warning(warning)
    if args.out is not None:
        import lightning
        import transformers

        import lopd_lightning

        config = json.loads(json.dumps(parsed.config.as_dict(), default=str))
        record = {
            "report": report.as_dict(),
            "metrics": report.metrics(),
            "privileged": report.privileged,
            "module": model_config.class_path,
            "task": getattr(dm.task, "name", type(dm.task).__name__),
            "composer_path": composer_path,
            "request_ids": [example.id for example in examples],
            "config": config,
            "argv": list(argv),
            "versions": {"lopd_lightning": lopd_lightning.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "lightning": lightning.__version__},
            "git_sha": _git_sha(),
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    return 0


def _rollout_experiences(module, dm, examples, args) -> list:
    if args.rollouts is not None:
        module.hparams.group_size = args.rollouts
    experiences = []
    for i in range(0, len(examples), args.batch_size):
        chunk = examples[i : i + args.batch_size]
        batch = module.make_batch(dm.task, chunk)
        for j in range(len(batch)):
            reward = float(batch.rewards[j])
            if reward >= args.min_reward:
                ex = dm.example(batch.example_ids[j])
                exp = module.experience_from_trajectory(dm.task, ex, batch.messages[j], reward)
                if exp is not None:
                    experiences.append(exp)
        print(f"  rolled out {min(i + args.batch_size, len(examples))}/{len(examples)} examples, "
              f"{len(experiences)} successful so far", flush=True)
    return experiences


def export_command(argv: list[str]) -> int:
    """``lopd export CHECKPOINT --out FOLDER [--adapter] [--class CLASS]``: see :mod:`lopd_lightning.export`."""
    parser = ArgumentParser(
        prog="lopd export",
        description="Write the student of a checkpoint of any method as a Hugging Face folder: the LoRA merged "
        "into the weights (default), or with --adapter the student LoRA alone beside its base model. "
        "The folder loads with transformers' AutoModelForCausalLM.from_pretrained and is a valid "
        "model.init_args.model for lopd fit/validate/test.",
    )
    parser.add_argument("checkpoint", help="a Lightning checkpoint (.ckpt) of any lopd_lightning method")
    parser.add_argument("--out", required=True, help="the folder to write (created)")
    parser.add_argument("--adapter", action="store_true", help="save the student LoRA only, beside its base model")
    parser.add_argument("--class", dest="module_class", default=None,
                        help="the module's class (e.g. LOPDModule) when the checkpoint does not name it")
    parser.add_argument("--model", default=None,
                        help="the base model to rebuild the module on, when the one the checkpoint names has moved")
    args = parser.parse_args(argv)
    from lopd_lightning.export import export_checkpoint

    start = time.perf_counter()
    folder = export_checkpoint(args.checkpoint, args.out, adapter=args.adapter, module_class=args.module_class,
                               model=args.model)
    form = "student LoRA beside its base" if args.adapter else "LoRA merged"
    print(f"exported the student of {args.checkpoint} ({form}) -> {folder} ({time.perf_counter() - start:.1f} s)")
    return 0

