"""KVP over a prompt read in chunks (later turns, streamed documents): each token scored once as it
entered (the default) against every held entry scored again at each eviction (``rescore=True``).

With the default ``compress="every_prefill"`` every multi-token forward ends with an eviction to the
budget's share of the tokens seen, so a prompt read in ``--chunks`` forwards is evicted that many
times; the continuation is then read in one forward, and the score is its mean NLL increase per
token over the uncompressed cache. The windows are held-out documents of the training corpora, as in
``rescore_validation.py``.

Run from the repository root: ``PYTHONPATH=. python docs/decode/rescore/chunked_prefill.py``
(resumes); writes ``chunked_prefill[_<model>].json`` next to this file.
"""

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm
from transformers import DynamicCache

from docs.decode.rescore.rescore_validation import SHIPPED, method_options, summary
from eval.realtext import continuation_nll
from kvp_cache import KVPCache
from kvp_cache.compat import text_config
from kvp_cache.integrations import forward_tokens
from kvp_cache.models import load_model
from kvp_cache.policy import load_policy
from kvp_cache.provenance import provenance
from train.calibrate import corpus_windows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--windows", default="code=3,native_code=3,docs=3,dialogue=3", help="CORPUS=COUNT,..."
    )
    parser.add_argument("--budgets", default="0.1,0.25", help="shares of the tokens seen, comma-separated")
    parser.add_argument("--model", default="smollm2", choices=sorted(SHIPPED))
    parser.add_argument("--methods", default="kvp,kvp_rescore,snapkv", help="as in rescore_validation.py")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=4, help="forwards the prompt is read in")
    parser.add_argument("--continuation-tokens", type=int, default=128)
    return parser.parse_args()


def chunked_nll(model, cache, prompt: torch.Tensor, chunks: int, continuation: torch.Tensor) -> float:
    """Mean NLL per token of ``continuation`` (``[1, c]``) after ``prompt`` (``[1, p]``) read into
    ``cache`` in ``chunks`` forwards."""
    for piece in prompt.tensor_split(chunks, dim=1):
        logits = forward_tokens(model, cache, piece, logits_to_keep=1)
    read = SimpleNamespace(next_token_logits=logits[:, -1])  # what continuation_nll reads of a prefill
    return float(continuation_nll(model, read, cache, continuation))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    budgets = [float(b) for b in args.budgets.split(",")]
    methods = args.methods.split(",")
    windows = {name: int(count) for name, count in (spec.split("=") for spec in args.windows.split(","))}
    model, tokenizer = load_model(args.model)
    policy = load_policy(SHIPPED[args.model])
    options = method_options(methods, policy)
    header = provenance(args.model, "float32", "cpu", policy, sys.argv)
    suffix = "" if args.model == "smollm2" else f"_{args.model}"
    out = Path(__file__).with_name(f"chunked_prefill{suffix}.json")
    record = json.loads(out.read_text()) if out.exists() else {"rows": []}
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
            prompt, continuation = torch.tensor([example.prompt_ids]), torch.tensor([example.future_ids])
            full = chunked_nll(
                model, DynamicCache(config=text_config(model.config)), prompt, args.chunks, continuation
            )
            row = {"window": example.uid, "source": example.source, "full_nll": full}
            for budget in budgets:
                for method in methods:
                    cache = KVPCache(model, budget=budget, **options[method])
                    row[f"{method}@{budget}"] = (
                        chunked_nll(model, cache, prompt, args.chunks, continuation) - full
                    )
            record["rows"].append(row)
            record["provenance"] = header
            record["summary"] = summary(record["rows"], budgets, methods)
            out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(record["summary"], indent=1))


if __name__ == "__main__":
    main()
