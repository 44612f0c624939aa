"""The experience bank a training module builds from its config keys (``bank_path``, ``embedder``, ...).

LOPD's bank (its teacher's latents) and OPSD's with ``privileged_context: retrieved`` (its teacher's text)
are built and read here, so that the two read the same bank the same way: :func:`check_bank_options` refuses
the options before the weights load, :func:`build_bank` loads the bank (or starts an empty one) once the
model is there (``embedder: backbone`` needs it), and :func:`retrieve_from` is their retrieval (and
benchmarks/task_calibration.py's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lopd_lightning.hints import choose_one_of
from lopd_lightning.memory.bank import ExperienceBank
from lopd_lightning.memory.embed import get_embedder
from lopd_lightning.memory.experience import SearchResult
from lopd_lightning.memory.persistence import check_bank, is_empty_folder

__all__ = ["EMBEDDERS", "build_bank", "check_bank_options", "check_embedder", "retrieve_from"]

#: the embedders a config may name (:func:`lopd_lightning.memory.embed.get_embedder`).
EMBEDDERS = ("minilm", "backbone", "hashing")


def check_embedder(embedder: str) -> None:
    """Refuse an ``embedder`` that is not one of :data:`EMBEDDERS`, in one line with the closest name.

    Raises:
        ValueError: naming ``model.init_args.embedder``.
    """
    if str(embedder).lower().strip() not in EMBEDDERS:
        raise ValueError(f"model.init_args.embedder {embedder!r} is not an embedder; "
                         f"{choose_one_of(str(embedder).lower(), EMBEDDERS)}")


def check_bank_options(embedder: str, bank_path: str | None, num_experiences: int, *, capacity: int | None = None) -> None:
    """The bank's checks that need no model: a known ``embedder``, a ``bank_capacity`` that can hold J
    (``num_experiences``) experiences, and a ``bank_path`` (when given) that holds a bank whose files are whole
    (:func:`~lopd_lightning.memory.persistence.check_bank`). A bank smaller than J is refused when ``fit`` starts
    (:func:`~lopd_lightning.memory.persistence.check_bank_fills`, which knows whether a MemoryRefresh fills it;
    ``lopd fit`` says it before the weights load).

    Raises:
        ValueError: :func:`check_embedder`; ``capacity`` below ``num_experiences``; a damaged bank
            (:class:`~lopd_lightning.memory.persistence.BankFileError`).
        FileNotFoundError: ``bank_path`` holds no bank.
    """
    check_embedder(embedder)
    if capacity is not None and 0 < int(capacity) < num_experiences:
        raise ValueError(f"model.init_args.bank_capacity={capacity} is smaller than num_experiences J={num_experiences}: "
                         f"the bank could never hold the J experiences a task retrieves; raise "
                         f"model.init_args.bank_capacity to >= {num_experiences} (or null) or lower "
                         f"model.init_args.num_experiences")
    if bank_path:  # missing or damaged files fail before the weights load
        check_bank(bank_path, capacity=capacity)


def build_bank(
    bank_path: str | None, embedder: str, *, num_experiences: int, capacity: int | None = None,
    eviction: str = "lowest_reward", allow_self_retrieval: bool = False, model: Any = None, tokenizer: Any = None,
) -> ExperienceBank:
    """The experience bank: loaded from ``bank_path``, or empty.

    Args:
        bank_path: a folder written by ``lopd build-memory`` (None, or an existing empty folder: an empty bank).
        embedder: a name of :data:`EMBEDDERS`; ``"backbone"`` embeds with ``model`` and ``tokenizer``.
        num_experiences: J, the experiences retrieved per task; not checked here: a bank smaller than J is refused,
            or filled by a MemoryRefresh, when ``fit`` starts (:func:`~lopd_lightning.memory.persistence.check_bank_fills`).
        capacity, eviction, allow_self_retrieval: the :class:`~lopd_lightning.memory.bank.ExperienceBank` options.

    Raises:
        FileNotFoundError, BankFileError: :func:`~lopd_lightning.memory.persistence.check_bank`.
    """
    embed = get_embedder(embedder, model=model, tokenizer=tokenizer) if embedder == "backbone" else get_embedder(embedder)
    options = dict(capacity=capacity, eviction=eviction, allow_self_retrieval=allow_self_retrieval)
    if not bank_path or is_empty_folder(bank_path):
        return ExperienceBank(embed, **options)
    return ExperienceBank.load(bank_path, embed, **options)


def retrieve_from(bank: ExperienceBank, examples: Sequence[Any], k: int) -> SearchResult:
    """The top-``k`` experiences of ``bank`` per example: the bank's search with each example's text as the query
    under its id, so that an example retrieves no record of its own task unless the bank allows self-retrieval
    (``allow_self_retrieval``; the embedder is the bank's too).

    Args:
        bank: the experience bank (:func:`build_bank`'s).
        examples: B examples (:class:`~lopd_lightning.tasks.Example`: ``id`` and ``text`` are read).
        k: J, the experiences per example (>= 0; 0 retrieves nothing).

    Returns:
        :class:`~lopd_lightning.memory.experience.SearchResult`: (B, k) ``indices`` / ``ids`` int64 and ``scores``
        float32, B lists of ``experiences`` best first (fewer than k when the bank holds fewer of other tasks),
        (B,) ``num_found``. With ``k = 0`` or a bank of fewer than ``k`` records (empty, or still being filled by
        LOPD's MemoryRefresh) nothing is searched (no embedding, no warning about missing results): every row is
        empty (:meth:`SearchResult.empty`); retrieval starts once the bank holds ``k``.

    Raises:
        ValueError: ``k < 0``. EmbedderError: the embedder failed on the texts.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if k == 0 or len(bank) < k:
        return SearchResult.empty(len(examples), k)
    return bank.search([e.id for e in examples], [e.text for e in examples], k)
