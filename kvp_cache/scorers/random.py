from dataclasses import dataclass

import torch

from kvp_cache.scorers.base import Scorer
from kvp_cache.scorers.registry import register_scorer


@register_scorer
@dataclass
class RandomScorer(Scorer):
    """Uniform random scores, a lower bound every method should beat. Seeded per layer."""

    name = "random"
    seed: int = 0

    def score(self, keys, values, positions, queries=None, layer_idx=0) -> torch.Tensor:
        generator = torch.Generator(device="cpu").manual_seed(self.seed + layer_idx)
        return torch.rand(keys.shape[:3], generator=generator).to(keys.device)
