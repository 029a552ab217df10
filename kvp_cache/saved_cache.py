"""Saving a ``KVPCache`` and loading it back, in this process or another: compress once, ask many times.

A saved cache is a directory of two files:

- ``cache.safetensors``: every layer's tensors, ``layers.{i}.keys`` and ``layers.{i}.values``
  ``[batch, kv_heads, slots, head_dim]`` (for an ``allocation="layer"``/``"head"`` layer its heads
  packed, ``[batch, slots, head_dim]``, with each head's length among the layer's counters) and, for an
  evicting layer, its per-row state (:attr:`~kvp_cache.cache.EvictingLayer.BATCH_FIELDS`: ``valid``,
  ``seen_real``, stored ``scores`` with NaN for pending ones, tracked ``positions``, ``entered``
  with an age decay) and
  ``recent_queries.*``, the queries captured since its last eviction;
- ``cache_config.json``: the cache's settings (method and its options, with the KVP policy's name
  and weights sha256, and for an adaptive allocation its calibration's sha256; budget; schedule;
  allocation), the model it was computed with (shape, dtype, the sha256 of
  its config and of a sample of its weights), the transformers cache layout (the layer class of each
  index), each layer's counters (logical length, compressed flag, ...), the kvp_cache version and
  the sha256 of the tensor file.

:func:`load_cache` rebuilds the cache with ``KVPCache(model, ...)`` from the recorded settings and
restores every layer, so it continues exactly as the saved one would have: decoding appends, a
``first_prefill`` cache that already compressed never evicts again, and pending scores, captured
queries and padding slots carry over. It refuses, naming what differs, a cache saved for another
model or another cache layout, a tensor file whose sha256 is not the recorded one, missing or
extra tensors, and pickle files (never opened: unpickling can run code).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from fnmatch import fnmatch
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvp_cache.cache import EvictingLayer, KVPCache
from kvp_cache.compat import attention_shape, text_config
from kvp_cache.policy import KVPolicy, load_policy, shipped_policies
from kvp_cache.policy_loading import PICKLE_PATTERNS
from kvp_cache.provenance import sha256_of
from kvp_cache.ragged import RaggedLayer
from kvp_cache.scorers import QueryStates, Scorer
from kvp_cache.scorers.kvp import KVPScorer
from kvp_cache.scorers.registry import SCORERS

CONFIG_NAME = "cache_config.json"
TENSORS_NAME = "cache.safetensors"
FORMAT = "kvp_cache.saved_cache"
LAYOUT_VERSION = 1
"""What each layer class stores (see :func:`layer_state`); a different number is a different layout."""

# The transformers layers a KVPCache holds beside its EvictingLayers. Their state is keys, values and,
# for sliding windows, the logical length; it is the same in every supported transformers release.
PLAIN_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
EVICTING_COUNTERS = ("cumulative_length", "appended_since_eviction", "compressed")
RAGGED_COUNTERS = (*EVICTING_COUNTERS, "lengths", "pending_forward", "holds_padding")
EVICTING_LAYERS = (EvictingLayer, RaggedLayer)
SETTINGS = (
    "budget",
    "sink_tokens",
    "window_tokens",
    "compress",
    "max_cache_tokens",
    "evict_every",
    "track_positions",
    "allocation",
    "min_per_head",
)
POLICY_SETTINGS = ("position_strategy", "trained_length")  # changeable after loading, and they change scores
# Config entries that describe how a model was loaded or run, not the keys and values it computes.
RUNTIME_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "architectures",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "attn_implementation",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
WEIGHT_SAMPLES = 64


# ---- saving -----------------------------------------------------------------------------------


def save_cache(cache: KVPCache, model: torch.nn.Module | None, save_directory: str | Path) -> Path:
    """Write ``cache`` (computed with ``model``) to ``save_directory``: see the module docstring."""
    if model is None:
        raise ValueError(
            "save_pretrained needs the model the cache was computed with: only a cache built with "
            "KVPCache(model, ...) can be saved (a config-built one does not know the model's weights)"
        )
    if cache.context.in_forward:
        raise RuntimeError("save_pretrained was called during a forward; save the cache between forwards")
    layout = cache_layout(cache)
    method = method_record(cache.settings.scorer, cache.settings.allocation)
    records, tensors = [], {}
    for i, layer in enumerate(cache.layers):
        record, layer_tensors = layer_state(layer)
        records.append(record)
        tensors.update({f"layers.{i}.{name}": tensor for name, tensor in layer_tensors.items()})

    from kvp_cache import __version__  # kvp_cache/__init__.py defines it after importing its modules

    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors_file, config_file = directory / TENSORS_NAME, directory / CONFIG_NAME
    # Own CPU copies: safetensors refuses views that share storage (captured queries can).
    save_file(
        {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}, tensors_file
    )
    config = {
        "format": FORMAT,
        "kvp_cache_version": __version__,
        "method": method,
        "settings": {name: getattr(cache.settings, name) for name in SETTINGS},
        "model": model_identity(model),
        "cache_layout": layout,
        "layers": records,
        "tensors": {"file": TENSORS_NAME, "sha256": sha256_of(tensors_file)},
    }
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # safetensors writes owner-only (0600) files: give the tensors the mode the umask gave the config.
    tensors_file.chmod(config_file.stat().st_mode & 0o777)
    return directory


def cache_layout(cache: KVPCache) -> dict:
    """The transformers cache layout: the layer class (and sliding window) of each index."""
    layers = []
    for i, layer in enumerate(cache.layers):
        if type(layer) not in EVICTING_LAYERS + PLAIN_LAYERS:
            raise ValueError(
                f"layer {i} of this cache is a {type(layer).__name__}; a saved cache holds "
                f"{', '.join(cls.__name__ for cls in EVICTING_LAYERS + PLAIN_LAYERS)} layers only"
            )
        kind = {"class": type(layer).__name__}
        if hasattr(layer, "sliding_window"):
            kind["sliding_window"] = layer.sliding_window
        layers.append(kind)
    return {"version": LAYOUT_VERSION, "transformers": transformers.__version__, "layers": layers}


def layer_state(layer) -> tuple[dict, dict[str, torch.Tensor]]:
    """One layer's JSON record (counters, tensor names) and its tensors, by name within the layer."""
    if not layer.is_initialized:
        return {"initialized": False, "tensors": [], "counters": {}, "recent_queries": None}, {}
    recent = None
    if isinstance(layer, EvictingLayer):
        tensors = {
            name: getattr(layer, name) for name in layer.BATCH_FIELDS if getattr(layer, name) is not None
        }
        names = RAGGED_COUNTERS if isinstance(layer, RaggedLayer) else EVICTING_COUNTERS
        counters = {name: getattr(layer, name) for name in names}
        if layer.recent_queries is not None:
            recent = {}
            for field in dataclasses.fields(QueryStates):
                value = getattr(layer.recent_queries, field.name)
                if isinstance(value, torch.Tensor):
                    tensors[f"recent_queries.{field.name}"] = value
                else:
                    recent[field.name] = value
    else:
        tensors = {"keys": layer.keys, "values": layer.values}
        counters = (
            {"cumulative_length": int(layer.cumulative_length)} if hasattr(layer, "cumulative_length") else {}
        )
    record = {"initialized": True, "tensors": sorted(tensors), "counters": counters, "recent_queries": recent}
    return record, tensors


