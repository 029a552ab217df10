"""The training targets: which stored importance ``fit`` ranks against, chosen by name.

``collect`` stores, per KV head ``h`` and prompt token ``i``, the core definitions of
:mod:`kvp_cache.targets` (``A_g[t, i]``: the model's full causal softmax attention of query head
``g`` at future position ``t``; ``G(h)``: the query heads that share KV head ``h``):

- ``importance[h, i] = sum_t max_{g in G(h)} A_g[t, i]`` (the paper's future attention, section 4);
- ``value_importance[h, i] = sum_t max_{g in G(h)} A_g[t, i] * ||W_o^g v_i||``: the attention
  weighted by the norm of what the token writes into the residual stream through head ``g``
  (``W_o^g`` is ``g``'s slice of ``o_proj``), closer to what evicting it changes in the output.

``fit`` trains on one of the :data:`TARGETS`, chosen by name:

- ``attention``: ``importance`` as stored (what the shipped policy was trained on);
- ``attention_evictable``: the same with the always-kept sinks and window zeroed, so they leave both
  the target and its normalizer (they carry about half the mass, and the cache keeps them anyway);
- ``value_attention``: ``value_importance``;
- ``value_attention_evictable``: ``value_importance`` with the sinks and window zeroed, as above.

Decode traces (``python -m train collect-decode``) store one target per eviction,
:func:`kvp_cache.targets.decode_attention`: the attention each token read so far receives until the
next eviction, with the cache's sinks and window (as of that eviction) zeroed when collected. Both
``attention`` and ``attention_evictable`` rank against it as stored (its protected entries are
already out, for the collection's ``--sinks``/``--window``); it has no value-weighted twin.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvp_cache.targets import evictable_only
from train.traces import LayerSample


def attention(sample: LayerSample, sinks: int, window: int) -> torch.Tensor:
    return sample.importance


def attention_evictable(sample: LayerSample, sinks: int, window: int) -> torch.Tensor:
    return evictable_only(sample.importance, sinks, window)


def value_attention(sample: LayerSample, sinks: int, window: int) -> torch.Tensor:
    if sample.value_importance is None:
        raise ValueError(
            f"target 'value_attention' needs value_importance in the traces ({sample.uid} has none); "
            "collect them again with this version of `python -m train collect`"
        )
    return sample.value_importance


def value_attention_evictable(sample: LayerSample, sinks: int, window: int) -> torch.Tensor:
    return evictable_only(value_attention(sample, sinks, window), sinks, window)


TARGETS: dict[str, Callable[[LayerSample, int, int], torch.Tensor]] = {
    "attention": attention,
    "attention_evictable": attention_evictable,
    "value_attention": value_attention,
    "value_attention_evictable": value_attention_evictable,
}


DECODE_TARGETS = ("attention", "attention_evictable")


def target(name: str, sample: LayerSample, sinks: int = 4, window: int = 16) -> torch.Tensor:
    """The importance that ``fit`` ranks against, by target name: ``[kv_heads, n]``, or for a decode
    sample ``[evictions, kv_heads, n]`` (its stored decode-time target, see the module docstring)."""
    if name not in TARGETS:
        raise ValueError(f"target must be one of {sorted(TARGETS)}, got {name!r}")
    if sample.evictions is not None:
        if name not in DECODE_TARGETS:
            raise ValueError(
                f"{sample.uid} is a decode trace: its target is the decode-time attention, so the target "
                f"must be one of {DECODE_TARGETS}, got {name!r}"
            )
        return sample.importance
    return TARGETS[name](sample, sinks, window)
