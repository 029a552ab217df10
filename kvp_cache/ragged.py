"""Adaptive budgets with real memory savings: KV heads that keep different numbers of entries.

With ``KVPCache(model, ..., allocation="layer" | "head")`` one ranking over every (layer, head,
entry) decides how many entries each KV head keeps (:mod:`kvp_cache.allocation`). A
``[batch, kv_heads, slots, head_dim]`` tensor would pad every head to the longest one, so a
:class:`RaggedLayer` stores each head on its own: ``keys[h]``/``values[h]`` ``[batch, slots_h,
head_dim]`` and ``valid[h]`` ``[batch, slots_h]`` (False on padding of a padded batch). The bytes held
are the allocated entries plus one validity byte (and, for ``per_token`` scorers, one float32 score)
per entry.

Attention reads the heads where they are: while a forward of the hooked model runs, the model's
attention implementation is :data:`RAGGED_ATTENTION`, whose function runs SDPA once per KV head
of a ragged layer (the head's query group against its own keys) and plain SDPA on every other
layer. The hooks (:mod:`kvp_cache.hooks`) switch it on and off around each forward and, at the end
of the forward, let the cache evict all its layers at once (:meth:`KVPCache.end_forward`): the
allocation compares entries across layers, so no layer can evict before the last one attended.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvp_cache.budget import protected_entries
from kvp_cache.cache import EvictingLayer, select_slots
from kvp_cache.capture import append_queries, drop_last_queries, map_query_batch

if TYPE_CHECKING:
    from kvp_cache.cache import KVPCache

RAGGED_ATTENTION = "kvp_ragged"
ACTIVE_CACHE: ContextVar[KVPCache | None] = ContextVar("kvp_active_ragged_cache", default=None)
"""The ragged cache of the forward in progress (set by the model hooks)."""


class RaggedLayer(EvictingLayer):
    """An evicting layer whose KV heads keep different numbers of entries (see the module docstring).

    The per-row fields of :class:`~kvp_cache.cache.EvictingLayer` become one tensor per head:
    ``keys``/``values`` lists of ``[batch, slots_h, head_dim]``, ``valid``, ``scores`` and
    ``positions`` lists of ``[batch, slots_h]``; ``seen_real`` stays ``[batch]``. New tokens enter
    every head at its end, so the entries appended since the last eviction are the same last
    ``appended_since_eviction`` slots of every head. The layer never evicts by itself: the cache
    calls :meth:`scores_for_allocation` and :meth:`keep` on all its layers together.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        super().lazy_initialization(key_states, value_states)
        heads = range(key_states.shape[1])
        self.keys = [self.keys[:, i] for i in heads]
        self.values = [self.values[:, i] for i in heads]
        self.valid = [self.valid for _ in heads]
        if self.scores is not None:
            self.scores = [self.scores[:, i] for i in heads]
        if self.positions is not None:
            self.positions = [self.positions[:, i] for i in heads]
        self.pending_forward = 0  # tokens of the forward whose eviction, if due, is still to come

    def _ingest(self, key_states, value_states, new_real, queries):
        """Append the forward's states (``[batch, kv_heads, q, head_dim]``); the eviction, if due,
        waits for :meth:`KVPCache.end_forward`. Returns the new states only: the ragged attention
        reads the heads from the layer."""
        if queries is not None:
            window = self.settings.scorer.query_window
            self.recent_queries = append_queries(self.recent_queries, queries, window)
        b, h, q, _ = key_states.shape
        if new_real is None or new_real.shape != (b, q):
            new_real = torch.ones(b, q, dtype=torch.bool, device=self.device)
        new_real = new_real.to(self.device)
        new_scores = None
        if self.scores is not None:
            positions = (self.seen_real[:, None] + new_real.long().cumsum(-1) - 1).masked_fill(~new_real, -1)
            new_scores = self._score_at_entry(key_states, value_states, positions) if q > 1 else None
            if new_scores is None:
                new_scores = torch.full((b, h, q), float("nan"), device=self.device)
        new_positions = torch.arange(self.cumulative_length, self.cumulative_length + q, device=self.device)
        for i in range(h):
            self.keys[i] = torch.cat([self.keys[i], key_states[:, i]], dim=-2)
            self.values[i] = torch.cat([self.values[i], value_states[:, i]], dim=-2)
            self.valid[i] = torch.cat([self.valid[i], new_real], dim=-1)
            if new_scores is not None:
                self.scores[i] = torch.cat([self.scores[i], new_scores[:, i]], dim=-1)
            if self.positions is not None:
                self.positions[i] = torch.cat([self.positions[i], new_positions.expand(b, q)], dim=-1)
        self.seen_real = self.seen_real + new_real.sum(-1)
        self.cumulative_length += q
        self.appended_since_eviction += q
        self.pending_forward = q
        return key_states, value_states

    def real_entries(self) -> torch.Tensor:
        """``[batch, kv_heads]`` real entries each head holds."""
        return torch.stack([v.sum(-1) for v in self.valid], dim=-1)

    def padded(self, tensors: list[torch.Tensor], fill) -> torch.Tensor:
        """The per-head ``[batch, slots_h, ...]`` tensors right-padded with ``fill`` and stacked:
        ``[batch, kv_heads, max slots_h, ...]``. Only for eviction and inspection, never per step."""
        slots = max(t.shape[1] for t in tensors)
        return torch.stack(
            [F.pad(t, (0, 0) * (t.dim() - 2) + (0, slots - t.shape[1]), value=fill) for t in tensors], dim=1
        )

    def scores_for_allocation(self, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scores, valid, protected)``, each ``[batch, kv_heads, max slots_h]``, for keeping
        ``kept`` (``[batch]``) entries per head on average: the scorer's cross-head scores, which
        slots hold a real entry, and which are the head's protected sinks and window."""
        s = self.settings
        valid = self.padded(self.valid, False)
        positions = (valid.long().cumsum(-1) - 1).masked_fill(~valid, -1)
        with torch.no_grad():
            raw = self._raw_scores(valid, positions)
            scores = s.scorer.cross_head_scores(raw.float(), valid, self.layer_idx).float()
        protected = protected_entries(positions, valid.sum(-1), kept, s.sink_tokens, s.window_tokens)
        return scores.masked_fill(~valid, float("-inf")), valid, protected & valid

    def _raw_scores(self, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, max slots_h]`` scores from the scorer (stored ones for ``per_token``)."""
        s = self.settings
        queries, self.recent_queries = self.recent_queries, drop_last_queries(self.recent_queries, None)
        if self.scores is not None:
            self._score_pending()
            return self.padded(self.scores, float("-inf"))
        if (
            self.cumulative_length == self.appended_since_eviction
        ):  # no eviction yet: heads hold the same entries
            keys, values = torch.stack(self.keys, 1), torch.stack(self.values, 1)
            return s.scorer.score(keys, values, positions[:, 0], queries, self.layer_idx)
        # Heads hold different entries: score each head on its own entries, repeated over the
        # heads so the scorer sees its usual shape, and keep that head's row of the result.
        heads = []
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            n = k.shape[1]
            repeated = [t[:, None].expand(-1, len(self.keys), -1, -1) for t in (k, v)]
            row = s.scorer.score(*repeated, positions[:, i, :n], queries, self.layer_idx)[:, i]
            heads.append(row)
        return self.padded(heads, float("-inf"))

    def _score_pending(self) -> None:
        """Score the decoded tokens still waiting (NaN): the same last slots of every head."""
        waiting = int(self.scores[0][0].isnan().sum())
        if waiting == 0:
            return
        tail = slice(-waiting, None)
        valid = self.valid[0]
        real_from_here = valid.flip(-1).long().cumsum(-1).flip(-1)
        positions = (self.seen_real[:, None] - real_from_here).masked_fill(~valid, -1)[:, tail]
        keys = torch.stack([k[:, tail] for k in self.keys], 1)
        values = torch.stack([v[:, tail] for v in self.values], 1)
        scores = self._score_one_token_rows(keys, values, positions)
        for i in range(len(self.scores)):
            self.scores[i][:, tail] = scores[:, i]

    def keep(self, counts: torch.Tensor, ranks: torch.Tensor) -> None:
        """Keep the ``counts[row, h]`` entries of rank ``< counts`` in each head, in their order.

        counts: ``[batch, kv_heads]``; ranks: ``[batch, kv_heads, max slots_h]`` from
        :func:`kvp_cache.allocation.entry_ranks` (valid entries before invalid ones)."""
        self.appended_since_eviction = 0
        self.pending_forward = 0
        for i in range(len(self.keys)):
            n = self.keys[i].shape[1]
            kept = counts[:, i]
            slots = int(kept.max())
            if slots == n and bool(self.valid[i].all()):
                continue
            index = select_slots(-ranks[:, i : i + 1, :n].float(), self.valid[i], kept, slots)[:, 0]
            gather = index[..., None].expand(-1, -1, self.keys[i].shape[-1])
            self.keys[i] = self.keys[i].gather(1, gather)
            self.values[i] = self.values[i].gather(1, gather)
            self.valid[i] = torch.arange(slots, device=self.device)[None, :] >= (slots - kept)[:, None]
            for name in ("scores", "positions"):
                tensors = getattr(self, name)
                if tensors is not None:
                    tensors[i] = tensors[i].gather(1, index)

    def kept_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, valid)``, each ``[batch, kv_heads, max slots_h]``: the logical position of
        every kept entry (needs ``track_positions=True``) and whether the slot holds a real one."""
        return self.padded(self.positions, 0), self.padded(self.valid, False)

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        # The model's mask only covers the forward's own tokens; the ragged attention adds each head's past.
        q = query_length.shape[0] if torch.is_tensor(query_length) else int(query_length)
        return q, self.cumulative_length

    def physical_length(self) -> int:
        return max(k.shape[1] for k in self.keys) if self.is_initialized else 0

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
        self.seen_real = self.seen_real - self.valid[0][:, -n:].sum(-1)
        for name in ("keys", "values", "valid", "scores", "positions"):
            tensors = getattr(self, name)
            if tensors is not None:
                setattr(self, name, [t[:, :-n] for t in tensors])
        self.recent_queries = drop_last_queries(self.recent_queries, n)
        self.cumulative_length -= n
        self.appended_since_eviction -= n

    def _map_batch(self, fn) -> None:
        for name in self.BATCH_FIELDS:
            value = getattr(self, name)
            if isinstance(value, list):
                setattr(self, name, [fn(t) for t in value])
            elif value is not None:
                setattr(self, name, fn(value))
        if self.recent_queries is not None:
            self.recent_queries = map_query_batch(self.recent_queries, fn)


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA per KV head over a :class:`RaggedLayer`'s own entries; plain SDPA on other layers.

    query: ``[batch, q_heads, q, head_dim]``; attention_mask: the model's SDPA mask over the
    forward's own ``q`` tokens (``[batch, 1, q, q]`` bool, or None when causal). Each KV head's
    query group sees the head's valid past entries and, among the new tokens, what the mask allows.
    Returns ``[batch, q, q_heads, head_dim]`` as transformers' attention functions do.
    """
    cache = ACTIVE_CACHE.get()
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if not isinstance(layer, RaggedLayer):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("allocation='layer'/'head' does not support attention logit soft-capping")
    b, q_heads, q, _ = query.shape
    heads = len(layer.keys)
    group = q_heads // heads
    new = _new_token_mask(attention_mask, b, q, query.device)
    outputs = []
    for i in range(heads):
        keys, values, valid = layer.keys[i], layer.values[i], layer.valid[i]
        past = keys.shape[1] - q
        mask = None
        if new is not None or not bool(valid[:, :past].all()):
            past_mask = valid[:, None, None, :past].expand(b, 1, q, past)
            new_mask = new if new is not None else _causal(q, query.device).expand(b, 1, q, q)
            mask = torch.cat([past_mask.to(query.device), new_mask], dim=-1)
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, i * group : (i + 1) * group],
                keys[:, None],
                values[:, None],
                attn_mask=mask,
                scale=scaling,
                is_causal=False,
                enable_gqa=True,
            )
        )
    return torch.cat(outputs, dim=1).transpose(1, 2).contiguous(), None


def _new_token_mask(attention_mask: torch.Tensor | None, batch: int, q: int, device) -> torch.Tensor | None:
    """``[batch, 1, q, q]`` bool mask among the forward's tokens (None: causal, or a single token).

    A token always sees itself, so no row is empty (a padding token's output is unused anyway, and an
    empty row would be NaN in SDPA and reach the cache as NaN keys)."""
    if attention_mask is None:
        return None if q == 1 else _causal(q, device).expand(batch, 1, q, q)
    mask = attention_mask[..., -q:]
    if mask.dtype != torch.bool:  # an additive float mask
        mask = mask == 0
    return mask.expand(batch, 1, q, q) | torch.eye(q, dtype=torch.bool, device=mask.device)


def _causal(q: int, device) -> torch.Tensor:
    return torch.ones(q, q, dtype=torch.bool, device=device).tril()


AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)
