"""Many nodes, a dry run on CPU: ``lopd fit -c configs/tiny.yaml -c configs/trainer/multinode.yaml`` through the
project's CLI under the environment torchrun or SLURM (srun) gives each process, with ``Trainer.fit`` replaced by
a stub that keeps the Trainer: nothing is launched, no process group starts, no weights are downloaded (the tiny
random student). It checks what Lightning resolves (the cluster environment, world size, ranks, the sampler's
shards, its own launch check), that ``lopd fit`` refuses a launcher layout other than the config's in one line
naming the key and the fix, and that examples/slurm/lopd_multinode.sbatch and the torchrun command lines in the
config and docs/scaling.md give the config's layout. Not run on real nodes (none here).
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.strategies import DDPStrategy

from lopd_lightning.cli import main
from lopd_lightning.cli.checks import check_launcher
from helpers import TINY_BANK, run_main

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"
MULTINODE = ROOT / "configs" / "trainer" / "multinode.yaml"
SBATCH = ROOT / "examples" / "slurm" / "lopd_multinode.sbatch"
SCALING = ROOT / "docs" / "scaling.md"

#: every variable torchrun (measured: torch 2.13's `torchrun --no-python env`) or srun sets that Lightning reads
LAUNCHER_VARIABLES = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS",
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_NAME", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES",
    "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_JOB_NUM_NODES",
)
#: what Lightning's seed_everything writes (tiny.yaml's seed_everything: 0)
SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def layout() -> tuple[int, int]:
    """(trainer.num_nodes, trainer.devices) of configs/trainer/multinode.yaml."""
    trainer = yaml.safe_load(MULTINODE.read_text())["trainer"]
    return int(trainer["num_nodes"]), int(trainer["devices"])


@pytest.fixture
def launcher_env(monkeypatch):
    """No launcher variable of this machine reaches the test, and none that the test or Lightning sets outlives
    it (SLURMEnvironment writes MASTER_ADDR and MASTER_PORT into os.environ, seed_everything PL_GLOBAL_SEED);
    Lightning's rank for its rank-zero-only logging is restored too."""
    for name in LAUNCHER_VARIABLES + SEED_VARIABLES:
        monkeypatch.setenv(name, "")  # records the value before (or its absence) for the undo
        monkeypatch.delenv(name)
    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))

    def set_env(values: dict[str, object]) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_env


def torchrun_env(nodes: int, per_node: int, node: int, local: int) -> dict[str, object]:
    """What torchrun --nnodes nodes --nproc-per-node per_node gives process ``local`` of node ``node``."""
    return dict(WORLD_SIZE=nodes * per_node, RANK=node * per_node + local, LOCAL_RANK=local,
                LOCAL_WORLD_SIZE=per_node, GROUP_RANK=node, GROUP_WORLD_SIZE=nodes, ROLE_RANK=node * per_node + local,
                ROLE_WORLD_SIZE=nodes * per_node, MASTER_ADDR="node001", MASTER_PORT=29500, TORCHELASTIC_RUN_ID="lopd")


def slurm_env(nodes: int, per_node: int, node: int, local: int, **more: object) -> dict[str, object]:
    """What srun gives task ``local`` of node ``node`` in a job of --nodes nodes --ntasks-per-node per_node
    (``more`` replaces some; None: unset)."""
    return {**dict(SLURM_NTASKS=nodes * per_node, SLURM_PROCID=node * per_node + local, SLURM_LOCALID=local,
                   SLURM_NODEID=node, SLURM_JOB_NAME="lopd-multinode", SLURM_NTASKS_PER_NODE=per_node,
                   SLURM_NNODES=nodes, SLURM_JOB_NUM_NODES=nodes, SLURM_NODELIST=f"gpu[017-{16 + nodes:03d}]",
                   SLURM_JOB_ID=4242), **more}


def dry_run_fit(monkeypatch, *overrides: str) -> pl.Trainer:
    """``lopd fit -c configs/tiny.yaml -c configs/trainer/multinode.yaml --trainer.accelerator=cpu ...`` through
    ``main`` (parse, the fit checks, the tiny student, the DataModule, the Trainer) with ``Trainer.fit`` a stub:
    the Trainer that fit would have run."""
    seen: list[pl.Trainer] = []
    monkeypatch.setattr(pl.Trainer, "fit", lambda self, *args, **kwargs: seen.append(self))
    args = ["fit", "-c", str(TINY_YAML), "-c", str(MULTINODE), "--trainer.accelerator=cpu", "--trainer.logger=false",
            f"--model.init_args.bank_path={TINY_BANK}", *overrides]
    assert main(args) == 0
    assert len(seen) == 1
    return seen[0]


