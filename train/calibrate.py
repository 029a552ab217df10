"""``python -m train calibrate``: make a learned policy's scores comparable across heads and layers.

The policy ranks each head's entries; an adaptive allocation (one top-k over every layer, head and
token) also needs to know how much each head's entries are worth against other heads'. The
calibration (:class:`kvp_cache.policy.Calibration`) adds a temperature ``tau`` and a weight ``w``
per (layer, KV head): ``w * softmax(score / tau)`` over the head's entries estimates each entry's
share of the future attention. They are fitted here to the measured target: the oracle's future
attention (:func:`eval.oracle.oracle_scorer`, the training definition), with the always-kept sinks
and window zeroed (:func:`kvp_cache.targets.evictable_only`, the ``attention_evictable`` target)
and divided by the number of future queries, so heads and layers compare.

Data: windows of ``context_tokens`` + ``continuation_tokens`` from the TRAINING documents of the
training corpora (:mod:`train.corpora`; never those :func:`train.data.is_held_out_document` holds
out, which ``eval.headroom`` validates on, nor the benchmark's held-out corpora, which the corpora
refuse). A share of them (``check_fraction``) is kept out of the fit to check it.

:data:`VARIANTS` say which parameters are free (``tau``, ``w`` or both; the other stays 1) and
:data:`LOSSES` what they fit. The check compares, on the check windows, the evictable future
attention each allocation of :mod:`kvp_cache.allocation` loses when driven by each variant, the
uncalibrated per-head softmax and the oracle itself.

Writes to ``--out``: ``windows.safetensors`` (the measured scores and targets, reused by a rerun
with the same settings), ``policy-<variant>/`` (the policy with that calibration, loadable as
``--policy``) and the results JSON (``--results``, default ``<out>/calibration.json``) with
provenance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from eval.__main__ import comma_list
from eval.oracle import oracle_scorer
from kvp_cache.allocation import MODES, allocate
from kvp_cache.budget import Budget, parse_budget
from kvp_cache.cli import add_protected_tokens_arguments
from kvp_cache.compat import evicting_layer_indices
from kvp_cache.models import load_model
from kvp_cache.policy import Calibration, KVPolicy, load_policy
from kvp_cache.prefill import Prefill, prefill
from kvp_cache.provenance import portable_argument, portable_command, portable_config, provenance
from kvp_cache.scorers import make_scorer
from kvp_cache.tables import markdown_table
from kvp_cache.targets import evictable_only
from train.collect import CHARS_PER_TOKEN_READ, parse_windows
from train.corpora import documents
from train.data import Example, interleave, is_held_out_document, text_examples

VARIANTS = {
    "tau": "a temperature per head (weight 1)",
    "w": "a weight per head (temperature 1)",
    "tau_w": "a temperature and a weight per head",
}
LOSSES = {
    "mass": "cross-entropy between the target's and the calibrated shares' distributions over every "
    "evictable (layer, head, token) entry of a window (mass-weighted: the entries that matter most)",
    "log_mse": "squared error between the log calibrated share and log(target + floor) over every "
    "evictable entry (every entry counts the same)",
}
LOG_FLOOR = 1e-6
"""Added to the target before ``log_mse`` takes its log: shares below it (a millionth of a query's
attention) are noise for a budget that keeps a few percent of the entries."""
SOFTMAX = "softmax"
ORACLE = "oracle"


@dataclass
class CalibrateConfig:
    """What ``calibrate`` fits and checks; the CLI flags map one to one."""

    model: str = "smollm2"
    policy: str = "smollm2-135m-instruct"
    out: str = "calibration"
    results: str | None = None
    windows: dict[str, int] = field(
        default_factory=lambda: {"code": 12, "docs": 12, "dialogue": 6, "native_code": 12}
    )
    context_tokens: int = 2048
    continuation_tokens: int = 128
    check_fraction: float = 0.25
    loss: str = "mass"
    steps: int = 200
    lr: float = 0.05
    budgets: list[Budget] = field(default_factory=lambda: [0.05, 0.1, 0.25])
    sink_tokens: int = 4
    window_tokens: int = 16
    val_fraction: float = 0.12
    essays_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {self.loss!r}")
        if not 0 < self.check_fraction < 1:
            raise ValueError(f"check_fraction must be in (0, 1), got {self.check_fraction}")
        if self.steps < 1 or self.lr <= 0:
            raise ValueError(f"steps must be >= 1 and lr > 0, got {self.steps} and {self.lr}")
        if self.context_tokens < 2 or self.continuation_tokens < 1:
            raise ValueError(
                f"context_tokens must be >= 2 and continuation_tokens >= 1, got {self.context_tokens} "
                f"and {self.continuation_tokens}"
            )
        if sum(self.windows.values()) < 2 or any(n < 0 for n in self.windows.values()):
            raise ValueError(f"windows must be counts >= 0 adding up to at least 2, got {self.windows}")


def corpus_windows(
    tokenizer,
    name: str,
    count: int,
    context_tokens: int,
    continuation_tokens: int,
    seed: int,
    val_fraction: float,
    held_out: bool,
    essays_dir: str | None = None,
) -> list[Example]:
    """``count`` disjoint windows of ``context_tokens`` + ``continuation_tokens`` from corpus ``name``'s
    held-out documents (``held_out``, cut as ``train collect`` cuts its held-out windows) or from its
    training documents (:func:`train.data.is_held_out_document` at ``val_fraction``)."""
    length = context_tokens + continuation_tokens
    held = partial(is_held_out_document, val_fraction=val_fraction)
    keep = held if held_out else (lambda text: not held(text))
    texts = documents(name, seed, count * length * CHARS_PER_TOKEN_READ, essays_dir=essays_dir, keep=keep)
    span, future = (context_tokens, context_tokens), (continuation_tokens, continuation_tokens)
    prefix = f"{name}-held-out" if held_out else f"{name}-train"
    try:
        examples = text_examples(tokenizer, texts, count, span, future, seed, prefix)
    except ValueError as error:
        side = "held-out" if held_out else "training"
        raise ValueError(f"{name}: {error} (its {side} documents are all there is)") from None
    return [replace(e, source=name) for e in examples]


def calibration_windows(config: CalibrateConfig, tokenizer) -> list[Example]:
    """The windows ``calibrate`` measures: ``config.windows`` of each corpus's training documents,
    sources interleaved."""
    groups = [
        corpus_windows(
            tokenizer,
            name,
            count,
            config.context_tokens,
            config.continuation_tokens,
            config.seed,
            config.val_fraction,
            held_out=False,
            essays_dir=config.essays_dir,
        )  # fmt: skip
        for name, count in config.windows.items()
        if count
    ]
    return list(interleave(*groups))


# -- the measurements --------------------------------------------------------------------------


@torch.no_grad()
def measure_window(
    model,
    policy: KVPolicy,
    example: Example,
    sink_tokens: int,
    window_tokens: int,
    prefilled: Prefill | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, target)`` of one window, each ``[evicting layers, kv_heads, prompt_tokens]`` float32:
    the policy's raw scores and each entry's share of the future attention per future query, sinks
    and window zeroed. ``prefilled``: the window's prompt already prefilled (None: prefilled here)."""
    device = next(model.parameters()).device
    if prefilled is None:
        prefilled = prefill(model, torch.tensor([example.prompt_ids], device=device))
    importance = oracle_scorer(model, prefilled, example.future_ids).importance
    scorer = make_scorer("kvp", policy=policy, check_base_model=False)
    positions = torch.arange(len(example.prompt_ids), device=device)[None]
    scores, target = [], []
    for layer in policy.layer_indices:
        states = prefilled.cache.layers[layer]
        scores.append(scorer.score(states.keys, states.values, positions, None, layer)[0].float().cpu())
        evictable = evictable_only(importance[layer], sink_tokens, window_tokens)
        target.append(evictable.cpu() / len(example.future_ids))
    return torch.stack(scores), torch.stack(target)


