"""Provenance of a results file: enough to reproduce its numbers and to spot stale ones.

Every results file (sweeps, benchmarks, ``train evaluate``) starts with :func:`provenance`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    """Name, weights sha256 and training record of a :class:`~kvp_cache.policy.KVPolicy`, or of a
    shipped name, directory or Hub id (loaded to read them)."""
    from kvp_cache.policy import KVPolicy, load_policy

    if not isinstance(policy, KVPolicy):
        policy = load_policy(policy)
    sha256 = getattr(policy, "weights_sha256", None)
    if sha256 is None:
        raise ValueError("this policy was not loaded from a safetensors file: save it and load it back first")
    return {"name": policy.source, "sha256": sha256, "training": policy.training_info}


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
        "command": " ".join(command if command is not None else sys.argv),
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
