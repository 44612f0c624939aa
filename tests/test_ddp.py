"""Data-parallel training of every method on 2 CPU processes (gloo): what DDP must preserve.

Selected by ``pytest -k ddp``; one method by ``pytest -k "ddp and grpo"`` (ids: lopd, grpo, sdpo, opsd,
skill_sd, sft). tests/scripts/ddp_methods.py trains 2 steps with ``strategy="ddp", devices=2`` and saves,
per rank and step, the batch, the gradients the optimisers saw and the weights after the step (LOPD: also
beta, the margin and the bank). Checked here, for every method:

- each rank generated different rollouts (its own examples and sampling seeds);
- the module has no trainable parameter outside what its optimisers update (a parameter without a
  gradient makes DDP skip its all-reduce and fail on the next step): no composer outside LOPD;
- the gradients are synchronised (identical on both ranks) and equal the gradient of ONE process on
  both ranks' batches together: the loss is normalised by the global count of loss tokens;
- the weights stay identical on both ranks after every step.

LOPD also: beta is updated from the all-reduced margin, and the experience bank is identical on every
rank after each refresh.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lopd_lightning.rollout import RolloutBatch

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ddp_methods.py"
METHODS = ["lopd", "grpo", "sdpo", "opsd", "skill_sd", "sft"]
_RUNS: dict[str, tuple[list, dict]] = {}


def _run(method: str, args: list[str], out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--method", method, "--out", str(out), *args],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def collate_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    """The batches' rows in one batch on CPU, right-padded to the longest, each batch's group ids renumbered
    0, 1, ... after the previous batch's (two ranks' groups 0 stay apart); experiences and stats joined when
    every batch has them."""
    batches = [b.to("cpu") for b in batches]
    pad, t = batches[0].pad_token_id, max(b.input_ids.shape[1] for b in batches)

    def padded(name: str, value) -> torch.Tensor:
        parts = [getattr(b, name) for b in batches]
        return torch.cat([torch.cat([x, torch.full((x.shape[0], t - x.shape[1]), value, dtype=x.dtype)], dim=1)
                          for x in parts])

    groups, offset = [], 0
    for b in batches:
        mapping: dict[int, int] = {}
        for gid in b.group_ids.tolist():
            mapping.setdefault(gid, len(mapping) + offset)
        groups.append(torch.tensor([mapping[g] for g in b.group_ids.tolist()], dtype=torch.long))
        offset += len(mapping)
    stats = None
    if all(b.stats is not None for b in batches):
        stats = batches[0].stats
        for b in batches[1:]:
            stats = stats + b.stats
    experiences = None if any(b.experiences is None for b in batches) else [x for b in batches for x in b.experiences]
    return RolloutBatch(
        input_ids=padded("input_ids", pad),
        attention_mask=padded("attention_mask", 0),
        assistant_mask=padded("assistant_mask", False),
        sampling_logps=padded("sampling_logps", 0.0),
        rewards=torch.cat([b.rewards for b in batches]),
        group_ids=torch.cat(groups),
        context_position=torch.cat([b.context_position for b in batches]),
        example_ids=[x for b in batches for x in b.example_ids],
        messages=[x for b in batches for x in b.messages],
        metadata=[x for b in batches for x in b.metadata],
        experiences=experiences,
        stats=stats,
        pad_token_id=pad,
    )


def ddp_run(method: str, tmp_path_factory) -> tuple[list, dict]:
    """(per-rank captures of the 2-step DDP run, the one-process capture on both first batches), cached."""
    if method not in _RUNS:
        out = tmp_path_factory.mktemp(f"ddp_{method}")
        _run(method, ["--steps", "2"], out)
        ranks = [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in (0, 1)]
        # the reference: one process, one step, on both ranks' first batches together
        combined = collate_batches([ranks[0][0]["batch"], ranks[1][0]["batch"]])
        torch.save(combined, out / "combined.pt")
        _run(method, ["--single"], out)
        single = torch.load(out / "single.pt", weights_only=False)
        _RUNS[method] = (ranks, single[0])
    return _RUNS[method]


def _grad_names(method: str) -> tuple[str, ...]:
    return ("student_grads", "composer_grads") if method == "lopd" else ("student_grads",)


@pytest.mark.parametrize("method", METHODS)
def test_ddp_ranks_generate_different_rollouts(method, tmp_path_factory):
    ranks, _ = ddp_run(method, tmp_path_factory)
    for step in range(2):
        a, b = ranks[0][step]["batch"], ranks[1][step]["batch"]
        assert not set(a.example_ids) & set(b.example_ids)  # disjoint examples
        assert a.assistant_mask.sum() != b.assistant_mask.sum() or not torch.equal(a.input_ids, b.input_ids)


@pytest.mark.parametrize("method", METHODS)
def test_ddp_trainable_parameters_are_what_the_optimisers_update(method, tmp_path_factory):
    ranks, _ = ddp_run(method, tmp_path_factory)
    trainable = ranks[0][0]["trainable"]
    assert trainable == ranks[1][0]["trainable"]
    if method != "lopd":  # a method without a composer has no composer parameter at all
        assert not [n for n in trainable if "composer" in n], trainable
        assert len(trainable) == len(ranks[0][0]["student_grads"])
    else:
        assert any("composer" in n for n in trainable) and not [n for n in trainable if "anchor" in n]


@pytest.mark.parametrize("method", METHODS)
def test_ddp_gradients_are_synchronised_and_equal_one_large_batch(method, tmp_path_factory):
    ranks, single = ddp_run(method, tmp_path_factory)
    for step in range(2):
        for name in _grad_names(method):
            for g0, g1 in zip(ranks[0][step][name], ranks[1][step][name], strict=True):
                assert (g0 is None) == (g1 is None)
                if g0 is not None:
                    torch.testing.assert_close(g0, g1, rtol=0, atol=0)  # all-reduced: bitwise equal
    # DDP averages the ranks' gradients; each rank divides by (global tokens / 2): together the gradient
    # of sum(all tokens' loss) / (all tokens), the one-process gradient on the concatenated batch
    assert sum(float(g.abs().sum()) for g in single["student_grads"] if g is not None) > 0
    for name in _grad_names(method):
        for g_ddp, g_one in zip(ranks[0][0][name], single[name], strict=True):
            assert (g_ddp is None) == (g_one is None)
            if g_ddp is not None:
                torch.testing.assert_close(g_ddp, g_one, rtol=2e-4, atol=1e-7)
    if method in ("lopd", "sft"):  # every assistant token is a loss token
        tokens = [float(r[0]["batch"].assistant_mask[:, 1:].sum()) for r in ranks]
        assert ranks[0][0]["num_loss_tokens"] == pytest.approx(sum(tokens) / 2)


@pytest.mark.parametrize("method", METHODS)
def test_ddp_weights_stay_identical_on_every_rank(method, tmp_path_factory):
    ranks, _ = ddp_run(method, tmp_path_factory)
    for step in range(2):
        before = ranks[0][step - 1]["params"] if step else None
        for p0, p1 in zip(ranks[0][step]["params"], ranks[1][step]["params"], strict=True):
            torch.testing.assert_close(p0, p1, rtol=0, atol=0)
        if before is not None:  # the second step did update the weights
            assert any(not torch.equal(a, b) for a, b in zip(before, ranks[0][step]["params"], strict=True))
    for step in range(2):
        assert ranks[0][step]["rollouts_consumed"] == ranks[1][step]["rollouts_consumed"]


def test_ddp_lopd_beta_follows_the_all_reduced_margin(tmp_path_factory):
    ranks, single = ddp_run("lopd", tmp_path_factory)
    for step in range(2):
        s0, s1 = ranks[0][step], ranks[1][step]
        assert s0["margin_delta"] == s1["margin_delta"]
        assert s0["beta_after"] == s1["beta_after"]
        assert s0["beta_after"] == pytest.approx(max(0.0, s0["beta_before"] + 0.5 * (0.3 - s0["margin_delta"])))
    assert ranks[0][0]["margin_delta"] == pytest.approx(single["margin_delta"], rel=1e-4, abs=1e-6)
    assert ranks[0][0]["beta_after"] == pytest.approx(single["beta_after"], rel=1e-4)


def test_ddp_lopd_bank_is_identical_on_every_rank_after_each_refresh(tmp_path_factory):
    ranks, _ = ddp_run("lopd", tmp_path_factory)
    sizes = []
    for step in range(2):
        s0, s1 = ranks[0][step], ranks[1][step]
        assert s0["bank_ids"] == s1["bank_ids"]
        assert s0["bank_traces"] == s1["bank_traces"]
        assert torch.equal(s0["bank_embeddings"], s1["bank_embeddings"])
        assert s0["rollouts_consumed"] == s1["rollouts_consumed"] == 8 * (step + 1)  # counted over both ranks
        sizes.append(len(s0["bank_ids"]))
    assert sizes[-1] > 4  # successes of both ranks entered the bank


def test_ddp_last_ckpt_is_written_at_the_final_step_on_both_ranks_without_a_hang(tmp_path):
    """3 steps saved every 2 under DDP: the final save (LastCheckpointAtTrainEnd, a collective save) runs on
    both ranks, and last.ckpt holds step 3 and rank 0's final weights."""
    _run("grpo", ["--steps", "3", "--checkpoint-every", "2"], tmp_path)
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 3
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt"]
    ranks = [torch.load(tmp_path / f"rank_{r}.pt", weights_only=False) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 3
    final = ranks[0][-1]
    assert final["weights"]
    for name, value in final["weights"].items():
        assert torch.equal(last["state_dict"][name], value), name
