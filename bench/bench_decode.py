"""Bounded memory while decoding: ``KVPCache(max_cache_tokens=N)`` against a full ``DynamicCache``.

    .venv/bin/python bench/bench_decode.py [--prompt-tokens 1024] [--generate-tokens 4096]
        [--speed-methods kvp] [--speed-cap 1024] [--continuation-tokens 2048] [--caps 256 512 1024]
        [--methods kvp knorm ...] [--evict-every 64] [--chunk 16] [--policy NAME_OR_DIR] [--threads 1]
        [--json out.json]

SmolLM2-135M-Instruct on CPU, float32. Two measurements on one long text: the start of the King
James Bible (the benchmark's ``kjv`` corpus, public domain, from the ``eval`` extra), or with
``--essays DIR`` the longest Paul Graham essay there (what ``bench/results/decode_smollm2.json`` used):

1. Speed and memory. The essay's first ``--prompt-tokens`` tokens are prefilled, then
   ``--generate-tokens`` tokens are decoded greedily, one forward per token (EOS does not stop
   it), with a full ``DynamicCache`` and with ``KVPCache(model, method=m, policy=..., budget=1.0,
   max_cache_tokens=--speed-cap, evict_every=...)`` for each ``--speed-methods``. Reported: decode
   tokens/s (time spent in the forwards only), the peak of the cache's bytes (keys, values and
   per-slot metadata, read after every forward) and whether it stays flat once the cap is
   reached (the peak over the last quarter of the generation over the peak over the second
   quarter; 1.00 = flat), and the time the scorer spent ranking the tokens that entered while
   decoding, as a share of the decode time and per decoded token.
2. Quality. The essay's next ``--continuation-tokens`` tokens after the prompt are teacher-forced
   through a capped cache, for every ``--methods`` at every ``--caps``, and the mean negative
   log-likelihood of the true tokens is reported next to the full cache's. The continuation is fed
   in chunks of ``--chunk`` tokens (a token-by-token loop is ``--chunk``x slower on CPU): each token
   attends to the cache as it stood at its chunk's start plus the chunk's earlier tokens, and the
   cache is trimmed at the end of a chunk, as after a decoding step. The prefill's own eviction
   happens at the end of the prompt, so the first continuation token is scored exactly.

``kvp`` uses ``--policy`` (default: the shipped ``smollm2-135m-instruct``) as it ships, with its own
``age_decay``; ``kvp_rescore`` is ``kvp`` with ``rescore=True`` (every held entry scored again at each
eviction) and ``kvp_no_decay`` ``kvp`` with ``age_decay=0`` (the stored scores ranked as they are). The JSON
output (``--json``) starts with ``kvp_cache.provenance.provenance(...)``. One thread by default:
the development machine's two cores are shared, and two OpenMP threads spin against each other.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/x.py` also imports eval/
from eval.realtext import continuation_nll, corpus_tokens  # noqa: E402
from kvp_cache import KVPCache, scorers
from kvp_cache.cache import cache_bytes
from kvp_cache.compat import cache_kwarg
from kvp_cache.models import MODELS, load_model
from kvp_cache.policy import shipped_policies
from kvp_cache.prefill import Prefill, prefill
from kvp_cache.provenance import portable_argument, provenance

FULL = "full"
POLICY = "smollm2-135m-instruct"  # the shipped policy for SmolLM2 (method kvp)
KVP_RESCORE = "kvp_rescore"  # method kvp with rescore=True: every held entry scored again at each eviction
KVP_NO_DECAY = "kvp_no_decay"  # method kvp with age_decay=0


def method_options(method: str, policy_name: str) -> dict:
    """``KVPCache`` keyword arguments for a method name of this script (``kvp_rescore`` and
    ``kvp_no_decay`` included)."""
    if method == KVP_RESCORE:
        return {"method": "kvp", "policy": policy_name, "rescore": True}
    if method == KVP_NO_DECAY:
        return {"method": "kvp", "policy": policy_name, "age_decay": 0.0}
    return {"method": method, "policy": policy_name} if method == "kvp" else {"method": method}


def text_ids(tokenizer, essays: Path | None, needed: int) -> tuple[torch.Tensor, str]:
    """The first ``needed`` tokens of the text, ``[1, needed]``, and its name."""
    if essays is None:
        return corpus_tokens("kjv", tokenizer)[None, :needed], "kjv"
    path = max(essays.glob("*.txt"), key=lambda p: p.stat().st_size)
    ids = tokenizer(path.read_text(), add_special_tokens=False, return_tensors="pt")["input_ids"]
    if ids.shape[1] < needed:
        raise SystemExit(f"{path} has {ids.shape[1]} tokens; lower --prompt-tokens/--continuation-tokens")
    return ids[:, :needed], path.name


def prefilled_cache(
    model, prefilled: Prefill, method: str, cap: int, evict_every: int, policy_name: str
) -> KVPCache:
    """The prompt's cache under ``method`` capped at ``cap`` (the prompt counts as the first prefill)."""
    options = method_options(method, policy_name)
    return KVPCache.from_prefill(
        prefilled, model, budget=1.0, max_cache_tokens=cap, evict_every=evict_every, **options
    )


