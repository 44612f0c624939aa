"""What a run of ``benchmarks/compare.py`` ran on besides its code: the start student's weights, the pretrained
composer, the experience bank and the library versions (issue 33, item 4).

:func:`run_provenance` is called by ``compare.run_one`` at run time, after the bank is prepared and before
``lopd fit`` starts, on the files the run's config names (paths relative to the repository root, where the
runs start), and again after the fit (:func:`changed_files`: a file that changed under a run is refused).
Its dict goes into each attempt and into the run file as ``provenance``:

- ``student_hash``: the first 16 hex digits of the SHA-256 of ``<model.init_args.model>/model.safetensors``
  (a student saved in shards, or as an adapter: :func:`tree_hash` of its ``*.safetensors`` files; a registry
  name such as ``tiny``, with no folder: None).
- ``composer_hash``: of ``<composer_path>/composer.pt``, the file ``fit`` loads (not its checkpoints or
  TensorBoard folder, which a resumed pretraining adds to); None for a run without ``composer_path``.
- ``bank_hash``: :func:`tree_hash` of every file in ``bank_path`` (``experiences.jsonl``,
  ``embeddings.npy``, ``meta.json``) for a run that reads a bank (LOPD and its ablations; OPSD with
  ``privileged_context: retrieved``); None otherwise.
- ``versions``: the versions of :data:`LIBRARIES` installed in the interpreter that runs ``lopd`` (the
  ``--lopd`` executable's, e.g. ``.venv-vllm``'s, not this script's), read from the package metadata without
  importing them (:func:`library_versions`); a library that is not importable is left out.

Files are hashed as a stream (1 MiB at a time) and cached by ``(path, size, mtime)`` within the process, so the
start student's 0.5 GB are read once however many runs use them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import REPO_ROOT

#: import name -> what the versions record calls it (vllm only where it is importable).
LIBRARIES = ("torch", "transformers", "lightning", "peft", "faiss", "vllm")
COMPOSER_FILE = "composer.pt"  # lopd_lightning.composer.model.COMPOSER_FILE (not imported: no torch here)
CHUNK = 1 << 20
_CACHE: dict[tuple[str, int, int], str] = {}

#: run by the interpreter of ``lopd``: prints ``{"python": ..., library: version}`` as JSON.
VERSIONS_SCRIPT = """
import importlib.metadata as md, importlib.util, json, platform
distributions = md.packages_distributions()
out = {"python": platform.python_version()}
for lib in LIBS:
    if importlib.util.find_spec(lib) is None:
        continue
    dists = distributions.get(lib) or [lib]
    try:
        out[lib] = md.version(dists[0])
    except md.PackageNotFoundError:
        out[lib] = None
print(json.dumps(out, sort_keys=True))
"""


# ---------------------------------------------------------------------- hashing
def file_sha256(path: str | os.PathLike[str]) -> str:
    """The full hex SHA-256 of a file, read in 1 MiB chunks; cached by (resolved path, size, mtime_ns).

    Raises:
        FileNotFoundError: ``path`` is not a file.
    """
    path = Path(path).resolve()
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _CACHE:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            while block := fh.read(CHUNK):
                digest.update(block)
        _CACHE[key] = digest.hexdigest()
    return _CACHE[key]


def tree_hash(folder: str | os.PathLike[str], pattern: str = "**/*") -> str | None:
    """The first 16 hex digits of a SHA-256 over ``relative path \\0 file SHA-256`` of every file matching
    ``pattern`` under ``folder``, in sorted order (None: no such file)."""
    folder = Path(folder)
    files = sorted(p for p in folder.glob(pattern) if p.is_file())
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + file_sha256(path).encode())
    return digest.hexdigest()[:16]


def _local(path: str | None) -> Path | None:
    """A config path as the run reads it (relative to the repository root), or None when it names nothing there."""
    if not path:
        return None
    resolved = Path(path) if Path(path).is_absolute() else REPO_ROOT / path
    return resolved if resolved.exists() else None


def student_hash(model: str | None) -> str | None:
    """The start student's weights hash (see the module docstring); None for a name with no folder."""
    folder = _local(model)
    if folder is None or not folder.is_dir():
        return None
    single = folder / "model.safetensors"
    return file_sha256(single)[:16] if single.is_file() else tree_hash(folder, "*.safetensors")


def composer_hash(composer_path: str | None) -> str | None:
    """The hash of ``<composer_path>/composer.pt``; None without a composer path.

    Raises:
        FileNotFoundError: ``composer_path`` is set and holds no ``composer.pt`` (the run would fail too).
    """
    if not composer_path:
        return None
    folder = _local(composer_path)
    if folder is None or not (folder / COMPOSER_FILE).is_file():
        raise FileNotFoundError(f"model.init_args.composer_path {composer_path!r} holds no {COMPOSER_FILE}: pretrain "
                                "it first (`lopd pretrain-composer`, see the LOPD config's header)")
    return file_sha256(folder / COMPOSER_FILE)[:16]


