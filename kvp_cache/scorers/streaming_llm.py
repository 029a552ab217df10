from dataclasses import dataclass

import torch

from kvp_cache.scorers.base import Scorer
from kvp_cache.scorers.registry import register_scorer


@register_scorer
@dataclass
class StreamingLLMScorer(Scorer):
    """Keep the first ``n_sink`` tokens and the most recent ones.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024
    (arXiv 2309.17453). Kept keys keep their original RoPE positions (no re-rotation), as in
    kvpress's ``StreamingLLMPress``.
    """

    name = "streaming_llm"
    n_sink: int = 4

    def score(self, keys, values, positions, queries=None, layer_idx=0) -> torch.Tensor:
        recency = positions.float()
        recency = torch.where(positions < self.n_sink, torch.finfo(torch.float32).max, recency)
        return recency[:, None, :].expand(keys.shape[:3])