def make_cache(model, method: str, cap: int | None, evict_every: int, policy_name: str):
    if method == FULL:
        return DynamicCache(config=model.config)
    options = method_options(method, policy_name)
    return KVPCache(model, budget=1.0, max_cache_tokens=cap, evict_every=evict_every, **options)


@contextmanager
def timed_scoring(cache):
    """Times every ``score`` call of the cache's scorer (none for ``DynamicCache``): yields a dict
    whose ``seconds`` and ``entries`` (entries scored) grow while the block runs."""
    totals = {"seconds": 0.0, "entries": 0}
    scorer = cache.settings.scorer if isinstance(cache, KVPCache) else None
    if scorer is None:
        yield totals
        return
    score = scorer.score

    def timed(keys, *args, **kwargs):
        start = time.perf_counter()
        out = score(keys, *args, **kwargs)
        totals["seconds"] += time.perf_counter() - start
        totals["entries"] += keys.shape[0] * keys.shape[-2]  # rows x tokens
        return out

    scorer.score = timed
    try:
        yield totals
    finally:
        del scorer.score  # the class's method again


@torch.no_grad()
def decode_run(model, cache, prompt: torch.Tensor, tokens: int, label: str) -> dict:
    """Prefill, then ``tokens`` greedy single-token forwards; tokens/s, the KV bytes after each, and
    the time the scorer took inside those forwards (each decoded token is scored once, when an
    eviction first needs it) as a share of the decode time."""
    kwargs = {cache_kwarg(model): cache}
    token = model(prompt, logits_to_keep=1, **kwargs).logits[:, -1:].argmax(-1)
    held, seconds = [], 0.0
    with timed_scoring(cache) as scoring:
        for _ in tqdm(range(tokens), desc=label, unit="tok", leave=False):
            start = time.perf_counter()
            logits = model(token, **kwargs).logits
            seconds += time.perf_counter() - start
            token = logits[:, -1:].argmax(-1)
            held.append(cache_bytes(cache))
    quarter = tokens // 4
    return {
        "tokens_per_s": tokens / seconds,
        "peak_kv_bytes": max(held),
        "final_kv_bytes": held[-1],
        "flatness": max(held[3 * quarter :]) / max(held[quarter : 2 * quarter]),
        "kv_bytes_every_256": held[255::256],
        "scoring_share": scoring["seconds"] / seconds,
        "scoring_ms_per_token": 1000 * scoring["seconds"] / tokens,
        "scored_entries": scoring["entries"],
    }


