"""Budgets and schedules: how many cache entries each KV head keeps, and when it evicts."""

from __future__ import annotations

import argparse
import math
import numbers

import torch

Budget = float | int

COMPRESS_SCHEDULES = ("every_prefill", "first_prefill")
"""``KVPCache(compress=...)``: evict after every multi-token forward, or after the first one only."""


def validate_budget(budget: object) -> Budget:
    """Return ``budget`` if valid, else raise a ``TypeError``/``ValueError`` naming the allowed range.

    A float in (0, 1] is the fraction of each row's prompt tokens kept per head; an int >= 1 is a
    token count kept per head.
    """
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise TypeError(
            f"budget must be a float in (0, 1] (fraction kept) or an int >= 1 (tokens kept), got {budget!r}"
        )
    if isinstance(budget, numbers.Integral):
        if budget < 1:
            raise ValueError(f"budget as an int is a token count and must be >= 1, got {budget}")
        return int(budget)
    if not math.isfinite(budget) or not 0.0 < budget <= 1.0:
        raise ValueError(f"budget as a float is a fraction and must be in (0, 1], got {budget}")
    return float(budget)


def validate_count(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum``, else a ``ValueError`` naming ``name`` and the range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def validate_schedule(
    compress: object,
    max_cache_tokens: object,
    evict_every: object,
    sink_tokens: int,
    window_tokens: int,
    method: str,
    scores_decoded_tokens: bool,
) -> None:
    """Check ``KVPCache``'s schedule arguments; errors name the parameter and the allowed values."""
    if compress not in COMPRESS_SCHEDULES:
        raise ValueError(f"compress must be one of {COMPRESS_SCHEDULES}, got {compress!r}")
    validate_count("evict_every", evict_every, 1)
    if max_cache_tokens is None:
        return
    protected = sink_tokens + window_tokens
    validate_count(
        f"max_cache_tokens (at least sink_tokens + window_tokens = {sink_tokens} + {window_tokens})",
        max_cache_tokens,
        max(protected, 1),
    )
    if not scores_decoded_tokens:
        raise ValueError(
            f"max_cache_tokens needs a method that can rank decoded tokens; method {method!r} cannot "
            "(see its docstring). Use another method, or max_cache_tokens=None."
        )


def parse_budget(text: str) -> Budget:
    """A command-line budget: ``"0.25"`` -> 0.25 (fraction kept), ``"512"`` -> 512 (tokens kept), validated."""
    try:
        value: Budget = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"budget must be a fraction in (0, 1] or a token count >= 1, got {text!r}"
            ) from None
    try:
        return validate_budget(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def kept_per_row(budget: Budget, real_lengths: torch.Tensor) -> torch.Tensor:
    """Entries to keep for each row: ``[batch]`` long tensor, never more than the row's real tokens.

    A fraction is applied to each row's own length, so a padded row keeps what it would keep alone.
    """
    if isinstance(budget, float):
        kept = torch.ceil(real_lengths.double() * budget).long()
    else:
        kept = torch.full_like(real_lengths, budget)
    return torch.minimum(kept, real_lengths).clamp_min(1)


def protected_entries(
    positions: torch.Tensor, real_lengths: torch.Tensor, kept: torch.Tensor, sinks: int, window: int
) -> torch.Tensor:
    """Which entries are the first ``sinks`` and last ``window`` real tokens: bool, ``positions``' shape.

    positions: ``[batch, seq]`` or ``[batch, kv_heads, seq]`` real-token index (-1 on pads);
    real_lengths: ``[batch]`` or ``[batch, kv_heads]``, matching; kept: ``[batch]`` entries kept per head.
    When a row keeps fewer entries than ``sinks + window`` the window wins first, then the sinks,
    so the protected set never exceeds the kept count and the result stays deterministic.
    """
    extra = (None,) * (positions.dim() - 1)
    window_row = torch.clamp(kept, max=window)
    sinks_row = torch.clamp(kept - window_row, max=sinks)
    is_sink = (positions >= 0) & (positions < sinks_row[(...,) + extra])
    start = real_lengths - window_row.view(-1, *([1] * (real_lengths.dim() - 1)))
    return is_sink | (positions >= start[..., None])


def protect_sinks_and_window(
    scores: torch.Tensor,
    positions: torch.Tensor,
    real_lengths: torch.Tensor,
    kept: torch.Tensor,
    sinks: int,
    window: int,
) -> torch.Tensor:
    """Force the first ``sinks`` and last ``window`` real tokens of every row into the kept set.

    scores: ``[batch, kv_heads, seq]``; positions: ``[batch, seq]`` real-token index (-1 on pads);
    see :func:`protected_entries`.
    """
    protected = protected_entries(positions, real_lengths, kept, sinks, window)[:, None, :]
    return scores.masked_fill(protected, torch.finfo(scores.dtype).max)
