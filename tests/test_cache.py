"""KVPCache semantics, each checked against the independent reference in tests/reference.py."""

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

from kvp_cache import KVPCache, available_methods
from kvp_cache.cache import EvictingLayer, take_slots
from kvp_cache.compat import cache_kwarg
from kvp_cache.prefill import prefill
from kvp_cache.scorers import SCORERS, Scorer, methods

KV_ONLY = ["knorm", "keydiff", "streaming_llm", "random", "lagkv"]
QUERY_AWARE = ["tova", "snapkv", "h2o", "expected_attention"]
SMALL_OPTIONS = {"lagkv": {"lag_size": 8}, "snapkv": {"window_size": 8}}


def make_cache(model, method="knorm", budget=20, **kwargs):
    return KVPCache(
        model, method=method, budget=budget, track_positions=True, **SMALL_OPTIONS.get(method, {}), **kwargs
    )


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
@pytest.mark.parametrize("method", ["knorm", "snapkv"])
def test_generate_matches_reference_on_every_family(kind, method):
    model = tiny_model(kind)
    cache = make_cache(model, method, budget=20)
    check_generate_against_reference(model, ids(length=48), cache)
    for layer in cache.layers:
        if isinstance(layer, EvictingLayer):
            assert layer.keys.shape[-2] == 20 + 5  # budget + decoded tokens (the last one is never fed)
        else:  # sliding layers keep their own window, untouched
            assert layer.keys.shape[-2] <= model.config.sliding_window
    assert cache.get_seq_length() == 48 + 5


@pytest.mark.parametrize("method", sorted(set(available_methods()) - {"kvp"}))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_every_method_matches_reference(method, attn):
    model = tiny_model("llama", attn_implementation=attn)
    cache = make_cache(model, method, budget=0.4)
    check_generate_against_reference(model, ids(length=50, seed=1), cache)


def test_kept_entries_stay_in_original_order():
    model = tiny_model("llama")
    cache = make_cache(model, "random", budget=16, sink_tokens=2, window_tokens=2)
    model(ids(length=40), **{cache_kwarg(model): cache})
    for layer in cache.evicting_layers:
        positions = layer.positions
        assert positions.shape[-1] == 16
        assert torch.all(positions[..., 1:] > positions[..., :-1])
        # the heads choose differently: eviction really is per head
        assert not torch.equal(positions[0, 0], positions[0, 1])


def test_sinks_and_window_always_kept():
    model = tiny_model("llama")
    cache = make_cache(model, "random", budget=24, sink_tokens=4, window_tokens=8)
    model(ids(length=64), **{cache_kwarg(model): cache})
    for layer in cache.evicting_layers:
        kept = set(layer.positions[0, 0].tolist())
        assert {0, 1, 2, 3} <= kept and set(range(56, 64)) <= kept


def test_direct_forward_uses_logical_positions():
    """A direct model(next_ids, cache=cache) gets RoPE positions from the logical length."""
    model = tiny_model("llama")
    cache = make_cache(model, "knorm", budget=12)
    recorder = ForwardRecorder(model, cache)
    prompt, continuation = ids(length=40), ids(length=5, seed=3)
    model(prompt, **{cache_kwarg(model): cache})
    observed = [model(continuation[:, i : i + 1], **{cache_kwarg(model): cache}).logits for i in range(5)]
    recorder.remove()
    assert cache.get_seq_length() == 45
    assert cache.get_mask_sizes(1, 0) == (12 + 5 + 1, 45 - 17)
    ref = reference_logits(model, torch.cat([prompt, continuation], -1), recorder.snapshots)
    torch.testing.assert_close(torch.cat(observed, 1).float(), ref[:, 40:], atol=ATOL, rtol=1e-4)


