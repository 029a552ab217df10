"""KV memory of the whole Gemma 3 270M at long contexts: sliding layers, global layers before and after
compression, and the ratio of KVPCache to DynamicCache, measured in one run.

    .venv/bin/python bench/bench_memory.py [--model gemma3-270m] [--lengths 4096 16384 32768]
                                           [--budgets 0.1 0.25 0.5] [--chunk 1024] [--threads 1]
                                           [--json runs/bench_memory.json]

One prompt of ``max(--lengths)`` tokens (BOS + RULER's noise sentences, or the Paul Graham essays of
``--essays DIR``, repeated) is prefilled once into a ``DynamicCache``, ``--chunk`` tokens per forward so the
attention scores of one forward stay small (a forward over 32K tokens at once would materialize
[heads, 32K, 32K] scores on CPU). When the prefill reaches each length, the cache is copied, and for
each budget ``KVPCache.from_prefill`` compresses the copy with the KVP policy shipped for the model
(``--policy`` for another; its sha256 goes in the JSON's provenance). Bytes are read off the tensors
the caches hold (``KVPCache.kv_bytes()`` counts its per-slot metadata too): the sliding-window
layers keep their last ``window - 1`` tokens whatever the context, the global layers keep every
token in a ``DynamicCache`` and ``ceil(budget x n)`` in a ``KVPCache``, so at long contexts the
global layers dominate and the savings show there.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from kvp_cache import KVPCache, ruler
from kvp_cache.budget import validate_budget
from kvp_cache.cache import layer_bytes
from kvp_cache.compat import cache_kwarg, text_config
from kvp_cache.demo import default_policy
from kvp_cache.models import MODELS, load_model
from kvp_cache.policy import KVPolicy, load_policy
from kvp_cache.prefill import Prefill
from kvp_cache.provenance import provenance

MIB = 2**20


@dataclass
class Row:
    """KV bytes of the whole model at one context length and budget."""

    tokens: int
    budget: float
    sliding_bytes: int  # every sliding-window layer (the same in both caches)
    global_full_bytes: int  # the global layers of the DynamicCache
    global_compressed_bytes: int  # the global layers of the KVPCache, metadata included
    dynamic_bytes: int
    kvp_bytes: int
    prefill_seconds: float  # wall time of the prefill up to ``tokens`` (cumulative)

    @property
    def ratio(self) -> float:
        return self.kvp_bytes / self.dynamic_bytes

    @property
    def global_share(self) -> float:
        """Share of the DynamicCache's bytes held by the global layers."""
        return self.global_full_bytes / self.dynamic_bytes


def essay_ids(tokenizer, tokens: int, essays: Path | None) -> torch.Tensor:
    """``[1, tokens]``: BOS, then the haystack text (repeated if it is shorter)."""
    text = ruler.load_haystack(essays)
    body = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    body = body.repeat(-(-tokens // body.numel()))
    return torch.cat([torch.tensor([tokenizer.bos_token_id]), body])[:tokens][None]


def measure(
    model,
    tokenizer,
    policy: KVPolicy,
    lengths: list[int],
    budgets: list[float],
    chunk: int,
    essays: Path | None,
) -> list[Row]:
    input_ids = essay_ids(tokenizer, max(lengths), essays)
    cache = DynamicCache(config=text_config(model.config))
    rows, start, seen = [], time.perf_counter(), 0
    with torch.no_grad(), tqdm(total=max(lengths), desc="Prefill", unit="tok") as bar:
        for length in sorted(lengths):
            while seen < length:
                step = input_ids[:, seen : min(seen + chunk, length)]
                out = model(input_ids=step, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
                seen += step.shape[1]
                bar.update(step.shape[1])
            seconds = time.perf_counter() - start
            prefilled = Prefill(
                copy.deepcopy(cache), {}, input_ids[:, :length], None, out.logits[:, -1].float()
            )
            rows += [compress(model, prefilled, policy, budget, seconds) for budget in budgets]
    return rows


def compress(model, prefilled: Prefill, policy: KVPolicy, budget: float, seconds: float) -> Row:
    kvp = KVPCache.from_prefill(prefilled, model, method="kvp", policy=policy, budget=budget)
    evicting = {layer.layer_idx for layer in kvp.evicting_layers}
    full = [layer_bytes(layer) for layer in prefilled.cache.layers]
    compressed = [layer_bytes(layer) for layer in kvp.layers]
    sliding = sum(b for i, b in enumerate(full) if i not in evicting)
    if sliding != sum(b for i, b in enumerate(compressed) if i not in evicting):
        raise AssertionError("the sliding layers differ between the DynamicCache and the KVPCache")
    if sum(compressed) != kvp.kv_bytes():
        raise AssertionError("layer bytes do not add up to KVPCache.kv_bytes()")
    return Row(
        tokens=prefilled.input_ids.shape[1],
        budget=budget,
        sliding_bytes=sliding,
        global_full_bytes=sum(full) - sliding,
        global_compressed_bytes=sum(compressed) - sliding,
        dynamic_bytes=sum(full),
        kvp_bytes=sum(compressed),
        prefill_seconds=seconds,
    )


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'tokens':>7} {'budget':>6} | {'sliding':>8} {'global':>8} {'global':>8} | {'Dynamic':>8} "
        f"{'KVP':>8} {'KVP/Dyn':>7} | {'global share':>12} | {'prefill s':>9}\n"
        f"{'':>7} {'':>6} | {'MiB':>8} {'full MiB':>8} {'kept MiB':>8} | {'MiB':>8} {'MiB':>8} {'':>7} | "
        f"{'of Dynamic':>12} | {'(cumul.)':>9}"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r.tokens:>7} {r.budget:>6.2f} | {r.sliding_bytes / MIB:>8.2f} {r.global_full_bytes / MIB:>8.2f} "
            f"{r.global_compressed_bytes / MIB:>8.2f} | {r.dynamic_bytes / MIB:>8.2f} {r.kvp_bytes / MIB:>8.2f} "
            f"{r.ratio:>7.3f} | {r.global_share:>12.1%} | {r.prefill_seconds:>9.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gemma3-270m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--chunk", type=int, default=1024, help="prefill tokens per forward (default 1024)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the box is shared)")
    parser.add_argument(
        "--policy", help="KVP policy (shipped name, directory, Hub id); default: shipped for --model"
    )
    parser.add_argument("--essays", type=Path, help="Paul Graham essays *.txt (default: RULER noise)")
    parser.add_argument("--json", type=Path, help="write the provenance and every row here")
    args = parser.parse_args(argv)
    for length in args.lengths:
        if length < 2:
            parser.error(f"--lengths must be >= 2 tokens, got {length}")
    if args.chunk < 2:
        parser.error(f"--chunk must be >= 2 tokens, got {args.chunk}")
    budgets = [validate_budget(b) for b in args.budgets]
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    limit = text_config(model.config).max_position_embeddings
    if max(args.lengths) > limit:
        parser.error(f"--lengths must be <= {limit} (the model's context), got {max(args.lengths)}")
    policy = load_policy(args.policy or default_policy(MODELS[args.model].model_id))
    record = {"provenance": provenance(args.model, model.dtype, model.device, policy, command=sys.argv)}
    rows = measure(model, tokenizer, policy, args.lengths, budgets, args.chunk, args.essays)
    print(format_table(rows))
    if args.json:
        record["rows"] = [asdict(r) | {"ratio": r.ratio, "global_share": r.global_share} for r in rows]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
