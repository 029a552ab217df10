"""Eviction schedules: compress="first_prefill", max_cache_tokens/evict_every, against the reference."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_CONFIGS, tiny_model
from reference import (
    ATOL,
    ForwardRecorder,
    check_beams_against_teacher_forcing,
    check_generate_against_reference,
    greedy,
    ids,
    reference_logits,
)
from transformers import DynamicCache

from kvp_cache import KVPCache, KVPolicy
from kvp_cache.compat import cache_kwarg
from kvp_cache.integrations import forward_tokens
from kvp_cache.prefill import prefill
from kvp_cache.scorers import Scorer, methods

SMALL_OPTIONS = {"snapkv": {"window_size": 8}}
CAPPED = sorted(set(methods()) - {"lagkv"})  # lagkv cannot rank decoded tokens


def make_cache(model, method="knorm", budget=20, **kwargs):
    """A cache of ``method``; ``kvp`` gets an untrained policy shaped for the model (same code path)."""
    options = {"sink_tokens": 2, "window_tokens": 2, **SMALL_OPTIONS.get(method, {}), **kwargs}
    if method == "kvp":
        torch.manual_seed(0)
        options["policy"] = KVPolicy.for_model(model, hidden_dim=16, pos_dim=8, max_positions=64)
    return KVPCache(model, method=method, budget=budget, track_positions=True, **options)


def physical(cache) -> int:
    return cache.evicting_layers[0].physical_length()


# ---------------------------------------------------------------------------------------------
# compress="first_prefill": compress the document once, then append questions and answers whole.


@pytest.mark.parametrize("method", ["knorm", "snapkv", "h2o", "kvp"])
def test_first_prefill_question_and_answer_see_compressed_context_and_themselves(method):
    model = tiny_model("llama")
    context, question = ids(length=40), ids(length=10, seed=1)
    cache = make_cache(model, method, budget=12, compress="first_prefill")
    recorder = ForwardRecorder(model, cache)
    model(context, **{cache_kwarg(model): cache})
    assert physical(cache) == 12
    prompt = torch.cat([context, question], -1)
    sequences, logits = greedy(model, prompt, cache, 5)
    recorder.remove()
    assert [s.length for s in recorder.snapshots] == [40, 10, 1, 1, 1, 1]  # the question in one forward
    assert physical(cache) == 12 + 10 + 4  # nothing evicted after the first prefill
    ref = reference_logits(model, sequences, recorder.snapshots)
    torch.testing.assert_close(logits, ref[:, 49:54], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_first_prefill_equals_feeding_the_question_token_by_token(kind):
    """The old protocol (every_prefill, question fed one token at a time) gives the same logits."""
    model = tiny_model(kind)
    context, question = ids(length=40), ids(length=9, seed=2)
    once = make_cache(model, "knorm", budget=12, compress="first_prefill")
    forward_tokens(model, once, context)
    got = forward_tokens(model, once, question)
    by_token = make_cache(model, "knorm", budget=12)
    forward_tokens(model, by_token, context)
    expected = torch.cat([forward_tokens(model, by_token, question[:, t : t + 1]) for t in range(9)], 1)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)


@torch.no_grad()
def test_first_prefill_deepcopy_serves_many_questions():
    model = tiny_model("llama")
    context = ids(length=40)
    cache = make_cache(model, "snapkv", budget=12, compress="first_prefill")
    model(context, **{cache_kwarg(model): cache})
    for seed in (3, 4):
        prompt = torch.cat([context, ids(length=8, seed=seed)], -1)
        own = copy.deepcopy(cache)
        got = model.generate(prompt, **{cache_kwarg(model): own}, max_new_tokens=5, do_sample=False)
        fresh = make_cache(model, "snapkv", budget=12, compress="first_prefill")
        model(context, **{cache_kwarg(model): fresh})
        expected = model.generate(prompt, **{cache_kwarg(model): fresh}, max_new_tokens=5, do_sample=False)
        assert torch.equal(got, expected)
    assert physical(cache) == 12 and cache.get_seq_length() == 40  # the original is untouched


def test_every_prefill_still_evicts_the_question():
    model = tiny_model("llama")
    cache = make_cache(model, "knorm", budget=12)
    model(ids(length=40), **{cache_kwarg(model): cache})
    model(ids(length=10, seed=1), **{cache_kwarg(model): cache})
    assert physical(cache) == 12


# ---------------------------------------------------------------------------------------------
# max_cache_tokens: bounded memory while decoding.


@pytest.mark.parametrize("method", CAPPED)
def test_capped_decoding_matches_masked_reference_at_every_step(method):
    model = tiny_model("llama")
    cache = make_cache(
        model, method, budget=1.0, max_cache_tokens=16, evict_every=4, sink_tokens=2, window_tokens=4
    )
    recorder = ForwardRecorder(model, cache)
    held = []
    hook = model.get_decoder().register_forward_hook(lambda *_: held.append(physical(cache)))
    prompt = ids(length=24)
    sequences, logits = greedy(model, prompt, cache, 20)
    recorder.remove()
    hook.remove()
    ref = reference_logits(model, sequences, recorder.snapshots)
    torch.testing.assert_close(logits, ref[:, 23:43], atol=ATOL, rtol=1e-4)
    assert max(held) <= 16 + 4 and held.count(16) >= 3  # the prompt was trimmed, then decoding was, again
    for snapshot in recorder.snapshots[1:]:
        positions = snapshot.kept[0][0]
        assert torch.all(positions[..., 1:] > positions[..., :-1])  # kept entries stay in order
        assert {0, 1} <= set(positions[0, 0].tolist())  # sinks stay
        recent = range(snapshot.start - 4, snapshot.start)
        assert set(recent) <= set(positions[0, 0].tolist())  # so does the recent window


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_capped_decoding_on_every_family(kind):
    model = tiny_model(kind)
    cache = make_cache(model, "kvp", budget=20, max_cache_tokens=12, evict_every=3)
    check_generate_against_reference(model, ids(length=40), cache, max_new_tokens=12)
    assert physical(cache) <= 12 + 3


@pytest.mark.parametrize("method", CAPPED)
def test_cap_above_total_length_is_token_identical_to_dynamic_cache(method):
    model = tiny_model("llama", attn_implementation="sdpa")
    prompt = ids(length=30)
    expected = model.generate(
        prompt, **{cache_kwarg(model): DynamicCache(config=model.config)}, max_new_tokens=10
    )
    cache = make_cache(model, method, budget=1.0, max_cache_tokens=40, evict_every=1)
    assert torch.equal(
        model.generate(prompt, **{cache_kwarg(model): cache}, max_new_tokens=10, do_sample=False), expected
    )


def test_budget_then_cap_with_first_prefill_and_a_question():
    model = tiny_model("llama")
    cache = make_cache(
        model, "snapkv", budget=20, compress="first_prefill", max_cache_tokens=16, evict_every=8
    )
    recorder = ForwardRecorder(model, cache)
    context = ids(length=40)
    model(context, **{cache_kwarg(model): cache})
    assert physical(cache) == 20  # the budget; within max_cache_tokens + evict_every
    prompt = torch.cat([context, ids(length=6, seed=5)], -1)
    sequences, logits = greedy(model, prompt, cache, 8)
    recorder.remove()
    assert physical(cache) <= 16 + 8
    ref = reference_logits(model, sequences, recorder.snapshots)
    torch.testing.assert_close(logits, ref[:, 45:53], atol=ATOL, rtol=1e-4)


class CountingScorer(Scorer):
    """A per-token scorer (as kvp is) that records the positions it is asked to score in layer 0."""

    per_token = True

    def __init__(self):
        self.scored: list[int] = []

    def score(self, keys, values, positions, queries=None, layer_idx=0):
        if layer_idx == 0:
            self.scored += positions.flatten().tolist()
        return -keys.float().norm(dim=-1)


def test_per_token_scores_are_computed_once_and_kept():
    model = tiny_model("llama")
    scorer = CountingScorer()
    options = dict(budget=0.5, max_cache_tokens=10, evict_every=2, sink_tokens=2, window_tokens=2)
    cache = KVPCache(model, scorer, track_positions=True, **options)
    check_generate_against_reference(model, ids(length=30), cache, max_new_tokens=12)
    assert sorted(scorer.scored) == sorted(set(scorer.scored))  # no token is scored twice
    assert set(range(30)) <= set(scorer.scored) <= set(range(30 + 11))
    layer = cache.evicting_layers[0]
    waiting = layer.scores[0, 0].isnan()  # decoded since the last eviction, not needed yet
    assert waiting.any() and not set(layer.positions[0, 0, waiting].tolist()) & set(scorer.scored)
    kept = layer.scores[..., ~waiting]
    torch.testing.assert_close(
        kept, -layer.keys[..., ~waiting, :].float().norm(dim=-1)
    )  # kept with their entries


def test_kvp_stored_scores_are_the_policy_scores_at_entry():
    model = tiny_model("llama")
    cache = make_cache(model, "kvp", budget=8, max_cache_tokens=8, evict_every=2)
    model.generate(ids(length=20), **{cache_kwarg(model): cache}, max_new_tokens=8, do_sample=False)
    policy = cache.settings.scorer.policy  # "clamp" positions: a token's score depends on itself alone
    for layer in cache.evicting_layers:
        assert layer.positions.max() >= 20  # decoded tokens are among the kept ones
        for i in range(layer.physical_length()):
            if layer.scores[0, 0, i].isnan():
                continue  # decoded after the last eviction: not scored yet
            entry = (layer.keys[..., i : i + 1, :], layer.values[..., i : i + 1, :])
            for head in range(layer.keys.shape[1]):
                position = layer.positions[:, head, i : i + 1]  # no padding: the logical position
                alone = policy(layer.layer_idx, *entry, position)[:, head]
                torch.testing.assert_close(layer.scores[:, head, i : i + 1], alone.float())


def test_kvp_rescore_scores_every_held_entry_at_each_eviction():
    model = tiny_model("llama")
    cache = make_cache(model, "kvp", budget=1.0, max_cache_tokens=12, evict_every=3, rescore=True)
    scorer, calls = cache.settings.scorer, []
    score = scorer.score

    def recording(keys, values, positions, queries=None, layer_idx=0):
        if layer_idx == 0:
            calls.append(positions[0].tolist())
        return score(keys, values, positions, queries, layer_idx)

    scorer.score = recording
    check_generate_against_reference(model, ids(length=30), cache, max_new_tokens=13)
    assert cache.evicting_layers[0].scores is None  # nothing stored: every eviction scores anew
    assert calls[0] == list(range(30))  # the prefill
    assert calls[1:] == [list(range(16))] * 3  # then 12 held + 4 decoded, each at its index among them


@pytest.mark.parametrize("allocation", ["uniform", "head"])
def test_kvp_rescore_keeps_the_same_entries_after_a_single_prefill(allocation):
    model = tiny_model("llama")
    kept = []
    for rescore in (False, True):
        cache = make_cache(model, "kvp", budget=0.4, allocation=allocation, rescore=rescore)
        model(ids(length=40), **{cache_kwarg(model): cache})
        kept.append([layer.kept_positions() for layer in cache.evicting_layers])
    for (positions, valid), (positions_rescored, valid_rescored) in zip(*kept, strict=True):
        assert torch.equal(positions, positions_rescored) and torch.equal(valid, valid_rescored)


@pytest.mark.parametrize("allocation", ["uniform", "head"])
def test_kvp_age_decay_keeps_the_same_entries_after_a_single_prefill(allocation):
    """Every entry of one prefill entered with the same forward: its age is 0, so nothing changes."""
    model = tiny_model("llama")
    kept = []
    for decay in (0.0, 5.0):
        cache = make_cache(model, "kvp", budget=0.4, allocation=allocation, age_decay=decay)
        model(ids(length=40), **{cache_kwarg(model): cache})
        kept.append([layer.kept_positions() for layer in cache.evicting_layers])
        assert all((layer.entered is None) == (decay == 0) for layer in cache.evicting_layers)
    for (positions, valid), (positions_decayed, valid_decayed) in zip(*kept, strict=True):
        assert torch.equal(positions, positions_decayed) and torch.equal(valid, valid_decayed)


def test_kvp_age_decay_ranks_by_score_minus_log_age():
    """Under a cap, each eviction ranks ``score - decay * log2(1 + age)``: a decay far above the
    scores' spread keeps the sinks and the newest tokens, as StreamingLLM does."""
    model = tiny_model("llama")
    kept = {}
    for decay in (0.0, 1e4):
        cache = make_cache(model, "kvp", budget=1.0, max_cache_tokens=12, evict_every=3, age_decay=decay)
        check_generate_against_reference(model, ids(length=30), cache, max_new_tokens=13)
        kept[decay] = {heads for layer in cache.evicting_layers for heads in kept_per_head(layer)}
    newest = (0, 1, *range(42 - 10, 42))  # 2 sinks, the last 10 of 30 + 12 read (the 13th is never read)
    assert kept[1e4] == {newest}
    assert kept[0.0] != {newest}