def test_generate_resumes_from_prefilled_cache():
    model = tiny_model("llama")
    prompt = ids(length=40)
    cache = make_cache(model, "knorm", budget=12)
    recorder = ForwardRecorder(model, cache)
    model(prompt[:, :-1], **{cache_kwarg(model): cache})
    sequences, logits = greedy(model, prompt, cache, 5)
    recorder.remove()
    assert [s.length for s in recorder.snapshots] == [39, 1, 1, 1, 1, 1]  # only the last prompt token re-fed
    ref = reference_logits(model, sequences, recorder.snapshots)
    torch.testing.assert_close(logits, ref[:, 39:44], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("budget", [12, 0.5])
@pytest.mark.parametrize("method", ["knorm", "snapkv", "h2o", "lagkv"])
def test_left_padded_batch_rows_match_alone(budget, method):
    model = tiny_model("llama")
    long, short = ids(length=40, seed=4), ids(length=28, seed=5)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 12, dtype=torch.long), short], -1)])
    mask = torch.ones_like(batch)
    mask[1, :12] = 0
    cache = make_cache(model, method, budget=budget)
    batched = check_generate_against_reference(model, batch, cache, attention_mask=mask)
    for layer in cache.evicting_layers:  # pads are never kept as valid entries
        kept = layer.positions[1][:, layer.valid[1]]
        assert (kept >= 12).all()
    for row, prompt in enumerate((long, short)):
        alone, _ = greedy(model, prompt, make_cache(model, method, budget=budget))
        assert torch.equal(batched[row, -6:], alone[0, -6:]), f"row {row} differs from its run alone"


def test_row_shorter_than_budget_keeps_all_its_tokens():
    model = tiny_model("llama")
    batch = ids(batch=2, length=30)
    mask = torch.ones_like(batch)
    mask[1, :24] = 0  # 6 real tokens, budget 16
    cache = make_cache(model, "knorm", budget=16)
    check_generate_against_reference(model, batch, cache, attention_mask=mask)
    assert cache.evicting_layers[0].valid[1].sum() == 6 + 5


@pytest.mark.parametrize("method", ["knorm", "tova"])
def test_beam_search_and_return_sequences(method):
    model = tiny_model("llama")
    check_beams_against_teacher_forcing(
        model, ids(length=40), lambda: make_cache(model, method, budget=16), 5
    )


def test_full_budget_is_token_identical_to_dynamic_cache_for_every_method():
    model = tiny_model("llama", attn_implementation="sdpa")
    prompt = ids(length=40)
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False)
    for method in sorted(set(available_methods()) - {"kvp"}):
        for budget in (1.0, 40, 100):
            out = model.generate(
                prompt,
                **{cache_kwarg(model): make_cache(model, method, budget)},
                max_new_tokens=8,
                do_sample=False,
            )
            assert torch.equal(out, expected), (method, budget)


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_physical_length_is_the_budget_after_prefill(kind):
    model = tiny_model(kind)
    for budget, expected in ((0.25, 15), (10, 10)):
        cache = make_cache(model, "keydiff", budget=budget)
        model(ids(length=60), **{cache_kwarg(model): cache})
        assert cache.evicting_layers, "every family has full-attention layers"
        for layer in cache.evicting_layers:
            assert layer.keys.shape[-2] == layer.values.shape[-2] == expected


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_prefill_in_chunks_equals_one_forward(kind):
    """kvp_cache.prefill in chunks (chunks longer and shorter than Gemma's sliding window of 16) keeps
    the one-forward cache, queries and logits, so every method compresses it to the same entries."""
    model = tiny_model(kind, attn_implementation="sdpa")
    prompt = ids(length=70, seed=3)
    mask = torch.ones_like(prompt)
    whole = prefill(model, prompt, mask)
    for chunk in (7, 32):
        parts = prefill(model, prompt, mask, chunk_tokens=chunk)
        torch.testing.assert_close(parts.next_token_logits, whole.next_token_logits, atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(parts.cache.layers, whole.cache.layers, strict=True):
            torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)
        assert parts.queries.keys() == whole.queries.keys() and whole.queries
        for layer, states in whole.queries.items():
            assert parts.queries[layer].queries.shape[-2] == 70
            for name in ("queries", "pre_rope_queries", "rope_step", "last_cos", "last_sin"):
                torch.testing.assert_close(
                    getattr(parts.queries[layer], name), getattr(states, name), atol=1e-5, rtol=1e-5
                )
        for method in ("snapkv", "expected_attention", "knorm"):
            mine, theirs = (
                KVPCache.from_prefill(state, model, method=method, budget=0.25).evicting_layers[0].keys
                for state in (parts, whole)
            )
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5, msg=method)


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True])
def test_bad_prefill_chunk_is_refused(chunk):
    with pytest.raises(ValueError, match="chunk_tokens must be an int >= 1"):
        prefill(tiny_model("llama"), ids(length=10), chunk_tokens=chunk)


