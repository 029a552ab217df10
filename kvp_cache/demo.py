"""``kvp-cache demo``: a needle in a ~2K-token haystack, answered with a full and a compressed cache.

Both runs generate greedily from the same prompt, one with a plain ``DynamicCache`` and one with a
:class:`~kvp_cache.KVPCache` holding ``budget`` of the prompt; the demo reports both answers, whether
each contains the needle, the KV bytes each cache holds at the end and the wall time of each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from packaging.version import Version
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from kvp_cache import ruler
from kvp_cache.budget import Budget
from kvp_cache.cache import KVPCache

# ../shared/data/pg_essays next to the repository checkout (absent in an installed wheel: noise is used).
DEFAULT_ESSAYS = Path(__file__).resolve().parents[2] / "shared" / "data" / "pg_essays"
FALLBACK_METHOD = "snapkv"  # the strongest baseline on RULER while no learned policy ships
# transformers 5.24 renamed generate's `past_key_values` to `cache` (the old name warns).
CACHE_ARG = (
    "cache"
    if Version(Version(transformers.__version__).base_version) >= Version("5.24")
    else "past_key_values"
)


@dataclass
class DemoRun:
    """One greedy generation: its answer, whether the needle is in it, the cache it ended with."""

    label: str
    answer: str
    found_needle: bool
    kv_bytes: int
    seconds: float


@dataclass
class DemoResult:
    """What ``kvp-cache demo`` prints, for tests and callers."""

    needle: str
    haystack: str  # where the filler text came from: an essays directory or "RULER noise"
    prompt_tokens: int
    method: str  # a method name, or "kvp:<policy>" for a learned policy
    budget: Budget
    full: DemoRun
    compressed: DemoRun

    @property
    def kv_ratio(self) -> float:
        """Compressed KV bytes / full KV bytes."""
        return self.compressed.kv_bytes / self.full.kv_bytes


def default_policy() -> str | None:
    """The first policy shipped in the package, or None while none ships (or the policy code is absent)."""
    try:
        from kvp_cache.policy import shipped_policies
    except ImportError:
        return None
    names = shipped_policies()
    return names[0] if names else None


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    """Bytes of the keys and values held by every layer of a ``DynamicCache``."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


class _TokenProgress(BaseStreamer):
    """A tqdm bar advanced by ``generate`` once per new token (its first ``put`` is the prompt)."""

    def __init__(self, total: int, desc: str):
        self.bar = tqdm(total=total, desc=desc, unit="tok", leave=False)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.bar.update(1)
        self.prompt_seen = True

    def end(self) -> None:
        self.bar.close()


def _generate(model, tokenizer, input_ids: torch.Tensor, cache, max_new_tokens: int, label: str):
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
            streamer=_TokenProgress(max_new_tokens, f"Generating ({label})"),
            **{CACHE_ARG: cache},
        )
    seconds = time.perf_counter() - start
    return tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True), seconds


def run_demo(
    method: str | None = None,
    policy: str | None = None,
    budget: Budget = 0.25,
    context_tokens: int = 2048,
    max_new_tokens: int = 32,
    essays: str | Path | None = None,
    seed: int = 0,
    model=None,
    tokenizer=None,
) -> DemoResult:
    """Answer one ``niah_single`` sample with a full cache and with a compressed one.

    method / policy: at most one; by default the first shipped KVP policy, else ``snapkv``.
    essays: a directory of essays for the haystack; by default ``../shared/data/pg_essays`` of the
        repository when it exists, else RULER's noise sentences.
    model, tokenizer: reuse a loaded SmolLM2 (or another chat model); loaded with
        :func:`kvp_cache.models.load_model` when omitted.
    """
    if method is not None and policy is not None:
        raise ValueError("pass either method or policy, not both")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if method is None and policy is None:
        policy = default_policy()
        method = FALLBACK_METHOD if policy is None else None
    if essays is None and DEFAULT_ESSAYS.is_dir():
        essays = DEFAULT_ESSAYS
    haystack_source = str(essays) if essays is not None else "RULER noise"
    if model is None or tokenizer is None:
        from kvp_cache.models import load_model

        with tqdm(total=1, desc="Loading SmolLM2", leave=False) as bar:
            model, tokenizer = load_model("smollm2")
            bar.update(1)

    sample = ruler.make_samples(
        "niah_single", tokenizer, context_tokens, n=1, seed=seed, haystack=ruler.load_haystack(essays)
    )[0]
    prompt, _ = ruler.chat_prompt(sample, tokenizer, question_in_context=True)
    input_ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]

    full_cache = DynamicCache(config=model.config)
    full_answer, full_seconds = _generate(
        model, tokenizer, input_ids, full_cache, max_new_tokens, "full cache"
    )
    if policy is not None:
        cache = KVPCache.from_pretrained(policy, model=model, budget=budget)
        label = f"kvp:{policy}"
    else:
        cache = KVPCache(model, method=method, budget=budget)
        label = method
    answer, seconds = _generate(
        model, tokenizer, input_ids, cache, max_new_tokens, f"{label}, budget {budget}"
    )

    def run(name: str, text: str, kv_bytes: int, secs: float) -> DemoRun:
        return DemoRun(name, text, ruler.score(sample, text) == 1.0, kv_bytes, secs)

    return DemoResult(
        needle=sample.answers[0],
        haystack=haystack_source,
        prompt_tokens=input_ids.shape[1],
        method=label,
        budget=budget,
        full=run("full DynamicCache", full_answer, dynamic_cache_bytes(full_cache), full_seconds),
        compressed=run(f"KVPCache {label} @ {budget}", answer, cache.kv_bytes(), seconds),
    )


def format_result(result: DemoResult) -> str:
    """The human-readable report ``kvp-cache demo`` prints."""
    lines = [
        f"Haystack: {result.haystack}",
        f"Prompt: {result.prompt_tokens} tokens, needle {result.needle}",
        "",
    ]
    for run in (result.full, result.compressed):
        lines += [
            f"[{run.label}]",
            f"  answer: {run.answer.strip()!r}",
            f"  needle found: {'yes' if run.found_needle else 'no'}",
            f"  KV bytes: {run.kv_bytes / 2**20:.2f} MiB",
            f"  wall time: {run.seconds:.2f} s",
        ]
    lines.append(
        f"KV bytes ratio (compressed / full, after generation): {result.kv_ratio:.3f} at budget {result.budget}"
    )
    return "\n".join(lines)
