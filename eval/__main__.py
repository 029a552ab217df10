"""``python -m eval sweep ...``: the budget sweep (see eval/sweep.py and docs/eval.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eval.sweep import SweepConfig, markdown_report, run_sweep, write_outputs
from kvp_cache.budget import parse_budget
from kvp_cache.models import load_model


def parse_methods(text: str, policy: str | None) -> list[str]:
    """A comma list; ``all`` = every available method (``kvp`` only with a policy)."""
    from kvp_cache import available_methods

    if text == "all":
        return [m for m in available_methods() if m != "kvp" or policy is not None]
    return [m.strip() for m in text.split(",") if m.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval")
    commands = parser.add_subparsers(dest="command", required=True)
    sweep = commands.add_parser(
        "sweep", help="accuracy of methods x budgets on RULER-style tasks, one prefill per sample"
    )
    sweep.add_argument(
        "--model", default="smollm2", help="'smollm2' (offline SmolLM2-135M-Instruct) or a model directory/id"
    )
    sweep.add_argument("--methods", default="all", help="comma list of methods, or 'all'")
    sweep.add_argument(
        "--budgets", default="0.125,0.25,0.5", help="comma list: fractions in (0,1] or token counts"
    )
    sweep.add_argument("--task", default="niah_single", help="comma list of kvp_cache.ruler tasks")
    sweep.add_argument("--context-tokens", type=int, default=2048)
    sweep.add_argument("--samples", type=int, default=8, help="samples per task")
    sweep.add_argument(
        "--policy", default=None, help="KVP policy for method 'kvp' (shipped name, directory, Hub id)"
    )
    sweep.add_argument("--question-after", action="store_true", help="compress the context only, ask after")
    sweep.add_argument(
        "--essays-dir", default=None, help="Paul Graham essays as haystack (default: RULER noise)"
    )
    sweep.add_argument("--seed", type=int, default=0)
    sweep.add_argument("--sink-tokens", type=int, default=4)
    sweep.add_argument("--window-tokens", type=int, default=16)
    sweep.add_argument(
        "--max-new-tokens", type=int, default=None, help="default: per task, see eval/sweep.py"
    )
    sweep.add_argument(
        "--separate-samples",
        type=int,
        default=1,
        help="first samples of the sweep whose answers are also timed as separate generate runs (0: none)",
    )
    sweep.add_argument(
        "--separate-runs",
        type=int,
        default=0,
        help="answers timed per such sample, spread over the grid (0: all)",
    )
    sweep.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy machine)"
    )
    sweep.add_argument("--device", default="cpu")
    sweep.add_argument(
        "--out", type=Path, required=True, help="folder for results.json, table.md, accuracy_vs_budget.png"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = SweepConfig(
        methods=parse_methods(args.methods, args.policy),
        budgets=[parse_budget(b) for b in args.budgets.split(",")],
        tasks=[t.strip() for t in args.task.split(",") if t.strip()],
        context_tokens=args.context_tokens,
        samples=args.samples,
        question_after=args.question_after,
        policy=args.policy,
        essays_dir=args.essays_dir,
        seed=args.seed,
        sink_tokens=args.sink_tokens,
        window_tokens=args.window_tokens,
        max_new_tokens=args.max_new_tokens,
        separate_samples=args.separate_samples,
        separate_runs=args.separate_runs or None,
    )
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    policy = None
    if config.policy is not None:
        from kvp_cache.policy import load_policy

        policy = load_policy(config.policy)
    model, tokenizer = load_model(args.model, device=args.device)
    result = run_sweep(model, tokenizer, config, policy)
    result["config"]["model"] = args.model
    paths = write_outputs(result, args.out)
    print(markdown_report(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
