"""The core importance targets (kvp_cache.targets) against brute-force references and the cache itself."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvp_cache import KVPCache
from kvp_cache.compat import cache_kwarg
from kvp_cache.scorers import Scorer
from kvp_cache.targets import decode_attention, evictable_only, eviction_points, future_attention


def random_states(q_heads=4, kv_heads=2, total=40, future=30, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(q_heads, future, d, generator=g)
    keys = torch.randn(kv_heads, total, d, generator=g)
    return queries, keys


def brute_force_decode(queries, keys, scaling, evictions, sinks, window, horizon):
    """One query, one head, one token at a time: the definition, written as loops."""
    q_heads, future, _ = queries.shape
    kv_heads, total, _ = keys.shape
    group = q_heads // kv_heads
    first = total - future
    expected = torch.zeros(len(evictions), kv_heads, total, dtype=torch.float64)
    for k, read in enumerate(evictions):
        if horizon is None:
            end = evictions[k + 1] if k + 1 < len(evictions) else total
        else:
            end = min(read + horizon, total)
        for t in range(read, end):
            for h in range(kv_heads):
                for i in range(read):
                    if i < sinks or i >= read - window:
                        continue
                    best = 0.0
                    for g in range(h * group, (h + 1) * group):
                        logits = (queries[g, t - first].double() @ keys[h, : t + 1].double().T) * scaling
                        best = max(best, float(logits.softmax(-1)[i]))
                    expected[k, h, i] += best
    return expected


@pytest.mark.parametrize("horizon", [None, 5, 100])
def test_decode_attention_matches_brute_force(horizon):
    queries, keys = random_states()
    evictions = [10, 14, 21, 27, 35, 40]  # uneven spans; the last one has no query after it
    got = decode_attention(queries, keys, 0.3, evictions, sinks=2, window=3, horizon=horizon, chunk=4)
    expected = brute_force_decode(queries, keys, 0.3, evictions, 2, 3, horizon)
    assert got.shape == (6, 2, 40)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert got[-1].abs().sum() == 0  # nothing reads the cache left after the last token


def test_one_eviction_after_the_prompt_is_the_prefill_target():
    queries, keys = random_states(total=40, future=25)
    prompt = 15
    (importance,) = decode_attention(queries, keys, 0.25, [prompt], sinks=4, window=5, chunk=7)
    prefill, _ = future_attention(queries, keys, prompt, 0.25, chunk=6)
    torch.testing.assert_close(importance[:, :prompt], evictable_only(prefill, 4, 5))
    assert importance[:, prompt:].abs().sum() == 0


def test_decode_attention_rejects_what_it_cannot_compute():
    queries, keys = random_states(total=40, future=30)
    with pytest.raises(ValueError, match="evictions must increase"):
        decode_attention(queries, keys, 0.3, [5, 20], 2, 3)  # eviction 5 reads queries not given
    with pytest.raises(ValueError, match="evictions must increase"):
        decode_attention(queries, keys, 0.3, [20, 20], 2, 3)
    with pytest.raises(ValueError, match="horizon"):
        decode_attention(queries, keys, 0.3, [20], 2, 3, horizon=0)
    with pytest.raises(ValueError, match="forward_tokens"):
        eviction_points([4, 0], 8, 2)


@dataclass
class CountingScorer(Scorer):
    """Oldest first (a key/value-only ranking), counting its calls: one per eviction per layer."""

    calls: int = field(default=0)

    def score(self, keys, values, positions, queries=None, layer_idx=0):
        if layer_idx == 0:
            self.calls += 1
        return positions[:, None, :].expand(-1, keys.shape[1], -1).float()


@pytest.mark.parametrize("forwards", [[1] * 50, [20] + [3] * 10, [12, 7, 7, 7, 1, 1, 9]])
def test_eviction_points_follow_the_caches_schedule(llama, forwards):
    scorer = CountingScorer()
    cache = KVPCache(
        llama, scorer, budget=1.0, max_cache_tokens=10, evict_every=4, sink_tokens=1, window_tokens=2
    )
    ids = torch.randint(0, 256, (1, sum(forwards)), generator=torch.Generator().manual_seed(1))
    seen, read = [], 0
    with torch.no_grad():
        for n in forwards:
            before = scorer.calls
            llama(input_ids=ids[:, read : read + n], use_cache=True, **{cache_kwarg(llama): cache})
            read += n
            if scorer.calls > before:
                seen.append(read)
    assert seen == eviction_points(forwards, max_cache_tokens=10, evict_every=4)
    assert seen  # the schedule evicted at least once