def test_kvp_age_decay_lowers_old_entries_in_an_adaptive_allocation():
    """The ragged layers rank the decayed scores too. Their cross-head values are a softmax per head,
    where a huge decay would underflow every old entry to the same 0, so this decay is moderate."""
    model = tiny_model("llama")
    mean_position = {}
    for decay in (0.0, 4.0):
        cache = make_cache(
            model, "kvp", budget=1.0, max_cache_tokens=12, evict_every=3, allocation="head", age_decay=decay
        )
        check_generate_against_reference(model, ids(length=30), cache, max_new_tokens=13)
        positions = [
            p for layer in cache.evicting_layers for heads in kept_per_head(layer) for p in heads[2:-2]
        ]
        mean_position[decay] = sum(positions) / len(positions)  # past the 2 sinks, before the 2-token window
    assert mean_position[4.0] > mean_position[0.0] + 5


def kept_per_head(layer) -> list[tuple[int, ...]]:
    """The sorted logical positions each head of batch row 0 keeps."""
    positions, valid = layer.kept_positions()
    valid = valid if valid.dim() == 3 else valid[:, None].expand_as(positions)
    return [tuple(sorted(positions[0, h][valid[0, h]].tolist())) for h in range(positions.shape[1])]


# ---------------------------------------------------------------------------------------------
# Batches, padding, beams, crop, reset, deepcopy, from_prefill.


