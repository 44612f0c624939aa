"""The code's shape stays readable: file and function sizes, and no import cycle between the project's modules.

Limits from the architecture issue: no source file over 600 lines, no function over 100 lines (docstring
included), and the project's modules import each other without a cycle (module-level imports; lazy imports
inside functions and ``TYPE_CHECKING`` blocks are not edges).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lopd_lightning"
PACKAGE = "lopd_lightning"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100


def module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def top_level_imports(path: Path, name: str, known: set[str], *, lazy: bool = False) -> set[str]:
    """The project modules ``name`` imports at module level (not in ``if TYPE_CHECKING``), and with ``lazy``
    also those it imports inside functions."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")
                    parent = parent[: len(parent) - (node.level - 1)]
                    base = ".".join([*parent, base] if base else parent)
                # `from pkg import submodule` imports the submodule; `from mod import name` the module
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            else:
                continue
            out.update(t for t in targets if t in known and t != name)

    visit(tree.body)
    if lazy:  # every import anywhere inside a function, however deeply nested
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit([n for n in ast.walk(func) if isinstance(n, (ast.Import, ast.ImportFrom))])
    return out


def test_no_source_file_is_over_the_line_limit():
    too_long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not too_long, f"files over {MAX_FILE_LINES} lines: {too_long}"


def test_no_function_is_over_the_line_limit():
    too_long = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long[f"{path.relative_to(SRC)}:{node.name}"] = n
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


@pytest.mark.parametrize("lazy", [False, True], ids=["module_level", "with_lazy_imports"])
def test_the_project_modules_import_each_other_without_a_cycle(lazy):
    """No cycle, also counting the imports made inside functions (a lazy import hides a cycle, it does not
    remove it)."""
    mods = sources()
    known = set(mods)
    graph = {name: top_level_imports(path, name, known, lazy=lazy) for name, path in mods.items()}
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := dfs(name)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_import_graph_sees_real_edges():
    """Guards the cycle test against vacuity: known edges of the project are found."""
    mods = sources()
    graph = {name: top_level_imports(path, name, set(mods)) for name, path in mods.items()}
    assert "lopd_lightning.losses" in graph["lopd_lightning.modules.grpo"]
    assert any(dep.startswith("lopd_lightning.rollout") for dep in graph["lopd_lightning.modules.base"])
