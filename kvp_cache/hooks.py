"""The one place where kvp_cache touches the model: decoder hooks that feed a ``KVPCache``.

``Cache.update(keys, values, layer_idx)`` receives post-RoPE keys and values and nothing else,
but eviction also needs to know which of a forward's tokens are padding, and query-aware methods
need the queries. The model's attention mask must also hide the padding slots a padded batch
keeps in the middle of the cache. So ``ModelHooks`` puts a pre-hook and a post-hook on the
decoder. Before each forward that uses its cache, the pre-hook fills the cache's
:class:`ForwardContext`, rewrites the 2-D attention mask over the kept slots, and attaches the
query capture (``kvp_cache.capture``) when the forward will evict with a query-aware method.
The post-hook clears the context and removes the capture. The hooks hold the cache weakly and
go away with it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvp_cache.capture import QueryCapture
from kvp_cache.compat import cache_argument, text_config
from kvp_cache.scorers import QueryStates

if TYPE_CHECKING:
    from kvp_cache.cache import KVPCache


@dataclass
class ForwardContext:
    """What the hooks learned about the forward in progress; the layers' ``update`` reads it.

    in_forward: a forward of the hooked model is running (a cache built from a model refuses
        updates from any other model).
    new_tokens_real: ``[batch, q]`` bool, False where the forward's new token is padding (None:
        all real). Set by the hooks, or by ``KVPCache.set_attention_mask`` for a config-built cache.
    queries: layer index -> the forward's captured queries, for query-aware scorers.
    """

    in_forward: bool = False
    new_tokens_real: torch.Tensor | None = None
    queries: dict[int, QueryStates] = field(default_factory=dict)

    def clear(self) -> None:
        self.in_forward = False
        self.new_tokens_real = None
        self.queries.clear()


class ModelHooks:
    """The decoder hooks of one ``KVPCache`` (see the module docstring)."""

    def __init__(self, cache: KVPCache, model: torch.nn.Module):
        self._cache = weakref.ref(cache)
        self.model = weakref.ref(model)
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        scorer = cache.settings.scorer
        evicting = {layer.layer_idx for layer in cache.evicting_layers}
        self.capture = QueryCapture(model, scorer.query_window, evicting) if scorer.needs_queries else None
        handles = [
            decoder.register_forward_pre_hook(self._before, with_kwargs=True),
            decoder.register_forward_hook(self._after, with_kwargs=True, always_call=True),
        ]
        self._restore = None  # (configs and their attention implementations, context token) mid-forward
        weakref.finalize(cache, _remove_all, handles, self.capture)

    def _before(self, module, args, kwargs):
        cache = self._cache()
        if cache is None or cache_argument(kwargs) is not cache:
            return None
        context = cache.context
        context.in_forward = True
        tokens = (
            kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        )
        if tokens is None and args:
            tokens = args[0]
        q = tokens.shape[1]
        mask = kwargs.get("attention_mask")
        cache.set_attention_mask(mask[:, -q:] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None)
        if self.capture is not None and cache.captures_queries(q):
            self.capture.attach(context.queries)
        kwargs["attention_mask"] = mask_invalid_slots(cache, mask, tokens)
        if cache.settings.allocation != "uniform":
            self._switch_to_ragged_attention(cache)
        return args, kwargs

    def _after(self, module, args, kwargs, output):
        cache = self._cache()
        if cache is None or cache_argument(kwargs) is not cache:
            return None
        try:
            if output is not None and cache.settings.allocation != "uniform":
                cache.end_forward()
        finally:
            cache.context.clear()
            if self.capture is not None:
                self.capture.detach()
            self._restore_attention()
        return None

    def _switch_to_ragged_attention(self, cache: KVPCache) -> None:
        """Attend through :func:`kvp_cache.ragged.ragged_attention` for this forward only."""
        from kvp_cache.ragged import ACTIVE_CACHE, RAGGED_ATTENTION  # ragged builds on the cache

        configs = {id(c): c for c in (self.model().config, text_config(self.model().config))}.values()
        self._restore = [(c, c._attn_implementation_internal) for c in configs], ACTIVE_CACHE.set(cache)
        for config in configs:
            config._attn_implementation_internal = RAGGED_ATTENTION

    def _restore_attention(self) -> None:
        if self._restore is None:
            return
        from kvp_cache.ragged import ACTIVE_CACHE

        saved, token = self._restore
        self._restore = None
        for config, implementation in saved:
            config._attn_implementation_internal = implementation
        ACTIVE_CACHE.reset(token)


def mask_invalid_slots(
    cache: KVPCache, mask: torch.Tensor | None, tokens: torch.Tensor
) -> torch.Tensor | None:
    """Zero the 2-D mask columns that face padding slots of the cache (rows of a padded batch).

    The mask covers the logical sequence; the kept slots are its last ``physical`` columns before
    the new tokens (``get_mask_sizes`` offsets it so), and every evicting layer has the same
    validity per row, so one rewrite serves all of them.
    """
    (batch, q), device = tokens.shape[:2], tokens.device
    layers = cache.evicting_layers
    if not layers or not layers[0].is_initialized or (mask is not None and mask.dim() != 2):
        return mask
    if cache.settings.allocation != "uniform":
        return mask  # the ragged attention masks each head's padding slots itself
    valid = layers[0].valid
    if bool(valid.all()):
        return mask
    seen = layers[0].cumulative_length
    if mask is None:
        mask = torch.ones(batch, seen + q, dtype=torch.long, device=device)
    mask = mask.clone()
    start = seen - valid.shape[-1]
    mask[:, start:seen] = valid.to(device=mask.device, dtype=mask.dtype)
    return mask


def _remove_all(handles, capture) -> None:
    for handle in handles:
        handle.remove()
    if capture is not None:
        capture.detach()
