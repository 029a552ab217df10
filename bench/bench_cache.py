"""KVPCache overheads on SmolLM2-135M-Instruct, CPU: every method side by side with a full DynamicCache.

    .venv/bin/python bench/bench_cache.py [--context-tokens 4096] [--budget 0.25] [--methods knorm snapkv]
                                          [--repeats 3] [--decode-tokens 64] [--threads 1] [--json out.json]

The prompt is one RULER ``niah_single`` sample (kvp_cache.ruler) of ``--context-tokens`` tokens over
RULER's noise sentences (Paul Graham essays with ``--essays DIR``) in
the chat template. For each repeat, configurations run in a fixed interleaved order (full, then
each method), each in a FRESH SUBPROCESS, which:

1. loads the model, then warms up the same cache type on a 256-token prompt (kernels, thread pools,
   lazy scorer state), so one-off costs are not billed to the measured run;
2. resets the kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs``, Linux) and reads the
   current RSS; runs the prefill ``model(ids, cache=..., logits_to_keep=1)`` (as ``generate`` does:
   no [seq, vocab] logits), timed with ``perf_counter``, while a wrapper around
   ``EvictingLayer._evict`` sums the time spent scoring and evicting (all layers);
3. reads the peak RSS (``VmHWM``): ``peak delta = VmHWM - RSS before``, the real resident memory the
   prefill and compression needed on top of the loaded model (activations, attention, the cache,
   captured queries), with no allocator instrumentation to distort it;
4. records the cache's bytes (``KVPCache.kv_bytes()``, metadata included; keys + values of every
   DynamicCache layer) and greedily decodes ``--decode-tokens`` tokens, timed.

Reported ratios (medians over repeats; each method against the full-cache median):

- evict / prefill: ``_evict`` time over the prefill time of the same run, so both come from one
  process under the same machine load. This is the scoring+eviction cost itself; target <= 1% for
  the key/value-only methods. Query-aware methods (tova, snapkv, h2o, expected_attention) also pay
  for the query capture inside the forward, which only shows in:
- prefill overhead: KVPCache prefill time / DynamicCache prefill time - 1 (eviction, hooks and
  capture included; across processes, so on a shared machine this difference of two ~equal times
  is the noisier one).
- KV ratio: compressed cache bytes / full cache bytes after the prefill; target <= budget x 1.01
  (the kept ``ceil(budget x n)`` entries plus at most 1% metadata).
- peak ratio: peak delta with KVPCache / peak delta with DynamicCache; target <= 1.05.
- decode ratio: decode tokens/s with the compressed cache / with the full cache.

Method ``kvp`` uses the shipped ``smollm2-135m-instruct`` policy. Every cache comes from the one
factory, ``KVPCache(model, method=..., policy=..., budget=...)``.

Threads: ``--threads 1`` by default. On a machine shared with other jobs, torch's OpenMP threads
spin against each other: on the 2-core dev box under load, 2 threads made a 512-token prefill 6x
and decoding 12x slower than 1 thread. Use ``--threads N`` on a dedicated machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, DynamicCache

from kvp_cache import KVPCache, available_methods, ruler, scorers
from kvp_cache.cache import EvictingLayer, cache_bytes
from kvp_cache.compat import cache_kwarg
from kvp_cache.models import MODELS, load_model
from kvp_cache.policy import shipped_policies
from kvp_cache.provenance import portable_path, provenance

FULL = "full"
KV_ONLY_TARGET = 0.01  # evict / prefill for key/value-only methods
KV_METADATA_TARGET = 0.01  # compressed bytes <= budget x full x (1 + this)
PEAK_TARGET = 1.05
WARMUP_TOKENS = 256
POLICY = "smollm2-135m-instruct"  # the shipped policy for SmolLM2 (method kvp)


@dataclass
class Run:
    """One configuration measured in one subprocess."""

    config: str
    prefill_s: float
    evict_s: float
    kv_bytes: int
    peak_delta_bytes: int
    decode_tokens_per_s: float


# ---------------------------------------------------------------------------------------------
# Child: one configuration in a fresh process.


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1))


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as error:
        raise SystemExit(f"peak RSS needs Linux /proc/self/clear_refs (kernel >= 4.0): {error}") from error


class EvictionTimer:
    """Sums the wall time of every ``EvictingLayer._evict`` call while active."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        original = self.original = EvictingLayer._evict
        timer = self

        def timed(layer, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(layer, *args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - start

        EvictingLayer._evict = timed
        return self

    def __exit__(self, *exc):
        EvictingLayer._evict = self.original


def make_cache(model, config: str, budget):
    if config == FULL:
        return DynamicCache(config=model.config)
    policy = {"policy": POLICY} if config == "kvp" else {}
    return KVPCache(model, method=config, budget=budget, **policy)


@torch.no_grad()
def decode(model, cache, first_token: torch.Tensor, tokens: int) -> float:
    """Greedy single-token steps on a prefilled cache; returns tokens/s."""
    token = first_token
    start = time.perf_counter()
    for _ in range(tokens):
        logits = model(token, **{cache_kwarg(model): cache}).logits
        token = logits[:, -1:].argmax(-1)
    return tokens / (time.perf_counter() - start)


@torch.no_grad()
def measure(config: str, input_ids: torch.Tensor, budget, decode_tokens: int, threads: int) -> Run:
    torch.set_num_threads(threads)
    model, _ = load_model("smollm2")
    warm = make_cache(model, config, budget)
    out = model(input_ids[:, :WARMUP_TOKENS], logits_to_keep=1, **{cache_kwarg(model): warm})
    decode(model, warm, out.logits[:, -1:].argmax(-1), 2)
    del warm, out
    gc.collect()

    cache = make_cache(model, config, budget)
    _reset_peak_rss()
    rss_before = _status_kib("VmRSS")
    with EvictionTimer() as timer:
        start = time.perf_counter()
        out = model(input_ids, logits_to_keep=1, **{cache_kwarg(model): cache})
        prefill_s = time.perf_counter() - start
    peak_delta = (_status_kib("VmHWM") - rss_before) * 1024
    kv_bytes = cache_bytes(cache)
    rate = decode(model, cache, out.logits[:, -1:].argmax(-1), decode_tokens)
    return Run(config, prefill_s, timer.seconds, kv_bytes, peak_delta, rate)


def run_child(config: str, ids_path: Path, budget, decode_tokens: int, threads: int) -> Run:
    command = [sys.executable, __file__, "--child", config, "--ids", str(ids_path), "--budget", str(budget)]
    command += ["--decode-tokens", str(decode_tokens), "--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {config!r} failed:\n{done.stderr[-3000:]}")
    return Run(**json.loads(done.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------------------------------------
# Parent: prompt, schedule, table.


def build_prompt(context_tokens: int, essays: Path | None) -> tuple[torch.Tensor, str]:
    tokenizer = AutoTokenizer.from_pretrained(MODELS["smollm2"].converted_dir())
    sample = ruler.make_samples(
        "niah_single", tokenizer, context_tokens, n=1, haystack=ruler.load_haystack(essays)
    )[0]
    prompt, _ = ruler.chat_prompt(sample, tokenizer)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids, portable_path(str(essays)) if essays is not None else "RULER noise"


def summarize(runs: list[Run], methods: list[str], budget) -> dict:
    def median(config: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs if r.config == config)

    full = {f: median(FULL, f) for f in ("prefill_s", "kv_bytes", "peak_delta_bytes", "decode_tokens_per_s")}
    rows = {}
    for method in methods:
        kv_only = method in scorers.methods(query_aware=False)
        evict = statistics.median(r.evict_s / r.prefill_s for r in runs if r.config == method)
        kv_ratio = median(method, "kv_bytes") / full["kv_bytes"]
        peak = median(method, "peak_delta_bytes") / full["peak_delta_bytes"]
        rows[method] = {
            "kv_only": kv_only,
            "prefill_overhead": median(method, "prefill_s") / full["prefill_s"] - 1,
            "evict_over_prefill": evict,
            "evict_target_met": evict <= KV_ONLY_TARGET if kv_only else None,
            "kv_ratio": kv_ratio,
            "kv_target_met": kv_ratio <= budget * (1 + KV_METADATA_TARGET),
            "peak_ratio": peak,
            "peak_target_met": peak <= PEAK_TARGET,
            "decode_ratio": median(method, "decode_tokens_per_s") / full["decode_tokens_per_s"],
        }
    return {"full": full, "methods": rows}


def format_table(summary: dict, header: str, budget) -> str:
    full = summary["full"]
    lines = [
        header,
        f"full DynamicCache: prefill {full['prefill_s']:.2f} s, KV {full['kv_bytes'] / 2**20:.1f} MiB, "
        f"peak +{full['peak_delta_bytes'] / 2**20:.0f} MiB, decode {full['decode_tokens_per_s']:.1f} tok/s",
        "",
        f"{'method':<19} {'kind':<5} {'prefill ovh':>11} {'evict/prefill':>14} {'KV ratio':>13} "
        f"{'peak ratio':>12} {'decode ratio':>12}",
        f"{'':<19} {'':<5} {'':>11} {'(k/v <=1%)':>14} {f'(<={budget * (1 + KV_METADATA_TARGET):.4f})':>13} "
        f"{f'(<={PEAK_TARGET})':>12} {'':>12}",
    ]

    def mark(ok):
        return "" if ok is None else (" ok" if ok else " NO")

    for method, r in summary["methods"].items():
        lines.append(
            f"{method:<19} {'k/v' if r['kv_only'] else 'query':<5} {r['prefill_overhead']:>+10.1%} "
            f"{r['evict_over_prefill']:>11.2%}{mark(r['evict_target_met']):<3} "
            f"{r['kv_ratio']:>10.4f}{mark(r['kv_target_met']):<3} {r['peak_ratio']:>9.3f}{mark(r['peak_target_met']):<3} "
            f"{r['decode_ratio']:>12.2f}"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context-tokens", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.25, help="fraction of the prompt kept, in (0, 1]")
    parser.add_argument("--methods", nargs="+", help="default: every kvp_cache.available_methods()")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per configuration (medians)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per measurement (default 1)")
    parser.add_argument(
        "--essays", type=Path, help="Paul Graham essays *.txt as haystack (default: RULER noise)"
    )
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--ids", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.budget <= 1:
        parser.error(f"--budget must be in (0, 1], got {args.budget}")
    for name in ("context_tokens", "repeats", "decode_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    known = available_methods()
    unknown = sorted(set(args.methods or []) - set(known))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; available: {', '.join(known)}")
    args.methods = args.methods or known
    if "kvp" in args.methods and POLICY not in shipped_policies():
        parser.error(f"method kvp needs the shipped policy {POLICY!r}; shipped: {shipped_policies()}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        run = measure(args.child, torch.load(args.ids), args.budget, args.decode_tokens, args.threads)
        print(json.dumps(asdict(run)))
        return
    from tqdm.auto import tqdm

    ids, haystack = build_prompt(args.context_tokens, args.essays)
    configs = [FULL, *args.methods]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        ids_path = Path(tmp) / "ids.pt"
        torch.save(ids, ids_path)
        with tqdm(total=len(configs) * args.repeats, desc="Measuring", unit="run") as bar:
            for _ in range(args.repeats):
                for config in configs:
                    bar.set_postfix_str(config)
                    runs.append(run_child(config, ids_path, args.budget, args.decode_tokens, args.threads))
                    bar.update(1)
    summary = summarize(runs, args.methods, args.budget)
    header = (
        f"SmolLM2-135M-Instruct, CPU ({args.threads} thread(s)), prompt {ids.shape[1]} tokens "
        f"(niah_single over {haystack}), budget {args.budget}, {args.repeats} repeat(s), "
        f"{args.decode_tokens} decode tokens"
    )
    print(format_table(summary, header, args.budget))
    if args.json:
        policy = POLICY if "kvp" in args.methods else None
        record = {"provenance": provenance(MODELS["smollm2"].model_id, torch.float32, "cpu", policy=policy)}
        record.update(settings={k: str(v) for k, v in vars(args).items()}, prompt_tokens=ids.shape[1])
        record.update(runs=[asdict(r) for r in runs], summary=summary)
        args.json.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
