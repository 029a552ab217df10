from dataclasses import dataclass

import torch

from kvp_cache.scorers.base import QueryStates, Scorer, grouped_attention
from kvp_cache.scorers.registry import register_scorer


@register_scorer
@dataclass
class H2OScorer(Scorer):
    """Heavy hitters: keep the tokens that received the most attention over the whole prefill.

    Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
    Models", NeurIPS 2023 (arXiv 2306.14048). The attention every prompt query pays each key is
    accumulated, ``chunk_size`` queries at a time so no ``seq x seq`` matrix exists for all heads
    at once, and averaged over the GQA group. ``normalize`` divides by the number of queries that
    could see each key (kvpress's ``ObservedAttentionPress``), removing the bias toward early tokens.

    Queries seen: every query of the evicting forward (the whole prompt at the prefill eviction);
    while decoding with ``max_cache_tokens``, the queries of the tokens appended since the
    previous eviction. Attention is not accumulated across evictions.
    """

    name = "h2o"
    needs_queries = True
    query_window = -1
    chunk_size: int = 256
    normalize: bool = False

    def score(self, keys, values, positions, queries: QueryStates, layer_idx=0) -> torch.Tensor:
        b, h, n, _ = keys.shape
        q_all = queries.queries
        first = n - q_all.shape[-2]
        valid = positions >= 0
        total = torch.zeros(b, h, n, device=keys.device)
        for start in range(0, q_all.shape[-2], self.chunk_size):
            chunk = q_all[..., start : start + self.chunk_size, :]
            end = first + start + chunk.shape[-2]  # keys past the chunk's last query are causally hidden
            attention = grouped_attention(
                chunk, keys[..., :end, :], queries.scaling, valid[:, :end], first + start
            )
            query_valid = valid[:, first + start : end]
            attention = attention.nan_to_num(0.0) * query_valid[:, None, None, :, None]
            total[..., :end] += attention.sum(dim=-2).mean(dim=2)
        if self.normalize:
            seen_by = valid.flip(-1).long().cumsum(-1).flip(-1).clamp_min(1)
            total = total / seen_by[:, None, :]
        return total
