"""KVPCache: a transformers ``Cache`` that evicts per KV head, on one of two schedules.

- ``compress="every_prefill"`` (default): every forward with more than one new token (the
  prefill, a chunk of a chunked prefill, a new turn) ends with each evicting layer holding its
  budget; single-token forwards (decoding) append.
- ``compress="first_prefill"``: only the first multi-token forward evicts; every later forward
  (questions asked about a compressed document, later turns, decoding) appends and is kept whole.

Either can be bounded with ``max_cache_tokens=N``: whenever a layer holds more than
``N + evict_every`` entries per head at the end of a forward, it is trimmed back to ``N``, ranked
by the same scorer over all its entries. A forward always attends to the states from before its
own eviction, so the logits of the forward that evicts are exact.

Semantics follow ``DynamicSlidingWindowLayer``: ``get_seq_length()`` is the logical number of
tokens seen and ``get_mask_sizes()`` offsets the mask by the evicted count. A direct forward takes
its RoPE positions from ``get_seq_length()`` and ``generate`` slices a resumed prompt by it, so a
physical count would shift positions and re-feed cached tokens after an eviction.

This module holds the layer and the container only, as transformers' ``cache_utils`` does; what
the cache needs from the model (padding, queries, the mask rewrite) comes through the hooks of
:mod:`kvp_cache.hooks`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from kvp_cache.allocation import head_counts, largest, top_entries, validate_mode
from kvp_cache.budget import (
    Budget,
    kept_per_row,
    protect_sinks_and_window,
    validate_budget,
    validate_count,
    validate_schedule,
)
from kvp_cache.capture import append_queries, drop_last_queries, map_query_batch
from kvp_cache.compat import attention_shape, check_decoder_config, evicting_layer_indices, text_config
from kvp_cache.hooks import ForwardContext, ModelHooks
from kvp_cache.prefill import Prefill
from kvp_cache.scorers import SCORERS, QueryStates, Scorer, make_scorer, methods


@dataclass(frozen=True)
class EvictionSettings:
    """The configuration every evicting layer of one cache shares; fixed when the cache is built.

    What changes from one forward to the next lives in the cache's
    :class:`~kvp_cache.hooks.ForwardContext`, filled by the model hooks.
    """

    scorer: Scorer
    budget: Budget
    sink_tokens: int
    window_tokens: int
    num_kv_heads: int
    head_dim: int
    compress: str = "every_prefill"
    max_cache_tokens: int | None = None
    evict_every: int = 64
    track_positions: bool = False
    built_from_model: bool = False
    allocation: str = "uniform"
    min_per_head: int | None = None


class EvictingLayer(DynamicLayer):
    """A full-attention layer that keeps the top entries of each KV head.

    Per row it keeps ``keys``/``values`` (``[batch, kv_heads, slots, head_dim]``), ``valid``
    (``[batch, slots]``, False where a slot holds padding) and ``seen_real`` (``[batch]``, real
    tokens seen). Optionally: ``scores`` (``[batch, kv_heads, slots]``, for scorers with
    ``per_token = True``: each token is scored once and the score is kept; NaN for decoded tokens
    not yet needed by an eviction),
    ``positions`` (``[batch, kv_heads, slots]`` logical positions, with ``track_positions=True``),
    ``entered`` (``[batch, kv_heads, slots]`` int32, for scorers with an ``age_decay``: the real
    tokens seen when the forward that read each entry ended, see :func:`age_decayed`)
    and ``recent_queries`` (the queries captured since the last eviction, for query-aware scorers).
    """

    BATCH_FIELDS = ("keys", "values", "valid", "seen_real", "scores", "positions", "entered")
    """The per-row tensors: every batch operation (beams, stacking) must apply to all of them."""

    is_sliding = False

    def __init__(self, settings: EvictionSettings, context: ForwardContext, layer_idx: int):
        super().__init__()
        self.settings = settings
        self.context = context
        self.layer_idx = layer_idx
        self._reset_state()

    def _reset_state(self) -> None:
        self.cumulative_length = 0
        self.valid: torch.Tensor | None = None
        self.seen_real: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.entered: torch.Tensor | None = None
        self.recent_queries: QueryStates | None = None
        self.appended_since_eviction = 0
        self.compressed = False  # the prefill eviction of compress="first_prefill" has happened

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        b, h = key_states.shape[:2]
        self.keys = key_states.new_empty((b, h, 0, key_states.shape[-1]))
        self.values = value_states.new_empty((b, h, 0, value_states.shape[-1]))
        self.valid = torch.ones(b, 0, dtype=torch.bool, device=self.device)
        self.seen_real = torch.zeros(b, dtype=torch.long, device=self.device)
        if self.settings.scorer.per_token:
            self.scores = torch.zeros(b, h, 0, device=self.device)
        if self.settings.track_positions:
            self.positions = torch.zeros((b, h, 0), dtype=torch.long, device=self.device)
        if self.settings.scorer.age_decay:
            self.entered = torch.zeros((b, h, 0), dtype=torch.int32, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new states (``[batch, kv_heads, q, head_dim]``) and return the whole layer.

        The forward attends to what this returns: the states from BEFORE eviction, so the
        forward that evicts (say, the prefill) is exact. Eviction, when the schedule calls for
        it, happens after the append, and only the next forward sees the kept entries.
        """
        s, context = self.settings, self.context
        if s.built_from_model and not context.in_forward:
            raise RuntimeError(
                "This KVPCache was built for another model instance: pass it only to the model given to "
                "KVPCache(model, ...), or build it from a config with KVPCache(config, ...)."
            )
        if key_states.shape[1] != s.num_kv_heads or key_states.shape[-1] != s.head_dim:
            raise ValueError(
                f"KVPCache was built for {s.num_kv_heads} KV heads of dim {s.head_dim}, but layer "
                f"{self.layer_idx} got states of shape {tuple(key_states.shape)}: it was built for another model."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        queries = context.queries.pop(self.layer_idx, None)
        return self._ingest(key_states, value_states, context.new_tokens_real, queries)

    def load_and_evict(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        attention_mask: torch.Tensor | None,
        queries: QueryStates | None,
    ) -> None:
        """Take over uncompressed prompt states (``[batch, kv_heads, seq, head_dim]``) as if they
        came from one prefill forward: append, then evict on the cache's schedule."""
        self.reset()
        self.lazy_initialization(keys, values)
        self._ingest(keys, values, attention_mask.bool() if attention_mask is not None else None, queries)

    def _ingest(self, key_states, value_states, new_real: torch.Tensor | None, queries):
        """Append one forward's states and metadata, then evict if the schedule says so.

        Returns the full states from before the eviction: ``[batch, kv_heads, slots + q, head_dim]``.
        """
        if queries is not None:
            window = self.settings.scorer.query_window
            self.recent_queries = append_queries(self.recent_queries, queries, window)
        keys, values = self._append(key_states, value_states, new_real)
        kept = self._kept_after(key_states.shape[-2], self.valid.sum(-1))
        if kept is not None:
            self._evict(kept)
        return keys, values

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, new_real: torch.Tensor | None):
        """Concatenate the new states and their metadata (scores for ``per_token`` scorers)."""
        b, h, q, _ = key_states.shape
        if new_real is None or new_real.shape != (b, q):
            new_real = torch.ones(b, q, dtype=torch.bool, device=self.device)
        new_real = new_real.to(self.device)
        if self.scores is not None:
            # Each token is scored once, at its index among its row's real tokens. A decoded token
            # (q == 1) waits as NaN until an eviction needs it (most never do), see _score_pending.
            positions = (self.seen_real[:, None] + new_real.long().cumsum(-1) - 1).masked_fill(~new_real, -1)
            new_scores = self._score_at_entry(key_states, value_states, positions) if q > 1 else None
            if new_scores is None:
                new_scores = torch.full((b, h, q), float("nan"), device=self.device)
            self.scores = torch.cat([self.scores, new_scores], dim=-1)
        if self.keys.shape[-2] == 0:
            # Nothing to append to: hold the states themselves (a copy of a whole prompt costs
            # more than scoring it). The cache never writes into them, it only concatenates and gathers.
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        self.valid = torch.cat([self.valid, new_real], dim=-1)
        self.seen_real = self.seen_real + new_real.sum(-1)
        if self.entered is not None:
            entered = self.seen_real.to(torch.int32)[:, None, None].expand(b, h, q)
            self.entered = torch.cat([self.entered, entered], dim=-1)
        if self.positions is not None:
            new_positions = torch.arange(
                self.cumulative_length, self.cumulative_length + q, device=self.device
            )
            self.positions = torch.cat([self.positions, new_positions.expand(b, h, q)], dim=-1)
        self.cumulative_length += q
        self.appended_since_eviction += q
        return self.keys, self.values

    @torch.no_grad()
    def _score_at_entry(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        return self.settings.scorer.score(keys, values, positions, None, self.layer_idx).float()

    def _score_pending(self) -> None:
        """Score the decoded tokens still waiting (NaN), each as it was when it entered alone.

        They all entered after the last eviction, so a waiting entry's index among its row's real
        tokens is ``seen_real`` minus the real entries from it to the end.
        """
        pending = self.scores[0, 0].isnan().nonzero().squeeze(-1)  # the same slots in every row and head
        if pending.numel() == 0:
            return
        real_from_here = self.valid.flip(-1).long().cumsum(-1).flip(-1)
        positions = (self.seen_real[:, None] - real_from_here).masked_fill(~self.valid, -1)[:, pending]
        self.scores[:, :, pending] = self._score_one_token_rows(
            self.keys[:, :, pending], self.values[:, :, pending], positions
        )

    def _score_one_token_rows(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        """Scores ``[batch, kv_heads, m]`` of ``m`` decoded tokens (``keys``/``values``
        ``[batch, kv_heads, m, head_dim]``, ``positions`` ``[batch, m]``): as a batch of one-token
        rows, each gets the score a one-token forward would have given it when it entered."""
        b, h, m, d = keys.shape

        def one_token_rows(states: torch.Tensor) -> torch.Tensor:  # [b, h, m, d] -> [b * m, h, 1, d]
            return states.permute(0, 2, 1, 3).reshape(b * m, h, 1, d)

        scores = self._score_at_entry(one_token_rows(keys), one_token_rows(values), positions.reshape(-1, 1))
        return scores.reshape(b, m, h).transpose(1, 2)

    def prefill_evicts(self, q: int) -> bool:
        """Whether a forward of ``q`` new tokens ends with the budget eviction of the schedule."""
        return q > 1 and (self.settings.compress == "every_prefill" or not self.compressed)

    def _kept_after(self, q: int, real_in_cache: torch.Tensor) -> torch.Tensor | None:
        """Entries each head of a row keeps after a forward of ``q`` tokens (``[batch]``), None if no
        eviction is due; ``real_in_cache`` ``[batch]``: the real entries a head holds now."""
        s = self.settings
        kept = None
        if self.prefill_evicts(q):
            self.compressed = True
            if isinstance(s.budget, float):
                kept = torch.minimum(kept_per_row(s.budget, self.seen_real), real_in_cache)
            else:
                kept = kept_per_row(s.budget, real_in_cache)
        if s.max_cache_tokens is not None:
            # Per row, so each row of a padded batch is trimmed exactly when it would be alone.
            held = kept if kept is not None else real_in_cache
            over = held > s.max_cache_tokens + s.evict_every
            if bool(over.any()):
                kept = torch.where(over, held.clamp(max=s.max_cache_tokens), held)
        return kept

    def _evict(self, kept: torch.Tensor) -> None:
        """Keep the top ``kept[row]`` entries of every head of each row, in their original order."""
        s = self.settings
        valid = self.valid
        slots = int(kept.max())
        queries, self.recent_queries = self.recent_queries, drop_last_queries(self.recent_queries, None)
        self.appended_since_eviction = 0
        if slots == valid.shape[-1] and bool(valid.all()):
            return  # every row keeps everything: nothing to evict
        if not s.built_from_model and bool((kept < slots).any()) and not self._padding_aligned(kept, slots):
            raise ValueError(
                "A padded batch with a fractional budget keeps different counts per row, which needs the "
                "attention mask rewritten at every step: build the cache with KVPCache(model, ...)."
            )
        positions = (valid.long().cumsum(-1) - 1).masked_fill(~valid, -1)
        with torch.no_grad():  # selection is not differentiable; don't build a graph for it
            if self.scores is not None:
                self._score_pending()
                scores = self.scores
            else:
                scores = s.scorer.score(self.keys, self.values, positions, queries, self.layer_idx).float()
            if self.entered is not None:
                scores = age_decayed(scores, self.entered, self.seen_real, s.scorer.age_decay)
            scores = protect_sinks_and_window(
                scores, positions, valid.sum(-1), kept, s.sink_tokens, s.window_tokens
            )
            index = select_slots(scores, valid, kept, slots)
        self.keys, self.values = take_slots(self.keys, index), take_slots(self.values, index)
        self.valid = torch.arange(slots, device=self.device)[None, :] >= (slots - kept)[:, None]
        for name in ("scores", "positions", "entered"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).gather(2, index))

    def kept_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, valid)``: the logical position of every kept entry, ``[batch, kv_heads,
        slots]`` (needs ``track_positions=True``), and which slots hold a real one, ``[batch, slots]``."""
        return self.positions, self.valid

    def _padding_aligned(self, kept: torch.Tensor, slots: int) -> bool:
        """True if the invalid slots fall exactly on the zero columns of the caller's left-padded mask."""
        return bool(
            (kept == torch.minimum(self.valid.sum(-1), torch.tensor(slots, device=self.device))).all()
        )

    def get_seq_length(self, *args) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        # <= 5.3 passes a cache_position tensor, >= 5.4 an int.
        q = query_length.shape[0] if torch.is_tensor(query_length) else int(query_length)
        physical = self.physical_length()
        return physical + q, self.cumulative_length - physical

    def physical_length(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self._reset_state()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens from the end; only tokens appended since the last eviction can be removed."""
        n = self.cumulative_length - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n > self.appended_since_eviction:
            raise ValueError(
                f"crop: cannot remove {n} tokens, only the {self.appended_since_eviction} appended since the "
                "last eviction are still stored in order; evicted tokens cannot be restored."
            )
        self._drop_last_slots(n)
        self.recent_queries = drop_last_queries(self.recent_queries, n)
        self.cumulative_length -= n
        self.appended_since_eviction -= n

    def _drop_last_slots(self, n: int) -> None:
        """Remove the last ``n`` slots of every head (the newest tokens) and their metadata."""
        self.seen_real = self.seen_real - self.valid[:, -n:].sum(-1)
        self.keys, self.values = self.keys[..., :-n, :], self.values[..., :-n, :]
        self.valid = self.valid[:, :-n]
        for name in ("scores", "positions", "entered"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[..., :-n])

    def _map_batch(self, fn) -> None:
        for name in self.BATCH_FIELDS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))
        if self.recent_queries is not None:
            self.recent_queries = map_query_batch(self.recent_queries, fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t[indices.to(t.device) if torch.is_tensor(indices) else indices])


def age_decayed(
    scores: torch.Tensor, entered: torch.Tensor, seen_real: torch.Tensor, decay: float
) -> torch.Tensor:
    """``scores - decay * log2(1 + age)``, the ranking of a scorer with an ``age_decay``.

    scores, entered: ``[batch, kv_heads, slots]``, ``entered`` the real tokens seen when the forward
    that read each entry ended; seen_real: ``[batch]`` real tokens seen now. An entry's age is the
    tokens read since its forward, so every entry of a single prefill has age 0 and ranks as without
    decay; under ``max_cache_tokens`` an entry read long ago ranks lower than its stored score says.
    """
    age = (seen_real[:, None, None] - entered).clamp_min(0).float()
    return scores - decay * torch.log2(1 + age)


def layer_bytes(layer) -> int:
    """Bytes of one cache layer's per-row tensors (any transformers layer): keys, values and, for an
    evicting layer, its per-slot metadata (validity, stored scores, tracked positions, entry times)."""
    tensors = (getattr(layer, name, None) for name in EvictingLayer.BATCH_FIELDS)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def cache_bytes(cache: Cache) -> int:
    """Bytes of every layer of ``cache`` (:func:`layer_bytes`)."""
    return sum(layer_bytes(layer) for layer in cache.layers)


def _check_allocation(allocation, min_per_head, budget: Budget, scorer: Scorer, model) -> None:
    """Errors naming the parameter for a bad ``allocation`` / ``min_per_head`` of ``KVPCache``."""
    validate_mode(allocation, "allocation")
    if min_per_head is not None:
        validate_count("min_per_head", min_per_head, 1)
        if isinstance(budget, int) and min_per_head > budget:
            raise ValueError(
                f"min_per_head ({min_per_head}) exceeds the per-head budget ({budget}): lower it"
            )
    if allocation == "uniform":
        return
    if not scorer.comparable_across_heads:
        comparable = sorted(name for name, cls in SCORERS.items() if cls.comparable_across_heads)
        raise ValueError(
            f"allocation={allocation!r} ranks entries across heads, which method {scorer.name!r} cannot: "
            f"its scores are not comparable across heads. Use allocation='uniform' or one of {comparable}"
        )
    if model is None:
        raise ValueError(
            f"allocation={allocation!r} attends through its own attention function: build the cache with "
            "KVPCache(model, ...), not a config"
        )
    softcap = getattr(text_config(model.config), "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"allocation={allocation!r} attends through SDPA, which cannot soft-cap attention logits as this "
            f"{model.config.model_type} model does (attn_logit_softcapping={softcap}): use allocation='uniform'"
        )


def _build_scorer(method: str | Scorer | None, options: dict) -> Scorer:
    if method is None:  # a policy says which method it is for
        method = "kvp" if "policy" in options else "knorm"
    if "policy" in options and isinstance(method, str) and method not in methods(learned=True):
        raise TypeError(
            f"policy= belongs to the learned method(s) {methods(learned=True)}, not to method {method!r}: "
            "drop method= (a policy implies method='kvp') or drop policy="
        )
    if isinstance(method, Scorer):
        if options:
            raise TypeError(
                f"method is a ready {type(method).__name__}: set its options on it, not as {sorted(options)}"
            )
        return method
    if not isinstance(method, str):
        raise TypeError(f"method must be a method name or a Scorer instance, got {type(method).__name__}")
    return make_scorer(method, **options)


def take_slots(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``states`` ``[..., slots, head_dim]`` at ``index`` ``[..., k]`` along the slot axis: ``[..., k,
    head_dim]``. One ``index_select`` of whole rows: ``gather`` runs 5x slower on CPU."""
    *lead, n, d = states.shape
    rows = torch.arange(math.prod(lead), device=index.device).view(*lead, 1) * n
    return states.reshape(-1, d).index_select(0, (index + rows).reshape(-1)).view(*lead, -1, d)


def select_slots(scores: torch.Tensor, valid: torch.Tensor, kept: torch.Tensor, slots: int) -> torch.Tensor:
    """Indices of the entries to keep, ``[batch, kv_heads, slots]``.

    Each row keeps its top ``kept[row]`` valid entries per head, in original order, after
    ``slots - kept[row]`` filler entries (padding when there is any), so every head of a row has
    its invalid slots first and one ``[batch, slots]`` validity mask describes them all.
    """
    b, h, n = scores.shape
    arange = torch.arange(n, device=scores.device).expand(b, h, n)
    # A NaN score ranks last, as in the adaptive allocations (kvp_cache.allocation.top_entries).
    scores = scores.nan_to_num(nan=float("-inf")).masked_fill(~valid[:, None, :], float("-inf"))
    chosen = largest(scores.reshape(b * h, n), kept.repeat_interleave(h)).view(b, h, n)
    if bool((kept == slots).all()):
        # Every head chose exactly `slots` entries and needs no fillers: they are the answer, in order.
        return arange.masked_select(chosen).view(b, h, slots)
    # Fillers: padding first, then the earliest leftovers; they are masked out anyway.
    preference = torch.where(chosen, 3 * n, torch.where(valid[:, None, :], n + arange, arange))
    filler_rank = torch.empty_like(arange).scatter_(-1, preference.argsort(dim=-1), arange)
    filler = ~chosen & (filler_rank < (slots - kept)[:, None, None])
    key = torch.where(filler, -1, torch.where(chosen, arange, n))
    return key.argsort(dim=-1, stable=True)[..., :slots]


class KVPCache(Cache):
    """Drop-in ``transformers`` cache that keeps only the top-``budget`` entries per KV head.

    Args:
        model_or_config: the model the cache will be used with (enables query-aware methods and
            pad-aware eviction inside ``generate``), or its config (key/value-only methods).
        method: a name from :func:`kvp_cache.scorers.methods`, or a ready :class:`~kvp_cache.scorers.Scorer`
            instance (for scorers that are not registered, such as an evaluation oracle). Default:
            ``"kvp"`` when a ``policy=`` is given, else ``"knorm"``.
        budget: float in (0, 1], the fraction of each row's tokens kept per head, or int >= 1,
            the number of tokens kept per head.
        sink_tokens, window_tokens: the first and last tokens always kept.
        compress: ``"every_prefill"`` (every multi-token forward ends with eviction) or
            ``"first_prefill"`` (only the first one does; later forwards append and are kept).
        max_cache_tokens: None (decoding appends without limit) or an int >= sink_tokens +
            window_tokens: a head holding more than ``max_cache_tokens + evict_every`` entries at
            the end of a forward is trimmed back to ``max_cache_tokens``.
        evict_every: int >= 1, the slack above ``max_cache_tokens`` (one eviction per
            ``evict_every`` decoded tokens, not one per token).
        track_positions: also store each kept entry's logical position (for inspection and tests).
        allocation: how the budget is split among KV heads: ``"uniform"`` (every head keeps the same
            count), ``"head"`` (one ranking over every layer's heads decides each head's count) or
            ``"layer"`` (that ranking decides each layer's count, split evenly over its heads). The
            total is the same in every mode; ``"layer"``/``"head"`` need a model and a method with
            scores comparable across heads, and store each head on its own (:mod:`kvp_cache.ragged`).
        min_per_head: with ``"layer"``/``"head"``, the entries every head keeps at least (protected
            ones included), from 1 up to the per-head budget; None: the sinks and window plus
            :data:`kvp_cache.allocation.MIN_EXTRA_PER_HEAD`, capped at the per-head budget.
        **method_options: the options of the method's dataclass (see its docstring); for
            ``method="kvp"``, ``policy=`` (shipped name, directory, Hub id or ``KVPolicy``).
    """

    def __init__(
        self,
        model_or_config: PreTrainedModel | PretrainedConfig,
        method: str | Scorer | None = None,
        budget: Budget = 0.25,
        sink_tokens: int = 4,
        window_tokens: int = 16,
        compress: str = "every_prefill",
        max_cache_tokens: int | None = None,
        evict_every: int = 64,
        track_positions: bool = False,
        allocation: str = "uniform",
        min_per_head: int | None = None,
        **method_options,
    ):
        model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
        if model is None and not isinstance(model_or_config, PretrainedConfig):
            raise TypeError(
                f"KVPCache needs a transformers model or its config, got {type(model_or_config).__name__}"
            )
        config = text_config(model.config if model is not None else model_or_config)
        check_decoder_config(config, model)
        sink_tokens = validate_count("sink_tokens", sink_tokens, 0)
        window_tokens = validate_count("window_tokens", window_tokens, 0)
        scorer = _build_scorer(method, method_options)
        validate_schedule(
            compress,
            max_cache_tokens,
            evict_every,
            sink_tokens,
            window_tokens,
            scorer.name,
            scorer.scores_decoded_tokens,
        )
        scorer.check_model(config)
        if scorer.needs_queries and model is None:
            raise ValueError(
                f"method '{scorer.name}' needs the prefill queries: build the cache with KVPCache(model, ...), not a config"
            )
        budget = validate_budget(budget)
        _check_allocation(allocation, min_per_head, budget, scorer, model)
        shape = attention_shape(config)
        self.settings = EvictionSettings(
            scorer=scorer,
            budget=budget,
            sink_tokens=sink_tokens,
            window_tokens=window_tokens,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            compress=compress,
            max_cache_tokens=max_cache_tokens,
            evict_every=evict_every,
            track_positions=track_positions,
            built_from_model=model is not None,
            allocation=allocation,
            min_per_head=min_per_head,
        )
        self.context = ForwardContext()
        evicting = set(evicting_layer_indices(config))
        layer_type = EvictingLayer
        if allocation != "uniform":
            from kvp_cache.ragged import RaggedLayer  # ragged builds on this module

            layer_type = RaggedLayer
        layers = [
            layer_type(self.settings, self.context, i) if i in evicting else layer
            for i, layer in enumerate(DynamicCache(config=config).layers)
        ]
        super().__init__(layers=layers)
        self.method = scorer.name or type(scorer).__name__
        self._hooks = ModelHooks(self, model) if model is not None else None

    @classmethod
    def from_pretrained(
        cls,
        policy,
        model: PreTrainedModel,
        budget: Budget = 0.25,
        sink_tokens: int = 4,
        window_tokens: int = 16,
        check_base_model: bool = True,
        **options,
    ) -> KVPCache:
        """A cache driven by a learned KVP policy: ``KVPCache(model, method="kvp", policy=policy, ...)``.

        ``policy`` is a :class:`~kvp_cache.policy.KVPolicy`, the name of a policy shipped in the
        package (see ``kvp_cache.policy.shipped_policies()``), a local directory, or a Hub repo id.
        The policy must match ``model``'s layers, KV heads and head_dim; ``check_base_model=False``
        also accepts a policy trained on another checkpoint of the same architecture. ``options``
        are the other arguments of ``KVPCache`` (``compress``, ``max_cache_tokens``, ...).
        """
        return cls(
            model,
            method="kvp",
            budget=budget,
            sink_tokens=sink_tokens,
            window_tokens=window_tokens,
            policy=policy,
            check_base_model=check_base_model,
            **options,
        )

    @classmethod
    def from_prefill(
        cls,
        prefilled: Prefill,
        model: PreTrainedModel,
        method: str | Scorer = "knorm",
        policy=None,
        **options,
    ) -> KVPCache:
        """An already-compressed cache built from a :func:`kvp_cache.prefill.prefill` result.

        The prefill is left untouched, so one prefill serves any number of (method, budget)
        pairs; ``options`` are those of ``KVPCache`` (budget, sink_tokens, compress, ..., method
        options). The prompt counts as the cache's first prefill. With ``policy`` the method is
        the learned one, as in :meth:`from_pretrained`.
        """
        if policy is not None:
            cache = cls.from_pretrained(policy, model=model, **options)
        else:
            cache = cls(model, method=method, **options)
        for i, source in enumerate(prefilled.cache.layers):
            target = cache.layers[i]
            if isinstance(target, EvictingLayer):
                target.load_and_evict(
                    source.keys, source.values, prefilled.attention_mask, prefilled.queries.get(i)
                )
            else:
                cache.layers[i] = copy.deepcopy(source)
        cache.end_forward()
        return cache

    @classmethod
    def from_saved(cls, directory: str | Path, model: PreTrainedModel, policy=None) -> KVPCache:
        """The cache :meth:`save_pretrained` wrote to ``directory``, ready to continue with ``model``.

        It continues exactly as the saved cache would have (see :mod:`kvp_cache.saved_cache`);
        a cache saved for another model or cache layout, or a changed tensor file, is refused.
        ``policy`` (method ``kvp``): where to find the recorded policy if its name or directory
        is not available here; its weights must have the recorded sha256.
        """
        from kvp_cache.saved_cache import load_cache  # saved_cache builds KVPCaches

        return load_cache(directory, model, policy=policy)

    def save_pretrained(self, save_directory: str | Path) -> Path:
        """Write the cache to ``save_directory`` (safetensors and a JSON record) for :meth:`from_saved`."""
        from kvp_cache.saved_cache import save_cache

        return save_cache(self, self._hooks.model() if self._hooks is not None else None, save_directory)

    @property
    def evicting_layers(self) -> list[EvictingLayer]:
        return [layer for layer in self.layers if isinstance(layer, EvictingLayer)]

    def set_attention_mask(self, attention_mask: torch.Tensor | None) -> None:
        """Tell the cache which of the next forward's tokens are padding (``[batch, seq]``, 1 = real).

        ``KVPCache(model, ...)`` does this by itself on every forward; call it only for a cache
        built from a config, before each forward of a padded batch.
        """
        if attention_mask is None or attention_mask.dim() != 2:
            self.context.new_tokens_real = None
            return
        self.context.new_tokens_real = attention_mask.bool()

    def captures_queries(self, q: int) -> bool:
        """Whether the hooks capture the queries of the next forward (``q`` new tokens): when it
        will end with the schedule's eviction, and on every forward under ``max_cache_tokens``,
        so a decoding eviction sees the queries since the last one."""
        layers = self.evicting_layers
        return bool(layers) and (self.settings.max_cache_tokens is not None or layers[0].prefill_evicts(q))

    def end_forward(self) -> None:
        """Evict every layer at once if the forward that just ended calls for it (allocation
        ``"layer"``/``"head"``; the hooks call this; a uniform cache evicts inside ``update``)."""
        from kvp_cache.ragged import RaggedLayer

        layers = [layer for layer in self.evicting_layers if isinstance(layer, RaggedLayer)]
        layers = [layer for layer in layers if layer.is_initialized and layer.pending_forward]
        if not layers:
            return
        heads = sum(len(layer.lengths) for layer in layers)
        real_per_head = sum(layer.real_entries().sum(-1) for layer in layers) // heads
        due = [layer._kept_after(layer.pending_forward, real_per_head) for layer in layers]
        for layer in layers:
            layer.pending_forward = 0
        kept = due[0]  # every layer saw the same tokens, so the schedule's answer is the same
        if kept is None:
            return
        scores, valid, protected = zip(*(layer.scores_for_allocation(kept) for layer in layers), strict=True)
        settings = self.settings
        counts = head_counts(scores, valid, protected, kept, settings.allocation, settings.min_per_head)
        for layer, *args in zip(layers, scores, valid, protected, counts, strict=True):
            layer.keep(top_entries(*args))

    def kv_bytes(self) -> int:
        """Bytes held by the cache: keys, values and per-slot metadata of every layer."""
        return cache_bytes(self)

    def reset(self) -> None:
        super().reset()
        self.context.clear()

    def __deepcopy__(self, memo):
        """An independent copy (own tensors and model hooks) that shares the scorer."""
        memo[id(self.settings.scorer)] = self.settings.scorer
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name != "_hooks":
                setattr(new, name, copy.deepcopy(value, memo))
        model = self._hooks.model() if self._hooks is not None else None
        new._hooks = ModelHooks(new, model) if model is not None else None
        return new

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"KVPCache(method={self.method!r}, budget={s.budget}, sink_tokens={s.sink_tokens}, "
            f"window_tokens={s.window_tokens}, compress={s.compress!r}, max_cache_tokens={s.max_cache_tokens}, "
            f"evict_every={s.evict_every}, allocation={s.allocation!r}, evicting_layers={len(self.evicting_layers)}/{len(self.layers)})"
        )
