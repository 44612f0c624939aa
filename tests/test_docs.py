"""The project carries its own copy of what it implements: no tracked file points outside the repository,
and every citation of docs/METHOD.md names a section that exists there. The README and the pages under
docs/ stay true to the code: links resolve, named commands, configs and functions exist, and each method's
page (docs/methods/) lists its constructor's knobs with their defaults and the TensorBoard tags it writes."""

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
        # a relative link from a page beside it, ](METHOD.md#...), is a path too
        assert not re.search(r"(?<![/\w])(?<!\]\()METHOD\.md", text) or path == METHOD, (
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


# ------------------------------------------------------------------------------------------------------------
# The README and the pages under docs/: links resolve, commands and configs exist, and each method's page
# (docs/methods/) states the knobs, defaults and TensorBoard tags its code has, so none of them can drift.

README = ROOT / "README.md"
METHOD_PAGES = ROOT / "docs" / "methods"
SRC = ROOT / "src" / "lopd_lightning"
TAG = r"(?:train|time|val|pretrain|by_rollouts)/\w+"


def user_docs() -> list[Path]:
    """The pages a user reads: the README, everything under docs/ and benchmarks/README.md."""
    return [README, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md"]


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces -> '-')."""
    anchors: set[str] = set()
    for line in without_code_blocks(path.read_text()).splitlines():
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            n, candidate = 0, slug
            while candidate in anchors:
                n += 1
                candidate = f"{slug}-{n}"
            anchors.add(candidate)
    return anchors


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(heading + "\n") + len(heading) + 1
    end = re.search(rf"^#{{1,{level}}} ", text[start:], flags=re.MULTILINE)
    return text[start:start + end.start()] if end else text[start:]


def tags_in(text: str) -> set[str]:
    """Every TensorBoard tag written as code (in backticks) in ``text``."""
    return set(re.findall(rf"`({TAG})`", text))


def test_relative_links_resolve_inside_the_repository():
    broken = []
    for page in user_docs():
        for target in re.findall(r"\]\(([^)\s]+)\)", without_code_blocks(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)} -> {target}"
            if ROOT not in resolved.parents and resolved != ROOT:
                broken.append(f"{where}: outside the repository")
            elif not resolved.exists():
                broken.append(f"{where}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
                broken.append(f"{where}: no such heading")
    assert broken == []


def test_readme_screen_one_says_what_how_and_status():
    """The first 40 lines: what this is, the two commands of the Makefile, a status of at most five lines."""
    text = README.read_text()
    first = "\n".join(text.splitlines()[:40])
    assert first.index("## Two commands") < first.index("## Status"), "what it is, the commands, then the status"
    assert "make quickstart" in first and "make test" in first
    status = [line for line in section(text, "## Status").splitlines() if line.strip()]
    assert 1 <= len(status) <= 5, status
    assert len(README.read_bytes()) < 14_000, "keep the README short: move details to a page under docs/"


def test_commands_and_configs_named_in_the_docs_exist():
    from lopd_lightning.cli import COMMANDS

    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE))
    bad = []
    for page in user_docs()[:-1]:  # benchmarks/README.md names its own scripts' options
        text = page.read_text()
        for block in code_blocks(text, "bash") + re.findall(r"`([^`\n]+)`", without_code_blocks(text)):
            for line in block.splitlines():
                make = re.match(r"\s*make (?:\w+=\S+ )*([a-z][\w-]*)", line)
                if make and make.group(1) not in targets:
                    bad.append(f"{page.relative_to(ROOT)}: make {make.group(1)}")
                command = re.match(r"\s*(?:\S*/)?lopd ([a-z][\w-]*)", line)
                if command and command.group(1) not in COMMANDS:
                    bad.append(f"{page.relative_to(ROOT)}: lopd {command.group(1)}")
                for config in re.findall(r"-c (configs/\S+?\.yaml)", line):
                    if not (ROOT / config).is_file():
                        bad.append(f"{page.relative_to(ROOT)}: {config}")
    assert bad == []
    listed = re.search(r"# the commands: (.*)", README.read_text()).group(1)
    assert listed.split(", ") == list(COMMANDS), "the README's `lopd --help` line lists every command"


def test_config_examples_name_real_keys():
    """Every YAML example in the README and docs/ parses, and its init_args are arguments of its classes."""
    import importlib

    import yaml

    from lopd_lightning.introspect import init_parameters

    examples = [(page, block) for page in user_docs()[:-1] for block in code_blocks(page.read_text(), "yaml")]
    assert examples, "no YAML example found"
    for page, block in examples:
        config = yaml.safe_load(block)
        for key in ("model", "data"):
            part = config.get(key) if isinstance(config, dict) else None
            if not isinstance(part, dict) or "class_path" not in part:
                continue
            module, _, name = part["class_path"].rpartition(".")
            cls = getattr(importlib.import_module(module), name)
            unknown = set(part.get("init_args", {})) - set(init_parameters(cls))
            assert not unknown, f"{page.relative_to(ROOT)}: {key}.init_args {sorted(unknown)} are not {name}'s"


def test_dotted_names_in_the_docs_resolve():
    """Every `lopd_lightning.x.y` the README and docs/ name (functions computing a loss, classes) exists."""
    import importlib

    missing = []
    for page in user_docs()[:-1]:
        for dotted in sorted(set(re.findall(r"`(lopd_lightning(?:\.\w+)+)`", page.read_text()))):
            parts = dotted.split(".")
            for i in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                    break
                except ImportError:
                    continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(f"{page.relative_to(ROOT)}: {dotted}")
    assert missing == []


# -------------------------------------------------------------------------------- knobs and defaults


def yaml_default(value) -> str:
    """A default as a config writes it (null, true, false, the string itself, else Python's repr)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return value if isinstance(value, str) else repr(value)


def effective_default(cls: type, name: str):
    """The default of ``name`` for ``cls``: the first class up its MRO whose ``__init__`` declares it."""
    import inspect

    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            parameter = inspect.signature(klass.__init__).parameters.get(name)
            if parameter is not None:
                return parameter.default
    raise KeyError(name)


def expected_knobs(cls: type) -> dict[str, str]:
    """What a page's knob table of ``cls`` must hold: a method's arguments beyond the shared ones (and the
    shared ones whose default it changes), every argument for the base and the callbacks (``init_parameters``)."""
    import inspect

    from lopd_lightning.introspect import init_parameters
    from lopd_lightning.modules import OnPolicyModule

    if not issubclass(cls, OnPolicyModule):
        return {p.name: yaml_default(p.default) for p in inspect.signature(cls.__init__).parameters.values()
                if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    shared = init_parameters(OnPolicyModule)
    return {
        name: yaml_default(effective_default(cls, name)) for name in init_parameters(cls)
        if cls is OnPolicyModule or name not in shared
        or effective_default(cls, name) != effective_default(OnPolicyModule, name)
    }


def knob_tables(text: str) -> dict[str, dict[str, str]]:
    """Every table headed ``| knob of `Class` | default | ...``: class -> {knob: default as written}."""
    tables: dict[str, dict[str, str]] = {}
    for match in re.finditer(r"^\| knob of `(\w+)` \| default \|.*\n\|[-| ]+\|\n((?:\|.*\n?)*)", text, re.MULTILINE):
        rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", match.group(2), flags=re.MULTILINE)
        assert len(rows) == len(match.group(2).strip().splitlines()), f"a row of {match.group(1)}'s table is malformed"
        tables[match.group(1)] = dict(rows)
    return tables


def method_pages():
    from lopd_lightning.modules.lopd_callbacks import MarginSchedule, MemoryRefresh
    from lopd_lightning.modules import GRPOModule, LOPDModule, OPSDModule, SDPOModule, SFTModule, SkillSDModule

    return {
        "lopd.md": [LOPDModule, MemoryRefresh, MarginSchedule], "grpo.md": [GRPOModule],
        "sdpo.md": [SDPOModule], "opsd.md": [OPSDModule], "skill_sd.md": [SkillSDModule], "sft.md": [SFTModule],
    }


def test_every_method_has_a_page_with_its_sections():
    from lopd_lightning import modules

    pages = method_pages()
    documented = {classes[0] for classes in pages.values()}
    methods = {getattr(modules, name) for name in modules.__all__} - {modules.OnPolicyModule, modules.SelfDistillationModule}
    assert documented == methods, "every method module has a page under docs/methods/"
    for page in pages:
        text = (METHOD_PAGES / page).read_text()
        for heading in ("## Privileged context", "## Loss", "## Knobs", "## TensorBoard tags"):
            assert heading + "\n" in text, f"docs/methods/{page} has no section {heading!r}"
        assert re.search(r"`lopd_lightning(?:\.\w+)+`", section(text, "## Loss")), f"{page}: name the loss's function"


def test_knob_tables_state_the_constructors_arguments_and_defaults():
    """Each page's knob table is its class's constructor: the same names, the same defaults (a new, renamed or
    re-defaulted argument fails here until its page says so)."""
    from lopd_lightning.modules import OnPolicyModule

    tables = {"README.md": [OnPolicyModule], **method_pages()}
    for page, classes in tables.items():
        found = knob_tables((METHOD_PAGES / page).read_text())
        for cls in classes:
            assert cls.__name__ in found, f"docs/methods/{page} has no knob table of {cls.__name__}"
            assert found[cls.__name__] == expected_knobs(cls), f"docs/methods/{page}: {cls.__name__}'s knobs"


# ------------------------------------------------------------------------------------------------ tags


def tags_in_source(path: Path, only_classes: tuple[str, ...] = ()) -> set[str]:
    """The TensorBoard tags that a source file spells: string literals such as "train/loss", timed phases
    (``self.timed("teacher")``, ``step_timings["generation"]``: ``time/<phase>``) and validation values
    (``f"{prefix}/reward_mean"``, also through a loop over literal names: ``val/<name>``)."""
    import ast

    tree = ast.parse(path.read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in only_classes] if only_classes else [tree]
    loop_names: dict[str, list[str]] = {}
    for node in (n for root in nodes for n in ast.walk(root)):
        if (isinstance(node, ast.For) and isinstance(node.target, ast.Tuple) and isinstance(node.iter, ast.Tuple)
                and isinstance(node.target.elts[0], ast.Name)):
            firsts = [e.elts[0].value for e in node.iter.elts if isinstance(e, ast.Tuple) and isinstance(e.elts[0], ast.Constant)]
            loop_names[node.target.elts[0].id] = firsts
    tags: set[str] = set()
    for node in (n for root in nodes for n in ast.walk(root)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(TAG, node.value):
            tags.add(node.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "timed"
              and node.args and isinstance(node.args[0], ast.Constant)):
            tags.add(f"time/{node.args[0].value}")
        elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
              and node.value.attr == "step_timings" and isinstance(node.slice, ast.Constant)):
            tags.add(f"time/{node.slice.value}")
        elif isinstance(node, ast.JoinedStr) and len(node.values) >= 2 and isinstance(node.values[0], ast.FormattedValue):
            rest = node.values[1]
            if isinstance(rest, ast.Constant) and re.fullmatch(r"/\w+", rest.value):
                tags.add(f"val{rest.value}")
            elif (isinstance(rest, ast.Constant) and rest.value == "/" and len(node.values) == 3
                  and isinstance(node.values[2], ast.FormattedValue) and isinstance(node.values[2].value, ast.Name)):
                tags |= {f"val/{name}" for name in loop_names.get(node.values[2].value.id, [])}
    return tags


def method_tags(cls: type) -> set[str]:
    """The tags a method's own code writes: the files of its classes below OnPolicyModule, and for LOPD its
    latent probe, the composer's pretraining stage and its two callbacks."""
    import inspect

    from lopd_lightning.modules import LOPDModule, OnPolicyModule

    files = {Path(inspect.getsourcefile(k)) for k in cls.__mro__
             if isinstance(k, type) and issubclass(k, OnPolicyModule) and k is not OnPolicyModule}
    tags = set().union(*(tags_in_source(f) for f in files))
    if issubclass(cls, LOPDModule):
        tags |= tags_in_source(SRC / "composer" / "probe.py") | tags_in_source(SRC / "composer" / "pretrain.py")
        tags |= tags_in_source(SRC / "modules" / "lopd_callbacks.py")
    return tags


def shared_tags() -> set[str]:
    """The tags the base writes for every method (less those each method writes itself, e.g. train/loss)."""
    every = set.intersection(*(method_tags(classes[0]) for classes in method_pages().values()))
    files = [SRC / "modules" / name for name in ("base.py", "observability.py", "evaluation.py")]
    return set().union(*(tags_in_source(f) for f in files)) - every


def test_each_method_page_lists_the_tags_its_code_writes():
    index = (METHOD_PAGES / "README.md").read_text()
    rows = dict(re.findall(r"^\| \[[^\]]+\]\((\w+\.md)#tensorboard-tags\) \| (.*) \|$", index, flags=re.MULTILINE))
    assert set(rows) == set(method_pages()), "docs/methods/README.md lists every method's own tags"
    for page, classes in method_pages().items():
        listed = tags_in(section((METHOD_PAGES / page).read_text(), "## TensorBoard tags"))
        assert listed == method_tags(classes[0]), f"docs/methods/{page}: its tags against its code"
        assert tags_in(rows[page]) == listed, f"docs/methods/README.md's row of {page} against the page"


def test_shared_tags_match_the_code_in_the_readme_and_the_methods_page():
    expected = shared_tags()
    page = section((METHOD_PAGES / "README.md").read_text(), "## Shared TensorBoard tags")
    assert tags_in(page.split("\n\n")[1]) == expected, "docs/methods/README.md's shared tags"
    readme = section(README.read_text(), "### TensorBoard tags")
    assert tags_in(readme.split("\n\n")[0]) == expected, "the README's shared tags (its first paragraph)"


def test_every_tag_the_docs_name_is_written_by_the_code():
    """A tag named anywhere a user reads (README, docs/, benchmarks/README.md) is one the code writes, or its
    ``by_rollouts/`` copy."""
    written = shared_tags().union(*(method_tags(classes[0]) for classes in method_pages().values()))
    written |= {f"by_rollouts/{t.split('/', 1)[1]}" for t in written if t.startswith("train/")}
    written |= {f"by_rollouts/val_{t.split('/', 1)[1]}" for t in written if t.startswith("val/")}
    unknown = {f"{page.relative_to(ROOT)}: {tag}" for page in user_docs() for tag in tags_in(page.read_text())
               if tag not in written}
    assert unknown == set()