def method_record(scorer: Scorer, allocation: str = "uniform") -> dict:
    """The method's registry name and options; for ``kvp``, the policy's name and weights sha256
    (and, for an adaptive ``allocation``, its calibration's sha256)."""
    if SCORERS.get(scorer.name) is not type(scorer):
        raise ValueError(
            f"this cache uses an unregistered {type(scorer).__name__} instance; only caches of registered "
            "methods (kvp_cache.available_methods()) can be saved, since loading rebuilds the method by name"
        )
    options = {field.name: getattr(scorer, field.name) for field in dataclasses.fields(scorer)}
    record = {"name": scorer.name, "options": options}
    if isinstance(scorer, KVPScorer):
        policy = options.pop("policy")
        if getattr(policy, "weights_sha256", None) is None:
            raise ValueError(
                "this cache's KVP policy was not loaded from a safetensors file, so a reloaded cache could not "
                "find it: save it with policy.save_pretrained(dir) and build the cache with policy=dir"
            )
        source = str(policy.source)
        if source not in shipped_policies() and Path(source).expanduser().is_dir():
            source = str(Path(source).expanduser().resolve())  # found from any working directory
        record["policy"] = {"source": source, "sha256": policy.weights_sha256} | {
            name: getattr(policy, name) for name in POLICY_SETTINGS
        }
        if allocation != "uniform":  # the calibration decides each head's share at the next eviction
            record["policy"]["calibration_sha256"] = getattr(policy, "calibration_sha256", None)
    return record


