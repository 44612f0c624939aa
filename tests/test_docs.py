"""The project carries its own copy of what it implements: no tracked file points outside the repository,
and every citation of docs/METHOD.md names a section that exists there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METHOD = ROOT / "docs" / "METHOD.md"


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    suffixes = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ""}
    this = Path(__file__).resolve()  # this file spells the patterns it looks for
    return [ROOT / f for f in out.splitlines()
            if Path(f).suffix in suffixes and (ROOT / f).is_file() and (ROOT / f).resolve() != this]


def test_no_tracked_file_points_outside_the_repository():
    outside = []
    for path in tracked_text_files():
        text = path.read_text(errors="replace")
        for match in re.finditer(r"\.\./shared|/work/shared|\.\./\.\./", text):
            outside.append(f"{path.relative_to(ROOT)}: {text[max(0, match.start() - 30):match.end() + 30]!r}")
    assert outside == []


def test_every_method_citation_names_an_existing_section():
    sections = {int(m.group(1)) for m in re.finditer(r"^## (\d+)\. ", METHOD.read_text(), re.MULTILINE)}
    assert sections == set(range(1, 8))
    cited: dict[int, list[str]] = {}
    for path in tracked_text_files():
        text = path.read_text(errors="replace")
        assert not re.search(r"(?<![/\w])METHOD\.md", text) or path == METHOD, (
            f"{path.relative_to(ROOT)} cites METHOD.md without its folder: write docs/METHOD.md"
        )
        for match in re.finditer(r"docs/METHOD\.md,? (?:sections? )?(\d+)", text):
            cited.setdefault(int(match.group(1)), []).append(str(path.relative_to(ROOT)))
    assert cited, "no citation found"
    assert set(cited) <= sections, {n: files for n, files in cited.items() if n not in sections}


def test_method_md_states_the_defaults_the_code_uses():
    import inspect

    from lopd_lightning.modules import GRPOModule, LOPDModule

    text = METHOD.read_text()
    lopd = inspect.signature(LOPDModule.__init__).parameters
    for key, written in [("num_latents", "K = 32"), ("num_experiences", "J = 3"), ("distill_top_k", "M = 20"),
                         ("margin", "m = 0.05"), ("anchor_weight", "lambda = 0.2"), ("dual_lr", "eta_beta = 0.5")]:
        assert written in text, written
        assert str(lopd[key].default) == written.split("= ")[1], key
    grpo = inspect.signature(GRPOModule.__init__).parameters
    assert grpo["clip_eps_low"].default == grpo["clip_eps_high"].default == 0.2 and "eps 0.2" in text
