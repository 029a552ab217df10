"""On-disk traces: ``<root>/<split>/shard_XXXXX/layer_YY.safetensors`` plus ``meta.json``.

Only the layers a ``KVPCache`` evicts are traced, ``YY`` being the model layer index: every layer
of SmolLM2, the full-attention layers 5, 11 and 17 of Gemma 3 270M. ``meta.json``'s ``model``
lists them under ``layer_indices`` (traces written before hybrid models were supported have no
such field: they hold every layer).

One file per (shard, layer) holds every sample of the shard concatenated along the token axis:

- ``keys``, ``values``: ``[kv_heads, total_tokens, head_dim]`` float16, post-RoPE prompt K/V;
- ``importance``: ``[kv_heads, total_tokens]`` float32, future attention per prompt token;
- ``value_importance``: ``[kv_heads, total_tokens]`` float32, the same weighted by ``||W_o v||``
  (``train/targets.py``; absent from traces collected before it existed);
- ``offsets``: ``[samples + 1]`` int64, sample ``i`` is ``[offsets[i], offsets[i+1])``;
- ``score.<method>``: ``[kv_heads, total_tokens]`` float32, query-aware baseline scores (held-out
  splits only).

Decode traces (``python -m train collect-decode``, ``train/decode.py``) hold a whole sequence per
sample (``keys``/``values`` of every token read) and, instead of ``importance``, the decode-time
target (:func:`kvp_cache.targets.decode_attention`) compactly: ``decode_importance`` ``[kv_heads,
sum_k evictions[k]]`` float16, per eviction ``k`` only the ``evictions[k]`` tokens read by then
(later tokens are zero by definition), samples one after another. Each sample's ``meta.json``
record lists its ``evictions`` (tokens read at each stored eviction) and ``forward_tokens`` (the
forwards that read it: the prompt, then the decoded chunks), so training scores every token as it
entered the cache.

``meta.json`` is written last, so a shard without it is unfinished and ``collect`` redoes it. It
lists the shard's samples and the ``skipped`` ones (RULER samples the full cache answered wrong); a
shard whose samples were all skipped has no layer files.
Files are read through ``safetensors.safe_open`` (memory-mapped): only the layer being trained is
ever materialized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def shard_dir(root: Path, split: str, index: int) -> Path:
    return Path(root) / split / f"shard_{index:05d}"


def layer_file(shard: Path, layer: int) -> Path:
    return shard / f"layer_{layer:02d}.safetensors"


def shard_done(shard: Path) -> bool:
    return (shard / "meta.json").exists()


def traced_layers(model: dict) -> list[int]:
    """The model layers a trace holds, from its metadata's ``model`` record (default: every layer)."""
    return model.get("layer_indices", list(range(model["num_layers"])))


def same_traced_model(a: dict, b: dict) -> bool:
    """Whether two metadata ``model`` records trace the same model and layers (one may predate
    ``layer_indices``)."""
    return a | {"layer_indices": traced_layers(a)} == b | {"layer_indices": traced_layers(b)}


def write_shard(shard: Path, per_layer: list[dict[str, list[torch.Tensor]]], meta: dict) -> None:
    """Write one shard. ``per_layer[i][name]`` is a list over samples of ``[kv_heads, n_i, ...]`` of
    the ``i``-th traced layer (:func:`traced_layers` of ``meta["model"]``)."""
    shard.mkdir(parents=True, exist_ok=True)
    layers = traced_layers(meta["model"]) if meta["samples"] else []
    if meta["samples"] and len(per_layer) != len(layers):
        raise ValueError(f"per_layer has {len(per_layer)} layers, the metadata traces layers {layers}")
    for layer, tensors in zip(layers, per_layer if meta["samples"] else [], strict=True):
        lengths = [t.shape[1] for t in tensors["keys"]]
        offsets = torch.tensor([0] + lengths).cumsum(0)
        out = {"offsets": offsets}
        for name, chunks in tensors.items():
            out[name] = torch.cat(chunks, dim=1).contiguous()
        save_file(out, str(layer_file(shard, layer)))
    (shard / "meta.json").write_text(json.dumps(meta, indent=1))


