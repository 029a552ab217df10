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

:func:`head_counts` is the batched core, over padded ``[batch, kv_heads, entries]`` scores whose
heads may hold different entries (a cache that already allocated adaptively), and
:func:`top_entries` picks each head's kept entries: ``KVPCache`` calls them at every eviction with
``allocation="layer" | "head"``; :func:`allocate` is the one-prompt form.
"""

from __future__ import annotations

import math

import torch

from kvp_cache.budget import Budget, kept_per_row, protected_entries, validate_budget, validate_count

MODES = ("uniform", "layer", "head")
MIN_EXTRA_PER_HEAD = 8
"""The default minimum per head is the protected entries plus this many (capped at the per-head
budget): small enough to leave nearly all of the budget to the global ranking, yet no head is
reduced to its sinks and window alone."""


def validate_mode(mode: object, name: str = "mode") -> str:
    """``mode`` if it is one of :data:`MODES`, else a ``ValueError`` naming ``name`` and the modes."""
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {MODES}, got {mode!r}")
    return mode


def allocate(
    scores: dict[int, torch.Tensor],
    budget: Budget,
    mode: str = "uniform",
    min_per_head: int | None = None,
    sink_tokens: int = 4,
    window_tokens: int = 16,
    ranking: dict[int, torch.Tensor] | None = None,
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
    ranking: scores of the same shapes that pick each head's entries once ``scores`` have set how
        many it keeps (None: ``scores`` pick them too); any scale, only each head's order counts.
        It separates an allocation's two decisions, for example the oracle's counts with a
        policy's ranking (``python -m eval.headroom --scores kvp_oracle_counts``).
    """
    validate_mode(mode)
    budget = validate_budget(budget)
    sinks = validate_count("sink_tokens", sink_tokens, 0)
    window = validate_count("window_tokens", window_tokens, 0)
    if min_per_head is not None:
        validate_count("min_per_head", min_per_head, 1)
    tokens = _check_scores(scores)
    if ranking is not None and (
        set(ranking) != set(scores) or any(ranking[k].shape != scores[k].shape for k in scores)
    ):
        raise ValueError("ranking must hold a tensor of the scores' shape for every layer of scores")
    per_head = kept_per_row(budget, torch.tensor([tokens]))
    positions = torch.arange(tokens).expand(1, 1, tokens)
    valid = torch.ones(1, 1, tokens, dtype=torch.bool)
    layers = list(scores)
    padded = [scores[layer].float()[None] for layer in layers]
    protected = [
        protected_entries(positions, valid.sum(-1), per_head, sinks, window).expand_as(s) for s in padded
    ]
    valid = [valid.expand_as(s) for s in padded]
    counts = head_counts(padded, valid, protected, per_head, mode, min_per_head)
    picking = padded if ranking is None else [ranking[layer].float()[None] for layer in layers]
    return {
        layer: top_entries(s, v, p, c)[0]
        for layer, s, v, p, c in zip(layers, picking, valid, protected, counts, strict=True)
    }


