"""What a cached token is worth to the future: the importance targets, one definition each.

They define the method: training ranks against them (``train/targets.py`` picks one by name) and
the benchmark's oracle rows keep what they rank highest (``eval/oracle.py``). With ``A_g[t, i]``
the model's full causal softmax attention of query head ``g`` at position ``t`` to token ``i``
(over every earlier token, never renormalized to a subset) and ``G(h)`` the query heads that
share KV head ``h``:

- after a prefill (:func:`future_attention`): ``importance[h, i] = sum_t max_{g in G(h)} A_g[t, i]``
  over the future queries ``t`` (the paper's future attention, section 4), and its value-weighted
  twin ``sum_t max_g A_g[t, i] * ||W_o^g v_i||`` (:func:`value_output_norms`);
- while decoding under ``max_cache_tokens`` (:func:`decode_attention`): at each eviction of the
  cache's schedule (:func:`eviction_points`), the same sum over the queries that read the cache it
  leaves, until the next eviction (or a fixed horizon), with the entries the cache protects
  anyway (sinks and recent window) zeroed, as :func:`evictable_only` does after a prefill.

The queries come from :class:`kvp_cache.capture.QueryCapture` hooks on the attention modules of
the evicting layers (:func:`attention_modules`, :func:`captured_queries`).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator, Sequence

import torch

from kvp_cache.capture import QueryCapture
from kvp_cache.compat import attention_shape, evicting_layer_indices
from kvp_cache.scorers import QueryStates


def attention_modules(model) -> list[torch.nn.Module]:
    """The attention modules of the evicting layers, in layer order (Llama-style: ``q_proj`` and
    ``layer_idx``); sliding-window layers are never evicted, so they have no target."""
    modules = sorted(
        (m for m in model.modules() if hasattr(m, "q_proj") and getattr(m, "layer_idx", None) is not None),
        key=lambda m: m.layer_idx,
    )
    layers = attention_shape(model.config).num_layers
    if len(modules) != layers:
        raise NotImplementedError(
            f"importance targets need Llama-style attention modules (q_proj, layer_idx); found {len(modules)} "
            f"of {layers}"
        )
    evicting = set(evicting_layer_indices(model.config))
    return [m for m in modules if m.layer_idx in evicting]


@contextlib.contextmanager
def captured_queries(model, modules: list[torch.nn.Module]) -> Iterator[dict[int, QueryStates]]:
    """While open, every forward stores, per module's ``layer_idx``, the :class:`QueryStates` of ALL its
    tokens (post-RoPE ``queries`` ``[batch, q_heads, tokens, head_dim]``); the last forward wins."""
    capture = QueryCapture(model, -1, {module.layer_idx for module in modules})
    store: dict[int, QueryStates] = {}
    capture.attach(store)
    try:
        yield store
    finally:
        capture.detach()


@torch.no_grad()
def future_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    prompt_len: int,
    scaling: float,
    value_norms: torch.Tensor | None = None,
    chunk: int = 128,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(importance, value_importance)`` of the prompt tokens, each ``[kv_heads, prompt_len]`` float32
    on the keys' device.

    queries: ``[q_heads, F, d]`` post-RoPE queries at positions ``T - F .. T - 1``;
    keys: ``[kv_heads, T, d]`` post-RoPE keys of prompt + future;
    value_norms: ``[q_heads, prompt_len]`` ``||W_o^g v_i||`` (:func:`value_output_norms`), or None to
    skip the value-aware target. Causal softmax in float32 over all ``T`` keys, future queries in
    chunks (never a full ``T x T`` matrix); max over each GQA group, then sum over the queries.
    """
    kv_heads, _, d = keys.shape
    weights = None if value_norms is None else value_norms.float().view(kv_heads, -1, 1, prompt_len)
    importance = torch.zeros(kv_heads, prompt_len, device=keys.device)
    value_importance = None if weights is None else torch.zeros_like(importance)
    for _, attention in causal_attention_chunks(queries, keys, scaling, chunk):
        attention = attention[..., :prompt_len]  # [kv_heads, group, chunk, prompt_len]
        importance += attention.amax(dim=1).sum(dim=1)
        if weights is not None:
            value_importance += (attention * weights).amax(dim=1).sum(dim=1)
    return importance, value_importance


