"""What a prompt token is worth to the future: the training targets, one definition each.

``collect`` measures, per KV head ``h`` and prompt token ``i``, with ``A_g[t, i]`` the model's full
causal softmax attention of query head ``g`` at future position ``t`` (not renormalized to the
prompt) and ``G(h)`` the query heads that share KV head ``h``:

- ``importance[h, i] = sum_t max_{g in G(h)} A_g[t, i]`` (the paper's future attention, section 4);
- ``value_importance[h, i] = sum_t max_{g in G(h)} A_g[t, i] * ||W_o^g v_i||``: the attention
  weighted by the norm of what the token writes into the residual stream through head ``g``
  (``W_o^g`` is ``g``'s slice of ``o_proj``), closer to what evicting it changes in the output.

``fit`` trains on one of the :data:`TARGETS`, chosen by name:

- ``attention``: ``importance`` as stored (what the shipped policy was trained on);
- ``attention_evictable``: the same with the always-kept sinks and window zeroed, so they leave both
  the target and its normalizer (they carry about half the mass, and the cache keeps them anyway);
- ``value_attention``: ``value_importance``;
- ``value_attention_evictable``: ``value_importance`` with the sinks and window zeroed, as above.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from train.traces import LayerSample


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
    kv_heads, total, d = keys.shape
    q_heads, future, _ = queries.shape
    group = q_heads // kv_heads
    grouped = queries.float().view(kv_heads, group, future, d)
    keys = keys.float()
    weights = None if value_norms is None else value_norms.float().view(kv_heads, group, 1, prompt_len)
    importance = torch.zeros(kv_heads, prompt_len, device=keys.device)
    value_importance = None if weights is None else torch.zeros_like(importance)
    key_pos = torch.arange(total, device=keys.device)
    for start in range(0, future, chunk):
        q = grouped[:, :, start : start + chunk]
        query_pos = torch.arange(q.shape[2], device=keys.device) + (total - future + start)
        logits = torch.einsum("hgfd,htd->hgft", q, keys) * scaling
        logits = logits.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        attention = logits.softmax(-1)[..., :prompt_len]  # [kv_heads, group, chunk, prompt_len]
        importance += attention.amax(dim=1).sum(dim=1)
        if weights is not None:
            value_importance += (attention * weights).amax(dim=1).sum(dim=1)
    return importance, value_importance


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


def attention(sample: LayerSample, sinks: int, window: int) -> torch.Tensor:
    return sample.importance


def evictable_only(importance: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """``importance`` ``[kv_heads, n]`` with the always-kept first ``sinks`` and last ``window`` zeroed."""
    n = importance.shape[-1]
    evictable = torch.zeros(n, dtype=torch.bool, device=importance.device)
    evictable[sinks : max(sinks, n - window)] = True
    return importance * evictable


def attention_evictable(sample: LayerSample, sinks: int, window: int) -> torch.Tensor:
    return evictable_only(sample.importance, sinks, window)


def value_attention(sample: LayerSample, sinks: int, window: int) -> torch.Tensor:
    if sample.value_importance is None:
        raise ValueError(
            f"target 'value_attention' needs value_importance in the traces ({sample.uid} has none); "
            "collect them again with this version of `python -m train collect`"
        )
    return sample.value_importance


def value_attention_evictable(sample: LayerSample, sinks: int, window: int) -> torch.Tensor:
    return evictable_only(value_attention(sample, sinks, window), sinks, window)


TARGETS: dict[str, Callable[[LayerSample, int, int], torch.Tensor]] = {
    "attention": attention,
    "attention_evictable": attention_evictable,
    "value_attention": value_attention,
    "value_attention_evictable": value_attention_evictable,
}


def target(name: str, sample: LayerSample, sinks: int = 4, window: int = 16) -> torch.Tensor:
    """The importance ``[kv_heads, n]`` that ``fit`` ranks against, by target name."""
    if name not in TARGETS:
        raise ValueError(f"target must be one of {sorted(TARGETS)}, got {name!r}")
    return TARGETS[name](sample, sinks, window)
