"""``python -m train evaluate``: eviction-cost curves on held-out traces, for every method.

For each held-out sample, layer and KV head, a method's scores rank the prompt tokens; at budget
``b`` the top ``ceil(b * n)`` are kept and the evicted share of the future attention is recorded
(``train/reward.py``). Results are means over samples, layers and heads.

- ``kvp`` (and ``kvp[<strategy>]`` for other position strategies): the policy's scores;
- key/value-only registry methods: ``make_scorer(name).score`` on the stored K/V;
- query-aware registry methods: the scores ``collect`` stored from the prompt's own queries;
- ``oracle``: ranking by the true importance, without protection (the lower bound).

Every method gets the sink/window protection the cache applies at inference (``--sinks``,
``--window``); the JSON also holds the unprotected numbers. ``auc`` is the mean evicted share
over a 5%-step budget grid divided by the oracle's (1 = oracle, lower is better).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvp_cache.policy import POSITION_STRATEGIES, KVPolicy, load_policy
from kvp_cache.provenance import policy_record, provenance
from kvp_cache.scorers import make_scorer
from kvp_cache.scorers import methods as registry_methods
from kvp_cache.tables import markdown_table
from train import plots
from train.reward import budget_grid, evicted_fraction, normalized_auc, oracle_evicted_fraction
from train.traces import TraceSplit

DEFAULT_BUDGETS = [0.05, 0.1, 0.25, 0.5]


@dataclass
class EvaluateConfig:
    """Everything ``evaluate`` needs; the CLI flags map one to one.

    policy: policy dirs, shipped names or ``name=path`` specs (a bare path is named ``kvp``).
    """

    traces: str
    out: str
    split: str = "val"
    policy: list[str] = field(default_factory=list)
    position_strategies: list[str] | None = None
    budgets: list[float] = field(default_factory=lambda: list(DEFAULT_BUDGETS))
    sinks: int = 4
    window: int = 16
    layers: list[int] | None = None
    record: bool = False


def method_scores(
    sample, layer: int, policies: dict[str, KVPolicy], kv_methods: list[str]
) -> dict[str, torch.Tensor]:
    """``{method: [heads, n]}`` scores of one sample of one layer."""
    keys, values = sample.keys.float()[None], sample.values.float()[None]
    positions = torch.arange(keys.shape[2])[None]
    out = {}
    with torch.no_grad():
        for name, policy in policies.items():
            out[name] = policy(layer, keys, values, positions)[0]
        for name in kv_methods:
            out[name] = make_scorer(name).score(keys, values, positions, None, layer)[0].float()
    out.update({name: s.float() for name, s in sample.scores.items()})
    return out


def evaluate(
    traces: str | Path,
    split: str,
    policies: dict[str, KVPolicy],
    budgets: list[float],
    sinks: int = 4,
    window: int = 16,
    layers: list[int] | None = None,
) -> dict:
    """Mean evicted share per budget and normalized AUC of every method, with and without protection."""
    data = TraceSplit(traces, split)
    info = data.model
    layers = layers if layers is not None else data.layer_indices
    kv_methods = registry_methods(query_aware=False, learned=False)
    grid = budget_grid(20)
    all_budgets = sorted(set(budgets) | set(grid))
    table_index = [all_budgets.index(b) for b in budgets]
    grid_index = [all_budgets.index(b) for b in grid]
    sums: dict[tuple[str, bool], torch.Tensor] = {}
    per_layer_auc: dict[str, list[float]] = {}
    count = 0
    for layer in tqdm(layers, desc=f"evaluate {split}", unit="layer"):
        layer_auc: dict[str, list[torch.Tensor]] = {}
        for sample in data.layer(layer):
            importance = sample.importance.float()
            oracle = oracle_evicted_fraction(importance, all_budgets)  # [budgets, heads]
            curves = {("oracle", True): oracle, ("oracle", False): oracle}
            for name, scores in method_scores(sample, layer, policies, kv_methods).items():
                for protected in (True, False):
                    protect = (sinks, window) if protected else None
                    curves[(name, protected)] = evicted_fraction(scores, importance, all_budgets, protect)
            for key, curve in curves.items():
                sums[key] = sums.get(key, 0) + curve.sum(-1)
                if key[1]:
                    auc = normalized_auc(curve[grid_index], oracle[grid_index])
                    layer_auc.setdefault(key[0], []).append(auc)
            count += importance.shape[0]
        for name, values in layer_auc.items():
            per_layer_auc.setdefault(name, []).append(torch.cat(values).mean().item())
    means = {key: (total / count) for key, total in sums.items()}
    oracle_grid = means[("oracle", True)][grid_index].mean()
    methods = {}
    for name in sorted({k[0] for k in means}):
        on, off = means[(name, True)], means[(name, False)]
        methods[name] = {
            "cost": [round(on[i].item(), 5) for i in table_index],
            "auc": round((on[grid_index].mean() / oracle_grid).item(), 4),
            "cost_unprotected": [round(off[i].item(), 5) for i in table_index],
            "auc_unprotected": round((off[grid_index].mean() / oracle_grid).item(), 4),
            "curve": [round(on[i].item(), 5) for i in grid_index],
        }
    samples = data.samples
    return {
        "traces": str(traces),
        "split": split,
        "model": info["name"],
        "samples": len(samples),
        "prompt_tokens": [min(s["prompt_tokens"] for s in samples), max(s["prompt_tokens"] for s in samples)],
        "layers": len(layers),
        "budgets": budgets,
        "grid": grid,
        "protect": {"sinks": sinks, "window": window},
        "methods": dict(sorted(methods.items(), key=lambda item: item[1]["auc"])),
        "auc_per_layer": per_layer_auc,
    }


def cost_table(result: dict, protected: bool = True) -> str:
    """Methods as rows (best AUC first), budgets then AUC as columns."""
    cost, auc = ("cost", "auc") if protected else ("cost_unprotected", "auc_unprotected")
    header = ["method", *(f"b={b:g}" for b in result["budgets"]), "AUC / oracle"]
    rows = [
        [name, *(f"{v:.4f}" for v in m[cost]), f"{m[auc]:.3f}"]
        for name, m in sorted(result["methods"].items(), key=lambda item: item[1][auc])
    ]
    return markdown_table(header, rows)


def card_evaluation(result: dict) -> dict:
    """The ``training["evaluation"]`` record the policy card renders (protected costs)."""
    return {
        "budgets": result["budgets"],
        "methods": {name: m["cost"] for name, m in result["methods"].items()},
        "data": f"{result['samples']} held-out traces ({result['split']} split, prompts of "
        f"{result['prompt_tokens'][0]}-{result['prompt_tokens'][1]} tokens); cost = share of the "
        f"future attention evicted, sinks {result['protect']['sinks']} and window "
        f"{result['protect']['window']} always kept",
    }


def parse_policies(specs: list[str], strategies: list[str] | None = None) -> dict[str, KVPolicy]:
    """``["path"]`` or ``["name=path", ...]`` -> loaded policies (a bare path is named ``kvp``), plus a
    ``name[strategy]`` copy for every other position strategy in ``strategies``."""
    out = {}
    for spec in specs:
        name, path = spec.split("=", 1) if "=" in spec else ("kvp", spec)
        out[name] = load_policy(path).eval()
        for strategy in strategies or []:
            if strategy != out[name].position_strategy:
                variant = load_policy(path).eval()
                variant.position_strategy = strategy
                out[f"{name}[{strategy}]"] = variant
    return out


def run_evaluation(config: EvaluateConfig) -> dict:
    """Evaluate, then write ``eviction_cost_<split>.{json,md,png}`` (the JSON opens with provenance)."""
    policies = parse_policies(config.policy, config.position_strategies)
    result = evaluate(
        config.traces, config.split, policies, config.budgets, config.sinks, config.window, config.layers
    )
    first = next(iter(policies.values()), None)
    result = {
        "provenance": provenance(result["model"], "float16 traces", "cpu", policy=first),
        "policies": {name: policy_record(policy) for name, policy in policies.items()},
        **result,
    }
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"eviction_cost_{config.split}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    table = cost_table(result, protected=True)
    unprotected = cost_table(result, protected=False)
    stem.with_suffix(".md").write_text(
        f"Evicted share of future attention on {result['samples']} held-out traces ({config.split}), mean over "
        f"{result['layers']} layers and every KV head; sinks {config.sinks} + window {config.window} kept.\n\n"
        f"{table}\n\nWithout sink/window protection:\n\n{unprotected}\n"
    )
    grid_curves = {name: m["curve"] for name, m in result["methods"].items()}
    plots.cost_curves(
        result["grid"], grid_curves, stem.with_suffix(".png"), f"{result['model']}: {config.split}"
    )
    print(table)
    if config.record:
        for spec in config.policy:
            directory = spec.split("=")[-1]
            policy = load_policy(directory)
            policy.training_info = {**policy.training_info, "evaluation": card_evaluation(result)}
            policy.save_pretrained(directory)
            print(f"recorded the evaluation in {directory}/config.json and its card")
    return result


def evaluate_command(args: argparse.Namespace) -> dict:
    fields = set(EvaluateConfig.__dataclass_fields__)
    return run_evaluation(EvaluateConfig(**{k: v for k, v in vars(args).items() if k in fields}))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", required=True, help="directory written by `collect`")
    parser.add_argument("--split", default="val", help="held-out split to evaluate on")
    parser.add_argument(
        "--policy", nargs="*", default=[], help="policy dir, shipped name or name=path (repeatable)"
    )
    parser.add_argument(
        "--position-strategies",
        nargs="*",
        choices=sorted(POSITION_STRATEGIES),
        default=None,
        help="also evaluate each policy with these position strategies",
    )
    parser.add_argument("--budgets", type=float, nargs="*", default=DEFAULT_BUDGETS)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--layers", type=int, nargs="*", default=None)
    parser.add_argument("--out", required=True, help="writes eviction_cost_<split>.{md,json,png} here")
    parser.add_argument(
        "--record", action="store_true", help="store the table in each policy's config and card"
    )
    parser.add_argument("--threads", type=int, default=2)
