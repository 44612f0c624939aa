"""``lopd export``: the student of any method's checkpoint as a Hugging Face folder (LoRA merged, or the
student LoRA beside its base) that transformers loads with the student's logits, without the composer,
its anchor or any other adapter, and that ``lopd validate`` accepts as its model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lopd_lightning.adapters import STUDENT, adapter_parameters, is_lora_student, use_adapter
from lopd_lightning.cli import main
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.export import export_checkpoint, export_student, load_module, module_class
from lopd_lightning.models import load_student, tiny_model
from lopd_lightning.modules import GRPOModule, LOPDModule, SFTModule
from helpers import TINY_BANK, ParityToy

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
IDS = torch.tensor([[60, 105, 110, 32, 116, 104, 101, 32, 119, 111, 114, 100, 1]])


def make(method: str, lora=LORA, dtype: str = "float32"):
    if method == "lopd":
        return LOPDModule("tiny", lora=lora, num_latents=2, num_experiences=1, composer_depth=1, embedder="hashing",
                          max_new_tokens=4, distill_top_k=4, max_experience_tokens=32, learning_rate=1e-2,
                          bank_path=str(TINY_BANK))  # LOPD refuses to fit on an empty bank
    if method == "grpo":
        return GRPOModule("tiny", lora=lora, group_size=2, max_new_tokens=4, learning_rate=1e-2, dtype=dtype)
    return SFTModule("tiny", lora=lora, learning_rate=1e-2)


def perturb(module) -> None:
    """Give every adapter (the student's LoRA and, for LOPD, the composer's) non-zero weights, so that the
    student differs from the base and an export that merged another adapter would differ from the student."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in getattr(module.backbone, "peft_config", {}):
            for p in adapter_parameters(module.backbone, name):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


def train(module, root: Path) -> Path:
    """Two steps with a checkpoint after each; returns the last checkpoint."""
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_last=True)
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", devices=1, logger=False, limit_val_batches=0, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root), callbacks=[checkpoints],
    )
    trainer.fit(module, OnPolicyDataModule(ParityToy(), examples_per_step=1, val_limit=1))
    assert trainer.global_step == 2
    return root / "ckpt" / "last.ckpt"


def student_logits(module) -> torch.Tensor:
    with torch.no_grad(), module.student_context():
        return module.backbone(input_ids=IDS).logits


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("method", ["lopd", "grpo"])
def test_exported_student_has_the_modules_student_logits(tmp_path, method):
    module = make(method)
    perturb(module)
    ckpt = train(module, tmp_path)
    expected = student_logits(module.eval())
    base = logits_of(tiny_model(seed=0))
    assert (expected - base).abs().max() > 1e-2  # the student is not the base: the export must carry it

    merged = export_checkpoint(ckpt, tmp_path / "merged")
    weights = load_file(merged / "model.safetensors")
    assert not [k for k in weights if "lora" in k or "composer" in k or "anchor" in k]
    hf = AutoModelForCausalLM.from_pretrained(merged, local_files_only=True)
    torch.testing.assert_close(logits_of(hf), expected, atol=1e-5, rtol=1e-5)
    info = json.loads((merged / "lopd_export.json").read_text())
    assert info["form"] == "merged" and info["global_step"] == 2 and info["method"].endswith(type(module).__name__)

    adapter = export_checkpoint(ckpt, tmp_path / "adapter", adapter=True)
    assert not (adapter / "config.json").exists()
    lora = load_file(adapter / "adapter_model.safetensors")
    assert len(lora) == len(adapter_parameters(module.backbone, "student"))  # the student's LoRA, nothing else
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((adapter / "base").resolve())  # tiny has no folder of its own
    hf = AutoModelForCausalLM.from_pretrained(adapter, local_files_only=True)  # transformers' peft integration
    torch.testing.assert_close(logits_of(hf), expected, atol=1e-5, rtol=1e-5)

    for folder in (merged, adapter):  # what lopd fit/validate load as model.init_args.model
        model, tokenizer = load_student(str(folder))
        assert not hasattr(model, "peft_config")
        torch.testing.assert_close(logits_of(model), expected, atol=1e-5, rtol=1e-5)
        assert tokenizer.chat_template == module.tokenizer.chat_template


