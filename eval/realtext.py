"""The real-text protocols: compress a long prefix, or read a long text under a cache cap, and
score the true continuation.

A window of a held-out corpus (:mod:`eval.corpora`) is ``prefix_tokens + continuation_tokens``
long. The prefix is prefilled once; each (method, budget) compresses it, then ONE forward of the
continuation on the compressed cache gives the logits of every continuation token. Those logits
are exact whatever the cache does after that forward (its eviction at the end of the forward
cannot change them), and the first continuation token comes from the prefill's own logits, which
are the same for every method. The score is the mean NLL per continuation token.

Under a cap (the benchmark's ``decode`` protocol) the prefix goes into a cache capped at
``max_cache_tokens`` and the continuation is read in chunks (``chunk_tokens``), the cache evicting
between them as it would while decoding.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from eval.corpora import corpus
from kvp_cache.integrations import forward_tokens
from kvp_cache.models import leading_special_ids
from kvp_cache.prefill import Prefill


@lru_cache(maxsize=4)
def corpus_tokens(name: str, tokenizer) -> torch.Tensor:
    """The corpus as one ``[tokens]`` stream: its documents tokenized, joined by a blank line."""
    separator = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    for document in corpus(name).documents():
        ids += tokenizer(document, add_special_tokens=False)["input_ids"] + separator
    return torch.tensor(ids, dtype=torch.long)


WINDOWS = "spread-slots"
"""How :func:`windows` places windows. Benchmark text records carry it (:func:`placement`), and
records made otherwise (before windows stopped depending on their count) are never read."""


def spread_order(n: int) -> list[int]:
    """``0 .. n-1`` in an order whose every prefix is spread evenly over the range (van der Corput:
    0, n/2, n/4, 3n/4, ...)."""
    bits = max(n - 1, 0).bit_length()
    order: dict[int, None] = {}
    for i in range(1 << bits):
        reversed_i = int(format(i, f"0{bits}b")[::-1], 2) if bits else 0
        order.setdefault(reversed_i * n >> bits, None)
    return list(order)


def windows(stream: torch.Tensor, length: int, count: int) -> list[torch.Tensor]:
    """``count`` non-overlapping ``[1, length]`` windows of ``stream`` ``[tokens]``, spread over it.

    The stream is cut into slots of ``length`` tokens taken in :func:`spread_order`, so window ``i``
    does not depend on ``count``: raising the count adds windows and keeps the first ones (a resumed
    benchmark tops its records up instead of mixing windows of two placements).
    """
    if length < 2:
        raise ValueError(f"length must be >= 2 (a prefix and a continuation token), got {length}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    slots = stream.shape[0] // length
    if count > slots:
        raise ValueError(
            f"the corpus has {stream.shape[0]} tokens: too few for {count} windows of {length}; lower the count"
        )
    return [stream[slot * length : (slot + 1) * length][None] for slot in spread_order(slots)[:count]]


def corpus_windows(name: str, tokenizer, length: int, count: int) -> list[torch.Tensor]:
    """``count`` ``[1, length]`` windows of corpus ``name`` (:func:`windows`), each starting with the
    ids the tokenizer puts before any text (Gemma's BOS; none for SmolLM2), as every prompt the
    model sees does (a base model read without its BOS is out of its distribution all along the
    window). The rest of the window is ``length`` minus those ids of text."""
    start = torch.tensor([leading_special_ids(tokenizer)], dtype=torch.long)
    stream = corpus_tokens(name, tokenizer)
    return [torch.cat([start, w], -1) for w in windows(stream, length - start.shape[1], count)]


def placement(tokenizer) -> str:
    """What text records of windows from :func:`corpus_windows` carry as ``windows``:
    :data:`WINDOWS`, plus ``+bos`` when they start with the tokenizer's leading ids (records of
    Gemma 3 read without its BOS, made before, are never read)."""
    return WINDOWS + ("+bos" if leading_special_ids(tokenizer) else "")


@torch.no_grad()
def continuation_nll(
    model,
    prefilled: Prefill,
    cache,
    continuation: torch.Tensor,
    scored: int | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Mean NLL per token ``[rows]`` of ``continuation`` (``[1, c]``) after the prefilled prefix.

    ``cache`` holds the prefix for ``rows`` rows (a stack of compressed caches, or an uncompressed
    copy of ``prefilled.cache``); it is consumed. ``scored``: only the last ``scored`` tokens count
    (the earlier ones, a question say, are read but not scored); default all. ``chunk_tokens``:
    None reads the continuation in one forward; an int reads it that many tokens per forward, so a
    cache under ``max_cache_tokens`` evicts between them as while decoding (each token attends to
    the cache as it stood at its chunk's start plus the chunk's earlier tokens).
    """
    rows = cache.layers[0].keys.shape[0]
    target = continuation.expand(rows, -1)
    first = F.cross_entropy(prefilled.next_token_logits.expand(rows, -1), target[:, 0], reduction="none")
    losses = [first[:, None]]
    step = chunk_tokens or target.shape[1]
    for start in range(0, target.shape[1] - 1, step):
        end = min(start + step, target.shape[1] - 1)
        logits = forward_tokens(model, cache, target[:, start:end]).float()
        losses.append(
            F.cross_entropy(logits.transpose(1, 2), target[:, start + 1 : end + 1], reduction="none")
        )
    return torch.cat(losses, dim=1)[:, -(scored or target.shape[1]) :].mean(-1)
