"""Hybrid models (sliding-window + full-attention layers, Gemma 3): only the full-attention layers are
evicted, traced and given agents. A tiny random Gemma 3 (4 layers, full attention at 1 and 3, window
16) against a tiny Llama: one helper decides the evicting layers for the cache, the prefill, collect
and the policy; collect -> fit -> load -> generate runs on the hybrid model; a policy is refused on a
model whose evicting layers differ; policies and traces from before ``layer_indices`` load as before."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file
from transformers import DynamicCache, Gemma3TextConfig, LlamaConfig

from kvp_cache import KVPCache
from kvp_cache.agents import HeadAgents
from kvp_cache.compat import cache_kwarg, evicting_layer_indices
from kvp_cache.policy import KVPolicy, load_policy
from kvp_cache.policy_loading import POLICIES_DIR
from kvp_cache.prefill import prefill
from train import collect, data, fit
from train.traces import TraceSplit, shard_dir, write_shard

SIZES = dict(hidden_dim=8, pos_dim=4, max_positions=16, num_mlp_layers=2)
PROMPT, FUTURE = 40, 6  # the prompt is longer than the sliding window (16): sliding layers slide
GLOBAL = [1, 3]


@pytest.fixture
def gemma():
    return tiny_model("gemma3")


def random_ids(count: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, 256, (count,), generator=generator).tolist()


def test_one_helper_decides_the_evicting_layers(gemma, llama):
    assert evicting_layer_indices(gemma.config) == GLOBAL
    assert evicting_layer_indices(llama.config) == [0, 1]
    cache = KVPCache(gemma, method="knorm", budget=8)
    assert [cache.layers.index(layer) for layer in cache.evicting_layers] == GLOBAL
    prompt = torch.tensor([random_ids(PROMPT, torch.Generator().manual_seed(0))])
    assert sorted(prefill(gemma, prompt).queries) == GLOBAL
    assert [m.layer_idx for m in collect.attention_modules(gemma)] == GLOBAL
    assert KVPolicy.for_model(gemma, **SIZES).layer_indices == GLOBAL


def test_collect_traces_only_the_global_layers(gemma, tmp_path):
    g = torch.Generator().manual_seed(1)
    gold = [data.Example(f"gold/{i}", "rand", random_ids(PROMPT, g), random_ids(FUTURE, g)) for i in range(2)]
    greedy = [data.Example(f"greedy/{i}", "rand", random_ids(PROMPT, g)) for i in range(3)]
    splits = {"train": greedy, "val": gold}
    collect.write_traces(gemma, tmp_path, splits, {"val"}, shard_size=2, max_new_tokens=4, settings={"t": 1})
    val, train = TraceSplit(tmp_path, "val"), TraceSplit(tmp_path, "train")
    assert val.layer_indices == train.layer_indices == GLOBAL and val.model["num_layers"] == 4
    assert sorted(p.name for p in shard_dir(tmp_path, "val", 0).glob("layer_*")) == [
        "layer_01.safetensors",
        "layer_03.safetensors",
    ]
    with pytest.raises(ValueError, match=r"traced layers \[1, 3\]"):
        val.layer(0)
    # Importance on the global layers equals the model's own full causal attention.
    example = gold[1]
    with torch.no_grad():
        out = gemma(torch.tensor([example.prompt_ids + example.future_ids]), output_attentions=True)
    for layer in GLOBAL:
        stored = val.layer(layer)[1]
        rows = out.attentions[layer][0, :, PROMPT:, :PROMPT]  # [q_heads=4, FUTURE, PROMPT]
        expected = rows.reshape(2, 2, FUTURE, PROMPT).amax(dim=1).sum(dim=1)
        torch.testing.assert_close(stored.importance, expected, atol=1e-5, rtol=1e-4)
        assert set(stored.scores) == set(collect.query_aware_methods())
    # The greedy answer is decoded on a copy of the cache (a slid window cannot be cropped back),
    # so the traced keys are the prompt's and the answer is the model's own greedy one.
    example = greedy[0]
    trace = collect.trace_example(gemma, collect.attention_modules(gemma), example, [], 4, only_correct=False)
    prompt = torch.tensor([example.prompt_ids])
    expected_answer = gemma.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4)
    assert trace.answer_ids == expected_answer[0, PROMPT:].tolist()
    reference = DynamicCache(config=gemma.config)
    with torch.no_grad():
        gemma(prompt, use_cache=True, **{cache_kwarg(gemma): reference})
    for layer, tensors in zip(GLOBAL, trace.layers, strict=True):
        torch.testing.assert_close(
            tensors["keys"].float(), reference.layers[layer].keys[0], atol=2e-3, rtol=2e-3
        )


def test_fit_load_and_generate_on_the_hybrid_model(gemma, tmp_path):
    g = torch.Generator().manual_seed(2)
    splits = {
        split: [
            data.Example(f"{split}/{i}", "rand", random_ids(PROMPT, g), random_ids(FUTURE, g))
            for i in range(n)
        ]
        for split, n in (("train", 4), ("val", 2))
    }
    collect.write_traces(
        gemma, tmp_path / "traces", splits, set(), shard_size=4, max_new_tokens=4, settings={}
    )
    config = fit.FitConfig(
        str(tmp_path / "traces"), str(tmp_path / "run"), objective="listnet", steps=6, batch_size=2,
        warmup=1, eval_every=3, **SIZES,
    )  # fmt: skip
    policy_dir = fit.fit(config)
    assert sorted(p.name for p in (tmp_path / "run" / "layers").glob("*.safetensors")) == [
        "layer_01.safetensors",
        "layer_03.safetensors",
    ]
    saved = json.loads((policy_dir / "config.json").read_text())
    assert saved["layer_indices"] == GLOBAL and saved["num_layers"] == 4
    policy = load_policy(policy_dir)
    assert policy.layer_indices == GLOBAL and len(policy.layers) == 2
    # Each global layer's trained agents are the ones saved for it.
    for layer in GLOBAL:
        trained = load_file(str(tmp_path / "run" / "layers" / f"layer_{layer:02d}.safetensors"))
        for name, tensor in policy.agents_for(layer).state_dict().items():
            assert torch.equal(tensor, trained[name])

    budget = 10
    prompt = torch.tensor([random_ids(PROMPT, g)])
    cache = KVPCache.from_pretrained(
        str(policy_dir), model=gemma, budget=budget, sink_tokens=0, window_tokens=0, track_positions=True
    )
    full = DynamicCache(config=gemma.config)
    with torch.no_grad():
        gemma(prompt, use_cache=True, **{cache_kwarg(gemma): full})
        gemma(prompt, attention_mask=torch.ones_like(prompt), **{cache_kwarg(gemma): cache})
    positions = torch.arange(PROMPT)[None]
    for layer in GLOBAL:
        scores = policy(layer, full.layers[layer].keys, full.layers[layer].values, positions)
        expected = scores.topk(budget, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(cache.layers[layer].positions, expected)

    cache = KVPCache.from_pretrained(str(policy_dir), model=gemma, budget=budget)
    output = gemma.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False,
        **{cache_kwarg(gemma): cache},
    )  # fmt: skip
    assert output.shape == (1, PROMPT + 5)
    assert [layer.keys.shape[-2] for layer in cache.evicting_layers] == [budget + 4] * 2
    assert cache.get_seq_length() == PROMPT + 4


def llama_like_gemma() -> LlamaConfig:
    """A Llama with the tiny Gemma's shape (4 layers, 2 KV heads of dim 16), all layers full attention."""
    return LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip


