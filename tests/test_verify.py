"""``lopd tasks verify`` replays the references with the turn limit of training (a replay that ``lopd fit``
would cut is a failure naming ``multi_turn`` / ``max_turns``), and a task class that cannot be imported or
built, or a ``--limit`` / ``--max-turns`` below 1, is one ``error:`` line."""

from __future__ import annotations

import pytest

from lopd_lightning.cli import main
from lopd_lightning.tasks.base import Example, Task, turn_limit
from lopd_lightning.tasks.toy import HINT_REQUEST, ToyTask, _HintEpisode
from lopd_lightning.tasks.verify import verify_task


class TwoStepToy(ToyTask):
    """Two replies per episode (a hint, then the answer), but no `multi_turn` declared: training gives one."""

    name = "two_step"

    def __init__(self, **options):
        super().__init__(num_examples=4, **options)
        self.max_turns = None

    def start(self, example):
        return _HintEpisode(self, example)

    def reference_replies(self, example):
        return [HINT_REQUEST, example.data["answer"]]


class TooShortToy(TwoStepToy):
    """Declares multi_turn, with a limit below what its references take."""

    name = "too_short"

    def __init__(self):
        super().__init__()
        self.multi_turn, self.max_turns = True, 1


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    """``lopd <args>`` in process: (exit status, stdout, stderr)."""
    try:
        code = main(args)
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(err: str, expected: str) -> None:
    lines = err.strip().splitlines()
    assert lines == [f"error: {expected}"], err