def data_fingerprint(config: CalibrateConfig, policy: KVPolicy, examples: list[Example]) -> str:
    """What the measured windows depend on: the policy's weights, the protection and every token."""
    tokens = [[e.prompt_ids, e.future_ids] for e in examples]
    keys = [policy.weights_sha256, config.model, config.sink_tokens, config.window_tokens, tokens]
    return hashlib.sha256(json.dumps(keys).encode()).hexdigest()


def measured_windows(
    config: CalibrateConfig, model, policy: KVPolicy, examples: list[Example]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, target)`` ``[windows, layers, kv_heads, prompt_tokens]`` of every example, read from
    ``<out>/windows.safetensors`` when it was measured with the same settings, else measured and
    written there."""
    path = Path(config.out) / "windows.safetensors"
    fingerprint = data_fingerprint(config, policy, examples)
    if path.exists():
        with safe_open(str(path), "pt") as handle:
            if (handle.metadata() or {}).get("fingerprint") == fingerprint:
                return handle.get_tensor("scores"), handle.get_tensor("target")
    pairs = [
        measure_window(model, policy, example, config.sink_tokens, config.window_tokens)
        for example in tqdm(examples, desc="calibrate: measure windows", unit="window")
    ]
    scores, target = (torch.stack(parts) for parts in zip(*pairs, strict=True))
    save_file({"scores": scores, "target": target}, str(path), metadata={"fingerprint": fingerprint})
    return scores, target


# -- the fit -----------------------------------------------------------------------------------


def log_shares(scores: torch.Tensor, log_tau: torch.Tensor, log_w: torch.Tensor) -> torch.Tensor:
    """``log(w * softmax(scores / tau))`` over each head's entries (every prompt entry is valid
    here), the log of :func:`kvp_cache.policy.calibrated_shares`; scores ``[..., layers, heads, n]``,
    parameters ``[layers, heads]``."""
    return log_w[..., None] + (scores / log_tau.exp()[..., None]).log_softmax(-1)


def loss_of(name: str, log_p: torch.Tensor, target: torch.Tensor, evictable: torch.Tensor) -> torch.Tensor:
    """One of :data:`LOSSES` over the evictable entries (``[n]`` bool) of ``[windows, layers, heads, n]``."""
    log_p, target = log_p[..., evictable], target[..., evictable]
    if name == "mass":
        windows = log_p.shape[0]
        log_q = log_p.reshape(windows, -1).log_softmax(-1)
        y = target.reshape(windows, -1)
        y = y / y.sum(-1, keepdim=True).clamp_min(1e-30)
        return -(y * log_q).sum(-1).mean()
    return (log_p - (target + LOG_FLOOR).log()).pow(2).mean()


def fit(
    scores: torch.Tensor,
    target: torch.Tensor,
    evictable: torch.Tensor,
    variant: str,
    loss: str,
    steps: int,
    lr: float,
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """``(temperature, weight, losses)``: the :data:`VARIANTS` parameters ``[layers, heads]`` fitted by
    Adam (full batch) from 1, and the loss before the first and after every ``steps // 10``-th step."""
    shape = scores.shape[1:3]
    log_tau = torch.zeros(shape, requires_grad="tau" in variant.split("_"))
    log_w = torch.zeros(shape, requires_grad="w" in variant.split("_"))
    free = [p for p in (log_tau, log_w) if p.requires_grad]
    optimizer = torch.optim.Adam(free, lr=lr)
    history = []
    for step in tqdm(range(steps + 1), desc=f"calibrate: fit {variant}", unit="step", leave=False):
        value = loss_of(loss, log_shares(scores, log_tau, log_w), target, evictable)
        if step % max(1, steps // 10) == 0 or step == steps:
            history.append(round(value.item(), 6))
        if step == steps:
            break
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    return log_tau.detach().exp(), log_w.detach().exp(), history


# -- the check ---------------------------------------------------------------------------------


def lost_attention(
    drivers: dict[str, torch.Tensor],
    target: torch.Tensor,
    layers: list[int],
    budgets: list[Budget],
    sink_tokens: int,
    window_tokens: int,
) -> dict[str, dict[str, list[float]]]:
    """``{driver: {"<mode>@<budget>": [per window]}}``: the evictable future attention per query that
    each allocation driven by each driver's values (``[windows, layers, heads, n]``) does not keep,
    summed over the heads and divided by their number (a mean head's loss)."""
    heads = target.shape[1] * target.shape[2]
    lost: dict[str, dict[str, list[float]]] = {name: {} for name in drivers}
    for w in range(target.shape[0]):
        for name, values in drivers.items():
            scores = {layer: values[w, i] for i, layer in enumerate(layers)}
            for budget in budgets:
                for mode in MODES:
                    kept = allocate(scores, budget, mode, None, sink_tokens, window_tokens)
                    missed = sum(float((target[w, i] * ~kept[layer]).sum()) for i, layer in enumerate(layers))
                    lost[name].setdefault(f"{mode}@{budget}", []).append(missed / heads)
    return lost


def summarize_lost(lost: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Means over the windows of :func:`lost_attention`."""
    return {name: {key: sum(v) / len(v) for key, v in cells.items()} for name, cells in lost.items()}


# -- the command -------------------------------------------------------------------------------


def split_windows(examples: list[Example], check_fraction: float) -> tuple[list[int], list[int]]:
    """Indices of the fit and check windows: every ``round(1 / check_fraction)``-th window (sources
    are interleaved, so every corpus lands in both)."""
    stride = max(2, round(1 / check_fraction))
    check = [i for i in range(len(examples)) if i % stride == stride - 1]
    return [i for i in range(len(examples)) if i not in check], check


def calibrate(config: CalibrateConfig, model=None, tokenizer=None, command: list[str] | None = None) -> dict:
    """Measure, fit every variant, check them, write the calibrated policies and the results JSON."""
    if model is None:
        model, tokenizer = load_model(config.model)
    policy = load_policy(config.policy)
    policy.check_compatible(model.config)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    examples = calibration_windows(config, tokenizer)
    start = time.perf_counter()
    scores, target = measured_windows(config, model, policy, examples)
    measure_seconds = time.perf_counter() - start
    fit_at, check_at = split_windows(examples, config.check_fraction)
    # The measured prompts: context_tokens plus the tokenizer's leading ids (Gemma's <bos>).
    prompt_tokens = scores.shape[-1]
    evictable = evictable_only(torch.ones(1, prompt_tokens), config.sink_tokens, config.window_tokens)[0] > 0
    layers = evicting_layer_indices(model.config)
    drivers = {ORACLE: target[check_at], SOFTMAX: scores[check_at].softmax(-1)}
    variants = {}
    for variant in VARIANTS:
        temperature, weight, history = fit(
            scores[fit_at], target[fit_at], evictable, variant, config.loss, config.steps, config.lr
        )
        check_loss = loss_of(
            config.loss,
            log_shares(scores[check_at], temperature.log(), weight.log()),
            target[check_at],
            evictable,
        ).item()
        record = {
            "variant": variant,
            "loss": config.loss,
            "fit_windows": len(fit_at),
            "data": describe_data(config, examples, fit_at),
            "command": portable_command(command if command is not None else sys.argv),
        }
        calibrated = Calibration(temperature, weight, record)
        policy.calibration = calibrated
        policy_dir = calibrated_policy_dir(out, variant)
        policy.save_pretrained(policy_dir)
        policy.calibration = None
        drivers[variant] = calibrated_values(scores[check_at], temperature, weight)
        variants[variant] = {
            "description": VARIANTS[variant],
            "losses": history,
            "check_loss": round(check_loss, 6),
            "temperature": temperature.tolist(),
            "weight": weight.tolist(),
            "policy_dir": portable_argument(str(policy_dir)),
        }
    softmax_loss = loss_of(config.loss, scores[check_at].log_softmax(-1), target[check_at], evictable).item()
    lost = lost_attention(
        drivers, target[check_at], layers, config.budgets, config.sink_tokens, config.window_tokens
    )
    result = {
        "provenance": provenance(config.model, "float32", "cpu", policy=policy, command=command),
        "config": portable_config(config),
        "windows": {"fit": [examples[i].uid for i in fit_at], "check": [examples[i].uid for i in check_at]},
        "measure_seconds": round(measure_seconds, 1),
        "softmax_check_loss": round(softmax_loss, 6),
        "variants": variants,
        "lost_attention": summarize_lost(lost),
        "lost_attention_per_window": lost,
    }
    for variant in VARIANTS:
        calibrated = load_policy(calibrated_policy_dir(out, variant))
        result["variants"][variant]["calibration_sha256"] = calibrated.calibration_sha256
    results = Path(config.results) if config.results else out / "calibration.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    results.with_suffix(".md").write_text(markdown_report(result), encoding="utf-8")
    return result


def calibrated_policy_dir(out: Path, variant: str) -> Path:
    """Where ``calibrate`` writes the policy with ``variant``'s calibration."""
    return Path(out) / f"policy-{variant}"


def calibrated_values(scores: torch.Tensor, temperature: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What :meth:`KVPolicy.cross_head_scores` gives every entry, ``[windows, layers, heads, n]``."""
    return (scores / temperature[..., None]).softmax(-1) * weight[..., None]


def describe_data(config: CalibrateConfig, examples: list[Example], chosen: list[int]) -> str:
    counts: dict[str, int] = {}
    for i in chosen:
        counts[examples[i].source] = counts.get(examples[i].source, 0) + 1
    listed = ", ".join(f"{count} {name}" for name, count in sorted(counts.items()))
    return (
        f"{listed} windows of {config.context_tokens} + {config.continuation_tokens} tokens from the "
        f"training documents (seed {config.seed}, val_fraction {config.val_fraction})"
    )


def markdown_report(result: dict) -> str:
    """The check as tables: lost attention per allocation and driver, and the fitted parameters."""
    config = result["config"]
    lost = result["lost_attention"]
    keys = [f"{mode}@{budget}" for budget in config["budgets"] for mode in MODES]
    body = [[name, *[f"{cells[key]:.4f}" for key in keys]] for name, cells in lost.items()]
    spread = [
        [
            variant,
            f"{entry['check_loss']:.4f}",
            *[
                f"{torch.tensor(entry[p]).median().item():.3g} ({torch.tensor(entry[p]).min().item():.3g}"
                f"-{torch.tensor(entry[p]).max().item():.3g})"
                for p in ("temperature", "weight")
            ],
        ]
        for variant, entry in result["variants"].items()
    ]
    provenance_ = result["provenance"]
    return (
        "\n".join(
            [
                f"# Calibration of `{config['policy']}` ({config['model']}), loss `{config['loss']}`",
                "",
                f"Command: `{provenance_['command']}` (commit {provenance_['git_commit']}, "
                f"{provenance_['threads']} thread(s)); measuring took {result['measure_seconds'] / 60:.1f} min.",
                "",
                f"Fit on {len(result['windows']['fit'])} training windows, checked on "
                f"{len(result['windows']['check'])} others. Lost attention: the evictable future attention per "
                "query that an allocation does not keep, mean per head (lower is better), on the check windows.",
                "",
                markdown_table(["driver", *keys], body),
                "",
                f"Check loss of the uncalibrated softmax: {result['softmax_check_loss']:.4f}.",
                "",
                markdown_table(
                    ["variant", "check loss", "temperature median (range)", "weight median (range)"], spread
                ),
            ]
        )
        + "\n"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = CalibrateConfig()
    parser.add_argument(
        "--model", default=defaults.model, help="'smollm2', 'gemma3-270m' or a model directory"
    )
    parser.add_argument(
        "--policy", default=defaults.policy, help="the policy to calibrate (name or directory)"
    )
    parser.add_argument(
        "--out", default=defaults.out, help="folder for the measurements and calibrated policies"
    )
    parser.add_argument("--results", default=None, help="results JSON (default: <out>/calibration.json)")
    parser.add_argument(
        "--windows",
        nargs="*",
        default=[f"{k}={v}" for k, v in defaults.windows.items()],
        metavar="CORPUS=COUNT",
        help="training-document windows per corpus (train.corpora)",
    )
    parser.add_argument("--context-tokens", type=int, default=defaults.context_tokens)
    parser.add_argument("--continuation-tokens", type=int, default=defaults.continuation_tokens)
    parser.add_argument("--check-fraction", type=float, default=defaults.check_fraction)
    parser.add_argument("--loss", choices=list(LOSSES), default=defaults.loss)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument(
        "--budgets", type=comma_list(parse_budget), default=defaults.budgets, help="budgets of the check"
    )
    add_protected_tokens_arguments(parser)
    parser.add_argument("--val-fraction", type=float, default=defaults.val_fraction)
    parser.add_argument("--essays-dir", default=None)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")


def calibrate_command(args: argparse.Namespace) -> dict:
    values = {k: v for k, v in vars(args).items() if k in CalibrateConfig.__dataclass_fields__}
    config = CalibrateConfig(**{**values, "windows": parse_windows(args.windows)})
    result = calibrate(config)
    print(markdown_report(result))
    return result
