"""The composer's compressors Comp_chi: one experience's encoder states -> K latent tokens (docs/METHOD.md 3).

* :class:`MemoryTokens` (``composer_architecture: memory_tokens``, the default): K learned embeddings appended
  to the encoder's input, read out at its last layer (docs/METHOD.md section 3, "Deviation").
* :class:`PerceiverResampler` (``perceiver``, the paper's): K learned queries over the encoder's last hidden
  states, one block applied ``depth`` times.
* :class:`TokenPointer` (``pointer``): K soft pointers into the experience's own tokens; each latent is a mixture
  of the experience's input token embeddings (plus a gated abstractive residual), so the frozen teacher can read
  it from the first step (docs/METHOD.md section 3, "The pointer compressor").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MemoryTokens", "PerceiverResampler", "TokenPointer"]


class _ResamplerBlock(nn.Module):
    """One Perceiver block: queries attend over concat(media, queries), residual; feed-forward, residual."""

    def __init__(self, d_model: int, *, num_heads: int, head_dim: int, ff_mult: int) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.norm_media = nn.LayerNorm(d_model)
        self.norm_latents = nn.LayerNorm(d_model)
        self.to_q = nn.Linear(d_model, inner, bias=False)
        self.to_kv = nn.Linear(d_model, 2 * inner, bias=False)
        self.to_out = nn.Linear(inner, d_model, bias=False)
        self.ff = nn.Sequential(
            nn.LayerNorm(d_model),
            nn.Linear(d_model, ff_mult * d_model),
            nn.GELU(),
            nn.Linear(ff_mult * d_model, d_model),
        )

    def _heads(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        return x.view(n, t, self.num_heads, self.head_dim).transpose(1, 2)  # [N, h, t, hd]

    def forward(self, latents: Tensor, media: Tensor, media_mask: Tensor) -> Tensor:
        """latents (N, K, d), media (N, T, d) already normed, media_mask (N, T) bool -> (N, K, d)."""
        n, k, _ = latents.shape
        q_in = self.norm_latents(latents)
        kv_in = torch.cat([media, q_in], dim=1)  # [N, T+K, d]
        q = self._heads(self.to_q(q_in))
        key, value = self.to_kv(kv_in).chunk(2, dim=-1)
        key, value = self._heads(key), self._heads(value)
        keep = torch.cat([media_mask, media_mask.new_ones(n, k)], dim=1)  # queries always visible
        attn = F.scaled_dot_product_attention(q, key, value, attn_mask=keep[:, None, None, :])
        attn = attn.transpose(1, 2).reshape(n, k, self.num_heads * self.head_dim)
        latents = latents + self.to_out(attn)
        return latents + self.ff(latents)


class PerceiverResampler(nn.Module):
    """Perceiver resampler Comp_chi: a variable-length sequence (T x d) -> K latent tokens (K x d).

    K learned queries (init ``randn / sqrt(d)``), an input projection of the media (Linear d -> d), then
    ONE block [pre-norm attention of the queries over concat(projected media, queries), residual;
    feed-forward LayerNorm, Linear d -> ff_mult*d, GELU, Linear back, residual] applied ``depth`` times
    (weights shared across depth: the parameter count does not depend on ``depth``), and an output
    ``LayerNorm(proj_out(.))``. docs/METHOD.md section 3; the block layout follows Flamingo's resampler.

    Args:
        d_model: d, the backbone's hidden size (input and output width).
        num_latents: K, latent tokens per sequence (32 in the paper).
        depth: how many times the shared block is applied (8 in the paper).
        num_heads: attention heads (the backbone's).
        head_dim: width of a head; ``d_model // num_heads`` when None (the backbone's ``head_dim``
            where it has one: the attention's inner width is ``num_heads * head_dim``).
        ff_mult: feed-forward expansion (4).
        output_gain: initial weight of the output LayerNorm (1.0 = PyTorch's default; a smaller value
            starts the latents closer to the scale of the backbone's token embeddings).

    Raises:
        ValueError: a size is not positive, or ``d_model`` is not divisible by ``num_heads`` when
            ``head_dim`` is None.
    """

    def __init__(
        self,
        d_model: int,
        *,
        num_latents: int = 32,
        depth: int = 8,
        num_heads: int = 8,
        head_dim: int | None = None,
        ff_mult: int = 4,
        output_gain: float = 1.0,
    ) -> None:
        super().__init__()
        if min(d_model, num_latents, depth, num_heads, ff_mult) <= 0:
            raise ValueError("d_model, num_latents, depth, num_heads and ff_mult must be positive")
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"d_model {d_model} is not divisible by num_heads {num_heads}")
            head_dim = d_model // num_heads
        self.d_model = d_model
        self.num_latents = num_latents
        self.depth = depth
        self.queries = nn.Parameter(torch.randn(num_latents, d_model) / math.sqrt(d_model))
        self.proj_in = nn.Linear(d_model, d_model)
        self.block = _ResamplerBlock(d_model, num_heads=num_heads, head_dim=head_dim, ff_mult=ff_mult)
        self.proj_out = nn.Linear(d_model, d_model)
        self.norm_out = nn.LayerNorm(d_model)
        with torch.no_grad():
            self.norm_out.weight.fill_(output_gain)

    def forward(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """Resample.

        Args:
            hidden: (N, T, d) float, the encoder's last hidden states.
            mask: (N, T) bool or {0, 1}, 1 on real tokens (key padding mask).

        Returns:
            (N, K, d) float in the resampler's dtype.
        """
        hidden = hidden.to(self.proj_in.weight.dtype)
        media = self.block.norm_media(self.proj_in(hidden))  # [N, T, d], normed once: the block is shared
        mask = mask.bool()
        latents = self.queries.unsqueeze(0).expand(hidden.shape[0], -1, -1)
        for _ in range(self.depth):
            latents = self.block(latents, media, mask)
        return self.norm_out(self.proj_out(latents))


class MemoryTokens(nn.Module):
    """Memory-token compressor Comp_chi: K learned embeddings read out at the end of the encoder's input.

    The encoder reads ``[experience tokens] [m_1 ... m_K]`` (the K memory embeddings after each row's last
    real token); its last hidden states at the memory positions, ``LayerNorm(proj(h))``, are the K latents.
    ``proj`` starts as the identity, the LayerNorm's gain at ``output_gain``. The in-context autoencoder's
    memory slots (Ge et al., ICLR 2024), with a learned output map to the input-embedding scale.

    Args:
        d_model: d, the backbone's hidden size.
        num_latents: K.
        init_embeddings: (V, d) float, the backbone's input embeddings: the memory embeddings start as K rows
            drawn at random (torch's global generator) from them.
        output_gain: initial gain of the output LayerNorm (the token embeddings' RMS puts the latents at
            their scale).

    Raises:
        ValueError: ``d_model`` or ``num_latents`` is not positive, or ``init_embeddings`` is not (V, d_model).
    """

    #: methods besides ``forward`` that read its weights: FSDP2 gathers them there too (lopd_lightning.sharding)
    fsdp_forward_methods = ("append_to",)

    def __init__(self, d_model: int, *, num_latents: int, init_embeddings: Tensor, output_gain: float = 1.0) -> None:
        super().__init__()
        if min(d_model, num_latents) <= 0:
            raise ValueError("d_model and num_latents must be positive")
        if init_embeddings.dim() != 2 or init_embeddings.shape[1] != d_model:
            raise ValueError(f"init_embeddings must be (V, {d_model}), got {tuple(init_embeddings.shape)}")
        self.d_model = d_model
        self.num_latents = num_latents
        rows = torch.randint(init_embeddings.shape[0], (num_latents,))
        self.memory = nn.Parameter(init_embeddings[rows].detach().float().clone())  # [K, d]
        self.proj = nn.Linear(d_model, d_model)
        self.norm_out = nn.LayerNorm(d_model)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(d_model))
            self.proj.bias.zero_()
            self.norm_out.weight.fill_(output_gain)

    def append_to(self, token_embeds: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The encoder's input with the memory embeddings after each row's real tokens.

        Args:
            token_embeds: (N, T, d) float, the input embeddings of right-padded rows.
            mask: (N, T) {0, 1}, 1 on real tokens (right padding).

        Returns:
            ``(inputs_embeds (N, T+K, d), attention_mask (N, T+K) long, memory_slots (N, T+K) bool)``; row n's
            memory embeddings sit at positions ``len_n .. len_n+K-1``, padding after them.
        """
        n, t, d = token_embeds.shape
        k = self.num_latents
        lengths = mask.long().sum(dim=1)  # [N]
        steps = torch.arange(t + k, device=token_embeds.device)[None, :]  # [1, T+K]
        is_token = steps < lengths[:, None]  # [N, T+K]
        is_memory = (steps >= lengths[:, None]) & (steps < lengths[:, None] + k)
        padded = torch.cat([token_embeds, token_embeds.new_zeros(n, k, d)], dim=1)  # [N, T+K, d]
        memory = self.memory.to(token_embeds.dtype)[(steps - lengths[:, None]).clamp(0, k - 1)]  # [N, T+K, d]
        memory = torch.where(is_memory[..., None], memory, torch.zeros_like(memory))
        embeds = torch.where(is_token[..., None], padded, memory)
        return embeds, (is_token | is_memory).long(), is_memory

    def forward(self, memory_hidden: Tensor) -> Tensor:
        """(N, K, d) last hidden states at the memory positions -> (N, K, d) latents, in chi's dtype."""
        return self.norm_out(self.proj(memory_hidden.to(self.proj.weight.dtype)))


class TokenPointer(nn.Module):
    """Pointer compressor Comp_chi: K latents, each a soft pointer into the experience's own token embeddings.

    For an experience of ``L`` real tokens with input embeddings ``e_t`` and encoder last hidden states ``h_t``
    (the backbone under the composer LoRA), latent k has a home position ``tau_k = min(max(L - K, 0) + k, L - 1)``
    (the last K tokens: the end of the trajectory, where its calls are) and is

        a_k = softmax_t( (W_q h_{tau_k}) . h_t / sqrt(d) - beta * |t - tau_k| )      over the L real tokens
        c_k = sum_t a_kt e_t + tanh(g) * LayerNorm(proj(h_{tau_k}))

    with ``beta = softplus(rho)``. ``W_q`` and ``g`` start at 0 and ``beta`` at ``sharpness`` (4: the home token
    carries ~96% of the weight), so the first latents are close to the embeddings of the experience's last K
    tokens: the frozen teacher reads them as (nearly) that text from the first step, and training moves the
    pointers (W_q, beta) and opens the abstractive residual (g, proj). Latents of a pointer that copies stay in
    the span of the experience's own token embeddings, the space the teacher was trained to read; the
    memory-token readout (:class:`MemoryTokens`) starts in the output space of the last layer instead. A
    pointer-generator's copy distribution (See et al., ACL 2017) over input embeddings, with positional homes.
    This project's design, not the paper's (docs/METHOD.md section 3).

    Args:
        d_model: d, the backbone's hidden size.
        num_latents: K.
        sharpness: the initial beta (> 0), in nats per token of distance from the home position.
        output_gain: initial gain of the residual's LayerNorm (the token embeddings' RMS).

    Raises:
        ValueError: ``d_model`` or ``num_latents`` is not positive, or ``sharpness`` is not > 0.
    """

    def __init__(self, d_model: int, *, num_latents: int, sharpness: float = 4.0, output_gain: float = 1.0) -> None:
        super().__init__()
        if min(d_model, num_latents) <= 0:
            raise ValueError("d_model and num_latents must be positive")
        if not sharpness > 0:
            raise ValueError(f"sharpness must be > 0, got {sharpness}")
        self.d_model = d_model
        self.num_latents = num_latents
        self.query = nn.Linear(d_model, d_model, bias=False)
        # softplus^-1(sharpness), stable for large values; shape (1,), not a scalar: FSDP2 shards no 0-dim parameter
        self.sharpness_raw = nn.Parameter(torch.tensor([sharpness + math.log(-math.expm1(-sharpness))]))
        self.gate = nn.Parameter(torch.zeros(1))
        self.proj = nn.Linear(d_model, d_model)
        self.norm_out = nn.LayerNorm(d_model)
        with torch.no_grad():
            self.query.weight.zero_()
            self.proj.weight.copy_(torch.eye(d_model))
            self.proj.bias.zero_()
            self.norm_out.weight.fill_(output_gain)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # composers saved before these two parameters had shape (1,) held them as scalars
        for name in ("sharpness_raw", "gate"):
            value = state_dict.get(prefix + name)
            if value is not None and value.dim() == 0:
                state_dict[prefix + name] = value.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def homes(self, mask: Tensor) -> Tensor:
        """(N, T) {0, 1} right-padded mask -> (N, K) long home positions ``tau_k`` (the last K real tokens)."""
        lengths = mask.long().sum(dim=1).clamp(min=1)  # [N]
        k = torch.arange(self.num_latents, device=mask.device)[None, :]  # [1, K]
        start = (lengths - self.num_latents).clamp(min=0)[:, None]
        return torch.minimum(start + k, (lengths - 1)[:, None])

    def pointers(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """The (N, K, T) float pointer weights a_k over the row's tokens (rows sum to 1; 0 on padding)."""
        return self._point(hidden, mask)[0]

    def _point(self, hidden: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """(pointer weights (N, K, T), the home positions' hidden states h_tau (N, K, d)), in the compressor's dtype."""
        hidden = hidden.to(self.query.weight.dtype)
        mask = mask.bool()
        n, t, d = hidden.shape
        homes = self.homes(mask)  # [N, K]
        home_hidden = hidden.gather(1, homes[..., None].expand(n, self.num_latents, d))  # [N, K, d]
        scores = torch.einsum("nkd,ntd->nkt", self.query(home_hidden), hidden) / math.sqrt(d)
        distance = (torch.arange(t, device=hidden.device)[None, None, :] - homes[..., None]).abs()
        scores = scores - F.softplus(self.sharpness_raw) * distance.to(scores.dtype)
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        return scores.softmax(dim=-1), home_hidden

    def forward(self, hidden: Tensor, mask: Tensor, token_embeds: Tensor) -> Tensor:
        """Point.

        Args:
            hidden: (N, T, d) float, the encoder's last hidden states.
            mask: (N, T) {0, 1}, 1 on real tokens (right padding; at least one per row).
            token_embeds: (N, T, d) float, the experience's input token embeddings (constants).

        Returns:
            (N, K, d) float latents in the compressor's dtype.
        """
        weights, home_hidden = self._point(hidden, mask)  # [N, K, T], [N, K, d]
        copied = torch.einsum("nkt,ntd->nkd", weights, token_embeds.to(weights.dtype))
        return copied + torch.tanh(self.gate) * self.norm_out(self.proj(home_hidden))