@pytest.mark.parametrize("method", ["knorm", "snapkv", "kvp"])
def test_capped_left_padded_batch_rows_match_alone(method):
    model = tiny_model("llama")
    long, short = ids(length=30, seed=4), ids(length=20, seed=5)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 10, dtype=torch.long), short], -1)])
    mask = torch.ones_like(batch)
    mask[1, :10] = 0
    options = dict(budget=0.5, max_cache_tokens=12, evict_every=3)
    cache = make_cache(model, method, **options)
    batched = check_generate_against_reference(model, batch, cache, attention_mask=mask, max_new_tokens=10)
    for row, prompt in enumerate((long, short)):
        alone, _ = greedy(model, prompt, make_cache(model, method, **options), 10)
        new = alone[0, prompt.shape[1] :]  # shorter than 10 when it hit EOS
        assert torch.equal(batched[row, 30 : 30 + len(new)], new), f"row {row} differs from its run alone"


@pytest.mark.parametrize("method", ["knorm", "tova", "kvp"])
def test_capped_beam_search_scores_equal_teacher_forcing(method):
    model = tiny_model("llama")
    options = dict(budget=16, max_cache_tokens=12, evict_every=2)
    check_beams_against_teacher_forcing(
        model, ids(length=30), lambda: make_cache(model, method, **options), 8
    )