def test_policies_are_refused_across_hybrid_and_full_attention(gemma):
    full = llama_like_gemma()
    for_full, for_hybrid = KVPolicy.for_model(full, **SIZES), KVPolicy.for_model(gemma, **SIZES)
    assert for_full.layer_indices == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"layer_indices: policy has \[0, 1, 2, 3\], model has \[1, 3\]"):
        KVPCache.from_pretrained(for_full, model=gemma)
    with pytest.raises(ValueError, match=r"layer_indices: policy has \[1, 3\], model has \[0, 1, 2, 3\]"):
        for_hybrid.check_compatible(full)
    for_hybrid.check_compatible(gemma)
    with pytest.raises(
        ValueError, match=r"layer_idx must be one of the policy's layer_indices \[1, 3\], got 0"
    ):
        for_hybrid(0, torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), torch.arange(5)[None])


@pytest.mark.parametrize("indices", [[], [3, 1], [1, 1], [0, 4], [-1], [1.0], "13"])
def test_bad_layer_indices_are_refused(indices):
    with pytest.raises(ValueError, match="layer_indices must be a non-empty ascending list"):
        KVPolicy(num_layers=4, num_kv_heads=2, head_dim=16, layer_indices=indices, **SIZES)


def test_policy_saved_before_layer_indices_loads_unchanged(tmp_path):
    """A config.json without layer_indices (policies saved before the field existed): agents for
    all 30 layers, agent i holding the file's ``layers.i`` weights, so scores equal agents built
    straight from the file."""
    old_format = tmp_path / "old"
    shutil.copytree(POLICIES_DIR / "smollm2-135m-instruct", old_format)
    config = json.loads((old_format / "config.json").read_text())
    assert config.pop("layer_indices") == list(range(30))
    (old_format / "config.json").write_text(json.dumps(config))
    policy = load_policy(old_format)
    assert policy.layer_indices == list(range(30))
    weights = load_file(str(old_format / "model.safetensors"))
    assert set(policy.state_dict()) == set(weights)
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(1, 3, 50, 64, generator=g), torch.randn(1, 3, 50, 64, generator=g)
    positions = torch.arange(50)[None]
    for layer in (0, 17, 29):
        agents = HeadAgents(
            config["num_kv_heads"], config["head_dim"], config["hidden_dim"], config["pos_dim"],
            config["max_positions"], config["num_mlp_layers"], config["position_strategy"],
        )  # fmt: skip
        agents.load_state_dict(
            {k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"layers.{layer}.")}
        )
        assert torch.equal(policy(layer, keys, values, positions), agents(keys, values, positions))
    policy.save_pretrained(tmp_path / "new")
    assert json.loads((tmp_path / "new" / "config.json").read_text())["layer_indices"] == list(range(30))
    assert load_file(str(tmp_path / "new" / "model.safetensors")).keys() == weights.keys()


