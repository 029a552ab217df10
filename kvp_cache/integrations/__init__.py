"""Integrations with evaluation tools, and the forward helpers they share.

:func:`forward_tokens` is one forward on top of a cache with the positions ``generate`` would use
for a left-padded batch. To ask a question *after* compressing a context, build the cache with
``KVPCache(..., compress="first_prefill")``: the context's forward compresses, and the question's
multi-token forward is appended whole. :func:`append_uncompressed` is the older way, for a cache on
the default ``compress="every_prefill"``: it feeds tokens one at a time, since a single-token
forward never evicts.
"""

from __future__ import annotations

import torch
from transformers import Cache, PreTrainedModel

from kvp_cache.compat import cache_kwarg


@torch.no_grad()
def forward_tokens(
    model: PreTrainedModel,
    cache: Cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    logits_to_keep: int = 0,
) -> torch.Tensor:
    """One forward of ``input_ids`` (``[batch, q]``) on top of ``cache``; returns logits ``[batch, q, vocab]``
    (``[batch, logits_to_keep, vocab]`` when ``logits_to_keep > 0``, which spares a long prefill's logits).

    ``attention_mask`` (``[batch, cached + q]``, 1 = real) covers the cached tokens too, as in
    ``generate``; positions then count real tokens only, so left-padded rows get the positions
    ``generate`` gives them. Without a mask positions continue from ``cache.get_seq_length()``.
    """
    kwargs = {cache_kwarg(model): cache, "use_cache": True}
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep
    if attention_mask is not None:
        q = input_ids.shape[1]
        positions = attention_mask.long().cumsum(-1) - 1
        kwargs["position_ids"] = positions.masked_fill(attention_mask == 0, 1)[:, -q:]
        kwargs["attention_mask"] = attention_mask
    return model(input_ids=input_ids, **kwargs).logits


@torch.no_grad()
def append_uncompressed(
    model: PreTrainedModel, cache: Cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Feed ``input_ids`` (``[batch, n]``) one token at a time, so a ``KVPCache`` keeps all of them.

    ``attention_mask`` is ``[batch, cached + n]`` as in :func:`forward_tokens`. Returns the logits
    of the last token (``[batch, vocab]``), or None when ``n == 0``.
    """
    n = input_ids.shape[1]
    past = attention_mask.shape[1] - n if attention_mask is not None else 0
    logits = None
    for t in range(n):
        mask = attention_mask[:, : past + t + 1] if attention_mask is not None else None
        logits = forward_tokens(model, cache, input_ids[:, t : t + 1], mask)[:, -1]
    return logits
