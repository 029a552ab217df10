"""KVPCache.save_pretrained / from_saved: a reloaded cache answers exactly as the in-memory one; bad saves are refused."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TINY_CONFIGS, tiny_model
from reference import greedy, ids
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kvp_cache import KVPCache, KVPolicy
from kvp_cache.compat import cache_kwarg
from kvp_cache.policy import Calibration
from kvp_cache.provenance import sha256_of
from kvp_cache.saved_cache import CONFIG_NAME, TENSORS_NAME
from kvp_cache.scorers import QueryStates
from kvp_cache.scorers.knorm import KnormScorer

REPO = Path(__file__).resolve().parents[1]
DOCUMENT, QUESTION = ids(length=40), ids(length=8, seed=1)
PROMPT = torch.cat([DOCUMENT, QUESTION], -1)
BUDGET = 12


def compressed(model, method="knorm", document=DOCUMENT, attention_mask=None, **options):
    """A cache holding ``document`` compressed by ``method`` (``first_prefill`` unless told otherwise)."""
    options = {"budget": BUDGET, "compress": "first_prefill", "sink_tokens": 2, "window_tokens": 2, **options}
    if method == "snapkv":
        options.setdefault("window_size", 8)
    cache = KVPCache(model, method=method, track_positions=True, **options)
    with torch.no_grad():
        model(document, attention_mask=attention_mask, **{cache_kwarg(model): cache})
    return cache


def saved_policy(model, directory: Path, seed: int = 0) -> str:
    """A random tiny KVP policy for ``model``, saved to ``directory`` (returned as a string)."""
    torch.manual_seed(seed)
    KVPolicy.for_model(model, hidden_dim=8, pos_dim=4, max_positions=64).save_pretrained(directory)
    return str(directory)


def reloaded(cache, directory, model, **options) -> KVPCache:
    cache.save_pretrained(directory)
    loaded = KVPCache.from_saved(directory, model, **options)
    assert_same_state(cache, loaded)
    return loaded


def assert_same(a, b, name: str) -> None:
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")
    elif isinstance(a, QueryStates):
        for field in dataclasses.fields(QueryStates):
            assert_same(getattr(a, field.name), getattr(b, field.name), f"{name}.{field.name}")
    else:
        assert a == b, f"{name}: saved {a!r}, reloaded {b!r}"


def assert_same_state(saved: KVPCache, loaded: KVPCache) -> None:
    """Every attribute of every layer equal (tensors bit for bit, NaN for NaN, dtype and device), and the settings."""
    assert repr(loaded) == repr(saved)
    assert dataclasses.replace(loaded.settings, scorer=None) == dataclasses.replace(
        saved.settings, scorer=None
    )
    options = [f.name for f in dataclasses.fields(saved.settings.scorer) if f.name != "policy"]
    for option in options:
        assert getattr(loaded.settings.scorer, option) == getattr(saved.settings.scorer, option)
    for i, (a, b) in enumerate(zip(saved.layers, loaded.layers, strict=True)):
        assert type(a) is type(b) and set(vars(a)) == set(vars(b)), f"layer {i}"
        for name, value in vars(a).items():
            if name not in (
                "settings",
                "context",
            ):  # checked above; the per-forward scratch is empty between forwards
                assert_same(value, getattr(b, name), f"layer {i}.{name}")


def assert_same_answers(model, saved, loaded, prompt=PROMPT, max_new_tokens=6, **kwargs):
    """Greedy continuations of ``prompt`` from both caches: the same tokens and bit-identical logits."""
    expected_tokens, expected_logits = greedy(model, prompt, saved, max_new_tokens, **kwargs)
    tokens, logits = greedy(model, prompt, loaded, max_new_tokens, **kwargs)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    return tokens


# ---- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
@pytest.mark.parametrize("method", ["knorm", "snapkv"])
def test_reloaded_first_prefill_cache_answers_like_the_in_memory_one(kind, method, tmp_path):
    model = tiny_model(kind)
    cache = compressed(model, method)
    loaded = reloaded(cache, tmp_path, model)
    assert loaded.get_seq_length() == 40 and all(layer.compressed for layer in loaded.evicting_layers)
    assert_same_answers(model, cache, loaded)
    # The question was appended whole (no second eviction), then 5 answer tokens (the 6th is never fed).
    assert {layer.physical_length() for layer in loaded.evicting_layers} == {BUDGET + 8 + 5}


def test_reloaded_every_prefill_cache_evicts_the_question_like_the_in_memory_one(tmp_path):
    model = tiny_model("llama")
    cache = compressed(model, "snapkv", compress="every_prefill")
    loaded = reloaded(cache, tmp_path, model)
    assert_same_answers(model, cache, loaded)
    assert {layer.physical_length() for layer in loaded.evicting_layers} == {BUDGET + 5}


AGED_KVP = "kvp, age_decay=1.0"


def method_options(method: str, model, policy_dir: Path) -> tuple[str, dict]:
    """The method name and options of a test's method; ``AGED_KVP`` is kvp with an age decay."""
    if method == AGED_KVP:
        return "kvp", {"policy": saved_policy(model, policy_dir), "age_decay": 1.0}
    return method, {"policy": saved_policy(model, policy_dir)} if method == "kvp" else {}