def test_a_full_parameter_student_exports_merged_and_refuses_adapter(tmp_path, capsys):
    module = make("sft", lora=None)
    ckpt = train(module, tmp_path)
    assert not is_lora_student(module.backbone)
    folder = export_checkpoint(ckpt, tmp_path / "student")
    torch.testing.assert_close(logits_of(AutoModelForCausalLM.from_pretrained(folder)), student_logits(module.eval()),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(ckpt), "--out", str(tmp_path / "adapter"), "--adapter"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --adapter needs a LoRA student") and "Traceback" not in "".join(err)


@pytest.mark.parametrize("targets", [["embed_tokens"], ["lm_head"], ["q_proj", "embed_tokens", "lm_head"]])
def test_a_lora_on_tied_embeddings_or_head_exports_untied_with_the_students_logits(tmp_path, targets):
    """The tiny model ties its head to its embeddings (as SmolLM2). The merge wrote both LoRA updates into the one
    shared matrix under a config that still said tied: the export's logits were 3 to 24 times the LoRA's own
    effect away from the student's, and load_student of the adapter form the same. Now the merged form has its
    own lm_head.weight and tie_word_embeddings: false, and the adapter form loads untied."""
    module = make("grpo", lora={**LORA, "target_modules": targets})
    inner = module.backbone.base_model.model
    assert inner.config.tie_word_embeddings
    perturb(module)
    expected = student_logits(module.eval())
    effect = (expected - logits_of(tiny_model(seed=0))).norm()

    merged = export_student(module, tmp_path / "merged")
    hf = AutoModelForCausalLM.from_pretrained(merged, local_files_only=True)
    assert float((logits_of(hf) - expected).norm() / effect) < 1e-5
    assert json.loads((merged / "config.json").read_text())["tie_word_embeddings"] is False
    weights = load_file(merged / "model.safetensors")
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])

    adapter = export_student(module, tmp_path / "adapter", adapter=True)
    for model in (AutoModelForCausalLM.from_pretrained(adapter, local_files_only=True),  # unmerged, as trained
                  load_student(str(adapter))[0], load_student(str(merged))[0]):
        assert float((logits_of(model) - expected).norm() / effect) < 1e-5
    assert inner.config.tie_word_embeddings  # the module's own model is left as it was: tied, shared
    assert inner.get_input_embeddings().weight is inner.get_output_embeddings().weight
    torch.testing.assert_close(student_logits(module), expected, rtol=0, atol=0)


def test_a_bfloat16_lora_students_export_is_float32_and_keeps_an_update_below_bfloat16s_resolution(tmp_path):
    """A bfloat16 LoRA student with a small update (||scale B A|| / ||W|| about 1.5e-3, below bfloat16's relative
    step): the merge rounded it onto the bfloat16 grid and the exported logits missed most of the LoRA's effect.
    The merged export is float32 now; the adapter form loaded in float32 merges exactly."""
    module = make("grpo", lora={**LORA, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]}, dtype="bfloat16")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in module.backbone.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 1e-4)
    exact = copy.deepcopy(module.backbone).float().eval()  # the student's own weights, float32 arithmetic
    with torch.no_grad():
        with use_adapter(exact, STUDENT):
            student = logits_of(exact)
        with use_adapter(exact, None):
            base = logits_of(exact)

    def error(model) -> float:
        return float(((logits_of(model.float()) - student).norm() / (student - base).norm()).item())

    merged = export_student(module, tmp_path / "merged")
    assert error(AutoModelForCausalLM.from_pretrained(merged, local_files_only=True)) < 0.1
    assert {t.dtype for t in load_file(merged / "model.safetensors").values()} == {torch.float32}
    assert json.loads((merged / "config.json").read_text())["dtype"] == "float32"
    adapter = export_student(module, tmp_path / "adapter", adapter=True)
    assert error(load_student(str(adapter), dtype="float32")[0]) < 0.1
    assert next(module.backbone.parameters()).dtype == torch.bfloat16  # the module's own model is left as it was


def test_the_module_class_comes_from_the_checkpoint_or_is_asked_for():
    lopd_keys = {k: None for k in ("model", "num_latents")}
    with pytest.raises(ValueError, match="lopd export --class"):
        module_class({"hyper_parameters": lopd_keys})
    assert module_class({"hyper_parameters": {"_class_path": "lopd_lightning.modules.GRPOModule"}}) is GRPOModule
    assert module_class({"hyper_parameters": {}}, "LOPDModule") is LOPDModule
    with pytest.raises(ValueError, match="not an lopd_lightning OnPolicyModule"):
        module_class({"hyper_parameters": {}}, "lopd_lightning.data.OnPolicyDataModule")