@torch.no_grad()
@pytest.mark.parametrize("method", ["snapkv", "kvp", "h2o"])
def test_crop_of_tokens_since_the_last_eviction(method):
    model = tiny_model("llama")
    decoded, later = ids(length=4, seed=6), ids(length=6, seed=7)
    options = dict(budget=16, max_cache_tokens=16, evict_every=4)
    cropped, straight = make_cache(model, method, **options), make_cache(model, method, **options)
    for cache, tokens in ((cropped, decoded), (straight, decoded[:, :2])):
        model(ids(length=30), **{cache_kwarg(model): cache})
        for t in range(tokens.shape[1]):
            model(tokens[:, t : t + 1], **{cache_kwarg(model): cache})
    cropped.crop(-2)  # back to the state after two decoded tokens
    logits = {}
    for name, cache in (("cropped", cropped), ("straight", straight)):
        # decoding on triggers the cap: it must rank with what survived the crop (scores, queries)
        logits[name] = torch.cat(
            [model(t.view(1, 1), **{cache_kwarg(model): cache}).logits for t in later[0]]
        )
        assert cache.evicting_layers[0].appended_since_eviction < 6
    torch.testing.assert_close(logits["cropped"], logits["straight"])
    assert cropped.evicting_layers[0].positions.tolist() == straight.evicting_layers[0].positions.tolist()
    with pytest.raises(ValueError, match="crop"):
        cropped.crop(-(cropped.evicting_layers[0].appended_since_eviction + 1))


