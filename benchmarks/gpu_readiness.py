"""GPU readiness in one borrowed-machine call: the GPU tests, and an LOPD and a GRPO step timed on a GPU.

The GPU machine this project can borrow (see the README, "Scaling out") has Python 3.12, torch, transformers,
lightning, peft, tensorboard and torchmetrics, no network, and takes at most 64 MiB of carried files. So:

    python benchmarks/gpu_readiness.py prepare            # here: gpu_bundle/ (wheels + SmolLM2's shape, no weights)
    python benchmarks/gpu_readiness.py run --out $OUT     # there (carry gpu_bundle): results in $OUT
    python benchmarks/gpu_readiness.py run --rehearse     # here: the same steps on the CPU, 2 layers, 1 step

``prepare`` downloads the missing pure-Python and manylinux wheels for CPython 3.12 (jsonargparse, omegaconf,
faiss-cpu, pytest, hypothesis and what they need, without dependencies the machine has) and writes the
config and tokenizer of SmolLM2-135M-Instruct (no weights: the model travels as its shape) into
``gpu_bundle/``, and checks the bundle's size. ``run`` installs the wheels into ``gpu_bundle/site`` (no
index, no dependencies), builds a randomly initialised model of SmolLM2's shape, runs the tests marked
``gpu`` and ``benchmarks/step_cost.py`` on it (toy task, hashing embedder, bfloat16 on CUDA), and writes
``gpu_readiness.json`` (the test summary and the step times) plus the logs to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, run_metadata, write_json_atomic  # noqa: E402

BUNDLE = REPO_ROOT / "gpu_bundle"
#: what the GPU machine lacks (pinned to what this project's CPU environment runs), installed without deps
WHEELS = [
    "jsonargparse==4.53.0", "docstring-parser==0.18.0", "typeshed-client==2.15.0", "omegaconf==2.4.0",
    "faiss-cpu==1.15.1", "pytest==9.2.0", "pluggy==1.7.0", "iniconfig==2.3.1", "pygments==2.19.2",
    "hypothesis==6.170.17", "sortedcontainers==2.4.0",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "config.json", "generation_config.json")
MAX_BUNDLE_MB = 60  # the call carries at most 64 MiB, the repository included


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def prepare(bundle: Path) -> None:
    """Wheels for CPython 3.12 on x86-64 Linux and SmolLM2's config and tokenizer into ``bundle``."""
    from lopd_lightning.models import smollm2_folder

    wheels = bundle / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64",
           "-d", str(wheels), *WHEELS]
    subprocess.run(cmd, check=True)
    shape = bundle / "smollm2_shape"
    shape.mkdir(exist_ok=True)
    source = smollm2_folder()
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, shape / name)
    size = folder_mb(bundle)
    print(f"{bundle}: {size:.1f} MiB ({len(list(wheels.glob('*.whl')))} wheels)")
    if size > MAX_BUNDLE_MB:
        raise SystemExit(f"the bundle is {size:.1f} MiB, over {MAX_BUNDLE_MB}: it would not travel")


def install(bundle: Path) -> Path:
    """The bundle's wheels into ``bundle/site`` (no index, no dependencies); returns the folder."""
    site = bundle / "site"
    wheels = sorted(str(p) for p in (bundle / "wheels").glob("*.whl"))
    if sys.version_info[:2] != (3, 12):  # a rehearsal here: this environment already has them
        print(f"Python {sys.version_info[0]}.{sys.version_info[1]}: the bundle's CPython 3.12 wheels are not installed")
        return site
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                        str(site), *wheels], check=True)
    return site


def random_student(bundle: Path, folder: Path, *, layers: int | None) -> Path:
    """A randomly initialised model of SmolLM2's shape (``layers`` of them, all by default) with its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    shape = bundle / "smollm2_shape"
    config = AutoConfig.from_pretrained(shape)
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(shape).save_pretrained(folder)
    for name in ("chat_template.jinja", "generation_config.json"):
        if (shape / name).exists():
            shutil.copy2(shape / name, folder / name)
    return folder


def run(bundle: Path, out: Path, *, device: str, rehearse: bool) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    site = install(bundle)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    result: dict[str, Any] = {"benchmark": "gpu_readiness", "device": device, "rehearsal": rehearse}
    start = time.perf_counter()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
                           cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    (out / "gpu_tests.log").write_text(tests.stdout + tests.stderr)
    result["gpu_tests"] = {"returncode": tests.returncode, "summary": (tests.stdout.strip().splitlines() or [""])[-1],
                           "seconds": time.perf_counter() - start}
    student = random_student(bundle, Path("/tmp/lopd_smollm2_shape"), layers=2 if rehearse else None)
    step_json = out / "step_cost_gpu.json"
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "step_cost.py"), "--model", str(student), "--task", "toy",
           "--embedder", "hashing", "--device", device, "--dtype", "bfloat16" if device == "cuda" else "float32",
           "--trajectories", "8", "--steps", "1" if rehearse else "3", "--warmup", "1", "--floor-repeats", "1",
           "--max-new-tokens", "16" if rehearse else "96", "--threads", "2" if rehearse else "8", "--out", str(step_json)]
    start = time.perf_counter()
    steps = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    (out / "step_cost.log").write_text(steps.stdout + steps.stderr)
    result["step_cost"] = {"returncode": steps.returncode, "seconds": time.perf_counter() - start}
    if step_json.exists():
        data = json.loads(step_json.read_text())
        result["step_cost"].update({k: data.get(k) for k in ("ratio_lopd_over_grpo", "ratio_excluding_generation")})
        result["step_cost"]["median_step_s"] = {m: data["methods"][m].get("step_total_median_s")
                                                for m in data.get("methods", {})}
    result.update(run_metadata(seed=0))
    write_json_atomic(result, out / "gpu_readiness.json")
    print(json.dumps({k: result[k] for k in ("gpu_tests", "step_cost")}, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["prepare", "run"])
    parser.add_argument("--bundle", type=Path, default=BUNDLE)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_readiness")))
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--rehearse", action="store_true", help="on the CPU: 2 layers, 1 step, short replies")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.bundle)
        return
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and not args.rehearse:
        raise SystemExit("no CUDA device here: pass --rehearse to rehearse the run on the CPU")
    run(args.bundle, args.out, device=device, rehearse=args.rehearse)


if __name__ == "__main__":
    main()