def missing_composers(configs: list[dict[str, Any]]) -> list[str]:
    """The ``composer_path`` values of ``configs`` that hold no ``composer.pt`` (sorted, each once)."""
    paths = {c.get("model", {}).get("init_args", {}).get("composer_path") for c in configs}
    return sorted(p for p in paths if p and not ((_local(p) or Path("/nonexistent")) / COMPOSER_FILE).is_file())


def reads_bank(init_args: dict[str, Any], class_path: str) -> bool:
    """Whether a run reads its ``bank_path``: LOPD (every module with a bank) does; OPSD only with
    ``privileged_context: retrieved``."""
    if not init_args.get("bank_path"):
        return False
    if class_path.endswith("OPSDModule"):
        return init_args.get("privileged_context", "reference") == "retrieved"
    return True


def bank_hash(config: dict[str, Any]) -> str | None:
    """The hash of the bank folder a run reads (:func:`reads_bank`), None for a run without one.

    Raises:
        FileNotFoundError: the run reads a bank whose folder holds no file.
    """
    model = config.get("model", {})
    init = model.get("init_args", {})
    if not reads_bank(init, str(model.get("class_path", ""))):
        return None
    folder = _local(init["bank_path"])
    digest = tree_hash(folder) if folder is not None else None
    if digest is None:
        raise FileNotFoundError(f"model.init_args.bank_path {init['bank_path']!r} holds no bank to hash")
    return digest


# ---------------------------------------------------------------------- library versions
_VERSIONS: dict[tuple[str, tuple[str, ...]], dict[str, str | None]] = {}
_CAPABILITIES: dict[str, str | None] = {}


def interpreter_of(command: list[str]) -> str:
    """The Python interpreter that runs ``command`` (a ``lopd`` console script: its ``#!`` line; ``python -m``:
    that python); this interpreter when neither can be read."""
    first = command[0]
    if len(command) > 1 and command[1] == "-m":
        return first
    try:
        with open(first, "rb") as fh:
            line = fh.readline(512).decode(errors="replace")
    except OSError:
        return sys.executable
    return line[2:].strip().split()[0] if line.startswith("#!") and line[2:].strip() else sys.executable


def library_versions(python: str | None = None, libraries: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    """``{"python": version, library: version}`` of ``libraries`` (default :data:`LIBRARIES`) importable by
    ``python`` (default this interpreter), read from package metadata in a subprocess of that interpreter
    (nothing is imported); cached per interpreter and list.

    Raises:
        RuntimeError: the interpreter cannot run the script (the message names it).
    """
    python = python or sys.executable
    key = (python, tuple(libraries))
    if key not in _VERSIONS:
        script = f"LIBS = {list(libraries)!r}\n{VERSIONS_SCRIPT}"
        try:
            out = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=120, check=True).stdout
        except (OSError, subprocess.SubprocessError) as error:
            raise RuntimeError(f"cannot read the library versions of {python}: {error}") from None
        _VERSIONS[key] = json.loads(out.strip().splitlines()[-1])
    return dict(_VERSIONS[key])


def cpu_capability_of(python: str | None = None) -> str | None:
    """``torch.backends.cpu.get_cpu_capability()`` as the interpreter ``python`` (default this one) sees it, in
    this process's environment (``ATEN_CPU_CAPABILITY`` lowers it): the instruction set its float kernels
    dispatch to. Read in a subprocess (torch is imported there, not here), cached per interpreter; None when
    that interpreter has no torch or cannot run (a run is never failed over it)."""
    python = python or sys.executable
    if python not in _CAPABILITIES:
        try:
            out = subprocess.run([python, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                                 capture_output=True, text=True, timeout=300, check=True).stdout
            _CAPABILITIES[python] = out.strip().splitlines()[-1] or None
        except (OSError, subprocess.SubprocessError, IndexError):
            _CAPABILITIES[python] = None
    return _CAPABILITIES[python]


def versions_key(versions: dict[str, Any] | None) -> str | None:
    """A short fingerprint (8 hex) of a versions dict, for messages and ``--versions``; None for None."""
    if versions is None:
        return None
    return hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:8]


# ---------------------------------------------------------------------- one run
def file_provenance(config: dict[str, Any]) -> dict[str, str | None]:
    """``student_hash``, ``composer_hash`` and ``bank_hash`` of a run config (see the module docstring)."""
    init = config.get("model", {}).get("init_args", {})
    return {"student_hash": student_hash(init.get("model")), "composer_hash": composer_hash(init.get("composer_path")),
            "bank_hash": bank_hash(config)}


def run_provenance(config: dict[str, Any], lopd: list[str] | None = None) -> dict[str, Any]:
    """The provenance a run file records: :func:`file_provenance` plus ``versions`` (:func:`library_versions`
    of the interpreter of the ``lopd`` command ``lopd``; None: this interpreter) and ``versions_key``."""
    versions = library_versions(interpreter_of(lopd) if lopd else None)
    return {**file_provenance(config), "versions": versions, "versions_key": versions_key(versions)}


def changed_files(before: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """The file hashes of ``before`` (:func:`run_provenance`) that differ now, as ``"bank_hash a -> b"``."""
    now = file_provenance(config)
    return [f"{key} {before.get(key)} -> {value}" for key, value in now.items() if before.get(key) != value]
