from dataclasses import dataclass

import torch

from kvp_cache.scorers.base import Scorer
from kvp_cache.scorers.registry import register_scorer


@register_scorer
@dataclass
class KnormScorer(Scorer):
    """Keep keys with a small L2 norm: score = -||k||.

    Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
    EMNLP 2024 (arXiv 2406.11430). Per KV head; no queries.
    """

    name = "knorm"

    def score(self, keys, values, positions, queries=None, layer_idx=0) -> torch.Tensor:
        return -keys.float().norm(dim=-1)
