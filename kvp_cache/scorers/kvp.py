"""The learned KVP policy as a scorer (method "kvp"); build it with ``KVPCache.from_pretrained``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvp_cache.policy import KVPolicy, checked_age_decay, load_policy
from kvp_cache.scorers.base import Scorer
from kvp_cache.scorers.registry import register_scorer


@register_scorer
@dataclass
class KVPScorer(Scorer):
    """Scores from a trained :class:`~kvp_cache.policy.KVPolicy` (key, value and position per head; no queries).

    Moschella et al., "Learning to Evict from Key-Value Cache" (arXiv 2602.10238). The policy
    weights stay float32; keys and values are cast to them. Each layer's agents move to the
    device of that layer's keys on first use, so a model split over devices keeps each layer's
    agents next to its cache.

    By default each token is scored once, as it entered the cache, at its index among its row's real
    tokens (``per_token``); the cache keeps the scores, so decoding never rescores old tokens. Decoded
    tokens are scored only when an eviction needs them, each as a one-token row. With ``rescore=True``
    every eviction scores all the entries a head holds again, at their index among them, as a prefill
    of those entries would be scored: a decoded token is then ranked by its place among the entries
    held rather than always as the newest token of its row. A single prefill keeps the same entries
    either way; the two differ only once a cache evicts a second time (``max_cache_tokens``, chunked
    prefill, later turns).

    With ``age_decay=lambda > 0`` each eviction ranks ``score - lambda * log2(1 + age)``, ``age`` the
    tokens read since the forward that read the entry (:func:`kvp_cache.cache.age_decayed`): a score
    given at entry says nothing of how long ago that was, and under ``max_cache_tokens`` old entries
    would otherwise outrank new ones forever. A single prefill ranks as without it (every age is 0).
    None (the default) takes the policy's own :attr:`~kvp_cache.policy.KVPolicy.age_decay`, the value
    chosen for it on validation and saved in its config.json; 0 turns the decay off.

    Across heads (:meth:`cross_head_scores`): ``weight * softmax(score / temperature)`` over each
    head's valid entries, the policy's :class:`~kvp_cache.policy.Calibration` (fitted by ``python -m
    train calibrate`` to each entry's share of the future attention, sinks and window excluded, per
    future query); a policy without one uses temperature 1 and weight 1, the plain per-head softmax
    that ListNet trains to match each head's normalized target.
    """

    name = "kvp"
    learned = True
    comparable_across_heads = True
    policy: KVPolicy | str | Path | None = None
    check_base_model: bool = True
    rescore: bool = False
    age_decay: float | None = None

    @property
    def per_token(self) -> bool:
        return not self.rescore

    def __post_init__(self) -> None:
        if self.policy is None:
            raise ValueError(
                "method 'kvp' needs policy=..., use KVPCache.from_pretrained(policy, model=model, budget=...) "
                "or KVPCache(model, method='kvp', policy=...) with a shipped policy name, a local directory, "
                "a Hub repo id or a KVPolicy"
            )
        if isinstance(self.policy, str | Path):
            self.policy = load_policy(self.policy)
        if not isinstance(self.policy, KVPolicy):
            raise TypeError(f"policy must be a kvp_cache.policy.KVPolicy, got {type(self.policy).__name__}")
        if not isinstance(self.rescore, bool):
            raise TypeError(f"rescore must be True or False, got {self.rescore!r}")
        self.age_decay = (
            self.policy.age_decay if self.age_decay is None else checked_age_decay(self.age_decay)
        )

    def check_model(self, config) -> None:
        self.policy.check_compatible(config, check_base_model=self.check_base_model)

    def score(self, keys, values, positions, queries=None, layer_idx=0) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` float32 scores of layer ``layer_idx``; -inf on padding."""
        if layer_idx not in self.policy.layer_indices:
            raise ValueError(
                f"The KVP policy has agents for layers {self.policy.layer_indices} but layer {layer_idx} asked "
                "for scores: it was trained for another model"
            )
        agents = self.policy.agents_for(layer_idx)
        if agents.position_table.device != keys.device:
            agents.to(keys.device)
        with torch.no_grad():
            return self.policy(layer_idx, keys, values, positions)

    def cross_head_scores(self, scores, valid, layer_idx=0) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` float32 estimated shares of the future attention mass (see the
        class docstring), -inf where not ``valid``."""
        with torch.no_grad():
            return self.policy.cross_head_scores(layer_idx, scores, valid)
