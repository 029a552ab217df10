"""Forward hooks that capture the prefill queries query-aware scorers need.

``Cache.update`` only ever sees keys and values. Methods such as SnapKV or TOVA also need the
queries of the prompt, so while a multi-token forward runs, a pre-hook on each evicting layer's
attention module recomputes them from the module's input: ``q_proj`` (plus ``q_norm`` where the
model has one), then RoPE with the position embeddings the layer received. Only the last
``window`` queries are computed, and the hooks exist only for the duration of that forward.
:class:`kvp_cache.hooks.ModelHooks` decides which forwards are captured.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from kvp_cache.scorers.base import QueryStates, rotate_half


class QueryCapture:
    """Attach/detach query-capturing pre-hooks on the attention modules of ``layer_indices``."""

    def __init__(self, model: torch.nn.Module, window: int, layer_indices: set[int]):
        self.window = window
        self.modules = [
            m
            for m in model.modules()
            if getattr(m, "layer_idx", None) in layer_indices and hasattr(m, "q_proj")
        ]
        if len(self.modules) != len(layer_indices):
            raise NotImplementedError(
                f"Query-aware methods need Llama-style attention modules with a q_proj; "
                f"{type(model).__name__} exposes {len(self.modules)} of {len(layer_indices)}. "
                "Use a key/value-only method (knorm, keydiff, streaming_llm, random, lagkv, kvp)."
            )
        self._handles: list = []

    def attach(self, store: dict) -> None:
        self.detach()
        for module in self.modules:
            hook = self._make_hook(store)
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_hook(self, store: dict):
        window = self.window

        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            store[module.layer_idx] = queries_of(module, hidden, cos, sin, window)

        return hook


@torch.no_grad()
def queries_of(
    module: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, window: int
):
    """QueryStates of the last ``window`` tokens (all if -1) of ``hidden`` ``[batch, seq, hidden]``."""
    n = hidden.shape[1] if window < 0 else min(window, hidden.shape[1])
    head_dim = module.head_dim
    b = hidden.shape[0]
    pre = module.q_proj(hidden[:, -n:]).view(b, n, -1, head_dim)
    if hasattr(module, "q_norm"):
        pre = module.q_norm(pre)
    pre = pre.transpose(1, 2)
    cos_n, sin_n = cos[:, -n:].unsqueeze(1), sin[:, -n:].unsqueeze(1)
    post = pre * cos_n + rotate_half(pre) * sin_n
    # RoPE angle advanced per position, read off the last two positions; with the rotation of the
    # last position it lets scorers rotate query statistics to future positions without knowing
    # the model's rotary class.
    angle_last = torch.atan2(sin[0, -1], cos[0, -1]).float()
    angle_prev = (
        torch.atan2(sin[0, -2], cos[0, -2]).float() if cos.shape[1] > 1 else torch.zeros_like(angle_last)
    )
    return QueryStates(
        queries=post,
        pre_rope_queries=pre,
        rope_step=torch.remainder(angle_last - angle_prev, 2 * math.pi),
        last_cos=cos[:, -1].float(),
        last_sin=sin[:, -1].float(),
        scaling=module.scaling,
    )


def append_queries(old: QueryStates | None, new: QueryStates, window: int | None) -> QueryStates:
    """``old``'s queries followed by ``new``'s, the last ``window`` of them (all when ``window < 0``).

    A one-token capture cannot measure RoPE's angle step per position, so it keeps ``old``'s.
    """
    if old is not None:
        new = replace(
            new,
            queries=torch.cat([old.queries, new.queries], dim=-2),
            pre_rope_queries=torch.cat([old.pre_rope_queries, new.pre_rope_queries], dim=-2),
            rope_step=old.rope_step if new.queries.shape[-2] == 1 else new.rope_step,
        )
    if window is not None and window > 0:
        new = replace(
            new,
            queries=new.queries[..., -window:, :],
            pre_rope_queries=new.pre_rope_queries[..., -window:, :],
        )
    return new


def drop_last_queries(states: QueryStates | None, n: int | None) -> QueryStates | None:
    """``states`` without its last ``n`` queries (all of them when ``n`` is None), RoPE data kept."""
    if states is None:
        return None
    keep = 0 if n is None else max(states.queries.shape[-2] - n, 0)
    return replace(
        states, queries=states.queries[..., :keep, :], pre_rope_queries=states.pre_rope_queries[..., :keep, :]
    )


def map_query_batch(states: QueryStates, fn: Callable[[torch.Tensor], torch.Tensor]) -> QueryStates:
    """Apply a batch operation (beam reorder, repeat, select) to every per-row tensor of ``states``."""
    return replace(
        states,
        queries=fn(states.queries),
        pre_rope_queries=fn(states.pre_rope_queries),
        last_cos=fn(states.last_cos),
        last_sin=fn(states.last_sin),
    )
