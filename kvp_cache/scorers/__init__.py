"""Scorers and their registry: ``make_scorer(name, **options)``, ``methods(query_aware=, learned=)``.

Each method lives in its own module and registers itself with ``@register_scorer``; importing this
package imports them all, so the registry is complete once ``kvp_cache.scorers`` is imported.
"""

from __future__ import annotations

from kvp_cache.scorers import (  # noqa: F401  (each module registers its scorer)
    expected_attention,
    h2o,
    keydiff,
    knorm,
    kvp,
    lagkv,
    random,
    snapkv,
    streaming_llm,
    tova,
)
from kvp_cache.scorers.base import QueryStates, Scorer
from kvp_cache.scorers.registry import SCORERS, available_methods, make_scorer, methods, register_scorer

__all__ = [
    "QueryStates",
    "SCORERS",
    "Scorer",
    "available_methods",
    "make_scorer",
    "methods",
    "register_scorer",
]
