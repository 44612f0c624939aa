"""Take the trained student out of a checkpoint of any method (``lopd export``).

A Lightning checkpoint of LOPD, GRPO, SDPO, OPSD, Skill-SD or SFT holds the whole module: the shared
backbone with its adapters (the student's LoRA and, for LOPD, the composer's and its frozen anchor; an
EMA teacher's), the composer's compressor, optimiser states, the bank. :func:`export_checkpoint` rebuilds
the module from the checkpoint's hyperparameters, loads its weights and writes the student alone as a
Hugging Face folder, in one of two forms:

- **merged** (default): the base weights with the student LoRA merged in (or the full-parameter student),
  ``config.json``, ``generation_config.json``, the safetensors weights and the tokenizer: a plain
  causal-LM folder (:func:`lopd_lightning.adapters.merged_student`). Its dtype: float32 for a LoRA student
  trained in bfloat16 or float16 (the merge on a 16-bit grid would round away a small update; twice the size
  of the 16-bit base on disk), the student's own dtype otherwise. A LoRA on ``embed_tokens`` or ``lm_head``
  of a model with tied word embeddings (SmolLM2) is written untied: its own ``lm_head.weight`` and
  ``tie_word_embeddings: false`` in ``config.json``;
- **adapter** (``adapter=True``, LoRA students only): the student LoRA alone (``adapter_config.json`` and
  ``adapter_model.safetensors``, peft's format) and the tokenizer. ``adapter_config.json`` names the
  base model by its absolute folder (``base_model_name_or_path``); a base that has no folder of its own
  (``model: tiny``, or a base that was itself an exported adapter) is saved beside it in ``base/``.

No other adapter, no composer, no optimiser state goes into the folder. ``lopd_export.json`` records the
method, checkpoint, step, form and base model (``smollm2-135m-instruct`` for the packaged model, whose
converted folder lives in the local cache). Either form loads with
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` (the adapter form through transformers'
peft integration, unmerged) and is a valid ``model.init_args.model`` for ``lopd fit|validate|test``
(:func:`lopd_lightning.models.load_student` merges an adapter folder into its base, untied as above, in the
``dtype`` it is given: float32 keeps a small update exactly).
"""

from __future__ import annotations

import copy
import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from lopd_lightning.introspect import exception_chain, init_parameters
from lopd_lightning.models import (
    EXPORT_INFO,
    SMOLLM2_NAME,
    adapter_base,
    smollm2_folder,
)

__all__ = ["check_checkpoint_path", "check_out_folder", "export_checkpoint", "export_student", "load_module", "module_class"]

#: The shipped methods, in the order :func:`module_class` tries them for a checkpoint that does not name its class.
_METHODS = ("LOPDModule", "GRPOModule", "SDPOModule", "OPSDModule", "SkillSDModule", "SFTModule")


def _import(path: str) -> Any:
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name or "lopd_lightning.modules"), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot import the module class {path!r}: {error}") from error


def module_class(checkpoint: dict[str, Any], name: str | None = None) -> type:
    """The LightningModule class of a checkpoint.

    Args:
        checkpoint: the loaded checkpoint (``torch.load``).
        name: the class, by class path or by the short name of a shipped method (``"LOPDModule"``);
            default: the class path a ``lopd fit`` checkpoint stores (``_class_path`` in its
            hyperparameters), else the one shipped method whose constructor takes exactly the
            checkpoint's hyperparameters (a module built in Python).

    Raises:
        ValueError: the class cannot be told (pass ``name``) or is not an ``OnPolicyModule``.
    """
    from lopd_lightning.modules.base import OnPolicyModule

    hparams = checkpoint.get("hyper_parameters") or {}
    path = name or hparams.get("_class_path")
    if path:
        cls = _import(path)
    else:
        import lopd_lightning.modules as modules

        keys = {k for k in hparams if not k.startswith("_")}
        fits = [getattr(modules, n) for n in _METHODS if set(init_parameters(getattr(modules, n))) == keys]
        if len(fits) != 1:
            raise ValueError(
                "the checkpoint does not name its module class and its hyperparameters fit "
                f"{'none' if not fits else ' and '.join(c.__name__ for c in fits)} of the shipped methods; "
                "give the class (lopd export --class LOPDModule, or your subclass's class path)"
            )
        cls = fits[0]
    if not (isinstance(cls, type) and issubclass(cls, OnPolicyModule)):
        raise ValueError(f"{path!r} is not an lopd_lightning OnPolicyModule subclass")
    return cls


