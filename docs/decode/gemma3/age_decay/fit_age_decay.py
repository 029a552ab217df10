"""Does the decode-time target call for an age decay on top of the entry-time scores? (issue 29,
thirteenth session)

KVP scores each token once, as it enters the cache, so under ``max_cache_tokens`` an old token keeps
its score however long ago it was read. This fits one ``lambda`` per (evicting layer, KV head) to the
decode traces with the policy frozen: the ranking at eviction ``k`` becomes ``score - lambda *
log2(1 + tokens read since the token's forward ended)`` (a prompt counts as one forward, a decoded
chunk as another), trained by ListNet against the stored decode-time target, as ``fit`` trains the
policy. A lambda near 0 and an unchanged loss mean the target itself asks for no decay.

Run from the repository root: ``PYTHONPATH=. python docs/decode/gemma3/age_decay/fit_age_decay.py
TRACES POLICY TRAIN_SPLIT VAL_SPLIT`` (about a minute on one CPU thread for Gemma's decode splits);
writes ``fit_age_decay.json`` next to this file.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kvp_cache.policy import load_policy
from kvp_cache.provenance import provenance
from train.batch import entry_forwards, pad_batch
from train.supervised import listnet
from train.traces import TraceSplit

STEPS, LR = 150, 0.05


def ranking_problems(traces: str, split: str, policy, layer: int):
    """``(scores, log_age, importance, valid)`` of every stored eviction of the split's decode
    samples: scores ``[problems, kv_heads, n]`` as the tokens entered, ``log_age`` ``[problems, 1,
    n]`` = log2(1 + tokens read since each token's forward ended)."""
    samples = [s for s in TraceSplit(traces, split).layer(layer) if s.evictions is not None]
    batch = pad_batch(samples)
    with torch.no_grad():
        scores = batch.scores(policy.agents_for(layer))
    n = batch.valid.shape[1]
    ages = []
    for sample in samples:
        ends, start = torch.zeros(n), 0
        for length in entry_forwards(sample):
            ends[start : start + length] = start + length
            start += length
        ages += [(read - ends).clamp(min=0) for read in sample.evictions]
    valid = batch.valid[:, None, :].expand_as(scores)
    return scores, torch.log2(1 + torch.stack(ages))[:, None, :], batch.importance, valid


def listnet_with_decay(problems, decay: torch.Tensor) -> torch.Tensor:
    scores, log_age, importance, valid = problems
    return listnet(scores - decay.view(1, -1, 1) * log_age, importance, valid)


def non_negative(raw: torch.Tensor) -> torch.Tensor:
    """softplus(raw) - softplus(0), clamped at 0: lambda starts at exactly 0 when raw does."""
    return (F.softplus(raw) - F.softplus(torch.zeros(()))).clamp(min=0)


def fit_decay(problems, heads: int) -> torch.Tensor:
    """``[heads]`` lambdas minimizing the ListNet loss on ``problems``, the policy frozen."""
    raw = torch.zeros(heads, requires_grad=True)
    optimizer = torch.optim.Adam([raw], lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        listnet_with_decay(problems, non_negative(raw)).backward()
        optimizer.step()
    return non_negative(raw).detach()


def main() -> None:
    torch.set_num_threads(1)
    traces, policy_name, train_split, val_split = sys.argv[1:5]
    policy = load_policy(policy_name).eval()
    layers = {}
    for layer in policy.layer_indices:
        train = ranking_problems(traces, train_split, policy, layer)
        val = ranking_problems(traces, val_split, policy, layer)
        fitted = fit_decay(train, train[0].shape[1])
        none = torch.zeros_like(fitted)
        with torch.no_grad():
            layers[layer] = {
                "lambda": fitted.tolist(),
                "train_listnet": [listnet_with_decay(train, d).item() for d in (none, fitted)],
                "val_listnet": [listnet_with_decay(val, d).item() for d in (none, fitted)],
            }
        print(layer, json.dumps(layers[layer]), flush=True)
    model = json.loads((Path(traces) / train_split / "collect.json").read_text())["settings"]["model"]
    result = {
        "provenance": provenance(model, "float32", "cpu", policy, sys.argv),
        "settings": {
            "traces": Path(traces).name,
            "train": train_split,
            "val": val_split,
            "steps": STEPS,
            "lr": LR,
        },
        "note": "train_listnet / val_listnet: [without decay, with the fitted lambda]",
        "layers": layers,
    }
    out = Path(__file__).with_name("fit_age_decay.json")
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
