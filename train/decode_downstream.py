"""``python -m train downstream-decode``: the loss under a decode-time cap on validation sequences.

The choice metric between policies for decoding (``python -m train downstream`` is its prefill
twin). The sequences are the held-out split of a ``collect-decode`` run (windows cut from the
held-out DOCUMENTS of the training corpora, never the benchmark's held-out corpora), rebuilt from
its ``collect.json``; a sampled sequence's continuation is the one its trace recorded. Per sequence
the prompt is prefilled once; each (method or policy, cap) reads the continuation through
``KVPCache.from_prefill(..., budget=1.0, max_cache_tokens=cap, evict_every=E)`` in forwards of
``chunk_tokens`` (:func:`eval.realtext.continuation_nll`), so the cache evicts between them as
while decoding, and the uncapped cache reads it the same way. The score is the mean NLL per
continuation token minus the uncapped cache's, per source, with a 95% bootstrap interval, and every
row's per-sequence difference from the first policy (or method) named. With ``--rescore`` the
policies score every held entry again at each eviction (``KVPCache(..., rescore=True)``); with
``--age-decay`` each eviction ranks their scores minus ``decay * log2(1 + age)``.

Records go to ``downstream_decode_<split>.jsonl`` as they finish (a rerun scores only what a record
lacks, for the same cache settings); the summary to ``downstream_decode_<split>.{json,md}``, with
provenance. In the tables, "budget" is the cap in tokens.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eval.benchmark_config import ranking_suffix
from eval.realtext import continuation_nll
from kvp_cache import KVPCache
from kvp_cache.models import load_model
from kvp_cache.policy import KVPolicy, checked_age_decay
from kvp_cache.prefill import prefill
from kvp_cache.provenance import policy_record, provenance
from train.data import Example, example_digest
from train.decode import DecodeCollectConfig, decode_examples
from train.downstream import FULL, score_examples, write_summary
from train.evaluate import parse_policies
from train.traces import TraceSplit

RANKINGS = (
    "`+rescore`, every held entry scored again at each eviction; `+age_decay=D`, each eviction ranks the "
    "scores minus D log2(1 + age), age the tokens read since the entry's forward."
)


@dataclass
class DecodeDownstreamConfig:
    """Everything ``downstream-decode`` needs; the CLI flags map one to one.

    policy: ``name=path`` specs, shipped names or directories; methods: registry methods that rank
    decoded tokens (``streaming_llm``, ``tova``, ...). caps: ``max_cache_tokens`` values.
    sources: only the sequences of these sources (``code``, ``docs-sampled``, ...), empty for all;
    for a collection whose corpora changed since, say. limit: at most this many sequences (the first
    ones), 0 for all. rescore: the policies score every held entry again at each eviction
    (``KVPCache(..., rescore=True)``) instead of once, as it entered. age_decay: the policies' ranking
    is their score minus ``age_decay * log2(1 + age)`` (``KVPCache(..., age_decay=...)``); None,
    each policy's own (:attr:`KVPolicy.age_decay`).
    """

    traces: str
    out: str
    split: str = "val"
    policy: list[str] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
    caps: list[int] = field(default_factory=lambda: [256, 512])
    chunk_tokens: int = 16
    evict_every: int = 64
    sinks: int = 4
    window: int = 16
    sources: list[str] = field(default_factory=list)
    limit: int = 0
    rescore: bool = False
    age_decay: float | None = None

    def validate(self) -> None:
        if self.age_decay is not None:
            self.age_decay = checked_age_decay(self.age_decay)
        if not self.policy and not self.methods:
            raise ValueError("give --policy and/or --methods to measure")
        if not self.caps or min(self.caps) <= self.sinks + self.window:
            raise ValueError(
                f"caps must each exceed sinks + window = {self.sinks + self.window}, got {self.caps}"
            )
        for name in ("chunk_tokens", "evict_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def cache_settings(self) -> dict:
        """What every record depends on besides the method: a rerun with others starts afresh."""
        return {k: getattr(self, k) for k in ("chunk_tokens", "evict_every", "sinks", "window")}


def validation_sequences(
    traces: str | Path, split: str, tokenizer, sources: list[str] | None = None
) -> list[Example]:
    """The sequences ``collect-decode`` traced into ``traces/split``, rebuilt from its ``collect.json``
    (a sampled one with its recorded continuation); only those of ``sources`` where given, so the
    others need not rebuild identically."""
    settings = json.loads((Path(traces) / split / "collect.json").read_text())["settings"]
    config = DecodeCollectConfig(out=str(traces), **settings)
    named = decode_examples(config, tokenizer)
    if split not in named:
        raise ValueError(f"split must be {config.train_name!r} or {config.val_name!r}, got {split!r}")
    examples = {e.uid: e for e in named[split]}
    out = []
    for record in of_sources(TraceSplit(traces, split).samples, sources or []):
        example = examples.get(record["uid"])
        if example is not None and example.future_ids is None:
            example.future_ids = record["continuation_ids"]
        if not traced_identically(example, record):
            raise ValueError(
                f"traced sequence {record['uid']} is not rebuilt identically from collect.json (was the "
                "collection made by another version of the code, or did its corpora change?)"
            )
        out.append(example)
    return out


def of_sources(records: list[dict], sources: list[str]) -> list[dict]:
    """The trace records of ``sources`` (all where it is empty); a source the split lacks is an error."""
    present = sorted({r["source"] for r in records})
    unknown = sorted(set(sources) - set(present))
    if unknown:
        raise ValueError(f"sources: {unknown} not in this split, whose sources are {present}")
    return [r for r in records if not sources or r["source"] in sources]


def traced_identically(example: Example | None, record: dict) -> bool:
    """Whether a rebuilt sequence is the one ``record`` traced: by its token digest, or only by its
    prompt length in collections made before the digest was recorded."""
    if example is None or len(example.prompt_ids) != record["prompt_tokens"]:
        return False
    recorded = record.get("ids_sha256")
    return recorded is None or recorded == example_digest(example)


@torch.no_grad()
def sequence_nll(model, example: Example, methods: dict[str, dict], config: DecodeDownstreamConfig) -> dict:
    """``{"full": nll, "<name>@<cap>": nll}``: mean NLL per continuation token, read in chunks.

    methods: name -> ``KVPCache.from_prefill`` options choosing it (``{"method": ...}`` or
    ``{"policy": ...}``).
    """
    device = next(model.parameters()).device
    prefilled = prefill(model, torch.tensor([example.prompt_ids], device=device))
    continuation = torch.tensor([example.future_ids], device=device)

    def nll(cache) -> float:
        return continuation_nll(
            model, prefilled, cache, continuation, chunk_tokens=config.chunk_tokens
        ).item()

    scores = {}
    for name, options in methods.items():
        for cap in config.caps:
            cache = KVPCache.from_prefill(
                prefilled,
                model,
                **options,
                budget=1.0,
                sink_tokens=config.sinks,
                window_tokens=config.window,
                max_cache_tokens=cap,
                evict_every=config.evict_every,
            )
            scores[f"{name}@{cap:g}"] = nll(cache)
    # Last: continuation_nll appends the continuation to the cache it is given, here the prefill's own.
    scores[FULL] = nll(prefilled.cache)
    return scores


def learned_rows(
    policies: dict[str, KVPolicy], rescore: bool, age_decay: float | None
) -> tuple[dict[str, dict], dict[str, str]]:
    """Each policy's ``KVPCache`` options and the weights key its records carry: the weights' sha256,
    followed by how held entries are ranked (:func:`~eval.benchmark_config.ranking_suffix`), so that
    records of different rankings are never read for each other. ``age_decay`` None: each policy's own."""
    options = {
        name: {
            "policy": policy,
            "rescore": rescore,
            "age_decay": policy.age_decay if age_decay is None else age_decay,
        }
        for name, policy in policies.items()
    }
    weights = {
        name: policy_record(policy)["sha256"] + ranking_suffix(rescore, options[name]["age_decay"])
        for name, policy in policies.items()
    }
    return options, weights


