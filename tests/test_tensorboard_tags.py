"""The TensorBoard tags a run writes are exactly those its docs list (issue 32, item 3), read from the event files.

``tests/test_docs.py`` checks the tag lists of docs/methods/ against the tags the source spells; here a tiny
1-step fit of every method (and LOPD's composer pretraining) writes real event files through Lightning's
``TensorBoardLogger``, read back with TensorBoard's ``EventAccumulator``, and the written set must equal the
documented one in both directions: nothing listed that the run does not write, nothing written that no page lists.

What a run is documented to write: the shared tags (docs/methods/README.md, "Shared TensorBoard tags": scalars,
the text tags ``samples/val`` and ``samples/train``, Lightning's ``hp_metric``), the method's own (its page's
"TensorBoard tags"; LOPD's ``lopd pretrain-composer`` line is the pretraining run's, not the fit's), and
``by_rollouts/<name>`` for every ``train/<name>``, ``by_rollouts/val_<name>`` for every ``val/<name>``. Less the
documented tags each run's settings leave out (``ABSENT``, as the docs' own conditions say), so that a tag that
stops being written fails here as surely as an undocumented one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from helpers import TINY_BANK, ParityToy
from test_docs import METHOD_PAGES, method_pages, section, tags_in

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
COMMON = dict(model="tiny", lora=LORA, learning_rate=1e-3, max_new_tokens=4, log_samples=1, log_samples_every_n_steps=1)
LOPD = dict(group_size=2, num_latents=2, num_experiences=1, composer_depth=1, max_experience_tokens=32,
            embedder="hashing", bank_path=str(TINY_BANK), distill_top_k=4)
#: scalars Lightning itself may write (no ``prefix/``): documented where a page names them in backticks
LIGHTNING_SCALARS = ("hp_metric", "epoch")
#: a documented tag no run here writes: the HF backend samples from the live student, nothing is copied
HF = {"time/weight_sync"}
#: the documented tags of a method that does not retrieve from a bank
NO_RETRIEVAL = HF | {"time/retrieval"}


@dataclass
class Run:
    """One tiny fit: its page under docs/methods/, its module, and the documented tags it leaves out."""

    page: str
    module: str
    options: dict[str, Any]
    absent: set[str]
    examples_per_step: int = 1
    lopd_callbacks: bool = False
    skill: bool = False
    task: Any = field(default_factory=ParityToy)  # rewards that vary within a group


RUNS = {
    "lopd": Run("lopd.md", "LOPDModule", dict(LOPD, latent_probe_every_n_steps=1), HF, examples_per_step=2,
                lopd_callbacks=True),  # two examples: the probe swaps one row's experiences for another task's
    "grpo": Run("grpo.md", "GRPOModule", dict(group_size=2, kl_coef=0.1), NO_RETRIEVAL),
    "grpo_without_kl": Run("grpo.md", "GRPOModule", dict(group_size=2),  # "with kl_coef > 0"
                           NO_RETRIEVAL | {"train/kl", "time/reference"}),
    "sdpo": Run("sdpo.md", "SDPOModule", dict(group_size=2, distill_top_k=4), NO_RETRIEVAL),
    "opsd": Run("opsd.md", "OPSDModule", dict(group_size=1), NO_RETRIEVAL, examples_per_step=2),
    "opsd_retrieved": Run("opsd.md", "OPSDModule", dict(group_size=1, privileged_context="retrieved",
                                                        bank_path=str(TINY_BANK), embedder="hashing"),
                          HF, examples_per_step=2),
    "skill_sd": Run("skill_sd.md", "SkillSDModule", dict(group_size=2, kl_coef=0.1, skill_refresh_every=1,
                                                         skill_max_new_tokens=4), NO_RETRIEVAL, skill=True),
    # SFT trains on the references: no generated training batch ("only where the training batch is generated")
    "sft": Run("sft.md", "SFTModule", {}, NO_RETRIEVAL | {"train/reply_tokens_mean", "train/cut_at_length_rate",
                                                          "time/generation"}, task="toy"),
}


def tags_section(page: str) -> tuple[str, str]:
    """(what ``lopd fit`` writes, what ``lopd pretrain-composer`` writes) in ``page``'s "TensorBoard tags"."""
    text = section((METHOD_PAGES / page).read_text(), "## TensorBoard tags")
    pretrain = re.search(r"^- `lopd pretrain-composer`:.*?(?=^- |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    if pretrain is None:
        return text, ""
    return text[:pretrain.start()] + text[pretrain.end():], pretrain.group(0)


def documented_in(text: str) -> set[str]:
    """The scalar and text tags ``text`` names in backticks (text tags as TensorBoard files them)."""
    lightning = {name for name in LIGHTNING_SCALARS if f"`{name}`" in text}
    texts = {f"{tag}/text_summary" for tag in re.findall(r"`(samples/\w+)`", text)}
    return tags_in(text) | lightning | texts


def expected_tags(run: Run) -> set[str]:
    """What ``run`` is documented to write (module docstring)."""
    shared = section((METHOD_PAGES / "README.md").read_text(), "## Shared TensorBoard tags")
    own, _ = tags_section(run.page)
    tags = {t for t in documented_in(shared) | documented_in(own) if not t.startswith("by_rollouts/")} - run.absent
    mirrored = {f"by_rollouts/{t.split('/', 1)[1]}" for t in tags if t.startswith("train/")}
    mirrored |= {f"by_rollouts/val_{t.split('/', 1)[1]}" for t in tags if t.startswith("val/")}
    return tags | mirrored


def written_tags(log_dir: Path) -> set[str]:
    """Every scalar and tensor (text) tag of the event files under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        tags |= set(events.Tags()["scalars"]) | set(events.Tags()["tensors"])
    return tags


def assert_same(written: set[str], expected: set[str], where: str) -> None:
    assert written == expected, (
        f"{where}: written but not documented {sorted(written - expected)}; documented but not written "
        f"{sorted(expected - written)} (document the first in docs/methods/, or stop writing it)"
    )


def test_every_method_page_has_a_run():
    assert {run.page for run in RUNS.values()} == set(method_pages())


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_fit_writes_exactly_the_documented_tags(name, tmp_path):
    from lopd_lightning import modules
    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.modules.lopd_callbacks import MarginSchedule, MemoryRefresh

    run = RUNS[name]
    L.seed_everything(0, verbose=False)
    options = {**COMMON, **run.options}
    if run.module == "SFTModule":
        options.pop("max_new_tokens")
    module = getattr(modules, run.module)(**options)
    if run.skill:  # the random student summarises no skill: seed the library with one
        module.add_skill("success", "Answer with the number only.")
    callbacks = [MarginSchedule(), MemoryRefresh(every_n_steps=1, min_reward=0.0)] if run.lopd_callbacks else []
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, logger=TensorBoardLogger(str(tmp_path), name="tb"),
        log_every_n_steps=1, val_check_interval=1, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), callbacks=callbacks,
    )
    trainer.fit(module, OnPolicyDataModule(run.task, examples_per_step=run.examples_per_step, val_limit=1,
                                           val_batch_size=1))
    assert_same(written_tags(tmp_path), expected_tags(run), f"docs/methods/{run.page} ({name})")


def test_composer_pretraining_writes_exactly_the_documented_tags(tmp_path):
    from lopd_lightning.composer.pretrain import pretrain_composer
    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.modules import LOPDModule

    module = LOPDModule(**COMMON, **LOPD, warm_start_steps=1, warm_start_batch_size=2)
    pretrain_composer(module, OnPolicyDataModule("toy", examples_per_step=1), tmp_path,
                      trainer_options={"enable_progress_bar": False})
    _, pretrain = tags_section("lopd.md")
    assert_same(written_tags(tmp_path / "tensorboard"), documented_in(pretrain), "docs/methods/lopd.md (pretraining)")