@pytest.mark.parametrize("method", ["kvp", AGED_KVP, "snapkv"])
def test_cache_saved_mid_answer_continues_with_its_pending_state(method, tmp_path):
    """Saved while decoding under max_cache_tokens: kvp's pending (NaN) scores (and with an age decay,
    when each entry entered) and snapkv's queries captured since the last eviction carry over, and
    the next decoding eviction needs them."""
    model = tiny_model("llama")
    method, options = method_options(method, model, tmp_path / "policy")
    options |= {"max_cache_tokens": 16, "evict_every": 4}
    cache = compressed(model, method, **options)
    started, _ = greedy(model, PROMPT, cache, max_new_tokens=3)  # 12 + 8 = 20 held; 21 -> 16; then 17
    layer = cache.evicting_layers[0]
    assert (layer.entered is not None) == ("age_decay" in options)
    if method == "kvp":
        assert layer.scores.isnan().any()  # a decoded token not scored yet
    else:
        assert layer.recent_queries.queries.shape[-2] > 0  # queries since the decoding eviction
    loaded = reloaded(cache, tmp_path / "cache", model)
    assert_same_answers(model, cache, loaded, prompt=started, max_new_tokens=8)  # 18, 19, 20, 21 -> 16, ...


@pytest.mark.parametrize("allocation", ["layer", "head"])
@pytest.mark.parametrize("method", ["kvp", AGED_KVP, "snapkv"])
def test_adaptive_cache_round_trip(allocation, method, tmp_path):
    """Heads packed with different lengths reload bit for bit: a document compressed once, then a
    left-padded batch saved mid-answer under a cap (kvp's pending scores, snapkv's captured queries)."""
    model = tiny_model("llama")
    method, options = method_options(method, model, tmp_path / "policy")
    options |= {"allocation": allocation, "budget": 0.6}  # 24 per head on average, at least 12
    cache = compressed(model, method, **options)
    lengths = [n for layer in cache.evicting_layers for n in layer.lengths]
    assert len(set(lengths)) > 1  # the allocation gave heads (or layers) different counts
    assert_same_answers(model, cache, reloaded(cache, tmp_path / "once", model))

    document = torch.cat(
        [DOCUMENT, torch.cat([torch.zeros(1, 12, dtype=torch.long), ids(length=28, seed=5)], -1)]
    )
    mask = torch.ones_like(document)
    mask[1, :12] = 0
    capped = {**options, "compress": "every_prefill", "max_cache_tokens": 16, "evict_every": 4}
    cache = compressed(model, method, document=document, attention_mask=mask, **capped)
    prompt = torch.cat([document, QUESTION.expand(2, -1)], -1)
    prompt_mask = torch.cat([mask, torch.ones(2, QUESTION.shape[1], dtype=torch.long)], -1)
    started, _ = greedy(model, prompt, cache, max_new_tokens=3, attention_mask=prompt_mask, pad_token_id=0)
    layer = cache.evicting_layers[0]
    assert layer.holds_padding
    assert layer.scores.isnan().any() if method == "kvp" else layer.recent_queries.queries.shape[-2] > 0
    loaded = reloaded(cache, tmp_path / "capped", model)
    started_mask = torch.cat([prompt_mask, torch.ones(2, 3, dtype=torch.long)], -1)
    assert_same_answers(
        model, cache, loaded, prompt=started, max_new_tokens=8, attention_mask=started_mask, pad_token_id=0
    )