@pytest.fixture
def task_module(tmp_path, monkeypatch):
    """Write ``<name>.py`` with ``source`` into an importable folder; returns the module name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        return name

    return write


# ----------------------------------------------------------------------- the turn limit of training
def test_the_turn_limit_is_the_rule_of_generate_rollouts():
    assert turn_limit(TwoStepToy()) == (1, "the default for single-turn tasks")
    assert turn_limit(ToyTask(multi_turn=True)) == (2, "the task's max_turns attribute")
    assert turn_limit(TooShortToy()) == (1, "the task's max_turns attribute")
    task = TwoStepToy()
    task.multi_turn = True
    assert turn_limit(task) == (8, "the default for multi-turn tasks")
    assert turn_limit(TwoStepToy(), 3) == (3, "model.init_args.max_turns")
    assert turn_limit(TwoStepToy(), 3, given_by="--max-turns") == (3, "--max-turns")
    with pytest.raises(ValueError, match="max_turns must be >= 1, got 0"):
        turn_limit(TwoStepToy(), 0)


def test_a_two_step_task_without_multi_turn_fails_as_lopd_fit_would_cut_it():
    """It used to report 4/4 full marks while `lopd fit` cut every episode after one reply."""
    report = verify_task(TwoStepToy())
    assert (report.n, report.n_full_marks, report.ok) == (4, 0, False)
    assert report.failures == [(f"toy/{i}", 0.0) for i in range(4)]
    assert report.cut == {f"toy/{i}": (1, 2) for i in range(4)}
    assert report.reason("toy/0") == "cut after 1 of its 2 replies at max_turns=1"
    advice = report.turn_limit_advice()
    assert "multi_turn = False" in advice and "`multi_turn = True` and `max_turns = 2`" in advice
    assert verify_task(TwoStepToy(), max_turns=2).ok  # the limit a config's model.init_args.max_turns gives


def test_a_multi_turn_task_whose_limit_is_too_low_names_max_turns():
    report = verify_task(TooShortToy())
    assert report.n_full_marks == 0 and len(report.cut) == 4
    advice = report.turn_limit_advice()
    assert "max_turns=1 (the task's max_turns attribute)" in advice
    assert "raise the task's `max_turns` attribute to 2 or set model.init_args.max_turns" in advice
    assert "lopd tasks verify --max-turns 2" in advice


def test_a_correct_multi_turn_task_still_gets_full_marks():
    report = verify_task(ToyTask(multi_turn=True))
    assert report.ok and report.n == 32 and not report.cut and report.turn_limit_advice() is None


def test_the_command_reports_cut_replays_with_the_reason(task_module, capsys):
    name = task_module("verify_two_step", "from test_verify import TwoStepToy\n")
    code, out, _ = run_main(["tasks", "verify", f"{name}.TwoStepToy"], capsys)
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith(f"{name}.TwoStepToy: 0/4 reference solutions score 1.0")
    assert lines[1] == "  FAIL toy/0: reward 0.0 (cut after 1 of its 2 replies at max_turns=1)"
    assert lines[-1] == (
        "4 of 4 replays were cut at max_turns=1 (the default for single-turn tasks), as lopd fit cuts its "
        "episodes; the longest reference takes 2 replies: task 'two_step' has multi_turn = False; a task whose "
        "episodes take several replies sets `multi_turn = True` and `max_turns = 2` on its Task class"
    )
    code, out, _ = run_main(["tasks", "verify", f"{name}.TwoStepToy", "--max-turns", "2"], capsys)
    assert code == 0 and f"{name}.TwoStepToy: 4/4 reference solutions score 1.0" in out


def test_a_replay_error_is_shown_with_its_failure(capsys, monkeypatch):
    class Raising(ToyTask):
        def reference_replies(self, example):
            raise KeyError("answer")

    monkeypatch.setattr("lopd_lightning.tasks.get_task", lambda name, **kw: Raising(num_examples=2))
    code, out, _ = run_main(["tasks", "verify", "toy"], capsys)
    assert code == 1 and "  FAIL toy/0: reward 0.0 (KeyError: 'answer')" in out.splitlines()


# ----------------------------------------------------------------------- why a reference failed
class StrictToy(ToyTask):
    """A checker that refuses every reply and says why in its info (as the BFCL checker does)."""

    def score_with_info(self, example, completion):
        return 0.0, {"error": f"expected {example.data['answer']!r} in capitals, got {completion!r}"}


class NoScoreTask(Task):
    """A single-turn task that forgot to implement ``score``."""

    name = "no_score"

    def all_examples(self):
        return [Example(id="no_score/0", text="2+2?", data={"answer": "4"})]

    def initial_messages(self, example):
        return [{"role": "user", "content": "2+2?"}]

    def reference_solution(self, example):
        return example.data["answer"]


def test_a_failing_reference_shows_the_checkers_info(capsys, monkeypatch):
    """It printed `reward 0.0` alone, without what the checker said."""
    report = verify_task(StrictToy(num_examples=2))
    answer = ToyTask(num_examples=2).examples("all")[0].data["answer"]
    first = report.failures[0][0]
    assert report.info[first] == {"error": f"expected {answer!r} in capitals, got {answer!r}"}
    assert report.reason(first) == f"checker: error: expected {answer!r} in capitals, got {answer!r}"
    monkeypatch.setattr("lopd_lightning.tasks.get_task", lambda name, **kw: StrictToy(num_examples=2))
    code, out, _ = run_main(["tasks", "verify", "toy"], capsys)
    assert code == 1
    assert f"  FAIL {first}: reward 0.0 (checker: error: expected {answer!r} in capitals, got {answer!r})" in out.splitlines()


def test_a_full_marks_reference_keeps_no_info():
    report = verify_task(ToyTask(num_examples=2))
    assert report.ok and report.info == {}


def test_a_single_turn_task_without_score_is_told_so_not_that_it_is_multi_turn(task_module, capsys):
    """It said "NoScoreTask is multi-turn: use start(example).step(...)"."""
    name = task_module("verify_no_score", "from test_verify import NoScoreTask\n")
    code, out, _ = run_main(["tasks", "verify", f"{name}.NoScoreTask"], capsys)
    assert code == 1
    assert out.splitlines()[1] == (
        "  FAIL no_score/0: reward 0.0 (NotImplementedError: NoScoreTask implements neither score(example, "
        "completion) nor score_with_info(example, completion), one of which a single-turn task "
        "(multi_turn = False) must; a multi-turn task sets multi_turn = True and overrides start(example))"
    )


# ----------------------------------------------------------------------- one line for a mistake
def test_a_task_class_that_needs_arguments_is_one_line(task_module, capsys):
    name = task_module("verify_needs_args", (
        "from lopd_lightning.tasks.toy import ToyTask\n\n\n"
        "class GuessTask(ToyTask):\n"
        "    def __init__(self, words, *, level):\n"
        "        super().__init__()\n"
    ))
    code, _, err = run_main(["tasks", "verify", f"{name}.GuessTask"], capsys)
    assert code == 2
    assert_one_line_error(err, f"task class '{name}.GuessTask' needs arguments (words, level); lopd tasks verify "
                               f"builds it without any: give them defaults, or verify a subclass that sets them")


def test_a_task_module_with_a_syntax_error_is_one_line(task_module, capsys):
    name = task_module("verify_broken", "class GuessTask(:\n    pass\n")
    code, _, err = run_main(["tasks", "verify", f"{name}.GuessTask"], capsys)
    assert code == 1
    assert_one_line_error(err, f"cannot import '{name}' for task '{name}.GuessTask': SyntaxError: invalid syntax "
                               f"({name}.py, line 1); fix the module (lopd --debug tasks verify {name}.GuessTask "
                               f"shows the traceback)")


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("--limit", "0", "lopd tasks verify: --limit must be >= 1, got 0 (leave it out to replay every example)"),
        ("--limit", "-3", "lopd tasks verify: --limit must be >= 1, got -3 (leave it out to replay every example)"),
        ("--max-turns", "0",
         "lopd tasks verify: --max-turns must be >= 1, got 0 (leave it out for the task's own turn limit)"),
    ],
)
def test_a_limit_below_one_is_refused(option, value, expected, capsys):
    """`--limit 0` printed "0/0 reference solutions score 1.0" and exited 0."""
    code, out, err = run_main(["tasks", "verify", "toy", option, value], capsys)
    assert code == 2 and out == ""
    assert_one_line_error(err, expected)
    with pytest.raises(ValueError, match="limit must be >= 1"):
        verify_task(ToyTask(), limit=0)
