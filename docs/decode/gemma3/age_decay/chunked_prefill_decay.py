"""KVP's ``age_decay`` on a prompt read in chunks, on validation text (fourteenth session).

The shipped policies rank with ``age_decay=0.5``, chosen under a decode-time cap. The default
``compress="every_prefill"`` also evicts again after each multi-token forward (later turns, a prompt
streamed in chunks), where the earlier chunks' entries are older: this checks that the decay does
not hurt there. Each window's first 2,048 tokens are read in 4 forwards, each ending with an
eviction to the budget's share of the tokens seen; then its next 128 tokens are scored in one
forward (``docs/decode/rescore/chunked_prefill.py``). The score is the mean NLL increase per token
over the uncompressed cache. The windows are held-out documents of the training corpora, never the
benchmark's held-out corpora.

Run from the repository root: ``PYTHONPATH=. python docs/decode/gemma3/age_decay/chunked_prefill_decay.py
MODEL WINDOWS DECAYS BUDGETS [BASELINES]``, e.g. ``smollm2 code=3,native_code=3,docs=3,dialogue=3 0,0.5
0.1,0.25 snapkv``; prints a row per window and writes ``chunked_prefill_decay_<model>.json`` next to
this file.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

from docs.decode.rescore.chunked_prefill import chunked_nll
from eval.stats import write_window_results
from kvp_cache import KVPCache
from kvp_cache.compat import text_config
from kvp_cache.demo import default_policy
from kvp_cache.models import MODELS, load_model
from kvp_cache.policy import load_policy
from kvp_cache.provenance import provenance
from train.calibrate import corpus_windows
from train.collect import parse_windows

CHUNKS, PROMPT, CONTINUATION = 4, 2048, 128


def window_row(
    model, policy, window, decays: list[float], budgets: list[float], baselines: list[str]
) -> dict:
    """One window's NLL increase over the uncompressed cache for KVP at every decay and each baseline."""
    prompt, continuation = torch.tensor([window.prompt_ids]), torch.tensor([window.future_ids])

    def nll(cache) -> float:
        return chunked_nll(model, cache, prompt, CHUNKS, continuation)

    full = nll(DynamicCache(config=text_config(model.config)))
    row = {"window": window.uid, "source": window.source}
    for budget in budgets:
        for decay in decays:
            cache = KVPCache(model, method="kvp", policy=policy, age_decay=decay, budget=budget)
            row[f"kvp@{decay:g}@{budget:g}"] = nll(cache) - full
        for method in baselines:
            row[f"{method}@{budget:g}"] = nll(KVPCache(model, method=method, budget=budget)) - full
    return row


def main() -> None:
    torch.set_num_threads(1)
    model_name, windows, decays, budgets = sys.argv[1:5]
    baselines = sys.argv[5].split(",") if len(sys.argv) > 5 else []
    decays, budgets = [float(d) for d in decays.split(",")], [float(b) for b in budgets.split(",")]
    model, tokenizer = load_model(model_name)
    policy = load_policy(default_policy(MODELS[model_name].model_id))
    rows = []
    with torch.no_grad():
        for name, count in parse_windows(windows.split(",")).items():
            for window in corpus_windows(
                tokenizer, name, count, PROMPT, CONTINUATION, 0, 0.12, held_out=True
            ):
                rows.append(window_row(model, policy, window, decays, budgets, baselines))
                print(json.dumps(rows[-1]), flush=True)
    write_window_results(
        Path(__file__).with_name(f"chunked_prefill_decay_{model_name}.json"),
        provenance(model_name, "float32", "cpu", policy, sys.argv),
        {
            "windows": windows,
            "decays": decays,
            "budgets": budgets,
            "chunks": CHUNKS,
            "prompt": PROMPT,
            "continuation": CONTINUATION,
        },
        rows,
    )


if __name__ == "__main__":
    main()
