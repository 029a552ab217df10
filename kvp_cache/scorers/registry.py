"""The method registry: built-in scorers register with ``@register_scorer``; nothing else adds names."""

from __future__ import annotations

import dataclasses

from kvp_cache.scorers.base import Scorer

SCORERS: dict[str, type[Scorer]] = {}


def register_scorer(cls: type[Scorer]) -> type[Scorer]:
    """Class decorator: make ``cls`` available as ``KVPCache(method=cls.name)``.

    Scorers used only for evaluation (an oracle, say) are not registered: pass an instance as
    ``KVPCache(model, method=scorer_instance)`` instead.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute `name` to be registered")
    if SCORERS.get(cls.name, cls) is not cls:
        raise ValueError(f"method name {cls.name!r} is taken by {SCORERS[cls.name].__name__}")
    SCORERS[cls.name] = cls
    return cls


def methods(query_aware: bool | None = None, learned: bool | None = None) -> list[str]:
    """Registered method names, sorted; ``query_aware``/``learned`` filter on the class attributes
    ``needs_queries``/``learned`` when given (None: no filter)."""
    return sorted(
        name
        for name, cls in SCORERS.items()
        if query_aware in (None, cls.needs_queries) and learned in (None, cls.learned)
    )


def available_methods() -> list[str]:
    """Names accepted by ``KVPCache(method=...)``: ``methods()`` with no filter."""
    return methods()


def make_scorer(method: str, **options) -> Scorer:
    """Instantiate a scorer by name; unknown names and options get an error listing what exists."""
    if method not in SCORERS:
        raise ValueError(f"Unknown method {method!r}; available methods: {', '.join(methods())}")
    cls = SCORERS[method]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(options) - fields
    if unknown:
        raise TypeError(
            f"Unknown option(s) {sorted(unknown)} for method {method!r}; its options are: {sorted(fields) or 'none'}"
        )
    return cls(**options)
