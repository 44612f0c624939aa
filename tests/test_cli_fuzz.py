"""A fuzz of ``lopd fit|validate|test`` (issue 57): wrong types, out-of-range numbers, unknown keys, missing files
and unwritable folders across the documented keys of every method's tiny config each end in exit status != 0
with one ``error:`` line naming the key, never a traceback, never a started run. The cases and the harness are
``benchmarks/cli_fuzz.py``'s, which runs many more and records the count in ``benchmarks/results/cli_fuzz.json``."""

from __future__ import annotations

import json

import lightning.pytorch  # noqa: F401  (imported here, not under capsys: its log handler keeps the real stderr)
import pytest
from hypothesis import HealthCheck, given, settings

from helpers import BENCHMARKS, load_benchmark

fuzz = load_benchmark("cli_fuzz")
PER_KIND = settings(max_examples=6, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def a_file():
    with fuzz.a_regular_file() as path:
        yield path


@pytest.mark.parametrize("method", sorted(fuzz.METHODS))
def test_every_tiny_config_as_given_starts_a_run(method, a_file):
    """The harness sees a valid config start (so each refusal below is the mistake's, not the config's)."""
    with fuzz.no_runs():
        outcome = fuzz.run_case(fuzz.Case(method, "fit", "none", "", ()), a_file)
    assert outcome.started and outcome.problem(fuzz.Case(method, "fit", "none", "", ())) == (
        "a run started (the model loaded or a Trainer stage began)")


@pytest.mark.parametrize("kind", sorted(fuzz.KINDS))
def test_each_mistake_is_one_error_line_naming_its_key_before_anything_runs(kind, a_file):
    seen = []

    @PER_KIND
    @given(case=fuzz.cases(kind))
    def check(case):
        outcome = fuzz.run_case(case, a_file)
        seen.append(case)
        assert outcome.problem(case) is None, (case, outcome)

    with fuzz.no_runs():
        check()
    assert len(seen) >= 6 and {case.kind for case in seen} == {kind}


def test_the_committed_fuzz_result_tried_hundreds_of_cases_without_a_traceback():
    result = json.loads((BENCHMARKS / "results" / "cli_fuzz.json").read_text())
    assert result["benchmark"] == "cli_fuzz" and result["cases"] >= 1000
    assert result["failures"] == result["tracebacks"] == result["started_runs"] == 0
    assert set(result["by_kind"]) == set(fuzz.KINDS) and set(result["by_method"]) == set(fuzz.METHODS)
    assert {"versions", "hardware", "git_sha"} <= set(result)
