"""allocation="layer" | "head": ragged per-head storage, checked against the per-head masked reference."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from conftest import TINY_CONFIGS, TINY_SHAPE, tiny_model
from reference import (
    ATOL,
    ForwardRecorder,
    check_beams_against_teacher_forcing,
    check_generate_against_reference,
    greedy,
    ids,
    reference_logits,
)
from transformers import AutoModelForCausalLM, DynamicCache, Gemma2Config

from kvp_cache import KVPCache, KVPolicy
from kvp_cache.compat import cache_kwarg
from kvp_cache.prefill import prefill
from kvp_cache.ragged import RaggedLayer
from kvp_cache.scorers import SCORERS as SCORER_CLASSES
from kvp_cache.scorers.base import Scorer
from kvp_cache.scorers.snapkv import SnapKVScorer

PROTECTED = {"sink_tokens": 2, "window_tokens": 3}


@dataclass
class PeakedNorm(Scorer):
    """Key/value-only, scored at entry: each head's softmax of its key norms, sharpened differently
    per (layer, head), so the adaptive modes really move entries between heads."""

    name = "test_peaked_norm"
    per_token = True
    comparable_across_heads = True

    def score(self, keys, values, positions, queries=None, layer_idx=0):
        return keys.float().norm(dim=-1).masked_fill(positions[:, None, :] < 0, float("-inf"))

    def cross_head_scores(self, scores, valid, layer_idx=0):
        sharpness = 1.0 + 3.0 * torch.arange(scores.shape[1], device=scores.device) + layer_idx
        return (scores * sharpness[:, None]).masked_fill(~valid, float("-inf")).softmax(-1)


@dataclass
class SharedSnapKV(SnapKVScorer):
    """SnapKV (query-aware, rescored at every eviction) with its pooled attention as the cross-head value."""

    name = "test_shared_snapkv"
    comparable_across_heads = True
    window_size: int = 6

    def cross_head_scores(self, scores, valid, layer_idx=0):
        return scores.masked_fill(~valid, float("-inf"))


SCORERS = {"per_token": PeakedNorm, "query_aware": SharedSnapKV}


def make_cache(model, allocation="head", scorer="per_token", budget=0.3, **options):
    return KVPCache(
        model,
        method=SCORERS[scorer](),
        budget=budget,
        allocation=allocation,
        track_positions=True,
        **{**PROTECTED, **options},
    )


def head_counts(cache) -> list[list[int]]:
    return [list(layer.lengths) for layer in cache.evicting_layers]


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
@pytest.mark.parametrize("allocation", ["head", "layer"])
@pytest.mark.parametrize("scorer", list(SCORERS))
def test_generate_matches_the_per_head_reference(kind, allocation, scorer):
    model = tiny_model(kind)
    cache = make_cache(model, allocation, scorer)
    check_generate_against_reference(model, ids(length=48, seed=1), cache)
    assert all(isinstance(layer, RaggedLayer) for layer in cache.evicting_layers)
    assert model.config._attn_implementation == "eager"  # switched for the forward only


@pytest.mark.parametrize("allocation", ["head", "layer"])
def test_equal_totals_and_heads_that_differ(allocation):
    model = tiny_model("llama")
    prompt = ids(length=60, seed=2)
    uniform = KVPCache(model, method=PeakedNorm(), budget=0.3, **PROTECTED)
    adaptive = make_cache(model, allocation, min_per_head=6)
    for cache in (uniform, adaptive):
        model(prompt, **{cache_kwarg(model): cache})
    counts = head_counts(adaptive)
    per_head = uniform.evicting_layers[0].keys.shape[-2]
    assert per_head == 18  # ceil(0.3 * 60)
    assert sum(map(sum, counts)) == per_head * sum(map(len, counts))
    assert len({c for layer in counts for c in layer}) > 1, counts
    assert min(c for layer in counts for c in layer) >= 6
    if allocation == "layer":
        assert all(max(layer) - min(layer) <= 1 for layer in counts)  # an even split of the layer's count


def test_kv_bytes_are_the_allocated_entries():
    """Real memory: keys and values of the kept entries plus one validity byte and one float32 score
    per entry, nothing padded between heads."""
    model = tiny_model("llama")
    cache = make_cache(model, min_per_head=6)
    model(ids(length=60, seed=2), **{cache_kwarg(model): cache})
    layer = cache.evicting_layers[0]
    head_dim = layer.keys.shape[-1]
    per_entry = 2 * head_dim * 4 + 1 + 4 + 8  # fp32 keys and values, valid, score, tracked position
    entries = sum(map(sum, head_counts(cache)))
    seen_real = 8 * len(cache.evicting_layers)  # one int64 per row and layer
    assert cache.kv_bytes() == entries * per_entry + seen_real
    assert len({c for layer in head_counts(cache) for c in layer}) > 1


@pytest.mark.parametrize("scorer", list(SCORERS))
def test_left_padded_batch_matches_reference(scorer):
    model = tiny_model("llama")
    prompt = ids(batch=2, length=44, seed=3)
    mask = torch.ones_like(prompt)
    mask[1, :11] = 0
    check_generate_against_reference(model, prompt, make_cache(model, scorer=scorer), attention_mask=mask)


def test_chunked_prefill_matches_reference():
    model = tiny_model("llama")
    cache = make_cache(model, budget=0.25)
    recorder = ForwardRecorder(model, cache)
    sequences, logits = greedy(model, ids(length=64), cache, 4, prefill_chunk_size=16)
    recorder.remove()
    assert sum(s.length > 1 for s in recorder.snapshots) >= 4
    ref = reference_logits(model, sequences, recorder.snapshots)
    torch.testing.assert_close(logits, ref[:, 63:67], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("scorer", list(SCORERS))
def test_first_prefill_then_a_question_matches_reference(scorer):
    model = tiny_model("llama")
    cache = make_cache(model, scorer=scorer, compress="first_prefill")
    recorder = ForwardRecorder(model, cache)
    model(ids(length=40, seed=4), **{cache_kwarg(model): cache})
    counts = head_counts(cache)
    question = ids(length=7, seed=5)
    sequences, logits = greedy(model, torch.cat([ids(length=40, seed=4), question], -1), cache, 4)
    recorder.remove()
    assert [[c + 7 + 3 for c in layer] for layer in counts] == head_counts(cache)  # appended whole
    ref = reference_logits(model, sequences, recorder.snapshots)
    torch.testing.assert_close(logits, ref[:, 46:50], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("scorer", list(SCORERS))
def test_capped_decoding_matches_reference(scorer):
    model = tiny_model("llama")
    cache = make_cache(model, scorer=scorer, budget=0.5, max_cache_tokens=14, evict_every=3)
    check_generate_against_reference(model, ids(length=40, seed=6), cache, max_new_tokens=12)
    heads = sum(map(len, head_counts(cache)))
    assert sum(map(sum, head_counts(cache))) <= (14 + 3) * heads


def test_beam_search_scores_equal_teacher_forcing():
    model = tiny_model("llama")
    check_beams_against_teacher_forcing(
        model, ids(length=30), lambda: make_cache(model, budget=16, max_cache_tokens=12, evict_every=2), 6
    )


@pytest.mark.parametrize("allocation", ["head", "layer"])
def test_full_budget_is_token_identical_to_dynamic_cache(allocation):
    model = tiny_model("llama")
    prompt = ids(length=40, seed=7)
    ours, our_logits = greedy(model, prompt, make_cache(model, allocation, budget=1.0), 8)
    theirs, their_logits = greedy(model, prompt, DynamicCache(config=model.config), 8)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(our_logits, their_logits, atol=ATOL, rtol=1e-4)


def test_from_prefill_equals_compressing_in_the_forward():
    model = tiny_model("llama")
    prompt = ids(length=50, seed=8)
    direct = make_cache(model)
    model(prompt, **{cache_kwarg(model): direct})
    loaded = KVPCache.from_prefill(
        prefill(model, prompt),
        model,
        method=PeakedNorm(),
        budget=0.3,
        allocation="head",
        track_positions=True,
        **PROTECTED,
    )
    for mine, theirs in zip(loaded.evicting_layers, direct.evicting_layers, strict=True):
        for a, b in zip(mine.kept_positions(), theirs.kept_positions(), strict=True):
            assert torch.equal(a, b)


def test_crop_reorder_and_deepcopy():
    model = tiny_model("llama")
    cache = make_cache(model)
    greedy(model, ids(batch=2, length=30), cache, 4)
    copied = copy.deepcopy(cache)
    cache.crop(-2)
    assert [[c + 2 for c in layer] for layer in head_counts(cache)] == head_counts(copied)
    layer = cache.evicting_layers[0]
    before = layer.keys.clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.keys, before.flip(0))
    with pytest.raises(ValueError, match="cannot remove"):
        cache.crop(-10)


def test_bad_allocation_arguments_are_refused_early():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"allocation must be one of \('uniform', 'layer', 'head'\)"):
        KVPCache(model, method="knorm", allocation="global")
    with pytest.raises(ValueError, match="not comparable across heads.*allocation='uniform'"):
        KVPCache(model, method="knorm", allocation="head")
    with pytest.raises(ValueError, match="KVPCache\\(model, ...\\), not a config"):
        KVPCache(model.config, method=PeakedNorm(), allocation="head")
    with pytest.raises(ValueError, match=r"min_per_head \(20\) exceeds the per-head budget \(8\)"):
        KVPCache(model, method=PeakedNorm(), budget=8, allocation="head", min_per_head=20)
    with pytest.raises(ValueError, match="min_per_head must be an int >= 1"):
        KVPCache(model, method=PeakedNorm(), allocation="head", min_per_head=0)
    cache = make_cache(model, budget=0.1, min_per_head=9)  # 9 > ceil(0.1 * 40): known at the prefill
    with pytest.raises(ValueError, match=r"min_per_head \(9\) exceeds the per-head budget \(4 entries"):
        model(ids(length=40), **{cache_kwarg(model): cache})
    assert model.config._attn_implementation == "eager"  # restored after the failed forward
    config = Gemma2Config(**TINY_SHAPE, head_dim=16, attn_logit_softcapping=50.0)
    softcapped = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with pytest.raises(ValueError, match=r"cannot soft-cap .* gemma2 .*attn_logit_softcapping=50.0"):
        KVPCache(softcapped, method=PeakedNorm(), allocation="head")
    KVPCache(softcapped, method=PeakedNorm())  # uniform attends through the model's own attention


COMPARABLE = sorted(name for name, cls in SCORER_CLASSES.items() if cls.comparable_across_heads)
KVP_VARIANTS = {
    "kvp, rescore=True": {"rescore": True},  # each head scored again on its own entries at every eviction
    "kvp, age_decay=1.0": {"age_decay": 1.0},  # stored scores lowered by each entry's age
}


@pytest.mark.parametrize("method", [*COMPARABLE, *KVP_VARIANTS])
@pytest.mark.parametrize("allocation", ["head", "layer"])
def test_every_comparable_method_matches_the_reference(method, allocation):
    model = tiny_model("llama")
    options = {"window_size": 6} if method == "snapkv" else {}
    if method in KVP_VARIANTS:
        method, options = "kvp", KVP_VARIANTS[method]
    if method == "kvp":
        torch.manual_seed(0)
        options["policy"] = KVPolicy.for_model(model, hidden_dim=16, pos_dim=8, max_positions=64)
    cache = KVPCache(
        model, method=method, budget=0.3, allocation=allocation, track_positions=True, **PROTECTED, **options
    )
    check_generate_against_reference(model, ids(length=48, seed=9), cache, max_new_tokens=4)
    capped = KVPCache(
        model,
        method=method,
        budget=0.5,
        allocation=allocation,
        max_cache_tokens=14,
        evict_every=3,
        track_positions=True,
        **PROTECTED,
        **options,
    )
    check_generate_against_reference(model, ids(length=40, seed=10), capped, max_new_tokens=8)


def test_comparable_methods_include_the_learned_policy_and_attention_baselines():
    assert {"kvp", "snapkv", "tova", "h2o", "expected_attention"} <= set(COMPARABLE)
