"""Adaptive budgets with real memory savings: KV heads that keep different numbers of entries.

With ``KVPCache(model, ..., allocation="layer" | "head")`` one ranking over every (layer, head,
entry) decides how many entries each KV head keeps (:mod:`kvp_cache.allocation`). A
``[batch, kv_heads, slots, head_dim]`` tensor would pad every head to the longest one, so a
:class:`RaggedLayer` packs the heads one after another along the slot axis: ``keys``/``values``
``[batch, slots, head_dim]`` with ``lengths[h]`` slots per head, and ``valid`` ``[batch, slots]``
(False on padding of a padded batch). The bytes held are the allocated entries plus one validity
byte (and, for ``per_token`` scorers, one float32 score) per entry.

Attention reads the heads where they are: while a forward of the hooked model runs, the model's
attention implementation is :data:`RAGGED_ATTENTION`, whose function runs SDPA once per KV head
of a ragged layer (the head's query group against its own keys) and plain SDPA on every other
layer. The hooks (:mod:`kvp_cache.hooks`) switch it on and off around each forward and, at the end
of the forward, let the cache evict all its layers at once (:meth:`KVPCache.end_forward`): the
allocation compares entries across layers, so no layer can evict before the last one attended.
"""

from __future__ import annotations

import itertools
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvp_cache.budget import protected_entries
from kvp_cache.cache import EvictingLayer, age_decayed, take_slots
from kvp_cache.capture import append_queries, drop_last_queries

if TYPE_CHECKING:
    from kvp_cache.cache import KVPCache

RAGGED_ATTENTION = "kvp_ragged"
ACTIVE_CACHE: ContextVar[KVPCache | None] = ContextVar("kvp_active_ragged_cache", default=None)
"""The ragged cache of the forward in progress (set by the model hooks)."""


