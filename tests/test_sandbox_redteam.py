"""Red-team tests of the sandbox: each hostile program must end within its limit, give a failing result
with a clear ``reason``, and leave the host unharmed (no surviving process, no file written or deleted
outside its own directory, no signal delivered, no secret read).

Most attacks run with ``python_guards=False`` (or bypass the guards through ``ctypes``), so that they test
the OS-level limits rather than the Python-level monkeypatches. They run in the isolation mode this
machine gives by default (``ISO["mode"]``: bubblewrap when it is installed, else namespaces and a one-off
uid as root, else the process limits only); the attacks on what the modes do differently also run with
bubblewrap turned off when it is installed. A gap of the weakest mode ("process-only": the trainer is not
root and has no bubblewrap) is an ``xfail(strict=True)`` there, whose reason names the gap (see README,
"The sandbox: threat model"). Attacks that only hold with a one-off user id are skipped, with a reason,
without one; those that would harm the trainer itself if they succeeded are never run then.
"""

from __future__ import annotations

import ast
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from lopd_lightning.sandbox import isolation_report, run_code
from helpers import alive

ISO = isolation_report()
ROOT_ONLY = pytest.mark.skipif(
    not ISO["user_switch"], reason="needs a one-off user id, i.e. a trainer running as root"
)
#: the weakest mode: the program shares the trainer's uid, with no namespace (its gaps are xfails)
SHARED_UID = ISO["mode"] == "process-only"
#: the isolation of the fallback without bubblewrap (what a machine without it gets)
FALLBACK = isolation_report(bwrap=False) if ISO["bwrap"] else ISO
NO_GUARDS = dict(python_guards=False)
LIMIT = 1.5
#: wall-clock slack over the limit: killing, reaping and draining the pipes on 2 shared cores.
SLACK = 3.0


def modes(gap: str | None = None, *, when=lambda report: report["mode"] == "process-only") -> list:
    """bwrap= options to run a mode-dependent attack with: the default, and the fallback when bubblewrap
    is installed (the fallback must hold on machines without it). ``gap``: the reason of the strict
    xfail of a run whose isolation report satisfies ``when`` (by default: the "process-only" mode)."""
    def param(value, report: dict, name: str):
        marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap and when(report) else []
        return pytest.param(value, id=name, marks=marks)

    out = [param(None, ISO, "default")]
    if ISO["bwrap"]:
        out.append(param(False, FALLBACK, "no-bwrap"))
    return out


MODES = modes()

PRELUDE = (
    "import os\nprint('MARK', os.getpgid(0), os.getuid(), os.readlink('/proc/self/ns/pid'), flush=True)\n"
)
MY_PID_NS = os.readlink("/proc/self/ns/pid")



def _my_zombies() -> list[int]:
    """Zombie children of this (the trainer's) process: the sandbox must reap what it starts."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read()
        except OSError:
            continue
        state, ppid = fields[fields.rfind(")") + 2 :].split()[:2]
        if state == "Z" and int(ppid) == os.getpid():
            out.append(int(name))
    return out


def in_pid_namespace(ns: str) -> list[int]:
    """Live processes of the machine in PID namespace ``ns`` (a run under bubblewrap has its own)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != ns:
                continue
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(int(name))
    return found


def left_behind(stdout: str) -> list[int]:
    """Live processes of a run whose first line of output was the PRELUDE's mark: its process group
    and one-off uid or, when it had a PID namespace of its own (its pgid means nothing out here), that
    namespace and its uid."""
    mark = next((line.split() for line in stdout.splitlines() if line.startswith("MARK ")), None)
    if mark is None:
        return []
    pgid, uid, ns = int(mark[1]), int(mark[2]), mark[3]
    uid = uid if uid != os.getuid() else None
    if ns != MY_PID_NS:
        return in_pid_namespace(ns) + (alive(pgid=-1, uid=uid) if uid is not None else [])
    return alive(pgid=pgid, uid=uid)


def attack(code: str, *, timeout_s: float = LIMIT, **options):
    """Run ``PRELUDE + code``; check the time limit and that no process of the run survives."""
    start = time.monotonic()
    result = run_code(PRELUDE + code, timeout_s=timeout_s, memory_mb=options.pop("memory_mb", 256), **options)
    assert time.monotonic() - start < timeout_s + SLACK, result
    assert left_behind(result.stdout) == []
    assert _my_zombies() == []
    return result


