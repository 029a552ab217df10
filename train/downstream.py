"""``python -m train downstream``: the loss after compression on a collection's held-out samples.

Eviction cost (``train evaluate``) is a proxy. This command measures what users feel, to choose
between policies trained on the same traces: for each held-out example of a ``collect`` run, the
prompt is prefilled once, compressed by every method at every budget, and the example's future
(the true continuation of a text window; the gold answer of a RULER task, after its question for
question-after examples) is teacher-forced through each compressed cache. The score is the mean
NLL per future token minus the full cache's, per source (``essays``, ``code``, ``niah_single``,
``niah_single-after``, ...), with a 95% bootstrap interval; and, to choose between them, every
method's per-example difference from the first policy (or method) named, with its interval.

The examples are rebuilt from the run's ``collect.json`` (deterministic given its seed) and must be
exactly the ones the run traced in ``--split``, so they are held out from every policy fitted on
its other split. Records go to ``downstream_<split>.jsonl`` as they finish (a rerun resumes, and
scores only the methods, budgets and policy weights an example's record lacks, for the same sinks
and window); the summary to ``downstream_<split>.{json,md}``, with provenance.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from eval.benchmark_caches import scored_once
from eval.realtext import continuation_nll
from eval.stats import bootstrap_interval
from eval.sweep import AnswerDecoder
from kvp_cache.budget import parse_budget
from kvp_cache.models import load_model
from kvp_cache.prefill import prefill
from kvp_cache.provenance import policy_record, provenance
from kvp_cache.scorers import make_scorer
from kvp_cache.tables import markdown_table
from train.collect import recorded_config, split_collection
from train.corpora import CORPORA
from train.data import Example, example_digest
from train.decode import SAMPLED
from train.evaluate import parse_policies
from train.traces import TraceSplit

FULL = "full"
ALL_TEXT = "all text"
# Every corpus of train.corpora, and --text-files / --hf-dataset windows ("text").
TEXT_SOURCES = (*CORPORA, "text")


@dataclass
class DownstreamConfig:
    """Everything ``downstream`` needs; the CLI flags map one to one.

    policy: ``name=path`` specs, shipped names or directories (see ``train evaluate``).
    limit: at most this many held-out examples (the first ones), 0 for all.
    """

    traces: str
    out: str
    split: str = "val"
    policy: list[str] = field(default_factory=list)
    methods: list[str] = field(
        default_factory=lambda: ["streaming_llm", "tova", "snapkv", "expected_attention"]
    )
    budgets: list[float] = field(default_factory=lambda: [0.1, 0.25])
    sinks: int = 4
    window: int = 16
    limit: int = 0


def held_out_examples(traces: str | Path, split: str, tokenizer) -> list[Example]:
    """The examples ``collect`` traced into ``traces/split``, rebuilt from its ``collect.json``.

    Examples the full cache answered wrong were skipped by ``collect`` and are left out here too.
    """
    config = recorded_config(traces, split)
    named = split_collection(config, tokenizer)
    if split not in named:
        raise ValueError(f"split must be {config.train_name!r} or {config.val_name!r}, got {split!r}")
    traced = TraceSplit(traces, split).samples
    examples = {e.uid: e for e in named[split]}
    differ = [
        s["uid"]
        for s in traced
        if s["uid"] not in examples or len(examples[s["uid"]].prompt_ids) != s["prompt_tokens"]
    ]
    if differ:
        raise ValueError(
            f"{len(differ)} traced samples are not rebuilt identically from collect.json (was the "
            f"collection made by another version of the code?): {differ[:5]}"
        )
    return [examples[s["uid"]] for s in traced]


@torch.no_grad()
def example_nll(model, decoder: AnswerDecoder, example: Example, scorers: dict, budgets: list) -> dict:
    """``{"full": nll, "<method>@<budget>": nll}``: mean NLL per token of the example's future."""
    if example.future_ids is None:
        raise ValueError(
            f"{example.uid}: a greedy future has no fixed tokens to score; collect with gold futures"
        )
    device = next(model.parameters()).device
    prefilled = prefill(model, torch.tensor([example.prompt_ids], device=device))
    future = torch.tensor([example.question_ids + example.future_ids], device=device)
    scored = {name: scored_once(scorer) for name, scorer in scorers.items()}
    nll = {}
    for budget in budgets:
        cache = decoder.compressed(prefilled, list(scored.values()), budget)
        for name, value in zip(
            scored, continuation_nll(model, prefilled, cache, future).tolist(), strict=True
        ):
            nll[f"{name}@{budget:g}"] = value
    # Last: continuation_nll appends the future to the cache it is given, here the prefill's own.
    nll[FULL] = continuation_nll(model, prefilled, prefilled.cache, future).item()
    return nll


def logged_records(log: Path) -> dict[str, dict]:
    """The records of a JSONL log by uid (the last one of a uid wins); empty when there is none."""
    if not log.exists():
        return {}
    return {r["uid"]: r for r in map(json.loads, log.read_text().splitlines())}