@pytest.mark.parametrize("method", ["knorm", "snapkv"])
def test_left_padded_batch_round_trip(method, tmp_path):
    model = tiny_model("llama")
    padded = torch.cat([torch.zeros(1, 12, dtype=torch.long), ids(length=28, seed=5)], -1)
    document = torch.cat([DOCUMENT, padded])
    mask = torch.ones_like(document)
    mask[1, :12] = 0
    cache = compressed(model, method, document=document, attention_mask=mask, budget=0.5)
    assert not cache.evicting_layers[0].valid[1].all()  # the short row keeps 14 of 20 slots: padding slots
    loaded = reloaded(cache, tmp_path, model)
    question = QUESTION.expand(2, -1)
    full_mask = torch.cat([mask, torch.ones_like(question)], -1)
    prompt = torch.cat([document, question], -1)
    assert_same_answers(model, cache, loaded, prompt=prompt, attention_mask=full_mask, pad_token_id=0)


def test_kvp_policy_is_found_by_its_record_and_checked_by_sha256(tmp_path):
    model = tiny_model("llama")
    cache = compressed(model, "kvp", policy=saved_policy(model, tmp_path / "policy"))
    cache.save_pretrained(tmp_path / "cache")
    record = json.loads((tmp_path / "cache" / CONFIG_NAME).read_text())["method"]["policy"]
    assert record["source"] == str((tmp_path / "policy").resolve())
    assert record["sha256"] == sha256_of(tmp_path / "policy" / "model.safetensors")

    (tmp_path / "policy").rename(tmp_path / "moved")
    with pytest.raises(ValueError, match=r"policy could not be loaded .* Pass policy="):
        KVPCache.from_saved(tmp_path / "cache", model)
    loaded = KVPCache.from_saved(tmp_path / "cache", model, policy=str(tmp_path / "moved"))
    assert_same_state(cache, loaded)
    assert_same_answers(model, cache, loaded)

    assert json.loads((tmp_path / "cache" / CONFIG_NAME).read_text())["method"]["options"]["rescore"] is False
    saved_policy(model, tmp_path / "other", seed=1)
    with pytest.raises(ValueError, match="has weights sha256 .* compressed with"):
        KVPCache.from_saved(tmp_path / "cache", model, policy=str(tmp_path / "other"))