def failed(result, *words: str) -> bool:
    """A failing result whose reason mentions all of ``words`` (case-insensitive)."""
    reason = result.reason.lower()
    return not result.ok and bool(reason) and all(w.lower() in reason for w in words)


#: what a program sees of what it may not reach: refused, or not there at all (a PID namespace, a
#: covered directory, a read-only file system)
OUT_OF_REACH = ("permission", "no such file", "no such process", "read-only file system")


def refused(result) -> bool:
    """A failing result whose reason says the target was refused or is out of sight."""
    return any(failed(result, word) for word in OUT_OF_REACH)


# ---------------------------------------------------------------------------------------------------
# Resource exhaustion
# ---------------------------------------------------------------------------------------------------

CTYPES_FORK_BOMB = """
import ctypes
libc = ctypes.CDLL(None)
while True:
    libc.fork()  # bypasses the Python-level guard on os.fork
"""

THREAD_BOMB = """
import threading, time
n = 0
while True:
    try:
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        n += 1
    except RuntimeError:
        print('threads', n, flush=True)
        while True:
            pass
"""


@pytest.mark.parametrize("code", [CTYPES_FORK_BOMB, THREAD_BOMB], ids=["ctypes-fork-bomb", "thread-bomb"])
def test_process_and_thread_bombs_are_bounded(code):
    result = attack(code)
    assert failed(result, "timeout")


def test_fork_bomb_with_guards_bypassed_is_bounded_by_nproc():
    # With the guards on, os.fork is refused; through ctypes, RLIMIT_NPROC stops the fork bomb.
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nn = 0\n"
        "for _ in range(10000):\n    pid = libc.fork()\n    if pid == 0:\n        import time; time.sleep(60)\n"
        "    if pid < 0:\n        break\n    n += 1\nprint('forked', n, flush=True)\n"
    )
    result = attack(code, max_processes=8)
    forked = int(next(line for line in result.stdout.splitlines() if line.startswith("forked")).split()[1])
    assert forked < 10000  # bounded: as root exactly by max_processes, else by the user's count + it
    if ISO["user_switch"]:
        assert forked <= 8


@pytest.mark.parametrize(
    "code",
    [
        "x = bytearray(2 ** 40)",
        "import mmap\nm = mmap.mmap(-1, 4 << 30)\nm[:] = b'x' * len(m)",
        "chunks = []\nwhile True:\n    chunks.append(b'x' * 10 ** 7)",
        "import os\nif os.fork() == 0:\n    chunks = []\n    while True:\n        chunks.append(b'x' * 10 ** 7)\n"
        "os.wait()\nraise MemoryError('child hit the limit too')",
    ],
    ids=["one-huge", "mmap-4g", "growing", "in-a-child"],
)
def test_memory_bombs(code):
    result = attack(code, **NO_GUARDS)
    assert result.status == "memory_limit" and failed(result, "memory limit"), result


def test_cpu_spin_in_many_threads_times_out():
    code = "import threading\ndef spin():\n    while True: pass\n" + "threading.Thread(target=spin).start()\n" * 4
    result = attack(code)
    assert result.status == "timeout" and failed(result, "timeout", "limit")


def test_huge_stdout_and_stderr_at_once_are_capped():
    code = (
        "import os, threading\n"
        "def err():\n    while True: os.write(2, b'e' * 65536)\n"
        "threading.Thread(target=err, daemon=True).start()\n"
        "while True: os.write(1, b'o' * 65536)\n"  # one endless line, no newline
    )
    result = attack(code, max_output_bytes=4096)
    assert result.status == "timeout"
    assert len(result.stdout) < 4096 + 200 and len(result.stderr) < 4096 + 200
    assert "bytes cut" in result.stdout and "bytes cut" in result.stderr


def test_one_file_past_the_size_limit_fails():
    code = "open('big', 'wb').write(b'x' * (3 << 20))"
    result = attack(code, max_file_mb=1)
    assert failed(result, "file too large"), result


def test_many_files_under_the_size_limit_cannot_fill_the_disk():
    if not ISO["private_tmp"]:
        pytest.xfail("gap: without a private tmpfs (trainer not root) total disk use is not capped")
    code = (
        "import os\nfor d in ('.', '/tmp', '/dev/shm'):\n    for i in range(200):\n"
        "        with open(os.path.join(d, 'fill%d' % i), 'wb') as f:\n            f.write(b'x' * (1 << 20))\n"
    )
    result = attack(code, max_file_mb=1, max_disk_mb=8, **NO_GUARDS)
    assert failed(result, "no space left"), result
    assert not any(p.startswith("fill") for p in os.listdir("/tmp") + os.listdir("/dev/shm"))


