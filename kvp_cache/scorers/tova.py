from dataclasses import dataclass

import torch

from kvp_cache.scorers.base import QueryStates, Scorer, grouped_attention
from kvp_cache.scorers.registry import register_scorer


@register_scorer
@dataclass
class TOVAScorer(Scorer):
    """Keep the tokens the last prompt token attends to most.

    Oren et al., "Transformers are Multi-State RNNs" (TOVA), EMNLP 2024 (arXiv 2401.06104). As in
    the paper and kvpress, the attention is averaged over all query heads, so every KV head of a
    layer keeps the same tokens.

    Queries seen: the prompt's last query at the prefill eviction; while decoding with
    ``max_cache_tokens``, the query of the token whose forward triggers the eviction (TOVA's own
    decoding rule, applied once per ``evict_every`` tokens).

    Across heads (:meth:`cross_head_scores`): the scores themselves, the last query's attention to
    each entry averaged over the layer's query heads. Each layer's entries share that query's
    attention (every KV head's total is 1), so layers compare; the heads of one layer hold the
    same values and get the same budget.
    """

    name = "tova"
    needs_queries = True
    comparable_across_heads = True
    query_window = 1

    def score(self, keys, values, positions, queries: QueryStates, layer_idx=0) -> torch.Tensor:
        attention = grouped_attention(
            queries.queries, keys, queries.scaling, positions >= 0, causal_offset=None
        )
        per_layer = attention.nan_to_num(0.0)[..., -1, :].mean(dim=(1, 2))  # [batch, seq]
        return per_layer[:, None, :].expand(keys.shape[:3])

    def cross_head_scores(self, scores, valid, layer_idx=0) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` float32: the last query's attention share (see the class
        docstring), -inf where not ``valid``."""
        return scores.float().masked_fill(~valid, float("-inf"))
