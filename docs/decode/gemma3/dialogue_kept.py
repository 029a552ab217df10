"""What the Gemma 3 policies keep on dialogue, where they lose the most (issue 29, twelfth session).

Validation windows only (held-out documents of the training corpora, as ``python -m eval.headroom``
cuts them; never the benchmark's held-out corpora): a 2,048-token prompt and its next 128 tokens, one
eviction at 10% after the prefill. For every method: the NLL increase per token over the full cache,
the share of the kept entries in the prompt's last and first 10% of positions (mean over the 3
global layers); for the shipped policy, the tokens it keeps beyond the sinks and the recent window
most often relative to their frequency in the prompt.

Run from the repository root: ``PYTHONPATH=. python docs/decode/gemma3/dialogue_kept.py [CORPUS
COUNT]`` (default ``dialogue 3``; about a minute per window on one CPU thread). Writes
``dialogue_kept_<corpus>.json`` next to this file.
"""

import collections
import copy
import json
import sys
from pathlib import Path

import torch

from eval.realtext import continuation_nll
from kvp_cache import KVPCache
from kvp_cache.models import load_model
from kvp_cache.policy import load_policy
from kvp_cache.prefill import prefill
from kvp_cache.provenance import provenance
from train.calibrate import corpus_windows

BUDGET, SINKS, WINDOW = 0.1, 4, 16


def kept_share(positions: list[torch.Tensor], low: float, high: float) -> float:
    """The share of kept entries at positions in ``[low, high)``, the mean over the evicting layers
    (``positions``: each layer's kept positions, ``[slots]``)."""
    return sum(float(((p >= low) & (p < high)).float().mean()) for p in positions) / len(positions)


def main() -> None:
    torch.set_num_threads(1)
    corpus = sys.argv[1] if len(sys.argv) > 1 else "dialogue"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    model, tokenizer = load_model("gemma3-270m")
    shipped = load_policy("gemma3-270m")
    methods = {
        "kvp": dict(method="kvp", policy=shipped),
        "kvp_first_fit": dict(method="kvp", policy=load_policy("docs/gemma3/first_fit_policy")),
        **{name: dict(method=name) for name in ("streaming_llm", "snapkv", "tova", "random")},
    }
    rows, kept, seen = [], collections.Counter(), collections.Counter()
    with torch.no_grad():
        for window in corpus_windows(tokenizer, corpus, count, 2048, 128, 0, 0.12, held_out=True):
            ids, continuation = torch.tensor([window.prompt_ids]), torch.tensor([window.future_ids])
            prefilled = prefill(model, ids)
            full = float(continuation_nll(model, prefilled, copy.deepcopy(prefilled.cache), continuation))
            n, row = ids.shape[1], {"window": window.uid}
            for name, options in methods.items():
                cache = KVPCache.from_prefill(
                    prefilled, model, budget=BUDGET, track_positions=True, **options
                )
                positions = [layer.positions[0, 0] for layer in cache.evicting_layers]
                row[name] = {
                    "nll_increase": float(continuation_nll(model, prefilled, cache, continuation)) - full,
                    "kept_in_last_10pct": kept_share(positions, 0.9 * n, n),
                    "kept_in_first_10pct": kept_share(positions, SINKS, 0.1 * n),
                }
                if name == "kvp":  # counted per evicting layer, like the kept tokens
                    prompt = tokenizer.convert_ids_to_tokens(ids[0, SINKS : n - WINDOW].tolist())
                    seen.update({t: c * len(positions) for t, c in collections.Counter(prompt).items()})
                    for p in positions:
                        old = p[(p >= SINKS) & (p < n - WINDOW)]
                        kept.update(tokenizer.convert_ids_to_tokens(ids[0, old].tolist()))
            rows.append(row)
            print(json.dumps(row), flush=True)
    share = {
        t: (kept[t] / sum(kept.values())) / (seen[t] / sum(seen.values())) for t in kept if seen[t] >= 20
    }
    over_kept = sorted(share, key=share.get, reverse=True)[:15]
    summary = {
        name: {key: sum(r[name][key] for r in rows) / len(rows) for key in rows[0][name]} for name in methods
    }
    result = {
        "provenance": provenance("gemma3-270m", "float32", "cpu", shipped, sys.argv),
        "settings": {
            "corpus": corpus,
            "windows": count,
            "budget": BUDGET,
            "prompt": 2048,
            "continuation": 128,
        },
        "summary": summary,
        "kvp_over_kept": [
            {
                "token": t,
                "kept_over_frequency": round(share[t], 2),
                "kept": kept[t],
                "kept_share": round(kept[t] / sum(kept.values()), 3),
            }
            for t in over_kept
        ],
        "rows": rows,
    }
    out = Path(__file__).with_name(f"dialogue_kept_{corpus}.json")
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result["summary"], indent=1))
    print(json.dumps(result["kvp_over_kept"]))


if __name__ == "__main__":
    main()