def model_identity(model: torch.nn.Module) -> dict:
    """What a saved cache records of its model: shape, dtype, config (and its sha256), weights sample sha256."""
    config = text_config(model.config)
    shape = attention_shape(config)
    settings = config_settings(config)
    return {
        "name_or_path": getattr(config, "name_or_path", "") or "",
        "model_type": config.model_type,
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "dtype": str(model.dtype).removeprefix("torch."),
        "config_sha256": hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest(),
        "weights_sample_sha256": weights_sample_sha256(model),
        "config": settings,
    }


def config_settings(config) -> dict:
    """The decoder config as JSON, without the entries of :data:`RUNTIME_CONFIG_KEYS`."""
    settings = json.loads(config.to_json_string(use_diff=False))
    return {
        key: value
        for key, value in settings.items()
        if key not in RUNTIME_CONFIG_KEYS and not key.startswith("_attn_implementation")
    }


def weights_sample_sha256(model: torch.nn.Module) -> str:
    """sha256 of each parameter's name, shape and :data:`WEIGHT_SAMPLES` evenly spaced values.

    Cheap at any model size, and it tells apart two checkpoints of one architecture (a base
    model and its instruct version share their config). Parameters on the meta device are skipped.
    """
    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
        if parameter.is_meta:
            continue
        flat = parameter.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // WEIGHT_SAMPLES)][:WEIGHT_SAMPLES]
        digest.update(f"{name}{tuple(parameter.shape)}".encode())
        digest.update(sample.float().cpu().numpy().tobytes())
    return digest.hexdigest()


# ---- loading ----------------------------------------------------------------------------------


