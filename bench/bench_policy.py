"""Cost of the KVP policy next to the prefill it compresses, and the size of its weights.

Prefills SmolLM2-135M-Instruct on ``--context-tokens`` tokens, then scores every KV head of every
layer of that prefill's cache, as ``KVPCache`` does after a prefill, with the trained ``--policy``
(default: the one shipped for SmolLM2; its sha256 goes in the JSON's provenance) and with a randomly
initialised ``KVPolicy`` of each ``--hidden-dim`` (the cost depends on the shape, not the weights). Prefill and scoring alternate in every repeat, so a busy
machine slows both alike; the medians are printed with their ratio, plus parameter count and
weights size (fp32, and the saved model.safetensors). The whole compression with the trained
policy at ``--budget`` is timed too, for each allocation (``KVPCache.from_prefill``: scoring, the
uniform top-k or the cross-head allocation, and the gather of the kept entries). One more,
profiled scoring pass splits the trained policy's time into its matrix products and the rest
(norms, SiLU, gathers: passes over ``[heads, seq, hidden]``), and gives its GFLOP/s. The trained
policy cast to bfloat16 is timed beside it (scoring, and the ``head`` compression), with the share of
the fp32 policy's kept entries it keeps at ``--budget``: what lower precision would buy, and change.

    .venv/bin/python bench/bench_policy.py --context-tokens 4096 --hidden-dim 16 32 \
        [--json bench/results/policy_smollm2.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from kvp_cache import KVPCache
from kvp_cache.agents import POSITION_STRATEGIES
from kvp_cache.demo import default_policy
from kvp_cache.models import MODELS, load_model
from kvp_cache.policy import KVPolicy, load_policy
from kvp_cache.prefill import prefill as prefill_prompt
from kvp_cache.provenance import provenance

ALLOCATIONS = ("uniform", "layer", "head")
MATMULS = {"aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context-tokens", type=int, default=4096, help="prompt length (default 4096)")
    parser.add_argument(
        "--policy", help="trained policy (shipped name, directory, Hub id); default: SmolLM2's"
    )
    parser.add_argument(
        "--hidden-dim", type=int, nargs="*", default=[32], help="widths of randomly initialised agents"
    )
    parser.add_argument("--pos-dim", type=int, default=8)
    parser.add_argument("--max-positions", type=int, default=1024)
    parser.add_argument("--num-mlp-layers", type=int, default=2)
    parser.add_argument("--position-strategy", choices=sorted(POSITION_STRATEGIES), default="clamp")
    parser.add_argument("--budget", type=float, default=0.1, help="budget of the timed compression")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats; medians are reported")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--json", type=Path, help="write the provenance, settings and every row here")
    args = parser.parse_args()
    for name in ("context_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_share(score: Callable[[], None]) -> tuple[float, float]:
    """(share of ``score``'s CPU time spent in matrix products, their GFLOP), from one profiled call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        score()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = [e for e in events if e.key in MATMULS]
    return sum(e.self_cpu_time_total for e in matmul) / total, sum(e.flops for e in matmul) / 1e9


def kept_agreement(
    reference: KVPolicy, other: KVPolicy, states: list[tuple], positions: torch.Tensor, kept: int
) -> float:
    """Share of the entries ``reference`` ranks in each head's top ``kept`` that ``other`` ranks there
    too, over every KV head of ``states`` (per layer ``(keys, values)``, ``[1, kv_heads, seq, head_dim]``)."""
    shared = 0
    with torch.no_grad():
        for layer_idx, (keys, values) in enumerate(states):
            tops = [
                p(layer_idx, keys, values, positions).topk(kept, dim=-1).indices for p in (reference, other)
            ]
            chosen = [torch.zeros(keys.shape[:3], dtype=torch.bool).scatter_(-1, t, True) for t in tops]
            shared += int((chosen[0] & chosen[1]).sum())
    return shared / (kept * sum(keys.shape[1] for keys, _ in states))


def saved_size(policy: KVPolicy) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        policy.save_pretrained(tmp)
        return (Path(tmp) / "model.safetensors").stat().st_size


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model("smollm2")
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (1, args.context_tokens), generator=torch.Generator().manual_seed(0))

    def prefill() -> DynamicCache:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids, cache=cache, use_cache=True)
        return cache

    cache = prefill()  # warm-up, and the keys/values every policy scores
    states = [(layer.keys, layer.values) for layer in cache.layers]
    positions = torch.arange(args.context_tokens)[None, :]
    trained = load_policy(args.policy or default_policy(MODELS["smollm2"].model_id)).eval()
    trained_bf16 = copy.deepcopy(trained).to(torch.bfloat16)
    trained_label, bf16_label = f"trained ({trained.hidden_dim})", f"trained ({trained.hidden_dim}) bf16"
    policies = {trained_label: trained, bf16_label: trained_bf16} | {
        f"random ({hidden})": KVPolicy.for_model(
            model,
            hidden_dim=hidden,
            pos_dim=args.pos_dim,
            max_positions=args.max_positions,
            num_mlp_layers=args.num_mlp_layers,
            position_strategy=args.position_strategy,
        ).eval()
        for hidden in args.hidden_dim
    }

    def score_all(policy: KVPolicy) -> None:
        with torch.no_grad():
            for layer_idx, (keys, values) in enumerate(states):
                policy(layer_idx, keys, values, positions)

    prefilled = prefill_prompt(model, input_ids)

    compressions = {allocation: (allocation, trained) for allocation in ALLOCATIONS}
    compressions["head, bf16 scoring"] = ("head", trained_bf16)

    def compress(label: str) -> None:
        allocation, policy = compressions[label]
        KVPCache.from_prefill(prefilled, model, policy=policy, budget=args.budget, allocation=allocation)

    for policy in policies.values():
        score_all(policy)  # warm-up
    for label in compressions:
        compress(label)  # warm-up
    prefill_times, policy_times = [], {label: [] for label in policies}
    compress_times = {label: [] for label in compressions}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        prefill_times.append(timed(prefill))
        for label, policy in policies.items():
            policy_times[label].append(timed(lambda policy=policy: score_all(policy)))
        for label in compressions:
            compress_times[label].append(timed(lambda label=label: compress(label)))

    prefill_s = statistics.median(prefill_times)
    heads = model.config.num_hidden_layers * model.config.num_key_value_heads
    print(
        f"SmolLM2-135M, {args.context_tokens} tokens, {args.threads} threads, {args.repeats} repeats (medians); "
        f"prefill {prefill_s * 1e3:.0f} ms; policy scores all {heads} KV heads; "
        f"random agents: pos_dim {args.pos_dim}, max_positions {args.max_positions}, num_mlp_layers "
        f"{args.num_mlp_layers}, position_strategy {args.position_strategy}; load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs (other work on the machine slows both sides)"
    )
    print(
        f"{'policy':>14} {'params':>10} {'fp32 MB':>8} {'file MB':>8} {'policy ms':>10} {'policy/prefill':>15}"
    )
    rows = []
    for label, policy in policies.items():
        params = policy.num_parameters()
        policy_s = statistics.median(policy_times[label])
        rows.append(
            {
                "policy": label,
                "hidden_dim": policy.hidden_dim,
                "parameters": params,
                "file_bytes": saved_size(policy),
                "policy_ms": policy_s * 1e3,
                "policy_over_prefill": policy_s / prefill_s,
            }
        )
        print(
            f"{label:>14} {params:>10,} {params * 4 / 1e6:>8.2f} {rows[-1]['file_bytes'] / 1e6:>8.2f} "
            f"{policy_s * 1e3:>10.1f} {policy_s / prefill_s:>14.2%}"
        )
    agreement = kept_agreement(
        trained, trained_bf16, states, positions, math.ceil(args.budget * args.context_tokens)
    )
    next(row for row in rows if row["policy"] == bf16_label)["kept_agreement"] = agreement
    print(
        f"{bf16_label}: keeps {agreement:.2%} of the entries the fp32 policy keeps at budget {args.budget} "
        "(same per-head counts; random-token prompt)"
    )
    share, gflop = matmul_share(lambda: score_all(trained))
    trained_ms = rows[0]["policy_ms"]
    profile = {"matmul_share": share, "matmul_gflop": gflop, "gflop_per_s": gflop / (trained_ms / 1e3)}
    print(
        f"{trained_label}: matrix products are {share:.0%} of the scoring time (profiled), "
        f"{gflop:.2f} GFLOP in all, {profile['gflop_per_s']:.0f} GFLOP/s over the median scoring time"
    )
    print(
        f"\nWhole compression with the trained policy at budget {args.budget} (scoring + selection + gather):"
    )
    compression = []
    for label, times in compress_times.items():
        seconds = statistics.median(times)
        compression.append(
            {
                "allocation": label,
                "compress_ms": seconds * 1e3,
                "compress_over_prefill": seconds / prefill_s,
            }
        )
        print(f"{label:>18} {seconds * 1e3:>10.1f} ms {seconds / prefill_s:>14.2%} of the prefill")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        record = {
            "provenance": provenance("smollm2", model.dtype, model.device, trained, command=sys.argv),
            "settings": settings | {"prefill_ms": prefill_s * 1e3, "load_average": os.getloadavg()[0]},
            "rows": rows,
            "scoring_profile": profile,
            "compression": compression,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
