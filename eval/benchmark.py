"""``python -m eval benchmark``: the canonical report, ``eval/results/<model>/benchmark.json``.

Four protocols, every method at every budget (cap), plus the full cache and the oracle (:mod:`eval.oracle`):

- ``question_in``: a RULER-style needle prompt is compressed whole, question included (the paper's);
- ``question_after``: the context is compressed, then the question is asked on the compressed cache;
- ``perplexity``: a held-out real-text prefix (:mod:`eval.corpora`) is compressed and the next
  ``continuation_tokens`` tokens are scored (:mod:`eval.realtext`);
- ``decode``: a held-out real-text prompt, then ``decode_tokens`` teacher-forced tokens, all read
  through a cache capped at ``max_cache_tokens`` (each of ``decode_caps``) in chunks of
  ``decode_chunk_tokens``, the cache evicting between chunks as while decoding; the NLL of the
  read tokens is scored. Methods that cannot rank decoded tokens (``scores_decoded_tokens``) sit
  it out; its oracle is :class:`eval.oracle.CappedOracleScorer`.

Needle samples come from the ``test`` split of :mod:`kvp_cache.ruler`, so none of them, nor their
needles, depths or haystack windows, was seen in training. Besides the ``niah_*`` tasks, every other
task whose full-cache accuracy reaches ``min_full_score`` (screened on its own samples) is
benchmarked; the rest are listed as excluded with their full-cache scores.

Allocations (``allocations``): every method whose scores are comparable across heads
(``Scorer.comparable_across_heads``, the oracle's too) gets a row per allocation, named
``<method>+<allocation>`` (``kvp+head``) beside its uniform row ``<method>``; the other methods get
their uniform row only; every KV head of an adaptive row keeps at least ``min_per_head`` entries.
The ``decode`` protocol stays uniform. Real-text rows carry the KV bytes of
their cache and its share of the full cache's (measured once per prefix length, :meth:`Benchmark.measure_kv_bytes`),
and each adaptive row its paired NLL gain over the uniform row of its method.

Every sample is prefilled ONCE; every (method, budget) is compressed from that prefill
(``KVPCache.from_prefill``) and all uniform methods of one budget decode together as one batch
(an adaptive cache keeps different entries per head, so it decodes on its own). Each
finished sample is appended to a per-cell JSONL shard under ``<out>/shards``, so an interrupted run
resumes where it stopped. A record holds one answer per (method, budget) and names the policy of its
learned answers, so a new method, budget or policy tops records up (:meth:`Benchmark.run`) instead
of recomputing them; ``benchmark.json`` holds one flat row per cell, built from the shards
(:func:`collect_rows`), under the provenance of the run.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from eval import realtext
from eval.corpora import CORPORA, corpus
from eval.oracle import ORACLE, OracleScorer, capped_oracle_scorer, future_states, oracle_scorer
from eval.stats import bootstrap_interval, wilson_interval
from eval.sweep import FULL, MAX_NEW_TOKENS, AnswerDecoder, check_methods, encode_prompt, stack_caches
from kvp_cache import KVPCache, ruler
from kvp_cache.allocation import MODES, validate_mode
from kvp_cache.budget import Budget, validate_budget, validate_count
from kvp_cache.cache import cache_bytes
from kvp_cache.prefill import prefill
from kvp_cache.provenance import portable_config
from kvp_cache.scorers import SCORERS, Scorer, make_scorer, methods
from kvp_cache.targets import eviction_points

NEEDLE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
SCREENED_TASKS = tuple(task for task in ruler.TASKS if task not in NEEDLE_TASKS)
NEEDLE_PROTOCOLS = ("question_in", "question_after")
PERPLEXITY = "perplexity"
DECODE = "decode"
TEMPLATE_TOKENS = 64
"""Room left in ``context_tokens`` for the chat template and answer prefix around a sample."""
ALL = "all"
"""The task or corpus of pooled rows: every sample of every task (corpus) of one protocol and length."""
UNIFORM = "uniform"
KV_BYTES = "kv_bytes"
"""The shards of the measured KV bytes of every real-text row, one per prefix length."""


def row_name(method: str, allocation: str) -> str:
    """How rows and records name a method under an allocation: ``kvp`` (uniform), ``kvp+head``."""
    return method if allocation == UNIFORM else f"{method}+{allocation}"


def split_row(name: str) -> tuple[str, str]:
    """``(method, allocation)`` of a row name (:func:`row_name`); ``full`` is uniform."""
    method, _, allocation = name.partition("+")
    return method, allocation or UNIFORM


def comparable_across_heads(method: str) -> bool:
    """Whether ``method`` (a registry name or the oracle) can rank an adaptive allocation."""
    return (OracleScorer if method == ORACLE else SCORERS[method]).comparable_across_heads


def uniform_only(method_names: list[str], allocations: list[str]) -> list[str]:
    """The methods that get no adaptive row although ``allocations`` asks for one: their scores
    are not comparable across heads."""
    if all(allocation == UNIFORM for allocation in allocations):
        return []
    return [m for m in method_names if not comparable_across_heads(m)]


@dataclass
class BenchmarkConfig:
    """What the benchmark covers; the defaults are the canonical SmolLM2 report.

    samples: needle samples per task at each context length (``contexts`` must all be keys);
    text_windows: real-text windows per corpus at each prefix length (``text_contexts`` keys).
    decode_caps: the ``decode`` protocol's ``max_cache_tokens``, each an int (tokens) or a float in
    (0, 1] (that share of ``decode_prompt_tokens + decode_tokens``, rounded); empty: no ``decode``.
    decode_windows: its windows per corpus; decode_chunk_tokens: tokens per forward after the
    prompt; evict_every: the capped cache's slack; oracle_horizon: queries after each eviction the
    capped oracle reads (None: until the next eviction).
    allocations: how each compressed row splits its budget among KV heads
    (:data:`kvp_cache.allocation.MODES`); a non-uniform one adds a row ``<method>+<allocation>`` for
    every method that can rank it (:func:`comparable_across_heads`), at the same total entries.
    The needle and real-text protocols only: ``decode`` rows are uniform.
    min_per_head: the entries every KV head of an adaptive row keeps at least (``KVPCache``'s
    ``min_per_head``, protected ones included); None: the cache's default, the protected entries plus
    :data:`kvp_cache.allocation.MIN_EXTRA_PER_HEAD`. Records name it with their adaptive answers, which
    another value recomputes (:func:`missing_rows`).
    """

    methods: list[str]
    policy: str | None = None
    budgets: list[Budget] = field(default_factory=lambda: [0.05, 0.1, 0.25, 0.5])
    allocations: list[str] = field(default_factory=lambda: [UNIFORM, "head"])
    min_per_head: int | None = None
    protocols: list[str] = field(default_factory=lambda: list(NEEDLE_PROTOCOLS))
    tasks: list[str] = field(default_factory=lambda: list(NEEDLE_TASKS))
    screened_tasks: list[str] = field(default_factory=lambda: list(SCREENED_TASKS))
    min_full_score: float = 0.3
    screen_samples: int = 20
    contexts: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    samples: dict[int, int] = field(default_factory=lambda: {1024: 50, 2048: 50, 4096: 20, 8192: 20})
    corpora: list[str] = field(default_factory=lambda: list(CORPORA))
    text_contexts: list[int] = field(default_factory=lambda: [2048, 4096])
    text_windows: dict[int, int] = field(default_factory=lambda: {2048: 50, 4096: 20})
    continuation_tokens: int = 128
    decode_caps: list[Budget] = field(default_factory=lambda: [256, 512, 1024, 0.1, 0.25])
    decode_prompt_tokens: int = 1024
    decode_tokens: int = 2048
    decode_windows: int = 20
    decode_chunk_tokens: int = 16
    evict_every: int = 64
    oracle_horizon: int | None = None
    oracle: bool = True
    essays_dir: str | None = None
    seed: int = 0
    sink_tokens: int = 4
    window_tokens: int = 16

    def __post_init__(self) -> None:
        check_methods(self.methods, self.policy)
        if not self.budgets:
            raise ValueError("budgets is empty; give fractions in (0, 1] or token counts >= 1")
        self.budgets = [validate_budget(b) for b in self.budgets]
        if not self.allocations or len(set(self.allocations)) != len(self.allocations):
            raise ValueError(f"allocations must be distinct values among {MODES}, got {self.allocations}")
        for allocation in self.allocations:
            validate_mode(allocation, "allocations")
        if self.min_per_head is not None:
            validate_count("min_per_head", self.min_per_head, 1)
            small = [b for b in self.budgets if isinstance(b, int) and b < self.min_per_head]
            if small:
                raise ValueError(f"min_per_head ({self.min_per_head}) exceeds the per-head budgets {small}")
        self.samples = {int(k): v for k, v in self.samples.items()}
        self.text_windows = {int(k): v for k, v in self.text_windows.items()}
        unknown = sorted(set(self.protocols) - set(NEEDLE_PROTOCOLS))
        if unknown:
            raise ValueError(f"protocols must be among {', '.join(NEEDLE_PROTOCOLS)}; got {unknown}")
        unknown = sorted(set(self.tasks + self.screened_tasks) - set(ruler.TASKS))
        if unknown:
            raise ValueError(f"tasks must be among {', '.join(ruler.TASKS)}; got {unknown}")
        unknown = sorted(set(self.corpora) - set(CORPORA))
        if unknown:
            raise ValueError(f"corpora must be among {', '.join(CORPORA)}; got {unknown}")
        for name, lengths, counts in (
            ("contexts", self.contexts, self.samples),
            ("text_contexts", self.text_contexts, self.text_windows),
        ):
            missing = [n for n in lengths if n not in counts]
            if missing:
                raise ValueError(f"{name} {missing} have no sample count; add them to the counts {counts}")
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 64 for n in lengths):
                raise ValueError(f"{name} must be ints >= 64 tokens, got {lengths}")
        counts = [*self.samples.values(), *self.text_windows.values(), self.screen_samples]
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
            raise ValueError(f"sample counts must be ints >= 1, got {counts}")
        if not 0.0 <= self.min_full_score <= 1.0:
            raise ValueError(f"min_full_score must be in [0, 1], got {self.min_full_score}")
        if self.continuation_tokens < 1:
            raise ValueError(f"continuation_tokens must be >= 1, got {self.continuation_tokens}")
        self.validate_decode()

    def validate_decode(self) -> None:
        self.decode_caps = [validate_budget(cap) for cap in self.decode_caps]
        for name, minimum in (
            ("decode_prompt_tokens", 1),
            ("decode_tokens", 2),
            ("decode_windows", 1),
            ("decode_chunk_tokens", 1),
            ("evict_every", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if self.oracle_horizon is not None and self.oracle_horizon < 1:
            raise ValueError(
                f"oracle_horizon must be None (until the next eviction) or >= 1, got {self.oracle_horizon}"
            )
        protected = self.sink_tokens + self.window_tokens
        small = [cap for cap in self.decode_caps if self.cap_tokens(cap) < protected]
        if small:
            raise ValueError(
                f"decode_caps {small} keep fewer than sink_tokens + window_tokens = {protected} tokens "
                f"(shares are of {self.decode_prompt_tokens + self.decode_tokens} tokens)"
            )

    def row_methods(self) -> list[str]:
        """The compressed rows of every cell (:func:`row_name`), the oracle's last: each method
        under each of ``allocations`` it can rank, its uniform row first."""
        return [
            row_name(method, allocation)
            for method in self.methods + ([ORACLE] if self.oracle else [])
            for allocation in self.allocations
            if allocation == UNIFORM or comparable_across_heads(method)
        ]

    def grid(self) -> list[tuple[str, Budget | None]]:
        """Every row of a cell: the full cache, then each (method, budget)."""
        return [(FULL, None)] + [(m, b) for m in self.row_methods() for b in self.budgets]

    def capped_methods(self) -> list[str]:
        """The methods of the ``decode`` protocol: those that can rank decoded tokens."""
        return [m for m in self.methods if SCORERS[m].scores_decoded_tokens]

    def decode_grid(self) -> list[tuple[str, Budget | None]]:
        """Every row of a ``decode`` cell: the uncapped cache, then each (method, cap), oracle last."""
        capped = self.capped_methods() + ([ORACLE] if self.oracle else [])
        return [(FULL, None)] + [(m, cap) for m in capped for cap in self.decode_caps]

    def cap_tokens(self, cap: Budget) -> int:
        """``max_cache_tokens`` of a cap: a token count, or a share of the ``decode`` window."""
        return cap if isinstance(cap, int) else round(cap * (self.decode_prompt_tokens + self.decode_tokens))

    def decode_fields(self) -> dict:
        """What every ``decode`` record depends on besides the fingerprint and its cell (records
        carry them; :class:`Shard` reads no record made with others)."""
        return {
            "windows": realtext.WINDOWS,
            "decode_tokens": self.decode_tokens,
            "chunk_tokens": self.decode_chunk_tokens,
            "evict_every": self.evict_every,
            "oracle_horizon": self.oracle_horizon,
        }

    def fingerprint(self, policy_sha256: str | None, calibration_sha256: str | None = None) -> Fingerprint:
        """What the shard records of a run with the policy of ``policy_sha256`` must match.

        The hash covers what EVERY answer of a record depends on: the samples (seed, essays, the
        room left for the template, the continuation length) and the cache geometry (sink and
        window). Methods, budgets and the policy stay out of it: a record names each answer by
        method and budget (:func:`method_key`), one method's answers never depend on the others',
        and the record names the policy of its learned answers, so another method list, budget list
        or policy tops records up instead of discarding them. ``calibration_sha256``: the policy's
        cross-head calibration, which its adaptive answers also depend on (:func:`is_calibrated`).
        ``min_per_head`` stays out of it too: only adaptive answers depend on it (:func:`is_adaptive`),
        and records name it, so another value recomputes those alone.
        """
        keys = {
            "seed": self.seed,
            "essays_dir": Path(self.essays_dir).name if self.essays_dir else None,
            "sink": self.sink_tokens,
            "window": self.window_tokens,
            "continuation": self.continuation_tokens,
            "template_tokens": TEMPLATE_TOKENS,
        }
        # The legacy format predates allocations: its method list is the uniform one.
        methods = self.methods + ([ORACLE] if self.oracle else [])
        legacy = {"methods": methods, "budgets": self.budgets, "policy": policy_sha256, **keys}
        return Fingerprint(digest(keys), policy_sha256, digest(legacy), calibration_sha256, self.min_per_head)


def shard(out: Path, fingerprint: Fingerprint, *parts: object, fields: dict | None = None) -> Shard:
    """The shard of cell ``parts`` (protocol, task or corpus, length) under ``out/shards``; ``fields``:
    what its records must carry (real text: the window placement, :data:`eval.realtext.WINDOWS`)."""
    if parts[0] == PERPLEXITY:
        fields = {"windows": realtext.WINDOWS}
    return Shard(Path(out) / "shards" / Path(*map(str, parts)).with_suffix(".jsonl"), fingerprint, fields)


def digest(keys: dict) -> str:
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Fingerprint:
    """Which shard records a run reads.

    config: the hash of what every answer depends on (:meth:`BenchmarkConfig.fingerprint`), stored
        in each record; records of another one are never read.
    policy: sha256 of the policy's ``model.safetensors`` (None without a policy); learned answers
        of a record naming another policy are recomputed.
    legacy: the fingerprint records had when it also hashed the method list, budgets and policy.
        Records carrying it were made with this configuration and policy: they are read as
        complete records of ``policy`` (and rewritten in today's format by the next run).
    calibration: sha256 of the policy's cross-head calibration (None without one); a record's
        learned adaptive answers (:func:`is_calibrated`) are recomputed when it names another one.
    min_per_head: :attr:`BenchmarkConfig.min_per_head`; a record's adaptive answers
        (:func:`is_adaptive`) are recomputed when it names another one (records without the field,
        made before it existed, used the default, None).
    """

    config: str
    policy: str | None
    legacy: str
    calibration: str | None = None
    min_per_head: int | None = None


def method_key(method: str, budget: Budget | None) -> str:
    """How a shard record names an answer: ``full`` or ``<row name>@<budget>`` (``kvp+head@0.1``)."""
    return FULL if budget is None else f"{method}@{budget}"


def is_learned(key: str) -> bool:
    """Whether the answer named ``key`` (:func:`method_key`) comes from a learned policy."""
    return split_row(key.split("@")[0])[0] in methods(learned=True)


def is_adaptive(key: str) -> bool:
    """Whether the answer named ``key`` comes from an adaptive allocation (``kvp+head@0.1``), so it
    depends on the minimum per head."""
    return split_row(key.split("@")[0])[1] != UNIFORM


def is_calibrated(key: str) -> bool:
    """Whether the answer named ``key`` also depends on the policy's cross-head calibration: a
    learned method under an adaptive allocation."""
    return is_learned(key) and is_adaptive(key)


ANSWER_FIELDS = ("predictions", "scores", "nll")
"""The fields of a record that map :func:`method_key` names to answers (needles: predictions and
scores; real text: nll)."""


def missing_rows(
    grid: list[tuple[str, Budget | None]], fingerprint: Fingerprint, record: dict | None
) -> list[tuple[str, Budget | None]]:
    """The rows of ``grid`` (a cell's) that ``record`` lacks, or holds from another policy (learned
    rows), calibration (learned adaptive rows) or minimum per head (adaptive rows)."""
    if record is None:
        return list(grid)
    held = {key for name in ANSWER_FIELDS for key in record.get(name, {})}
    fresh = record.get("policy") == fingerprint.policy
    calibrated = record.get("calibration") == fingerprint.calibration
    minimum = record.get("min_per_head") == fingerprint.min_per_head
    return [
        (method, budget)
        for method, budget in grid
        if (key := method_key(method, budget)) not in held
        or (is_learned(key) and not fresh)
        or (is_calibrated(key) and not calibrated)
        or (is_adaptive(key) and not minimum)
    ]


def topped_up(record: dict | None, new: dict, fingerprint: Fingerprint) -> dict:
    """``record`` with the answers and fields of ``new`` (computed for some rows) added; times add up.

    When ``new`` holds learned answers, the record's learned answers of another policy are dropped,
    and the record names ``fingerprint.policy``; likewise for learned adaptive answers and
    ``fingerprint.calibration``, and for adaptive answers and ``fingerprint.min_per_head`` (each
    named only once the record holds such answers).
    """
    old = dict(record or {})
    keys = [key for name in ANSWER_FIELDS for key in new.get(name, {})]
    learned = any(map(is_learned, keys))
    calibrated = any(map(is_calibrated, keys))
    adaptive = any(map(is_adaptive, keys))
    stale = learned and old.get("policy") != fingerprint.policy
    stale_calibration = calibrated and old.get("calibration") != fingerprint.calibration
    stale_minimum = adaptive and old.get("min_per_head") != fingerprint.min_per_head
    merged = {**old, **new, "policy": fingerprint.policy if learned else old.get("policy")}
    if calibrated:
        merged["calibration"] = fingerprint.calibration
    if adaptive:
        merged["min_per_head"] = fingerprint.min_per_head
    for name in ANSWER_FIELDS:
        if name in new:
            kept = {
                k: v
                for k, v in old.get(name, {}).items()
                if not (stale and is_learned(k))
                and not (stale_calibration and is_calibrated(k))
                and not (stale_minimum and is_adaptive(k))
            }
            merged[name] = {**kept, **new[name]}
    for name in ("seconds", "cpu_seconds"):
        merged[name] = old.get(name, 0.0) + new[name]
    return merged


class Shard:
    """One cell's finished samples, one JSON line each (append-only; a torn last line is ignored).

    A sample's later line replaces its earlier ones: a top-up appends the whole merged record.
    ``fields``: values every record read must carry (real text: the window placement,
    :data:`eval.realtext.WINDOWS`); records without them are never read.
    """

    def __init__(self, path: Path, fingerprint: Fingerprint, fields: dict | None = None):
        self.path = path
        self.fingerprint = fingerprint
        self.fields = fields or {}

    def records(self) -> dict[int, dict]:
        """The latest record of each sample made under this fingerprint (or its legacy one, then
        named after the fingerprint's policy)."""
        found: dict[int, dict] = {}
        if not self.path.exists():
            return found
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # an interrupted write
            if any(record.get(key) != value for key, value in self.fields.items()):
                continue
            if record.get("fingerprint") == self.fingerprint.legacy:
                found[record["index"]] = {**record, "policy": self.fingerprint.policy}
            elif record.get("fingerprint") == self.fingerprint.config:
                found[record["index"]] = record
        return found

    def upgrade(self) -> None:
        """Append, in today's format, every sample whose latest line has the legacy fingerprint, so
        that its answers stay usable when the method list or the policy changes."""
        for record in self.records().values():
            if record["fingerprint"] == self.fingerprint.legacy:
                self.append(record)

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torn = (
            self.path.exists() and not self.path.read_bytes().endswith(b"\n") and self.path.stat().st_size > 0
        )
        with self.path.open("a", encoding="utf-8") as handle:
            # After an interrupted write, start on a new line so the torn one stays alone.
            handle.write(
                ("\n" if torn else "") + json.dumps({**record, "fingerprint": self.fingerprint.config}) + "\n"
            )


@dataclass
class Cell:
    """One (protocol, task or corpus, length) cell: its shard, sample count, ``compute(index, rows)``
    -> the answers of ``rows`` (``(method, budget)`` pairs of ``grid``, the cell's rows) for one
    sample, with the sample's other fields (without index and timings), and the latest record of
    each sample."""

    shard: Shard
    count: int
    compute: Callable[[int, list[tuple[str, Budget | None]]], dict]
    grid: list[tuple[str, Budget | None]]
    records: dict[int, dict] = field(init=False)

    def __post_init__(self) -> None:
        self.records = self.shard.records()


@dataclass
class AllocatedDecoder(AnswerDecoder):
    """An :class:`~eval.sweep.AnswerDecoder` whose caches split each budget by ``allocation``, each
    head keeping at least ``min_per_head`` entries under an adaptive one (None: the cache's default).

    Uniform caches of one budget keep the same entries per head and stack into one batch; an
    adaptive cache keeps different entries per head, so it is a batch of its own.
    """

    allocation: str = UNIFORM
    min_per_head: int | None = None

    def cache_options(self, method: str | Scorer, budget: Budget) -> dict:
        options = super().cache_options(method, budget)
        if self.allocation == UNIFORM:
            return options
        return {**options, "allocation": self.allocation, "min_per_head": self.min_per_head}

    def caches(self, prefilled, methods: list, budget: Budget) -> list[KVPCache]:
        """One compressed cache of the prefill per method, all at ``budget``."""
        return [
            KVPCache.from_prefill(prefilled, self.model, **self.cache_options(m, budget)) for m in methods
        ]

    def compressed(self, prefilled, methods: list, budget: Budget) -> KVPCache:
        caches = self.caches(prefilled, methods, budget)
        if self.allocation == UNIFORM:
            return stack_caches(caches)
        if len(caches) != 1:
            raise ValueError(f"allocation {self.allocation!r} caches do not stack: give one method at a time")
        return caches[0]


class Benchmark:
    """Runs the cells of a :class:`BenchmarkConfig` into shards under ``out / "shards"``."""

    def __init__(
        self,
        model,
        tokenizer,
        config: BenchmarkConfig,
        out: Path,
        policy=None,
        prefill_chunk: int | None = None,
    ):
        self.model = model
        # Prompt tokens per prefill forward (kvp_cache.prefill's chunk_tokens): bounds attention memory
        # at long contexts; answers equal one forward's up to float noise, so it is not in the fingerprint.
        self.prefill_chunk = prefill_chunk
        self.tokenizer = tokenizer
        self.config = config
        self.out = Path(out)
        self.device = next(model.parameters()).device
        self.decoders = {
            allocation: AllocatedDecoder(
                model,
                tokenizer,
                config.sink_tokens,
                config.window_tokens,
                policy,
                allocation=allocation,
                min_per_head=config.min_per_head,
            )
            for allocation in MODES
        }
        self.decoder = self.decoders[UNIFORM]
        sha256 = getattr(policy, "weights_sha256", None)
        if policy is not None and sha256 is None:
            raise ValueError(
                "policy has no weights_sha256, which shard records name it by: pass a policy loaded "
                "from a safetensors file (kvp_cache.policy.load_policy after save_pretrained)"
            )
        calibration = getattr(policy, "calibration", None)
        calibration_sha256 = hashlib.sha256(calibration.to_bytes()).hexdigest() if calibration else None
        self.fingerprint = config.fingerprint(sha256, calibration_sha256)
        self.haystack = ruler.load_haystack(config.essays_dir)

    def shard(self, *parts: object, fields: dict | None = None) -> Shard:
        return shard(self.out, self.fingerprint, *parts, fields=fields)

    def prefill(self, input_ids: torch.Tensor):
        return prefill(self.model, input_ids, chunk_tokens=self.prefill_chunk)

    def run(self) -> None:
        """Screen the screened tasks, then every cell's samples round-robin (sample 0 of every cell,
        then sample 1, ...), so an unfinished run has every cell equally far.

        A sample whose record holds every row is skipped; one whose record lacks rows (a method or
        budget added since) or holds learned rows of another policy is topped up: one prefill, only
        the missing rows computed, the merged record appended. Last, the KV bytes of every real-text
        row not measured yet (:meth:`measure_kv_bytes`).
        """
        cells = []
        for context in self.config.contexts:
            tasks = self.config.tasks + [
                t for t in self.config.screened_tasks if self.passes_screen(t, context)
            ]
            cells += [
                self.needle_cell(protocol, task, context)
                for protocol in self.config.protocols
                for task in tasks
            ]
        for context in self.config.text_contexts:
            cells += [self.text_cell(name, context) for name in self.config.corpora]
        if self.config.decode_caps:
            cells += [self.decode_cell(name) for name in self.config.corpora]
        for cell in cells:
            cell.shard.upgrade()
        work = [
            (cell, index, rows)
            for index in range(max((cell.count for cell in cells), default=0))
            for cell in cells
            if index < cell.count
            and (rows := missing_rows(cell.grid, self.fingerprint, cell.records.get(index)))
        ]
        top_ups = sum(index in cell.records for cell, index, _ in work)
        for cell, index, rows in tqdm(work, desc=f"benchmark ({top_ups} top-ups)", unit="sample"):
            start, cpu_start = time.perf_counter(), time.process_time()
            new = cell.compute(index, rows)
            new.update(seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu_start)
            cell.records[index] = topped_up(cell.records.get(index), new, self.fingerprint)
            cell.shard.append({"index": index, **cell.records[index]})
        for context in self.config.text_contexts if self.config.corpora else []:
            self.measure_kv_bytes(context)

    def measure_kv_bytes(self, context: int) -> None:
        """The bytes each real-text row's cache holds (``KVPCache.kv_bytes``) and the full cache's, at
        prefix length ``context``, into the shard ``kv_bytes/<context>``.

        They depend on the prefix length, the budget and the allocation (adaptive caches keep the
        same total entries as uniform ones, whatever their minimum per head), never on the text, so the first window of the first
        corpus measures them, once per row: one prefill, then each missing row compressed.
        """
        sizes = self.shard(KV_BYTES, context)
        held = sizes.records().get(0, {}).get(KV_BYTES, {})
        rows = [(m, b) for m, b in self.config.grid() if method_key(m, b) not in held]
        if not rows:
            return
        name = self.config.corpora[0]
        stream = realtext.corpus_tokens(name, self.tokenizer)
        window = realtext.windows(stream, context + self.config.continuation_tokens, 1)[0].to(self.device)
        with torch.no_grad():
            prefilled = self.prefill(window[:, :context])
            measured = self.answers(
                prefilled,
                rows,
                ids(window[:, context:]),
                full=lambda: cache_bytes(prefilled.cache),
                batch=lambda scorers, budget, allocation: [
                    cache.kv_bytes() for cache in self.decoders[allocation].caches(prefilled, scorers, budget)
                ],
            )
        sizes.append(
            {"index": 0, "corpus": name, "windows": realtext.WINDOWS, KV_BYTES: {**held, **measured}}
        )

    def samples(self, task: str, context: int, count: int) -> list[ruler.Sample]:
        """``count`` test-split samples whose chat prompt plus answer fit in ``context`` tokens (8K is
        SmolLM2's limit), whatever the sizing tolerance."""
        target = int(context * (1 - ruler.LENGTH_TOLERANCE)) - MAX_NEW_TOKENS[task] - TEMPLATE_TOKENS
        return ruler.make_samples(
            task, self.tokenizer, target, count, self.config.seed, self.haystack, split="test"
        )

    def passes_screen(self, task: str, context: int) -> bool:
        """Full-cache accuracy of ``task`` at ``context`` (question inside) reaches ``min_full_score``."""
        shard = self.shard("screen", task, context)
        shard.upgrade()
        done = shard.records()
        samples = self.samples(task, context, self.config.screen_samples)
        for index, sample in enumerate(tqdm(samples, desc=f"screen {task} {context}", unit="sample")):
            if index in done:
                continue
            prompt = encode_prompt(sample, self.tokenizer, False, self.device)
            with torch.no_grad():
                prefilled = self.prefill(prompt.prefix)
                prediction = self.decoder.full_answer(prefilled, prompt, MAX_NEW_TOKENS[task])
            score = ruler.score(sample, prediction)
            shard.append({"index": index, "predictions": {FULL: prediction}, "scores": {FULL: score}})
        scores = [r["scores"][FULL] for r in shard.records().values()]
        return sum(scores) / len(scores) >= self.config.min_full_score

    def needle_cell(self, protocol: str, task: str, context: int) -> Cell:
        samples = self.samples(task, context, self.config.samples[context])

        @torch.no_grad()
        def compute(index: int, rows: list[tuple[str, Budget | None]]) -> dict:
            sample = samples[index]
            prompt = encode_prompt(sample, self.tokenizer, protocol == "question_after", self.device)
            prefilled = self.prefill(prompt.prefix)
            tokens = MAX_NEW_TOKENS[task]
            predictions = self.answers(
                prefilled,
                rows,
                ids(prompt.suffix) + ruler.gold_answer_ids(sample, self.tokenizer),
                full=lambda: self.decoder.full_answer(prefilled, prompt, tokens),
                batch=lambda scorers, budget, allocation: self.decoders[allocation].budget_answers(
                    prefilled, prompt, scorers, budget, tokens
                ),
            )
            return {
                "prompt_tokens": prompt.full.shape[1],
                "answers": sample.answers,
                "predictions": predictions,
                "scores": {key: ruler.score(sample, text) for key, text in predictions.items()},
            }

        return Cell(self.shard(protocol, task, context), len(samples), compute, self.config.grid())

    def text_cell(self, name: str, context: int) -> Cell:
        stream = realtext.corpus_tokens(name, self.tokenizer)
        count = self.config.text_windows[context]
        windows = realtext.windows(stream, context + self.config.continuation_tokens, count)

        @torch.no_grad()
        def compute(index: int, rows: list[tuple[str, Budget | None]]) -> dict:
            window = windows[index].to(self.device)
            prefix, continuation = window[:, :context], window[:, context:]
            prefilled = self.prefill(prefix)

            def nll(cache) -> list[float]:
                return realtext.continuation_nll(self.model, prefilled, cache, continuation).tolist()

            return {
                "windows": realtext.WINDOWS,
                "nll": self.answers(
                    prefilled,
                    rows,
                    ids(continuation),
                    full=lambda: nll(copy.deepcopy(prefilled.cache))[0],
                    batch=lambda scorers, budget, allocation: nll(
                        self.decoders[allocation].compressed(prefilled, scorers, budget)
                    ),
                ),
            }

        return Cell(self.shard(PERPLEXITY, name, context), count, compute, self.config.grid())

    def decode_cell(self, name: str) -> Cell:
        """The ``decode`` cell of corpus ``name``: per window, the prompt is prefilled once; each
        (method, cap) gets a capped cache of that prefill (``KVPCache.from_prefill``, budget 1.0, so
        only the cap evicts) and reads the rest in chunks; the uncapped row reads it the same way."""
        config = self.config
        prompt_tokens = config.decode_prompt_tokens
        stream = realtext.corpus_tokens(name, self.tokenizer)
        windows = realtext.windows(stream, prompt_tokens + config.decode_tokens, config.decode_windows)
        fields = config.decode_fields()
        # The forwards that read a window: the prompt, then the chunks of every token but the last.
        chunks = range(0, config.decode_tokens - 1, config.decode_chunk_tokens)
        forwards = [prompt_tokens] + [
            min(config.decode_chunk_tokens, config.decode_tokens - 1 - c) for c in chunks
        ]

        @torch.no_grad()
        def compute(index: int, rows: list[tuple[str, Budget | None]]) -> dict:
            window = windows[index].to(self.device)
            prompt, continuation = window[:, :prompt_tokens], window[:, prompt_tokens:]
            prefilled = self.prefill(prompt)
            states = None

            def nll(cache) -> float:
                return realtext.continuation_nll(
                    self.model, prefilled, cache, continuation, chunk_tokens=config.decode_chunk_tokens
                ).item()

            answers = {FULL: nll(copy.deepcopy(prefilled.cache))} if (FULL, None) in rows else {}
            capped = [(method, cap) for method, cap in rows if method != FULL]
            for method, cap in tqdm(capped, desc=f"decode {name} window {index}", unit="cache", leave=False):
                options = self.decoder.cache_options(method, 1.0)
                tokens = config.cap_tokens(cap)
                if method == ORACLE:
                    states = states or future_states(self.model, prefilled, ids(continuation[:, :-1]))
                    oracle = capped_oracle_scorer(
                        states,
                        eviction_points(forwards, tokens, config.evict_every),
                        config.sink_tokens,
                        config.window_tokens,
                        config.oracle_horizon,
                    )
                    options.update(method=oracle, track_positions=True)
                cache = KVPCache.from_prefill(
                    prefilled, self.model, **options, max_cache_tokens=tokens, evict_every=config.evict_every
                )
                if method == ORACLE:
                    oracle.bind(cache)
                answers[method_key(method, cap)] = nll(cache)
            return {**fields, "nll": answers}

        return Cell(self.shard(DECODE, name, prompt_tokens, fields=fields), config.decode_windows, compute,
                    config.decode_grid())  # fmt: skip

    def answers(
        self,
        prefilled,
        rows: list[tuple[str, Budget | None]],
        future_ids: list[int],
        full: Callable[[], object],
        batch: Callable[[list[Scorer], Budget, str], list],
    ) -> dict[str, object]:
        """``{method_key: answer}`` of one sample's ``rows``: ``full()`` if the full cache is among
        them, then for each budget and allocation ``batch(scorers, budget, allocation)`` over the
        methods it needs (one answer per scorer): the uniform ones together, each adaptive one on
        its own. Only those methods' scorers are built (the oracle runs its ``future_ids`` only when
        it is needed); each scores the prefill once for all budgets and allocations."""
        names = [m for m in self.config.row_methods() if any(m == method for method, _ in rows)]
        bases = list(dict.fromkeys(split_row(name)[0] for name in names))
        scorers = dict(zip(bases, self.scorers(prefilled, future_ids, bases), strict=True))
        answers = {FULL: full()} if (FULL, None) in rows else {}
        for budget in self.config.budgets:
            for allocation in self.config.allocations:
                needed = [n for n in names if (n, budget) in rows and split_row(n)[1] == allocation]
                for group in [needed] if allocation == UNIFORM else [[n] for n in needed]:
                    if group:
                        values = batch([scorers[split_row(n)[0]] for n in group], budget, allocation)
                        answers.update({method_key(n, budget): v for n, v in zip(group, values, strict=True)})
        return answers

    def scorers(self, prefilled, future_ids: list[int], names: list[str]) -> list[Scorer]:
        """One sample's scorers of ``names`` (registry methods and the oracle), each scoring each
        layer once for all budgets."""
        return [
            oracle_scorer(self.model, prefilled, future_ids)
            if name == ORACLE
            else scored_once(make_scorer(name, **self.method_options(name)))
            for name in names
        ]

    def method_options(self, method: str) -> dict:
        return {"policy": self.decoder.policy} if method in methods(learned=True) else {}


_SCORED_ONCE: dict[type, type] = {}


def scored_once(scorer: Scorer) -> Scorer:
    """``scorer``, changed to compute each layer's scores once and return them on later calls.

    A method's scores depend on the prefill, never on the budget, so the caches of one sample at
    every budget share them (H2O's, quadratic in the prompt, would otherwise dominate long contexts).
    Use it for one prefill only.
    """
    cls = type(scorer)
    if cls not in _SCORED_ONCE:

        def score(self, keys, values, positions, queries=None, layer_idx=0):
            # The sum tells this prefill's states from states appended later (a question's, say).
            key = (layer_idx, tuple(keys.shape), float(keys.float().sum()))
            if key not in self.memo:
                self.memo[key] = cls.score(self, keys, values, positions, queries, layer_idx)
            return self.memo[key]

        _SCORED_ONCE[cls] = type(cls.__name__, (cls,), {"score": score, "__doc__": cls.__doc__})
    scorer.__class__ = _SCORED_ONCE[cls]
    scorer.memo = {}
    return scorer


def ids(tokens: torch.Tensor) -> list[int]:
    """The token ids of a batch-1 ``[1, n]`` tensor."""
    return tokens[0].tolist()


def cell_row(where: dict, method: str, budget: float, metric: str, values: list[float], interval) -> dict:
    """One flat row: ``where`` (protocol, task or corpus, context) then the mean of ``values`` and its CI."""
    return {
        **where,
        "method": method,
        "budget": budget,
        "n": len(values),
        "metric": metric,
        "score": sum(values) / len(values),
        "ci95": list(interval(values)),
    }


def needle_rows(
    protocol: str, task: str, context: int, records: list[dict], grid: list[tuple[str, Budget | None]]
) -> list[dict]:
    """Rows of one needle cell: the full cache, then every method x budget of ``grid`` (accuracy, Wilson CI)."""
    where = {"protocol": protocol, "task": task, "context_tokens": context}
    return [
        cell_row(
            where,
            method,
            budget,
            "accuracy",
            [r["scores"][method_key(method, budget)] for r in records],
            wilson_interval,
        )
        for method, budget in grid
    ]


def text_rows(
    name: str,
    context: int,
    records: list[dict],
    grid: list[tuple[str, Budget | None]],
    reference: str | None,
    protocol: str = PERPLEXITY,
    sizes: dict[str, int] | None = None,
) -> list[dict]:
    """Rows of one real-text cell (``perplexity`` or ``decode``, where the budget is the cap): NLL per
    token and its increase over the full cache (bootstrap CIs).

    Every other compressed method's row also holds ``paired``: its per-window NLL minus that of
    ``reference`` (the first method) at the same budget, mean and CI. The windows are shared, so
    pairing removes their spread, which dominates the unpaired intervals; positive: ``reference``
    lost less. An adaptive row (``kvp+head``) also holds ``allocation_gain``: the uniform row of its
    method (``kvp``) minus its own per-window NLL; positive: the adaptive allocation lost less.
    ``sizes``: the measured KV bytes by :func:`method_key` (:meth:`Benchmark.measure_kv_bytes`);
    rows found there hold ``kv_bytes`` and ``kv_share``, their share of the full cache's bytes."""
    where = {
        "protocol": protocol,
        "corpus": name,
        "kind": corpus(name).kind if name != ALL else ALL,
        "context_tokens": context,
    }
    full = [r["nll"][FULL] for r in records]
    sizes = sizes or {}
    rows = []
    for method, budget in grid:
        nll = [r["nll"][method_key(method, budget)] for r in records]
        increase = [a - b for a, b in zip(nll, full, strict=True)]
        row = cell_row(where, method, budget, "nll_increase", increase, bootstrap_interval)
        row = {**row, "nll": sum(nll) / len(nll), "nll_ci95": list(bootstrap_interval(nll))}
        if budget is not None and method != reference and (reference, budget) in grid:
            against = [r["nll"][method_key(reference, budget)] for r in records]
            difference = [a - b for a, b in zip(nll, against, strict=True)]
            row["paired"] = {
                "against": reference,
                "difference": sum(difference) / len(difference),
                "ci95": list(bootstrap_interval(difference)),
            }
        uniform = split_row(method)[0]
        if budget is not None and uniform != method and (uniform, budget) in grid:
            gain = [r["nll"][method_key(uniform, budget)] - a for r, a in zip(records, nll, strict=True)]
            row["allocation_gain"] = {
                "against": uniform,
                "difference": sum(gain) / len(gain),
                "ci95": list(bootstrap_interval(gain)),
            }
        if (key := method_key(method, budget)) in sizes and FULL in sizes:
            row = {**row, "kv_bytes": sizes[key], "kv_share": sizes[key] / sizes[FULL]}
        rows.append(row)
    return rows


def _cells(config: BenchmarkConfig) -> Iterator[tuple]:
    for context in config.contexts:
        for protocol in config.protocols:
            for task in config.tasks + config.screened_tasks:
                yield protocol, task, context


def collect_rows(config: BenchmarkConfig, out: Path, fingerprint: Fingerprint) -> dict:
    """``rows`` of every cell, plus ``pending`` cells and ``excluded`` tasks.

    A row (method, budget) of a cell is reported once all the cell's samples hold it (learned rows from
    ``fingerprint.policy``), so every reported row of a cell covers the same samples; a method added to
    the grid later is pending while the finished rows stay reported. A cell with any row missing is
    pending, with the samples that hold every row counted as done and the missing methods named."""

    def records(*parts, fields: dict | None = None) -> dict[int, dict]:
        return shard(out, fingerprint, *parts, fields=fields).records()

    rows, pending, excluded, seconds = [], [], [], {}

    def finished(
        cell: dict, found: dict[int, dict], wanted: int, cell_grid: list | None = None
    ) -> tuple[list[dict], list] | None:
        """The cell's records in index order and the rows of its grid (default ``config.grid()``)
        that all of them hold; None while the full cache's row is not done."""
        cell_grid = config.grid() if cell_grid is None else cell_grid
        missing = [set(missing_rows(cell_grid, fingerprint, found.get(i))) for i in range(wanted)]
        grid = [row for row in cell_grid if not any(row in m for m in missing)]
        if len(grid) < len(cell_grid):
            methods = sorted({method for m in missing for method, _ in m})
            pending.append({**cell, "done": sum(not m for m in missing), "n": wanted, "missing": methods})
        if (FULL, None) not in grid:
            return None
        return [found[i] for i in range(wanted)], grid

    def pooled_records(cells: list[tuple[list[dict], list]]) -> tuple[list[dict], list]:
        """All cells' records and the grid rows every cell reported."""
        grid = [row for row in cells[0][1] if all(row in cell_grid for _, cell_grid in cells)]
        return [r for done, _ in cells for r in done], grid

    pooled: dict[tuple, list] = {}
    unreported: set[tuple] = set()  # (protocol, length) groups with a cell not reported: not pooled
    for context in config.contexts:
        for task in config.screened_tasks:
            screen = [r["scores"][FULL] for r in records("screen", task, context).values()]
            if len(screen) >= config.screen_samples and sum(screen) / len(screen) < config.min_full_score:
                excluded.append(
                    {
                        "task": task,
                        "context_tokens": context,
                        "protocol": "question_in",
                        "n": len(screen),
                        "full_score": sum(screen) / len(screen),
                        "ci95": list(wilson_interval(screen)),
                    }
                )
    skipped = {(e["task"], e["context_tokens"]) for e in excluded}
    for protocol, task, context in _cells(config):
        if (task, context) in skipped:
            continue
        cell = {"protocol": protocol, "task": task, "context_tokens": context}
        done = finished(cell, records(protocol, task, context), config.samples[context])
        if done is None:
            unreported.add((protocol, context))
            continue
        rows += needle_rows(protocol, task, context, *done)
        pooled.setdefault((protocol, context), []).append(done)
        seconds[f"{protocol}/{task}/{context}"] = cost(done[0])
    for (protocol, context), cells in pooled.items():
        if (protocol, context) not in unreported:
            rows += needle_rows(protocol, ALL, context, *pooled_records(cells))
    text_cells = [
        (PERPLEXITY, n, config.text_windows[n], None, config.methods[0], None) for n in config.text_contexts
    ]
    sizes = {n: records(KV_BYTES, n).get(0, {}).get(KV_BYTES) for n in config.text_contexts}
    if config.decode_caps:
        reference = next(iter(config.capped_methods()), None)
        text_cells.append(
            (DECODE, config.decode_prompt_tokens, config.decode_windows, config.decode_grid(), reference,
             config.decode_fields())
        )  # fmt: skip
    for protocol, context, wanted, grid, reference, fields in text_cells:
        for name in config.corpora:
            cell = {"protocol": protocol, "corpus": name, "context_tokens": context}
            done = finished(cell, records(protocol, name, context, fields=fields), wanted, grid)
            if done is None:
                unreported.add((protocol, context))
                continue
            rows += text_rows(name, context, *done, reference, protocol, sizes.get(context))
            pooled.setdefault((protocol, context), []).append(done)
            seconds[f"{protocol}/{name}/{context}"] = cost(done[0])
        cells = pooled.get((protocol, context))
        if cells and (protocol, context) not in unreported:
            rows += text_rows(ALL, context, *pooled_records(cells), reference, protocol, sizes.get(context))
    return {"rows": rows, "pending": pending, "excluded": excluded, "seconds": seconds}


def cost(records: list[dict]) -> dict:
    """A cell's measured cost: samples, wall seconds and CPU seconds of this process (one thread:
    the time on a dedicated core, whatever else ran on the machine)."""
    return {
        "n": len(records),
        "wall_seconds": sum(r["seconds"] for r in records),
        "cpu_seconds": sum(r["cpu_seconds"] for r in records),
    }


def benchmark_result(config: BenchmarkConfig, out: Path, fingerprint: Fingerprint, provenance: dict) -> dict:
    """The contents of ``benchmark.json``: provenance first, then config, corpora, rows."""
    collected = collect_rows(config, out, fingerprint)
    return {
        "provenance": provenance,
        "config": portable_config(config),
        "corpora": {
            name: {"kind": corpus(name).kind, "requirement": corpus(name).requirement}
            for name in config.corpora
        },
        "fingerprint": fingerprint.config,
        **collected,
    }
