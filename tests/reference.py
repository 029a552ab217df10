"""Independent reference for KVPCache: one full forward with an explicit per-layer, per-head mask.

``ForwardRecorder`` snapshots, before every forward that uses the cache, which logical positions
each evicting layer holds for each KV head. ``reference_logits`` then reruns the whole sequence
from scratch with a custom attention function in which a query of forward ``f`` may see (a) the
tokens of forward ``f`` up to itself and (b) among earlier tokens, only those the snapshot of
forward ``f`` says were kept for that layer and KV head. Causality, padding and sliding windows
are applied explicitly. Nothing here uses KVPCache's mask or length logic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from kvp_cache.cache import KVPCache
from kvp_cache.compat import cache_argument, cache_kwarg


@dataclass
class Snapshot:
    start: int  # logical index of the forward's first token
    length: int  # tokens in the forward
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (positions [b, h, S], valid [b, (h,) S])


class ForwardRecorder:
    def __init__(self, model: torch.nn.Module, cache: KVPCache):
        self.cache = cache
        self.snapshots: list[Snapshot] = []
        decoder = model.get_decoder()
        self._handle = decoder.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if cache_argument(kwargs) is not self.cache:
            return
        tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
        kept = {}
        for layer in self.cache.evicting_layers:
            if layer.is_initialized:
                kept[layer.layer_idx] = tuple(t.clone() for t in layer.kept_positions())
        self.snapshots.append(Snapshot(self.cache.get_seq_length(), tokens.shape[1], kept))

    def remove(self) -> None:
        self._handle.remove()


ATOL = 2e-4


def ids(batch=1, length=48, seed=0, vocab=256):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, input_ids, cache, max_new_tokens=6, **kwargs):
    out = model.generate(
        input_ids,
        **{cache_kwarg(model): cache},
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences, torch.stack(out.logits, dim=1).float()


def check_generate_against_reference(
    model, prompt, cache, attention_mask=None, max_new_tokens=6, atol=ATOL, rtol=1e-4
):
    recorder = ForwardRecorder(model, cache)
    sequences, logits = greedy(model, prompt, cache, max_new_tokens, attention_mask=attention_mask)
    recorder.remove()
    mask = None
    if attention_mask is not None:
        mask = torch.cat([attention_mask, torch.ones_like(sequences[:, prompt.shape[1] :])], dim=-1)
    ref = reference_logits(model, sequences, recorder.snapshots, mask)
    steps = ref[:, prompt.shape[1] - 1 : prompt.shape[1] - 1 + logits.shape[1]]
    torch.testing.assert_close(logits, steps, atol=atol, rtol=rtol)
    return sequences


@torch.no_grad()
def teacher_forced_logprobs(model, prompt: torch.Tensor, continuation: torch.Tensor, cache) -> torch.Tensor:
    """Log-probabilities ``[n]`` of ``continuation`` (``[n]``) fed one token at a time after ``prompt``."""
    step = model(prompt, **{cache_kwarg(model): cache}).logits[:, -1]
    scores = []
    for token in continuation:
        scores.append(torch.log_softmax(step.float(), -1)[0, token])
        step = model(token.view(1, 1), **{cache_kwarg(model): cache}).logits[:, -1]
    return torch.stack(scores)


@torch.no_grad()
def check_beams_against_teacher_forcing(model, prompt: torch.Tensor, new_cache, max_new_tokens: int) -> None:
    """Beam search with 3 beams returned: each beam's transition scores equal its log-probabilities
    teacher-forced one token at a time through a fresh cache from ``new_cache()``."""
    out = model.generate(
        prompt,
        **{cache_kwarg(model): new_cache()},
        num_beams=3,
        num_return_sequences=3,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == (3, prompt.shape[1] + max_new_tokens)
    transition = model.compute_transition_scores(
        out.sequences, out.scores, out.beam_indices, normalize_logits=False
    )
    for row in range(3):
        scores = teacher_forced_logprobs(model, prompt, out.sequences[row, prompt.shape[1] :], new_cache())
        torch.testing.assert_close(scores, transition[row].float(), atol=1e-3, rtol=1e-3)


_CONTEXT: dict = {}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    allowed = _CONTEXT["allowed"](module.layer_idx, kwargs.get("sliding_window"))  # [b, kv_heads, T, T]
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    allowed = allowed.repeat_interleave(groups, dim=1)
    logits = (query.float() @ key.float().transpose(-1, -2)) * (
        scaling if scaling is not None else module.scaling
    )
    logits = logits.masked_fill(~allowed, torch.finfo(torch.float32).min)
    weights = logits.softmax(-1)
    out = (weights @ value.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights


AttentionInterface.register("kvp_reference", _reference_attention)


@torch.no_grad()
def reference_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    snapshots: list[Snapshot],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits ``[batch, T, vocab]`` of the whole sequence under the recorded evictions."""
    b, total = input_ids.shape
    device = input_ids.device
    real = (
        attention_mask.bool()
        if attention_mask is not None
        else torch.ones(b, total, dtype=torch.bool, device=device)
    )
    positions = (real.long().cumsum(-1) - 1).clamp_min(0)
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    base = causal[None] & real[:, None, :]  # [b, T(q), T(k)]
    num_kv_heads = model.config.num_key_value_heads

    def allowed(layer_idx: int, sliding_window: int | None) -> torch.Tensor:
        mask = base[:, None].expand(b, num_kv_heads, total, total).clone()
        if sliding_window:
            q_idx = torch.arange(total, device=device)[:, None]
            k_idx = torch.arange(total, device=device)[None, :]
            mask &= (q_idx - k_idx < sliding_window)[None, None]
            return mask
        for snap in snapshots:
            if layer_idx not in snap.kept:
                continue
            kept_positions, valid = snap.kept[layer_idx]
            member = torch.zeros(b, num_kv_heads, snap.start, dtype=torch.long, device=device)
            weights = valid[:, None, :] if valid.dim() == 2 else valid  # per row, or per head (ragged)
            member = member.scatter_add_(-1, kept_positions, weights.expand_as(kept_positions).long()) > 0
            rows = slice(snap.start, snap.start + snap.length)
            mask[:, :, rows, : snap.start] = member[:, :, None, :] & real[:, None, None, : snap.start]
        return mask

    previous = model.config._attn_implementation
    _CONTEXT["allowed"] = allowed
    model.set_attn_implementation("kvp_reference")
    try:
        return model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions
        ).logits.float()
    finally:
        model.set_attn_implementation(previous)
        _CONTEXT.clear()
