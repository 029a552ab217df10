"""Finding and reading a KVP policy's files: shipped name, local directory or Hub repo; strict safetensors.

A policy is a directory with ``config.json`` (the ``KVPolicy`` arguments, see :func:`read_config`)
and ``model.safetensors``, and optionally ``calibration.safetensors`` (the per-head scale that makes
its scores comparable across heads, :func:`read_calibration`), which config.json then records with
its sha256. Names resolve in a fixed order (:func:`resolve_local`): a policy shipped
in ``kvp_cache/policies/``, then a local directory, then a Hub repo id. Weights load only from
safetensors and must match the config key for key and shape; pickle checkpoints are refused
without being opened, since unpickling can run code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from torch import Tensor, nn

POLICIES_DIR = Path(__file__).resolve().parent / "policies"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CALIBRATION_NAME = "calibration.safetensors"
CALIBRATION_KEYS = ("temperature", "weight")
"""The tensors of ``calibration.safetensors``, each ``[evicting layers, kv_heads]`` float32, positive."""
PICKLE_PATTERNS = ("pytorch_model.bin", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")

# Architecture keys config.json must hold; the rest of the config are optional settings and metadata.
ARCHITECTURE_KEYS = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "hidden_dim",
    "pos_dim",
    "max_positions",
    "num_mlp_layers",
)
# layer_indices is optional: policies saved before hybrid models were supported have agents for every layer.
OPTIONAL_KEYS = (
    "layer_indices",
    "position_strategy",
    "trained_length",
    "age_decay",
    "base_model",
    "training",
    "kvp_cache_version",
    "calibration",
)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` looks like a Hub repo id (``owner/name``) and is not an existing local path."""
    return bool(name) and bool(HUB_ID.match(name)) and not Path(name).expanduser().exists()


def shipped_policies() -> list[str]:
    """Names of the policies shipped in ``kvp_cache/policies/`` (dirs with config.json and model.safetensors)."""
    if not POLICIES_DIR.is_dir():
        return []
    return sorted(
        d.name for d in POLICIES_DIR.iterdir() if (d / CONFIG_NAME).is_file() and (d / WEIGHTS_NAME).is_file()
    )


def _shipped_names() -> str:
    """The shipped policy names for an error message."""
    return ", ".join(shipped_policies()) or "none shipped"


def resolve_local(name_or_path: str | Path) -> Path | None:
    """The directory a shipped name or a local path points to; None for a Hub repo id.

    Shipped names win over local directories, which win over Hub ids, so a shipped name is never
    looked up on the Hub. Anything else (a name without '/', a missing path) is an error.
    """
    name = str(name_or_path)
    if not isinstance(name_or_path, Path) and name in shipped_policies():
        return POLICIES_DIR / name
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(
            f"Policy path {name!r} is a file; pass the directory holding config.json and {WEIGHTS_NAME}"
        )
    if isinstance(name_or_path, str) and HUB_ID.match(name):
        return None
    if "/" not in name and "\\" not in name:
        raise ValueError(
            f"Unknown policy {name!r}: not a shipped policy ({_shipped_names()}), "
            "a local directory or a Hub repo id ('owner/name')"
        )
    raise ValueError(f"Policy directory {name!r} does not exist (and it is not a Hub repo id 'owner/name')")


def _local_files(directory: Path) -> tuple[Path, Path]:
    config_file, weights_file = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    if not weights_file.is_file():
        pickles = sorted({p.name for pattern in PICKLE_PATTERNS for p in directory.glob(pattern)})
        if pickles:
            raise ValueError(
                f"Policy directory {str(directory)!r} holds only pickle checkpoints ({', '.join(pickles)}) and no "
                f"{WEIGHTS_NAME}; kvp_cache loads safetensors only (pickle files can run code when loaded). "
                "Convert it with KVPolicy.save_pretrained from a trusted environment."
            )
        raise ValueError(f"Policy directory {str(directory)!r} has no {WEIGHTS_NAME}")
    if not config_file.is_file():
        raise ValueError(f"Policy directory {str(directory)!r} has no {CONFIG_NAME}")
    return config_file, weights_file


def _hub_file(repo_id: str, filename: str, **download) -> Path:
    """Download (or find in the HF cache) one file of a Hub policy."""
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=filename, **download))
    except LocalEntryNotFoundError:
        raise ValueError(
            f"Policy {repo_id!r} ({filename}) is not in the local Hugging Face cache and could not be downloaded "
            "(HF_HUB_OFFLINE=1, local_files_only=True or no network). Download it once with "
            f"`hf download {repo_id}`, or pass a local directory or a shipped policy "
            f"({_shipped_names()})."
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"Hub repo {repo_id!r} does not exist or is private (pass token=... for a private repo)"
        ) from None
    except EntryNotFoundError:
        hint = (
            " kvp_cache loads only safetensors weights, never pickle checkpoints."
            if filename in (WEIGHTS_NAME, CALIBRATION_NAME)
            else ""
        )
        raise ValueError(
            f"Hub repo {repo_id!r} has no {filename}; it is not a kvp_cache policy.{hint}"
        ) from None
    except HfHubHTTPError as error:
        raise ValueError(f"Could not download {filename} of policy {repo_id!r}: {error}") from None


