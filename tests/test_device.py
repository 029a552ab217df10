"""Every method on every available device and dtype against the masked reference (tests/reference.py).

CUDA cases exist only where a GPU does (run them there with ``pytest tests/test_device.py``); on a
CPU-only machine the bfloat16 cases still check that no scorer or cache step depends on float32.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from reference import check_generate_against_reference, ids
from test_benchmark import saved_policy, small_config
from test_cache import make_cache
from test_policy import tiny_policy
from test_sweep import tiny_with_chat_tokenizer

from eval.benchmark import Benchmark, benchmark_result
from kvp_cache import available_methods

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# bfloat16 keeps 8 bits of mantissa; the reference attends in float32, the model in bfloat16.
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("method", sorted(available_methods()))
def test_every_method_matches_reference_on_device_and_dtype(method, kind, dtype, device):
    model = tiny_model(kind, attn_implementation="sdpa").to(device=device, dtype=dtype)
    options = {"policy": tiny_policy(model)} if method == "kvp" else {}
    cache = make_cache(model, method, budget=0.4, **options)
    prompt = ids(length=50, seed=2).to(device)
    check_generate_against_reference(model, prompt, cache, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    for layer in cache.evicting_layers:
        assert layer.keys.device.type == device and layer.keys.dtype == dtype
        assert layer.positions.device.type == device


@pytest.mark.parametrize("device", DEVICES)
def test_benchmark_on_device_matches_cpu(device, tmp_path, fake_corpora):
    """The benchmark's whole data path (prompts, prefill, every scorer, the oracle, decoding, real-text
    NLL) on ``device`` gives the CPU's rows: the accuracies exactly, the NLLs to float noise."""
    model, tokenizer = tiny_with_chat_tokenizer()
    config = small_config(methods=["kvp", *sorted(set(available_methods()) - {"kvp"})], policy="tiny")
    policy = saved_policy(model, 0, tmp_path / "policy")
    rows = {}
    for where in ("cpu", device):
        bench = Benchmark(model.to(where), tokenizer, config, tmp_path / where, policy.to(where))
        bench.run()
        result = benchmark_result(config, tmp_path / where, bench.fingerprint, {})
        rows[where] = {
            (
                r["protocol"],
                r.get("task") or r.get("corpus"),
                r["context_tokens"],
                r["method"],
                r["budget"],
            ): r
            for r in result["rows"]
        }
    assert rows[device].keys() == rows["cpu"].keys() and len(rows["cpu"]) > 20
    for key, row in rows["cpu"].items():
        if row["metric"] == "accuracy":
            assert rows[device][key]["score"] == row["score"], key
        else:  # NLL increase over the full cache, and the full cache's own NLL
            assert rows[device][key]["score"] == pytest.approx(row["score"], abs=1e-3), key
            assert rows[device][key]["nll"] == pytest.approx(row["nll"], abs=1e-3), key


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("method", ["kvp", "snapkv"])
def test_adaptive_allocation_matches_reference_on_device_and_dtype(method, kind, dtype, device):
    """The ragged per-head layout and its attention keep the model's device and dtype."""
    model = tiny_model(kind, attn_implementation="sdpa").to(device=device, dtype=dtype)
    options = {"policy": tiny_policy(model)} if method == "kvp" else {}
    cache = make_cache(model, method, budget=0.4, allocation="head", **options)
    prompt = ids(length=50, seed=2).to(device)
    check_generate_against_reference(model, prompt, cache, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    for layer in cache.evicting_layers:
        assert layer.keys.device.type == device and layer.keys.dtype == dtype
        assert layer.positions.device.type == device and layer.valid.device.type == device
