"""The sandbox holds against hostile programs: each test runs one in a child with a 1-2 s limit."""

from __future__ import annotations

import os
import time

import pytest

from lopd_lightning.sandbox import SandboxResult, isolation_report, run_code, run_many
from helpers import alive

FAST = dict(timeout_s=1.5, memory_mb=256)


@pytest.fixture(scope="module")
def isolation() -> dict:
    return isolation_report()



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


FORK_BOMB = """
import os
print(os.getpgid(0), os.getuid(), flush=True)
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
    pgid, uid = map(int, result.stdout.split()[:2])
    assert alive(pgid=pgid, uid=uid if uid != os.getuid() else None) == []


def test_fork_is_refused_by_the_python_guards():
    result = run_code("import os\nos.fork()", **FAST)
    assert result.status == "error" and "starting processes is refused" in result.stderr
    result = run_code("import subprocess\nsubprocess.run(['true'])", **FAST)
    assert result.status == "error" and "starting processes is refused" in result.stderr


def test_child_escaping_its_session_is_killed(isolation):
    if not isolation["user_switch"]:
        pytest.skip("escaping the session is only caught with a one-off user id (trainer runs as root)")
    code = (
        "import os, time\nprint(os.getpgid(0), os.getuid(), flush=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(0.2)"
    )
    result = run_code(code, timeout_s=1.5, python_guards=False)
    assert result.status == "ok"
    pgid, uid = map(int, result.stdout.split()[:2])
    assert alive(pgid=pgid, uid=uid) == []


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