def load_cache(
    directory: str | Path, model: torch.nn.Module, policy: KVPolicy | str | Path | None = None
) -> KVPCache:
    """The cache saved in ``directory``, rebuilt for ``model`` and ready to continue.

    policy: for a cache saved with method ``kvp``, where to find its policy when the recorded name
        or directory is not available here (a shipped name, a directory or a ``KVPolicy``); its
        weights must have the recorded sha256.
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"model must be the transformers model the cache was saved for, got {type(model).__name__}"
        )
    config_file, tensors_file = saved_files(directory)
    source = str(directory)
    saved = read_saved_config(config_file, source)
    check_model(saved["model"], model, saved["cache_layout"]["transformers"], source)
    cache = KVPCache(
        model, method=saved["method"]["name"], **saved["settings"], **method_options(saved["method"], policy)
    )
    check_layout(saved["cache_layout"], cache, source)
    tensors = read_tensors(tensors_file, saved, source)
    devices = layer_devices(model, len(cache.layers))
    for i, (layer, record) in enumerate(zip(cache.layers, saved["layers"], strict=True)):
        layer_tensors = {name: tensors[f"layers.{i}.{name}"].to(devices[i]) for name in record["tensors"]}
        restore_layer(layer, record, layer_tensors, f"{source}: layer {i}")
    return cache


def saved_files(directory: str | Path) -> tuple[Path, Path]:
    """``cache_config.json`` and ``cache.safetensors`` of a saved-cache directory (pickles refused unopened)."""
    path = Path(directory).expanduser()
    if not path.exists():
        raise ValueError(f"Saved cache directory {str(path)!r} does not exist")
    if path.is_dir():
        pickles = sorted({p.name for pattern in PICKLE_PATTERNS for p in path.glob(pattern)})
    else:
        pickles = [path.name] if any(fnmatch(path.name, pattern) for pattern in PICKLE_PATTERNS) else []
    config_file, tensors_file = path / CONFIG_NAME, path / TENSORS_NAME
    if pickles and not tensors_file.is_file():
        raise ValueError(
            f"{str(path)!r} holds pickle files ({', '.join(pickles)}), not a saved KVPCache; kvp_cache loads "
            "caches from safetensors only (unpickling can run code). Save caches with KVPCache.save_pretrained."
        )
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is a file; pass the directory KVPCache.save_pretrained wrote")
    for file in (config_file, tensors_file):
        if not file.is_file():
            raise ValueError(
                f"Saved cache directory {str(path)!r} has no {file.name}; it was not written by "
                "KVPCache.save_pretrained (or is incomplete)"
            )
    return config_file, tensors_file


def read_saved_config(config_file: Path, source: str) -> dict:
    try:
        saved = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"Saved cache {source!r}: {CONFIG_NAME} is not valid JSON ({error})") from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(f"Saved cache {source!r}: {CONFIG_NAME} is not a saved KVPCache record")
    required = ("method", "settings", "model", "cache_layout", "layers", "tensors")
    missing = [key for key in required if key not in saved]
    if missing:
        raise ValueError(f"Saved cache {source!r}: {CONFIG_NAME} lacks {missing}")
    return saved


def check_model(saved: dict, model: torch.nn.Module, saved_transformers: str, source: str) -> None:
    """Raise ``ValueError`` naming every difference between the recorded model and ``model``."""
    current = model_identity(model)
    problems = [
        f"{key}: saved {saved.get(key)!r}, model {current[key]!r}"
        for key in ("model_type", "num_layers", "num_kv_heads", "head_dim", "dtype")
        if saved.get(key) != current[key]
    ]
    if saved.get("config_sha256") != current["config_sha256"]:
        old, new = saved.get("config", {}), current["config"]
        differing = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
        problems.append(
            "config differs in "
            + ", ".join(f"{key} (saved {old.get(key)!r}, model {new.get(key)!r})" for key in differing[:6])
            + (f", ... ({len(differing)} keys)" if len(differing) > 6 else "")
        )
    if not problems and saved.get("weights_sample_sha256") != current["weights_sample_sha256"]:
        problems.append("weights differ (another checkpoint of the same architecture?)")
    if problems:
        versions = (
            f" It was saved with transformers {saved_transformers}, this is {transformers.__version__}."
            if saved_transformers != transformers.__version__
            else ""
        )
        raise ValueError(
            f"Saved cache {source!r} was computed with another model ({saved.get('name_or_path') or 'unnamed'!r}): "
            + "; ".join(problems)
            + f". Load it with the model it was saved from.{versions}"
        )


def method_options(method: dict, policy: KVPolicy | str | Path | None) -> dict:
    """The recorded method options, with the ``kvp`` policy loaded and checked against its sha256."""
    options = dict(method["options"])
    if "policy" not in method:
        if policy is not None:
            raise ValueError(
                f"policy= is for caches saved with method 'kvp'; this one used {method['name']!r}"
            )
        return options
    record = method["policy"]
    if isinstance(policy, KVPolicy):
        loaded = policy
    else:
        try:
            loaded = load_policy(policy if policy is not None else record["source"])
        except (ValueError, OSError) as error:
            raise ValueError(
                f"The saved cache's KVP policy could not be loaded ({error}). Pass "
                f"policy=<shipped name | directory | KVPolicy> holding the weights with sha256 {record['sha256']}."
            ) from None
    sha256 = getattr(loaded, "weights_sha256", None)
    if sha256 != record["sha256"]:
        raise ValueError(
            f"KVP policy {getattr(loaded, 'source', 'given')!r} has weights sha256 {sha256}, but the cache was "
            f"compressed with {record['source']!r} (sha256 {record['sha256']}): another policy would rank the "
            "cached tokens differently. Pass the same policy as policy=."
        )
    calibration = getattr(loaded, "calibration_sha256", None)
    if "calibration_sha256" in record and calibration != record["calibration_sha256"]:
        raise ValueError(
            f"KVP policy {getattr(loaded, 'source', 'given')!r} has calibration sha256 {calibration}, but the "
            f"cache's heads were allocated with calibration {record['calibration_sha256']}: its next eviction "
            "would split the budget differently. Pass the policy with that calibration as policy=."
        )
    for name in POLICY_SETTINGS:
        if loaded is policy and getattr(loaded, name) != record[name]:
            raise ValueError(
                f"the given KVP policy has {name}={getattr(loaded, name)!r}, the cache was saved with {record[name]!r}"
            )
        setattr(loaded, name, record[name])
    return options | {"policy": loaded}


def check_layout(saved: dict, cache: KVPCache, source: str) -> None:
    """Raise ``ValueError`` unless the saved layer classes are those ``cache`` was built with."""
    current = cache_layout(cache)
    if saved.get("version") != LAYOUT_VERSION:
        raise ValueError(
            f"Saved cache {source!r} has cache layout version {saved.get('version')!r}; this kvp_cache reads "
            f"version {LAYOUT_VERSION}"
        )
    old, new = saved.get("layers", []), current["layers"]
    differing = [
        f"layer {i}: saved {a}, now {b}" for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b
    ]
    if len(old) != len(new):
        differing.append(f"saved {len(old)} layers, now {len(new)}")
    if differing:
        raise ValueError(
            f"Saved cache {source!r} has another transformers cache layout (saved with transformers "
            f"{saved.get('transformers')}, this is {transformers.__version__}): " + "; ".join(differing[:4])
        )


def read_tensors(tensors_file: Path, saved: dict, source: str) -> dict[str, torch.Tensor]:
    """The tensor file's tensors on CPU, after checking its sha256 and that it holds exactly the recorded names."""
    recorded, actual = saved["tensors"].get("sha256"), sha256_of(tensors_file)
    if actual != recorded:
        raise ValueError(
            f"Saved cache {source!r}: {TENSORS_NAME} has sha256 {actual}, but {CONFIG_NAME} records {recorded}; "
            "the file was changed or corrupted after saving. Refusing to load it."
        )
    try:
        tensors = load_file(str(tensors_file), device="cpu")
    except SafetensorError as error:
        raise ValueError(
            f"Saved cache {source!r}: {TENSORS_NAME} is not a valid safetensors file ({error})"
        ) from None
    expected = {
        f"layers.{i}.{name}" for i, record in enumerate(saved["layers"]) for name in record["tensors"]
    }
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        problems = [
            f"{label} tensors {names[:5]}"
            for label, names in (("missing", missing), ("unexpected", extra))
            if names
        ]
        raise ValueError(
            f"Saved cache {source!r}: {TENSORS_NAME} does not match {CONFIG_NAME} ({'; '.join(problems)}); "
            "refusing to load a partial cache."
        )
    return tensors