class RaggedLayer(EvictingLayer):
    """An evicting layer whose KV heads keep different numbers of entries (see the module docstring).

    The per-row fields of :class:`~kvp_cache.cache.EvictingLayer` are packed head after head along
    one slot axis: ``keys``/``values`` ``[batch, slots, head_dim]``, ``valid``, ``scores``,
    ``positions`` and ``entered`` ``[batch, slots]``, where head ``h`` holds ``lengths[h]`` slots starting at
    ``sum(lengths[:h])``; ``seen_real`` stays ``[batch]``. New tokens enter every head at its end,
    so the entries appended since the last eviction are the same last ``appended_since_eviction``
    slots of every head. The layer never evicts by itself: the cache calls
    :meth:`scores_for_allocation` and :meth:`keep` on all its layers together.
    """

    PACKED_FIELDS = ("keys", "values", "valid", "scores", "positions", "entered")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys, self.values = self.keys[:, 0], self.values[:, 0]  # [batch, 0, head_dim]
        if self.scores is not None:
            self.scores = self.scores[:, 0]
        if self.positions is not None:
            self.positions = self.positions[:, 0]
        if self.entered is not None:
            self.entered = self.entered[:, 0]
        self.lengths = [0] * key_states.shape[1]
        self.pending_forward = 0  # tokens of the forward whose eviction, if due, is still to come
        self.holds_padding = False  # some slot of some row is padding: attention needs a mask per head

    def head_slices(self) -> list[slice]:
        """Where each head's slots lie along the packed slot axis."""
        ends = list(itertools.accumulate(self.lengths))
        return [slice(end - n, end) for end, n in zip(ends, self.lengths, strict=True)]

    def heads(self, name: str) -> list[torch.Tensor]:
        """Field ``name`` split per head: views ``[batch, lengths[h], ...]``."""
        packed = getattr(self, name)
        return [packed[:, where] for where in self.head_slices()]

    def _pack(self, pieces: dict[str, list[torch.Tensor]], lengths: list[int]) -> None:
        """Each field of ``pieces`` becomes the concatenation of its pieces; heads get ``lengths``."""
        for name, tensors in pieces.items():
            setattr(self, name, torch.cat(tensors, dim=1))
        self.lengths = lengths

    def _fields(self) -> list[str]:
        return [name for name in self.PACKED_FIELDS if getattr(self, name) is not None]

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
        self.holds_padding = self.holds_padding or not bool(new_real.all())
        new = {"keys": key_states, "values": value_states, "valid": new_real[:, None].expand(b, h, q)}
        if self.scores is not None:
            positions = (self.seen_real[:, None] + new_real.long().cumsum(-1) - 1).masked_fill(~new_real, -1)
            scores = self._score_at_entry(key_states, value_states, positions) if q > 1 else None
            new["scores"] = (
                scores if scores is not None else torch.full((b, h, q), float("nan"), device=self.device)
            )
        if self.positions is not None:
            logical = torch.arange(self.cumulative_length, self.cumulative_length + q, device=self.device)
            new["positions"] = logical.expand(b, h, q)
        seen_real = self.seen_real + new_real.sum(-1)
        if self.entered is not None:
            new["entered"] = seen_real.to(torch.int32)[:, None, None].expand(b, h, q)
        if any(self.lengths):
            # One concatenation per field: each head's slots, then its new ones.
            pieces = {
                name: [piece for i, old in enumerate(self.heads(name)) for piece in (old, added[:, i])]
                for name, added in new.items()
            }
            self._pack(pieces, [n + q for n in self.lengths])
        else:
            # Nothing held: the new states, head after head, are the packed layout (a view, no copy
            # of a whole prompt; the cache never writes into them).
            for name, added in new.items():
                setattr(self, name, added.flatten(1, 2))
            self.lengths = [q] * h
        self.seen_real = seen_real
        self.cumulative_length += q
        self.appended_since_eviction += q
        self.pending_forward = q
        return key_states, value_states

    def real_entries(self) -> torch.Tensor:
        """``[batch, kv_heads]`` real entries each head holds."""
        return torch.stack([v.sum(-1) for v in self.heads("valid")], dim=-1)

    def padded(self, name: str, fill) -> torch.Tensor:
        """Field ``name`` per head, right-padded with ``fill`` to the longest head:
        ``[batch, kv_heads, max lengths, ...]``. Only for eviction and inspection, never per step."""
        tensors = self.heads(name)
        slots = max(self.lengths)
        return torch.stack(
            [F.pad(t, (0, 0) * (t.dim() - 2) + (0, slots - t.shape[1]), value=fill) for t in tensors], dim=1
        )

    def scores_for_allocation(self, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scores, valid, protected)``, each ``[batch, kv_heads, max lengths]``, for keeping
        ``kept`` (``[batch]``) entries per head on average: the scorer's cross-head scores, which
        slots hold a real entry, and which are the head's protected sinks and window."""
        s = self.settings
        valid = self.padded("valid", False)
        positions = (valid.long().cumsum(-1) - 1).masked_fill(~valid, -1)
        with torch.no_grad():
            raw = self._raw_scores(positions)
            if self.entered is not None:
                raw = age_decayed(raw.float(), self.padded("entered", 0), self.seen_real, s.scorer.age_decay)
            scores = s.scorer.cross_head_scores(raw.float(), valid, self.layer_idx).float()
        protected = protected_entries(positions, valid.sum(-1), kept, s.sink_tokens, s.window_tokens)
        return scores.masked_fill(~valid, float("-inf")), valid, protected & valid

    def _raw_scores(self, positions: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, max lengths]`` scores from the scorer (stored ones for ``per_token``);
        positions: ``[batch, kv_heads, max lengths]`` index among the head's real entries."""
        s = self.settings
        queries, self.recent_queries = self.recent_queries, drop_last_queries(self.recent_queries, None)
        if self.scores is not None:
            self._score_pending()
            return self.padded("scores", float("-inf"))
        if (
            self.cumulative_length == self.appended_since_eviction
        ):  # no eviction yet: heads hold the same entries
            keys, values = (torch.stack(self.heads(name), 1) for name in ("keys", "values"))
            return s.scorer.score(keys, values, positions[:, 0], queries, self.layer_idx)
        # Heads hold different entries: score each head on its own entries, repeated over the
        # heads so the scorer sees its usual shape, and keep that head's row of the result.
        rows = []
        for i, (k, v) in enumerate(zip(self.heads("keys"), self.heads("values"), strict=True)):
            repeated = [t[:, None].expand(-1, len(self.lengths), -1, -1) for t in (k, v)]
            rows.append(
                s.scorer.score(*repeated, positions[:, i, : k.shape[1]], queries, self.layer_idx)[:, i]
            )
        slots = max(self.lengths)
        return torch.stack([F.pad(r, (0, slots - r.shape[1]), value=float("-inf")) for r in rows], dim=1)

    def _score_pending(self) -> None:
        """Score the decoded tokens still waiting (NaN): the same last slots of every head."""
        waiting = int(self.heads("scores")[0][0].isnan().sum())
        if waiting == 0:
            return
        tails = [slice(where.stop - waiting, where.stop) for where in self.head_slices()]
        valid = self.heads("valid")[0]
        real_from_here = valid.flip(-1).long().cumsum(-1).flip(-1)
        positions = (self.seen_real[:, None] - real_from_here).masked_fill(~valid, -1)[:, -waiting:]
        keys, values = (
            torch.stack([getattr(self, name)[:, t] for t in tails], 1) for name in ("keys", "values")
        )
        scores = self._score_one_token_rows(keys, values, positions)
        for i, tail in enumerate(tails):
            self.scores[:, tail] = scores[:, i]

    def keep(self, chosen: torch.Tensor) -> None:
        """Keep the ``chosen`` entries of each head, in their order.

        chosen: bool ``[batch, kv_heads, max lengths]``, only valid entries (from
        :func:`kvp_cache.allocation.top_entries`). A row keeping fewer than its head's longest row
        ends that head with invalid filler slots."""
        self.appended_since_eviction = 0
        self.pending_forward = 0
        kept = chosen.sum(-1)
        indices, valid, lengths = [], [], []
        for i, where in enumerate(self.head_slices()):
            slots = int(kept[:, i].max())
            # Chosen slots first, in order: a stable sort of one byte per entry.
            order = (~chosen[:, i, : where.stop - where.start]).to(torch.uint8).argsort(dim=-1, stable=True)
            indices.append(order[:, :slots] + where.start)
            valid.append(torch.arange(slots, device=self.device)[None, :] < kept[:, i, None])
            lengths.append(slots)
        index = torch.cat(indices, dim=1)
        for name in self._fields():
            if name == "valid":  # rebuilt below: kept slots first, fillers after
                continue
            packed = getattr(self, name)
            setattr(self, name, packed.gather(1, index) if packed.dim() == 2 else take_slots(packed, index))
        self.valid = torch.cat(valid, dim=1)
        self.lengths = lengths

    def kept_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, valid)``, each ``[batch, kv_heads, max lengths]``: the logical position of
        every kept entry (needs ``track_positions=True``) and whether the slot holds a real one."""
        return self.padded("positions", 0), self.padded("valid", False)

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        # The model's mask only covers the forward's own tokens; the ragged attention adds each head's past.
        q = query_length.shape[0] if torch.is_tensor(query_length) else int(query_length)
        return q, self.cumulative_length

    def physical_length(self) -> int:
        return max(self.lengths) if self.is_initialized else 0

    def _drop_last_slots(self, n: int) -> None:
        self.seen_real = self.seen_real - self.heads("valid")[0][:, -n:].sum(-1)
        pieces = {name: [head[:, :-n] for head in self.heads(name)] for name in self._fields()}
        self._pack(pieces, [length - n for length in self.lengths])


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
    heads = len(layer.lengths)
    group = q_heads // heads
    new = _new_token_mask(attention_mask, b, q, query.device)
    outputs = []
    for i, where in enumerate(layer.head_slices()):
        keys, values = layer.keys[:, where], layer.values[:, where]
        past = keys.shape[1] - q
        mask, causal = None, False
        if layer.holds_padding or new is not None:
            past_mask = layer.valid[:, where][:, None, None, :past].expand(b, 1, q, past).to(query.device)
            new_mask = new if new is not None else _causal(q, query.device).expand(b, 1, q, q)
            mask = torch.cat([past_mask, new_mask], dim=-1)
        elif q > 1 and past == 0:
            causal = True  # a prefill with nothing cached: SDPA's own causal path, no mask tensor
        elif q > 1:
            mask = torch.cat(
                [torch.ones(q, past, dtype=torch.bool, device=query.device), _causal(q, query.device)], -1
            )
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, i * group : (i + 1) * group],
                keys[:, None],
                values[:, None],
                attn_mask=mask,
                scale=scaling,
                is_causal=causal,
                enable_gqa=True,
            )
        )
    return torch.cat(outputs, dim=1).transpose(1, 2).contiguous(), None


def _new_token_mask(attention_mask: torch.Tensor | None, batch: int, q: int, device) -> torch.Tensor | None:
    """``[batch, 1, q, q]`` bool mask among the forward's tokens from the model's mask (None: causal).

    A token always sees itself, so no row is empty (a padding token's output is unused anyway, and an
    empty row would be NaN in SDPA and reach the cache as NaN keys)."""
    if attention_mask is None:
        return None
    mask = attention_mask[..., -q:]
    if mask.dtype != torch.bool:  # an additive float mask
        mask = mask == 0
    return mask.expand(batch, 1, q, q) | torch.eye(q, dtype=torch.bool, device=mask.device)


def _causal(q: int, device) -> torch.Tensor:
    return torch.ones(q, q, dtype=torch.bool, device=device).tril()


AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)
