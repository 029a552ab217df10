from dataclasses import dataclass

import torch

from kvp_cache.scorers.base import Scorer
from kvp_cache.scorers.registry import register_scorer


@register_scorer
@dataclass
class KeyDiffScorer(Scorer):
    """Keep distinctive keys: score = -cos(k, mean of the normalized keys of the row and head).

    Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference
    in Resource-Constrained Environments" (arXiv 2504.15364). Per KV head; padding is left out of
    the mean; no queries.
    """

    name = "keydiff"

    def score(self, keys, values, positions, queries=None, layer_idx=0) -> torch.Tensor:
        unit = torch.nn.functional.normalize(keys.float(), dim=-1)
        valid = (positions >= 0)[:, None, :, None].float()
        anchor = (unit * valid).sum(2, keepdim=True) / valid.sum(2, keepdim=True).clamp_min(1.0)
        anchor = torch.nn.functional.normalize(anchor, dim=-1)
        return -(unit * anchor).sum(-1)