def top_entries(
    scores: torch.Tensor, valid: torch.Tensor, protected: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The first ``counts[row, head]`` entries of each head, bool ``[batch, kv_heads, entries]``, in
    the order every allocation keeps them: protected entries by score, then the other valid ones
    by score, then invalid ones; ties go to the lower index, NaN scores last within their tier.

    scores, valid, protected: ``[batch, kv_heads, entries]``; counts: ``[batch, kv_heads]`` long.
    Two :func:`largest` passes (a ``topk`` each) instead of sorting every head.
    """
    ranked = finite_scores(scores)
    from_protected = torch.minimum(counts, protected.sum(-1))
    return _largest_per_head(ranked.masked_fill(~protected, -math.inf), from_protected) | _largest_per_head(
        ranked.masked_fill(protected | ~valid, -math.inf), counts - from_protected
    )


def finite_scores(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` as float32 with NaN and -inf raised to the lowest finite value, so that masking
    with -inf afterwards ranks every entry left unmasked above every masked one, whatever it scored."""
    lowest = torch.finfo(torch.float32).min
    return scores.float().nan_to_num(nan=lowest).clamp(min=lowest)


def _largest_per_head(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """:func:`largest` of every head: ``values`` ``[batch, kv_heads, entries]``, ``counts`` ``[batch, kv_heads]``."""
    return largest(values.flatten(0, 1), counts.flatten()).view_as(values)


def head_counts(
    scores: list[torch.Tensor],
    valid: list[torch.Tensor],
    protected: list[torch.Tensor],
    per_head: torch.Tensor,
    mode: str,
    min_per_head: int | None = None,
) -> list[torch.Tensor]:
    """Entries each head keeps, one ``[batch, kv_heads]`` long tensor per layer.

    scores, valid, protected: per layer ``[batch, kv_heads, entries]``: scores comparable across
    heads and layers, which entries are real, which are the head's protected sinks and window;
    per_head: ``[batch]``, what every head keeps under a uniform budget, so each row keeps
    ``per_head * heads`` in all (or everything it has, if less). Each head keeps its entries in
    :func:`top_entries`' order.
    """
    available = [v.sum(-1) for v in valid]
    per_head = per_head.to(scores[0].device)
    if mode == "uniform":
        return [torch.minimum(per_head[:, None], a) for a in available]
    protected_counts = [p.sum(-1) for p in protected]
    if min_per_head is None:
        floors = [torch.minimum(p + MIN_EXTRA_PER_HEAD, per_head[:, None]) for p in protected_counts]
    else:
        if bool((per_head < min_per_head).any()):
            raise ValueError(
                f"min_per_head ({min_per_head}) exceeds the per-head budget ({int(per_head.min())} entries "
                "at this budget and prompt length); lower min_per_head or raise the budget"
            )
        floors = [torch.clamp(p, min=min_per_head) for p in protected_counts]
    floors = [torch.minimum(f, a) for f, a in zip(floors, available, strict=True)]
    heads = sum(s.shape[1] for s in scores)
    total = torch.minimum(per_head * heads, sum(a.sum(-1) for a in available))
    need = total - sum(f.sum(-1) for f in floors)  # [batch]
    candidates = torch.cat(
        [
            finite_scores(s).masked_fill(top_entries(s, v, p, f) | ~v, -math.inf).flatten(1)
            for s, v, p, f in zip(scores, valid, protected, floors, strict=True)
        ],
        dim=1,
    )
    chosen = largest(candidates, need)
    counts, start = [], 0
    for s, f in zip(scores, floors, strict=True):
        size = s.shape[1] * s.shape[2]
        counts.append(f + chosen[:, start : start + size].view_as(s).sum(-1))
        start += size
    if mode == "layer":
        counts = [_even_split(*args) for args in zip(scores, valid, protected, counts, strict=True)]
    return counts


def largest(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bool ``[batch, n]``: the ``counts[row]`` largest of each row of ``values`` ``[batch, n]``, ties
    going to the lower index (what a stable descending sort takes first). One ``topk`` finds each
    row's threshold: on a 4K prompt's 90 heads it costs a fraction of sorting every entry."""
    k = int(counts.max())
    if k == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    # A row keeping 0 reads its largest value as threshold: nothing is above it and it has no room.
    threshold = values.topk(k, dim=-1).values.gather(-1, (counts[:, None] - 1).clamp(min=0))
    above, tied = values > threshold, values == threshold
    room = counts[:, None] - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room))


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


def _even_split(
    scores: torch.Tensor, valid: torch.Tensor, protected: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``counts`` ``[batch, kv_heads]``'s row totals split evenly over the heads; the remainder goes
    one entry each to the heads whose best entry beyond the even share scores highest."""
    heads = scores.shape[1]
    total = counts.sum(-1)
    share, remainder = total // heads, total % heads
    # A remainder means the layer does not keep every entry of every head, so each head has a next
    # entry: among its protected ones left, if any, else among its other valid ones.
    left = valid & ~top_entries(scores, valid, protected, share[:, None].expand(-1, heads))
    left_protected = left & protected
    pool = torch.where(left_protected.any(-1, keepdim=True), left_protected, left)
    next_best = scores.float().nan_to_num(nan=-math.inf).masked_fill(~pool, -math.inf).amax(-1)
    order = next_best.argsort(dim=-1, descending=True, stable=True)
    extra = torch.zeros_like(counts).scatter_(
        -1, order, (torch.arange(heads, device=counts.device) < remainder[:, None]).long()
    )
    return share[:, None] + extra