@torch.no_grad()
def test_reset_and_deepcopy_keep_the_schedule():
    model = tiny_model("llama")
    options = dict(budget=0.5, compress="first_prefill", max_cache_tokens=10, evict_every=2)
    cache = make_cache(model, "kvp", **options)
    prompt = ids(length=30)
    first = model.generate(prompt, **{cache_kwarg(model): cache}, max_new_tokens=8, do_sample=False)
    cache.reset()
    assert cache.get_seq_length() == 0 and not cache.evicting_layers[0].compressed
    again = model.generate(prompt, **{cache_kwarg(model): cache}, max_new_tokens=8, do_sample=False)
    assert torch.equal(first, again)
    clone = copy.deepcopy(cache)
    token = ids(length=1, seed=9)
    torch.testing.assert_close(
        model(token, **{cache_kwarg(model): cache}).logits, model(token, **{cache_kwarg(model): clone}).logits
    )
    assert (
        clone.settings == cache.settings
        and clone.evicting_layers[0].scores is not cache.evicting_layers[0].scores
    )


@pytest.mark.parametrize("method", ["knorm", "snapkv", "kvp"])
def test_from_prefill_follows_the_schedule(method):
    model = tiny_model("llama")
    prompt = ids(length=40)
    options = dict(
        budget=16,
        compress="first_prefill",
        max_cache_tokens=12,
        evict_every=3,
        sink_tokens=2,
        window_tokens=2,
    )
    direct = make_cache(model, method, **options)
    model(prompt[:, :-1], **{cache_kwarg(model): direct})
    scorer = direct.settings.scorer  # shared: the same (possibly random) policy
    built = KVPCache.from_prefill(
        prefill(model, prompt[:, :-1]), model, method=scorer, track_positions=True, **options
    )
    assert built.evicting_layers[0].compressed
    a = model.generate(prompt, **{cache_kwarg(model): built}, max_new_tokens=10, do_sample=False)
    b = model.generate(prompt, **{cache_kwarg(model): direct}, max_new_tokens=10, do_sample=False)
    assert torch.equal(a, b)
    assert built.evicting_layers[0].positions.tolist() == direct.evicting_layers[0].positions.tolist()
