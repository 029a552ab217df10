"""Prefill once, compress many times: what budget sweeps need.

``prefill`` runs the model over the prompt with a plain ``DynamicCache`` and every prompt query
captured. ``KVPCache.from_prefill`` then builds an already-compressed cache for any (method,
budget) from it without running the model again, and ``generate_after_prefill`` decodes from it
greedily. The result is token-identical to ``model.generate(input_ids, cache=KVPCache(...))``:
the first new token comes from the exact prefill logits, later ones from the compressed cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from kvp_cache.capture import QueryCapture, append_queries
from kvp_cache.compat import cache_kwarg, evicting_layer_indices, text_config


@dataclass
class Prefill:
    """The uncompressed prompt state of one batch.

    cache: a ``DynamicCache`` over ``input_ids``.
    queries: layer index -> ``QueryStates`` of every prompt token (full-attention layers only).
    input_ids, attention_mask: ``[batch, seq]`` (mask may be None).
    next_token_logits: ``[batch, vocab]`` logits of the first new token.
    """

    cache: DynamicCache
    queries: dict
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    next_token_logits: torch.Tensor


@torch.no_grad()
def prefill(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> Prefill:
    """Run ``model`` over ``input_ids`` (``[batch, seq]``) and keep its full state.

    ``chunk_tokens``: at most this many prompt tokens per forward (None: one forward). One forward
    materializes attention scores of ``[batch, heads, seq, seq]`` where SDPA takes an explicit mask
    (CPU, Gemma 3), 16 GB per layer at 32K in float32; chunks bound that to ``[.., chunk, seq]``.
    The cache, queries and logits equal one forward's up to float noise.
    """
    seq = input_ids.shape[-1]
    if input_ids.ndim != 2 or seq < 1:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 1, got shape {tuple(input_ids.shape)}")
    if chunk_tokens is not None and (
        isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
    ):
        raise ValueError(f"chunk_tokens must be an int >= 1 or None, got {chunk_tokens!r}")
    chunk = chunk_tokens or seq
    cache = DynamicCache(config=text_config(model.config))
    capture = QueryCapture(model, window=-1, layer_indices=set(evicting_layer_indices(model.config)))
    queries: dict = {}
    step: dict = {}
    capture.attach(step)
    try:
        for start in range(0, seq, chunk):
            end = min(start + chunk, seq)
            step.clear()
            # Only the last position's logits: a 262K vocabulary (Gemma 3) over 8K tokens would be 8.6 GB.
            out = model(
                input_ids=input_ids[:, start:end],
                attention_mask=None if attention_mask is None else attention_mask[:, :end],
                use_cache=True,
                logits_to_keep=1,
                **{cache_kwarg(model): cache},
            )
            for layer, states in step.items():
                queries[layer] = append_queries(queries.get(layer), states, window=None)
    finally:
        capture.detach()
    return Prefill(cache, queries, input_ids, attention_mask, out.logits[:, -1].float())


@torch.no_grad()
def generate_after_prefill(model: PreTrainedModel, prefilled: Prefill, cache, max_new_tokens: int, **kwargs):
    """Greedy continuation ``[batch, max_new_tokens]`` of a prefilled prompt with ``cache``
    (from ``KVPCache.from_prefill``); ``kwargs`` go to ``model.generate``."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    first = prefilled.next_token_logits.argmax(-1, keepdim=True)
    if max_new_tokens == 1:
        return first
    ids = torch.cat([prefilled.input_ids, first], dim=-1)
    mask = prefilled.attention_mask
    if mask is not None:
        mask = torch.cat([mask, torch.ones_like(first, dtype=mask.dtype)], dim=-1)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens - 1,
        do_sample=False,
        **{cache_kwarg(model): cache},
        **kwargs,
    )
    return out[:, prefilled.input_ids.shape[1] :]
