"""kvp_cache.allocation: equal totals across modes, today's per-head top-k, minimum, protection."""

from __future__ import annotations

import math

import pytest
import torch

from kvp_cache.allocation import MIN_EXTRA_PER_HEAD, MODES, allocate, largest, top_entries


def random_scores(layers=3, heads=2, tokens=64, seed=0) -> dict[int, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # Heads of different peakedness, so the global modes move entries between them.
    return {
        layer: torch.rand(heads, tokens, generator=generator) ** (1 + 3 * layer) for layer in range(layers)
    }


def counts(kept: dict[int, torch.Tensor]) -> dict[int, list[int]]:
    return {layer: mask.sum(-1).tolist() for layer, mask in kept.items()}


@pytest.mark.parametrize("budget", [0.05, 0.1, 0.25, 0.5, 1.0, 3, 20, 500])
def test_every_mode_keeps_the_same_total(budget):
    scores = random_scores()
    tokens = 64
    per_head = math.ceil(budget * tokens) if isinstance(budget, float) else min(budget, tokens)
    heads = sum(s.shape[0] for s in scores.values())
    for mode in MODES:
        kept = allocate(scores, budget, mode)
        assert sum(int(mask.sum()) for mask in kept.values()) == per_head * heads, mode
        assert all(mask.dtype == torch.bool and mask.shape == (2, tokens) for mask in kept.values())


def test_uniform_is_each_heads_top_k_with_sinks_and_window():
    scores = random_scores(tokens=50)
    kept = allocate(scores, 0.4, "uniform", sink_tokens=3, window_tokens=5)
    for layer, s in scores.items():
        boosted = s.clone()
        boosted[:, :3] = boosted[:, -5:] = float("inf")
        expected = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, boosted.topk(20).indices, True)
        assert torch.equal(kept[layer], expected)


def test_tiny_budget_keeps_the_window_first_as_the_cache_does():
    kept = allocate(random_scores(tokens=40), 5, "uniform", sink_tokens=4, window_tokens=3)
    assert all(mask[:, -3:].all() and mask[:, :2].all() and mask.sum() == 10 for mask in kept.values())


@pytest.mark.parametrize("mode", ["head", "layer"])
def test_global_modes_keep_the_minimum_and_the_protected_entries(mode):
    scores = random_scores(layers=4, tokens=100)
    for minimum in (None, 1, 12, 25):
        kept = allocate(scores, 0.25, mode, min_per_head=minimum, sink_tokens=4, window_tokens=6)
        floor = 4 + 6 + MIN_EXTRA_PER_HEAD if minimum is None else max(minimum, 10)
        for mask in kept.values():
            assert mask[:, :4].all() and mask[:, -6:].all()
            assert (mask.sum(-1) >= floor).all()


def test_head_mode_is_one_top_k_over_every_unprotected_entry():
    scores = random_scores(layers=3, heads=3, tokens=60)
    kept = allocate(scores, 0.2, "head", min_per_head=1, sink_tokens=0, window_tokens=0)
    # With a minimum of 1 only each head's best entry is forced; everything else is one global top-k.
    flat = torch.cat([s.flatten() for s in scores.values()])
    best = torch.cat([s == s.amax(-1, keepdim=True) for s in scores.values()]).flatten()
    rest = flat.masked_fill(best, -1).topk(12 * 9 - 9).indices
    expected = best.clone()
    expected[rest] = True
    assert torch.equal(torch.cat([k.flatten() for k in kept.values()]), expected)


def test_a_peaked_head_gives_its_entries_to_a_flat_head():
    peaked = torch.tensor([10.0, 9.0] + [0.01] * 18)
    flat = torch.full((20,), 0.5)
    scores = {0: torch.stack([peaked, flat])}
    minimum = 3
    kept = allocate(scores, 0.5, "head", min_per_head=minimum, sink_tokens=0, window_tokens=0)
    assert counts(kept) == {0: [minimum, 2 * 10 - minimum]}
    assert kept[0][0, :2].all()  # the peaked head keeps its two peaks
    assert counts(allocate(scores, 0.5, "uniform", sink_tokens=0, window_tokens=0)) == {0: [10, 10]}


def test_layer_mode_splits_each_layers_global_total_evenly():
    scores = {0: torch.stack([torch.full((30,), 0.9), torch.full((30,), 0.8), torch.full((30,), 0.7)])}
    scores[1] = torch.full((3, 30), 0.01)
    head = counts(allocate(scores, 0.3, "head", min_per_head=2, sink_tokens=0, window_tokens=0))
    layer = counts(allocate(scores, 0.3, "layer", min_per_head=2, sink_tokens=0, window_tokens=0))
    assert {k: sum(v) for k, v in head.items()} == {k: sum(v) for k, v in layer.items()} == {0: 48, 1: 6}
    assert layer == {0: [16, 16, 16], 1: [2, 2, 2]}
    uneven = {0: torch.stack([torch.full((30,), 0.9), torch.full((30,), 0.1)]), 1: torch.full((2, 30), 0.5)}
    split = counts(allocate(uneven, 0.5, "layer", min_per_head=1, sink_tokens=0, window_tokens=0))
    # Layer 0 gets 30 (head 0) + 1 (head 1's minimum) = 31 entries; head 0's next entry wins the odd one.
    assert split[0] == [16, 15] and sum(split[1]) == 29


