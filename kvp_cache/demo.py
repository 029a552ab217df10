"""``kvp-cache demo``: a needle in a ~2K-token haystack, answered with a full and a compressed cache.

Both runs generate greedily from the same prompt, one with a plain ``DynamicCache`` and one with a
:class:`~kvp_cache.KVPCache` holding ``budget`` of the prompt; the demo reports both answers, whether
each contains the needle, the KV bytes each cache holds at the end and the wall time of each.
Any model of :data:`kvp_cache.models.MODELS` runs it (SmolLM2 by default); chat models get the chat
template, base models a plain-text prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from kvp_cache import ruler
from kvp_cache.budget import Budget
from kvp_cache.cache import KVPCache, cache_bytes
from kvp_cache.compat import cache_kwarg
from kvp_cache.models import MODELS, load_model, prompt_for


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

    model: str  # the Hub id of the model that answered
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


def default_policy(model_id: str) -> str:
    """The shipped KVP policy trained for ``model_id`` (a Hub id such as ``config.name_or_path``)."""
    from kvp_cache.policy import load_policy, shipped_policies

    names = shipped_policies()
    for name in names:
        if load_policy(name).base_model == model_id:
            return name
    raise ValueError(
        f"no KVP policy ships for {model_id} (shipped: {', '.join(names) or 'none'}); "
        "pass a method (--method, see kvp_cache.available_methods()) or a policy (--policy)"
    )


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
            **{cache_kwarg(model): cache},
        )
    seconds = time.perf_counter() - start
    return tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True), seconds


def run_demo(
    method: str | None = None,
    policy: str | None = None,
    budget: Budget = 0.25,
    sink_tokens: int = 4,
    window_tokens: int = 16,
    allocation: str = "uniform",
    model_name: str = "smollm2",
    context_tokens: int = 2048,
    max_new_tokens: int = 32,
    essays: str | Path | None = None,
    seed: int = 0,
    model=None,
    tokenizer=None,
) -> DemoResult:
    """Answer one ``niah_single`` sample with a full cache and with a compressed one.

    method / policy: at most one; by default the KVP policy shipped for the model.
    budget, sink_tokens, window_tokens, allocation: as in :class:`~kvp_cache.KVPCache`.
    model_name: a name of :data:`kvp_cache.models.MODELS` (or a transformers directory / Hub id);
        it also decides the prompt format (chat template or plain text).
    essays: a directory of essays (``*.txt``) for the haystack; by default RULER's noise sentences.
    model, tokenizer: reuse a loaded ``model_name``; loaded with :func:`kvp_cache.models.load_model`
        when omitted.
    """
    if method is not None and policy is not None:
        raise ValueError("pass either method or policy, not both")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    haystack = ruler.load_haystack(essays)  # a bad essays directory fails before the model loads
    offline = MODELS.get(model_name)
    if method is None and policy is None:
        if model is not None:
            model_id = model.config.name_or_path
        else:
            model_id = offline.model_id if offline is not None else model_name
        policy = default_policy(model_id)
    if model is None or tokenizer is None:
        with tqdm(total=1, desc=f"Loading {model_name}", leave=False) as bar:
            model, tokenizer = load_model(model_name)
            bar.update(1)

    (sample,) = ruler.make_samples(
        "niah_single", tokenizer, context_tokens, n=1, seed=seed, haystack=haystack
    )
    chat = offline.chat if offline is not None else bool(getattr(tokenizer, "chat_template", None))
    prompt, _ = prompt_for(sample, tokenizer, chat=chat, question_in_context=True)
    input_ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]

    full_cache = DynamicCache(config=model.config)
    full_answer, full_seconds = _generate(
        model, tokenizer, input_ids, full_cache, max_new_tokens, "full cache"
    )
    options = dict(budget=budget, sink_tokens=sink_tokens, window_tokens=window_tokens)
    if allocation != "uniform":
        options["allocation"] = allocation
    if policy is not None:
        cache = KVPCache(model, method="kvp", policy=policy, **options)
        label = f"kvp:{policy}"
    else:
        cache = KVPCache(model, method=method, **options)
        label = method
    if allocation != "uniform":
        label += f", allocation {allocation}"
    answer, seconds = _generate(
        model, tokenizer, input_ids, cache, max_new_tokens, f"{label}, budget {budget}"
    )

    def run(name: str, text: str, kv_bytes: int, secs: float) -> DemoRun:
        return DemoRun(name, text, ruler.score(sample, text) == 1.0, kv_bytes, secs)

    return DemoResult(
        model=model.config.name_or_path,
        needle=sample.answers[0],
        haystack=str(essays) if essays is not None else "RULER noise",
        prompt_tokens=input_ids.shape[1],
        method=label,
        budget=budget,
        full=run("full DynamicCache", full_answer, cache_bytes(full_cache), full_seconds),
        compressed=run(f"KVPCache {label} @ {budget}", answer, cache.kv_bytes(), seconds),
    )


def format_result(result: DemoResult) -> str:
    """The human-readable report ``kvp-cache demo`` prints."""
    lines = [
        f"Model: {result.model}",
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