def test_a_checkpoint_whose_hyperparameters_the_class_does_not_take_is_refused_in_one_line(tmp_path):
    """Another version of lopd_lightning wrote it (here: group_size stored as rollouts_per_example): one line
    naming the argument and what to do, before any weight loads."""
    module = make("grpo")
    ckpt = train(module, tmp_path)
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    checkpoint["hyper_parameters"]["rollouts_per_example"] = checkpoint["hyper_parameters"].pop("group_size")
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    with pytest.raises(ValueError) as caught:
        load_module(old, module_class_name="GRPOModule")
    message = str(caught.value)
    assert "\n" not in message and message == (
        f"checkpoint {str(old)!r} was written by another version of lopd_lightning: its hyperparameters name "
        "rollouts_per_example, which GRPOModule does not take; retrain with this version, or export it with the "
        "lopd_lightning commit that wrote it")


def test_export_refuses_to_overwrite_a_folder_it_did_not_write(tmp_path):
    module = make("grpo")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not empty"):
        export_student(module, tmp_path / "mine")
    export_student(module, tmp_path / "out", adapter=True)
    export_student(module, tmp_path / "out")  # over an earlier export: replaced, no adapter file left behind
    assert not (tmp_path / "out" / "adapter_config.json").exists() and (tmp_path / "out" / "config.json").exists()


def test_lopd_fit_then_export_then_validate_on_the_exported_student(tmp_path, capsys):
    """The command-line round trip: a `lopd fit` checkpoint (its class path stored by LightningCLI) is exported,
    and `lopd validate` runs with the folder as its model."""
    common = ["-c", str(TINY_YAML), "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}",
              "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
              "--data.init_args.val_limit=1"]
    assert main(["fit", *common, "--trainer.max_steps=1", "--trainer.val_check_interval=1"]) == 0
    [ckpt] = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert main(["export", str(ckpt), "--out", str(tmp_path / "student")]) == 0
    assert f"-> {tmp_path / 'student'}" in capsys.readouterr().out
    module, _ = load_module(ckpt)
    assert type(module) is LOPDModule
    torch.testing.assert_close(logits_of(AutoModelForCausalLM.from_pretrained(tmp_path / "student")),
                               student_logits(module), atol=1e-5, rtol=1e-5)
    assert main(["validate", *common, f"--model.init_args.model={tmp_path / 'student'}"]) == 0


# ----------------------------------------------------------------------- bad input: one line, nothing loaded
def run_export(args: list[str], capsys) -> tuple[int, str]:
    """``lopd export <args>`` in process: (exit status, stderr)."""
    try:
        code = main(["export", *args])
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


def assert_one_line_error(err: str, expected: str) -> None:
    assert err.strip().splitlines() == [f"error: {expected}"], err


@pytest.fixture
def nothing_loads(monkeypatch):
    """Reading a checkpoint or building a module fails the test: the check must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint or a model was loaded")

    monkeypatch.setattr("lopd_lightning.export.torch.load", refuse)
    monkeypatch.setattr("lopd_lightning.modules.base.load_student", refuse)


def test_a_file_that_is_not_a_checkpoint_is_one_line(tmp_path, capsys):
    """torch.load's 26-line UnpicklingError traceback before."""
    code, err = run_export([str(TINY_YAML), "--out", str(tmp_path / "x")], capsys)
    assert code == 1
    assert_one_line_error(err, f"checkpoint {str(TINY_YAML)!r} is not a Lightning checkpoint (torch.load: "
                               f"UnpicklingError: invalid load key, '#'.); give the .ckpt file that lopd fit wrote "
                               f"(in its checkpoints/ folder)")
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    code, err = run_export([str(empty), "--out", str(tmp_path / "x")], capsys)
    assert code == 1 and err.startswith(f"error: checkpoint {str(empty)!r} is not a Lightning checkpoint (torch.load: ")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    torch.save({"weights": torch.zeros(1)}, tmp_path / "plain.pt")
    code, err = run_export([str(tmp_path / "plain.pt"), "--out", str(tmp_path / "x")], capsys)
    assert_one_line_error(err, f"checkpoint {str(tmp_path / 'plain.pt')!r} is not a Lightning checkpoint (no "
                               f"state_dict); give the .ckpt file that lopd fit wrote (in its checkpoints/ folder)")


