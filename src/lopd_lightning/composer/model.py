"""The composer's model: retrieved experiences -> latent tokens c_phi (docs/METHOD.md section 3).

``c_phi = Comp_chi(Enc_psi(x, m_1), ..., Enc_psi(x, m_J))``. The encoder Enc_psi is the *shared* backbone
with its ``"composer"`` LoRA active (psi); it reads :func:`experience_prompt`
(``"Task to solve:\\n{x}\\n\\nReference past trajectory:\\n{m_j}"``) for each retrieved experience. Two
compressors Comp_chi turn one experience into K latent tokens (``architecture``):

- ``"memory_tokens"`` (the default; an in-context-autoencoder compressor, not the paper's): K learned
  embeddings are appended to the encoder's input and the latents are its last hidden states at those K
  positions, through ``LayerNorm(proj(.))`` started at the scale of the token embeddings
  (:class:`MemoryTokens`). Every latent is computed by the whole backbone attending over the experience.
  docs/METHOD.md section 3, "Deviation" gives the measurement that made it the default.
- ``"perceiver"`` (the paper's): the encoder's last hidden states H_j (T_j x d) go through a Perceiver
  resampler (:class:`PerceiverResampler`): K learned queries, a shared block applied ``depth`` times.
- ``"pointer"`` (this project's): K soft pointers into the experience's own tokens (:class:`TokenPointer`):
  each latent is a mixture of the experience's input token embeddings, started at its last K tokens, plus a
  gated residual of the encoder's hidden state, so the frozen teacher reads the latents from the first step.

So J experiences give J*K latents of the backbone's hidden size d. ``hidden_states[-1]`` of the model
output is, in transformers 5, the output of the final norm (the vectors the LM head reads).

The backbone is *not* a submodule of :class:`LatentComposer`: it is held in a plain tuple attribute,
which ``nn.Module`` does not register. ``composer.parameters()`` and ``composer.state_dict()`` therefore
hold only the compressor chi; the LoRA psi lives in the backbone (saved with it) and is reached with
:meth:`LatentComposer.lora_parameters`. ``composer.to(device)`` moves only the compressor: the owner of the
backbone (the LightningModule) moves the backbone.

Map to the method (docs/METHOD.md):

* :class:`LatentComposer`, :func:`experience_prompt`: section 3, c_phi = Comp_chi(Enc_psi(x, m_j)).
* :func:`clip_composer_grads`, :func:`composer_parameter_groups`: section 5, the separate clip norms
  (30 for the compressor, 3 for the LoRA).
* :func:`save_composer`, :func:`load_composer`: a composer (compressor and LoRA) in a folder of its own,
  what ``lopd pretrain-composer`` writes and ``model.init_args.composer_path`` reads.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import torch
from peft import PeftModel
from torch import Tensor, nn

from lopd_lightning.adapters import COMPOSER, composer_lora_parameters, use_adapter
from lopd_lightning.composer.compressors import MemoryTokens, PerceiverResampler, TokenPointer
from lopd_lightning.sharding import plain
from lopd_lightning.text import encode_data

__all__ = [
    "ARCHITECTURES",
    "ClipNorms",
    "ComposerOutput",
    "ExperienceBatch",
    "LR_SCHEDULES",
    "LatentComposer",
    "check_composer_options",
    "clip_composer_grads",
    "composer_parameter_groups",
    "experience_prompt",
    "load_composer",
    "save_composer",
]

#: the compressors a composer may use (``LatentComposer(architecture=...)``)
ARCHITECTURES = ("memory_tokens", "perceiver", "pointer")

#: Clip norms of docs/METHOD.md section 5 (composer cold start): 30 for the compressor, 3 for the LoRA.
COMPRESSOR_CLIP = 30.0
LORA_CLIP = 3.0
#: the file :func:`save_composer` writes in its folder
COMPOSER_FILE = "composer.pt"


def experience_prompt(task_text: str, trace: str) -> str:
    """The encoder's input for one retrieved experience (docs/METHOD.md section 3).

    Args:
        task_text: x, the task to solve now.
        trace: m_j, the observation-lite trace of a retrieved, solved task.

    Returns:
        ``"Task to solve:\\n{x}\\n\\nReference past trajectory:\\n{m_j}"``.
    """
    return f"Task to solve:\n{task_text}\n\nReference past trajectory:\n{trace}"


class ExperienceBatch(NamedTuple):
    """Tokenised experiences, right-padded.

    Attributes:
        input_ids: (B, J, T) long; pad id where ``attention_mask`` is 0.
        attention_mask: (B, J, T) long {0, 1}; all zeros for a missing experience.
        experience_mask: (B, J) bool, True where row b has a j-th experience.
    """

    input_ids: Tensor
    attention_mask: Tensor
    experience_mask: Tensor


class ComposerOutput(NamedTuple):
    """Latent tokens c_phi.

    Attributes:
        latents: (B, J*K, d) float, experience j of row b at ``[b, j*K:(j+1)*K]``; exactly 0 for missing
            experiences.
        latent_mask: (B, J*K) bool, False on the latents of missing experiences (drop them).
    """

    latents: Tensor
    latent_mask: Tensor


class ClipNorms(NamedTuple):
    """Total gradient norms (before clipping) of the composer's two parameter groups."""

    compressor: Tensor
    lora: Tensor


