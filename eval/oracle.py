"""The oracle row: each head keeps the entries the gold continuation itself attends to most.

It uses the one importance definition training ranks against too (:func:`kvp_cache.targets.future_attention`:
the future queries' causal softmax attention, maxed over each GQA group and summed over the queries)
over the compressed prompt, then the question asked after it (if any), then the gold answer
(:func:`kvp_cache.ruler.gold_answer_ids`) or the text's true continuation. It is the ceiling of a key/value-only ranking
trained on that target, an evaluation tool and not a method users select: it is not registered,
and caches get it as ``KVPCache(model, method=OracleScorer(...))``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvp_cache.compat import cache_kwarg
from kvp_cache.prefill import Prefill
from kvp_cache.scorers import Scorer
from kvp_cache.targets import attention_modules, captured_queries, future_attention

ORACLE = "oracle"
"""The method name of the oracle in benchmark rows."""


@dataclass
class OracleScorer(Scorer):
    """Scores = the gold continuation's future attention to each prompt entry.

    importance: layer index -> ``[kv_heads, prompt_tokens]`` float32.
    """

    name: ClassVar[str] = ORACLE
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


@torch.no_grad()
def oracle_scorer(model, prefilled: Prefill, future_ids: list[int]) -> OracleScorer:
    """The oracle of a prefilled prompt (the tokens that get compressed) and its gold future: the
    question asked after compression (if any), then the gold answer or the true continuation.

    The future runs over a copy of the prefill's cache, as ``train.collect.trace_example`` runs it
    over its own prefill, so the prompt is not prefilled a second time.
    """
    if prefilled.input_ids.shape[0] != 1 or not future_ids:
        raise ValueError("the oracle scores one prompt (batch 1) and needs at least one future token")
    prompt_tokens = prefilled.input_ids.shape[1]
    cache = copy.deepcopy(prefilled.cache)
    modules = attention_modules(model)
    future = torch.tensor([future_ids], device=prefilled.input_ids.device)
    with captured_queries(model, modules) as store:
        model.base_model(input_ids=future, use_cache=True, **{cache_kwarg(model.base_model): cache})
    importance = {}
    for module in modules:
        queries = store[module.layer_idx].queries[0]
        keys = cache.layers[module.layer_idx].keys[0]
        importance[module.layer_idx], _ = future_attention(queries, keys, prompt_tokens, module.scaling)
    return OracleScorer(importance)
