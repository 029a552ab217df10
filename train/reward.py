"""The one definition of eviction cost, used by ``fit``, ``evaluate`` and the plots.

Importance ``c`` of a prompt token is the attention it receives from the future queries (see
``collect``). A ranking ``sigma`` (best first) keeps its top ``b`` tokens at budget ``b`` and evicts
the rest, so the evicted mass at budget ``b`` is ``sum_{i >= b} c_{sigma_i}`` (with ``c`` normalized
to sum 1). Summing it over every budget ``b = 0..n-1`` gives the area under the evicted-mass curve::

    cost(sigma) = sum_b sum_{i >= b} c_{sigma_i} = sum_i (i + 1) c_{sigma_i}

exactly as the released KVP code computes it. The oracle sorts ``c`` descending and is the minimum
(rearrangement inequality); ``reward = -cost / oracle_cost`` is ``-1`` for the oracle and lower for
every other ranking.
"""

from __future__ import annotations

import torch

REWARD_FLOOR = -200.0


def normalized(importance: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Importance ``[..., n]`` as a distribution over the valid tokens (negatives and padding count 0)."""
    c = importance.float().clamp_min(0.0)
    if valid is not None:
        c = c * valid
    return c / c.sum(-1, keepdim=True).clamp_min(1e-30)


def ranking_cost(
    ranking: torch.Tensor, importance: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Area under the evicted-mass-vs-budget curve of each ranking.

    ranking: ``[..., n]`` long, a permutation of token indices, best first (padding last).
    importance: ``[..., n]`` non-negative, in token order; valid: ``[..., n]`` bool (False on padding).
    Returns ``[...]`` float32 ``sum_i (i + 1) c_{ranking_i}`` with ``c`` normalized to sum 1.
    """
    c = normalized(importance, valid).gather(-1, ranking)
    weights = torch.arange(1, c.shape[-1] + 1, device=c.device, dtype=c.dtype)
    return (c * weights).sum(-1)


def oracle_cost(importance: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The minimum of :func:`ranking_cost`: tokens sorted by importance, descending. ``[...]``."""
    c = normalized(importance, valid).sort(dim=-1, descending=True).values
    weights = torch.arange(1, c.shape[-1] + 1, device=c.device, dtype=c.dtype)
    return (c * weights).sum(-1)


def ranking_reward(
    ranking: torch.Tensor,
    importance: torch.Tensor,
    valid: torch.Tensor | None = None,
    floor: float | None = None,
) -> torch.Tensor:
    """``-cost / oracle_cost`` in ``(-inf, -1]`` (``-1`` = optimal), optionally clamped at ``floor``."""
    reward = -ranking_cost(ranking, importance, valid) / oracle_cost(importance, valid).clamp_min(1e-8)
    return reward if floor is None else reward.clamp_min(floor)


def rank_by_scores(scores: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Deterministic ranking (best first) of ``[..., n]`` scores; padding goes last."""
    scores = scores.float()
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    return scores.argsort(dim=-1, descending=True, stable=True)


def evicted_fraction(
    scores: torch.Tensor,
    importance: torch.Tensor,
    budgets: list[float],
    protect: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Share of the importance evicted when keeping the top ``ceil(b * n)`` tokens, per budget.

    scores: ``[heads, n]`` (higher = keep) for one sample; importance: ``[heads, n]``.
    protect: ``(sinks, window)``: force those tokens in exactly as the cache does at inference
    (``kvp_cache.budget.protect_sinks_and_window``), which depends on the kept count per budget.
    Returns ``[len(budgets), heads]`` in [0, 1].
    """
    from kvp_cache.budget import kept_per_row, protect_sinks_and_window

    heads, n = scores.shape
    c = normalized(importance, None)
    positions = torch.arange(n, device=scores.device)[None]
    real = torch.tensor([n], device=scores.device)
    out = []
    for budget in budgets:
        kept = kept_per_row(float(budget), real)
        ranked = scores.float()[None]
        if protect is not None:
            ranked = protect_sinks_and_window(ranked, positions, real, kept, protect[0], protect[1])
        order = ranked[0].argsort(dim=-1, descending=True, stable=True)
        out.append(c.gather(-1, order[:, int(kept) :]).sum(-1))
    return torch.stack(out)


def oracle_evicted_fraction(importance: torch.Tensor, budgets: list[float]) -> torch.Tensor:
    """:func:`evicted_fraction` of the oracle (ranking by the true importance, no protection)."""
    return evicted_fraction(importance.float(), importance, budgets, protect=None)


def budget_grid(points: int = 20) -> list[float]:
    """Evenly spaced budget fractions ``1/points .. 1 - 1/points`` used for the AUC."""
    return [i / points for i in range(1, points)]


def normalized_auc(curve: torch.Tensor, oracle_curve: torch.Tensor) -> torch.Tensor:
    """Mean evicted fraction over a budget grid divided by the oracle's (1 = oracle, higher = worse).

    curve, oracle_curve: ``[budgets, ...]`` from :func:`evicted_fraction` on the same grid.
    """
    return curve.mean(0) / oracle_curve.mean(0).clamp_min(1e-12)