def test_errors_name_the_parameter():
    scores = random_scores()
    with pytest.raises(ValueError, match=r"mode must be one of \('uniform', 'layer', 'head'\)"):
        allocate(scores, 0.1, "global")
    with pytest.raises(ValueError, match="min_per_head .* exceeds the per-head budget"):
        allocate(scores, 0.1, "head", min_per_head=8)
    with pytest.raises(ValueError, match="min_per_head must be an int >= 1"):
        allocate(scores, 0.1, "head", min_per_head=0)
    with pytest.raises(ValueError, match="budget as a float"):
        allocate(scores, 1.5, "head")
    with pytest.raises(ValueError, match="same tokens"):
        allocate({0: torch.rand(2, 10), 1: torch.rand(2, 11)}, 0.5)
    with pytest.raises(ValueError, match="finite"):
        allocate({0: torch.tensor([[1.0, float("nan")]])}, 0.5)
    with pytest.raises(ValueError, match="non-empty dict"):
        allocate({}, 0.5)
    with pytest.raises(ValueError, match=r"\[kv_heads, tokens\]"):
        allocate({0: torch.rand(10)}, 0.5)
    with pytest.raises(ValueError, match="window_tokens must be an int >= 0"):
        allocate(scores, 0.5, window_tokens=-1)


def test_largest_takes_what_a_stable_descending_sort_takes_first():
    generator = torch.Generator().manual_seed(0)
    # Few distinct values, so most thresholds fall inside a run of ties; one row of -inf padding.
    values = torch.randint(0, 6, (5, 40), generator=generator).float()
    values[4, 30:] = -math.inf
    counts = torch.tensor([0, 1, 17, 40, 30])
    order = values.argsort(dim=-1, descending=True, stable=True)
    expected = torch.zeros_like(values, dtype=torch.bool)
    expected.scatter_(-1, order, torch.arange(40) < counts[:, None])
    assert torch.equal(largest(values, counts), expected)
    assert not largest(values, torch.zeros(5, dtype=torch.long)).any()


def test_top_entries_takes_protected_then_valid_entries_as_a_stable_sort_does():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (2, 3, 40), generator=generator).float()  # many ties
    scores[0, 1, :6] = -math.inf
    scores[1, 2, 3:9] = math.nan
    valid = torch.rand(2, 3, 40, generator=generator) > 0.2
    protected = valid & (torch.rand(2, 3, 40, generator=generator) > 0.7)
    available, protected_counts = valid.sum(-1), protected.sum(-1)
    # Per head: none, part of the protected entries, all of them and more, every valid entry.
    counts = torch.stack(
        [torch.zeros_like(available), protected_counts // 2, protected_counts + 3, available]
    )
    tier = protected.long() * 2 + valid.long()
    by_score = scores.nan_to_num(nan=-math.inf).argsort(dim=-1, descending=True, stable=True)
    order = by_score.gather(-1, tier.gather(-1, by_score).argsort(dim=-1, descending=True, stable=True))
    for count in counts:
        expected = torch.zeros_like(valid).scatter_(-1, order, torch.arange(40) < count[..., None])
        assert torch.equal(top_entries(scores, valid, protected, count), expected)


@pytest.mark.parametrize("mode", MODES)
def test_a_ranking_picks_the_entries_the_scores_allocate(mode):
    scores = random_scores(layers=2, heads=3, tokens=50)
    ranking = random_scores(layers=2, heads=3, tokens=50, seed=1)
    protected = dict(sink_tokens=2, window_tokens=3)
    kept = allocate(scores, 0.2, mode, **protected, ranking=ranking)
    assert counts(kept) == counts(allocate(scores, 0.2, mode, **protected))
    forced = torch.zeros(50, dtype=torch.bool)
    forced[:2] = forced[-3:] = True
    for layer, mask in kept.items():
        for head, row in enumerate(mask):
            best = ranking[layer][head].masked_fill(forced, -math.inf).topk(int(row.sum()) - 5).indices
            assert torch.equal(row, forced.clone().index_fill_(0, best, True))
    with pytest.raises(ValueError, match="ranking must hold a tensor of the scores' shape"):
        allocate(scores, 0.2, mode, ranking={0: ranking[0]})
