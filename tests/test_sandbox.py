"""The sandbox holds against hostile programs: each test runs one in a child with a 1-2 s limit."""

from __future__ import annotations

import logging
import math
import os
import time

import pytest

from lopd_lightning.sandbox import (
    SandboxLimits,
    SandboxResult,
    bwrap_available,
    isolation_report,
    run_checked,
    run_code,
    run_many,
    run_many_checked,
)
from helpers import alive

FAST = dict(timeout_s=1.5, memory_mb=256)
MY_PID_NS = os.readlink("/proc/self/ns/pid")
#: a program's first line: its process group, uid and PID namespace (see left_behind)
MARK = "import os\nprint(os.getpgid(0), os.getuid(), os.readlink('/proc/self/ns/pid'), flush=True)\n"


@pytest.fixture(scope="module")
def isolation() -> dict:
    return isolation_report()


def left_behind(stdout: str) -> list[int]:
    """Live processes of a run that printed MARK first: its process group and one-off uid, or, when it
    had a PID namespace of its own (bubblewrap: its pgid means nothing out here), that namespace."""
    pgid, uid, ns = stdout.split()[:3]
    uid = int(uid) if int(uid) != os.getuid() else None
    if ns == MY_PID_NS:
        return alive(pgid=int(pgid), uid=uid)
    found = alive(pgid=-1, uid=uid) if uid is not None else []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.readlink(f"/proc/{name}/ns/pid") == ns:
                with open(f"/proc/{name}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                        found.append(int(name))
        except OSError:
            continue
    return found



def test_ok_run():
    result = run_code("print('hello', 6 * 7)", **FAST)
    assert isinstance(result, SandboxResult)
    assert (result.status, result.returncode, result.stdout, result.stderr) == ("ok", 0, "hello 42\n", "")
    assert 0 < result.duration_s < 1.5


def test_exception_is_error_with_traceback():
    result = run_code("def f():\n    raise ValueError('boom')\nf()", **FAST)
    assert (result.status, result.returncode) == ("error", 1)
    assert "ValueError: boom" in result.stderr and '"<sandbox>", line 2' in result.stderr


@pytest.mark.parametrize(
    "code, status, returncode",
    [
        ("import sys; sys.exit(3)", "error", 3),
        ("import os; os._exit(0)", "ok", 0),  # a clean exit really is a clean exit
        ("import os; os._exit(7)", "error", 7),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "error", -9),
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "error", -11),
        ("import atexit, sys\natexit.register(sys.exit, 0)\nraise ValueError('x')", "error", 1),
    ],
)
def test_exits_and_signals(code, status, returncode):
    result = run_code(code, **FAST)
    assert (result.status, result.returncode) == (status, returncode)


def test_infinite_loop_times_out():
    start = time.monotonic()
    result = run_code("while True:\n    pass", timeout_s=1.0)
    assert result.status == "timeout" and result.returncode == -9
    assert 1.0 <= result.duration_s and time.monotonic() - start < 3.0


@pytest.mark.parametrize(
    "code",
    [
        "try:\n    while True: pass\nfinally:\n    while True: pass",
        "import atexit\natexit.register(lambda: [None for _ in iter(int, 1)])",
        "import signal, time\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
        "    signal.signal(s, signal.SIG_IGN)\ntime.sleep(60)",
        "import sys\ndef hook(*a):\n    while True: pass\nsys.excepthook = hook\nraise ValueError",
    ],
    ids=["finally-loop", "atexit-loop", "ignore-signals", "excepthook-loop"],
)
def test_code_that_never_returns_control_times_out(code):
    result = run_code(code, timeout_s=1.0)
    assert result.status == "timeout"


