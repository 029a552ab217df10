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

from types import SimpleNamespace

import torch
from transformers import DynamicCache

from docs.decode.rescore.rescore_validation import common_arguments, run
from eval.realtext import continuation_nll
from kvp_cache import KVPCache
from kvp_cache.compat import text_config
from kvp_cache.integrations import forward_tokens
from train.data import Example


def chunked_nll(model, cache, prompt: torch.Tensor, chunks: int, continuation: torch.Tensor) -> float:
    """Mean NLL per token of ``continuation`` (``[1, c]``) after ``prompt`` (``[1, p]``) read into
    ``cache`` in ``chunks`` forwards."""
    for piece in prompt.tensor_split(chunks, dim=1):
        logits = forward_tokens(model, cache, piece, logits_to_keep=1)
    read = SimpleNamespace(next_token_logits=logits[:, -1])  # what continuation_nll reads of a prefill
    return float(continuation_nll(model, read, cache, continuation))


def main() -> None:
    parser = common_arguments(__doc__.split("\n")[0], "code=3,native_code=3,docs=3,dialogue=3",
                              "kvp,kvp_rescore,snapkv", (2048, 128))  # fmt: skip
    parser.add_argument("--budgets", default="0.1,0.25", help="shares of the tokens seen, comma-separated")
    parser.add_argument("--chunks", type=int, default=4, help="forwards the prompt is read in")
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]

    def measure(model, example: Example, options: dict[str, dict]) -> dict:
        prompt, continuation = torch.tensor([example.prompt_ids]), torch.tensor([example.future_ids])

        def nll(cache) -> float:
            return chunked_nll(model, cache, prompt, args.chunks, continuation)

        full = nll(DynamicCache(config=text_config(model.config)))
        row = {"full_nll": full}
        for budget in budgets:
            for method, chosen in options.items():
                row[f"{method}@{budget}"] = nll(KVPCache(model, budget=budget, **chosen)) - full
        return row

    run(args, "chunked_prefill", budgets, measure)


if __name__ == "__main__":
    main()
