"""Compress a document once, save it, answer from the saved cache: file size and time against recomputing.

    .venv/bin/python bench/bench_saved_cache.py [--context-tokens 2048] [--budget 0.25] [--repeats 3]
                                                [--threads 1] [--json out.json]

SmolLM2-135M-Instruct on CPU with the shipped KVP policy. The document is the demo's ``niah_single``
sample (RULER noise haystack, seed 0) with the question asked after compression: its context, in
the chat template, is prefilled into ``KVPCache(..., compress="first_prefill")`` and saved with
``cache.save_pretrained``. Reported side by side: the bytes of the full ``DynamicCache`` of the
context, the compressed cache's ``kv_bytes()`` and the saved files; the seconds to prefill and
compress the context against ``KVPCache.from_saved`` (medians of ``--repeats``); and whether the
greedy answer to the question from the reloaded cache equals the in-memory cache's token for token.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvp_cache import KVPCache, ruler
from kvp_cache.cache import cache_bytes
from kvp_cache.compat import cache_kwarg
from kvp_cache.models import MODELS, load_model
from kvp_cache.provenance import provenance

POLICY = "smollm2-135m-instruct"


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def answer(model, cache, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy tokens after ``ids`` (the context already in ``cache``, then the question)."""
    out = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 1:
        parser.error("--repeats and --new-tokens must be >= 1")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2")
    (sample,) = ruler.make_samples("niah_single", tokenizer, args.context_tokens, n=1, seed=0)
    context, question = ruler.chat_prompt(sample, tokenizer, question_in_context=False)
    context_ids = tokenizer(context, add_special_tokens=False, return_tensors="pt")["input_ids"]
    question_ids = tokenizer(question, add_special_tokens=False, return_tensors="pt")["input_ids"]
    ids = torch.cat([context_ids, question_ids], dim=1)

    def compress() -> KVPCache:
        cache = KVPCache(model, policy=POLICY, budget=args.budget, compress="first_prefill")
        with torch.no_grad():
            model(context_ids, **{cache_kwarg(model): cache}, logits_to_keep=1)
        return cache

    with tempfile.TemporaryDirectory() as folder:
        prefills = [timed(compress) for _ in range(args.repeats)]
        cache = prefills[-1][0]
        cache.save_pretrained(folder)
        files = {p.name: p.stat().st_size for p in sorted(Path(folder).iterdir())}
        loads = [timed(lambda: KVPCache.from_saved(folder, model)) for _ in range(args.repeats)]
        reloaded = loads[-1][0]
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(context_ids, **{cache_kwarg(model): full}, logits_to_keep=1)
    in_memory_answer = answer(model, copy.deepcopy(cache), ids, args.new_tokens)
    reloaded_answer = answer(model, reloaded, ids, args.new_tokens)
    result = {
        "context_tokens": context_ids.shape[1],
        "budget": args.budget,
        "full_kv_bytes": cache_bytes(full),
        "compressed_kv_bytes": cache.kv_bytes(),
        "saved_files_bytes": files,
        "saved_over_full": sum(files.values()) / cache_bytes(full),
        "prefill_and_compress_s": statistics.median(s for _, s in prefills),
        "load_s": statistics.median(s for _, s in loads),
        "answer": tokenizer.decode(reloaded_answer),
        "answers_identical": in_memory_answer == reloaded_answer,
    }
    saved = sum(files.values())
    print(f"context {result['context_tokens']} tokens, policy {POLICY}, budget {args.budget}")
    print(f"full DynamicCache    {result['full_kv_bytes']:>12,} bytes")
    print(f"KVPCache in memory   {result['compressed_kv_bytes']:>12,} bytes")
    print(f"saved files          {saved:>12,} bytes ({result['saved_over_full']:.3f} of full) {files}")
    print(f"prefill + compress   {result['prefill_and_compress_s']:>12.2f} s")
    print(
        f"from_saved           {result['load_s']:>12.2f} s "
        f"({result['prefill_and_compress_s'] / result['load_s']:.0f}x faster)"
    )
    print(f"answers identical    {result['answers_identical']} ({result['answer']!r})")
    if args.json:
        record = {"provenance": provenance(MODELS["smollm2"].model_id, model.dtype, "cpu", policy=POLICY)}
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({**record, "settings": settings, **result}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