class LatentComposer(nn.Module):
    """Enc_psi (the shared backbone + ``"composer"`` LoRA) followed by Comp_chi (memory tokens or a Perceiver).

    Args:
        backbone: the shared ``PeftModel`` from :func:`lopd_lightning.adapters.prepare_backbone`; held
            without registration (see the module docstring), never copied.
        tokenizer: the backbone's tokenizer (its pad id pads; its special tokens are added as for any
            text, e.g. a BOS for Llama tokenizers, the EOS for ByT5).
        architecture: ``"memory_tokens"`` (:class:`MemoryTokens`, the default), ``"perceiver"``
            (:class:`PerceiverResampler`, the paper's) or ``"pointer"`` (:class:`TokenPointer`).
        num_latents: K per experience (the paper: 32).
        depth: Perceiver depth, weights shared (8; the perceiver only).
        num_heads: Perceiver heads; the backbone's ``num_attention_heads`` when None (head width from the
            backbone's ``head_dim`` when it has one; the perceiver only).
        ff_mult: Perceiver feed-forward expansion (4; the perceiver only).
        max_experience_tokens: each encoder input is cut to this many tokens, the task text first
            (:meth:`experience_ids`; the K memory tokens come on top).
        adapter_name: the encoder's LoRA adapter on the backbone.
        output_gain: initial gain of the compressor's output LayerNorm; ``"embedding"`` (the default) sets
            it to the RMS of the backbone's input embeddings, so that the initial latents have the scale of
            token embeddings (the paper does not say; 1.0 is PyTorch's default).

    Raises:
        ValueError: ``adapter_name`` is not an adapter of the backbone, or an unknown ``architecture``.
    """

    def __init__(
        self,
        backbone: PeftModel,
        tokenizer,
        *,
        architecture: str = "memory_tokens",
        num_latents: int = 32,
        depth: int = 8,
        num_heads: int | None = None,
        ff_mult: int = 4,
        max_experience_tokens: int = 512,
        adapter_name: str = COMPOSER,
        output_gain: float | str = "embedding",
    ) -> None:
        super().__init__()
        if adapter_name not in backbone.peft_config:
            raise ValueError(f"the backbone has no adapter {adapter_name!r}; use prepare_backbone first")
        if architecture not in ARCHITECTURES:
            raise ValueError(f"composer architecture {architecture!r} is not one of {', '.join(ARCHITECTURES)}")
        self._backbone = (backbone,)  # a tuple: nn.Module does not register it (no copy, no state_dict)
        self.tokenizer = tokenizer
        self.adapter_name = adapter_name
        self.architecture = architecture
        self.max_experience_tokens = max_experience_tokens
        config = backbone.get_base_model().config
        d = config.hidden_size
        embeddings = backbone.get_input_embeddings().weight
        if output_gain == "embedding":
            with torch.no_grad():
                gain = float(embeddings.float().pow(2).mean().sqrt())
        else:
            gain = float(output_gain)
        if architecture == "memory_tokens":
            self.compressor: nn.Module = MemoryTokens(d, num_latents=num_latents, init_embeddings=embeddings,
                                                      output_gain=gain)
            return
        if architecture == "pointer":
            self.compressor = TokenPointer(d, num_latents=num_latents, output_gain=gain)
            return
        heads = num_heads if num_heads is not None else config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) if num_heads is None else None
        if head_dim is None and d % heads:
            raise ValueError(f"hidden size {d} is not divisible by num_heads {heads}")
        self.compressor = PerceiverResampler(
            d, num_latents=num_latents, depth=depth, num_heads=heads, head_dim=head_dim, ff_mult=ff_mult,
            output_gain=gain,
        )

    @property
    def backbone(self) -> PeftModel:
        """The shared backbone (not a submodule)."""
        return self._backbone[0]

    @property
    def num_latents(self) -> int:
        """K, latents per experience."""
        return self.compressor.num_latents

    @property
    def hidden_size(self) -> int:
        """d, the latents' width (the backbone's hidden size)."""
        return self.compressor.d_model

    def compressor_parameters(self) -> list[nn.Parameter]:
        """chi: the compressor's parameters (what ``self.parameters()`` yields)."""
        return list(self.compressor.parameters())

    def lora_parameters(self) -> list[nn.Parameter]:
        """psi: the encoder LoRA's parameters on the shared backbone."""
        return composer_lora_parameters(self.backbone, self.adapter_name)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """phi = (psi, chi): compressor first, then LoRA."""
        return self.compressor_parameters() + self.lora_parameters()

    def lora_state_dict(self) -> dict[str, Tensor]:
        """The encoder LoRA's weights (peft naming, adapter name stripped), e.g. to save the composer alone."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.backbone, adapter_name=self.adapter_name)

    def experience_ids(self, task_text: str, trace: str) -> list[int]:
        """The token ids of :func:`experience_prompt` at most ``max_experience_tokens`` long. What does not fit is
        cut from the task text x first (the experience m_j is what the composer exists to read), then from
        the end of the trace. The text is data (:func:`~lopd_lightning.text.encode_data`): a trace's tool
        output that spells ``</s>`` or ``<|im_end|>`` stays text; the tokenizer's own BOS/EOS are added."""
        limit = self.max_experience_tokens

        def encode(text: str, *, add_special_tokens: bool = True) -> list[int]:
            return encode_data(self.tokenizer, text, add_special_tokens=add_special_tokens)

        ids = encode(experience_prompt(task_text, trace))
        if len(ids) <= limit:
            return ids
        without_task = encode(experience_prompt("", trace))
        room = limit - len(without_task)
        if room <= 0:
            return without_task[:limit]
        task_ids = encode(task_text, add_special_tokens=False)[:room]
        cut = self.tokenizer.decode(task_ids, skip_special_tokens=False)
        return encode(experience_prompt(cut, trace))[:limit]

    def tokenize_experiences(self, experiences: list[list[tuple[str, str]]]) -> ExperienceBatch:
        """Tokenise the encoder inputs of each row's retrieved experiences.

        Args:
            experiences: B lists (one per task) of (task_text x, trace m_j) pairs; rows may hold fewer
                experiences than the longest (J = the longest row's count; 0 allowed).

        Returns:
            :class:`ExperienceBatch` with (B, J, T) ids and mask (right padding, T = the longest encoder
            input after :meth:`experience_ids` cut it to ``max_experience_tokens``, at least 1) and the (B, J)
            experience mask.
        """
        batch = len(experiences)
        num_exp = max((len(row) for row in experiences), default=0)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        encoded: list[list[list[int]]] = []
        for row in experiences:
            encoded.append([self.experience_ids(task_text, trace) for task_text, trace in row])
        length = max((len(ids) for row in encoded for ids in row), default=1)
        length = max(length, 1)
        input_ids = torch.full((batch, num_exp, length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, num_exp, length), dtype=torch.long)
        experience_mask = torch.zeros((batch, num_exp), dtype=torch.bool)
        for b, row in enumerate(encoded):
            for j, ids in enumerate(row):
                input_ids[b, j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                attention_mask[b, j, : len(ids)] = 1
                experience_mask[b, j] = len(ids) > 0
        return ExperienceBatch(input_ids, attention_mask, experience_mask)

    def encode(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Enc_psi: the backbone under the composer LoRA over (N, T) right-padded ids and mask, its last hidden
        states: (N, T, d) at every position (``"perceiver"``, ``"pointer"``), or (N, K, d) at the K memory positions
        appended after each row's tokens (``"memory_tokens"``, :meth:`MemoryTokens.append_to`).

        Only psi (and the memory embeddings) can receive gradients from this pass
        (``use_adapter(..., grads="adapter")``): the base weights (frozen, or trainable for a full-parameter
        student) and the student's LoRA are constants. With activation checkpointing its decoder layers (train
        mode) are recomputed in the backward under this adapter and these flags
        (:class:`~lopd_lightning.checkpointing.ForwardStateRecompute`), whatever adapter is active then.
        """
        memory = self.architecture == "memory_tokens"
        with use_adapter(self.backbone, self.adapter_name, grads="adapter"):
            if memory:
                token_embeds = self.backbone.get_input_embeddings()(input_ids).detach()  # constants (full students too)
                embeds, mask, slots = self.compressor.append_to(token_embeds, attention_mask)
                inputs = {"inputs_embeds": embeds, "attention_mask": mask}
            else:
                inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
            out = self.backbone(
                **inputs,
                output_hidden_states=True,
                use_cache=False,
                logits_to_keep=1,  # the LM head is not needed: skip it on all but one position
            )
        hidden = out.hidden_states[-1]
        if memory:
            return hidden[slots].view(input_ids.shape[0], self.num_latents, hidden.shape[-1])
        return hidden

    def latents_of(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The K latents of each of N present experiences: (N, T) right-padded ids and mask -> (N, K, d)."""
        hidden = self.encode(input_ids, attention_mask)
        if self.architecture == "memory_tokens":
            return self.compressor(hidden)
        if self.architecture == "pointer":
            with use_adapter(self.backbone, self.adapter_name, grads="adapter"):  # as the memory tokens' lookup
                token_embeds = self.backbone.get_input_embeddings()(input_ids).detach()  # constants
            return self.compressor(hidden, attention_mask, token_embeds)
        return self.compressor(hidden, attention_mask)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, experience_mask: Tensor | None = None
    ) -> ComposerOutput:
        """c_phi for a batch of retrieved experiences.

        Args:
            input_ids: (B, J, T) long, from :meth:`tokenize_experiences` (right padding).
            attention_mask: (B, J, T) {0, 1}.
            experience_mask: (B, J) bool; when None, an experience is present where its mask has a 1.

        Returns:
            :class:`ComposerOutput`: latents (B, J*K, d) (zeros for missing experiences) and latent_mask
            (B, J*K) bool. The encoder runs on the present experiences only, flattened to (N, T'), with
            T' the longest present input.

        Raises:
            ValueError: the shapes do not agree.
        """
        if input_ids.dim() != 3 or input_ids.shape != attention_mask.shape:
            raise ValueError(
                f"expected (B, J, T) ids and mask, got {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
            )
        batch, num_exp, width = input_ids.shape
        if experience_mask is None:
            experience_mask = attention_mask.bool().any(dim=-1)
        if experience_mask.shape != (batch, num_exp):
            raise ValueError(f"experience_mask must be {(batch, num_exp)}, got {tuple(experience_mask.shape)}")
        anchor = next(self.compressor.parameters())
        device = anchor.device
        k, d = self.num_latents, self.hidden_size
        present_flat = experience_mask.to(device).bool().reshape(-1)  # [B*J]
        flat_ids = input_ids.reshape(batch * num_exp, width).to(device)
        flat_mask = attention_mask.reshape(batch * num_exp, width).to(device)
        present_flat = present_flat & flat_mask.bool().any(dim=-1)
        # [B*J, K, d]; torch.zeros, not anchor.new_zeros: under FSDP2 the anchor is a DTensor shard
        latents = torch.zeros(batch * num_exp, k, d, dtype=anchor.dtype, device=device)
        rows = present_flat.nonzero().squeeze(-1)
        if rows.numel() > 0:
            ids, mask = flat_ids[rows], flat_mask[rows]
            used = mask.bool().any(dim=0)  # drop the columns that are padding in every present row
            ids, mask = ids[:, used], mask[:, used]
            out = self.latents_of(ids, mask)  # [N, K, d]
            latents = latents.index_put((rows,), out.to(latents.dtype))
        latents = latents.view(batch, num_exp * k, d)
        latent_mask = present_flat.view(batch, num_exp).repeat_interleave(k, dim=1)
        return ComposerOutput(latents, latent_mask)

    def compose(self, experiences: list[list[tuple[str, str]]]) -> ComposerOutput:
        """c_phi of texts: the one texts -> latents (:meth:`tokenize_experiences`, then :meth:`forward`).

        Args:
            experiences: B lists (one per task) of (task_text x, trace m_j) pairs, as :meth:`tokenize_experiences`.

        Returns:
            :class:`ComposerOutput`: latents (B, J*K, d) float on the compressor's device and latent_mask
            (B, J*K) bool, J the longest row's count.
        """
        batch = self.tokenize_experiences(experiences)
        return self(batch.input_ids, batch.attention_mask, batch.experience_mask)


