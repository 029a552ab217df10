"""``python -m train reproduce --model {smollm2,gemma3-270m}``: a shipped policy from nothing.

Runs, each step resumable (rerun the command after an interruption):

1. collect, in one or more collections of one trace directory, each holding out its own validation
   split;
2. fit every evicting layer on every training split, validating on the held-out splits;
3. evaluate: eviction cost on the held-out splits (recorded in the policy card), then the loss after
   compression on the same examples (``train downstream``, the number the recipe was chosen by);
4. where the recipe has a :class:`FineTune`: its prefill and decode-time collections into a second
   trace directory, a short fit from step 2's weights, anchored to their ranking, and its eviction
   cost on the prefill validation splits (recorded in the card);
5. where the recipe is calibrated: ``train calibrate`` (a temperature and a weight per head, for
   ``allocation="head"``/``"layer"``), the ``tau_w`` variant;
6. with ``--ship``, copy the policy (and its calibration) to ``kvp_cache/policies/<its shipped name>``.

The recipes (:data:`RECIPES`):

- ``smollm2`` (``smollm2-135m-instruct``): prompts log-uniform in 512-4096 tokens, 8% held out.
  ``train``/``val``: 460 candidates: text windows (90 essays, 110 third-party Python code, 60
  package docs, 40 dialogue turns) whose future is their true continuation (64-256 tokens), and
  RULER ``niah_single``/``niah_multikey`` prompts (100 with the question inside, 60 asked after)
  whose future is the gold answer, kept only where the full cache answers correctly;
  ``train_native``/``val_native``: 110 windows of third-party C/C++/CUDA/Cython/JavaScript source,
  added once the first policy lost on JavaScript. ListNet on ``attention_evictable`` (future
  attention with the always-kept sinks and window left out), 64 hidden units, 400 steps. 80 + 17
  minutes of collection (22.2 GB of traces), 93 process-minutes of fitting (47 min on 2 processes
  with torchrun), ~20 of downstream evaluation on 2 shared cores (docs/training_report.md).
  Then the fine-tune that serves decoding too (docs/decode/README.md, "anchor08long"): 114 prefill
  candidates of 512-2048 tokens (36 needle prompts, 78 windows), 104 sequences of a 1,024-token
  prompt and 1,024 tokens traced as they are decoded under a cap of 256 (16 continue with the
  model's own samples), and 48 prefill candidates of 4,096-7,936 tokens; 100 steps of ListNet from
  the first fit with ``--anchor 0.8``, on every split (31 minutes). The ``docs`` windows read the
  installed distributions' READMEs, so they differ between environments (the shipped fine-tune's
  first two collections ran at 266ea3c from the checkout root). Then its calibration (7 minutes;
  docs/decode/calibration_anchor08long.md).
- ``gemma3-270m``: plain prompts (a base model), 10% held out, one collection of 140 candidates of
  512-8192 tokens (35 essays, 35 Python code, 25 docs; 30 ``niah_single``/``niah_multiquery``
  prompts with the question inside, 15 asked after). Only its 3 global layers are traced and
  fitted. ListNet on the paper's ``attention`` target, 32 hidden units. 53 minutes of collection
  (0.9 GB), 2 of fitting (docs/training_report_gemma3.md; more data and other targets were tried
  and not shipped, same report). Then the fine-tune that serves decoding too (docs/decode/README.md,
  "a03LE"): 88 sequences of a 1,024-token prompt and 1,024 tokens traced as they are decoded under
  a cap of 256, 24 prefill candidates of 4,096-8,192 tokens (code, docs, ``niah_single``), and 30
  of 1,024-8,192 tokens read from the essays (16 windows, 20 essay-haystack needle prompts); 400
  steps of ListNet on ``attention_evictable`` with ``--anchor 0.3`` (13 + 26 + 18 minutes of
  collection, 3 of fitting).
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from kvp_cache.policy import POLICIES_DIR
from train.calibrate import CalibrateConfig, calibrate, calibrated_policy_dir
from train.collect import LEGACY_SETTINGS, CollectConfig, collect
from train.decode import DecodeCollectConfig, collect_decode
from train.downstream import DownstreamConfig, run_downstream
from train.evaluate import EvaluateConfig, run_evaluation
from train.fit import FitConfig, fit

CALIBRATION_VARIANT = "tau_w"


@dataclass(frozen=True)
class FineTune:
    """A second fit from the first one's weights: collections into their own trace directory, each
    ``("prefill", CollectConfig fields)`` or ``("decode", DecodeCollectConfig fields)`` in the order
    the fit reads their splits; then ``steps`` of ListNet at ``lr`` on every split, ``anchor`` of
    the target being the start weights' ranking. A collection with ``essays`` windows reads the essays
    (its needles then hide in them too); the others read none."""

    collections: tuple[tuple[str, dict], ...]
    steps: int = 100
    lr: float = 1e-3
    anchor: float = 0.8
    eval_every: int = 10
    target: str | None = None  # None: the first fit's


@dataclass(frozen=True)
class Recipe:
    """How one shipped policy is built: its collections (``CollectConfig`` fields, into one trace
    directory), the fit settings that differ between models, an optional :class:`FineTune`, and
    whether the shipped policy carries a cross-head calibration."""

    shipped_name: str
    report_dir: str
    collections: tuple[dict, ...]
    hidden_dim: int
    target: str = "attention_evictable"
    steps: int = 200
    finetune: FineTune | None = None
    calibrated: bool = False


# The shipped policies were collected before text windows were disjoint (train.data.text_examples)
# and before held-out windows came from held-out documents (train.collect.text_windows).
SMOLLM2_SHARED = dict(
    context_tokens=(512, 4096),
    future_tokens=(64, 256),
    max_new_tokens=48,
    val_fraction=0.08,
    **LEGACY_SETTINGS,
)
# The fine-tune's prefill collections: needles in RULER's noise haystack, current window rules.
FINETUNE_PREFILL = dict(tasks=["niah_single", "niah_multikey"], future_tokens=(64, 256), val_fraction=0.15)
RECIPES = {
    "smollm2": Recipe(
        "smollm2-135m-instruct",
        "docs/smollm2",
        (
            dict(
                synthetic=100,
                synthetic_after=60,
                tasks=["niah_single", "niah_multikey"],
                windows={"essays": 90, "code": 110, "docs": 60, "dialogue": 40},
                seed=0,
                **SMOLLM2_SHARED,
            ),
            dict(
                windows={"native_code": 110},
                train_name="train_native",
                val_name="val_native",
                seed=1,
                **SMOLLM2_SHARED,
            ),
        ),
        hidden_dim=64,
        steps=400,
        finetune=FineTune(
            (
                (
                    "prefill",
                    dict(
                        synthetic=24,
                        synthetic_after=12,
                        windows={"code": 30, "native_code": 16, "docs": 16, "dialogue": 16},
                        context_tokens=(512, 2048),
                        seed=1,
                        **FINETUNE_PREFILL,
                    ),
                ),
                (
                    "decode",
                    dict(
                        windows={"code": 24, "native_code": 20, "docs": 20, "dialogue": 24},
                        sampled={"code": 6, "dialogue": 6, "docs": 4},
                        train_name="train_decode",
                        val_name="val_decode",
                        seed=1,
                    ),
                ),
                (
                    "prefill",
                    dict(
                        synthetic=12,
                        synthetic_after=8,
                        windows={"code": 10, "native_code": 6, "docs": 6, "dialogue": 6},
                        context_tokens=(4096, 7936),
                        train_name="train_long",
                        val_name="val_long",
                        seed=3,
                        **FINETUNE_PREFILL,
                    ),
                ),
            )
        ),
        calibrated=True,
    ),
    "gemma3-270m": Recipe(
        "gemma3-270m",
        "docs/gemma3",
        (
            dict(
                synthetic=30,
                synthetic_after=15,
                tasks=["niah_single", "niah_multiquery"],
                windows={"essays": 35, "code": 35, "docs": 25},
                context_tokens=(512, 8192),
                future_tokens=(64, 256),
                max_new_tokens=48,
                val_fraction=0.1,
                model="gemma3-270m",
                seed=0,
                **LEGACY_SETTINGS,
            ),
        ),
        hidden_dim=32,
        target="attention",
        finetune=FineTune(
            (
                (
                    "decode",
                    dict(
                        windows={"code": 24, "native_code": 20, "docs": 20, "dialogue": 24},
                        train_name="train_decode",
                        val_name="val_decode",
                        seed=1,
                    ),
                ),
                (
                    "prefill",
                    dict(
                        FINETUNE_PREFILL,
                        synthetic=8,
                        synthetic_after=4,
                        tasks=["niah_single"],
                        windows={"code": 8, "native_code": 6, "docs": 6},
                        context_tokens=(4096, 8192),
                        train_name="train_long",
                        val_name="val_long",
                        seed=3,
                    ),
                ),
                (
                    "prefill",
                    dict(
                        FINETUNE_PREFILL,
                        synthetic=12,
                        synthetic_after=8,
                        windows={"essays": 16},
                        context_tokens=(1024, 8192),
                        train_name="train_essays",
                        val_name="val_essays",
                        seed=4,
                    ),
                ),
            ),
            steps=400,
            anchor=0.3,
            eval_every=20,
            target="attention_evictable",
        ),
    ),
}


def collect_configs(
    traces: Path, model: str = "smollm2", essays_dir: str | None = None
) -> list[CollectConfig]:
    """Step 1: the recipe's collections into ``traces``, shards of 8 samples. Both recipes read the
    Paul Graham essays (haystack and text windows), which are not shipped: ``essays_dir``."""
    return [
        CollectConfig(str(traces), shard_size=8, essays_dir=essays_dir, **settings)
        for settings in RECIPES[model].collections
    ]


def fit_config(traces: Path, out: Path, objective: str = "listnet", model: str = "smollm2") -> FitConfig:
    """Step 2. A 128-row position table read with "scale" (relative positions), so prompts of any
    length share it; ListNet, the recipe's steps of 8 traces. It trains on every collection's training split
    and validates on their held-out splits."""
    recipe = RECIPES[model]
    collections = collect_configs(traces, model)
    return FitConfig(
        str(traces),
        str(out),
        objective=objective,
        target=recipe.target,
        steps=recipe.steps,
        batch_size=8,
        eval_every=25,
        warmup=10,
        lr=3e-3,
        position_strategy="scale",
        max_positions=128,
        hidden_dim=recipe.hidden_dim,
        train_split="+".join(c.train_name for c in collections),
        val_split="+".join(c.val_name for c in collections),
    )


def finetune_collect_configs(
    traces: Path, model: str = "smollm2", essays_dir: str | None = None
) -> list[CollectConfig | DecodeCollectConfig]:
    """Step 4's collections into ``traces``. Only those with ``essays`` windows read ``essays_dir``;
    the others' needles hide in RULER's noise haystack."""
    kinds = {"prefill": CollectConfig, "decode": DecodeCollectConfig}
    return [
        kinds[kind](
            str(traces),
            model=model,
            essays_dir=essays_dir if "essays" in settings.get("windows", {}) else None,
            **settings,
        )
        for kind, settings in RECIPES[model].finetune.collections
    ]


def finetune_fit_config(traces: Path, out: Path, start: Path, model: str = "smollm2") -> FitConfig:
    """Step 4's fit: step 2's settings from its weights ``start``, shorter and slower, anchored, with
    a faster-moving average of the weights; on every collection's splits."""
    finetune = RECIPES[model].finetune
    collections = finetune_collect_configs(traces, model)
    first_fit = fit_config(traces, out, model=model)
    return replace(
        first_fit,
        target=finetune.target or first_fit.target,
        steps=finetune.steps,
        lr=finetune.lr,
        warmup=5,
        eval_every=finetune.eval_every,
        ema_decay=0.95,
        init_from=str(start),
        anchor=finetune.anchor,
        train_split="+".join(c.train_name for c in collections),
        val_split="+".join(c.val_name for c in collections),
    )