def layer_devices(model: torch.nn.Module, num_layers: int) -> list[torch.device]:
    """The device of each decoder layer's attention (a model split over devices keeps each layer's cache there)."""
    default = next(model.parameters()).device
    devices: dict[int, torch.device] = {}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        parameter = next(module.parameters(recurse=True), None)
        if isinstance(index, int) and index not in devices and parameter is not None:
            devices[index] = parameter.device
    return [devices.get(i, default) for i in range(num_layers)]


def restore_layer(layer, record: dict, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Put a layer of a fresh cache in the recorded state (``tensors`` by name within the layer)."""
    if not record["initialized"]:
        return
    keys, values = tensors.get("keys"), tensors.get("values")
    ragged = isinstance(layer, RaggedLayer)
    layout = "[batch, slots, head_dim] (heads packed)" if ragged else "[batch, kv_heads, slots, head_dim]"
    if keys is None or values is None or keys.dim() != (3 if ragged else 4) or values.shape != keys.shape:
        raise ValueError(f"{where}: needs keys and values of one shape {layout}")
    if isinstance(layer, EvictingLayer):
        restore_evicting_layer(layer, record, tensors, where)
    else:
        # A forward's update: it initializes the layer on these states' device and dtype, as transformers
        # does in every supported release; then the logical length the window had reached.
        layer.update(keys, values)
    for name, value in record["counters"].items():
        if not hasattr(layer, name):
            raise ValueError(f"{where}: a {type(layer).__name__} has no {name} (another cache layout)")
        setattr(layer, name, value)


def restore_evicting_layer(
    layer: EvictingLayer, record: dict, tensors: dict[str, torch.Tensor], where: str
) -> None:
    keys, values = tensors["keys"], tensors["values"]
    settings = layer.settings
    heads, head_dim = settings.num_kv_heads, settings.head_dim
    batch, slots = keys.shape[0], keys.shape[-2]
    ragged = isinstance(layer, RaggedLayer)
    if ragged:
        lengths = record["counters"].get("lengths")
        if not isinstance(lengths, list) or len(lengths) != heads or sum(lengths) != slots:
            raise ValueError(
                f"{where}: head lengths {lengths!r} do not pack {slots} slots into {heads} KV heads"
            )
    stored = (heads if ragged else keys.shape[1], keys.shape[-1])
    if stored != (heads, head_dim):
        raise ValueError(
            f"{where}: keys of shape {tuple(keys.shape)}, but the model has {heads} KV heads of dim {head_dim}"
        )
    if ragged:  # lazy_initialization takes a forward's [batch, kv_heads, q, head_dim] states: none yet
        empty = [t.new_empty(batch, heads, 0, t.shape[-1]) for t in (keys, values)]
        layer.lazy_initialization(*empty)
    else:
        layer.lazy_initialization(keys, values)
    per_entry = (batch, slots) if ragged else (batch, heads, slots)  # scores, positions, entry times
    # The per-row tensors this cache's settings hold (scores for per-token methods, positions if tracked).
    needed = {name for name in layer.BATCH_FIELDS if getattr(layer, name) is not None}
    saved = {name for name in tensors if not name.startswith("recent_queries.")}
    if needed != saved:
        raise ValueError(
            f"{where}: saved tensors {sorted(saved)}, but this cache's settings hold {sorted(needed)}"
        )
    shapes = {"valid": (batch, slots), "seen_real": (batch,)} | dict.fromkeys(
        ("scores", "positions", "entered"), per_entry
    )
    for name in needed:
        shape = shapes.get(name, keys.shape)
        if tensors[name].shape != shape:
            raise ValueError(
                f"{where}: {name} has shape {tuple(tensors[name].shape)}, expected {tuple(shape)}"
            )
        setattr(layer, name, tensors[name])
    if record["recent_queries"] is not None:
        queries = {
            name.removeprefix("recent_queries."): t for name, t in tensors.items() if name not in saved
        }
        layer.recent_queries = QueryStates(**queries, **record["recent_queries"])