def composer_parameter_groups(
    composer: LatentComposer,
    *,
    lr: float,
    weight_decay: float = 0.0,
    compressor_clip: float = COMPRESSOR_CLIP,
    lora_clip: float = LORA_CLIP,
    compressor_lr: float | None = None,
) -> list[dict]:
    """Optimizer parameter groups for phi: ``[compressor (chi), LoRA (psi)]``, each with its clip norm.

    The extra keys ``name`` and ``clip_norm`` ride along in the groups (torch optimizers keep unknown
    keys), so a training loop can clip each group with its own norm (or call :func:`clip_composer_grads`).

    Args:
        lr: learning rate of both groups (AdamW 1e-5 in the paper).
        compressor_lr: a different rate for the compressor; ``lr`` when None.
        compressor_clip: the compressor's clip norm (30, docs/METHOD.md section 5).
        lora_clip: the LoRA's clip norm (3).

    Returns:
        Two dicts with keys params, lr, weight_decay, name ("compressor" / "composer_lora"), clip_norm.
    """
    return [
        {
            "params": composer.compressor_parameters(),
            "lr": lr if compressor_lr is None else compressor_lr,
            "weight_decay": weight_decay,
            "name": "compressor",
            "clip_norm": compressor_clip,
        },
        {
            "params": composer.lora_parameters(),
            "lr": lr,
            "weight_decay": weight_decay,
            "name": "composer_lora",
            "clip_norm": lora_clip,
        },
    ]


