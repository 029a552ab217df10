"""Scorer registry: ``make_scorer(name, **options)`` and ``available_methods()``."""

from __future__ import annotations

import dataclasses

from kvp_cache.scorers.base import QueryStates, Scorer
from kvp_cache.scorers.expected_attention import ExpectedAttentionScorer
from kvp_cache.scorers.h2o import H2OScorer
from kvp_cache.scorers.keydiff import KeyDiffScorer
from kvp_cache.scorers.knorm import KnormScorer
from kvp_cache.scorers.lagkv import LagKVScorer
from kvp_cache.scorers.random import RandomScorer
from kvp_cache.scorers.snapkv import SnapKVScorer
from kvp_cache.scorers.streaming_llm import StreamingLLMScorer
from kvp_cache.scorers.tova import TOVAScorer

SCORERS: dict[str, type[Scorer]] = {
    cls.name: cls
    for cls in (
        KnormScorer,
        KeyDiffScorer,
        StreamingLLMScorer,
        RandomScorer,
        LagKVScorer,
        TOVAScorer,
        SnapKVScorer,
        H2OScorer,
        ExpectedAttentionScorer,
    )
}


def register_scorer(cls: type[Scorer]) -> type[Scorer]:
    """Add a scorer class to the registry under ``cls.name`` (usable as a decorator)."""
    SCORERS[cls.name] = cls
    return cls


def available_methods() -> list[str]:
    """Names accepted by ``KVPCache(method=...)``."""
    _register_learned()
    return sorted(SCORERS)


def make_scorer(method: str, **options) -> Scorer:
    """Instantiate a scorer by name; unknown names and options get an error listing what exists."""
    _register_learned()
    if method not in SCORERS:
        raise ValueError(f"Unknown method {method!r}; available methods: {', '.join(sorted(SCORERS))}")
    cls = SCORERS[method]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(options) - fields
    if unknown:
        raise TypeError(
            f"Unknown option(s) {sorted(unknown)} for method {method!r}; its options are: {sorted(fields) or 'none'}"
        )
    return cls(**options)


def _register_learned() -> None:
    """The learned policy scorer lives with the policy code; import it on first use."""
    if "kvp" not in SCORERS:
        try:
            from kvp_cache.scorers import kvp  # noqa: F401  (registers "kvp")
        except ImportError:
            pass


__all__ = ["QueryStates", "SCORERS", "Scorer", "available_methods", "make_scorer", "register_scorer"]
