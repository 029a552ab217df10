"""A prototype age decay for KVP under a decode-time cap, on validation text (issue 29, thirteenth
session).

KVP scores each token once, as it enters the cache, so under ``max_cache_tokens`` an old token keeps
its score however long ago it was read; on dialogue the Gemma 3 policy keeps old tokens where
StreamingLLM keeps the latest ones. This patches ``EvictingLayer._evict`` (the library is unchanged)
so that each eviction ranks ``score - lambda * log2(1 + age)``, where ``age`` is the tokens read
since the token entered: a prompt token counts from the prompt's end, a later token from its own
position. Sinks and the window stay protected.

The windows are held-out documents of the training corpora (``train.calibrate.corpus_windows`` with
``held_out=True``), never the benchmark's held-out corpora: each window's first 1,024 tokens are
prefilled, its next 2,048 read in chunks of 16 under the cap (evict_every 64), as the benchmark's
``decode`` protocol reads them. The score is the mean NLL increase per token over the uncapped cache.

Run from the repository root: ``PYTHONPATH=. python docs/decode/gemma3/age_decay/age_decay_validation.py
MODEL WINDOWS LAMBDAS CAP [BASELINES]``, e.g. ``gemma3-270m dialogue=2,code=2,docs=1,native_code=1
0,0.5,1,2 256 streaming_llm,snapkv`` (about 5 minutes per window on one CPU thread); prints a row
per window and writes ``age_decay_validation.json`` next to this file.
"""

import copy
import json
import sys
from pathlib import Path

import torch

import kvp_cache.cache as cache_module
from eval.realtext import continuation_nll
from kvp_cache import KVPCache
from kvp_cache.models import load_model
from kvp_cache.policy import load_policy
from kvp_cache.prefill import prefill
from kvp_cache.provenance import provenance
from train.calibrate import corpus_windows
from train.collect import parse_windows

SHIPPED = {"smollm2": "smollm2-135m-instruct", "gemma3-270m": "gemma3-270m"}
DECAY = {"lambda": 0.0, "prompt_tokens": 0}
protect_sinks_and_window = cache_module.protect_sinks_and_window
evict = cache_module.EvictingLayer._evict


def decayed_evict(layer, kept):
    """``EvictingLayer._evict`` with each stored score lowered by ``lambda * log2(1 + age)`` (needs
    ``track_positions=True`` for the entries' positions)."""

    def protect(scores, positions, *rest):
        if DECAY["lambda"] and layer.scores is not None:
            entered = torch.clamp(layer.positions + 1, min=DECAY["prompt_tokens"])
            age = (layer.cumulative_length - entered).clamp(min=0).float()
            scores = scores - DECAY["lambda"] * torch.log2(1 + age)
        return protect_sinks_and_window(scores, positions, *rest)

    cache_module.protect_sinks_and_window = protect
    try:
        return evict(layer, kept)
    finally:
        cache_module.protect_sinks_and_window = protect_sinks_and_window


def window_row(model, policy, window, lambdas: list[float], cap: int, baselines: list[str]) -> dict:
    """One window's NLL increase over the uncapped cache for KVP at every lambda and each baseline."""
    prefilled = prefill(model, torch.tensor([window.prompt_ids]))
    continuation = torch.tensor([window.future_ids])

    def nll(cache) -> float:
        return float(continuation_nll(model, prefilled, cache, continuation, chunk_tokens=16))

    full = nll(copy.deepcopy(prefilled.cache))
    row = {"window": window.uid, "source": window.source}
    DECAY["prompt_tokens"] = len(window.prompt_ids)
    options = dict(budget=1.0, max_cache_tokens=cap, evict_every=64)
    for value in lambdas:
        DECAY["lambda"] = value
        cache = KVPCache.from_prefill(
            prefilled, model, method="kvp", policy=policy, track_positions=True, **options
        )
        row[f"kvp@{value}"] = nll(cache) - full
    DECAY["lambda"] = 0.0
    for method in baselines:
        row[method] = nll(KVPCache.from_prefill(prefilled, model, method=method, **options)) - full
    return row


def main() -> None:
    torch.set_num_threads(1)
    cache_module.EvictingLayer._evict = decayed_evict
    model_name, windows, lambdas, cap = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    baselines = sys.argv[5].split(",") if len(sys.argv) > 5 else []
    model, tokenizer = load_model(model_name)
    policy = load_policy(SHIPPED[model_name])
    rows = []
    with torch.no_grad():
        for name, count in parse_windows(windows.split(",")).items():
            for window in corpus_windows(tokenizer, name, count, 1024, 2048, 0, 0.12, held_out=True):
                rows.append(
                    window_row(model, policy, window, [float(x) for x in lambdas.split(",")], cap, baselines)
                )
                print(json.dumps(rows[-1]), flush=True)
    keys = [k for k in rows[0] if k not in ("window", "source")]

    def mean(of: list[dict]) -> dict:
        return {k: sum(r[k] for r in of) / len(of) for k in keys}

    result = {
        "provenance": provenance(model_name, "float32", "cpu", policy, sys.argv),
        "settings": {
            "windows": windows,
            "lambdas": lambdas,
            "cap": cap,
            "prompt": 1024,
            "continuation": 2048,
        },
        "mean": mean(rows),
        "by_source": {
            s: mean([r for r in rows if r["source"] == s]) for s in sorted({r["source"] for r in rows})
        },
        "rows": rows,
    }
    out = Path(__file__).with_name("age_decay_validation.json")
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result["mean"], indent=1))


if __name__ == "__main__":
    main()