def test_a_cache_saved_here_answers_the_same_in_another_process(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    cache = compressed(model, "snapkv")
    cache.save_pretrained(tmp_path / "cache")
    expected, _ = greedy(model, PROMPT, cache)
    script = textwrap.dedent(
        """
        import json, sys
        import torch
        from transformers import AutoModelForCausalLM
        from kvp_cache import KVPCache
        from kvp_cache.compat import cache_kwarg

        torch.set_num_threads(1)
        model_dir, cache_dir, prompt = sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3]))
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
        cache = KVPCache.from_saved(cache_dir, model)
        out = model.generate(prompt, **{cache_kwarg(model): cache}, max_new_tokens=6, do_sample=False)
        print(json.dumps(out.tolist()))
        """
    )
    arguments = [str(tmp_path / "model"), str(tmp_path / "cache"), json.dumps(PROMPT.tolist())]
    result = subprocess.run(
        [sys.executable, "-c", script, *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        # The checkout first, so the child imports this kvp_cache whether or not it is installed.
        env={
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("allocation", ["uniform", "head"])
def test_smollm2_document_compressed_once_answers_the_same_after_reloading(smollm2, allocation, tmp_path):
    model, _ = smollm2
    generator = torch.Generator().manual_seed(0)
    document = torch.randint(100, 5000, (1, 600), generator=generator)
    prompt = torch.cat([document, torch.randint(100, 5000, (1, 12), generator=generator)], -1)
    cache = KVPCache.from_pretrained(
        "smollm2-135m-instruct", model=model, budget=0.25, compress="first_prefill", allocation=allocation
    )
    with torch.no_grad():
        model(document, **{cache_kwarg(model): cache})
    loaded = reloaded(cache, tmp_path, model)
    assert (
        json.loads((tmp_path / CONFIG_NAME).read_text())["method"]["policy"]["source"]
        == "smollm2-135m-instruct"
    )
    assert_same_answers(model, cache, loaded, prompt=prompt, max_new_tokens=8)


# ---- refusals ---------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    """A tiny Llama and the directory of a knorm cache saved for it."""
    model = tiny_model("llama")
    compressed(model).save_pretrained(tmp_path / "cache")
    return model, tmp_path / "cache"


def edit_json(directory, change) -> None:
    path = directory / CONFIG_NAME
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def llama_with(**changes):
    config = TINY_CONFIGS["llama"]()
    for name, value in changes.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize(
    "other, message",
    [
        (lambda: tiny_model("qwen3"), r"model_type: saved 'llama', model 'qwen3'"),
        (
            lambda: llama_with(rms_norm_eps=1e-3),
            r"config differs in rms_norm_eps \(saved 1e-06, model 0.001\)",
        ),
        (lambda: tiny_model("llama", seed=1), r"weights differ"),
        (lambda: tiny_model("llama").to(torch.bfloat16), r"dtype: saved 'float32', model 'bfloat16'"),
    ],
    ids=["other family", "other config", "other weights", "other dtype"],
)
def test_a_cache_saved_for_another_model_is_refused(saved, other, message):
    _, directory = saved
    with pytest.raises(ValueError, match=rf"computed with another model .*{message}"):
        KVPCache.from_saved(directory, other())


def test_another_cache_layout_is_refused(saved):
    model, directory = saved
    edit_json(
        directory, lambda r: r["cache_layout"]["layers"][0].update({"class": "DynamicSlidingWindowLayer"})
    )
    with pytest.raises(
        ValueError, match=r"another transformers cache layout .*layer 0: saved .*DynamicSlidingWindow"
    ):
        KVPCache.from_saved(directory, model)
    edit_json(directory, lambda r: r["cache_layout"].update({"version": 2}))
    with pytest.raises(ValueError, match="cache layout version 2"):
        KVPCache.from_saved(directory, model)


def test_head_lengths_that_do_not_pack_the_keys_are_refused(tmp_path):
    model = tiny_model("llama")
    compressed(model, "snapkv", allocation="head", budget=0.6).save_pretrained(tmp_path)
    edit_json(tmp_path, lambda r: r["layers"][0]["counters"].update({"lengths": [1, 2]}))
    with pytest.raises(
        ValueError, match=r"layer 0: head lengths \[1, 2\] do not pack \d+ slots into 2 KV heads"
    ):
        KVPCache.from_saved(tmp_path, model)


def test_an_adaptive_kvp_cache_needs_the_calibration_it_was_allocated_with(tmp_path):
    model = tiny_model("llama")
    policy = saved_policy(model, tmp_path / "policy")
    compressed(model, "kvp", policy=policy, allocation="head", budget=0.6).save_pretrained(tmp_path / "cache")
    recalibrated = KVPolicy.from_pretrained(policy)
    shape = (len(recalibrated.layer_indices), recalibrated.num_kv_heads)
    recalibrated.calibration = Calibration(temperature=torch.ones(shape), weight=torch.rand(shape) + 0.5)
    recalibrated.save_pretrained(tmp_path / "recalibrated")  # the same weights, another calibration
    with pytest.raises(
        ValueError, match=r"calibration sha256 \w+, but the cache's heads were allocated with"
    ):
        KVPCache.from_saved(tmp_path / "cache", model, policy=str(tmp_path / "recalibrated"))
    KVPCache.from_saved(tmp_path / "cache", model, policy=policy)


def test_a_changed_tensor_file_is_refused(saved):
    model, directory = saved
    data = bytearray((directory / TENSORS_NAME).read_bytes())
    data[-1] ^= 1  # one bit of the last tensor's data: still a valid safetensors file
    (directory / TENSORS_NAME).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="has sha256 .* records .* changed or corrupted"):
        KVPCache.from_saved(directory, model)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("layers.0.valid"), r"missing tensors \['layers.0.valid'\]"),
        (lambda t: t.update({"layers.1.extra": torch.zeros(1)}), r"unexpected tensors \['layers.1.extra'\]"),
    ],
)
def test_missing_or_extra_tensors_are_refused(saved, change, message):
    """Even with the recorded sha256 updated to match the new file, the names must match the record."""
    model, directory = saved
    tensors = load_file(directory / TENSORS_NAME)
    change(tensors)
    save_file(tensors, directory / TENSORS_NAME)
    edit_json(directory, lambda r: r["tensors"].update({"sha256": sha256_of(directory / TENSORS_NAME)}))
    with pytest.raises(ValueError, match=message):
        KVPCache.from_saved(directory, model)