def assert_resolved(trainer: pl.Trainer, environment: type, nodes: int, devices: int, node: int, local: int) -> None:
    """The Trainer is DDP over ``nodes`` x ``devices`` processes, this one rank ``node * devices + local``,
    as Lightning's own check at launch accepts."""
    assert type(trainer.strategy) is DDPStrategy
    cluster = trainer.strategy.cluster_environment
    assert type(cluster) is environment
    assert (trainer.num_nodes, trainer.num_devices) == (nodes, devices)
    assert trainer.world_size == nodes * devices
    assert (trainer.global_rank, trainer.node_rank, trainer.local_rank) == (node * devices + local, node, local)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": nodes * devices,
                                                           "rank": node * devices + local}
    cluster.validate_settings(num_devices=trainer.num_devices, num_nodes=trainer.num_nodes)  # Lightning's, at launch


def test_torchrun_environment_resolves_to_the_configs_layout(launcher_env, monkeypatch):
    """Under torchrun's variables (the last process of the last node), the config stacked on tiny.yaml is a DDP
    Trainer on TorchElasticEnvironment: world size num_nodes x devices, ranks and rendezvous from torchrun."""
    nodes, devices = layout()
    assert nodes > 1 and devices > 1
    launcher_env(torchrun_env(nodes, devices, node=nodes - 1, local=devices - 1))
    trainer = dry_run_fit(monkeypatch)
    assert_resolved(trainer, TorchElasticEnvironment, nodes, devices, node=nodes - 1, local=devices - 1)
    cluster = trainer.strategy.cluster_environment
    assert (cluster.main_address, cluster.main_port) == ("node001", 29500)


def test_slurm_environment_resolves_to_the_configs_layout(launcher_env, monkeypatch):
    """Under srun's variables (task 3 of node 1), the same stack is a DDP Trainer on SLURMEnvironment: world size
    SLURM_NTASKS, ranks from SLURM_PROCID / SLURM_NODEID / SLURM_LOCALID, the first node of SLURM_NODELIST as
    MASTER_ADDR and 15000 + the job id's last 4 digits as MASTER_PORT."""
    nodes, devices = layout()
    launcher_env(slurm_env(nodes, devices, node=1, local=3))
    trainer = dry_run_fit(monkeypatch)
    assert_resolved(trainer, SLURMEnvironment, nodes, devices, node=1, local=3)
    cluster = trainer.strategy.cluster_environment
    assert (cluster.main_address, cluster.main_port) == ("gpu017", 15000 + 4242)


def test_lightning_builds_a_mismatched_trainer_and_refuses_it_only_at_launch(launcher_env):
    """Why ``lopd fit`` checks the layout itself: under torchrun with num_nodes x devices other than WORLD_SIZE,
    Lightning 2.6 builds the Trainer without a word (after the student loaded, in ``lopd fit``) and refuses only
    in its launcher, with a ValueError traceback on every rank."""
    launcher_env(torchrun_env(2, 8, node=0, local=0))
    trainer = pl.Trainer(accelerator="cpu", devices=8, num_nodes=1, strategy="ddp", logger=False)
    with pytest.raises(ValueError, match="does not match the world size"):
        trainer.strategy.cluster_environment.validate_settings(num_devices=8, num_nodes=1)


