"""``python -m train reproduce``: the shipped SmolLM2-135M-Instruct policy from nothing.

Runs, each step resumable (rerun the command after an interruption):

1. collect, in two collections of one trace directory, 8% of each held out, prompts log-uniform in
   512-4096 tokens:
   - ``train``/``val``: 460 candidates: text windows (90 essays, 110 third-party Python code, 60
     package docs, 40 dialogue turns) whose future is their true continuation (64-256 tokens), and
     RULER ``niah_single``/``niah_multikey`` prompts (100 with the question inside, 60 asked after)
     whose future is the gold answer, kept only where the full cache answers correctly;
   - ``train_native``/``val_native``: 110 windows of third-party C/C++/CUDA/Cython/JavaScript
     source (``native_code``), added once the first policy lost on JavaScript;
2. fit: every layer on ``train+train_native``, ListNet on the ``attention_evictable`` target (future
   attention with the always-kept sinks and window left out), 200 steps of 8 traces, agents of 64
   hidden units;
3. evaluate: eviction cost on ``val+val_native`` (recorded in the policy card), then the loss after
   compression on the same held-out examples (``train downstream``, the number the recipe was chosen
   by);
4. with ``--ship``, copy the policy to ``kvp_cache/policies/smollm2-135m-instruct``.

The shipped run, one thread per step on 2 shared cores: 80 + 17 minutes of collection (22.2 GB of
traces), 45 of fitting (two fits sharing the cores), ~20 of downstream evaluation
(docs/training_report.md).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from kvp_cache.policy import POLICIES_DIR
from train.collect import CollectConfig, collect
from train.downstream import DownstreamConfig, run_downstream
from train.evaluate import EvaluateConfig, run_evaluation
from train.fit import FitConfig, fit

SHIPPED_NAME = "smollm2-135m-instruct"


def collect_configs(traces: Path) -> list[CollectConfig]:
    """Step 1: real text of four kinds plus needle tasks (question inside and after), then non-Python
    source code under its own split names; each collection holds out its own validation split."""
    shared = dict(
        context_tokens=(512, 4096),
        future_tokens=(64, 256),
        max_new_tokens=48,
        val_fraction=0.08,
        shard_size=8,
    )
    return [
        CollectConfig(
            str(traces),
            synthetic=100,
            synthetic_after=60,
            tasks=["niah_single", "niah_multikey"],
            windows={"essays": 90, "code": 110, "docs": 60, "dialogue": 40},
            seed=0,
            **shared,
        ),
        CollectConfig(
            str(traces),
            windows={"native_code": 110},
            train_name="train_native",
            val_name="val_native",
            seed=1,
            **shared,
        ),
    ]


def fit_config(traces: Path, out: Path, objective: str = "listnet") -> FitConfig:
    """Step 2. A 128-row position table read with "scale" (relative positions), so prompts of any
    length share it; 64 hidden units (1.7% of a 4K prefill to score, bench/results/policy_smollm2.json).
    It trains on every collection's training split and validates on their held-out splits."""
    collections = collect_configs(traces)
    return FitConfig(
        str(traces),
        str(out),
        objective=objective,
        target="attention_evictable",
        steps=200,
        batch_size=8,
        eval_every=25,
        warmup=10,
        lr=3e-3,
        position_strategy="scale",
        max_positions=128,
        hidden_dim=64,
        train_split="+".join(c.train_name for c in collections),
        val_split="+".join(c.val_name for c in collections),
    )


def ship(policy_dir: Path) -> None:
    """Step 4: copy the policy into the package."""
    target = POLICIES_DIR / SHIPPED_NAME
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "README.md"):
        shutil.copy(policy_dir / name, target / name)
    print(f"shipped to {target}")


def reproduce_command(args: argparse.Namespace) -> None:
    run_dir, report = Path(args.run_dir), Path(args.report_dir)
    traces, fit_dir = run_dir / "traces", run_dir / "fit"
    collections = collect_configs(traces)
    for config in collections:
        collect(config)
    policy_dir = fit(fit_config(traces, fit_dir, args.objective))
    report.mkdir(parents=True, exist_ok=True)
    shutil.copy(fit_dir / "training_curves.png", report / "training_curves.png")
    val_splits = [c.val_name for c in collections]
    run_evaluation(
        EvaluateConfig(
            str(traces), str(report), split="+".join(val_splits), policy=[str(policy_dir)], record=True
        )
    )
    for split in val_splits:  # downstream rebuilds examples from one collection's settings
        run_downstream(DownstreamConfig(str(traces), str(report), split=split, policy=[f"kvp={policy_dir}"]))
    if args.ship:
        ship(policy_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", default="runs/smollm2", help="traces/ and fit/ go here")
    parser.add_argument("--report-dir", default="docs/smollm2", help="evaluation tables and figures")
    parser.add_argument(
        "--objective", default="listnet", help="fit objective: listnet (shipped) or rl (the paper's trainer)"
    )
    parser.add_argument(
        "--ship", action="store_true", help=f"copy the policy to kvp_cache/policies/{SHIPPED_NAME}"
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (1 is faster on a busy machine)"
    )
