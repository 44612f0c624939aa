"""Data-parallel LOPD on 2 CPU processes (gloo): what DDP must preserve (selected by ``pytest -k ddp``).

tests/scripts/ddp_lopd.py trains 2 steps with ``strategy="ddp", devices=2`` and saves, per rank and
step, the batch, the gradients the optimisers saw, beta, the margin and the bank. Checked here:

- each rank generated different rollouts (its own examples and sampling seeds);
- the gradients are synchronised (identical on both ranks) and equal the gradient of ONE process on
  both ranks' batches together: the loss is normalised by the global count of assistant tokens;
- beta is updated from the all-reduced margin (identical on both ranks, equal to the one-process value);
- the experience bank is identical on every rank after each refresh (ids, traces and embeddings).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lopd_lightning.rollout import collate_batches

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ddp_lopd.py"


def _run(args: list[str], out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    _run(["--steps", "2"], out)
    ranks = [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in (0, 1)]
    # the reference: one process, one step, on both ranks' first batches together
    combined = collate_batches([ranks[0][0]["batch"], ranks[1][0]["batch"]])
    torch.save(combined, out / "combined.pt")
    _run(["--single"], out)
    single = torch.load(out / "single.pt", weights_only=False)
    return ranks, single[0]


def test_ddp_ranks_generate_different_rollouts(ddp_run):
    ranks, _ = ddp_run
    for step in range(2):
        a, b = ranks[0][step]["batch"], ranks[1][step]["batch"]
        assert not set(a.example_ids) & set(b.example_ids)  # disjoint examples
        assert a.assistant_mask.sum() != b.assistant_mask.sum() or not torch.equal(a.input_ids, b.input_ids)
    # the ranks really do hold different token counts (what makes the normalisation test meaningful)
    assert ranks[0][0]["batch"].assistant_mask.sum() != ranks[1][0]["batch"].assistant_mask.sum()


def test_ddp_gradients_are_synchronised_and_equal_one_large_batch(ddp_run):
    ranks, single = ddp_run
    for step in range(2):
        for name in ("student_grads", "composer_grads"):
            for g0, g1 in zip(ranks[0][step][name], ranks[1][step][name], strict=True):
                assert (g0 is None) == (g1 is None)
                if g0 is not None:
                    torch.testing.assert_close(g0, g1, rtol=0, atol=0)  # all-reduced: bitwise equal
    # DDP averages the ranks' gradients; each rank divides by (global tokens / 2): together the gradient
    # of sum(all tokens' KL) / (all tokens), the one-process gradient on the concatenated batch
    assert sum(float(g.abs().sum()) for g in single["student_grads"]) > 0
    for name in ("student_grads", "composer_grads"):
        for g_ddp, g_one in zip(ranks[0][0][name], single[name], strict=True):
            assert (g_ddp is None) == (g_one is None)
            if g_ddp is not None:
                torch.testing.assert_close(g_ddp, g_one, rtol=2e-4, atol=1e-7)
    tokens = [float(r[0]["batch"].assistant_mask[:, 1:].sum()) for r in ranks]
    assert ranks[0][0]["num_loss_tokens"] == pytest.approx(sum(tokens) / 2)


def test_ddp_beta_follows_the_all_reduced_margin(ddp_run):
    ranks, single = ddp_run
    for step in range(2):
        s0, s1 = ranks[0][step], ranks[1][step]
        assert s0["margin_delta"] == s1["margin_delta"]
        assert s0["beta_after"] == s1["beta_after"]
        assert s0["beta_after"] == pytest.approx(max(0.0, s0["beta_before"] + 0.5 * (0.3 - s0["margin_delta"])))
    assert ranks[0][0]["margin_delta"] == pytest.approx(single["margin_delta"], rel=1e-4, abs=1e-6)
    assert ranks[0][0]["beta_after"] == pytest.approx(single["beta_after"], rel=1e-4)


def test_ddp_bank_is_identical_on_every_rank_after_each_refresh(ddp_run):
    ranks, _ = ddp_run
    sizes = []
    for step in range(2):
        s0, s1 = ranks[0][step], ranks[1][step]
        assert s0["bank_ids"] == s1["bank_ids"]
        assert s0["bank_traces"] == s1["bank_traces"]
        assert torch.equal(s0["bank_embeddings"], s1["bank_embeddings"])
        assert s0["rollouts_consumed"] == s1["rollouts_consumed"] == 8 * (step + 1)  # counted over both ranks
        sizes.append(len(s0["bank_ids"]))
    assert sizes[-1] > 4  # successes of both ranks entered the bank
