"""Adaptive budgets, measured side by side: KV bytes, peak memory and decode speed of the ragged
per-head cache (``allocation="head"``/``"layer"``) against the uniform cache and ``DynamicCache``.

    .venv/bin/python bench/bench_allocation.py [--prompt-tokens 2048] [--decode-tokens 256]
                                                [--budget 0.25] [--threads 1] [--json runs/alloc.json]

SmolLM2 with its shipped policy reads the first ``--prompt-tokens`` tokens of the KJV corpus, then
decodes ``--decode-tokens`` greedy tokens one forward at a time. For memory, each cache runs in its
own process, so its peak resident memory above the loaded model (Linux ``VmHWM``, reset after
loading) is its own. For speed, one process holds all four caches and decodes one token in each in
turn, so a busy machine slows them alike. Reported per cache:

- ``kv_bytes``: every tensor the cache holds after the prefill (``KVPCache.kv_bytes()``);
- ``entry_bytes``: the keys and values of the entries it keeps, and ``overhead`` = ``kv_bytes /
  entry_bytes - 1`` (validity, stored scores, counters; for the ragged cache also the padding, of
  which there is none);
- ``peak_mib``: the process's peak resident memory during prefill and decoding, above the model;
- ``prefill_s`` (in its own process) and ``decode_tok_s`` (median step, interleaved), and the ratios
  to ``DynamicCache`` and uniform.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/x.py` also imports eval/
from eval.realtext import corpus_tokens  # noqa: E402
from kvp_cache import KVPCache
from kvp_cache.cache import cache_bytes
from kvp_cache.compat import cache_kwarg
from kvp_cache.models import MODELS, load_model
from kvp_cache.provenance import provenance

POLICY = "smollm2-135m-instruct"
CACHES = ("dynamic", "uniform", "layer", "head")


def resident_kib(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (peak) of this process, in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set size (VmHWM)


def make_cache(model, name: str, budget: float):
    if name == "dynamic":
        return DynamicCache(config=model.config)
    return KVPCache.from_pretrained(POLICY, model=model, budget=budget, allocation=name)


def entry_bytes(cache) -> int:
    """Bytes of the keys and values alone (what any layout must hold for the kept entries)."""
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            total += t.numel() * t.element_size()
    return total


def load(prompt_tokens: int, threads: int):
    torch.set_num_threads(threads)
    model, tokenizer = load_model("smollm2")
    return model, corpus_tokens("kjv", tokenizer)[None, :prompt_tokens]


@torch.no_grad()
def memory_of(name: str, prompt_tokens: int, decode_tokens: int, budget: float, threads: int) -> dict:
    """One cache alone in this process: its bytes and the peak memory of prefill and decoding."""
    model, prompt = load(prompt_tokens, threads)
    cache = make_cache(model, name, budget)
    kwargs = {cache_kwarg(model): cache}
    base_kib = resident_kib("VmRSS")
    reset_peak()
    start = time.perf_counter()
    token = model(prompt, logits_to_keep=1, **kwargs).logits[:, -1:].argmax(-1)
    prefill_s = time.perf_counter() - start
    kv, kept = cache_bytes(cache), entry_bytes(cache)
    for _ in range(decode_tokens):
        token = model(token, **kwargs).logits[:, -1:].argmax(-1)
    counts = [list(layer.lengths) for layer in cache.evicting_layers] if name in ("layer", "head") else None
    return {
        "cache": name,
        "prefill_s": prefill_s,
        "kv_bytes": kv,
        "entry_bytes": kept,
        "overhead": kv / kept - 1,
        "peak_mib": (resident_kib("VmHWM") - base_kib) / 1024,
        "head_counts": counts,
    }


@torch.no_grad()
def interleaved_speed(
    prompt_tokens: int, decode_tokens: int, budget: float, threads: int
) -> dict[str, float]:
    """Decoded tokens per second of every cache (median step), one step of each in turn."""
    model, prompt = load(prompt_tokens, threads)
    caches = {name: make_cache(model, name, budget) for name in CACHES}
    tokens = {
        name: model(prompt, logits_to_keep=1, **{cache_kwarg(model): cache}).logits[:, -1:].argmax(-1)
        for name, cache in caches.items()
    }
    steps = {name: [] for name in CACHES}
    for _ in tqdm(range(decode_tokens), desc="interleaved decoding", unit="tok"):
        for name, cache in caches.items():
            start = time.perf_counter()
            tokens[name] = model(tokens[name], **{cache_kwarg(model): cache}).logits[:, -1:].argmax(-1)
            steps[name].append(time.perf_counter() - start)
    return {name: 1 / statistics.median(times) for name, times in steps.items()}


def table(rows: dict[str, dict]) -> str:
    dynamic, uniform = rows["dynamic"], rows["uniform"]
    lines = [
        "| cache | KV MiB | overhead | peak MiB | prefill s | decode tok/s | KV vs dynamic | speed vs dynamic "
        "| speed vs uniform |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['kv_bytes'] / 2**20:.2f} | {100 * r['overhead']:.2f}% | {r['peak_mib']:.0f} | "
            f"{r['prefill_s']:.2f} | {r['decode_tok_s']:.1f} | {r['kv_bytes'] / dynamic['kv_bytes']:.3f} | "
            f"{r['decode_tok_s'] / dynamic['decode_tok_s']:.2f} | {r['decode_tok_s'] / uniform['decode_tok_s']:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the box is shared)")
    parser.add_argument("--json", type=Path, help="write the provenance and every row here")
    parser.add_argument("--one", choices=CACHES, help=argparse.SUPPRESS)  # the child process's cache
    args = parser.parse_args(argv)
    if args.prompt_tokens < 64 or args.decode_tokens < 1 or not 0 < args.budget <= 1:
        parser.error("--prompt-tokens must be >= 64, --decode-tokens >= 1 and --budget in (0, 1]")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    settings = [str(args.prompt_tokens), str(args.decode_tokens), str(args.budget), str(args.threads)]
    if args.one:
        print(
            json.dumps(memory_of(args.one, args.prompt_tokens, args.decode_tokens, args.budget, args.threads))
        )
        return
    rows = {}
    for name in tqdm(CACHES, desc="memory, one process per cache"):
        child = [sys.executable, __file__, "--one", name, "--prompt-tokens", settings[0]]
        child += ["--decode-tokens", settings[1], "--budget", settings[2], "--threads", settings[3]]
        out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
        rows[name] = json.loads(out.strip().splitlines()[-1])
    speed = interleaved_speed(args.prompt_tokens, args.decode_tokens, args.budget, args.threads)
    for name, tokens_per_s in speed.items():
        rows[name]["decode_tok_s"] = tokens_per_s
    print(
        f"SmolLM2, {args.prompt_tokens}-token KJV prompt, budget {args.budget}, {args.decode_tokens} decoded "
        f"tokens, {args.threads} thread(s):"
    )
    print(table(rows))
    if args.json:
        record = {
            "provenance": provenance(MODELS["smollm2"].model_id, torch.float32, "cpu", policy=POLICY),
            "settings": vars(args) | {"json": None},
            "rows": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
