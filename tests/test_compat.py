"""The public paths on the installed transformers, with its FutureWarnings (such as the deprecated
``past_key_values=`` keyword of 5.24+) raised as errors; the version range and the cache keyword."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from conftest import tiny_model
from packaging.version import Version
from transformers import AutoTokenizer, DynamicCache

from kvp_cache import KVPCache, demo
from kvp_cache.compat import SUPPORTED_TRANSFORMERS, cache_kwarg, check_transformers_version
from kvp_cache.models import MODELS
from kvp_cache.prefill import generate_after_prefill, prefill

INSTALLED = Version(Version(transformers.__version__).base_version)
RENAMED = Version("5.24")  # the release that renamed `past_key_values` to `cache`


def ids(length: int = 40, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def future_warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        yield


def test_installed_version_is_supported_and_bounds_are_enforced():
    low, high = SUPPORTED_TRANSFORMERS
    check_transformers_version()
    for outside in (str(Version(f"{low.major}.{low.minor - 1}")), str(high), f"{high}.1", "6.0.0"):
        with pytest.raises(ImportError, match="kvp_cache supports transformers"):
            check_transformers_version(outside)
    check_transformers_version(f"{low}.0")


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_cache_kwarg_is_the_keyword_of_the_installed_version(kind):
    assert cache_kwarg(tiny_model(kind)) == ("cache" if INSTALLED >= RENAMED else "past_key_values")


@pytest.mark.skipif(INSTALLED < RENAMED, reason="past_key_values is the only keyword before 5.24")
def test_the_old_keyword_warns_so_the_checks_below_can_fail(future_warnings_are_errors):
    model = tiny_model("llama")
    with pytest.raises(FutureWarning, match="past_key_values"):
        model(ids(), past_key_values=DynamicCache(config=model.config))


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("method", ["knorm", "snapkv"])
@torch.no_grad()
def test_forward_and_generate_without_future_warnings(future_warnings_are_errors, kind, method):
    model = tiny_model(kind)
    cache = KVPCache(model, method=method, budget=16)
    model(ids(), **{cache_kwarg(model): cache})
    assert all(layer.keys.shape[-2] == 16 for layer in cache.evicting_layers)
    cache = KVPCache(model, method=method, budget=16)
    out = model.generate(ids(), max_new_tokens=4, do_sample=False, **{cache_kwarg(model): cache})
    assert out.shape[1] == 44 and cache.get_seq_length() == 43


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@torch.no_grad()
def test_prefill_and_generate_after_prefill_without_future_warnings(future_warnings_are_errors, kind):
    model = tiny_model(kind)
    prompt = ids(seed=1)
    expected = model.generate(
        prompt,
        max_new_tokens=5,
        do_sample=False,
        **{cache_kwarg(model): KVPCache(model, method="snapkv", budget=16)},
    )
    prefilled = prefill(model, prompt)
    cache = KVPCache.from_prefill(prefilled, model, method="snapkv", budget=16)
    assert torch.equal(generate_after_prefill(model, prefilled, cache, max_new_tokens=5), expected[:, 40:])


def test_demo_runs_without_future_warnings(future_warnings_are_errors):
    tokenizer = AutoTokenizer.from_pretrained(MODELS["smollm2"].converted_dir())
    model = tiny_model("llama")
    model.resize_token_embeddings(len(tokenizer))
    result = demo.run_demo(
        method="snapkv", budget=64, context_tokens=200, max_new_tokens=2, model=model, tokenizer=tokenizer
    )
    assert result.compressed.kv_bytes < result.full.kv_bytes
