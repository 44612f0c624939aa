"""The child program's entry point (:func:`main`, called by :mod:`.__main__`) and the three roles it runs a
program in: ``"program"`` (:func:`lopd_lightning.sandbox.run_code`), ``"candidate"`` and ``"checker"``
(:func:`lopd_lightning.sandbox.run_checked`; see the package docstring).
"""

from __future__ import annotations

import builtins
import json
import os
import sys

from . import SETUP_FAILED_EXIT
from .channel import _Checker, _Lines, _serve
from .stages import _confine, _exec_bwrap, _stage1


def _read_program() -> bytes:
    """The program: stdin read to its end, then replaced with ``/dev/null``."""
    chunks = []
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return b"".join(chunks)



def _run(cfg, source: bytes) -> None:
    """Run the program ``source`` in the role ``cfg["role"]`` (the process is set up and confined)."""
    import types

    role = cfg["role"]
    channel = cfg.get("channel")
    if role == "candidate":
        requests = _Lines(channel[0])
        hello = requests.readline()  # the checker is non-dumpable before this comes
        if hello != b'{"hello":1}':
            os._exit(0)
    elif role == "checker":
        checker = _Checker(channel[0], channel[1])
        checker.send(b'{"hello":1}\n')
    name = cfg.get("module") or "__main__"
    module = types.ModuleType(name)
    module.__builtins__ = builtins  # the module, as in any __main__
    if role == "checker":
        module.candidate_function = checker.function
    sys.modules[name] = module
    if name != "__main__":
        sys.modules["__main__"] = module
    sys.argv[:] = ["<sandbox>"]
    try:
        code = compile(source, "<sandbox>", "exec")
        del source
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        raise SystemExit(1)
    if role == "candidate":
        _serve(module.__dict__, requests, channel[1])
    elif role == "checker":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main() -> None:
    """The child's entry point: read the run's settings (JSON, ``sys.argv[1]``: role, limits, mounts,
    uid), set the limits and isolation up, then run the candidate's program or the checker. Exits with
    ``SETUP_FAILED_EXIT`` (125) when the limits cannot be set (the program never runs)."""
    cfg = json.loads(sys.argv[1])
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if cfg["role"] == "checker":
            libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0, before anything else
        source = _read_program()
        here = os.path.dirname(os.path.realpath(__file__))  # this folder: sys.path[0], run by path
        sys.path[:] = [p for p in sys.path if p not in ("", ".", cfg["tmp"], here)]
        if cfg["stage"] == 1:
            _stage1(libc, cfg)
            if cfg["bwrap"]:
                _exec_bwrap(cfg, source)
        _confine(libc, cfg)
    except BaseException as exc:
        os.write(2, ("lopd sandbox: setup failed: %r\n" % (exc,)).encode())
        os._exit(SETUP_FAILED_EXIT)
    _run(cfg, source)