def causal_attention_chunks(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, chunk: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """The model's causal softmax attention, ``chunk`` queries at a time: ``(first query index among
    the queries, attention [kv_heads, group, chunk, T] float32)``.

    queries: ``[q_heads, F, d]`` post-RoPE at positions ``T - F .. T - 1``; keys: ``[kv_heads, T, d]``.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 query, got {chunk}")
    kv_heads, total, d = keys.shape
    q_heads, future, _ = queries.shape
    if future > total or q_heads % kv_heads:
        raise ValueError(
            f"queries {tuple(queries.shape)} do not fit keys {tuple(keys.shape)}: at most T queries, and "
            "q_heads a multiple of kv_heads"
        )
    grouped = queries.float().view(kv_heads, q_heads // kv_heads, future, d)
    keys = keys.float()
    key_pos = torch.arange(total, device=keys.device)
    for start in range(0, future, chunk):
        q = grouped[:, :, start : start + chunk]
        query_pos = torch.arange(q.shape[2], device=keys.device) + (total - future + start)
        logits = torch.einsum("hgfd,htd->hgft", q, keys) * scaling
        logits = logits.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        yield start, logits.softmax(-1)


def value_output_norms(values: torch.Tensor, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """``||W_o^g v_i||`` for every query head ``g`` and token ``i``: ``[q_heads, n]`` float32.

    values: ``[kv_heads, n, d]``; o_proj_weight: ``[hidden, q_heads * d]``. Uses the ``d x d`` Gram
    matrix ``W_o^g^T W_o^g`` per head, so the cost does not grow with the hidden size per token.
    """
    kv_heads, n, d = values.shape
    hidden = o_proj_weight.shape[0]
    per_head = o_proj_weight.float().view(hidden, -1, d)  # [hidden, q_heads, d]
    q_heads = per_head.shape[1]
    gram = torch.einsum("xgd,xge->gde", per_head, per_head)  # [q_heads, d, d]
    v = values.float().repeat_interleave(q_heads // kv_heads, dim=0)  # [q_heads, n, d]
    return torch.einsum("gnd,gde,gne->gn", v, gram, v).clamp_min(0).sqrt()


def evictable_only(importance: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """``importance`` ``[kv_heads, n]`` with the always-kept first ``sinks`` and last ``window`` zeroed."""
    n = importance.shape[-1]
    evictable = torch.zeros(n, dtype=torch.bool, device=importance.device)
    evictable[sinks : max(sinks, n - window)] = True
    return importance * evictable


def eviction_points(forward_tokens: Sequence[int], max_cache_tokens: int, evict_every: int) -> list[int]:
    """When a ``KVPCache(budget=1.0, max_cache_tokens=C, evict_every=E)`` evicts, for a sequence read
    in forwards of ``forward_tokens`` tokens each (``[1] * T``: token by token; ``[prompt, chunk,
    chunk, ...]``: a prompt, then chunks).

    A head holding more than ``C + E`` entries at the end of a forward is trimmed to ``C``
    (``KVPCache._kept_after``). Returns, for each eviction, the number of tokens read when it
    happens (``t``: it ranks tokens ``0 .. t - 1``, and the queries at positions ``t ..`` read the
    cache it leaves), increasing.
    """
    if max_cache_tokens < 1 or evict_every < 1:
        raise ValueError(
            f"max_cache_tokens and evict_every must be >= 1, got {max_cache_tokens} and {evict_every}"
        )
    if any(n < 1 for n in forward_tokens):
        raise ValueError(f"forward_tokens must all be >= 1, got {list(forward_tokens)}")
    points, held, read = [], 0, 0
    for n in forward_tokens:
        held, read = held + n, read + n
        if held > max_cache_tokens + evict_every:
            points.append(read)
            held = max_cache_tokens
    return points


@torch.no_grad()
def decode_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    evictions: Sequence[int],
    sinks: int,
    window: int,
    horizon: int | None = None,
    chunk: int = 128,
) -> torch.Tensor:
    """The decode-time target: what each token is worth to the cache each eviction leaves.

    queries: ``[q_heads, F, d]`` post-RoPE queries at positions ``T - F .. T - 1``;
    keys: ``[kv_heads, T, d]`` post-RoPE keys of the whole sequence (the uncapped model's);
    evictions: tokens read at each eviction (:func:`eviction_points`), increasing, each in
    ``[T - F, T]`` (every query that reads an evicted cache must be given);
    sinks, window: the cache's ``sink_tokens`` and ``window_tokens``;
    horizon: None, the queries from an eviction until the next one (the last: until ``T``); or
    ``H >= 1``, the ``H`` queries after each eviction (fewer at the end of the sequence).

    Returns ``importance`` ``[len(evictions), kv_heads, T]`` float32 on the keys' device:
    ``importance[k, h, i]`` is the sum, over the queries ``t`` of eviction ``k``'s span (positions
    ``evictions[k] ..``), of ``max_{g in G(h)} A_g[t, i]``, the model's full causal softmax
    attention (not renormalized to the entries the cache holds). It is zero for tokens not read by
    eviction ``k`` (``i >= evictions[k]``) and for the ones it protects: the first ``sinks`` and
    the ``window`` last read (``evictable_only``). Queries go ``chunk`` at a time (never ``T x T``).
    """
    kv_heads, total, _ = keys.shape
    first = total - queries.shape[1]
    starts = list(evictions)
    if any(b <= a for a, b in zip(starts, starts[1:], strict=False)) or (
        starts and not first <= starts[0] <= starts[-1] <= total
    ):
        raise ValueError(
            f"evictions must increase within [T - F, T] = [{first}, {total}] (the queries given), got {starts}"
        )
    if horizon is not None and horizon < 1:
        raise ValueError(f"horizon must be None (until the next eviction) or >= 1 query, got {horizon}")
    if horizon is None:
        ends = [*starts[1:], total]
    else:
        ends = [min(start + horizon, total) for start in starts]
    importance = torch.zeros(len(starts), kv_heads, total, device=keys.device)
    for offset, attention in causal_attention_chunks(queries, keys, scaling, chunk):
        per_query = attention.amax(dim=1)  # [kv_heads, chunk, T]
        lo, hi = first + offset, first + offset + per_query.shape[1]
        # Spans start and end in increasing order, so those overlapping [lo, hi) are contiguous.
        for k in range(bisect.bisect_right(ends, lo), bisect.bisect_left(starts, hi)):
            start, end = max(starts[k], lo), min(ends[k], hi)
            importance[k, :, : starts[k]] += per_query[:, start - lo : end - lo, : starts[k]].sum(dim=1)
    for k, read in enumerate(starts):
        importance[k, :, :read] = evictable_only(importance[k, :, :read], sinks, window)
    return importance
