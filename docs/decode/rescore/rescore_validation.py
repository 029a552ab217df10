"""KVP under a decode-time cap: each token scored once as it enters (the default) against every held
entry scored again at each eviction (``rescore=True``). SmolLM2, the shipped policy, validation text.

The windows are held-out documents of the training corpora (``train.calibrate.corpus_windows`` with
``held_out=True``, as ``python -m eval.headroom`` cuts them), never the benchmark's held-out corpora,
the Python standard library or ``/usr/share``. Each window's first 1,024 tokens are prefilled, then its
next 2,048 are read in chunks of 16 through ``max_cache_tokens`` (evict_every 64), as the benchmark's
``decode`` protocol reads them; the score is the mean NLL increase per token over the uncapped cache.

Run from the repository root: ``PYTHONPATH=. python docs/decode/rescore/rescore_validation.py`` (resumes; about
3 minutes per window on one CPU thread); writes ``rescore_validation.json`` next to this file.
"""

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from eval.realtext import continuation_nll
from eval.stats import bootstrap_interval
from kvp_cache import KVPCache
from kvp_cache.models import load_model
from kvp_cache.policy import load_policy
from kvp_cache.prefill import prefill
from kvp_cache.provenance import provenance
from train.calibrate import corpus_windows

POLICY = "smollm2-135m-instruct"
PROMPT, CONTINUATION, CHUNK, EVICT_EVERY = 1024, 2048, 16, 64
METHODS = ("kvp", "kvp_rescore", "snapkv")
OUT = Path(__file__).with_name("rescore_validation.json")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--windows", default="code=3,native_code=3,docs=2,dialogue=2", help="CORPUS=COUNT,..."
    )
    parser.add_argument("--caps", default="256,512", help="max_cache_tokens values, comma-separated")
    return parser.parse_args()


def summary(rows: list[dict], caps: list[int]) -> dict:
    """Pooled mean NLL increase of every method and cap, and rescore's paired difference to each."""
    result = {}
    for cap in caps:
        scores = {m: torch.tensor([r[f"{m}@{cap}"] for r in rows]) for m in METHODS}
        sources = sorted({r["source"] for r in rows})
        by_source = {
            source: {m: s[[r["source"] == source for r in rows]].mean().item() for m, s in scores.items()}
            for source in sources
        }
        paired = {}
        for method, s in scores.items():
            if method != "kvp_rescore":
                difference = scores["kvp_rescore"] - s
                paired[method] = {
                    "mean": difference.mean().item(),
                    "interval": bootstrap_interval(difference.tolist()),
                }
        result[str(cap)] = {
            "mean": {m: s.mean().item() for m, s in scores.items()},
            "by_source": by_source,
            "rescore_minus": paired,
        }
    return result


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    caps = [int(c) for c in args.caps.split(",")]
    windows = {name: int(count) for name, count in (spec.split("=") for spec in args.windows.split(","))}
    model, tokenizer = load_model("smollm2")
    policy = load_policy(POLICY)  # loaded once, shared by every kvp cache
    options = {
        "kvp": {"method": "kvp", "policy": policy},
        "kvp_rescore": {"method": "kvp", "policy": policy, "rescore": True},
        "snapkv": {"method": "snapkv"},
    }
    header = provenance("smollm2", "float32", "cpu", policy, sys.argv)
    record = json.loads(OUT.read_text()) if OUT.exists() else {"rows": []}
    done = {r["window"] for r in record["rows"]}
    examples = [
        e
        for name, count in windows.items()
        for e in corpus_windows(tokenizer, name, count, PROMPT, CONTINUATION, 0, 0.12, held_out=True)
    ]
    with torch.no_grad():
        for example in tqdm([e for e in examples if e.uid not in done], desc="windows", unit="window"):
            ids = torch.tensor([example.prompt_ids + example.future_ids])
            prefilled = prefill(model, ids[:, :PROMPT])
            continuation = ids[:, PROMPT:]
            full = float(
                continuation_nll(
                    model, prefilled, copy.deepcopy(prefilled.cache), continuation, chunk_tokens=CHUNK
                )
            )
            row = {"window": example.uid, "source": example.source, "full_nll": full}
            for cap in caps:
                for method in METHODS:
                    cache = KVPCache.from_prefill(
                        prefilled,
                        model,
                        budget=1.0,
                        max_cache_tokens=cap,
                        evict_every=EVICT_EVERY,
                        **options[method],
                    )
                    nll = float(continuation_nll(model, prefilled, cache, continuation, chunk_tokens=CHUNK))
                    row[f"{method}@{cap}"] = nll - full
            record["rows"].append(row)
            record["provenance"] = header
            record["summary"] = summary(record["rows"], caps)
            OUT.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(record["summary"], indent=1))


if __name__ == "__main__":
    main()
