"""Provenance of a results file: enough to reproduce its numbers and to spot stale ones.

Every results file (sweeps, benchmarks, ``train evaluate``) starts with :func:`provenance`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# Data outside the repository is named by its content up to this size; larger (traces) by name only.
MAX_HASHED_BYTES = 256 << 20


def content_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, or of a directory's files: their relative paths and contents, sorted."""
    path = Path(path)
    if path.is_file():
        return sha256_of(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path).as_posix()}\0{sha256_of(file)}\n".encode())
    return digest.hexdigest()


def _size(path: Path) -> int:
    return (
        path.stat().st_size
        if path.is_file()
        else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    )


def portable_path(text: str) -> str:
    """A path as any machine can read it: relative inside the repository; outside it, existing data as
    ``name@sha256:<12 hex>`` of its content, anything else (an output, a large trace folder) as
    ``.../parent/name``. Never an absolute path of the machine that ran the command."""
    path = Path(os.path.abspath(text))
    if path.is_relative_to(REPO):
        return path.relative_to(REPO).as_posix() or "."
    if path.exists() and _size(path) <= MAX_HASHED_BYTES:
        return f"{path.name}@sha256:{content_sha256(path)[:12]}"
    return ".../" + "/".join(path.parts[-2:]) if len(path.parts) > 2 else ".../" + path.name


def _looks_like_path(text: str) -> bool:
    return os.path.isabs(text) or (("/" in text or text.startswith(".")) and os.path.exists(text))


def portable_argument(text: str) -> str:
    """One command-line argument with every path in it made :func:`portable_path` (``--opt=PATH``,
    ``name=PATH`` and comma lists too)."""
    if text.startswith("-") and "=" in text:
        option, value = text.split("=", 1)
        return f"{option}={portable_argument(value)}"
    if "," in text:
        return ",".join(portable_argument(part) for part in text.split(","))
    if _looks_like_path(text):
        return portable_path(text)
    if "=" in text:
        name, value = text.split("=", 1)
        return f"{name}={portable_argument(value)}" if _looks_like_path(value) else text
    return text


def _module_run(script: Path) -> str | None:
    """The module name when this process runs ``script`` as ``python -m <module>`` (argv[0] is then
    the module's file, which alone cannot tell ``-m eval.headroom`` from ``eval/headroom.py``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None or not spec.origin or Path(spec.origin).resolve() != script.resolve():
        return None
    return spec.name.removesuffix(".__main__")


def portable_command(argv: list[str]) -> str:
    """``argv`` as a command to run from the repository root: ``python -m eval ...`` for a module run
    or a package's ``__main__.py``, ``python bench/x.py ...`` for a script of the repository, paths
    as :func:`portable_path`."""
    program, *arguments = argv
    script = Path(os.path.abspath(program))
    if script.suffix == ".py" and script.is_relative_to(REPO):
        relative = script.relative_to(REPO)
        is_package_main = relative.name == "__main__.py" and len(relative.parts) == 2
        module = _module_run(script) or (relative.parts[0] if is_package_main else None)
        program = f"python -m {module}" if module else f"python {relative.as_posix()}"
    elif os.path.isabs(program):
        program = script.name  # a console script such as kvp-lm-eval
    return " ".join([program, *map(portable_argument, arguments)])


def portable_config(config) -> dict:
    """A dataclass's fields for a results file, every path in them as :func:`portable_path`."""
    return {k: portable_argument(v) if isinstance(v, str) else v for k, v in asdict(config).items()}


def git_commit() -> str:
    """The checkout's commit, with ``-dirty`` when tracked files have changed; ``unknown`` outside git."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def policy_record(policy) -> dict:
    """Name, weights sha256, calibration sha256 (None without one) and training record of a
    :class:`~kvp_cache.policy.KVPolicy`, or of a shipped name, directory or Hub id (loaded to read them)."""
    from kvp_cache.policy import KVPolicy, load_policy

    if not isinstance(policy, KVPolicy):
        policy = load_policy(policy)
    sha256 = getattr(policy, "weights_sha256", None)
    if sha256 is None:
        raise ValueError("this policy was not loaded from a safetensors file: save it and load it back first")
    return {
        "name": portable_argument(str(policy.source)),
        "sha256": sha256,
        "calibration_sha256": getattr(policy, "calibration_sha256", None),
        "training": policy.training_info,
    }


def provenance(
    model: str,
    dtype: torch.dtype | str,
    device: str | torch.device,
    policy=None,
    command: list[str] | None = None,
) -> dict:
    """The header of a results file: command, commit, versions, device, dtype, threads, model, policy."""
    import transformers

    return {
        "command": portable_command(command if command is not None else sys.argv),
        "kvp_cache": _version("kvp-cache"),
        "git_commit": git_commit(),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "lm_eval": _version("lm_eval"),
        },
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "model": model,
        "policy": policy_record(policy) if policy is not None else None,
    }