def clip_composer_grads(
    composer: LatentComposer, *, compressor_clip: float = COMPRESSOR_CLIP, lora_clip: float = LORA_CLIP
) -> ClipNorms:
    """Clip the compressor's and the LoRA's gradients, each group by its own total norm.

    Args:
        compressor_clip: max total L2 norm of chi's gradients (30).
        lora_clip: max total L2 norm of psi's gradients (3).

    Returns:
        :class:`ClipNorms` with each group's total norm *before* clipping (0 when no gradient).

    Source: docs/METHOD.md section 5 (separate clip norms, 30 compressor, 3 LoRA).
    """
    chi = [p for p in composer.compressor_parameters() if p.grad is not None]
    psi = [p for p in composer.lora_parameters() if p.grad is not None]
    zero = next(composer.compressor.parameters()).new_zeros(())
    chi_norm = torch.nn.utils.clip_grad_norm_(chi, compressor_clip) if chi else zero
    psi_norm = torch.nn.utils.clip_grad_norm_(psi, lora_clip) if psi else zero.clone()
    return ClipNorms(plain(chi_norm), plain(psi_norm))  # FSDP2: DTensor gradients give the whole norm, a DTensor



def composer_settings(composer: LatentComposer) -> dict:
    """What a saved composer must agree on with the one it is loaded into: architecture, K, d and the encoder
    LoRA's rank, alpha and target modules."""
    config = composer.backbone.peft_config[composer.adapter_name]
    targets = config.target_modules
    return {"architecture": composer.architecture, "num_latents": composer.num_latents,
            "hidden_size": composer.hidden_size, "lora_r": int(config.r), "lora_alpha": float(config.lora_alpha),
            "lora_target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else str(targets)}


#: ``warm_start_lr_schedule`` values: the pretraining learning rate's shape
#: (:func:`lopd_lightning.composer.pretrain.lr_factor`)
LR_SCHEDULES = ("constant", "cosine")


def check_composer_options(architecture: str, output_gain: float | str, path: str | None,
                           warm_start_weights: tuple[float, float], *, warm_start_lr: float,
                           warm_start_batch_size: int, warm_start_reconstruction_noise: float,
                           warm_start_lr_schedule: str) -> None:
    """Refuse composer options that are wrong whatever the model, naming the ``model.init_args`` key.

    Args:
        architecture, output_gain, path: ``composer_architecture``, ``composer_output_gain``, ``composer_path``.
        warm_start_weights: (``warm_start_task_weight``, ``warm_start_reconstruction_weight``).
        warm_start_lr, warm_start_batch_size: the pretraining's learning rate and batch.
        warm_start_reconstruction_noise, warm_start_lr_schedule: the reconstruction's noise and the learning
            rate's schedule (:mod:`lopd_lightning.composer.pretrain`).

    Raises:
        ValueError: an unknown architecture, a gain that is neither "embedding" nor a finite number > 0,
            weights that are negative, not finite or both 0, a learning rate that is not a finite number > 0,
            a batch size below 1, a noise outside [0, 1), or an unknown schedule.
        FileNotFoundError: ``path`` holds no ``composer.pt``.
    """
    from lopd_lightning.hints import choose_one_of

    if architecture not in ARCHITECTURES:
        raise ValueError(f"model.init_args.composer_architecture {architecture!r} is not a composer; "
                         f"{choose_one_of(architecture, ARCHITECTURES)}")
    if output_gain != "embedding" and not (_is_number(output_gain) and 0 < float(output_gain) < math.inf):
        raise ValueError(f"model.init_args.composer_output_gain must be \"embedding\" or a finite number > 0, got "
                         f"{output_gain!r}")
    if path and not (Path(path) / COMPOSER_FILE).is_file():
        raise FileNotFoundError(f"model.init_args.composer_path {path!r} holds no pretrained composer; "
                                f"pretrain one with `lopd pretrain-composer -c CONFIG`, or set it to null")
    weights = warm_start_weights
    if not all(_is_number(w) and 0 <= float(w) < math.inf for w in weights) or not any(weights):
        raise ValueError(f"model.init_args.warm_start_task_weight and warm_start_reconstruction_weight must be finite, "
                         f">= 0 and not both 0, got {weights[0]} and {weights[1]}")
    if not (_is_number(warm_start_lr) and 0 < float(warm_start_lr) < math.inf):
        raise ValueError(f"model.init_args.warm_start_lr must be a finite number > 0, got {warm_start_lr!r}")
    batch_size = warm_start_batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"model.init_args.warm_start_batch_size must be an int >= 1, got {warm_start_batch_size!r}")
    noise = warm_start_reconstruction_noise
    if not (_is_number(noise) and 0 <= float(noise) < 1):
        raise ValueError(f"model.init_args.warm_start_reconstruction_noise must be in [0, 1) (0: no noise), got {noise!r}")
    if warm_start_lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"model.init_args.warm_start_lr_schedule {warm_start_lr_schedule!r} is not a schedule; "
                         f"{choose_one_of(warm_start_lr_schedule, LR_SCHEDULES)}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def save_composer(composer: LatentComposer, folder: str | Path, *, info: dict | None = None) -> Path:
    """Write the composer (compressor chi and encoder LoRA psi) to ``folder/composer.pt``.

    Args:
        folder: created if missing.
        info: JSON-able facts stored beside the weights (steps, losses, the bank it was trained on).

    Returns:
        The file written.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "settings": composer_settings(composer),
        "compressor": {k: v.detach().cpu() for k, v in composer.compressor.state_dict().items()},
        "lora": {k: v.detach().cpu() for k, v in composer.lora_state_dict().items()},
        "info": dict(info or {}),
    }
    path = folder / COMPOSER_FILE
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    return path


def load_composer(composer: LatentComposer, folder: str | Path, *, key: str = "model.init_args.composer_path") -> dict:
    """Load a composer saved by :func:`save_composer` into ``composer`` (compressor and LoRA, in place).

    Args:
        key: the config key that named ``folder`` (for the error messages).

    Returns:
        The saved ``info``.

    Raises:
        FileNotFoundError: ``folder`` holds no ``composer.pt``.
        ValueError: the saved architecture, K or d differ from ``composer``'s.
    """
    from peft import set_peft_model_state_dict

    path = Path(folder) / COMPOSER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{key} {str(folder)!r} holds no {COMPOSER_FILE}; pretrain one with "
                                f"`lopd pretrain-composer -c CONFIG`, or set {key} to null")
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved, mine = state["settings"], composer_settings(composer)
    if saved != mine:
        diff = ", ".join(f"{name} {saved.get(name)!r} (this run: {mine[name]!r})"
                         for name in mine if saved.get(name) != mine[name])
        raise ValueError(f"{key} {str(folder)!r} holds a composer with {diff}; set the module's "
                         f"composer_architecture / num_latents / composer_lora to match, or pretrain a new one")
    own = set(composer.lora_state_dict())
    if set(state["lora"]) != own:
        raise ValueError(f"{key} {str(folder)!r}: its encoder LoRA has other weights than this backbone's composer "
                         f"adapter ({len(set(state['lora']) ^ own)} differ); pretrain it with this model")
    composer.compressor.load_state_dict(state["compressor"])
    set_peft_model_state_dict(composer.backbone, state["lora"], adapter_name=composer.adapter_name)
    return dict(state.get("info", {}))
