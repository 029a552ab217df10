"""How a total cache budget is split among KV heads: the same share everywhere, or adaptively.

Today every KV head of every evicting layer keeps the same number of its prompt entries. Given
scores comparable across heads and layers (higher = keep), :func:`allocate` instead decides where
one shared total goes, in one of :data:`MODES`:

- ``"uniform"``: every head keeps its own top ``k`` entries, exactly as ``KVPCache`` does (``k``
  from :func:`kvp_cache.budget.kept_per_row`, sinks and window forced in by
  :func:`kvp_cache.budget.protect_sinks_and_window`);
- ``"head"``: every head first keeps its ``min_per_head`` best entries (protected ones first),
  then ONE top-k over every remaining (layer, head, token) entry hands out the rest of the total;
- ``"layer"``: the ``"head"`` selection only decides each layer's total, which is split evenly
  over the layer's heads (the remainder of the division goes to the heads whose next entry scores
  highest); each head then keeps its own top entries.

Every mode keeps exactly ``k * (KV heads summed over layers)`` entries, where ``k`` is the
per-head count of today's cache: ``ceil(budget * tokens)`` for a fraction, ``min(budget, tokens)``
for an int. So a fraction's share is rounded up to a whole entry per head, identically in every
mode, and the modes compare at exactly equal totals. Each head keeps its protected entries (the
first ``sink_tokens`` and last ``window_tokens`` tokens, clipped to ``k`` as the cache clips them)
and at least ``min_per_head`` entries; its kept set is always its top entries by score.
"""

from __future__ import annotations

import math

import torch

from kvp_cache.budget import Budget, kept_per_row, protect_sinks_and_window, validate_budget, validate_count

MODES = ("uniform", "layer", "head")
MIN_EXTRA_PER_HEAD = 8
"""The default minimum per head is the protected entries plus this many (capped at the per-head
budget): small enough to leave nearly all of the budget to the global ranking, yet no head is
reduced to its sinks and window alone."""