MISMATCHES = {
    "torchrun-nnodes": (torchrun_env(2, 8, 1, 0), ["--trainer.num_nodes=1"],
                        ["trainer.num_nodes=1 but torchrun runs 2 nodes of 8", "set --trainer.num_nodes=2"]),
    "torchrun-nnodes-devices-auto": (torchrun_env(4, 8, 1, 0), ["--trainer.devices=auto"],
                                     ["trainer.num_nodes=2 but torchrun runs 4 nodes", "--trainer.num_nodes=4"]),
    "torchrun-nproc": (torchrun_env(2, 4, 1, 0), [],
                       ["trainer.devices=8 but torchrun starts 4 processes per node", "set --trainer.devices=4"]),
    "slurm-ntasks-only": (slurm_env(2, 8, 1, 0, SLURM_NTASKS_PER_NODE=None), [],
                          ["SLURM started 16 tasks (--ntasks) without --ntasks-per-node",
                           "#SBATCH --nodes=2 --ntasks-per-node=8"]),
    "slurm-nodes": (slurm_env(4, 8, 1, 0), [],
                    ["trainer.num_nodes=2 but the SLURM job has 4 nodes", "set --trainer.num_nodes=4"]),
    "slurm-ntasks-per-node": (slurm_env(2, 4, 1, 0), [],
                              ["trainer.devices=8 but SLURM starts 4 tasks per node", "set --trainer.devices=4"]),
    "slurm-ntasks": (slurm_env(2, 8, 1, 0, SLURM_NTASKS=15), [],
                     ["trainer.num_nodes x trainer.devices = 2 x 8 = 16 processes but SLURM started 15 tasks",
                      "give #SBATCH --nodes=2 --ntasks-per-node=8"]),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_a_launcher_layout_other_than_the_configs_is_one_line_before_the_student_loads(
        case, launcher_env, monkeypatch, capsys, no_model_loading):
    """torchrun's --nnodes / --nproc-per-node or SLURM's --nodes / --ntasks-per-node / --ntasks other than the
    config's num_nodes x devices: ``lopd fit`` exits 1 with one line naming the key and the fix, before the
    student loads (Lightning would refuse it only at launch, with a traceback)."""
    env, overrides, expected = MISMATCHES[case]
    launcher_env({k: v for k, v in env.items() if v is not None})
    code, err = run_main(["fit", "-c", str(TINY_YAML), "-c", str(MULTINODE), "--trainer.accelerator=cpu",
                          "--trainer.logger=false", *overrides], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and "Traceback" not in err, err
    assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, err
    for text in expected:
        assert text in lines[-1], err


LIGHTNING_ENVIRONMENT = "lightning.fabric.plugins.environments.LightningEnvironment"


@pytest.mark.parametrize("trainer, environ", [
    ({"num_nodes": 2, "devices": 8}, {}),  # no launcher
    ({"num_nodes": 1, "devices": 1}, slurm_env(2, 8, 0, 0)),  # one process in a batch script, without srun
    ({"num_nodes": 1, "devices": "auto"}, slurm_env(1, 4, 0, 0)),  # devices resolved from the machine
    ({"num_nodes": 2, "devices": "auto"}, torchrun_env(2, 4, 1, 2)),
    ({"num_nodes": 2, "devices": 8}, {**slurm_env(4, 2, 0, 0), "SLURM_JOB_NAME": "interactive"}),
    ({"num_nodes": 1, "devices": 8, "plugins": [{"class_path": LIGHTNING_ENVIRONMENT}]},
     torchrun_env(2, 8, 0, 0)),  # the config names its cluster environment
])
def test_check_launcher_refuses_nothing_it_cannot_compare(trainer, environ):
    """No launcher, a one-process config under SLURM, ``devices: auto`` (nodes still compared), SLURM's
    interactive job names and a cluster environment in trainer.plugins are not refused."""
    check_launcher(trainer, {k: str(v) for k, v in environ.items() if v is not None})


def sbatch_options() -> dict[str, str]:
    """The ``#SBATCH --key=value`` lines of examples/slurm/lopd_multinode.sbatch."""
    return dict(re.findall(r"^#SBATCH\s+(--[\w-]+)=(\S+)", SBATCH.read_text(), flags=re.MULTILINE))


def test_the_sbatch_script_gives_the_configs_layout():
    """--nodes is trainer.num_nodes, --ntasks-per-node and --gpus-per-node are trainer.devices, and srun starts
    ``lopd fit`` with configs/trainer/multinode.yaml after an existing method config."""
    nodes, devices = layout()
    options = sbatch_options()
    assert int(options["--nodes"]) == nodes
    assert int(options["--ntasks-per-node"]) == int(options["--gpus-per-node"]) == devices
    assert "--ntasks" not in options  # Lightning needs --ntasks-per-node
    command = re.search(r"^srun lopd fit((?:.*\\\n)*.*)", SBATCH.read_text(), flags=re.MULTILINE).group(1)
    configs = re.findall(r"-c (\S+)", command)
    assert configs[-1] == "configs/trainer/multinode.yaml" and len(configs) == 2
    assert (ROOT / configs[0]).is_file()


def test_the_torchrun_command_lines_give_the_configs_layout():
    """Every torchrun line in the config's comments and docs/scaling.md starts num_nodes x devices processes
    (--nnodes, --nproc-per-node) of ``python -m lopd_lightning.cli``, the module of the ``lopd`` script."""
    nodes, devices = layout()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["lopd"] == "lopd_lightning.cli:main"
    assert importlib.util.find_spec("lopd_lightning.cli.__main__") is not None
    for path in (MULTINODE, SCALING):
        text = re.sub(r"\\\n\s*#?\s*", " ", path.read_text())  # join continued lines (and comment lines)
        commands = re.findall(r"torchrun --[^`\n]*", text)
        assert commands, f"no torchrun command in {path.relative_to(ROOT)}"
        for command in commands:
            assert f"--nnodes {nodes} " in command and f"--nproc-per-node {devices} " in command, command
            assert "--rdzv-backend c10d --rdzv-endpoint " in command and "-m lopd_lightning.cli fit" in command
            assert "-c configs/trainer/multinode.yaml" in command, command