def still_to_score(
    old: dict, weights: dict[str, str], kept: dict, scorers: dict, budgets: list
) -> tuple[dict, dict | None, dict]:
    """What a rerun must score of one example: ``(nll kept from its log record, the scorers still
    missing (None: nothing, not even the full cache), the record it builds on)``.

    A record made with other ``kept`` settings (sinks, window, ...) carries nothing over; a policy
    name whose weights (``weights``: name -> sha256) changed since it was logged is scored again,
    as is every method lacking a budget of ``budgets``.
    """
    if old.get("kept") != kept:
        old = {"nll": {}, "policies": {}}
    stale = {name for name, sha in weights.items() if old.get("policies", {}).get(name) != sha}
    kept_nll = {k: v for k, v in old["nll"].items() if k.split("@")[0] not in stale}
    missing = {
        name: scorer
        for name, scorer in scorers.items()
        if name in stale or any(f"{name}@{b:g}" not in old["nll"] for b in budgets)
    }
    return kept_nll, (missing if missing or FULL not in old["nll"] else None), old


def source_groups(records: list[dict]) -> dict[str, list[dict]]:
    """Records by source, plus every text corpus pooled under :data:`ALL_TEXT`; sorted by source."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record["source"], []).append(record)
        # A sampled continuation (collect-decode --sampled) is text of its prompt's corpus.
        if record["source"].removesuffix(f"-{SAMPLED}") in TEXT_SOURCES:
            groups.setdefault(ALL_TEXT, []).append(record)
    return dict(sorted(groups.items()))


def summary_rows(records: list[dict], names: list[str], budgets: list[float]) -> list[dict]:
    """One row per (source, method, budget): the mean NLL increase over the full cache, with its CI."""
    rows = []
    for source, group in source_groups(records).items():
        for name in names:
            for budget in budgets:
                increase = [r["nll"][f"{name}@{budget:g}"] - r["nll"][FULL] for r in group]
                rows.append(
                    {
                        "source": source,
                        "method": name,
                        "budget": budget,
                        "n": len(increase),
                        "nll_increase": sum(increase) / len(increase),
                        "ci95": list(bootstrap_interval(increase)),
                    }
                )
    return rows


def paired_rows(records: list[dict], names: list[str], budgets: list[float]) -> list[dict]:
    """Every method against the first (``names[0]``) on the same examples: one row per (source,
    method, budget) with the mean per-example NLL difference and its CI. Negative: lower loss than
    the first. Pairing removes the spread between examples, which dominates the unpaired intervals,
    so two policies can be told apart on a small validation split."""
    rows = []
    for source, group in source_groups(records).items():
        for name in names[1:]:
            for budget in budgets:
                key, reference = f"{name}@{budget:g}", f"{names[0]}@{budget:g}"
                difference = [r["nll"][key] - r["nll"][reference] for r in group]
                rows.append(
                    {
                        "source": source,
                        "method": name,
                        "against": names[0],
                        "budget": budget,
                        "n": len(difference),
                        "nll_difference": sum(difference) / len(difference),
                        "ci95": list(bootstrap_interval(difference)),
                    }
                )
    return rows


def markdown_paired(rows: list[dict], budgets: list[float]) -> str:
    """Sources down, methods across: the paired difference against the first method, with its CI."""
    value = {(r["source"], r["method"], r["budget"]): r for r in rows}
    sources = list(dict.fromkeys(r["source"] for r in rows))
    names = list(dict.fromkeys(r["method"] for r in rows))
    tables = []
    for budget in budgets:
        body = [
            [source]
            + [
                "{:+.4f} ({:+.4f}, {:+.4f})".format(
                    value[source, name, budget]["nll_difference"], *value[source, name, budget]["ci95"]
                )
                for name in names
            ]
            for source in sources
        ]
        tables.append(
            f"Budget {budget:g}: NLL difference per future token against `{rows[0]['against']}`, same "
            "examples (95% CI); negative is better\n\n" + markdown_table(["source", *names], body)
        )
    return "\n\n".join(tables)


def markdown_summary(rows: list[dict], names: list[str], budgets: list[float]) -> str:
    """Sources down, methods across, one table per budget; lower is better."""
    value = {(r["source"], r["method"], r["budget"]): r for r in rows}
    sources = sorted({r["source"] for r in rows})
    tables = []
    for budget in budgets:
        body = [
            [f"{source} (n={value[source, names[0], budget]['n']})"]
            + [f"{value[source, name, budget]['nll_increase']:+.4f}" for name in names]
            for source in sources
        ]
        tables.append(
            f"Budget {budget:g}: NLL increase per future token\n\n" + markdown_table(["source", *names], body)
        )
    return "\n\n".join(tables)


def run_downstream(config: DownstreamConfig, model=None, tokenizer=None) -> dict:
    """Score every held-out example (resuming from the JSONL), then write the summary files.

    model / tokenizer: the collection's (default: loaded from its ``collect.json``).
    """
    collection = recorded_config(config.traces, config.split)
    if model is None:
        model, tokenizer = load_model(collection.model)
    examples = held_out_examples(config.traces, config.split, tokenizer)
    examples = examples[: config.limit] if config.limit else examples
    policies = parse_policies(config.policy)
    scorers = {name: make_scorer("kvp", policy=policy) for name, policy in policies.items()}
    scorers |= {name: make_scorer(name) for name in config.methods}
    decoder = AnswerDecoder(model, tokenizer, config.sinks, config.window)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"downstream_{config.split}"
    log = stem.with_suffix(".jsonl")
    weights = {name: policy_record(policy)["sha256"] for name, policy in policies.items()}
    kept = {"sinks": config.sinks, "window": config.window}

    def score(example: Example, missing: dict) -> dict:
        return example_nll(model, decoder, example, missing, config.budgets)

    records = score_examples(log, examples, weights, kept, scorers, config.budgets, score, "downstream")
    first = next(iter(policies.values()), None)
    weight = next(model.parameters())
    head = {
        "provenance": provenance(collection.model, str(weight.dtype), str(weight.device), policy=first),
        "policies": {name: policy_record(policy) for name, policy in policies.items()},
        "traces": str(config.traces),
        "split": config.split,
        "sinks": config.sinks,
        "window": config.window,
    }
    intro = (
        f"Held-out `{config.split}` examples of `{config.traces}`; sinks {config.sinks} + window "
        f"{config.window} kept. Lower is better."
    )
    return write_summary(stem, records, list(scorers), config.budgets, head, intro)


SAME_NLL = 1e-3
"""How far the full cache's NLL of one example may move between runs (threads, float noise)."""
ANOTHER_EXAMPLE = "rebuild the examples as that run did (its commit and working directory) or use a new --out"


