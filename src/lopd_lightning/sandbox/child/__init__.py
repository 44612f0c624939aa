"""The sandbox's child program: trusted code that runs first in every sandboxed process.

How it starts: :mod:`lopd_lightning.sandbox` runs ``python -s .../lopd_lightning/sandbox/child/__main__.py CONFIG``,
the file *by path* (the run's settings as JSON in ``argv[1]``, the program on stdin), never ``python -m``: the
sandboxed interpreter must not import ``lopd_lightning`` (nor torch or anything else it imports), and need not
even have it installed. Every module of this folder imports only the standard library and its siblings (relative
imports); :mod:`.__main__` loads the folder as the package ``lopd_sandbox_child``, every module at once, before
stage 1 may take the folder out of view (a checkout under /tmp is under the program's private ``/tmp``), then
calls :func:`.main.main`. The trainer imports this package only for the plain-data codec (:mod:`.codec`) and the
exit statuses below.

Modules: :mod:`.codec` (plain data <-> one line of tagged JSON, shared with the trainer), :mod:`.channel` (the
protocol between the checker and the candidate), :mod:`.guards` (the Python-level guards), :mod:`.mounts` (the
private mount namespace of a root trainer), :mod:`.stages` (limits, bubblewrap, the one-off uid), :mod:`.main`
(the entry point and the roles).

What it does, in order (the promises are in :mod:`lopd_lightning.sandbox`):

1. reads the program from stdin to the end and replaces stdin with ``/dev/null``;
2. *stage 1*: as root, a private mount namespace in which the directories on the way to the
   interpreter that other users may not cross (``/root`` for ``/root/.pyenv``) are covered by a small
   tmpfs with only the interpreter's own directories bound back, read-only (so the one-off user id
   needs no capability to import its standard library), the ``cover`` paths (``hide=``) covered by
   nothing, every mount made read-only, then fresh size-limited tmpfs on the working directory,
   ``/tmp``, ``/var/tmp`` and ``/dev/shm``; an empty network namespace and an IPC namespace of its own;
   in every mode, the resource limits but the address space, and ``PR_SET_PDEATHSIG``;
3. with bubblewrap: stage 1 executes ``bwrap`` (new PID, IPC and UTS namespaces, a read-only view of
   the file system but the temporary directories, a fresh ``/dev`` and ``/proc``, the ``cover`` paths
   covered; when not root, also a user and network namespace and the trainer's home covered, this folder
   bound back), which starts *stage 2* of this program (the program travels in a memfd on stdin);
4. the last stage drops to the one-off user id with no capability (root), sets ``PR_SET_PDEATHSIG``,
   the Python-level guards and the address-space limit, and runs the program in its *role*:

   * ``"program"``: the program as ``__main__`` (:func:`lopd_lightning.sandbox.run_code`);
   * ``"candidate"``: the program as module ``module`` (its functions), then answers calls from the
     checker process on its channel, one line per call, with results encoded as plain data;
   * ``"checker"``: made non-dumpable first (``PR_SET_DUMPABLE 0``: a same-uid process cannot trace it
     or read its memory), it runs the checks with ``candidate_function(name)`` in their globals: a
     proxy that sends the arguments to the candidate process and decodes its answer with
     :func:`.codec.decode` (``json.loads`` of a tagged encoding: never ``pickle``, ``marshal`` or
     ``eval``). Any breach of the protocol by the candidate process (an answer that is not plain data,
     garbage, an answer too long, an answer before the question, a closed channel) ends the checker at
     once with exit status :data:`PROTOCOL_EXIT` and a line ``lopd checker: <why>`` on stderr; an
     exception of the candidate's function is raised in the checks as its nearest built-in exception
     class (looked up by name in ``builtins``; a ``SystemExit`` or ``KeyboardInterrupt`` ends the run),
     else ``RuntimeError``.

The protocol on the channel (a pipe pair that only these two processes hold), one JSON object a line:
the checker first sends ``{"hello": 1}`` (after it made itself non-dumpable; the candidate's program
runs only after it); then ``{"n": N, "call": [name, args, kwargs]}`` (encoded), answered by
``{"n": N, "ok": value}``, ``{"n": N, "raise": [exception name, message]}`` or
``{"n": N, "fatal": why}``.
"""

#: Exit status when the limits could not be set up (the program never ran).
SETUP_FAILED_EXIT = 125
#: Exit status of the checker when the candidate's process broke the protocol.
PROTOCOL_EXIT = 3
