"""The ``lopd`` command.

- ``lopd fit|validate|test -c CONFIG [-c MORE] [--print_config]``: the Lightning CLI in subclass mode: a
  config names any module (``LOPDModule``, ``GRPOModule``, ...), DataModule, task or callback class.
- ``lopd build-memory -c CONFIG [--from-references] [--out FOLDER]``: build the experience bank offline.
- ``lopd tasks verify NAME [--limit N]``: replay every reference solution through the task's reward.
- ``lopd tasks list``: the registered task names.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

log = logging.getLogger("lopd_lightning")


def check_task_name(config: Any) -> None:
    """Raise ValueError for an unknown task name in a parsed config, before any class is instantiated.

    LightningCLI instantiates the model before the DataModule, so without this check a misspelt
    ``data.init_args.task`` would only be reported after the student had been loaded.

    Raises:
        ValueError: ``data.init_args.task`` is a string that is not a registered task name (the message
            lists the known ones).
    """
    from lopd_lightning.tasks import TASK_NAMES

    data = config.get("data") if hasattr(config, "get") else None
    init_args = data.get("init_args") if hasattr(data, "get") else None
    task = init_args.get("task") if hasattr(init_args, "get") else None
    if isinstance(task, str) and task not in TASK_NAMES:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASK_NAMES)} (or give a Task subclass)")


def _configured_bank_path(configs: list[str], overrides: list[str]) -> str | None:
    """``model.init_args.bank_path`` of stacked YAML configs (later files win), or of a command-line override."""
    from omegaconf import OmegaConf

    for arg in reversed(overrides):
        if arg.startswith("--model.init_args.bank_path="):
            return arg.split("=", 1)[1]
    merged = OmegaConf.merge(*[OmegaConf.load(c) for c in configs])
    return OmegaConf.select(merged, "model.init_args.bank_path")


def _lightning_cli(args: list[str], *, run: bool = True):
    from lightning.pytorch.cli import LightningCLI

    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.modules.base import OnPolicyModule
    import lopd_lightning.modules  # noqa: F401  (registers the shipped methods for short class names)
    import lopd_lightning.callbacks  # noqa: F401

    class LOPDCLI(LightningCLI):
        def before_instantiate_classes(self) -> None:
            check_task_name(self.config[self.subcommand] if self.subcommand else self.config)

    return LOPDCLI(
        OnPolicyModule,
        OnPolicyDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
        parser_kwargs={"parser_mode": "omegaconf"},
    )


def tasks_command(argv: list[str]) -> int:
    """``lopd tasks verify NAME [--limit N]`` and ``lopd tasks list``."""
    from lopd_lightning.tasks import TASK_NAMES, get_task

    parser = argparse.ArgumentParser(prog="lopd tasks")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="list the registered tasks")
    verify = sub.add_parser("verify", help="replay every reference solution through the task's reward")
    verify.add_argument("name", help=f"one of: {', '.join(TASK_NAMES)}")
    verify.add_argument("--limit", type=int, default=None, help="only the first N examples")
    verify.add_argument("--split", default="all", choices=["train", "val", "all"])
    args = parser.parse_args(argv)
    if args.action == "list":
        print("\n".join(TASK_NAMES))
        return 0
    from lopd_lightning.tasks.verify import verify_task

    start = time.perf_counter()
    report = verify_task(get_task(args.name), limit=args.limit, split=args.split)
    seconds = time.perf_counter() - start
    print(f"{args.name}: {report.n_full_marks}/{report.n} reference solutions score 1.0 ({seconds:.1f} s)")
    for example_id, reward in report.failures[:20]:
        print(f"  FAIL {example_id}: reward {reward}")
    return 0 if report.n_full_marks == report.n else 1


def build_memory_command(argv: list[str]) -> int:
    """``lopd build-memory -c CONFIG``: roll out the model on the train split, keep the successes.

    The bank is built as the paper does: rollouts of the configured model (the ``model`` section) on the
    train split, sampled with the module's settings, kept when the reward reaches ``--min-reward``.
    ``--from-references`` seeds it with the tasks' reference solutions instead (for base models too
    weak to succeed on their own). The folder is the module's ``bank_path`` unless ``--out`` is given.
    """
    parser = argparse.ArgumentParser(prog="lopd build-memory")
    parser.add_argument("-c", "--config", action="append", required=True, help="the fit config(s)")
    parser.add_argument("--out", default=None, help="bank folder (default: model.init_args.bank_path)")
    parser.add_argument("--from-references", action="store_true", help="seed from reference solutions")
    parser.add_argument("--min-reward", type=float, default=1.0, help="keep trajectories with reward >= this")
    parser.add_argument("--rollouts", type=int, default=None, help="rollouts per example (default: the module's)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N train examples")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per generation batch")
    args, rest = parser.parse_known_args(argv)

    from lopd_lightning.memory.bank import ExperienceBank

    config_args = [a for c in args.config for a in ("-c", c)] + rest
    # the configured bank_path is where the bank goes, not a bank to load: read it, then build without it
    out = args.out or _configured_bank_path(args.config, rest)
    cli = _lightning_cli(["--trainer.logger=false", *config_args, "--model.init_args.bank_path=null"], run=False)
    module, dm = cli.model, cli.datamodule
    bank = getattr(module, "bank", None)
    if bank is None:
        raise SystemExit("error: the configured module has no experience bank (use LOPDModule)")
    if not out:
        raise SystemExit("error: give --out FOLDER or set model.init_args.bank_path in the config")
    task = dm.task
    examples = dm.train_examples[: args.limit] if args.limit else dm.train_examples
    start = time.perf_counter()
    experiences = []
    if args.from_references:
        for ex in examples:  # replayed and scored: a reference the checker rejects is reported, not kept
            messages, reward = module.reference_trajectory(task, ex)
            if reward < args.min_reward:
                print(f"  skipped {ex.id}: its reference solution scores {reward}", flush=True)
                continue
            exp = module.experience_from_trajectory(task, ex, messages, reward)
            if exp is not None:
                experiences.append(exp)
    else:
        if args.rollouts is not None:
            module.hparams.rollouts_per_example = args.rollouts
        for i in range(0, len(examples), args.batch_size):
            chunk = examples[i : i + args.batch_size]
            batch = module.make_batch(task, chunk)
            for j in range(len(batch)):
                reward = float(batch.rewards[j])
                if reward >= args.min_reward:
                    ex = dm.example(batch.example_ids[j])
                    exp = module.experience_from_trajectory(task, ex, batch.messages[j], reward)
                    if exp is not None:
                        experiences.append(exp)
            print(f"  rolled out {min(i + args.batch_size, len(examples))}/{len(examples)} examples, "
                  f"{len(experiences)} successful so far", flush=True)
    fresh = ExperienceBank(bank.embedder, **bank.settings())
    fresh.add(experiences)
    fresh.save(out)
    seconds = time.perf_counter() - start
    source = "reference solutions" if args.from_references else "rollouts"
    print(f"bank: {len(fresh)} experiences from {len(examples)} train examples ({source}) -> {out} ({seconds:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lopd`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("faiss").setLevel(logging.WARNING)  # its loader logs a missing AVX2 build at INFO
    if argv and argv[0] == "tasks":
        return tasks_command(argv[1:])
    if argv and argv[0] == "build-memory":
        return build_memory_command(argv[1:])
    _lightning_cli(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
