"""KVP under a decode-time cap: each token scored once as it enters (the default) against every held
entry scored again at each eviction (``rescore=True``), with the model's shipped policy, on validation text.

The windows are held-out documents of the training corpora (``train.calibrate.corpus_windows`` with
``held_out=True``, as ``python -m eval.headroom`` cuts them), never the benchmark's held-out corpora,
the Python standard library or ``/usr/share``. Each window's first 1,024 tokens are prefilled, then its
next 2,048 are read in chunks of 16 through ``max_cache_tokens`` (evict_every 64), as the benchmark's
``decode`` protocol reads them; the score is the mean NLL increase per token over the uncapped cache.

Run from the repository root: ``PYTHONPATH=. python docs/decode/rescore/rescore_validation.py`` (resumes; about
3 minutes per window on one CPU thread); writes ``rescore_validation.json`` next to this file, or
``rescore_validation_<model>.json`` for another ``--model``. Gemma 3's windows start with its BOS
(``train.data.text_examples``), which the prefill keeps.
"""

import argparse
import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from eval.realtext import continuation_nll
from eval.stats import bootstrap_interval
from kvp_cache import KVPCache
from kvp_cache.demo import default_policy
from kvp_cache.models import MODELS, load_model
from kvp_cache.policy import load_policy
from kvp_cache.prefill import prefill
from kvp_cache.provenance import provenance
from train.calibrate import corpus_windows
from train.collect import parse_windows
from train.data import Example

CHUNK, EVICT_EVERY = 16, 64


def common_arguments(description: str, windows: str, methods: str, lengths: tuple[int, int]):
    """The arguments of every experiment here; ``windows``, ``methods`` and ``lengths`` (prompt,
    continuation) are its defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--windows", default=windows, help="CORPUS=COUNT,...")
    parser.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    parser.add_argument(
        "--methods",
        default=methods,
        help="comma-separated: kvp (scored once), kvp_rescore, any baseline method",
    )
    parser.add_argument("--prompt-tokens", type=int, default=lengths[0])
    parser.add_argument("--continuation-tokens", type=int, default=lengths[1])
    return parser


def method_options(methods: list[str], policy) -> dict[str, dict]:
    """``KVPCache`` options of each method name: ``kvp`` (each token scored once), ``kvp_rescore``, or
    a baseline's registry name. Both KVP rows rank without ``age_decay``, as the records here were
    measured before the shipped policies carried one."""
    learned = {
        "kvp": {"method": "kvp", "policy": policy, "age_decay": 0.0},
        "kvp_rescore": {"method": "kvp", "policy": policy, "rescore": True, "age_decay": 0.0},
    }
    return {m: learned.get(m, {"method": m}) for m in methods}


def summary(rows: list[dict], settings: list, methods: list[str]) -> dict:
    """Pooled mean NLL increase of every method and setting (cap or budget: rows name answers
    ``<method>@<setting>``), and rescore's paired difference to each."""
    result = {}
    for setting in settings:
        scores = {m: torch.tensor([r[f"{m}@{setting}"] for r in rows]) for m in methods}
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
        result[str(setting)] = {
            "mean": {m: s.mean().item() for m, s in scores.items()},
            "by_source": by_source,
            "rescore_minus": paired,
        }
    return result


Measure = Callable[[object, Example, dict[str, dict]], dict]
"""``(model, window, options of each method) -> {"full_nll": nll, "<method>@<setting>": increase}``."""


def run(args: argparse.Namespace, stem: str, settings: list, measure: Measure) -> None:
    """Measure every validation window not yet in ``<stem>[_<model>].json`` next to this file, writing
    the record with its provenance and summary after each. A record of other settings is refused."""
    torch.set_num_threads(1)
    methods = args.methods.split(",")
    windows = parse_windows(args.windows.split(","))
    model, tokenizer = load_model(args.model)
    # Loaded once, shared by every kvp cache.
    policy = load_policy(default_policy(MODELS[args.model].model_id))
    options = method_options(methods, policy)
    header = provenance(args.model, "float32", "cpu", policy, sys.argv)
    suffix = "" if args.model == "smollm2" else f"_{args.model}"
    out = Path(__file__).with_name(f"{stem}{suffix}.json")
    settings_of_rows = vars(args)
    record = json.loads(out.read_text()) if out.exists() else {"rows": [], "settings": settings_of_rows}
    if record.get("settings", settings_of_rows) != settings_of_rows:
        # Windows are cut anew for each count, so the same name can be another window.
        raise SystemExit(
            f"{out} was measured with {record['settings']}, not {settings_of_rows}: move it away"
        )
    record["settings"] = settings_of_rows
    done = {r["window"] for r in record["rows"]}
    examples = [
        e
        for name, count in windows.items()
        for e in corpus_windows(
            tokenizer, name, count, args.prompt_tokens, args.continuation_tokens, 0, 0.12, held_out=True
        )
    ]
    with torch.no_grad():
        for example in tqdm([e for e in examples if e.uid not in done], desc="windows", unit="window"):
            row = {"window": example.uid, "source": example.source, **measure(model, example, options)}
            record["rows"].append(row)
            record["provenance"] = header
            record["summary"] = summary(record["rows"], settings, methods)
            out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(record["summary"], indent=1))


def main() -> None:
    parser = common_arguments(__doc__.split("\n")[0], "code=3,native_code=3,docs=2,dialogue=2",
                              "kvp,kvp_rescore,snapkv", (1024, 2048))  # fmt: skip
    parser.add_argument("--caps", default="256,512", help="max_cache_tokens values, comma-separated")
    args = parser.parse_args()
    caps = [int(c) for c in args.caps.split(",")]

    def measure(model, example: Example, options: dict[str, dict]) -> dict:
        prefilled = prefill(model, torch.tensor([example.prompt_ids]))
        continuation = torch.tensor([example.future_ids])

        def nll(cache) -> float:
            return float(continuation_nll(model, prefilled, cache, continuation, chunk_tokens=CHUNK))

        full = nll(copy.deepcopy(prefilled.cache))
        row = {"full_nll": full}
        for cap in caps:
            for method, chosen in options.items():
                cache = KVPCache.from_prefill(
                    prefilled, model, budget=1.0, max_cache_tokens=cap, evict_every=EVICT_EVERY, **chosen
                )
                row[f"{method}@{cap}"] = nll(cache) - full
        return row

    run(args, "rescore_validation", caps, measure)


if __name__ == "__main__":
    main()
