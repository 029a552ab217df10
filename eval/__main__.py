"""``python -m eval sweep|benchmark|report|compare ...`` (see eval/sweep.py, eval/benchmark.py,
eval/compare.py, docs/eval.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvp_cache.budget import parse_budget
from kvp_cache.cli import add_protected_tokens_arguments
from kvp_cache.models import MODELS, load_model
from kvp_cache.provenance import provenance

SHIPPED = "shipped"  # the benchmark's default policy: the one shipped for --model
RESULTS = Path(__file__).resolve().parent / "results"


def parse_methods(text: str, policy: str | None) -> list[str]:
    """A comma list; ``all`` = every registry method (learned ones only with a policy)."""
    from kvp_cache.scorers import methods

    if text == "all":
        return methods(learned=False) + (methods(learned=True) if policy else [])
    return [m.strip() for m in text.split(",") if m.strip()]


def config_from_args(config_class, args: argparse.Namespace, **derived):
    """``config_class`` (a dataclass) from the options named like its fields, then ``derived`` values.

    Options left at None keep the field's default.
    """
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(config_class)
        if getattr(args, f.name, None) is not None
    }
    return config_class(**{**given, **derived})


def comma_list(convert):
    return lambda text: [convert(item.strip()) for item in text.split(",") if item.strip()]


def add_common(parser: argparse.ArgumentParser) -> None:
    """Options the sweep and the benchmark share."""
    parser.add_argument(
        "--model", default="smollm2", help="'smollm2' (offline SmolLM2-135M-Instruct) or a model directory/id"
    )
    parser.add_argument("--methods", default="all", help="comma list of methods, or 'all'")
    parser.add_argument(
        "--policy", default=None, help="KVP policy for method 'kvp' (shipped name, directory, Hub id)"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_protected_tokens_arguments(parser)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy machine)"
    )
    parser.add_argument("--device", default="cpu")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval")
    commands = parser.add_subparsers(dest="command", required=True)
    sweep = commands.add_parser(
        "sweep", help="accuracy of methods x budgets on RULER-style tasks, one prefill per sample"
    )
    add_common(sweep)
    sweep.add_argument(
        "--budgets", type=comma_list(parse_budget), default="0.125,0.25,0.5",
        help="comma list: fractions in (0,1] or token counts",
    )  # fmt: skip
    sweep.add_argument("--task", default="niah_single", help="comma list of kvp_cache.ruler tasks")
    sweep.add_argument("--context-tokens", type=int, default=2048)
    sweep.add_argument("--samples", type=int, default=8, help="samples per task")
    sweep.add_argument("--split", default="test", help="ruler split: test (reported numbers) or val")
    sweep.add_argument("--question-after", action="store_true", help="compress the context only, ask after")
    sweep.add_argument(
        "--question-token-by-token",
        action="store_true",
        help="with --question-after: feed the question one token at a time (the slower pre-schedules path)",
    )
    sweep.add_argument(
        "--essays-dir", default=None, help="Paul Graham essays as haystack (default: RULER noise)"
    )
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
        "--out", type=Path, required=True, help="folder for results.json, table.md, accuracy_vs_budget.png"
    )

    bench = commands.add_parser(
        "benchmark",
        help="the canonical report: needles (both protocols), held-out real text compressed and read under "
        "a cap, needles recalled after a read under a cap, CIs, resumable",
    )
    add_common(bench)
    bench.set_defaults(policy=SHIPPED)
    bench.add_argument("--budgets", type=comma_list(parse_budget), default=[0.05, 0.1, 0.25, 0.5])
    bench.add_argument("--allocations", type=comma_list(str), default=None,
                       help="comma list of uniform, layer, head: a row per allocation for every method whose scores "
                       "are comparable across heads (others: uniform only), e.g. kvp+head beside kvp "
                       "(default: uniform,head; the decode protocol stays uniform)")  # fmt: skip
    bench.add_argument("--min-per-head", type=int, default=None,
                       help="entries every KV head of an adaptive row keeps at least, protected ones "
                       "included (default: the cache's, the sinks and window plus "
                       "kvp_cache.allocation.MIN_EXTRA_PER_HEAD)")  # fmt: skip
    bench.add_argument("--kvp-rescore", action="store_true",
                       help="the kvp rows score every held entry again at each eviction (KVPCache(..., "
                       "rescore=True)); only the decode and decode_recall protocols answer differently, so only their "
                       "learned rows are recomputed")  # fmt: skip
    bench.add_argument("--kvp-age-decay", type=float, default=None,
                       help="the kvp rows rank each eviction by score - DECAY * log2(1 + age), age the tokens read "
                       "since the entry's forward (KVPCache(..., age_decay=DECAY); default: the policy's own, "
                       "0 turns it off); as with --kvp-rescore, only the decode and decode_recall protocols "
                       "answer differently")  # fmt: skip
    bench.add_argument("--contexts", type=comma_list(int), default=[1024, 2048, 4096, 8192],
                       help="needle context lengths (tokens)")  # fmt: skip
    bench.add_argument("--samples", type=comma_list(int), default=None,
                       help="needle samples per task at each context (default: 50 up to 2K, 20 above)")  # fmt: skip
    bench.add_argument("--protocols", type=comma_list(str), default=["question_in", "question_after"])
    bench.add_argument("--tasks", type=comma_list(str), default=None, help="default: the four niah_* tasks")
    bench.add_argument("--screened-tasks", type=comma_list(str), default=None,
                       help="tasks benchmarked where the full cache scores >= --min-full-score (default: vt, cwe, fwe)")  # fmt: skip
    bench.add_argument("--min-full-score", type=float, default=0.3)
    bench.add_argument("--screen-samples", type=int, default=20)
    bench.add_argument(
        "--corpora", type=comma_list(str), default=None, help="default: every eval.corpora corpus"
    )
    bench.add_argument("--text-contexts", type=comma_list(int), default=[2048, 4096],
                       help="real-text prefix lengths (tokens); empty string for none")  # fmt: skip
    bench.add_argument("--text-windows", type=comma_list(int), default=None,
                       help="windows per corpus at each prefix length (default: 50 at 2K, 20 above)")  # fmt: skip
    bench.add_argument("--continuation-tokens", type=int, default=128)
    bench.add_argument("--decode-caps", type=comma_list(parse_budget), default=None,
                       help="decode protocol: max_cache_tokens, token counts or shares of its window "
                       "(default: 256,512,1024,0.1,0.25); empty string for no decode protocol")  # fmt: skip
    bench.add_argument(
        "--decode-prompt-tokens", type=int, default=None, help="decode protocol prompt (default 1024)"
    )
    bench.add_argument("--decode-tokens", type=int, default=None,
                       help="decode protocol: tokens read under the cap after the prompt, scored (default 2048)")  # fmt: skip
    bench.add_argument(
        "--decode-windows", type=int, default=None, help="decode windows per corpus (default 20)"
    )
    bench.add_argument("--decode-chunk-tokens", type=int, default=None,
                       help="decode protocol: tokens per forward after the prompt (default 16)")  # fmt: skip
    bench.add_argument("--recall-caps", type=comma_list(parse_budget), default=None,
                       help="decode_recall protocol (a needle, filler read under the cap, then the question): "
                       "max_cache_tokens, token counts or shares of context + filler (default: 0.25); "
                       "empty string for no decode_recall protocol")  # fmt: skip
    bench.add_argument("--recall-tasks", type=comma_list(str), default=None,
                       help="decode_recall needle tasks (default: niah_single,niah_multikey)")  # fmt: skip
    bench.add_argument("--recall-samples", type=int, default=None,
                       help="decode_recall samples per task (default 50)")  # fmt: skip
    bench.add_argument("--recall-context-tokens", type=int, default=None,
                       help="decode_recall needle context, question left out (default 1024)")  # fmt: skip
    bench.add_argument("--recall-filler-tokens", type=int, default=None,
                       help="decode_recall: held-out prose read under the cap before the question, in "
                       "chunks of --decode-chunk-tokens (default 1024)")  # fmt: skip
    bench.add_argument(
        "--evict-every", type=int, default=None, help="the capped caches' evict_every (default 64)"
    )
    bench.add_argument("--oracle-horizon", type=int, default=None,
                       help="queries after each eviction the capped oracle reads (default: until the next one)")  # fmt: skip
    bench.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt tokens per prefill forward (default: one forward); bounds attention memory, which a "
        "32K prompt on CPU needs",
    )
    bench.add_argument("--no-oracle", action="store_true", help="skip the oracle row")
    bench.add_argument(
        "--essays-dir", default=None, help="Paul Graham essays *.txt as haystack (default: RULER noise)"
    )
    bench.add_argument("--out", type=Path, default=None, help="default: eval/results/<model>")
    bench.add_argument(
        "--no-run",
        action="store_true",
        help="only write benchmark.json and the report from the finished samples (e.g. while a run goes on)",
    )

    report = commands.add_parser(
        "report", help="rewrite tables, plots, headline and docs/eval.md from a benchmark.json"
    )
    report.add_argument("benchmark_json", type=Path)

    compare = commands.add_parser(
        "compare",
        help="pair two benchmark runs' learned rows sample by sample (another policy, same samples)",
    )
    compare.add_argument("new", type=Path, help="benchmark output directory of the candidate policy")
    compare.add_argument("base", type=Path, help="benchmark output directory it is compared against")
    compare.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    return parser


def default_counts(lengths: list[int], counts: list[int] | None) -> dict[int, int]:
    """``--samples``/``--text-windows`` per length (one number for all, or one per length)."""
    if counts is None:
        return {n: 50 if n <= 2048 else 20 for n in lengths}
    if len(counts) == 1:
        counts = counts * len(lengths)
    if len(counts) != len(lengths):
        raise SystemExit(f"give one count, or one per length ({len(lengths)}), got {counts}")
    return dict(zip(lengths, counts, strict=True))


def load_policy_if(name: str | None):
    if not name:
        return None
    from kvp_cache.policy import load_policy

    return load_policy(name)


def run_sweep_command(args, model, tokenizer, policy) -> None:
    from eval.sweep import SweepConfig, markdown_report, run_sweep, write_outputs

    config = config_from_args(
        SweepConfig,
        args,
        methods=parse_methods(args.methods, args.policy),
        tasks=[t.strip() for t in args.task.split(",") if t.strip()],
        question_whole=not args.question_token_by_token,
        separate_runs=args.separate_runs or None,
    )
    header = provenance(args.model, next(model.parameters()).dtype, args.device, policy=policy)
    result = {"provenance": header, **run_sweep(model, tokenizer, config, policy)}
    paths = write_outputs(result, args.out)
    print(markdown_report(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))


def run_benchmark_command(args, model, tokenizer, policy) -> None:
    from eval.benchmark import Benchmark, benchmark_result
    from eval.benchmark_config import BenchmarkConfig
    from eval.report import DOCS, README, write_report

    config = config_from_args(
        BenchmarkConfig,
        args,
        methods=parse_methods(args.methods, args.policy),
        policy=args.policy or None,
        samples=default_counts(args.contexts, args.samples),
        text_windows=default_counts(args.text_contexts, args.text_windows),
        oracle=not args.no_oracle,
        essays_dir=args.essays_dir or None,
    )
    out = args.out or RESULTS / Path(args.model).name
    benchmark = Benchmark(model, tokenizer, config, out, policy, prefill_chunk=args.prefill_chunk)
    if not args.no_run:
        benchmark.run()
    header = provenance(args.model, next(model.parameters()).dtype, args.device, policy=policy)
    result = benchmark_result(benchmark.config, out, benchmark.fingerprint, header)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "benchmark.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    # The canonical run (default --out) also regenerates docs/eval.md's tables and the README headline.
    canonical = args.out is None
    paths = write_report(result, out, docs=DOCS if canonical else None, readme=README if canonical else None)
    print(f"wrote {path}, " + ", ".join(str(p) for p in paths))
    if result["pending"]:
        print(f"{len(result['pending'])} cells unfinished: run the same command again to resume")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "prefill_chunk", None) is not None and args.prefill_chunk < 1:
        parser.error(f"--prefill-chunk must be >= 1 token, got {args.prefill_chunk}")
    if args.command == "report":
        from eval.report import write_report

        result = json.loads(args.benchmark_json.read_text())
        print("wrote " + ", ".join(str(p) for p in write_report(result, args.benchmark_json.parent)))
        return 0
    if args.command == "compare":
        from eval.compare import main as compare

        compare(args.new, args.base, args.out)
        return 0
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.policy == SHIPPED:
        from kvp_cache.demo import default_policy

        args.policy = default_policy(MODELS[args.model].model_id if args.model in MODELS else args.model)
    policy = load_policy_if(args.policy)
    model, tokenizer = load_model(args.model, device=args.device)
    if args.command == "sweep":
        run_sweep_command(args, model, tokenizer, policy)
    else:
        run_benchmark_command(args, model, tokenizer, policy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