def score_examples(
    log: Path,
    examples: list[Example],
    weights: dict[str, str],
    kept: dict,
    scorers: dict,
    budgets: list,
    score: Callable[[Example, dict], dict],
    desc: str,
) -> list[dict]:
    """Each example's record, in order: read from the JSONL ``log``, and what it lacks (see
    :func:`still_to_score`) scored by ``score(example, missing scorers) -> {key: nll}`` and appended
    to the log as each example finishes.

    A record tops up only the example it was scored on: records name it by :func:`example_digest`,
    and for records made before that, the full cache's NLL (scored again each time) must repeat.
    Otherwise the rebuilt example differs (its corpus changed, say), and mixing the two would be
    silently wrong, so this raises.
    """
    done = logged_records(log)
    for example in tqdm(examples, desc=desc, unit="example"):
        kept_nll, missing, old = still_to_score(done.get(example.uid, {}), weights, kept, scorers, budgets)
        if missing is None:
            continue
        digest = example_digest(example)
        if old.get("ids_sha256", digest) != digest:
            raise ValueError(
                f"{log} scored another {example.uid} than the one rebuilt now; {ANOTHER_EXAMPLE}"
            )
        scored = score(example, missing)
        if FULL in kept_nll and abs(kept_nll[FULL] - scored[FULL]) > SAME_NLL:
            raise ValueError(
                f"{example.uid}: the full cache's NLL is {scored[FULL]:.4f} where {log} recorded "
                f"{kept_nll[FULL]:.4f}: it scored another example than the one rebuilt now; {ANOTHER_EXAMPLE}"
            )
        record = {
            "uid": example.uid,
            "source": example.source,
            "ids_sha256": digest,
            "prompt_tokens": len(example.prompt_ids),
            "future_tokens": len(example.question_ids) + len(example.future_ids or []),
            "nll": {**kept_nll, **scored},
            "policies": {**old["policies"], **weights},
            "kept": kept,
        }
        done[example.uid] = record
        with log.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return [done[e.uid] for e in examples]


def write_summary(
    stem: Path, records: list[dict], names: list[str], budgets: list, head: dict, intro: str
) -> dict:
    """Write ``stem.json`` (``head``, then the summary and paired rows) and ``stem.md`` (``intro``,
    then their tables); print the tables and return the JSON's content."""
    rows = summary_rows(records, names, budgets)
    paired = paired_rows(records, names, budgets)
    result = {**head, "rows": rows, "paired": paired}
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown_summary(rows, names, budgets)
    if paired:
        table += "\n\n" + markdown_paired(paired, budgets)
    stem.with_suffix(".md").write_text(f"{intro}\n\n{table}\n")
    print(table)
    return result


def downstream_command(args: argparse.Namespace) -> dict:
    fields = set(DownstreamConfig.__dataclass_fields__)
    return run_downstream(DownstreamConfig(**{k: v for k, v in vars(args).items() if k in fields}))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", required=True, help="directory written by `collect`")
    parser.add_argument("--split", default="val", help="its held-out split")
    parser.add_argument("--policy", nargs="*", default=[], help="policy dir, shipped name or name=path")
    parser.add_argument(
        "--methods", nargs="*", default=DownstreamConfig.__dataclass_fields__["methods"].default_factory()
    )
    parser.add_argument("--budgets", type=parse_budget, nargs="*", default=[0.1, 0.25])
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--limit", type=int, default=0, help="only the first N held-out examples (0: all)")
    parser.add_argument("--out", required=True, help="writes downstream_<split>.{jsonl,json,md} here")
    parser.add_argument("--threads", type=int, default=2)