def test_traces_without_layer_indices_hold_every_layer(tmp_path):
    """Trace directories written before the field existed (the SmolLM2 collections) load as all layers."""
    info = {"name": "tiny", "num_layers": 2, "num_kv_heads": 1, "head_dim": 4}
    tensors = {"keys": [torch.zeros(1, 3, 4).half()], "values": [torch.zeros(1, 3, 4).half()]}
    tensors["importance"] = [torch.arange(3.0)[None]]
    meta = {"model": info, "methods": [], "samples": [{"uid": "a/0", "source": "a", "prompt_tokens": 3}]}
    write_shard(shard_dir(tmp_path, "train", 0), [tensors, tensors], meta)
    split = TraceSplit(tmp_path, "train")
    assert split.layer_indices == [0, 1]
    assert torch.equal(split.layer(1)[0].importance, torch.arange(3.0)[None])


def test_shipped_gemma_policy_fits_the_gemma3_270m_layout():
    """Gemma 3 270M's layout (18 layers, a global one after every 5 sliding ones, 1 KV head of dim
    256), built without the weights: the shipped policy fits it and only it."""
    layout = dict(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256)
    gemma = Gemma3TextConfig(
        vocab_size=256, hidden_size=640, intermediate_size=64, sliding_window=512, **layout
    )
    gemma.name_or_path = "google/gemma-3-270m"
    assert evicting_layer_indices(gemma) == [5, 11, 17]
    policy = load_policy("gemma3-270m")
    assert policy.layer_indices == [5, 11, 17] and policy.base_model == gemma.name_or_path
    policy.check_compatible(gemma)
    full = LlamaConfig(vocab_size=256, hidden_size=640, intermediate_size=64, **layout)
    with pytest.raises(ValueError, match=r"layer_indices: policy has \[5, 11, 17\], model has \[0, 1, 2"):
        policy.check_compatible(full)
