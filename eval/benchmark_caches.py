"""How the benchmark builds caches and scorers from one prefill: :class:`AllocatedDecoder` splits each
budget among KV heads by an allocation, :func:`scored_once` lets one scorer serve every budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from eval.benchmark_config import UNIFORM
from eval.sweep import AnswerDecoder, stack_caches
from kvp_cache import KVPCache
from kvp_cache.budget import Budget
from kvp_cache.scorers import Scorer


@dataclass
class AllocatedDecoder(AnswerDecoder):
    """An :class:`~eval.sweep.AnswerDecoder` whose caches split each budget by ``allocation``, each
    head keeping at least ``min_per_head`` entries under an adaptive one (None: the cache's default).

    Uniform caches of one budget keep the same entries per head and stack into one batch; an
    adaptive cache keeps different entries per head, so it is a batch of its own.
    """

    allocation: str = UNIFORM
    min_per_head: int | None = None

    def cache_options(self, method: str | Scorer, budget: Budget) -> dict:
        options = super().cache_options(method, budget)
        if self.allocation == UNIFORM:
            return options
        return {**options, "allocation": self.allocation, "min_per_head": self.min_per_head}

    def caches(self, prefilled, methods: list, budget: Budget) -> list[KVPCache]:
        """One compressed cache of the prefill per method, all at ``budget``."""
        return [
            KVPCache.from_prefill(prefilled, self.model, **self.cache_options(m, budget)) for m in methods
        ]

    def compressed(self, prefilled, methods: list, budget: Budget) -> KVPCache:
        caches = self.caches(prefilled, methods, budget)
        if self.allocation == UNIFORM:
            return stack_caches(caches)
        if len(caches) != 1:
            raise ValueError(f"allocation {self.allocation!r} caches do not stack: give one method at a time")
        return caches[0]


_SCORED_ONCE: dict[type, type] = {}


def scored_once(scorer: Scorer) -> Scorer:
    """``scorer``, changed to compute each layer's scores once and return them on later calls.

    A method's scores depend on the prefill, never on the budget, so the caches of one sample at
    every budget share them (H2O's, quadratic in the prompt, would otherwise dominate long contexts).
    Use it for one prefill only.
    """
    cls = type(scorer)
    if cls not in _SCORED_ONCE:

        def score(self, keys, values, positions, queries=None, layer_idx=0):
            # The sum tells this prefill's states from states appended later (a question's, say).
            key = (layer_idx, tuple(keys.shape), float(keys.float().sum()))
            if key not in self.memo:
                self.memo[key] = cls.score(self, keys, values, positions, queries, layer_idx)
            return self.memo[key]

        _SCORED_ONCE[cls] = type(cls.__name__, (cls,), {"score": score, "__doc__": cls.__doc__})
    scorer.__class__ = _SCORED_ONCE[cls]
    scorer.memo = {}
    return scorer
