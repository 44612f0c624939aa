"""Memory: the experience bank (FAISS, exact cosine), text embedders and the latent composer.

docs/METHOD.md sections 2 and 3. ``bank`` stores (task, trace, reward) records and retrieves the top-J of
other tasks (its records are ``experience``'s, its FAISS indexes ``faiss_index``'s, its folder on disk
``persistence``'s); ``embed`` turns texts into unit vectors; ``composer`` (LoRA encoder + Perceiver
resampler) turns retrieved experiences into latent tokens.
"""

from lopd_lightning.memory.bank import Experience, ExperienceBank, SearchResult
from lopd_lightning.memory.embed import (
    BackboneEmbedder,
    EmbedderError,
    HashingEmbedder,
    MiniLMEmbedder,
    TextEmbedder,
    embed_texts,
    get_embedder,
    minilm_folder,
)

__all__ = [
    "BackboneEmbedder",
    "EmbedderError",
    "Experience",
    "ExperienceBank",
    "HashingEmbedder",
    "MiniLMEmbedder",
    "SearchResult",
    "TextEmbedder",
    "embed_texts",
    "get_embedder",
    "minilm_folder",
]
