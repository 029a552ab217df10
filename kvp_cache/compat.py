"""Which transformers versions and models KVPCache supports, checked early with clear errors."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import transformers
from packaging.version import Version
from transformers import PretrainedConfig

SUPPORTED_TRANSFORMERS = (Version("4.57"), Version("5.26"))


def check_transformers_version(version: str = transformers.__version__) -> None:
    low, high = SUPPORTED_TRANSFORMERS
    v = Version(Version(version).base_version)
    if not low <= v < high:
        raise ImportError(
            f"kvp_cache supports transformers >={low},<{high}; found {version}. "
            f'Install a supported version: pip install "transformers>={low},<{high}"'
        )


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (multimodal models nest it)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def check_decoder_config(config: PretrainedConfig, model: torch.nn.Module | None = None) -> None:
    """Refuse configs and models that are not decoder-only causal LMs with standard attention."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"KVPCache supports decoder-only LMs; '{model_type}' is an encoder-decoder model")
    encoder_only = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(
        config, "is_decoder", False
    )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or encoder_only:
        raise ValueError(
            f"KVPCache supports decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, ...); "
            f"'{model_type or type(config).__name__}' is not one"
        )
    for attribute in ("num_attention_heads", "hidden_size", "num_hidden_layers"):
        if getattr(config, attribute, None) is None:
            raise ValueError(f"KVPCache needs config.{attribute}, which '{model_type}' does not define")
    if model is not None and not hasattr(model, "generate"):
        raise ValueError(f"KVPCache needs a generative model; {type(model).__name__} has no generate()")


@dataclass(frozen=True)
class AttentionShape:
    """The decoder's attention geometry, read from its config."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int


def attention_shape(config: PretrainedConfig) -> AttentionShape:
    """Layers, query heads, KV heads and head_dim of a (possibly multimodal) decoder config."""
    config = text_config(config)
    heads = config.num_attention_heads
    return AttentionShape(
        num_layers=config.num_hidden_layers,
        num_attention_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
    )


def evicting_layer_indices(config: PretrainedConfig) -> list[int]:
    """Indices of the decoder layers a ``KVPCache`` evicts (and a ``KVPolicy`` has agents for).

    These are the full-attention layers: those transformers' ``DynamicCache`` builds as a plain
    ``DynamicLayer`` for ``config``. Sliding-window, chunked, linear-attention and shared layers keep
    their own bounded cache and are never evicted; e.g. Gemma 3 270M evicts 3 of its 18 layers.
    Reading the layers off ``DynamicCache`` avoids copying its layer-type inference, which changed
    across transformers versions.
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer

    reference = DynamicCache(config=text_config(config))
    return [i for i, layer in enumerate(reference.layers) if type(layer) is DynamicLayer]


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword under which ``model.forward`` and ``generate`` take a cache.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns, and goes away
    from ``forward`` in 5.40 and from ``generate`` in 6.0); earlier versions know only the old name.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_argument(kwargs: dict):
    """The cache a forward was called with, under either keyword (``None`` when there is none)."""
    return kwargs["cache"] if kwargs.get("cache") is not None else kwargs.get("past_key_values")