def allocate(
    scores: dict[int, torch.Tensor],
    budget: Budget,
    mode: str = "uniform",
    min_per_head: int | None = None,
    sink_tokens: int = 4,
    window_tokens: int = 16,
) -> dict[int, torch.Tensor]:
    """The kept entries of every layer: ``{layer_idx: bool [kv_heads, tokens]}``.

    scores: ``{layer_idx: [kv_heads, tokens]}``, finite, the same ``tokens`` in every layer (one
        prompt), comparable across heads and layers (higher = keep).
    budget: a fraction in (0, 1] of the prompt's entries, or an int: entries per head on average
        (:func:`kvp_cache.budget.validate_budget`); the total is the same in every mode.
    mode: one of :data:`MODES` (see the module docstring).
    min_per_head: entries every head keeps at least (``"head"`` and ``"layer"``), protected ones
        included, from 1 up to the per-head budget; None: the protected entries plus
        :data:`MIN_EXTRA_PER_HEAD`, capped at the per-head budget.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    budget = validate_budget(budget)
    sinks = validate_count("sink_tokens", sink_tokens, 0)
    window = validate_count("window_tokens", window_tokens, 0)
    tokens = _check_scores(scores)
    per_head = int(kept_per_row(budget, torch.tensor([tokens]))[0])
    ranked = {layer: _ranks(s, per_head, sinks, window) for layer, s in scores.items()}
    protected = int(_protected(tokens, per_head, sinks, window).sum())
    if min_per_head is None:
        minimum = min(per_head, protected + MIN_EXTRA_PER_HEAD)
    else:
        minimum = validate_count("min_per_head", min_per_head, 1)
        if minimum > per_head:
            raise ValueError(
                f"min_per_head ({minimum}) exceeds the per-head budget ({per_head} of {tokens} tokens "
                f"at budget {budget}); lower it or raise the budget"
            )
        minimum = max(minimum, protected)
    if mode == "uniform":
        counts = {layer: torch.full((s.shape[0],), per_head) for layer, s in scores.items()}
    else:
        counts = _global_counts(scores, ranked, per_head, minimum)
        if mode == "layer":
            counts = {layer: _even_split(scores[layer], ranked[layer], c) for layer, c in counts.items()}
    return {layer: ranked[layer] < counts[layer][:, None] for layer in scores}


def _check_scores(scores: dict[int, torch.Tensor]) -> int:
    """The prompt's token count, after checking the scores' shapes and values."""
    if not isinstance(scores, dict) or not scores:
        raise ValueError("scores must be a non-empty dict {layer_idx: [kv_heads, tokens]}")
    shapes = {layer: tuple(s.shape) for layer, s in scores.items()}
    if any(len(shape) != 2 or 0 in shape for shape in shapes.values()):
        raise ValueError(f"every score tensor must be [kv_heads, tokens] with both >= 1, got {shapes}")
    if len({shape[1] for shape in shapes.values()}) != 1:
        raise ValueError(f"every layer must score the same prompt (same tokens), got {shapes}")
    bad = [layer for layer, s in scores.items() if not torch.isfinite(s).all()]
    if bad:
        raise ValueError(f"scores must be finite; layers {bad} hold NaN or infinite values")
    return next(iter(shapes.values()))[1]


def _protected(tokens: int, per_head: int, sinks: int, window: int) -> torch.Tensor:
    """``[tokens]`` bool: the sinks and window a head of ``per_head`` entries keeps (the cache's rule)."""
    zero = torch.zeros(1, 1, tokens)
    positions = torch.arange(tokens)[None]
    count = torch.tensor([per_head])
    return protect_sinks_and_window(zero, positions, torch.tensor([tokens]), count, sinks, window)[0, 0] > 0


def _ranks(scores: torch.Tensor, per_head: int, sinks: int, window: int) -> torch.Tensor:
    """``[kv_heads, tokens]`` long: each entry's rank within its head (0 = kept first), protected
    entries first; a head keeping ``c`` entries keeps those of rank ``< c``."""
    tokens = scores.shape[1]
    protected = _protected(tokens, per_head, sinks, window)
    boosted = scores.float().masked_fill(protected, math.inf)
    order = boosted.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(tokens).expand_as(order))
    return ranks


def _global_counts(
    scores: dict[int, torch.Tensor], ranked: dict[int, torch.Tensor], per_head: int, minimum: int
) -> dict[int, torch.Tensor]:
    """Entries per head, ``{layer: [kv_heads]}``: ``minimum`` each, then one top-k over every other
    entry of every head and layer for the rest of the ``per_head * heads`` total."""
    layers = list(scores)
    candidates = torch.cat(
        [scores[layer].float().masked_fill(ranked[layer] < minimum, -math.inf).flatten() for layer in layers]
    )
    heads = sum(scores[layer].shape[0] for layer in layers)
    chosen = torch.zeros_like(candidates, dtype=torch.bool)
    chosen[candidates.topk((per_head - minimum) * heads).indices] = True
    counts, start = {}, 0
    for layer in layers:
        size = scores[layer].numel()
        counts[layer] = minimum + chosen[start : start + size].view_as(scores[layer]).sum(-1)
        start += size
    return counts


def _even_split(scores: torch.Tensor, ranks: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``counts`` ``[kv_heads]``'s total split evenly over the heads; the remainder goes one entry
    each to the heads whose best entry beyond the even share scores highest."""
    heads, tokens = scores.shape
    share, remainder = divmod(int(counts.sum()), heads)
    even = torch.full((heads,), share)
    if remainder:
        # share < tokens here: a remainder means the layer does not keep every entry of every head.
        next_best = scores.float().masked_fill(ranks != share, -math.inf).amax(-1)
        even[next_best.topk(remainder).indices] += 1
    return even
