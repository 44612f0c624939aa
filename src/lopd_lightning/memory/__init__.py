"""Memory: the experience bank (FAISS, exact cosine) and text embedders.

docs/METHOD.md section 2. ``bank`` stores (task, trace, reward) records and retrieves the top-J of
other tasks (its records are ``experience``'s, its FAISS indexes ``faiss_index``'s, its folder on disk
``persistence``'s, the bank a module builds from its config keys and reads ``module_bank``'s); ``embed`` turns texts
into unit vectors. The composer that turns retrieved experiences into latent tokens is
:mod:`lopd_lightning.composer`.
"""

from lopd_lightning.memory.bank import ExperienceBank
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
from lopd_lightning.memory.experience import Experience, SearchResult
from lopd_lightning.memory.module_bank import build_bank, retrieve_from

__all__ = [
    "BackboneEmbedder",
    "EmbedderError",
    "Experience",
    "ExperienceBank",
    "HashingEmbedder",
    "MiniLMEmbedder",
    "SearchResult",
    "TextEmbedder",
    "build_bank",
    "embed_texts",
    "get_embedder",
    "minilm_folder",
    "retrieve_from",
]
