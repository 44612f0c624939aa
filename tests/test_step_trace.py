"""benchmarks/step_trace.py: the counts it reports, on two tiny modules whose path is known by hand."""

from __future__ import annotations

import importlib
import sys

import pytest
from helpers import load_benchmark


@pytest.fixture(scope="module")
def step_trace():
    return load_benchmark("step_trace")


@pytest.fixture
def two_files(tmp_path, monkeypatch):
    """A package folder with ``a.f`` calling ``b.g`` twice (and a comprehension, which is no call)."""
    (tmp_path / "a_mod.py").write_text("from b_mod import g\n\n\ndef f():\n    g()\n    return [g() for _ in range(1)]\n")
    (tmp_path / "b_mod.py").write_text("def g():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("a_mod", "b_mod"):
        sys.modules.pop(name, None)
    yield tmp_path, importlib.import_module("a_mod")
    for name in ("a_mod", "b_mod"):
        sys.modules.pop(name, None)


def test_the_counts_follow_the_definitions(step_trace, two_files):
    root, a = two_files
    tracer = step_trace.StepTrace(root.resolve())
    tracer.start()
    try:
        a.f()
    finally:
        tracer.stop()
    got = tracer.summary()
    # path a -> b -> a -> b -> a: 4 transitions; back to a twice (returns), to b once (the second call)
    assert got["files_entered"] == ["a_mod.py", "b_mod.py"] and got["packages_entered"] == ["."]
    assert got["calls"] == 3 and got["calls_per_file"] == {"b_mod.py": 2, "a_mod.py": 1}
    assert got["transitions"] == 4
    assert got["returns_to_a_file_already_left"] == 3 and got["of_which_by_a_call"] == 1
    assert got["top_pairs"] == [{"caller": "a_mod.py", "callee": "b_mod.py", "calls": 2}]
    assert got["cross_file_calls"] == 2 and got["entries_from_outside"] == 1
    assert got["adapters_calls"] == got["adapters_calls_from_other_files"] == 0


def test_a_step_before_the_second_is_refused(step_trace):
    with pytest.raises(ValueError, match="--step must be >= 2"):
        step_trace.trace_method("grpo", step=1)
