"""Every bench script starts as its docstring says (``python bench/x.py``), from any folder."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = sorted((Path(__file__).resolve().parent.parent / "bench").glob("bench_*.py"))


def load_bench(name: str):
    """The script ``bench/<name>.py`` as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCH[0].parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", BENCH, ids=lambda p: p.name)
def test_bench_script_imports_and_parses_its_arguments(script, tmp_path):
    result = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


def test_bench_decode_times_the_scoring_of_decoded_tokens(llama):
    """The scoring share counts the scorer's calls while decoding, every decoded token once, and
    puts the scorer's own method back afterwards."""
    from kvp_cache import KVPCache, KVPolicy
    from kvp_cache.targets import eviction_points

    bench_decode = load_bench("bench_decode")
    policy = KVPolicy.for_model(llama, hidden_dim=16, pos_dim=8, max_positions=64)
    cache = KVPCache(llama, policy=policy, budget=1.0, max_cache_tokens=32, evict_every=8)
    prompt = torch.randint(0, llama.config.vocab_size, (1, 24))
    run = bench_decode.decode_run(llama, cache, prompt, 40, "test")
    # The prompt is scored in its own forward, before timing starts. A decoded token is scored
    # once, by the first eviction after it entered: those up to the last eviction, in every layer.
    last = eviction_points([24] + [1] * 40, 32, 8)[-1]
    assert 0 < run["scoring_share"] < 1 and run["scoring_ms_per_token"] > 0
    assert run["scored_entries"] == (last - 24) * llama.config.num_hidden_layers
    assert "score" not in vars(cache.settings.scorer)
    full = bench_decode.decode_run(llama, bench_decode.make_cache(llama, "full", None, 8, ""), prompt, 8, "t")
    assert full["scoring_share"] == 0 and full["scored_entries"] == 0
    # kvp_rescore scores every entry held at each eviction: the cap, the tokens since, and the new one.
    rescored = KVPCache(llama, policy=policy, budget=1.0, max_cache_tokens=32, evict_every=8, rescore=True)
    run = bench_decode.decode_run(llama, rescored, prompt, 40, "test")
    evictions = eviction_points([24] + [1] * 40, 32, 8)
    assert run["scored_entries"] == len(evictions) * (32 + 8 + 1) * llama.config.num_hidden_layers
    assert bench_decode.method_options("kvp_rescore", "p") == {
        "method": "kvp",
        "policy": "p",
        "rescore": True,
    }
    assert bench_decode.method_options("kvp_no_decay", "p") == {
        "method": "kvp",
        "policy": "p",
        "age_decay": 0.0,
    }
    # kvp keeps the policy's own decay; kvp_no_decay turns it off. Both score each entry once.
    policy.age_decay = 0.5
    for method, decay in (("kvp", 0.5), ("kvp_no_decay", 0.0)):
        options = bench_decode.method_options(method, policy)
        capped = KVPCache(llama, **options, budget=1.0, max_cache_tokens=32, evict_every=8)
        run = bench_decode.decode_run(llama, capped, prompt, 40, "test")
        assert run["scored_entries"] == (last - 24) * llama.config.num_hidden_layers
        assert capped.settings.scorer.age_decay == decay
        assert (capped.evicting_layers[0].entered is not None) == bool(decay)


def test_bench_policy_splits_scoring_time_into_matrix_products_and_the_rest():
    bench_policy = load_bench("bench_policy")
    a, b, x = torch.randn(2, 64, 32), torch.randn(2, 32, 16), torch.randn(256, 256)
    share, gflop = bench_policy.matmul_share(lambda: torch.bmm(a, b))
    assert share > 0.5 and gflop == pytest.approx(2 * 2 * 64 * 32 * 16 / 1e9)
    share, gflop = bench_policy.matmul_share(lambda: torch.nn.functional.silu(x).mul(2))
    assert share == 0.0 and gflop == 0.0


def test_bench_policy_kept_agreement_counts_the_shared_top_entries(llama):
    from kvp_cache import KVPolicy

    bench_policy = load_bench("bench_policy")
    heads, dim = (
        llama.config.num_key_value_heads,
        llama.config.hidden_size // llama.config.num_attention_heads,
    )
    states = [(torch.randn(1, heads, 40, dim), torch.randn(1, heads, 40, dim)) for _ in range(2)]
    positions = torch.arange(40)[None, :]
    policy = KVPolicy.for_model(llama, hidden_dim=16, pos_dim=8, max_positions=64).eval()
    other = KVPolicy.for_model(llama, hidden_dim=16, pos_dim=8, max_positions=64).eval()
    assert bench_policy.kept_agreement(policy, policy, states, positions, 10) == 1.0
    agreement = bench_policy.kept_agreement(policy, other, states, positions, 10)
    expected = 0
    with torch.no_grad():
        for i, (k, v) in enumerate(states):
            a, b = (p(i, k, v, positions).topk(10, dim=-1).indices for p in (policy, other))
            expected += sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a[0], b[0], strict=True))
    assert agreement == expected / (10 * heads * len(states)) and agreement < 1.0
    # Everything kept: every entry is shared.
    assert bench_policy.kept_agreement(policy, other, states, positions, 40) == 1.0