def test_a_folder_given_as_the_checkpoint_is_one_line_naming_its_checkpoints(tmp_path, capsys, nothing_loads):
    """It said "does not exist" for a folder that exists."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    code, err = run_export([str(run), "--out", str(tmp_path / "x")], capsys)
    assert code == 1
    assert_one_line_error(err, f"checkpoint {str(run)!r} is a folder; give the .ckpt file in it that lopd fit wrote")
    (run / "checkpoints" / "step=2.ckpt").write_bytes(b"x")
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    code, err = run_export([str(run), "--out", str(tmp_path / "x")], capsys)
    assert_one_line_error(err, f"checkpoint {str(run)!r} is a folder; give the .ckpt file in it that lopd fit wrote, "
                               f"e.g. {str(run / 'checkpoints' / 'last.ckpt')!r}")


def test_a_bad_out_is_one_line_before_anything_loads(tmp_path, capsys, monkeypatch, nothing_loads):
    """--out an existing file (NotADirectoryError), --out . (ValueError: empty name), a non-empty folder (refused
    only after the model had loaded) are refused before the checkpoint is read."""
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"not read")
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, err = run_export([str(ckpt), "--out", str(afile)], capsys)
    assert code == 1
    assert_one_line_error(err, f"--out {str(afile)!r} is a file, not a folder; give a new folder "
                               f"(lopd export CKPT --out FOLDER)")
    code, err = run_export([str(ckpt), "--out", str(afile / "student")], capsys)
    assert_one_line_error(err, f"--out {str(afile / 'student')!r}: {str(afile)!r} is a file, not a folder; "
                               f"give a new folder (--out)")
    monkeypatch.chdir(tmp_path)
    code, err = run_export([str(ckpt), "--out", "."], capsys)
    assert code == 1
    assert_one_line_error(err, "--out '.' is the current folder or holds it, and an export replaces its folder; "
                               "give a new folder (e.g. --out student)")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    code, err = run_export([str(ckpt), "--out", "mine"], capsys)
    assert code == 1
    assert_one_line_error(err, "--out 'mine' is not empty and holds no earlier export; give a new folder (--out)")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "last.ckpt", "mine"]  # nothing written


def fake_checkpoint(path: Path, model: str) -> Path:
    """A checkpoint of an SFT module built on ``model``, as `lopd fit` stores its class path (no weights)."""
    hparams = {"_class_path": "lopd_lightning.modules.SFTModule", "model": model, "lora": LORA}
    torch.save({"state_dict": {}, "hyper_parameters": hparams, "global_step": 1}, path)
    return path


def test_a_base_model_that_moved_names_lopd_export_model(tmp_path, capsys, monkeypatch):
    """It named model.init_args.model, a key of lopd fit's config that export has no way to set."""
    gone = tmp_path / "models" / "base"
    ckpt = fake_checkpoint(tmp_path / "last.ckpt", str(gone))
    monkeypatch.setattr("lopd_lightning.modules.base.load_student",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("a model was loaded")))
    code, err = run_export([str(ckpt), "--out", str(tmp_path / "x")], capsys)
    assert code == 1
    assert_one_line_error(err, f"the checkpoint's base model {str(gone)!r} does not exist (moved or deleted?); give "
                               f"its folder with lopd export CKPT --out FOLDER --model BASE_FOLDER")
    code, err = run_export([str(ckpt), "--out", str(tmp_path / "x"), "--model", str(tmp_path / "nowhere")], capsys)
    assert_one_line_error(err, f"--model {str(tmp_path / 'nowhere')!r} does not exist; give the base model's folder, "
                               f"'smollm2-135m-instruct' (packaged) or 'tiny'")


def test_an_adapter_base_model_that_moved_names_lopd_export_model(tmp_path, capsys):
    """A base that exists but is an exported adapter whose own base moved: the loader's message, with the
    export's option in place of model.init_args.model."""
    from lopd_lightning.models import tiny_tokenizer

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    tiny_tokenizer().save_pretrained(adapter)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    ckpt = fake_checkpoint(tmp_path / "last.ckpt", str(adapter))
    code, err = run_export([str(ckpt), "--out", str(tmp_path / "x")], capsys)
    assert code == 1
    assert_one_line_error(err, f"no config.json in {str(tmp_path / 'gone')!r}, the base model of the adapter folder "
                               f"{str(adapter)!r}; give a Hugging Face model folder (the checkpoint's base model; "
                               f"give another with lopd export --model BASE_FOLDER)")