def check_checkpoint_path(checkpoint_path: str | Path) -> Path:
    """The checkpoint file ``lopd export`` was given, checked before anything is read.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a folder (the message names the ``.ckpt`` files in it, when it has some).
    """
    path = Path(checkpoint_path)
    if path.is_dir():
        patterns = ("*.ckpt", "checkpoints/*.ckpt", "*/checkpoints/*.ckpt", "*/*/checkpoints/*.ckpt")  # lopd fit's
        found = sorted({p for pattern in patterns for p in path.glob(pattern) if p.is_file()},
                       key=lambda p: (len(p.parts), p.name != "last.ckpt", str(p)))
        hint = f", e.g. {str(found[0])!r}" if found else ""
        raise ValueError(
            f"checkpoint {str(path)!r} is a folder; give the .ckpt file in it that lopd fit wrote{hint}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist (a .ckpt file that lopd fit wrote)")
    return path


def check_out_folder(folder: str | Path) -> Path:
    """The export folder (``--out``), checked before anything is loaded or written; returns it resolved.

    Raises:
        ValueError: ``folder`` (or a folder above it) is a file, or it is the current folder or one above it
            (an export replaces its folder).
        FileExistsError: ``folder`` holds files that no earlier export wrote.
    """
    given = str(folder)
    resolved = Path(folder).resolve()
    if resolved.exists() and not resolved.is_dir():
        raise ValueError(f"--out {given!r} is a file, not a folder; give a new folder (lopd export CKPT --out FOLDER)")
    above = next((p for p in resolved.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ValueError(f"--out {given!r}: {str(above)!r} is a file, not a folder; give a new folder (--out)")
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise ValueError(
            f"--out {given!r} is the current folder or holds it, and an export replaces its folder; "
            f"give a new folder (e.g. --out student)"
        )
    if resolved.is_dir() and any(resolved.iterdir()) and not (resolved / EXPORT_INFO).exists():
        raise FileExistsError(f"--out {given!r} is not empty and holds no earlier export; give a new folder (--out)")
    return resolved


def _check_base_model(name: Any, *, given: bool) -> None:
    """Raise FileNotFoundError when the base model the module is rebuilt on is a folder that does not exist."""
    if not isinstance(name, str) or name in ("tiny", SMOLLM2_NAME) or Path(name).exists():
        return
    if given:
        raise FileNotFoundError(
            f"--model {name!r} does not exist; give the base model's folder, {SMOLLM2_NAME!r} (packaged) or 'tiny'"
        )
    raise FileNotFoundError(
        f"the checkpoint's base model {name!r} does not exist (moved or deleted?); give its folder with "
        f"lopd export CKPT --out FOLDER --model BASE_FOLDER"
    )


def load_module(
    checkpoint_path: str | Path, *, module_class_name: str | None = None, model: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """Rebuild the module of a checkpoint (CPU) and load its weights: ``(module, checkpoint)``.

    The checkpoint is read once (with ``torch.load(weights_only=False)``: load only checkpoints you
    trust). The module's ``bank_path`` is not read (the bank comes from the checkpoint).

    Args:
        module_class_name: see :func:`module_class`.
        model: the base model to build on instead of the checkpoint's ``model`` (it moved).

    Raises:
        FileNotFoundError: no such checkpoint; the base model (the checkpoint's, or ``model``) does not exist
            (the message names ``lopd export --model``).
        ValueError: a folder or a file that is not a Lightning checkpoint; see :func:`module_class`; a
            checkpoint whose hyperparameters name an argument the class does not take (another version of
            lopd_lightning wrote it).
    """
    path = check_checkpoint_path(checkpoint_path)
    if model is not None:
        _check_base_model(model, given=True)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # pickle / zip / EOF errors: not a checkpoint (or a truncated one)
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        raise ValueError(
            f"checkpoint {str(path)!r} is not a Lightning checkpoint (torch.load: {reason[:200]}); give the .ckpt "
            f"file that lopd fit wrote (in its checkpoints/ folder)"
        ) from error
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(
            f"checkpoint {str(path)!r} is not a Lightning checkpoint (no state_dict); give the .ckpt file that "
            f"lopd fit wrote (in its checkpoints/ folder)"
        )
    cls = module_class(checkpoint, module_class_name)
    hparams = checkpoint.get("hyper_parameters") or {}
    init = {k: v for k, v in hparams.items() if not k.startswith("_")}
    params = set(init_parameters(cls))
    unknown = sorted(set(init) - params)
    if unknown:
        raise ValueError(
            f"checkpoint {str(path)!r} was written by another version of lopd_lightning: its hyperparameters name "
            f"{', '.join(unknown)}, which {cls.__name__} does not take; retrain with this version, or export it "
            f"with the lopd_lightning commit that wrote it"
        )
    if "bank_path" in params:
        init["bank_path"] = None
    if "composer_path" in params:  # the checkpoint holds the composer it trained
        init["composer_path"] = None
    if model is not None:
        init["model"] = model
    else:
        _check_base_model(init.get("model"), given=False)
    try:
        if hparams.get("_instantiator") and module_class_name is None:
            from lightning.pytorch.cli import instantiate_module

            module = instantiate_module(cls, {"_class_path": hparams["_class_path"], **init})
        else:
            module = cls(**init)
    except Exception as error:
        # the module's loader names the config key of `lopd fit`; here the base model is the checkpoint's,
        # or --model
        named = next((e for e in exception_chain(error) if "model.init_args.model" in str(e)), None)
        if named is None:
            raise
        where = "lopd export --model" if model is not None else (
            "the checkpoint's base model; give another with lopd export --model BASE_FOLDER")
        message = " ".join(str(named).replace("model.init_args.model", where).split())
        raise (FileNotFoundError if isinstance(named, FileNotFoundError) else ValueError)(message) from error
    module.on_load_checkpoint(checkpoint)
    module.load_state_dict(checkpoint["state_dict"], strict=True)
    module.eval()
    return module, checkpoint


def _base_weights(backbone: torch.nn.Module) -> torch.nn.Module:
    """A copy of the backbone's base weights without any adapter."""
    from peft import PeftModel

    clone = copy.deepcopy(backbone)
    return clone.unload() if isinstance(clone, PeftModel) else clone


def export_student(module: Any, folder: str | Path, *, adapter: bool = False, info: dict[str, Any] | None = None) -> Path:
    """Write the student of ``module`` (any ``OnPolicyModule``) as a Hugging Face folder; returns it.

    Args:
        adapter: False: the LoRA merged into the weights (a plain model folder). True: the student LoRA
            alone, beside its base model (see the module docstring); needs a LoRA student.
        info: extra entries of ``lopd_export.json``.

    Raises:
        ValueError: ``adapter`` for a full-parameter student; ``folder`` is a file, the current folder or
            cannot be created (see :func:`check_out_folder`).
        FileExistsError: ``folder`` holds files that no earlier export wrote.
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from lopd_lightning.adapters import STUDENT, is_lora_student, merged_student

    backbone = module.backbone
    if adapter and not is_lora_student(backbone):
        raise ValueError(
            "--adapter needs a LoRA student, and this one was trained full-parameter (model.init_args.lora: null); "
            "export it merged (without --adapter)"
        )
    given, folder = Path(folder), check_out_folder(folder)
    tmp = folder.with_name(folder.name + ".exporting")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except OSError as error:
        raise ValueError(f"--out {str(folder)!r}: cannot create {str(tmp)!r} ({error.strerror or error}); "
                         f"give a folder you can write (--out)") from error
    base_name = str(getattr(module, "model_name", module.hparams.get("model")))
    record: dict[str, Any] = {"form": "adapter" if adapter else "merged", "base_model": base_name, **(info or {})}
    if not adapter:
        merged_student(backbone).save_pretrained(tmp)
    else:
        if base_name == SMOLLM2_NAME:
            base = str(smollm2_folder().resolve())
        elif base_name != "tiny" and Path(base_name).is_dir() and adapter_base(base_name) is None:
            base = str(Path(base_name).resolve())
        else:  # no folder of its own: the base weights go beside the adapter
            _base_weights(backbone).save_pretrained(tmp / "base")
            module.tokenizer.save_pretrained(tmp / "base")
            base = str((folder / "base").resolve())
            record["base_saved_in"] = "base"
        config = copy.deepcopy(backbone.peft_config[STUDENT])
        config.base_model_name_or_path = base
        config.inference_mode = True
        config.save_pretrained(tmp)
        # the LoRA weights alone: peft would add the (frozen, unchanged) base embeddings of a LoRA on them
        state = get_peft_model_state_dict(backbone, adapter_name=STUDENT, save_embedding_layers=False)
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, tmp / "adapter_model.safetensors",
                  metadata={"format": "pt"})
        record["base_model_name_or_path"] = base
    module.tokenizer.save_pretrained(tmp)
    (tmp / EXPORT_INFO).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    if folder.exists():
        shutil.rmtree(folder)  # an earlier export (checked above)
    tmp.replace(folder)
    return given


def export_checkpoint(
    checkpoint_path: str | Path,
    folder: str | Path,
    *,
    adapter: bool = False,
    module_class: str | None = None,
    model: str | None = None,
) -> Path:
    """``lopd export``: :func:`load_module` then :func:`export_student`; returns the folder.

    The checkpoint path and ``folder`` are checked before anything is read (a typo in ``--out`` does not
    cost a model load).
    """
    check_checkpoint_path(checkpoint_path)
    check_out_folder(folder)
    module, checkpoint = load_module(checkpoint_path, module_class_name=module_class, model=model)
    info = {
        "method": f"{type(module).__module__}.{type(module).__qualname__}",
        "checkpoint": str(Path(checkpoint_path).resolve()),
        "global_step": int(checkpoint.get("global_step", 0)),
    }
    return export_student(module, folder, adapter=adapter, info=info)
