"""Seeded sampling: the seed of each rollout's turn, and the per-row sampler of the Hugging Face backend.

Every rollout and turn draws from its own random stream, seeded by :func:`derive_seed` from (seed, step,
example id, sample index, turn) and by nothing else, so a rollout's tokens do not depend on which other
rollouts share its batch. The global torch RNG is neither used nor reseeded.

Source of the seeding scheme (seeds derived from step, example and sample): karpathy/nanochat
``scripts/chat_rl.py``. The top-k and top-p rules are transformers' (``TopKLogitsWarper``,
``TopPLogitsWarper``).
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

__all__ = ["derive_seed"]


def derive_seed(seed: int, step: int, example_id: str, sample_index: int, turn: int) -> int:
    """The 63-bit seed of one rollout's turn: a hash (BLAKE2b) of its coordinates.

    It depends on nothing else (not on batch composition, order or device), so a rollout's random
    stream is the same wherever it is generated.

    Args:
        seed: the run's sampling seed; step: the global step; example_id: :attr:`Example.id`;
        sample_index: the rollout's index among its example's rollouts; turn: replies already made.

    Returns:
        An int in [0, 2**63): the seed of a ``torch.Generator`` (or of a backend's per-request sampler).
    """
    key = f"{seed}|{step}|{example_id}|{sample_index}|{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def _sample_rows(z: Tensor, generators: list[torch.Generator], top_k: int | None, top_p: float | None) -> Tensor:
    """One token per row from ``softmax(top_p(top_k(z)))``, row i drawn with ``generators[i]``.

    Top-k keeps the k largest logits (``torch.topk``; among exactly tied logits at the k-th place, the
    one topk returns); top-p then keeps the smallest most-likely prefix of the renormalised top-k
    distribution whose mass reaches ``top_p`` (transformers' ``TopPLogitsWarper`` rule: a token is
    dropped when the tokens more likely than it already hold ``top_p``; the first is always kept).

    Args:
        z: (B, V) float, logits divided by the temperature.

    Returns:
        (B,) long token ids.
    """
    vocab = z.shape[-1]
    use_top_p = top_p is not None and top_p < 1.0
    if top_k is not None and 0 < top_k < vocab:
        values, index = torch.topk(z, top_k, dim=-1)  # sorted, most likely first
    elif use_top_p:
        values, index = torch.sort(z, dim=-1, descending=True)
    else:
        values, index = z, None
    if use_top_p:
        probs = values.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        drop = before >= top_p
        drop[..., 0] = False
        values = values.masked_fill(drop, float("-inf"))
    probs = values.softmax(dim=-1)
    choice = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])
    return choice if index is None else index.gather(-1, choice[:, None]).squeeze(-1)


class _SeededSampler:
    """A logits processor that samples itself, one ``torch.Generator`` per row.

    ``model.generate`` runs greedy search (``do_sample=False``); this processor, last in the list, draws
    each row's token from ``softmax(top_p(top_k(z / temperature)))`` with that row's generator, records
    ``log_softmax(z / temperature)`` at the drawn token, and returns logits that are -inf except at the
    drawn token, so greedy search picks it. Recording the log-prob here avoids keeping the (B, S, V)
    logits that ``output_logits=True`` would store.
    """

    def __init__(self, seeds: list[int], *, device: torch.device, temperature: float, top_k: int | None,
                 top_p: float | None, greedy: bool):
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.temperature, self.top_k, self.top_p, self.greedy = temperature, top_k, top_p, greedy
        self.tokens: list[Tensor] = []
        self.logps: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        z = scores.float() / self.temperature  # (B, V)
        logp = torch.log_softmax(z, dim=-1)
        if self.greedy:
            tok = z.argmax(dim=-1)
        else:
            tok = _sample_rows(z, self.generators, self.top_k, self.top_p)
        self.tokens.append(tok)
        self.logps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, tok[:, None], 0.0)