FORK_BOMB = MARK + """
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def test_fork_bomb_is_bounded_and_leaves_no_process():
    start = time.monotonic()
    result = run_code(FORK_BOMB, timeout_s=1.5, python_guards=False)
    assert result.status == "timeout" and time.monotonic() - start < 5.0
    assert left_behind(result.stdout) == []


def test_fork_is_refused_by_the_python_guards():
    result = run_code("import os\nos.fork()", **FAST)
    assert result.status == "error" and "starting processes is refused" in result.stderr
    result = run_code("import subprocess\nsubprocess.run(['true'])", **FAST)
    assert result.status == "error" and "starting processes is refused" in result.stderr


def test_child_escaping_its_session_is_killed(isolation):
    if not isolation["user_switch"]:
        pytest.skip("escaping the session is only caught with a one-off user id (trainer runs as root)")
    code = MARK + "import time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(0.2)"
    result = run_code(code, timeout_s=1.5, python_guards=False)
    assert result.status == "ok"
    assert left_behind(result.stdout) == []


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(2 ** 40)", "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))"],
    ids=["one-huge", "growing"],
)
def test_memory_bomb_hits_memory_limit(code):
    result = run_code(code, timeout_s=3.0, memory_mb=256)
    assert result.status == "memory_limit" and result.returncode != 0


def test_endless_output_is_capped_without_hanging():
    start = time.monotonic()
    code = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)"
    result = run_code(code, timeout_s=1.0, max_output_bytes=1000)
    assert result.status == "timeout" and time.monotonic() - start < 3.0
    assert len(result.stdout) <= 1000 + 100 and "bytes cut" in result.stdout


def test_large_output_keeps_head_and_tail():
    code = "import sys\nsys.stdout.write('A' * 1000 + 'm' * 5_000_000 + 'Z' * 1000)\nsys.stderr.write('e' * 100_000)"
    result = run_code(code, max_output_bytes=2000, **FAST)
    assert result.status == "ok"
    assert result.stdout.startswith("A" * 1000) and result.stdout.endswith("Z" * 1000)
    assert "[lopd sandbox: 5000000 bytes cut]" in result.stdout
    assert len(result.stderr) <= 2000 + 100


def test_non_utf8_output_is_replaced():
    result = run_code("import sys\nsys.stdout.buffer.write(b'ok\\xff\\xfe')\nsys.stderr.buffer.write(b'\\x80')", **FAST)
    assert result.status == "ok" and result.stdout == "ok\ufffd\ufffd" and result.stderr == "\ufffd"


@pytest.mark.parametrize("guards", [True, False])
def test_writing_outside_its_directory_fails(tmp_path, isolation, guards):
    if not guards and not isolation["user_switch"]:
        pytest.skip("without the guards, only a one-off user id (trainer runs as root) stops the write")
    # tmp_path lies under /tmp: with a private tmpfs there (root), the unguarded write may succeed, but
    # into the program's own /tmp, which the host never sees; otherwise the one-off uid is refused.
    private = not guards and isolation["private_tmp"] and str(tmp_path).startswith("/tmp/")
    target = tmp_path / "pwned.txt"
    code = f"import os\nopen({str(target)!r}, 'w').write('x')"
    result = run_code(code, python_guards=guards, **FAST)
    if not private:
        assert result.status == "error" and "PermissionError" in result.stderr
    result = run_code(f"import os\nos.mkdir({str(tmp_path / 'pwned_dir')!r})", python_guards=guards, **FAST)
    if not private:
        assert result.status == "error"
    assert not target.exists() and not (tmp_path / "pwned_dir").exists()


def test_guards_refuse_writes_to_world_writable_dirs_but_allow_the_workdir():
    code = (
        "import os, pathlib, tempfile\n"
        "pathlib.Path('mine.txt').write_text('ok')\n"
        "os.makedirs('a/b')\n"
        "with tempfile.NamedTemporaryFile(dir='.') as f: f.write(b'x')\n"
        "try:\n    open('/tmp/lopd-sandbox-test-escape', 'w')\nexcept PermissionError:\n    print('refused')\n"
        "try:\n    os.rename('mine.txt', '/tmp/lopd-sandbox-test-escape')\n"
        "except PermissionError:\n    print('refused')\n"
    )
    result = run_code(code, **FAST)
    assert (result.status, result.stdout) == ("ok", "refused\nrefused\n"), result.stderr
    assert not os.path.exists("/tmp/lopd-sandbox-test-escape")


def test_parent_environment_is_not_visible(monkeypatch, isolation):
    monkeypatch.setenv("LOPD_SANDBOX_SECRET", "hunter2")
    code = (
        "import os\nprint(sorted(os.environ))\nprint(os.environ.get('LOPD_SANDBOX_SECRET'))\n"
        f"try:\n    print(open('/proc/{os.getpid()}/environ').read())\nexcept OSError as e:\n    print('denied')"
    )
    result = run_code(code, **FAST)
    assert result.status == "ok"
    assert "hunter2" not in result.stdout and "LOPD_SANDBOX_SECRET" not in result.stdout
    assert result.stdout.splitlines()[1] == "None"
    if isolation["user_switch"]:
        assert result.stdout.splitlines()[2] == "denied"


def test_stdin_is_empty_and_program_is_not_on_disk_or_command_line():
    code = (
        "import os, sys\nMARK = 'sandbox-mark-' + '1234'\n"
        "print(repr(sys.stdin.read()))\n"
        "print(open('/proc/self/cmdline', 'rb').read().count(b'sandbox-mark-'))\n"
        "print(sorted(os.listdir('.')), sys.argv)"
    )
    result = run_code(code, **FAST)
    assert result.stdout.splitlines() == ["''", "0", "[] ['<sandbox>']"], result.stderr


def test_temporary_directory_is_removed():
    code = (
        "import os\nprint(os.getcwd())\nos.makedirs('d/e')\nopen('d/e/f', 'w').write('x')\n"
        "os.chmod('d/e', 0o500)\nos.chmod('d', 0o500)"
    )
    result = run_code(code, **FAST)
    workdir = result.stdout.strip()
    assert result.status == "ok" and workdir.startswith("/") and not os.path.exists(workdir)


def test_network_is_cut_when_possible(isolation):
    if not isolation["network_isolated"]:
        pytest.skip("no privilege for a network namespace here")
    code = "import socket\nsocket.create_connection(('10.255.255.1', 80), timeout=0.5)"
    result = run_code(code, **FAST)
    assert result.status == "error" and "unreachable" in result.stderr.lower()


def test_run_many_keeps_order_and_runs_in_parallel():
    codes = [f"import time\ntime.sleep(0.6)\nprint({i})" for i in range(4)]
    start = time.monotonic()
    results = run_many(codes, max_workers=4, **FAST)
    elapsed = time.monotonic() - start
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert all(r.ok for r in results)
    assert elapsed < 2.0  # serial would take >= 2.4 s
    assert run_many([]) == []


def test_bad_limits_raise():
    with pytest.raises(ValueError):
        run_code("pass", timeout_s=0)
    with pytest.raises(ValueError):
        run_code("pass", memory_mb=-1)
    with pytest.raises(ValueError):
        run_many(["pass"], max_workers=0)


# ---------------------------------------------------------------------------------------------------
# The limits as one record
# ---------------------------------------------------------------------------------------------------


def test_limits_record_defaults_validation_and_cpu_limit():
    limits = SandboxLimits()
    assert (limits.timeout_s, limits.memory_mb, limits.max_output_bytes, limits.max_processes, limits.max_file_mb,
            limits.max_disk_mb) == (10.0, 1024, 64_000, 32, 16, 64)
    assert limits.isolate_network and limits.private_tmp and limits.python_guards and limits.bwrap is None
    assert SandboxLimits(timeout_s=1.5).cpu_s == 3 and SandboxLimits(timeout_s=2.0).cpu_s == 3
    for bad in ({"timeout_s": 0}, {"timeout_s": math.nan}, {"memory_mb": -1}, {"max_output_bytes": -1},
                {"max_processes": 0}, {"max_file_mb": 0}, {"max_disk_mb": 0}):
        with pytest.raises(ValueError, match="sandbox limits must be positive"):
            SandboxLimits(**bad)
    assert SandboxLimits(max_output_bytes=0).max_output_bytes == 0
    with pytest.raises(AttributeError):  # frozen: one record can be shared by many runs
        limits.timeout_s = 1.0


def test_limits_record_and_keywords_set_the_same_limits():
    loop = "while True:\n    pass"
    by_record = run_code(loop, limits=SandboxLimits(timeout_s=1.0, memory_mb=256))
    by_keywords = run_code(loop, timeout_s=1.0, memory_mb=256)
    overridden = run_code(loop, limits=SandboxLimits(timeout_s=30.0), timeout_s=1.0)  # a keyword wins
    for result in (by_record, by_keywords, overridden):
        assert result.status == "timeout" and result.reason == "timeout: wall-clock limit of 1 s", result
        assert result.duration_s < 3.0
    small = SandboxLimits(max_output_bytes=100, **FAST)
    printed = "print('x' * 1000)"
    assert "bytes cut" in run_code(printed, limits=small).stdout
    assert [len(r.stdout) < 200 for r in run_many([printed, printed], limits=small, max_workers=2)] == [True, True]
    pairs = [("def f(x):\n    return x + 1\n", "assert candidate_function('f')(1) == 2\n")]
    assert run_checked(*pairs[0], limits=small, python_guards=False).passed
    assert [r.passed for r in run_many_checked(pairs, limits=small, module="solution")] == [True]


def test_limits_that_are_not_a_record_or_not_an_option_raise():
    with pytest.raises(TypeError, match="SandboxLimits"):
        run_code("pass", limits={"timeout_s": 1.0})
    with pytest.raises(TypeError, match="no_such_limit"):
        run_code("pass", no_such_limit=1)
    with pytest.raises(TypeError, match="module"):
        run_many(["pass"], module="solution")  # an option of run_checked only
    with pytest.raises(ValueError, match="memory_mb=0"):
        run_many_checked([("pass", "pass")], limits=SandboxLimits(), memory_mb=0)


# ---------------------------------------------------------------------------------------------------
# The child program
# ---------------------------------------------------------------------------------------------------


def test_child_program_imports_only_the_standard_library_and_its_own_folder():
    # The sandboxed interpreter must never import lopd_lightning (nor torch & co.): every module of the child's
    # folder imports the standard library and its siblings (relatively) only.
    import ast
    import sys
    from pathlib import Path

    import lopd_lightning.sandbox.child as child_package

    folder = Path(child_package.__file__).parent
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # a sibling
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                top = name.split(".")[0]
                # lopd_sandbox_child: this folder, as __main__.py names it when the sandbox runs it by path
                assert top in sys.stdlib_module_names or top in ("__future__", "lopd_sandbox_child"), (path, name)
    code = "import sys\nprint(sorted(m.split('.')[0] for m in sys.modules if m.startswith(('lopd', 'torch'))))"
    result = run_code(code, **FAST)
    assert result.ok and set(ast.literal_eval(result.stdout)) == {"lopd_sandbox_child"}, result


# ---------------------------------------------------------------------------------------------------
# Isolation modes
# ---------------------------------------------------------------------------------------------------


def test_isolation_report_says_which_isolation_a_run_gets(isolation):
    assert isolation["mode"] in ("bwrap", "namespaces+uid", "uid-only", "process-only")
    assert isolation["bwrap"] == (isolation["mode"] == "bwrap")
    if (isolation["root"] or isolation["user_switch"]) and isolation["mode"] != "uid-only":
        assert isolation["reads_all_files"] is False  # no CAP_DAC_READ_SEARCH kept any more
    if isolation["bwrap"]:
        assert isolation["pid_isolated"] and isolation["private_tmp"] and isolation["network_isolated"]
        fallback = isolation_report(bwrap=False)
        assert fallback["mode"] != "bwrap" and not fallback["bwrap"] and not fallback["pid_isolated"]


def test_bubblewrap_can_be_turned_off_or_required(monkeypatch):
    code = "import os\nprint(os.readlink('/proc/self/ns/pid'))"
    monkeypatch.setenv("LOPD_SANDBOX_BWRAP", "0")
    assert run_code(code, **FAST).stdout.strip() == MY_PID_NS  # the fallback: no PID namespace
    assert isolation_report()["mode"] != "bwrap"
    monkeypatch.delenv("LOPD_SANDBOX_BWRAP")
    assert run_code(code, bwrap=False, **FAST).stdout.strip() == MY_PID_NS
    if bwrap_available():
        assert run_code(code, bwrap=True, **FAST).stdout.strip() != MY_PID_NS
    else:
        with pytest.raises(RuntimeError, match="bubblewrap"):
            run_code(code, bwrap=True, **FAST)


# ---------------------------------------------------------------------------------------------------
# Plain data between the checker and the candidate
# ---------------------------------------------------------------------------------------------------

PLAIN_VALUES = [
    None, True, False, 0, -7, 2**64, -(2**70000), 1.5, -0.0, float("inf"), float("-inf"), 1e308, 5e-324,
    complex(1, -2), complex(float("inf"), 0.5), "", "héllo\n\x00\udcff", b"", b"\x00\xff", [], (), set(),
    frozenset(), {}, [1, [2, [3]]], (1,), (1, [2, (3,)]), [(1, 2), [1, 2]], {1, "a", (2, 3)},
    frozenset({frozenset({1})}), {"a": 1, 2: [3], (4, 5): {"x": None}, None: b"z", 1.5: frozenset({1})},
    [True, 1, 1.0], {True: "t"}, "x" * 100_000, list(range(1000)),
]


@pytest.mark.parametrize("value", PLAIN_VALUES, ids=[f"{type(v).__name__}-{i}" for i, v in enumerate(PLAIN_VALUES)])
def test_plain_data_round_trip_keeps_types(value):
    from lopd_lightning.sandbox.child.codec import decode, encode

    text = encode(value)
    assert "\n" not in text and text.isascii()
    back = decode(text)

    def same(a, b):  # equal, same exact types all the way down (tuple is not list, bool is not int)
        if type(a) is not type(b):
            return False
        if isinstance(a, float):
            return (a != a and b != b) or (a == b and math.copysign(1, a) == math.copysign(1, b))
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b

    assert same(value, back)
    assert same(float("nan"), decode(encode(float("nan"))))


class Sneaky(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


@pytest.mark.parametrize(
    "value",
    [Sneaky(1), [Sneaky(1)], object(), bytearray(b"x"), range(3), iter([1]), (x for x in []), type, print,
     {"k": object()}, [[[[[]]]]]],
    ids=["int-subclass", "nested-subclass", "object", "bytearray", "range", "iterator", "generator", "type",
         "function", "dict-value", "too-deep"],
)
def test_anything_else_is_not_plain_data(value):
    from lopd_lightning.sandbox.child.codec import NotPlainData, encode

    with pytest.raises(NotPlainData):
        encode(value, max_depth=4)


@pytest.mark.parametrize(
    "text",
    ['{"x": 1}', '{"t": 1}', '{"s": [[1]]}', '{"d": [[[1], 2]]}', '{"d": [1]}', '{"b": "zz"}',
     '{"i": "12"}', '{"c": ["1", 2]}', '{"t": [1], "s": [2]}', "[" * 5000 + "]" * 5000, "[1,", "",
     '{"__class__": "os.system"}', '"\\ud800" x'],
)
def test_decode_refuses_what_encode_never_makes(text):
    from lopd_lightning.sandbox.child.codec import decode

    with pytest.raises(ValueError):
        decode(text)


def test_decode_bounds_depth_and_size():
    from lopd_lightning.sandbox.child.codec import decode, encode

    deep = "[" * 150 + "]" * 150
    with pytest.raises(ValueError, match="deeper"):
        decode(deep)
    assert decode(deep, max_depth=200) is not None
    with pytest.raises(ValueError, match="values"):
        decode(encode(list(range(2000))), max_items=1000)


# ---------------------------------------------------------------------------------------------------
# Checks in another process (run_checked)
# ---------------------------------------------------------------------------------------------------

#: the candidate's own end of the channel: the pipe it answers on (found as any program could)
ANSWER_FD = """
import fcntl, os, stat
def answer_fd():
    for name in sorted(os.listdir('/proc/self/fd'), key=int):
        fd = int(name)
        try:
            if fd > 2 and stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & 3 == 1:
                return fd
        except OSError:
            pass
