"""KVP's ``age_decay`` under a decode-time cap, on validation text (issue 29, thirteenth session).

KVP scores each token once, as it enters the cache, so under ``max_cache_tokens`` an old token keeps
its score however long ago it was read. ``KVPCache(..., method="kvp", age_decay=D)`` ranks each
eviction by ``score - D * log2(1 + age)``, ``age`` the tokens read since the entry's forward. This
measures the model's shipped policy at several ``D`` (0: scored once) and the baselines given.

The windows are held-out documents of the training corpora (``train.calibrate.corpus_windows`` with
``held_out=True``), never the benchmark's held-out corpora: each window's first 1,024 tokens are
prefilled, its next 2,048 read in chunks of 16 under the cap (evict_every 64), as the benchmark's
``decode`` protocol reads them. The score is the mean NLL increase per token over the uncapped cache.

Run from the repository root: ``PYTHONPATH=. python docs/decode/gemma3/age_decay/age_decay_validation.py
MODEL WINDOWS DECAYS CAP [BASELINES]``, e.g. ``smollm2 code=2,native_code=1,docs=1,dialogue=2
0,0.5,1 256 snapkv`` (about a minute per window and cache on one CPU thread); prints a row per window
and writes ``age_decay_validation_<model>_<cap>.json`` next to this file.
"""

import copy
import json
import sys
from pathlib import Path

import torch

from eval.realtext import continuation_nll
from eval.stats import write_window_results
from kvp_cache import KVPCache
from kvp_cache.demo import default_policy
from kvp_cache.models import MODELS, load_model
from kvp_cache.policy import load_policy
from kvp_cache.prefill import prefill
from kvp_cache.provenance import provenance
from train.calibrate import corpus_windows
from train.collect import parse_windows


def window_row(model, policy, window, decays: list[float], cap: int, baselines: list[str]) -> dict:
    """One window's NLL increase over the uncapped cache for KVP at every decay and each baseline."""
    prefilled = prefill(model, torch.tensor([window.prompt_ids]))
    continuation = torch.tensor([window.future_ids])

    def nll(cache) -> float:
        return float(continuation_nll(model, prefilled, cache, continuation, chunk_tokens=16))

    full = nll(copy.deepcopy(prefilled.cache))
    row = {"window": window.uid, "source": window.source}
    options = dict(budget=1.0, max_cache_tokens=cap, evict_every=64)
    for decay in decays:
        cache = KVPCache.from_prefill(
            prefilled, model, method="kvp", policy=policy, age_decay=decay, **options
        )
        row[f"kvp@{decay:g}"] = nll(cache) - full
    for method in baselines:
        row[method] = nll(KVPCache.from_prefill(prefilled, model, method=method, **options)) - full
    return row


def main() -> None:
    torch.set_num_threads(1)
    model_name, windows, decays, cap = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    baselines = sys.argv[5].split(",") if len(sys.argv) > 5 else []
    model, tokenizer = load_model(model_name)
    policy = load_policy(default_policy(MODELS[model_name].model_id))
    rows = []
    with torch.no_grad():
        for name, count in parse_windows(windows.split(",")).items():
            for window in corpus_windows(tokenizer, name, count, 1024, 2048, 0, 0.12, held_out=True):
                rows.append(
                    window_row(model, policy, window, [float(d) for d in decays.split(",")], cap, baselines)
                )
                print(json.dumps(rows[-1]), flush=True)
    write_window_results(
        Path(__file__).with_name(f"age_decay_validation_{model_name}_{cap}.json"),
        provenance(model_name, "float32", "cpu", policy, sys.argv),
        {"windows": windows, "decays": decays, "cap": cap, "prompt": 1024, "continuation": 2048},
        rows,
    )


if __name__ == "__main__":
    main()