def evaluate_into_card(traces: Path, report: Path, splits: list[str], policy_dir: Path) -> None:
    """Steps 3 and 4's eviction cost on the held-out ``splits``, recorded in the policy's card."""
    run_evaluation(
        EvaluateConfig(
            str(traces), str(report), split="+".join(splits), policy=[str(policy_dir)], record=True
        )
    )


def ship(policy_dir: Path, model: str = "smollm2") -> None:
    """Step 6: copy the policy, and its calibration where it has one, into the package."""
    target = POLICIES_DIR / RECIPES[model].shipped_name
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "README.md", "calibration.safetensors"):
        if (policy_dir / name).exists():
            shutil.copy(policy_dir / name, target / name)
        else:
            (target / name).unlink(missing_ok=True)  # config.json is the judge of what belongs
    print(f"shipped to {target}")


def reproduce_command(args: argparse.Namespace) -> None:
    recipe = RECIPES[args.model]
    run_dir = Path(args.run_dir or f"runs/{args.model}")
    report = Path(args.report_dir or recipe.report_dir)
    traces, fit_dir = run_dir / "traces", run_dir / "fit"
    collections = collect_configs(traces, args.model, args.essays_dir)
    for config in collections:
        collect(config)
    policy_dir = fit(fit_config(traces, fit_dir, args.objective, args.model))
    report.mkdir(parents=True, exist_ok=True)
    shutil.copy(fit_dir / "training_curves.png", report / "training_curves.png")
    val_splits = [c.val_name for c in collections]
    evaluate_into_card(traces, report, val_splits, policy_dir)
    for split in val_splits:  # downstream rebuilds examples from one collection's settings
        run_downstream(DownstreamConfig(str(traces), str(report), split=split, policy=[f"kvp={policy_dir}"]))
    if recipe.finetune is not None:
        tune_traces = run_dir / "finetune_traces"
        tune_collections = finetune_collect_configs(tune_traces, args.model, args.essays_dir)
        for config in tune_collections:
            (collect_decode if isinstance(config, DecodeCollectConfig) else collect)(config)
        policy_dir = fit(finetune_fit_config(tune_traces, run_dir / "finetune", policy_dir, args.model))
        prefill_val = [c.val_name for c in tune_collections if isinstance(c, CollectConfig)]
        evaluate_into_card(tune_traces, report / "finetune", prefill_val, policy_dir)
    if recipe.calibrated:
        out = run_dir / "calibrate"
        calibrate(
            CalibrateConfig(
                model=args.model,
                policy=str(policy_dir),
                out=str(out),
                results=str(report / "calibration.json"),
            )
        )
        policy_dir = calibrated_policy_dir(out, CALIBRATION_VARIANT)
    if args.ship:
        ship(policy_dir, args.model)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", choices=sorted(RECIPES), help="whose shipped policy")
    parser.add_argument(
        "--essays-dir",
        required=True,
        help="the Paul Graham essays (*.txt) the recipes were collected with: haystack and text windows",
    )
    parser.add_argument("--run-dir", default=None, help="traces/ and fit/ go here (default: runs/<model>)")
    parser.add_argument(
        "--report-dir", default=None, help="evaluation tables and figures (default: the recipe's docs/<dir>)"
    )
    parser.add_argument(
        "--objective", default="listnet", help="fit objective: listnet (shipped) or rl (the paper's trainer)"
    )
    parser.add_argument(
        "--ship", action="store_true", help="copy the policy to kvp_cache/policies/<its shipped name>"
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (1 is faster on a busy machine)"
    )