def policy_files(name_or_path: str | Path, **download) -> tuple[Path, Path]:
    """``config.json`` and ``model.safetensors`` of a shipped name, a local directory or a Hub repo id.

    ``download`` goes to ``hf_hub_download`` for Hub ids (revision, token, cache_dir, ...).
    """
    directory = resolve_local(name_or_path)
    if directory is not None:
        return _local_files(directory)
    return _hub_file(str(name_or_path), CONFIG_NAME, **download), _hub_file(
        str(name_or_path), WEIGHTS_NAME, **download
    )


def calibration_file(name_or_path: str | Path, recorded: bool, **download) -> Path | None:
    """The policy's ``calibration.safetensors``, or None when it has none.

    recorded: whether its config.json records a calibration. A local directory must hold the file
    exactly when it is recorded (a calibration config.json does not vouch for is refused); a Hub
    repo is asked for it only when recorded.
    """
    directory = resolve_local(name_or_path)
    if directory is None:
        return _hub_file(str(name_or_path), CALIBRATION_NAME, **download) if recorded else None
    path = directory / CALIBRATION_NAME
    if recorded and not path.is_file():
        raise ValueError(
            f"Policy directory {str(directory)!r}: config.json records a calibration but {CALIBRATION_NAME} "
            "is missing; copy it with the policy or remove the 'calibration' entry of config.json"
        )
    if not recorded and path.exists():
        raise ValueError(
            f"Policy directory {str(directory)!r} holds {CALIBRATION_NAME} but config.json records no "
            "calibration; write it with KVPolicy.save_pretrained (which records its sha256) or remove it"
        )
    return path if recorded else None


def read_config(config_file: Path, source: str) -> dict:
    """The ``KVPolicy.__init__`` arguments recorded in a policy's config.json (strict about its keys)."""
    try:
        config = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"Policy {source!r}: config.json is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"Policy {source!r}: config.json must hold a JSON object")
    missing = [key for key in ARCHITECTURE_KEYS if key not in config]
    unknown = sorted(set(config) - set(ARCHITECTURE_KEYS) - set(OPTIONAL_KEYS))
    if missing or unknown:
        raise ValueError(
            f"Policy {source!r}: config.json is not a kvp_cache policy config"
            + (f"; missing keys {missing}" if missing else "")
            + (f"; unknown keys {unknown} (saved by a newer kvp_cache?)" if unknown else "")
        )
    config.pop("kvp_cache_version", None)
    return config


def read_weights(weights_file: Path, source: str) -> dict[str, Tensor]:
    """The tensors of a policy's ``model.safetensors``, on CPU (a clear error for a corrupt file)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(weights_file), device="cpu")
    except SafetensorError as error:
        raise ValueError(
            f"Policy {source!r}: {weights_file.name} is not a valid safetensors file ({error})"
        ) from None


def read_calibration(
    calibration_file: Path, source: str, recorded: dict, shape: tuple[int, int]
) -> dict[str, Tensor]:
    """The :data:`CALIBRATION_KEYS` tensors of a policy's ``calibration.safetensors``, strictly: the
    file's sha256 must be the one config.json records, with exactly those keys, each of ``shape``
    (``[evicting layers, kv_heads]``), finite and positive."""
    from kvp_cache.provenance import sha256_of

    if not isinstance(recorded, dict) or not isinstance(recorded.get("sha256"), str):
        raise ValueError(f"Policy {source!r}: config.json's 'calibration' must be a dict with its 'sha256'")
    found = sha256_of(calibration_file)
    if found != recorded["sha256"]:
        raise ValueError(
            f"Policy {source!r}: {CALIBRATION_NAME} has sha256 {found[:12]}..., config.json records "
            f"{recorded['sha256'][:12]}...; the calibration belongs to another policy or was edited"
        )
    tensors = read_weights(calibration_file, source)
    missing = sorted(set(CALIBRATION_KEYS) - set(tensors))
    extra = sorted(set(tensors) - set(CALIBRATION_KEYS))
    shapes = [
        f"{key}: file {tuple(tensors[key].shape)} vs policy {shape}"
        for key in sorted(set(CALIBRATION_KEYS) & set(tensors))
        if tuple(tensors[key].shape) != shape
    ]
    if missing or extra or shapes:
        problems = [
            f"missing keys: {missing}" if missing else "",
            f"unexpected keys: {extra}" if extra else "",
            f"shape mismatches: {shapes}" if shapes else "",
        ]
        raise ValueError(
            f"Policy {source!r}: {CALIBRATION_NAME} does not match its config.json "
            f"({'; '.join(p for p in problems if p)}); refusing to load a partial calibration."
        )
    return {key: tensors[key].float() for key in CALIBRATION_KEYS}


def check_state_dict(policy: nn.Module, state: dict[str, Tensor], source: str) -> None:
    """Raise ``ValueError`` unless ``state`` has exactly the policy's keys with the same shapes."""
    expected = policy.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    shapes = [
        f"{key}: file {tuple(state[key].shape)} vs config {tuple(expected[key].shape)}"
        for key in sorted(set(expected) & set(state))
        if state[key].shape != expected[key].shape
    ]
    if missing or extra or shapes:

        def some(names: list[str]) -> str:
            return ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")

        problems = []
        if missing:
            problems.append(f"missing keys: {some(missing)}")
        if extra:
            problems.append(f"unexpected keys: {some(extra)}")
        if shapes:
            problems.append(f"shape mismatches: {some(shapes)}")
        raise ValueError(
            f"Policy {source!r}: {WEIGHTS_NAME} does not match its config.json ({'; '.join(problems)}); "
            "refusing to load a partial policy."
        )
