"""Bad input gets a clear, early error naming the parameter and the allowed range."""

import pytest
import torch
from conftest import tiny_model
from transformers import BertConfig, LlamaConfig, T5Config

from kvp_cache import KVPCache, KVPolicy, make_scorer, validate_budget
from kvp_cache.compat import cache_kwarg


@pytest.mark.parametrize(
    "budget, error, match",
    [
        (0, ValueError, r"int .* >= 1"),
        (-3, ValueError, r">= 1"),
        (0.0, ValueError, r"\(0, 1\]"),
        (-0.5, ValueError, r"\(0, 1\]"),
        (1.5, ValueError, r"\(0, 1\]"),
        (float("nan"), ValueError, r"\(0, 1\]"),
        ("0.5", TypeError, "budget must be"),
        (None, TypeError, "budget must be"),
        (True, TypeError, "budget must be"),
    ],
)
def test_bad_budgets(budget, error, match):
    with pytest.raises(error, match=match):
        validate_budget(budget)
    with pytest.raises(error, match=match):
        KVPCache(tiny_model("llama"), budget=budget)


def test_good_budgets():
    assert validate_budget(1) == 1 and validate_budget(1.0) == 1.0 and validate_budget(0.25) == 0.25


def test_unknown_method_lists_available_ones():
    with pytest.raises(ValueError, match="available methods: .*knorm.*snapkv"):
        KVPCache(tiny_model("llama"), method="nope")


def test_unknown_method_option_lists_the_options():
    with pytest.raises(TypeError, match="window_size"):
        make_scorer("snapkv", windw_size=3)


def test_kvp_rescore_must_be_a_bool():
    model = tiny_model("llama")
    policy = KVPolicy.for_model(model, hidden_dim=8, pos_dim=4, max_positions=32)
    with pytest.raises(TypeError, match="rescore must be True or False, got 'yes'"):
        KVPCache(model, method="kvp", policy=policy, rescore="yes")


@pytest.mark.parametrize(
    "decay, error, message",
    [
        ("1", TypeError, "age_decay must be a number >= 0, got '1'"),
        (True, TypeError, "age_decay must be a number >= 0, got True"),
        (-0.5, ValueError, r"age_decay must be a finite number >= 0 \(0: no decay\), got -0.5"),
        (float("inf"), ValueError, "age_decay must be a finite number >= 0 .* got inf"),
    ],
)
def test_kvp_age_decay_must_be_a_finite_number_at_least_0(decay, error, message):
    """Checked in the cache's option, the policy's argument and its setter alike."""
    model = tiny_model("llama")
    policy = KVPolicy.for_model(model, hidden_dim=8, pos_dim=4, max_positions=32)
    with pytest.raises(error, match=message):
        KVPCache(model, method="kvp", policy=policy, age_decay=decay)
    with pytest.raises(error, match=message):
        KVPolicy.for_model(model, hidden_dim=8, pos_dim=4, max_positions=32, age_decay=decay)
    with pytest.raises(error, match=message):
        policy.age_decay = decay
    assert policy.age_decay == 0.0


def test_scorer_instance_takes_no_options():
    with pytest.raises(TypeError, match="set its options on it"):
        KVPCache(tiny_model("llama"), method=make_scorer("snapkv"), window_size=3)
    with pytest.raises(TypeError, match="method name or a Scorer instance"):
        KVPCache(tiny_model("llama"), method=3)


@pytest.mark.parametrize("name, value", [("sink_tokens", -1), ("window_tokens", 2.5), ("sink_tokens", "4")])
def test_bad_protection_counts(name, value):
    with pytest.raises(ValueError, match=name):
        KVPCache(tiny_model("llama"), **{name: value})


@pytest.mark.parametrize(
    "config, match",
    [
        (
            BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32),
            "decoder-only",
        ),
        (T5Config(d_model=32, num_layers=1, num_heads=2), "encoder-decoder"),
    ],
)
def test_not_a_decoder_lm(config, match):
    with pytest.raises(ValueError, match=match):
        KVPCache(config)


def test_not_a_model_or_config():
    with pytest.raises(TypeError, match="model or its config"):
        KVPCache("meta-llama/Llama-3.1-8B")


def test_query_aware_method_needs_the_model():
    with pytest.raises(ValueError, match="needs the prefill queries"):
        KVPCache(tiny_model("llama").config, method="snapkv")


def test_cache_passed_to_another_model_instance():
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    cache = KVPCache(model, budget=8)
    with pytest.raises(RuntimeError, match="built for another model"):
        other(torch.randint(0, 256, (1, 20)), **{cache_kwarg(other): cache})


def test_cache_from_config_of_another_architecture():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2)
    cache = KVPCache(config, budget=8)
    with pytest.raises(ValueError, match="built for 4 KV heads"):
        model = tiny_model("llama")
        model(torch.randint(0, 256, (1, 20)), **{cache_kwarg(model): cache})


def test_unsupported_transformers_version():
    from kvp_cache.compat import check_transformers_version

    with pytest.raises(ImportError, match="supports transformers"):
        check_transformers_version("4.40.0")
    with pytest.raises(ImportError, match="supports transformers"):
        check_transformers_version("6.0.0")
    check_transformers_version("5.24.0")


@pytest.mark.parametrize(
    "options, match",
    [
        ({"compress": "every_forward"}, r"compress must be one of \('every_prefill', 'first_prefill'\)"),
        ({"compress": None}, "compress must be one of"),
        ({"evict_every": 0}, r"evict_every must be an int >= 1, got 0"),
        ({"evict_every": 2.5}, r"evict_every must be an int >= 1"),
        ({"evict_every": True}, r"evict_every must be an int >= 1"),
        (
            {"max_cache_tokens": 19},
            r"max_cache_tokens \(at least sink_tokens \+ window_tokens = 4 \+ 16\).*>= 20, got 19",
        ),
        ({"max_cache_tokens": 0, "sink_tokens": 0, "window_tokens": 0}, r"max_cache_tokens .*>= 1, got 0"),
        ({"max_cache_tokens": "512"}, r"max_cache_tokens .*must be an int"),
        (
            {"max_cache_tokens": 64, "method": "lagkv"},
            r"max_cache_tokens needs a method that can rank decoded.*'lagkv'",
        ),
    ],
)
def test_bad_schedules(options, match):
    with pytest.raises(ValueError, match=match):
        KVPCache(tiny_model("llama"), **options)


def test_good_schedules():
    model = tiny_model("llama")
    KVPCache(model, compress="first_prefill", max_cache_tokens=20, evict_every=1)
    KVPCache(model, method="lagkv", compress="first_prefill")


@pytest.mark.parametrize(
    "device, match",
    [("gpu0", "must be a torch device"), ("cuda:99", "CUDA device"), (3.5, "must be a torch")],
)
def test_bad_device_is_refused_before_loading(device, match):
    from kvp_cache.models import available_device, load_model

    with pytest.raises(ValueError, match=match):
        load_model("no/such-model", device=device)
    assert available_device("cpu") == torch.device("cpu")
