"""``last.ckpt`` is the trained model: LastCheckpointAtTrainEnd writes it at the final step when
ModelCheckpoint's own schedule (``every_n_train_steps``) ended earlier (tiny model, ParityToy, CPU)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lopd_lightning.callbacks import LastCheckpointAtTrainEnd, RunSummary
from lopd_lightning.data import OnPolicyDataModule
from lopd_lightning.modules import GRPOModule
from helpers import ParityToy, quiet_trainer

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


class Saves(Callback):
    """The global step of every checkpoint written, and a checksum of the weights after every step."""

    def __init__(self):
        self.steps: list[int] = []
        self.weights: dict[int, float] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.steps.append(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights[trainer.global_step] = sum(float(p.detach().double().abs().sum()) for p in pl_module.parameters())


def grpo_fit(tmp_path, name: str, *, max_steps: int, every: int, save_last=True, save_top_k=0, ckpt_path=None):
    """A GRPO run with ``ModelCheckpoint(every_n_train_steps=every)``: ``(module, saves, checkpoint folder)``."""
    L.seed_everything(0)
    module = GRPOModule("tiny", lora=LORA, group_size=2, max_new_tokens=4, learning_rate=1e-2, seed=0)
    dm = OnPolicyDataModule(ParityToy(), examples_per_step=2, val_limit=2, val_batch_size=2)
    folder = tmp_path / name
    saves = Saves()
    checkpoint = ModelCheckpoint(dirpath=folder, every_n_train_steps=every, save_last=save_last,
                                 save_top_k=save_top_k)
    trainer = quiet_trainer(tmp_path, max_steps=max_steps, enable_checkpointing=True, callbacks=[checkpoint, saves])
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    assert trainer.global_step == max_steps
    return module, saves, folder


def test_lightning_alone_leaves_last_ckpt_at_its_schedule_not_at_the_final_step(tmp_path):
    """Why the callback exists: without it, 5 steps saved every 2 end with a last.ckpt of step 4."""
    trainer = quiet_trainer(tmp_path, max_steps=5, enable_checkpointing=True, callbacks=[
        ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_last=True, save_top_k=0)])
    trainer.fit(BoringModel())
    assert torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)["global_step"] == 4
    # the callback on the same Trainer settings: step 5
    trainer = quiet_trainer(tmp_path, max_steps=5, enable_checkpointing=True, callbacks=[
        ModelCheckpoint(dirpath=tmp_path / "ck2", every_n_train_steps=2, save_last=True, save_top_k=0),
        LastCheckpointAtTrainEnd()])
    trainer.fit(BoringModel())
    assert torch.load(tmp_path / "ck2" / "last.ckpt", weights_only=False)["global_step"] == 5


def test_an_on_policy_run_ends_with_last_ckpt_at_its_final_step_holding_the_trained_weights(tmp_path):
    module, saves, folder = grpo_fit(tmp_path, "run", max_steps=3, every=2, save_top_k=-1)
    assert saves.steps == [2, 2, 3]  # the schedule's step 2 (its top-k file and last), then the final last once
    last = torch.load(folder / "last.ckpt", weights_only=False)
    assert last["global_step"] == 3
    trained = module.state_dict()
    assert set(last["state_dict"]) == set(trained)
    for key, value in trained.items():
        assert torch.equal(last["state_dict"][key], value), key
    # the top-k files stay on the schedule: the final save is the last checkpoint only
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert RunSummary().summary(module.trainer, module)["checkpoint"] == str(folder / "last.ckpt")


def test_a_schedule_that_ends_on_the_final_step_saves_it_once(tmp_path):
    _, saves, folder = grpo_fit(tmp_path, "run", max_steps=4, every=2)
    assert saves.steps == [2, 4]
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 4


def test_a_checkpoint_callback_without_save_last_is_left_alone(tmp_path):
    _, saves, folder = grpo_fit(tmp_path, "run", max_steps=3, every=2, save_last=False, save_top_k=-1)
    assert saves.steps == [2]
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt"]


def test_a_run_continued_from_the_final_last_ckpt_matches_one_run_straight_through(tmp_path):
    """The final save is a resumable state: 3 steps, then continued to 5 from last.ckpt, gives the weights of
    5 steps run at once, step by step."""
    _, straight, _ = grpo_fit(tmp_path, "straight", max_steps=5, every=2)
    _, first, folder = grpo_fit(tmp_path, "first", max_steps=3, every=2)
    _, continued, _ = grpo_fit(tmp_path, "continued", max_steps=5, every=2, ckpt_path=str(folder / "last.ckpt"))
    assert sorted(continued.weights) == [4, 5]
    for step in (1, 2, 3):
        assert first.weights[step] == pytest.approx(straight.weights[step], rel=1e-12)
    for step in (4, 5):
        assert continued.weights[step] == pytest.approx(straight.weights[step], rel=1e-9), step
    assert straight.weights[5] != pytest.approx(straight.weights[3], rel=1e-9)  # the extra steps trained


def boring_fit(tmp_path, *checkpoints, max_steps: int = 5, **trainer_options):
    """A BoringModel fit with ``checkpoints`` and LastCheckpointAtTrainEnd: the steps of every save."""
    saves = Saves()
    trainer = quiet_trainer(tmp_path, max_steps=max_steps, enable_checkpointing=True,
                            callbacks=[*checkpoints, saves, LastCheckpointAtTrainEnd()], **trainer_options)
    trainer.fit(BoringModel())
    return saves.steps


def step_of(path) -> int:
    return torch.load(path, weights_only=False)["global_step"]


def test_link_mode_writes_the_final_step_as_a_file_not_a_link_to_an_older_one(tmp_path):
    """save_last="link" links last.ckpt to the callback's latest top-k file (step 4): the final step has no
    top-k file, so it is written as one of its own, and the step-4 file is left as it was."""
    folder = tmp_path / "ck"
    steps = boring_fit(tmp_path, ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_last="link", save_top_k=1))
    assert steps == [2, 4, 5]
    assert not (folder / "last.ckpt").is_symlink() and step_of(folder / "last.ckpt") == 5
    assert step_of(folder / "epoch=0-step=4.ckpt") == 4


def test_a_validation_checkpoint_at_the_final_step_is_not_saved_twice(tmp_path):
    """compare.py's pair: last.ckpt every 4 steps, evaluated.ckpt after each validation (every 5 of 10): the final
    step's validation saves evaluated.ckpt, the end of training last.ckpt, each once."""
    last = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4, save_last=True, save_top_k=0)
    evaluated = ModelCheckpoint(dirpath=tmp_path / "ck", filename="evaluated", save_top_k=1, monitor=None,
                                enable_version_counter=False)
    steps = boring_fit(tmp_path, last, evaluated, max_steps=10, val_check_interval=5, limit_val_batches=1)
    assert steps == [4, 5, 8, 10, 10]
    assert step_of(tmp_path / "ck" / "last.ckpt") == 10 and step_of(tmp_path / "ck" / "evaluated.ckpt") == 10
    # the schedule itself ending on the final step: saved there once
    assert boring_fit(tmp_path / "b", ModelCheckpoint(dirpath=tmp_path / "b" / "ck", every_n_train_steps=5,
                                                      save_last=True, save_top_k=0), max_steps=10) == [5, 10]


def test_a_run_stopped_by_an_exception_is_not_saved_at_its_last_step(tmp_path):
    class Fail(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        boring_fit(tmp_path, ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_last=True,
                                             save_top_k=0), Fail())
    assert step_of(tmp_path / "ck" / "last.ckpt") == 2