def run_decode_downstream(config: DecodeDownstreamConfig, model=None, tokenizer=None) -> dict:
    """Score every validation sequence (resuming from the JSONL), then write the summary files."""
    config.validate()
    settings = json.loads((Path(config.traces) / config.split / "collect.json").read_text())["settings"]
    if model is None:
        model, tokenizer = load_model(settings["model"])
    examples = validation_sequences(config.traces, config.split, tokenizer, config.sources)
    examples = examples[: config.limit] if config.limit else examples
    policies = parse_policies(config.policy)
    methods, weights = learned_rows(policies, config.rescore, config.age_decay)
    methods |= {name: {"method": name} for name in config.methods}
    kept = config.cache_settings()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"downstream_decode_{config.split}"
    log = stem.with_suffix(".jsonl")

    def score(example: Example, missing: dict) -> dict:
        return sequence_nll(model, example, missing, config)

    records = score_examples(log, examples, weights, kept, methods, config.caps, score, "downstream-decode")
    first = next(iter(policies.values()), None)
    weight = next(model.parameters())
    head = {
        "provenance": provenance(settings["model"], str(weight.dtype), str(weight.device), policy=first),
        "policies": {
            name: policy_record(policy) | {"age_decay": methods[name]["age_decay"]}
            for name, policy in policies.items()
        },
        "traces": str(config.traces),
        "split": config.split,
        "caps": config.caps,
        "rescore": config.rescore,
        "age_decay": config.age_decay,
        **kept,
    }
    intro = (
        f"Validation sequences (`{config.split}` of `{config.traces}`: held-out documents of the training "
        f"corpora), read after their prompt in chunks of {config.chunk_tokens} through a cache capped at "
        f"each budget = `max_cache_tokens` (evict_every {config.evict_every}, sinks {config.sinks} + window "
        f"{config.window} kept). NLL per continuation token over the uncapped cache; lower is better."
    )
    rankings = {name: key.split("+", 1)[1] for name, key in weights.items() if "+" in key}
    if rankings:
        named = ", ".join(f"{name} `<sha256>+{ranking}`" for name, ranking in rankings.items())
        intro += f" The policies' records are named {named}: " + RANKINGS
    return write_summary(stem, records, list(methods), config.caps, head, intro)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DecodeDownstreamConfig(traces="", out="")
    parser.add_argument("--traces", required=True, help="directory written by `collect-decode`")
    parser.add_argument("--split", default=defaults.split, help="its held-out split")
    parser.add_argument("--policy", nargs="*", default=[], help="policy dir, shipped name or name=path")
    parser.add_argument("--methods", nargs="*", default=[], help="registry methods that rank decoded tokens")
    parser.add_argument("--caps", type=int, nargs="+", default=defaults.caps, help="max_cache_tokens values")
    for name in ("chunk_tokens", "evict_every", "sinks", "window"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--sources", nargs="*", default=[], help="only these sources' sequences")
    parser.add_argument("--limit", type=int, default=0, help="only the first N sequences (0: all)")
    parser.add_argument(
        "--rescore", action="store_true", help="policies score every held entry again at each eviction"
    )
    parser.add_argument(
        "--age-decay",
        type=float,
        default=None,
        help="policies rank score - DECAY * log2(1 + age) (default: each policy's own; 0: none)",
    )
    parser.add_argument("--out", required=True, help="writes downstream_decode_<split>.{jsonl,json,md} here")
    parser.add_argument("--threads", type=int, default=2)


def downstream_decode_command(args: argparse.Namespace) -> dict:
    fields = set(DecodeDownstreamConfig.__dataclass_fields__)
    return run_decode_downstream(
        DecodeDownstreamConfig(**{k: v for k, v in vars(args).items() if k in fields})
    )