def test_pickle_files_are_refused_without_unpickling(saved, tmp_path, monkeypatch):
    model, directory = saved

    def no_unpickling(*args, **kwargs):
        raise AssertionError("a pickle file was opened")

    monkeypatch.setattr(torch, "load", no_unpickling)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save({"layers.0.keys": torch.zeros(1)}, pickled / "cache.pt")
    for path in (pickled, pickled / "cache.pt"):
        with pytest.raises(ValueError, match=r"pickle files \(cache.pt\).* safetensors only"):
            KVPCache.from_saved(path, model)
    # A pickle under the tensor file's name, with its sha256 recorded, is not a safetensors file.
    torch.save({"layers.0.keys": torch.zeros(1)}, directory / TENSORS_NAME)
    edit_json(directory, lambda r: r["tensors"].update({"sha256": sha256_of(directory / TENSORS_NAME)}))
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        KVPCache.from_saved(directory, model)


def test_missing_or_incomplete_directories_are_refused(saved, tmp_path):
    model, directory = saved
    with pytest.raises(ValueError, match="does not exist"):
        KVPCache.from_saved(tmp_path / "nowhere", model)
    (directory / CONFIG_NAME).unlink()
    with pytest.raises(ValueError, match=f"has no {CONFIG_NAME}"):
        KVPCache.from_saved(directory, model)


def test_caches_that_cannot_be_rebuilt_are_not_saved(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs the model"):
        KVPCache(model.config).save_pretrained(tmp_path)

    class Unregistered(KnormScorer):
        pass

    with pytest.raises(ValueError, match="unregistered Unregistered"):
        KVPCache(model, method=Unregistered()).save_pretrained(tmp_path)
    torch.manual_seed(0)
    in_memory = KVPolicy.for_model(model, hidden_dim=8, pos_dim=4, max_positions=64)
    with pytest.raises(ValueError, match="not loaded from a safetensors file"):
        KVPCache(model, method="kvp", policy=in_memory).save_pretrained(tmp_path)
    assert not (tmp_path / CONFIG_NAME).exists()