@dataclass
class LayerSample:
    """One sample of one layer. keys/values ``[kv_heads, n, head_dim]`` float16, importance and
    value_importance ``[kv_heads, n]``, scores: method -> ``[kv_heads, n]``.

    A decode sample (``evictions`` set) is one ranking problem per eviction: its importance is
    ``[len(evictions), kv_heads, n]`` (problem ``k`` ranks tokens ``0 .. evictions[k] - 1``; zero
    after), and ``forward_tokens`` (summing to ``n``) are the forwards its tokens entered with. A
    prefill sample entered as one forward (``forward_tokens`` None).
    """

    keys: torch.Tensor
    values: torch.Tensor
    importance: torch.Tensor
    scores: dict[str, torch.Tensor]
    uid: str
    source: str
    value_importance: torch.Tensor | None = None
    evictions: list[int] | None = None
    forward_tokens: list[int] | None = None


def decode_importance(packed: torch.Tensor, evictions: list[int], tokens: int) -> torch.Tensor:
    """``[len(evictions), kv_heads, tokens]`` float32 from the packed ``[kv_heads, sum(evictions)]``
    (each eviction's read prefix in turn, as ``decode_importance`` is stored)."""
    dense = torch.zeros(len(evictions), packed.shape[0], tokens)
    start = 0
    for k, read in enumerate(evictions):
        dense[k, :, :read] = packed[:, start : start + read].float()
        start += read
    return dense


def pack_decode_importance(importance: torch.Tensor, evictions: list[int]) -> torch.Tensor:
    """The stored form ``[kv_heads, sum(evictions)]`` float16 of ``importance`` ``[evictions,
    kv_heads, T]`` (:func:`decode_importance` inverts it)."""
    return torch.cat([importance[k, :, :read] for k, read in enumerate(evictions)], dim=1).half()


class TraceSplit:
    """The finished shards of one split, e.g. ``TraceSplit("runs/smollm2", "val")``. Splits joined
    with ``+`` read as one (``"train+train_native"``: a collection topped up under another name)."""

    def __init__(self, root: str | Path, split: str):
        self.dirs = [Path(root) / name for name in split.split("+")]
        done = [p for d in self.dirs if d.is_dir() for p in sorted(d.glob("shard_*")) if shard_done(p)]
        metas = [json.loads((s / "meta.json").read_text()) for s in done]
        self.skipped = [s for m in metas for s in m.get("skipped", [])]
        self.shards = [s for s, m in zip(done, metas, strict=True) if m["samples"]]
        self.metas = [m for m in metas if m["samples"]]
        empty = [str(d) for d in self.dirs if not any(s.parent == d for s in self.shards)]
        if empty:
            raise FileNotFoundError(
                f"no finished shards with samples under {', '.join(empty)}; run `python -m train collect` first"
            )
        self.model = self.metas[0]["model"]
        for shard, meta in zip(self.shards, self.metas, strict=True):
            if not same_traced_model(meta["model"], self.model):
                raise ValueError(
                    f"split {split!r} mixes models: {shard} traced {meta['model']}, "
                    f"{self.shards[0]} traced {self.model}"
                )
        self.layer_indices = traced_layers(self.model)

    @property
    def samples(self) -> list[dict]:
        return [s for m in self.metas for s in m["samples"]]

    def __len__(self) -> int:
        return len(self.samples)

    def layer(self, layer: int) -> list[LayerSample]:
        """Every sample of model layer ``layer`` (views into the memory-mapped shard files)."""
        if layer not in self.layer_indices:
            raise ValueError(f"layer must be one of the traced layers {self.layer_indices}, got {layer}")
        out = []
        for shard, meta in zip(self.shards, self.metas, strict=True):
            with safe_open(str(layer_file(shard, layer)), framework="pt") as f:
                names = list(f.keys())
                tensors = {name: f.get_tensor(name) for name in names}
            offsets = tensors["offsets"].tolist()
            packed_start = 0
            for i, info in enumerate(meta["samples"]):
                a, b = offsets[i], offsets[i + 1]
                scores = {n.split(".", 1)[1]: t[:, a:b] for n, t in tensors.items() if n.startswith("score.")}
                value_importance = tensors.get("value_importance")
                evictions = info.get("evictions")
                if evictions is None:
                    importance = tensors["importance"][:, a:b]
                else:
                    packed_end = packed_start + sum(evictions)
                    packed = tensors["decode_importance"][:, packed_start:packed_end]
                    importance, packed_start = decode_importance(packed, evictions, b - a), packed_end
                out.append(
                    LayerSample(
                        tensors["keys"][:, a:b],
                        tensors["values"][:, a:b],
                        importance,
                        scores,
                        info["uid"],
                        info["source"],
                        None if value_importance is None else value_importance[:, a:b],
                        evictions,
                        info.get("forward_tokens"),
                    )
                )
        return out