"""

CHECK_F = "f = candidate_function('f')\nassert f(1) == 2\nassert f(2) == 3\n"


def checked(program: str, checker: str = CHECK_F, **options):
    options = {**FAST, "python_guards": False, **options}
    start = time.monotonic()
    result = run_checked(program, checker, **options)
    assert time.monotonic() - start < options["timeout_s"] + 3.0, result
    return result


def test_checked_pass_and_fail():
    good = checked("def f(x):\n    return x + 1\n")
    assert good.passed and good.ok and good.status == "ok" and good.reason == "", good
    assert good.checker.ok and good.program.ok and good.isolation in ("bwrap", "namespaces+uid", "uid-only",
                                                                      "process-only")
    bad = checked("def f(x):\n    return x + 2\n")
    assert not bad.passed and bad.status == "error" and "AssertionError" in bad.reason, bad


def test_checked_values_keep_their_types_both_ways():
    program = "def echo(*args, **kwargs):\n    return [args, kwargs, [type(a).__name__ for a in args]]\n"
    checker = (
        "echo = candidate_function('echo')\n"
        "args = ((1, 2), [1, 2], {1, 2}, frozenset({3}), {(1, 2): b'x'}, 1.5, -0.0, 2 ** 100, 1j, None, True)\n"
        "back, kwargs, names = echo(*args, key=(1,))\n"
        "assert back == args and kwargs == {'key': (1,)}, back\n"
        "assert names == ['tuple', 'list', 'set', 'frozenset', 'dict', 'float', 'float', 'int', 'complex',"
        " 'NoneType', 'bool'], names\n"
        "assert type(back[0]) is tuple and type(back[1]) is list and str(back[6]) == '-0.0'\n"
        "nan = echo(float('nan'))[0][0]\nassert nan != nan\n"
    )
    result = checked(program, checker)
    assert result.passed, result


def test_checked_exceptions_travel_as_builtin_exceptions():
    program = (
        "class MyError(KeyError):\n    pass\n"
        "def f(kind):\n"
        "    if kind == 'value':\n        raise ValueError('bad value')\n"
        "    if kind == 'mine':\n        raise MyError('mine')\n"
        "    raise type('Custom', (Exception,), {})('odd')\n"
    )
    checker = (
        "f = candidate_function('f')\n"
        "try:\n    f('value')\nexcept ValueError as e:\n    assert 'bad value' in str(e)\n"
        "else:\n    raise SystemExit(5)\n"
        "try:\n    f('mine')\nexcept KeyError:\n    pass\nelse:\n    raise SystemExit(6)\n"
        "try:\n    f('other')\nexcept Exception as e:\n    assert type(e) is Exception and 'odd' in str(e), repr(e)\n"
    )
    assert checked(program, checker).passed


@pytest.mark.parametrize(
    "program, words",
    [
        ("class Yes:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Yes()\n",
         ["not plain built-in data"]),
        ("class Yes(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Yes(x + 1)\n",
         ["not plain built-in data"]),
        ("def f(x):\n    yield x + 1\n", ["generator"]),
        ("def f(x):\n    v = []\n    for _ in range(10 ** 5):\n        v = [v]\n    return v\n", ["deeper"]),
        ("def f(x):\n    return [0] * 10 ** 7\n", ["values"]),
        ("def f(x):\n    raise SystemExit(0)\n", ["SystemExit"]),
        ("def g(x):\n    return x + 1\n", ["does not define f"]),
        ("def f(x):\n    import os\n    os._exit(0)\n", ["ended", "candidate: exit status 0"]),
        ("def f(x):\n    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)\n", ["ended", "SIGKILL"]),
        (ANSWER_FD + "os.close(answer_fd())\ndef f(x):\n    return x + 1\n", ["ended"]),
        (ANSWER_FD + "os.write(answer_fd(), b'{\"n\":1,\"ok\":2}\\n')\ndef f(x):\n    return x + 1\n",
         ["before call|more than one answer|answered call 1 when call 2"]),
        (ANSWER_FD + "def f(x):\n    os.write(answer_fd(), b'garbage\\n')\n    return x + 1\n",
         ["not a valid|more than one answer"]),
        (ANSWER_FD + "def f(x):\n    os.write(answer_fd(), b'x' * (17 << 20))\n", ["longer than"]),
        (ANSWER_FD + "def f(x):\n    os.write(answer_fd(), b'{\"n\":1,\"ok\":{\"__reduce__\":1}}\\n')\n"
         "    import time\n    time.sleep(5)\n", ["not plain data"]),
        (ANSWER_FD + "def f(x):\n"
         "    os.write(answer_fd(), b'{\"n\":1,\"ok\":' + b'[' * 100000 + b']' * 100000 + b'}\\n')\n"
         "    import time\n    time.sleep(5)\n", ["not a valid message"]),
        ("import sys\ndef f(x):\n    sys._getframe(1).f_globals['encode'] = lambda v: '[' * 500 + ']' * 500\n"
         "    return x + 1\n", ["deeper"]),
        ("import sys\ndef f(x):\n    sys._getframe(1).f_globals['encode'] = lambda v: '{\"x\": 1}'\n"
         "    return x + 1\n", ["not plain data"]),
    ],
    ids=["always-equal", "int-subclass", "generator", "deep-recursion", "ten-million", "system-exit",
         "undefined", "exit-0", "kill-itself", "closes-its-channel", "answers-before-asked", "garbage",
         "huge-line", "unknown-tag", "json-bomb", "patched-encoder-deep", "patched-encoder-tag"],
)
def test_checked_breaches_by_the_candidate_fail_fast(program, words):
    result = checked(program)
    assert not result.passed and result.status != "timeout", result
    assert result.checker.returncode == 3 or "SystemExit" in words, result
    reason = result.reason.lower()
    assert all(any(w in reason for w in alternatives.lower().split("|")) for alternatives in words), result


def test_checked_candidate_that_never_answers_times_out():
    start = time.monotonic()
    result = checked("def f(x):\n    while True:\n        pass\n", timeout_s=1.0)
    assert not result.passed and result.status == "timeout" and "wall-clock" in result.reason, result
    assert time.monotonic() - start < 3.0


def test_checked_verdict_is_the_checkers_alone():
    # Whatever the candidate's process prints or how it ends counts for nothing: only the checks do.
    fake = "import os\nprint('All tests passed!')\nos.write(1, b'\\n' + b'0' * 32 + b'\\n')\nos._exit(0)\n"
    assert not checked(fake).passed
    # and a right answer passes whatever else the candidate does in its own process
    noisy = ("import builtins, sys\nbuiltins.AssertionError = KeyError\nsys.settrace(lambda *a: None)\n"
             "def f(x):\n    print('noise' * 1000)\n    return x + 1\n")
    assert checked(noisy).passed


def test_checked_processes_are_apart(isolation):
    program = (
        "import ctypes, os\nlibc = ctypes.CDLL(None)\n"
        "def f(x):\n    return [os.getuid(), os.readlink('/proc/self/ns/pid'), libc.prctl(3, 0, 0, 0, 0)]\n"
    )
    checker = (
        "import ctypes, os\nlibc = ctypes.CDLL(None)\n"
        "uid, pidns, dumpable = candidate_function('f')(0)\n"
        "print(uid, os.getuid(), pidns, os.readlink('/proc/self/ns/pid'), dumpable, libc.prctl(3, 0, 0, 0, 0))\n"
    )
    result = checked(program, checker)
    assert result.passed, result
    c_uid, k_uid, c_ns, k_ns, c_dump, k_dump = result.checker.stdout.split()
    assert k_dump == "0"  # the checker is non-dumpable: no same-uid process may trace or read it
    if isolation["user_switch"]:
        assert c_uid != k_uid and "0" not in (c_uid, k_uid)
    if isolation["pid_isolated"]:
        assert c_ns != k_ns


def test_checked_processes_hold_only_their_own_ends_of_the_channel():
    open_fds = ("import os\ndef fds():\n    out = []\n    for fd in range(256):\n        try:\n"
                "            os.fstat(fd)\n            out.append(fd)\n        except OSError:\n            pass\n"
                "    return out\n")
    checker = open_fds + "print(fds(), candidate_function('fds')())\n"
    result = checked(open_fds, checker)
    assert result.passed, result
    mine, theirs = result.checker.stdout.strip().split("] [")
    assert len(mine.split(",")) == 5 and len(theirs.split(",")) == 5, result.checker.stdout  # 0, 1, 2, r, w


def test_checked_program_runs_as_its_module_and_waits_for_the_checker():
    program = "MAIN = __name__ == '__main__'\ndef f(x):\n    return [__name__, MAIN]\n"
    checker = "print(candidate_function('f')(0))\n"
    result = checked(program, checker, module="solution")
    assert result.passed and result.checker.stdout.strip() == "['solution', False]", result


def test_run_many_checked_keeps_order():
    pairs = [(f"def f(x):\n    return x + {i}\n", CHECK_F) for i in (1, 2, 1)]
    results = run_many_checked(pairs, max_workers=2, **FAST)
    assert [r.passed for r in results] == [True, False, True]
    assert run_many_checked([]) == []


def test_checked_hide_covers_the_candidates_view_only():
    # What HumanEvalTask does with the folder of its data: the candidate sees an empty, read-only folder
    # there (where this mode can hide anything), the checker sees the files.
    import json

    # a folder both processes can see wherever the checkout lives (a checkout under /tmp is outside the
    # sandbox's view): the standard library's email package, which the child program does not import
    import email

    here = os.path.dirname(os.path.abspath(email.__file__))
    look = ("import os\ndef look():\n    try:\n        return [sorted(os.listdir(%r)), len(open(%r).read())]\n"
            "    except OSError as e:\n        return [[], -e.errno]\n" % (here, os.path.join(here, "__init__.py")))
    checker = look + "import json\nprint(json.dumps([look(), candidate_function('look')()]))\n"
    result = checked(look, checker, hide=[here, "/nonexistent/lopd"])
    assert result.passed, result
    (names, size), theirs = json.loads(result.checker.stdout)
    assert "__init__.py" in names and size > 0, result.checker.stdout
    if isolation_report()["hides_paths"]:
        assert theirs == [[], -2], theirs  # an empty folder: no such file


def test_isolation_report_says_what_a_mode_cannot_do(isolation):
    assert isolation["hides_paths"] == (isolation["mode"] in ("bwrap", "namespaces+uid"))
    assert isolation["checker_protected"] == (isolation["mode"] != "process-only")


def test_process_only_mode_warns_once(monkeypatch, caplog):
    import lopd_lightning.sandbox.checked as checked_module

    monkeypatch.setattr(checked_module, "_mode_name", lambda tool, **kw: "process-only")
    monkeypatch.setattr(checked_module, "_PROCESS_ONLY_WARNED", False)
    with caplog.at_level(logging.WARNING, logger="lopd_lightning.sandbox"):
        for _ in range(2):
            assert checked("def f(x):\n    return x + 1\n").passed
    warned = [r.getMessage() for r in caplog.records if "process-only" in r.getMessage()]
    assert len(warned) == 1 and os.path.join("sandbox", "child") in warned[0] and "forge" in warned[0], warned
