"""Supervising the processes of one run (:func:`_supervise`): feed each its program, capture its output with a
cap, wait for the deciding process or the wall-clock limit, then kill every process of the run and reap them.
"""

from __future__ import annotations

import os
import selectors
import time

from lopd_lightning.sandbox.child import PROTOCOL_EXIT
from lopd_lightning.sandbox.procs import _kill_groups
from lopd_lightning.sandbox.spawn import _Child

#: Seconds to keep reading the pipes after the program has ended (buffered output of killed children).
_DRAIN_S = 0.5


def _supervise(children: list[_Child], deadline: float, decider: _Child, *, linger: float = 0.0) -> bool:
    """Feed each child its program, read stdout/stderr with a cap, wait until ``decider`` ends or the
    deadline passes, then kill and reap every child and drain the pipes. Returns True on timeout. When
    ``decider`` ends with exit status ``PROTOCOL_EXIT``, the others get up to ``linger`` seconds to end
    by themselves first (so that a candidate that died is reported as such, not as stopped)."""
    pipes = _Pipes()
    try:
        for child in children:
            pipes.add(child)
        timed_out = _wait(children, deadline, decider, linger, pipes)
        _stop(children, pipes)
    finally:
        pipes.close()
    return timed_out


class _Pipes:
    """The trainer's ends of the children's pipes on one selector: each program written to its child's stdin
    (never blocking), stdout, stderr and bubblewrap's info pipe read into their captures, and one pidfd per
    child (where the kernel has them) that wakes the loop when the child exits."""

    def __init__(self):
        self.sel = selectors.DefaultSelector()
        self.views: dict[int, tuple[memoryview, object]] = {}  # stdin fd -> (what is left to write, the stream)
        self.pidfds: dict[_Child, int] = {}

    def add(self, child: _Child) -> None:
        """Register the pipes (and pidfd) of ``child``."""
        proc, sel = child.proc, self.sel
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ, ("read", child.out))
        sel.register(proc.stderr.fileno(), selectors.EVENT_READ, ("read", child.err))
        if child.info_r is not None:
            sel.register(child.info_r, selectors.EVENT_READ, ("read", child.info))
        if child.data:
            os.set_blocking(proc.stdin.fileno(), False)
            self.views[proc.stdin.fileno()] = (memoryview(child.data), proc.stdin)
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, ("write", None))
        else:
            proc.stdin.close()
        if hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(proc.pid)
            except OSError:
                fd = None
            if fd is not None:
                self.pidfds[child] = fd
                sel.register(fd, selectors.EVENT_READ, ("exit", None))

    def pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a pipe (or pidfd) to be ready, and move what is ready."""
        for key, _ in self.sel.select(timeout):
            what, capture = key.data
            if what == "read":
                chunk = os.read(key.fd, 65536)
                if chunk:
                    capture.feed(chunk)
                else:
                    self.sel.unregister(key.fd)
            elif what == "write":
                view, stream = self.views[key.fd]
                try:
                    view = view[os.write(key.fd, view[:65536]) :]
                except BlockingIOError:
                    pass
                except BrokenPipeError:  # the program died before reading all of itself
                    view = view[:0]
                self.views[key.fd] = (view, stream)
                if not view:
                    self.sel.unregister(key.fd)
                    stream.close()

    def exited(self, child: _Child) -> None:
        """``child`` has ended: stop watching its pidfd (it stays readable)."""
        if child in self.pidfds:
            self.sel.unregister(self.pidfds[child])

    def drain(self) -> None:
        """After the kill: read what is left in the output pipes, for at most :data:`_DRAIN_S` seconds."""
        for fd in self.pidfds.values():
            if self.sel.get_map() is not None and fd in self.sel.get_map():
                self.sel.unregister(fd)
        drain_until = time.monotonic() + _DRAIN_S
        while any(key.data[0] == "read" for key in self.sel.get_map().values()):
            now = time.monotonic()
            if now >= drain_until:
                break
            self.pump(drain_until - now)

    def close(self) -> None:
        self.sel.close()
        for fd in self.pidfds.values():
            os.close(fd)


def _wait(children: list[_Child], deadline: float, decider: _Child, linger: float, pipes: _Pipes) -> bool:
    """Pump the pipes until ``decider`` ends (after a breach of the protocol: until every child ended or
    ``linger`` passed) or the deadline passes. Returns True on timeout."""
    linger_until = None
    while True:
        for child in children:
            if not child.exited_itself and child.exited():
                child.exited_itself = True
                pipes.exited(child)
        now = time.monotonic()
        if decider.exited_itself:
            if decider.exit_status != PROTOCOL_EXIT or all(child.exited_itself for child in children):
                return False
            linger_until = min(deadline, now + linger) if linger_until is None else linger_until
            if now >= linger_until:
                return False
            wait = linger_until - now
        elif now >= deadline:
            return True
        else:
            wait = deadline - now
        pipes.pump(min(wait, 0.05) if len(pipes.pidfds) < len(children) else wait)


def _stop(children: list[_Child], pipes: _Pipes) -> None:
    """Kill every process of the run (bubblewrap's PID namespaces included), reap the children, drain."""
    for child in children:  # what bubblewrap said it made (it writes that before the program runs)
        if child.info_r is not None and child.info_r in pipes.sel.get_map():
            pipes.sel.unregister(child.info_r)
            child.read_info()
    pidns = frozenset().union(*(child.pid_namespace() for child in children))
    _kill_groups([(child.proc.pid, child.uid) for child in children],
                 tree=any(child.bwrap for child in children), pidns=pidns)
    for child in children:
        child.reap()
    pipes.drain()
