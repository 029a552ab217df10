"""Which importance target, known exactly, keeps what the continuation needs? (issue 29, thirteenth
session)

KVP is trained to rank by a target; the oracle row keeps each head's top entries by that target
computed from the true continuation. Three targets, each an oracle here, per prompt token ``i`` of
KV head ``h`` (``A_g[t, i]``: the model's causal softmax attention of query head ``g`` in ``h``'s
group at continuation position ``t``, over prompt and continuation):

- ``attention``: ``sum_t max_g A_g[t, i]`` (the paper's target; the benchmark's oracle);
- ``value``: ``sum_t max_g A_g[t, i] * ||W_o^g v_i||`` (``value_attention`` in ``train/targets.py``);
- ``output_change``: ``sum_t max_g A_g[t, i] * ||W_o^g (v_i - o_{g,t})||``, where ``o_{g,t}`` is
  the head's attention output. Dropping entry ``i`` and renormalizing moves the output by
  ``A_g[t, i] / (1 - A_g[t, i]) * (o_{g,t} - v_i)``, so an entry whose value is what the head
  outputs anyway (a sink-like token, one of many alike) costs little however much attention it gets.

On validation windows (held-out documents of the training corpora, ``train.calibrate.corpus_windows``
with ``held_out=True``; never the benchmark's held-out corpora): each window's prompt is prefilled,
each oracle keeps its share of every head at each budget (``KVPCache.from_prefill``, sinks 4 and
window 16 kept), and the score is the continuation's NLL increase per token over the full cache.
The shipped policy and StreamingLLM are rows for scale.

Run from the repository root: ``PYTHONPATH=. python docs/gemma3/oracle_targets/oracle_targets.py
MODEL WINDOWS`` (e.g. ``gemma3-270m dialogue=4,code=2,docs=2,native_code=2``; under a minute per
window on one CPU thread); writes ``oracle_targets_<model>.json`` next to this file.
"""

import copy
import json
import sys
from pathlib import Path

import torch

from eval.oracle import OracleScorer
from eval.realtext import continuation_nll
from eval.stats import write_window_results
from kvp_cache import KVPCache
from kvp_cache.compat import cache_kwarg
from kvp_cache.demo import default_policy
from kvp_cache.models import MODELS, load_model
from kvp_cache.policy import load_policy
from kvp_cache.prefill import prefill
from kvp_cache.provenance import provenance
from kvp_cache.targets import attention_modules, captured_queries, causal_attention_chunks
from train.calibrate import corpus_windows
from train.collect import parse_windows

BUDGETS = (0.05, 0.1, 0.25)
PROMPT, CONTINUATION = 2048, 128
TARGETS = ("attention", "value", "output_change")


@torch.no_grad()
def targets(model, prefilled, future_ids: list[int]) -> dict[str, dict[int, torch.Tensor]]:
    """Each target's importance per evicting layer, ``[kv_heads, prompt tokens]`` float32."""
    n = prefilled.input_ids.shape[1]
    cache = copy.deepcopy(prefilled.cache)
    modules = attention_modules(model)
    with captured_queries(model, modules) as store:
        model.base_model(
            input_ids=torch.tensor([future_ids]), use_cache=True, **{cache_kwarg(model.base_model): cache}
        )
    out = {name: {} for name in TARGETS}
    for module in modules:
        layer = module.layer_idx
        keys, values = cache.layers[layer].keys[0].float(), cache.layers[layer].values[0].float()  # [h, T, d]
        kv_heads, _, d = keys.shape
        weight = module.o_proj.weight.float()
        per_head = weight.view(weight.shape[0], -1, d)  # [hidden, q_heads, d]
        gram = torch.einsum("xgd,xge->gde", per_head, per_head)  # [q_heads, d, d]
        group = gram.shape[0] // kv_heads
        gram = gram.view(kv_heads, group, d, d)
        prompt_values = values[:, :n]  # [h, n, d]
        gv = torch.einsum("hgde,hne->hgnd", gram, prompt_values)  # G v_i
        vgv = torch.einsum("hnd,hgnd->hgn", prompt_values, gv)  # v_i^T G v_i
        sums = {name: torch.zeros(kv_heads, n) for name in TARGETS}
        for _, attention in causal_attention_chunks(store[layer].queries[0], keys, module.scaling, 32):
            output = torch.einsum("hgft,htd->hgfd", attention, values)  # o_{g,t}
            ogo = torch.einsum("hgfd,hgde,hgfe->hgf", output, gram, output)
            vgo = torch.einsum("hgnd,hgfd->hgfn", gv, output)
            change = (vgv[:, :, None, :] - 2 * vgo + ogo[..., None]).clamp_min(0).sqrt()  # ||W(v_i - o)||
            a = attention[..., :n]  # [h, g, f, n]
            sums["attention"] += a.amax(1).sum(1)
            sums["value"] += (a * vgv.clamp_min(0).sqrt()[:, :, None, :]).amax(1).sum(1)
            sums["output_change"] += (a * change).amax(1).sum(1)
        for name in TARGETS:
            out[name][layer] = sums[name]
    return out


def main() -> None:
    torch.set_num_threads(1)
    model_name, windows = sys.argv[1], sys.argv[2]
    model, tokenizer = load_model(model_name)
    policy = load_policy(default_policy(MODELS[model_name].model_id))
    rows = []
    for name, count in parse_windows(windows.split(",")).items():
        for window in corpus_windows(tokenizer, name, count, PROMPT, CONTINUATION, 0, 0.12, held_out=True):
            prefilled = prefill(model, torch.tensor([window.prompt_ids]))
            continuation = torch.tensor([window.future_ids])
            methods = {
                f"oracle_{k}": {"method": OracleScorer(v)}
                for k, v in targets(model, prefilled, window.future_ids).items()
            }
            methods |= {
                "kvp": {"method": "kvp", "policy": policy},
                "streaming_llm": {"method": "streaming_llm"},
            }
            with torch.no_grad():
                full = float(continuation_nll(model, prefilled, copy.deepcopy(prefilled.cache), continuation))
                row = {"window": window.uid, "source": window.source}
                for method, options in methods.items():
                    for budget in BUDGETS:
                        cache = KVPCache.from_prefill(
                            prefilled, model, budget=budget, compress="first_prefill", **options
                        )
                        row[f"{method}@{budget}"] = (
                            float(continuation_nll(model, prefilled, cache, continuation)) - full
                        )
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_window_results(
        Path(__file__).with_name(f"oracle_targets_{model_name}.json"),
        provenance(model_name, "float32", "cpu", policy, sys.argv),
        {"windows": windows, "prompt": PROMPT, "continuation": CONTINUATION, "budgets": BUDGETS},
        rows,
    )


if __name__ == "__main__":
    main()