def speed_table(speed: dict, cap: int, evict_every: int) -> str:
    full = speed[FULL]
    lines = [
        "| cache | tokens/s | vs full | peak KV MiB | vs full | flat (last/2nd quarter) | scoring share of decode |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in speed.items():
        label = (
            "DynamicCache" if name == FULL else f"{name}, max_cache_tokens={cap}, evict_every={evict_every}"
        )
        lines.append(
            f"| {label} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / full['tokens_per_s']:.2f}x | "
            f"{r['peak_kv_bytes'] / 2**20:.1f} | {r['peak_kv_bytes'] / full['peak_kv_bytes']:.3f} | {r['flatness']:.2f} | "
            + (
                ""
                if name == FULL
                else f"{100 * r['scoring_share']:.2f}% ({r['scoring_ms_per_token']:.2f} ms/token)"
            )
            + " |"
        )
    return "\n".join(lines)


def nll_table(nll: dict, caps: list[int]) -> str:
    lines = [
        "| method | " + " | ".join(f"cap {c}" for c in caps) + " | mean rank |",
        "|---|" + "---|" * (len(caps) + 1),
    ]
    methods = [m for m in nll if m != FULL]
    ranks = {m: [] for m in methods}
    for cap in caps:
        for rank, m in enumerate(sorted(methods, key=lambda m: nll[m][str(cap)]), start=1):
            ranks[m].append(rank)
    for m in sorted(methods, key=lambda m: statistics.mean(ranks[m])):
        cells = " | ".join(f"{nll[m][str(c)]:.4f}" for c in caps)
        lines.append(f"| {m} | {cells} | {statistics.mean(ranks[m]):.1f} |")
    lines.append(f"| full DynamicCache | {nll[FULL]:.4f} (no cap) | |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    capped = scorers.methods()
    capped = [m for m in capped if scorers.SCORERS[m].scores_decoded_tokens] + [KVP_RESCORE, KVP_NO_DECAY]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--generate-tokens", type=int, default=4096)
    parser.add_argument("--speed-methods", nargs="*", default=["kvp"], choices=capped)
    parser.add_argument("--speed-cap", type=int, default=1024)
    parser.add_argument("--continuation-tokens", type=int, default=2048, help="0 skips the quality part")
    parser.add_argument("--caps", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--methods", nargs="+", default=capped, choices=capped)
    parser.add_argument("--evict-every", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=16, help="teacher-forcing chunk, <= --evict-every")
    parser.add_argument("--policy", default=POLICY, help="method kvp's policy (shipped name or directory)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--essays", type=Path, help="Paul Graham essays *.txt (default: the kjv corpus)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    for name in ("prompt_tokens", "speed_cap", "evict_every", "chunk", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("generate_tokens", "continuation_tokens"):
        if getattr(args, name) < 0 or 0 < getattr(args, name) < 8:
            parser.error(f"--{name.replace('_', '-')} must be 0 (skip) or >= 8, got {getattr(args, name)}")
    if min(args.caps) < 20:  # the default sink_tokens + window_tokens
        parser.error(f"--caps must be >= 20 (sink_tokens + window_tokens), got {args.caps}")
    if args.chunk > args.evict_every:
        parser.error(f"--chunk must be <= --evict-every ({args.evict_every}), got {args.chunk}")
    if args.essays is not None and not args.essays.is_dir():
        parser.error(f"--essays {args.essays} is not a directory of .txt essays")
    if args.policy == POLICY and POLICY not in shipped_policies():
        parser.error(f"method kvp needs the shipped policy {POLICY!r}; shipped: {shipped_policies()}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2")
    needed = args.prompt_tokens + max(args.continuation_tokens, 1)
    ids, essay = text_ids(tokenizer, args.essays, needed)
    prompt = ids[:, : args.prompt_tokens]
    record = {
        "provenance": provenance(MODELS["smollm2"].model_id, model.dtype, "cpu", policy=args.policy),
        "settings": {
            k: portable_argument(str(v)) if isinstance(v, Path) else v for k, v in vars(args).items()
        },
        "essay": essay,
    }
    if args.generate_tokens:
        speed = {}
        for method in [FULL, *args.speed_methods]:
            cache = make_cache(model, method, args.speed_cap, args.evict_every, args.policy)
            speed[method] = decode_run(model, cache, prompt, args.generate_tokens, f"decode {method}")
            del cache
        record["speed"] = speed
        print(
            f"\nDecoding {args.generate_tokens} tokens after a {args.prompt_tokens}-token prompt ({essay}):"
        )
        print(speed_table(speed, args.speed_cap, args.evict_every))
    if args.continuation_tokens:
        runs = [(FULL, None)] + [(m, c) for m in args.methods for c in args.caps]
        nll: dict = {m: {} for m in args.methods}
        prefilled = prefill(model, ids[:, : args.prompt_tokens])
        for method, cap in tqdm(runs, desc="teacher-forced NLL", unit="run"):
            cache = (
                copy.deepcopy(prefilled.cache)
                if method == FULL
                else prefilled_cache(model, prefilled, method, cap, args.evict_every, args.policy)
            )
            continuation = ids[:, args.prompt_tokens :]
            value = float(continuation_nll(model, prefilled, cache, continuation, chunk_tokens=args.chunk))
            if method == FULL:
                nll[FULL] = value
            else:
                nll[method][str(cap)] = value
        record["nll"] = nll
        print(
            f"\nMean NLL of the essay's next {args.continuation_tokens} tokens after {args.prompt_tokens} "
            f"(teacher-forced in chunks of {args.chunk}, evict_every {args.evict_every}, budget 1.0):"
        )
        print(nll_table(nll, args.caps))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