def test_inodes_are_capped():
    if not (ISO["private_tmp"] and ISO["user_switch"]):
        pytest.skip("the inode cap is part of root's private tmpfs (trainer runs as root)")
    result = attack("for i in range(10 ** 6):\n    open('f%d' % i, 'w').close()", max_disk_mb=1)
    assert failed(result, "no space left"), result


def test_many_open_files_fail():
    result = attack("fs = []\nwhile True:\n    fs.append(open('/dev/null'))")
    assert failed(result, "too many open files"), result


def test_infinite_recursion_fails():
    result = attack("def f(n):\n    return f(n + 1)\nf(0)")
    assert failed(result, "exit status 1", "recursion"), result


def test_stack_overflow_past_the_recursion_limit_is_a_crash():
    result = attack("import sys\nsys.setrecursionlimit(10 ** 7)\ndef f(n):\n    return f(n + 1) + 1\nf(0)")
    # the C stack overflows (SIGSEGV), or, on a slow machine, the limit comes first
    assert failed(result, "signal") or failed(result, "timeout"), result


def test_ctypes_segfault_is_a_crash():
    result = attack("import ctypes\nctypes.string_at(0)")
    assert result.returncode == -signal.SIGSEGV and failed(result, "segmentation fault"), result


# ---------------------------------------------------------------------------------------------------
# File system
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def home_decoy():
    """A file of the trainer's outside /tmp (so not under the private tmpfs): a stand-in for the test
    harness, the trainer's code or its checkpoints."""
    folder = Path.home() / ".cache" / "lopd_lightning" / f"redteam-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    decoy = folder / "harness.py"
    decoy.write_text("HARNESS = True\n")
    decoy.chmod(0o644)
    yield decoy
    for p in sorted(folder.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
    folder.rmdir()


@pytest.mark.parametrize("how", ["remove", "overwrite", "rmtree", "chmod"])
@pytest.mark.parametrize("bwrap", modes(gap="gap: a trainer that is not root (without bubblewrap) shares its uid "
                                        "with the program, whose unguarded writes reach every file of the trainer's"))
def test_deleting_or_changing_the_harness_fails(home_decoy, how, bwrap):
    folder = str(home_decoy.parent)
    code = {
        "remove": f"os.remove({str(home_decoy)!r})",
        "overwrite": f"open({str(home_decoy)!r}, 'w').write('HARNESS = False')",
        "rmtree": f"import shutil\nshutil.rmtree({folder!r})",
        "chmod": f"os.chmod({str(home_decoy)!r}, 0o777)",
    }[how]
    result = attack(code, bwrap=bwrap, **NO_GUARDS)
    assert home_decoy.read_text() == "HARNESS = True\n"
    assert stat.S_IMODE(home_decoy.stat().st_mode) == 0o644
    assert refused(result), result


@ROOT_ONLY
def test_writing_to_system_directories_fails():
    code = (
        "import os\nfor p in ('/etc/lopd-pwned', '/usr/lopd-pwned', '/root/lopd-pwned', '/lopd-pwned'):\n"
        "    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
        "    except OSError as e:\n        print('refused', p, e.errno)\nraise PermissionError('all refused')"
    )
    result = attack(code, **NO_GUARDS)
    assert "WROTE" not in result.stdout and failed(result, "permission"), result  # it raises PermissionError
    assert not any(os.path.exists(p) for p in ("/etc/lopd-pwned", "/usr/lopd-pwned", "/root/lopd-pwned"))


def test_symlink_escape_through_the_guards_is_refused():
    code = "os.symlink('/etc', 'etc')\nopen('etc/lopd-pwned', 'w').write('x')"
    result = attack(code)  # guards on: the path is resolved before the write
    assert failed(result, "permission") and "outside the working directory" in result.stderr
    assert not os.path.exists("/etc/lopd-pwned")


def test_cleanup_never_follows_a_symlink_out(home_decoy):
    # The program leaves a symlink to a trainer's file inside a read-only folder: removing the folder
    # fails for a trainer that is not root, and the clean-up must not chmod the link's target.
    code = f"os.mkdir('d')\nos.symlink({str(home_decoy)!r}, 'd/link')\nos.chmod('d', 0o500)\nraise SystemExit(1)"
    result = attack(code)
    assert failed(result, "exit status 1")
    assert stat.S_IMODE(home_decoy.stat().st_mode) == 0o644


def test_world_writable_directories_keep_nothing():
    if not ISO["private_tmp"]:
        pytest.xfail("gap: without a private tmpfs (trainer not root) an unguarded program can leave "
                     "files in /tmp and /dev/shm")
    name = f"lopd-redteam-{uuid.uuid4().hex[:8]}"
    code = f"for d in ('/tmp', '/var/tmp', '/dev/shm'):\n    open(d + '/{name}', 'w').write('x')\nraise SystemExit(3)"
    result = attack(code, **NO_GUARDS)
    assert failed(result, "exit status 3"), result
    assert not any(os.path.exists(f"{d}/{name}") for d in ("/tmp", "/var/tmp", "/dev/shm"))


@pytest.mark.parametrize("bwrap", modes(gap="gap: as root where no mount namespace can be made (\"uid-only\"), "
                                        "the one-off uid keeps CAP_DAC_READ_SEARCH to reach an interpreter in a "
                                        "root-only folder, so it reads every file",
                                        when=lambda report: bool(report["reads_all_files"])))
def test_reading_etc_shadow_fails(bwrap):
    # As root, the one-off uid has no capability left (the interpreter under /root is reachable through
    # the covered /root instead of CAP_DAC_READ_SEARCH): /etc/shadow (mode 0640, root:shadow) is refused.
    if not os.path.exists("/etc/shadow"):
        pytest.skip("no /etc/shadow here")
    result = attack("print(len(open('/etc/shadow').read()))", bwrap=bwrap)
    assert failed(result, "permission"), result
    assert "MARK" in result.stdout and len(result.stdout.splitlines()) == 1


def interpreter_folders_under(top: str) -> set[str]:
    """The names directly under ``top`` on the way to this interpreter's directories (its prefixes, its
    executable's folder, its import path): e.g. {'.pyenv'}, or {'.cache', '.pyenv'} for an environment that a
    tool keeps in ~/.cache."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable), *sys.path}
    names = set()
    for path in filter(None, paths):
        for form in {path, os.path.realpath(path)}:
            rest = os.path.relpath(form, top)
            if not rest.startswith(".." + os.sep) and rest not in ("..", "."):
                names.add(rest.split(os.sep)[0])
    return names


@ROOT_ONLY
@pytest.mark.parametrize("bwrap", modes(gap="gap: as root where no mount namespace can be made (\"uid-only\"), "
                                        "nothing is covered: the one-off uid keeps CAP_DAC_READ_SEARCH to reach an "
                                        "interpreter in a root-only folder",
                                        when=lambda report: bool(report["reads_all_files"])))
def test_root_only_directories_are_covered_but_the_interpreter_imports(bwrap):
    # /root (0700) holds this interpreter (pyenv) on many machines, or its environment (~/.cache/...): the
    # program sees only the interpreter's own directories there, read-only, and still imports what
    # HumanEval's tests import; wherever the environment lives.
    code = (
        "import sys, collections, fractions, functools, hashlib, heapq, itertools, json, math, random, re, "
        "statistics, string, typing, ctypes, decimal, datetime\n"
        "print(hashlib.sha256(b'x').hexdigest()[:8], math.gcd(12, 18))\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
        "try:\n    print(sorted(os.listdir('/root')))\nexcept OSError as e:\n    print('refused', e.errno)\n"
        "open('/root/lopd-pwned', 'w')\n"
    )
    result = attack(code, bwrap=bwrap, **NO_GUARDS)
    lines = result.stdout.splitlines()
    assert lines[1] == "2d711642 6", result
    assert int(lines[2], 16) == 0  # no capability at all
    if lines[3].startswith("["):  # listed: only the folders on the way to the interpreter's own directories
        assert set(ast.literal_eval(lines[3])) <= interpreter_folders_under("/root"), result
    else:
        assert lines[3].startswith("refused"), result
    assert refused(result) and not os.path.exists("/root/lopd-pwned"), result


# ---------------------------------------------------------------------------------------------------
# The trainer's process: environment, /proc, signals
# ---------------------------------------------------------------------------------------------------


@pytest.mark.xfail(SHARED_UID, strict=True,
                   reason="gap: a trainer that is not root (without bubblewrap) shares its uid with the "
                          "program, which can read the trainer's /proc entries (environ, cwd, fds, maps)")
@pytest.mark.parametrize("entry", ["environ", "cwd", "fd", "maps", "mem"])
def test_parent_proc_entries_are_closed(entry, monkeypatch):
    monkeypatch.setenv("LOPD_REDTEAM_SECRET", "hunter2")
    pid = os.getpid()
    code = {
        "environ": f"print(open('/proc/{pid}/environ', 'rb').read())",
        "cwd": f"print(os.listdir('/proc/{pid}/cwd'))",
        # as root the fd numbers can be listed (CAP_DAC_READ_SEARCH); what they point to cannot be read
        "fd": f"for n in os.listdir('/proc/{pid}/fd'):\n    print(os.readlink('/proc/{pid}/fd/' + n))",
        "maps": f"print(open('/proc/{pid}/maps').read()[:100])",
        "mem": f"f = open('/proc/{pid}/mem', 'rb')\nprint(f.read(1))",
    }[entry]
    result = attack(code, **NO_GUARDS)
    assert "hunter2" not in result.stdout
    assert refused(result), result  # a PID namespace (bubblewrap) does not even show the trainer


@pytest.fixture
def decoy_process():
    """A process of the trainer's that the program will try to kill or stop."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.xfail(SHARED_UID, strict=True,
                   reason="gap: a trainer that is not root (without bubblewrap) shares its uid with the "
                          "program, which can signal the trainer's processes")
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP", "SIGTERM"])
def test_signalling_the_trainers_processes_fails(decoy_process, sig):
    code = f"import signal\nos.kill({decoy_process.pid}, signal.{sig})"
    result = attack(code, **NO_GUARDS)
    time.sleep(0.1)
    with open(f"/proc/{decoy_process.pid}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    assert decoy_process.poll() is None and state not in ("T", "t", "Z"), state
    assert refused(result), result


@ROOT_ONLY  # never run where it would work: kill(-1) from the trainer's own uid kills the test run
def test_kill_everything_and_the_parent_fails(decoy_process):
    code = (
        "import signal\n"
        "try:\n    os.kill(-1, signal.SIGKILL)  # every process it may signal (but itself): none\n"
        "except PermissionError:\n    pass\n"
        "os.kill(os.getppid(), signal.SIGKILL)\n"
    )
    result = attack(code, **NO_GUARDS)
    assert decoy_process.poll() is None
    assert refused(result), result  # under bubblewrap its parent is the namespace's init


def test_ignoring_sigterm_and_stopping_itself_time_out():
    code = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nos.kill(os.getpid(), signal.SIGSTOP)"
    result = attack(code)
    assert result.status == "timeout" and failed(result, "wall-clock"), result


def test_stopped_and_zombie_children_are_cleaned_up():
    code = (
        "import signal, time\n"
        "for _ in range(3):\n    if os.fork() == 0:\n        os._exit(0)\n"  # zombies: never waited for
        "pid = os.fork()\nif pid == 0:\n    time.sleep(60)\n"
        "os.kill(pid, signal.SIGSTOP)\ntime.sleep(0.2)\nraise SystemExit(2)"
    )
    result = attack(code, **NO_GUARDS)
    assert failed(result, "exit status 2"), result


DAEMON = """
import sys, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        os.close(w)
        for s in range(1, 32):
            try:
                import signal; signal.signal(s, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
        time.sleep(5)
        os._exit(0)
    os._exit(0)
os.close(w)
print('DAEMON', os.read(r, 32).decode(), flush=True)
raise SystemExit(4)
"""


@pytest.mark.parametrize("bwrap", modes(gap="gap: a trainer that is not root (without bubblewrap) cannot tell "
                                        "the program's processes from its own once one leaves the session with "
                                        "setsid() (no cgroup, no pid namespace)"))
def test_daemonised_grandchild_is_killed(bwrap):
    result = attack(DAEMON, bwrap=bwrap, **NO_GUARDS)  # checks that nothing of the run is left
    assert failed(result, "exit status 4"), result
    if MY_PID_NS not in result.stdout:
        return  # the printed pid is its PID namespace's own: attack() found nothing left in there
    pid = int(next(line for line in result.stdout.splitlines() if line.startswith("DAEMON")).split()[1])
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    if state not in ("gone", "Z", "X"):
        os.kill(pid, signal.SIGKILL)  # do not leave it behind (the gap case)
    assert state in ("gone", "Z", "X")


# ---------------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def listener():
    """A TCP server of the trainer's on 127.0.0.1 (a stand-in for a local service: a metrics server, a
    database, a cloud metadata proxy)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0)
    yield server
    server.close()


@pytest.mark.skipif(not ISO["network_isolated"], reason="no privilege for a network namespace here")
@pytest.mark.parametrize("target", ["loopback", "external", "udp", "abstract-unix"])
def test_network_attempts_fail(listener, target):
    port = listener.getsockname()[1]
    code = {
        "loopback": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5)",
        "external": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=0.5)",
        "udp": "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.sendto(b'x', ('8.8.8.8', 53))",
        "abstract-unix": "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('\\0lopd-redteam')",
    }[target]
    if target == "abstract-unix":
        server = socket.socket(socket.AF_UNIX)
        server.bind("\0lopd-redteam")
        server.listen()
    try:
        result = attack(code, **NO_GUARDS)
    finally:
        if target == "abstract-unix":
            server.close()
    assert failed(result, "exit status 1"), result
    assert any(w in result.reason.lower() for w in ("unreachable", "refused", "connectionrefused")), result
    with pytest.raises(BlockingIOError):
        listener.accept()


# ---------------------------------------------------------------------------------------------------
# Privilege
# ---------------------------------------------------------------------------------------------------


@ROOT_ONLY
def test_becoming_root_again_fails():
    code = "import ctypes\nos.setuid(0)"
    result = attack(code, **NO_GUARDS)
    assert failed(result, "permission"), result


# ---------------------------------------------------------------------------------------------------
# Hidden paths: the task's data (hide=), the checker's program, world-writable directories
# ---------------------------------------------------------------------------------------------------

#: the folder and the file hidden from the program below: the test suite (what a reward hacker would look
#: for) and a file next to it; a sibling file stays in sight (the control)
REPO = Path(__file__).resolve().parent.parent
HIDDEN_FOLDER, HIDDEN_FILE, CONTROL_FILE = REPO / "tests", REPO / "README.md", REPO / "pyproject.toml"

HIDE_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
FOLDER, FILE, CONTROL, HANDLE = {folder!r}, {file!r}, {control!r}, {handle!r}
def attempt(tag, folder=FOLDER, file=FILE):
    try:
        names = os.listdir(folder)
    except OSError:
        names = []
    if names:
        print('LISTED', tag, len(names), flush=True)
    for p in [file] + [os.path.join(folder, n) for n in names[:5]]:
        try:
            with open(p, 'rb') as f:
                if f.read(1):
                    print('READ', tag, p, flush=True)
        except OSError:
            pass
attempt('plain')
try:
    with open(CONTROL, 'rb') as f:
        print('CONTROL', len(f.read(10)), flush=True)
except OSError as e:
    print('control refused', e.errno, flush=True)
try:
    open(os.path.join(FOLDER, 'lopd-pwned'), 'w').write('x')
    print('WROTE', flush=True)
except OSError as e:
    print('write refused', e.errno, flush=True)
# A user and mount namespace of its own, where it holds every capability: unmount the covers, or bind
# the parent folder without its sub-mounts to see what lies under them.
if libc.unshare(0x10000000 | 0x20000) == 0:  # CLONE_NEWUSER | CLONE_NEWNS
    for p in (FOLDER, FILE):
        if libc.umount2(p.encode(), 2) == 0:  # MNT_DETACH
            print('UNMOUNTED', p, flush=True)
    attempt('after-umount')
    os.makedirs('peek', exist_ok=True)
    parent = os.path.dirname(FOLDER)
    if libc.mount(parent.encode(), b'peek', None, 0x1000, None) == 0:  # MS_BIND, not recursive
        print('BOUND', flush=True)
        attempt('bind', os.path.join('peek', os.path.basename(FOLDER)), os.path.join('peek', os.path.basename(FILE)))
else:
    print('no user namespace', ctypes.get_errno(), flush=True)
# The hidden file's handle (as the trainer saw it: a guess at best): open it by handle, not by path.
if HANDLE is not None:
    class Handle(ctypes.Structure):
        _fields_ = [('size', ctypes.c_uint), ('type', ctypes.c_int), ('data', ctypes.c_ubyte * 128)]
    handle = Handle(len(HANDLE[1]), HANDLE[0])
    handle.data[:len(HANDLE[1])] = list(HANDLE[1])
    for d in ('/', os.path.dirname(FILE), '.'):
        try:
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        fd = libc.open_by_handle_at(dfd, ctypes.byref(handle), os.O_RDONLY)
        if fd >= 0 and os.read(fd, 1):
            print('READ by handle', d, flush=True)
raise SystemExit(5)
"""


def _file_handle(path) -> tuple[int, bytes] | None:
    """(type, bytes) of ``name_to_handle_at(path)``, or None where the file system has none."""
    import ctypes

    class Handle(ctypes.Structure):
        _fields_ = [("size", ctypes.c_uint), ("type", ctypes.c_int), ("data", ctypes.c_ubyte * 128)]

    libc = ctypes.CDLL(None, use_errno=True)
    handle, mount_id = Handle(128, 0), ctypes.c_int()
    if libc.name_to_handle_at(-100, os.fsencode(path), ctypes.byref(handle), ctypes.byref(mount_id), 0) != 0:
        return None
    return handle.type, bytes(handle.data[: handle.size])


@pytest.mark.parametrize("bwrap", modes(gap="gap: without a mount namespace (a trainer that is not root and has no "
                                        "bubblewrap, or \"uid-only\"), hide= cannot cover anything: the program "
                                        "reads every file the trainer's uid (or its one-off uid) may read",
                                        when=lambda report: not report["hides_paths"]))
def test_hidden_folders_and_files_are_out_of_sight(bwrap):
    # What run_checked(hide=...) does for HumanEval's data (tasks/code.py): a folder and a file the
    # program could read otherwise are covered, empty and read-only, and neither a namespace trick nor
    # the file's handle uncovers them.
    code = HIDE_PROBE.format(folder=str(HIDDEN_FOLDER), file=str(HIDDEN_FILE), control=str(CONTROL_FILE),
                             handle=_file_handle(HIDDEN_FILE))
    try:
        result = attack(code, bwrap=bwrap, hide=[str(HIDDEN_FOLDER), str(HIDDEN_FILE)], **NO_GUARDS)
    finally:
        pwned = HIDDEN_FOLDER / "lopd-pwned"
        if pwned.exists():
            pwned.unlink()
            pytest.fail("the program wrote into the hidden folder")
    assert failed(result, "exit status 5"), result
    for sign in ("LISTED", "READ", "WROTE", "UNMOUNTED", "BOUND"):
        assert sign not in result.stdout, result.stdout
    if ISO["user_switch"] and bwrap is False:
        assert "CONTROL 10" in result.stdout, result.stdout  # what is not hidden stays readable


def _digest(path: str) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _checker_files() -> list[str]:
    """The checker's own program: the child program's files (its entry first), then the rest of the sandbox
    package (the trainer's side)."""
    import lopd_lightning.sandbox as sandbox_module
    import lopd_lightning.sandbox.child as child_package

    child = Path(os.path.realpath(child_package.__file__)).parent
    package = Path(os.path.realpath(sandbox_module.__file__)).parent
    rest = sorted(str(p) for p in [*child.glob("*.py"), *package.glob("*.py")] if p.name != "__main__.py")
    return [str(child / "__main__.py"), *rest]


@pytest.mark.parametrize("bwrap", modes(gap="gap: a trainer that is not root (without bubblewrap) shares its uid "
                                        "with the program, which can rewrite the checker's own program "
                                        "(sandbox/child/, sandbox/) and every file of the trainer's: every "
                                        "later verdict could be forged (see the warning of run_checked)",
                                        when=lambda report: report["mode"] == "process-only"
                                        and os.access(_checker_files()[0], os.W_OK)))
def test_rewriting_the_checkers_program_fails(bwrap):
    # With the guards on: _io.open is not wrapped, so they are no obstacle. The files are opened for
    # appending and closed unchanged (nothing is written even where that is allowed).
    targets = _checker_files()
    before = [_digest(p) for p in targets]
    code = (
        f"import _io\nfor p in {targets!r}:\n    try:\n        _io.open(p, 'ab').close()\n"
        "        print('WRITABLE', p, flush=True)\n    except OSError as e:\n        print('refused', p, e)\n"
        "raise PermissionError(13, 'all refused')\n"
    )
    result = attack(code, bwrap=bwrap)
    assert [_digest(p) for p in targets] == before
    assert "WRITABLE" not in result.stdout, result.stdout
    assert refused(result), result


def world_writable_directories(max_depth: int = 4) -> list[str]:
    """Directories any user may write to (``o+w``), at most ``max_depth`` below ``/`` (not /proc, /sys),
    not below one another."""
    found = []
    stack = [("/", 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if not entry.is_dir(follow_symlinks=False) or entry.path in ("/proc", "/sys"):
                    continue
                if entry.stat(follow_symlinks=False).st_mode & stat.S_IWOTH:
                    found.append(entry.path)
                elif depth + 1 < max_depth:
                    stack.append((entry.path, depth + 1))
            except OSError:
                continue
    return sorted(found)


@pytest.mark.parametrize("bwrap", modes(gap="gap: without a mount namespace (a trainer that is not root and has no "
                                        "bubblewrap, or \"uid-only\"), the world-writable directories are the "
                                        "host's: what the program writes there stays",
                                        when=lambda report: not report["private_tmp"]))
def test_every_world_writable_directory_keeps_nothing(bwrap):
    # /tmp, /var/tmp and /dev/shm are private tmpfs; every other world-writable directory (/run/lock,
    # /var/lock, /var/mail, ...) must not keep a file or folder of the program's either.
    folders = sorted({*world_writable_directories(), *(d for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
                                                       if os.path.isdir(d))})
    name = f"lopd-left-{uuid.uuid4().hex[:8]}"
    code = (
        f"for d in {folders!r}:\n"
        "    for make in (lambda p: open(p, 'x').write('x'), os.mkdir):\n"
        f"        p = os.path.join(d, {name!r} + ('' if make is os.mkdir else '.f'))\n"
        "        try:\n            make(p)\n            print('WROTE', p, flush=True)\n"
        "        except OSError as e:\n            print('refused', p, e.errno, flush=True)\n"
        "raise SystemExit(6)\n"
    )
    try:
        result = attack(code, bwrap=bwrap, **NO_GUARDS)
    finally:
        left = [os.path.join(d, name + suffix) for d in folders for suffix in ("", ".f")]
        left = [p for p in left if os.path.lexists(p)]
        for p in left:
            os.rmdir(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    assert left == [], f"left on the host: {left}"
    assert failed(result, "exit status 6"), result


def _sysv_keys() -> dict[str, set[int]]:
    """The keys of the host's System V IPC objects (shared memory, message queues, semaphores)."""
    keys = {}
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                keys[kind] = {int(line.split()[0]) for line in f.readlines()[1:] if line.strip()}
        except OSError:
            keys[kind] = set()
    return keys


def _remove_sysv(key: int, owner: int | None) -> None:
    """Remove what a program left under ``key`` (the gap case): as this user, then as the program's own
    uid (a root trainer without CAP_SYS_ADMIN may not remove another user's objects; their owner may)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def remove() -> None:
        for get, args, ctl in ((libc.shmget, (0, 0), libc.shmctl), (libc.msgget, (0,), libc.msgctl),
                               (libc.semget, (0, 0), libc.semctl)):
            ident = get(key, *args)
            if ident >= 0:
                ctl(ident, 0, 0, None) if ctl is libc.semctl else ctl(ident, 0, None)  # IPC_RMID

    remove()
    if owner is None or owner == os.getuid() or not any(key in keys for keys in _sysv_keys().values()):
        return
    pid = os.fork()
    if pid == 0:  # a child that becomes the owner, removes, and exits at once
        try:
            os.setgroups([])
            os.setresgid(owner, owner, owner)
            os.setresuid(owner, owner, owner)
            remove()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


@pytest.mark.parametrize("bwrap", modes(gap="gap: without namespaces (a trainer that is not root and has no "
                                        "bubblewrap, or \"uid-only\") System V IPC objects are the host's: a "
                                        "segment the program leaves outlives it (and its one-off uid)",
                                        when=lambda report: not report["private_tmp"]))
def test_system_v_ipc_objects_do_not_outlive_the_run(bwrap):
    if not os.path.exists("/proc/sysvipc/shm"):
        pytest.skip("no /proc/sysvipc here")
    key = 0x10D0000 + int(uuid.uuid4().hex[:4], 16)
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"print('shm', libc.shmget({key}, 1 << 20, 0o1666), 'msg', libc.msgget({key}, 0o1666), "
        f"'sem', libc.semget({key}, 1, 0o1666), flush=True)\nraise SystemExit(7)\n"
    )
    result = None
    try:
        result = attack(code, bwrap=bwrap, **NO_GUARDS)
        left = [kind for kind, keys in _sysv_keys().items() if key in keys]
    finally:
        mark = next((line.split() for line in (result.stdout if result else "").splitlines()
                     if line.startswith("MARK ")), None)
        _remove_sysv(key, int(mark[2]) if mark else None)
    assert failed(result, "exit status 7") and "shm -1" not in result.stdout, result
    assert left == [], f"left on the host: {left}"
