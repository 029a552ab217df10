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

    Across heads (:meth:`cross_head_scores`): each entry's accumulated attention divided by the
    number of queries that paid it, so an entry's share of a mean query's attention: every query's
    attention sums to 1 over the entries, so every head's total is 1, in every layer. With
    ``normalize`` the scores already are a mean over the queries that could see each entry (the
    same divisor in every head and layer), so they are returned as they are; they compare across
    heads and layers but no longer add up to 1.
    """

    name = "h2o"
    needs_queries = True
    comparable_across_heads = True
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

    def cross_head_scores(self, scores, valid, layer_idx=0) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` float32 attention shares (see the class docstring), -inf where
        not ``valid``."""
        scores = scores.float().masked_fill(~valid, 0.0)
        if not self.normalize:
            # Every query's attention adds up to 1 in every head: a row's total over its heads,
            # divided by their number, counts its queries (the same divisor for every layer).
            queries = scores.sum(dim=(1, 2), keepdim=True) / scores.shape[1]
            scores = scores / queries.clamp_min(torch.finfo(torch.float32).tiny)
        return scores.masked_fill(~valid, float("-inf"))