def test_empty_prompt_is_refused_before_the_model_runs():
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\] with seq >= 1"):
        prefill(tiny_model("llama"), torch.zeros(1, 0, dtype=torch.long))


def test_chunked_prefill_compresses_to_budget_and_matches_reference():
    model = tiny_model("llama")
    cache = make_cache(model, "knorm", budget=0.25)
    prompt = ids(length=64)
    check_generate_against_reference(model, prompt, cache, max_new_tokens=4)  # warm: single prefill
    cache = make_cache(model, "knorm", budget=0.25)
    recorder = ForwardRecorder(model, cache)
    sequences, logits = greedy(model, prompt, cache, 4, prefill_chunk_size=16)
    recorder.remove()
    lengths = [s.length for s in recorder.snapshots]
    assert max(lengths) <= 16 and sum(n > 1 for n in lengths) >= 4  # the prompt really came in chunks
    ref = reference_logits(model, sequences, recorder.snapshots)
    torch.testing.assert_close(logits, ref[:, 63:67], atol=ATOL, rtol=1e-4)
    assert 16 <= cache.evicting_layers[0].keys.shape[-2] <= 16 + 4  # ~ceil(0.25 * 64) + decoded


def test_multi_turn_second_generate_continues_correctly():
    model = tiny_model("llama")
    cache = make_cache(model, "knorm", budget=0.5)
    recorder = ForwardRecorder(model, cache)
    turn1 = ids(length=40)
    first, _ = greedy(model, turn1, cache, 5)
    conversation = torch.cat([first, ids(length=12, seed=7)], -1)
    second, logits = greedy(model, conversation, cache, 5)
    recorder.remove()
    assert recorder.snapshots[-5].length == 12 + 1  # the last answer token and the new turn, nothing re-fed
    ref = reference_logits(model, second, recorder.snapshots)
    start = conversation.shape[1] - 1
    torch.testing.assert_close(logits, ref[:, start : start + 5], atol=ATOL, rtol=1e-4)
    assert cache.evicting_layers[0].keys.shape[-2] == -(-(conversation.shape[1] - 1) // 2) + 4 + 1


def test_reset_crop_reorder_and_batch_methods_keep_metadata_consistent():
    model = tiny_model("llama")
    cache = make_cache(model, "knorm", budget=10)
    model(ids(batch=2, length=30), **{cache_kwarg(model): cache})
    for t in range(3):
        model(ids(batch=2, length=1, seed=t), **{cache_kwarg(model): cache})
    layer = cache.evicting_layers[0]

    def consistent():
        n = layer.keys.shape[-2]
        assert layer.values.shape[-2] == layer.valid.shape[-1] == layer.positions.shape[-1] == n
        assert (
            layer.keys.shape[0]
            == layer.valid.shape[0]
            == layer.seen_real.shape[0]
            == layer.positions.shape[0]
        )

    cache.crop(-2)
    consistent()
    assert cache.get_seq_length() == 31 and layer.keys.shape[-2] == 11
    with pytest.raises(ValueError, match="crop"):
        cache.crop(-5)  # only decoded tokens can be cropped back
    before = layer.keys.clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    consistent()
    assert torch.equal(layer.keys[0], before[1])
    cache.batch_repeat_interleave(2)
    consistent()
    assert layer.keys.shape[0] == 4
    cache.batch_select_indices(torch.tensor([0, 3]))
    consistent()
    assert layer.keys.shape[0] == 2
    cache.reset()
    assert cache.get_seq_length() == 0 and not layer.is_initialized
    model(ids(batch=1, length=30), **{cache_kwarg(model): cache})  # reusable after reset
    consistent()
    assert layer.keys.shape[-2] == 10


@torch.no_grad()
def test_deepcopy_is_independent_and_usable():
    model = tiny_model("llama")
    cache = make_cache(model, "snapkv", budget=10)
    model(ids(length=30), **{cache_kwarg(model): cache})
    clone = copy.deepcopy(cache)
    token = ids(length=1, seed=9)
    a = model(token, **{cache_kwarg(model): cache}).logits
    b = model(token, **{cache_kwarg(model): clone}).logits
    torch.testing.assert_close(a, b)
    assert cache.evicting_layers[0].keys is not clone.evicting_layers[0].keys
    assert clone.settings.scorer is cache.settings.scorer


def test_config_built_cache_works_for_key_value_methods():
    model = tiny_model("llama")
    cache = KVPCache(model.config, method="knorm", budget=10, track_positions=True)
    check_generate_against_reference(model, ids(length=30), cache)


def test_bfloat16_model_keeps_dtype():
    model = tiny_model("llama").to(torch.bfloat16)
    cache = make_cache(model, "expected_attention", budget=10)
    out = model.generate(ids(length=30), **{cache_kwarg(model): cache}, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 33)
    assert cache.evicting_layers[0].keys.dtype == torch.bfloat16


def test_kv_bytes_is_budget_times_full_plus_small_metadata():
    model = tiny_model("llama")
    prompt = ids(length=400, vocab=256)
    full = DynamicCache(config=model.config)
    model(prompt, **{cache_kwarg(model): full})
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    cache = KVPCache(model, method="knorm", budget=0.25)
    model(prompt, **{cache_kwarg(model): cache})
    assert 0.25 * full_bytes <= cache.kv_bytes() <= 0.25 * full_bytes * 1.01


def test_hooks_are_removed_when_cache_is_collected():
    import gc

    model = tiny_model("llama")
    decoder = model.get_decoder()
    attention = model.model.layers[0].self_attn
    before = (len(decoder._forward_pre_hooks), len(decoder._forward_hooks))
    cache = make_cache(model, "snapkv", budget=10)
    model(ids(length=30), **{cache_kwarg(model): cache})
    assert len(attention._forward_pre_hooks) == 0, "query capture is removed after the forward"
    del cache
    gc.collect()
    assert (len(decoder._forward_pre_hooks), len(decoder._forward_hooks)) == before


def test_registry_describes_its_methods():
    assert methods() == available_methods() == sorted(SCORERS)
    assert set(methods(query_aware=True)) == set(QUERY_AWARE)
    assert set(methods(query_aware=False)) == set(KV_ONLY) | {"kvp"}
    assert methods(learned=True) == ["kvp"]
    assert methods(query_aware=False, learned=False) == sorted(KV_ONLY)


class OldestFirst(Scorer):
    """An unregistered scorer (as an evaluation oracle would be): keep the earliest tokens."""

    def score(self, keys, values, positions, queries=None, layer_idx=0):
        return -positions.float()[:, None, :].expand(keys.shape[:3])


def test_cache_accepts_an_unregistered_scorer_instance():
    model = tiny_model("llama")
    cache = KVPCache(model, OldestFirst(), budget=12, sink_tokens=0, window_tokens=0, track_positions=True)
    check_generate_against_reference(model, ids(length=30), cache)
    assert cache.evicting_layers[0].positions[0, 0, :12].tolist() == list(range(12))
    assert cache.method == "OldestFirst" and "OldestFirst" not in methods()


def test_take_slots_is_a_gather_along_the_slot_axis():
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(2, 10, 3, 4, generator=generator).transpose(1, 2)  # not contiguous
    index = torch.randint(0, 10, (2, 3, 5), generator=generator)
    assert torch.equal(take_slots(states, index), states.gather(2, index[..., None].expand(-1, -1, -1, 4)))
    packed, rows = states[:, 0], index[:, 0]  # a ragged layer's [batch, slots, head_dim]
    assert torch.equal(take_slots(packed, rows), packed.gather(1, rows[..., None].expand(-1, -1, 4)))
    assert take_slots(states, index[..., :0]).shape == (2, 3, 0, 4)
