from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvp_cache.scorers.base import QueryStates, Scorer, grouped_attention
from kvp_cache.scorers.registry import register_scorer


@register_scorer
@dataclass
class SnapKVScorer(Scorer):
    """Keep the tokens an observation window of the last prompt queries attends to.

    Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024
    (arXiv 2404.14469). The window's attention is averaged over its queries, smoothed with an
    average pool of ``kernel_size``, and averaged over the GQA group (as kvpress does, after
    FasterDecoding/SnapKV#22). The window itself is always kept.

    Queries seen: the last ``window_size`` queries of the evicting forward (the prompt's, at the
    prefill eviction); while decoding with ``max_cache_tokens``, those of the tokens appended
    since the previous eviction, at most ``window_size`` of them (``evict_every + 1`` with
    ``evict_every < window_size``).

    Across heads (:meth:`cross_head_scores`, Ada-KV style): the scores themselves. Outside the
    window each is the mean attention a window query of the KV head's group pays the entry
    (pooled), so a head's entries share its window queries' attention: every head's total is 1,
    split between the window, which it always keeps, and the rest, as that head attends. The
    window keeps its ``float32`` maximum, so every allocation keeps it first, as SnapKV does.
    """

    name = "snapkv"
    needs_queries = True
    comparable_across_heads = True
    window_size: int = 64
    kernel_size: int = 5

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window_size

    def score(self, keys, values, positions, queries: QueryStates, layer_idx=0) -> torch.Tensor:
        b, h, n, _ = keys.shape
        window = queries.queries.shape[-2]
        attention = grouped_attention(
            queries.queries, keys, queries.scaling, positions >= 0, causal_offset=n - window
        )
        observed = attention.nan_to_num(0.0).mean(dim=-2)  # [b, h, group, n]
        pooled = F.avg_pool1d(observed.flatten(0, 2)[:, None], self.kernel_size, 1, self.kernel_size // 2)
        scores = pooled.view(b, h, -1, n).mean(dim=2)
        scores[..., n - window :] = torch.finfo(scores.dtype).max
        return scores

    def cross_head_scores(self, scores, valid, layer_idx=0) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` float32: the window queries' attention share (see the class
        docstring), -inf where not ``valid``."""
        return scores.float().masked_fill(~valid, float("-inf"))
