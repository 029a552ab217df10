"""The scorer contract: one score per ``[batch, kv_head, token]``, higher means keep."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class QueryStates:
    """What the capture hooks saw of the prefill queries of one attention layer.

    queries: ``[batch, q_heads, window, head_dim]`` post-RoPE queries of the last ``window`` prompt
        tokens (all tokens when the scorer asks for ``query_window = -1``).
    pre_rope_queries: the same queries before RoPE (after any q-norm), for methods that model the
        distribution of future queries.
    rope_step: ``[head_dim]`` RoPE angle advanced per position (cos/sin layout), and
    last_cos, last_sin: ``[batch, head_dim]`` the RoPE of the last token, so scorers can rotate
        statistics to future positions.
    scaling: the attention softmax scale of the layer.
    """

    queries: torch.Tensor
    pre_rope_queries: torch.Tensor
    rope_step: torch.Tensor
    last_cos: torch.Tensor
    last_sin: torch.Tensor
    scaling: float


@dataclass
class Scorer:
    """Base class: subclasses are dataclasses of their options and implement :meth:`score`.

    Class attributes describe the method (the registry filters on them, see
    :func:`kvp_cache.scorers.methods`):

    - ``name``: the registry name (``KVPCache(method=name)``);
    - ``needs_queries``: True for query-aware methods, whose ``score`` takes ``queries:
      QueryStates`` (captured by hooks on the model); False for key/value-only methods, scored
      inside ``Cache.update`` from the cached states alone;
    - ``query_window`` (query-aware methods): how many of a forward's last queries the capture
      keeps, ``n > 0`` or ``-1`` for all of them;
    - ``learned``: True for trained policies (``kvp``);
    - ``per_token``: a token's score depends on its own key, value and position only, so the
      cache scores each token once, when it enters, and keeps the score (decoding never rescores);
    - ``scores_decoded_tokens``: the method can rank a cache that holds decoded tokens and
      earlier evictions' survivors, so it works with ``max_cache_tokens``;
    - ``comparable_across_heads``: :meth:`cross_head_scores` turns the method's scores into values
      one sort can rank across every head and layer of a model, so it can drive an adaptive
      allocation (``KVPCache(..., allocation="layer" | "head")``);
    - ``age_decay``: 0, or ``lambda > 0``: each eviction ranks ``score - lambda * log2(1 + age)``,
      ``age`` the tokens read since the entry's forward (:func:`kvp_cache.cache.age_decayed`); a
      method that offers it makes it an option.
    """

    name: ClassVar[str] = ""
    needs_queries: ClassVar[bool] = False
    query_window: ClassVar[int | None] = None
    learned: ClassVar[bool] = False
    per_token: ClassVar[bool] = False
    scores_decoded_tokens: ClassVar[bool] = True
    comparable_across_heads: ClassVar[bool] = False
    age_decay: ClassVar[float] = 0.0

    def score(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        queries: QueryStates | None = None,
        layer_idx: int = 0,
    ) -> torch.Tensor:
        """Score every cached entry.

        keys, values: ``[batch, kv_heads, seq, head_dim]`` post-RoPE, as stored in the cache.
        positions: ``[batch, seq]`` index of each token among its row's real tokens, -1 on padding.
        queries: None for key/value-only methods.
        Returns ``[batch, kv_heads, seq]``; the cache keeps the top entries per head.
        """
        raise NotImplementedError

    def cross_head_scores(
        self, scores: torch.Tensor, valid: torch.Tensor, layer_idx: int = 0
    ) -> torch.Tensor:
        """Scores that rank entries across heads and layers: each entry's estimated share of the
        future attention mass of the model, so one top-k over all of them allocates a budget.

        scores: ``[batch, kv_heads, seq]`` as :meth:`score` returned them (or as stored for
        ``per_token`` methods); valid: ``[batch, kv_heads, seq]`` bool, False on padding and on
        empty slots. Returns ``[batch, kv_heads, seq]`` float32, ``-inf`` where not valid.
        """
        raise ValueError(
            f"method {self.name or type(self).__name__!r} has no scores comparable across heads, so it "
            "supports allocation='uniform' only"
        )

    def check_model(self, config) -> None:
        """Raise ``ValueError`` if this scorer cannot serve a model with ``config`` (a decoder config)."""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's half rotation: ``[x1, x2] -> [-x2, x1]`` on the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def group_queries(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[batch, q_heads, n, d]`` -> ``[batch, kv_heads, group, n, d]`` (GQA groups are contiguous)."""
    b, hq, n, d = queries.shape
    return queries.view(b, num_kv_heads, hq // num_kv_heads, n, d)


def grouped_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    key_valid: torch.Tensor,
    causal_offset: int | None,
) -> torch.Tensor:
    """Softmax attention of ``queries`` over ``keys`` per query head.

    queries: ``[batch, q_heads, n, d]``; keys: ``[batch, kv_heads, seq, d]``; key_valid: ``[batch, seq]``.
    causal_offset: index in ``keys`` of the first query (None: every query sees every key).
    Returns ``[batch, kv_heads, group, n, seq]`` in float32.
    """
    q = group_queries(queries.float(), keys.shape[1])
    logits = torch.einsum("bhgnd,bhsd->bhgns", q, keys.float()) * scaling
    visible = key_valid[:, None, None, None, :]
    if causal_offset is not None:
        n, s = q.shape[-2], keys.shape[-2]
        q_pos = torch.arange(n, device=keys.device)[:, None] + causal_offset
        visible = visible & (torch.arange(s, device=keys.device)[None, :] <= q_pos)
    return logits.masked_fill(~visible, float("-inf")).softmax(-1)
