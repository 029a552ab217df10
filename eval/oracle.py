"""The oracle row: each head keeps the entries the gold continuation itself attends to most.

It uses the one importance definition training ranks against too (:func:`kvp_cache.targets.future_attention`:
the future queries' causal softmax attention, maxed over each GQA group and summed over the queries)
over the compressed prompt, then the question asked after it (if any), then the gold answer
(:func:`kvp_cache.ruler.gold_answer_ids`) or the text's true continuation. It is the ceiling of a key/value-only ranking
trained on that target, an evaluation tool and not a method users select: it is not registered,
and caches get it as ``KVPCache(model, method=OracleScorer(...))``. Its importance is a share of the
future attention mass, comparable across heads and layers, so it also ranks one adaptive allocation
(``allocation="layer" | "head"``: the benchmark's ``oracle+head`` row).

Under ``max_cache_tokens`` (the benchmark's ``decode`` protocol) the oracle is
:class:`CappedOracleScorer`: at each eviction it ranks by the decode-time target
(:func:`kvp_cache.targets.decode_attention`), the attention the true text's queries pay each held
token until the next eviction. Teacher-forced text is known in advance, so the oracle may read it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvp_cache.compat import cache_kwarg
from kvp_cache.prefill import Prefill
from kvp_cache.scorers import Scorer
from kvp_cache.targets import attention_modules, captured_queries, decode_attention, future_attention

ORACLE = "oracle"
"""The method name of the oracle in benchmark rows."""


@dataclass
class OracleScorer(Scorer):
    """Scores = the gold continuation's future attention to each prompt entry.

    importance: layer index -> ``[kv_heads, prompt_tokens]`` float32.
    """

    name: ClassVar[str] = ORACLE
    comparable_across_heads: ClassVar[bool] = True
    importance: dict[int, torch.Tensor]

    def score(self, keys, values, positions, queries=None, layer_idx=0) -> torch.Tensor:
        """``[batch, kv_heads, seq]``: the stored importance of layer ``layer_idx`` for every row."""
        importance = self.importance[layer_idx]
        if importance.shape != keys.shape[1:3]:
            raise ValueError(
                f"the oracle was built for {tuple(importance.shape)} (kv_heads, tokens) at layer {layer_idx}, "
                f"the cache holds {tuple(keys.shape[1:3])}: build it from the same prompt"
            )
        return importance.to(keys.device)[None].expand(keys.shape[0], -1, -1)

    def cross_head_scores(self, scores, valid, layer_idx=0) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` float32: the future attention importance itself, already each
        entry's share of the future queries' attention mass, so comparable across heads and layers;
        -inf where not ``valid``."""
        return scores.float().masked_fill(~valid, float("-inf"))


@dataclass(frozen=True)
class FutureStates:
    """What the gold future's queries see, per evicting layer: ``queries`` ``[q_heads, F, d]`` (post-RoPE,
    positions ``T - F .. T - 1``), ``keys`` ``[kv_heads, T, d]`` of prompt + future, and the layer's
    softmax ``scaling``."""

    queries: torch.Tensor
    keys: torch.Tensor
    scaling: float


@torch.no_grad()
def future_states(model, prefilled: Prefill, future_ids: list[int]) -> dict[int, FutureStates]:
    """The uncapped model's states over a prefilled prompt and its gold future, by layer index.

    The future runs over a copy of the prefill's cache, as ``train.collect.trace_example`` runs it
    over its own prefill, so the prompt is not prefilled a second time.
    """
    if prefilled.input_ids.shape[0] != 1 or not future_ids:
        raise ValueError("the oracle scores one prompt (batch 1) and needs at least one future token")
    cache = copy.deepcopy(prefilled.cache)
    modules = attention_modules(model)
    future = torch.tensor([future_ids], device=prefilled.input_ids.device)
    with captured_queries(model, modules) as store:
        model.base_model(input_ids=future, use_cache=True, **{cache_kwarg(model.base_model): cache})
    return {
        m.layer_idx: FutureStates(store[m.layer_idx].queries[0], cache.layers[m.layer_idx].keys[0], m.scaling)
        for m in modules
    }


def oracle_scorer(model, prefilled: Prefill, future_ids: list[int]) -> OracleScorer:
    """The oracle of a prefilled prompt (the tokens that get compressed) and its gold future: the
    question asked after compression (if any), then the gold answer or the true continuation."""
    prompt_tokens = prefilled.input_ids.shape[1]
    return OracleScorer(
        {
            layer: future_attention(s.queries, s.keys, prompt_tokens, s.scaling)[0]
            for layer, s in future_states(model, prefilled, future_ids).items()
        }
    )


@dataclass
class CappedOracleScorer(Scorer):
    """The oracle under ``max_cache_tokens``: at each eviction, each head keeps the entries that the
    queries until the next eviction (or a horizon) attend to most, by the decode-time target
    (:func:`kvp_cache.targets.decode_attention`, on the uncapped model's queries and keys).

    importance: layer index -> ``[evictions, kv_heads, T]`` float32; evictions: tokens read at each
    eviction (:func:`kvp_cache.targets.eviction_points`). The cache's entries are found by their
    logical positions, so the cache must be built with ``track_positions=True`` and given to
    :meth:`bind` before its second eviction.
    """

    name: ClassVar[str] = ORACLE
    importance: dict[int, torch.Tensor]
    evictions: list[int]
    cache: object = None
    unbound_layers: set[int] = field(default_factory=set)

    def bind(self, cache) -> None:
        """Score the entries of ``cache`` (a ``KVPCache`` with ``track_positions=True``) by their
        logical positions; call it before the cache's second eviction."""
        self.cache = cache

    def score(self, keys, values, positions, queries=None, layer_idx=0) -> torch.Tensor:
        """``[batch, kv_heads, seq]``: each held entry's target at the eviction under way."""
        if self.cache is not None:
            logical = self.cache.layers[layer_idx].positions
            if logical is None:
                raise ValueError("the capped oracle's cache must be built with track_positions=True")
        elif layer_idx in self.unbound_layers:
            raise ValueError(
                "the capped oracle evicts a second time without its cache: call bind(cache) first"
            )
        else:
            # Until its first eviction a cache holds tokens 0 .. n - 1 in order (``KVPCache.from_prefill``
            # evicts before it returns the cache to bind), so the positions given are logical.
            self.unbound_layers.add(layer_idx)
            logical = positions[:, None, :].expand(-1, keys.shape[1], -1)
        read = int(logical.max()) + 1  # the newest token is always held
        if read not in self.evictions:
            raise ValueError(
                f"the oracle was built for evictions after {self.evictions} tokens read, the cache evicts after "
                f"{read}: build it for the cache's schedule (eviction_points of the same forwards)"
            )
        importance = self.importance[layer_idx][self.evictions.index(read)].to(keys.device)
        return importance[None].expand(keys.shape[0], -1, -1).gather(2, logical)


def capped_oracle_scorer(
    states: dict[int, FutureStates], evictions: list[int], sinks: int, window: int, horizon: int | None = None
) -> CappedOracleScorer:
    """The capped oracle of one schedule, from :func:`future_states` (the future is every token the
    capped cache reads after the prompt)."""
    return CappedOracleScorer(
        {
            layer: decode_attention(s.queries, s.keys, s.scaling, evictions, sinks, window, horizon)
            for layer, s in states.items()
        },
        list(evictions),
    )
