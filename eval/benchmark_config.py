"""What a benchmark run covers (:class:`BenchmarkConfig`), how its rows are named and which shard
records it reads (:class:`Fingerprint`).

A compressed row is named after its method and allocation (:func:`row_name`: ``kvp``, ``kvp+head``);
methods whose scores are not comparable across heads get their uniform row only (:func:`uniform_only`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from eval import realtext
from eval.corpora import CORPORA
from eval.oracle import ORACLE, OracleScorer
from eval.sweep import FULL, check_methods
from kvp_cache import ruler
from kvp_cache.allocation import MIN_EXTRA_PER_HEAD, MODES, validate_mode
from kvp_cache.budget import Budget, validate_budget, validate_count
from kvp_cache.policy import checked_age_decay
from kvp_cache.scorers import SCORERS

NEEDLE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
SCREENED_TASKS = tuple(task for task in ruler.TASKS if task not in NEEDLE_TASKS)
NEEDLE_PROTOCOLS = ("question_in", "question_after")
PERPLEXITY = "perplexity"
DECODE = "decode"
DECODE_RECALL = "decode_recall"
CAPPED_PROTOCOLS = (DECODE, DECODE_RECALL)
"""The protocols whose caches evict more than once (under ``max_cache_tokens``)."""
RECALL_TASKS = ("niah_single", "niah_multikey")
RECALL_CORPUS = "kjv"
"""The held-out prose the ``decode_recall`` protocol reads between a needle and its question."""
TEMPLATE_TOKENS = 64
"""Room left in ``context_tokens`` for the chat template and answer prefix around a sample."""
ALL = "all"
"""The task or corpus of pooled rows: every sample of every task (corpus) of one protocol and length."""
UNIFORM = "uniform"
RESCORED = "+rescore"
"""Appended to the policy that learned answers of :data:`CAPPED_PROTOCOLS` name when they come from
``kvp_rescore``; ``+age_decay=<value>`` follows it for ``kvp_age_decay`` (:meth:`Fingerprint.for_protocol`)."""
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
    recall_caps: the ``decode_recall`` protocol's ``max_cache_tokens`` (:mod:`eval.recall`), ints or shares of
    ``recall_context_tokens + recall_filler_tokens`` as for ``decode_caps``; empty: no ``decode_recall``.
    recall_tasks, recall_samples: its needle tasks (among :data:`NEEDLE_TASKS`) and samples per task;
    recall_context_tokens: its needle context (question left out); recall_filler_tokens: the held-out
    text read under the cap before the question, in chunks of ``decode_chunk_tokens``.
    min_per_head: the entries every KV head of an adaptive row keeps at least (``KVPCache``'s
    ``min_per_head``, protected ones included); None: the cache's default, the protected entries plus
    :data:`kvp_cache.allocation.MIN_EXTRA_PER_HEAD`. Records name it with their adaptive answers, which
    another value recomputes (:func:`~eval.shards.missing_rows`).
    kvp_rescore: the learned rows score every held entry again at each eviction (``KVPCache(...,
    rescore=True)``). Only caches that evict more than once (:data:`CAPPED_PROTOCOLS`) answer
    differently, so only their records name it with the policy of their learned answers
    (:meth:`Fingerprint.for_protocol`): rows made with and without it are never mixed, and the
    prefill protocols' answers are reused.
    kvp_age_decay: the learned rows' ``KVPCache(..., age_decay=...)``: each eviction ranks the stored
    scores minus ``decay * log2(1 + age)``; None, the policy's own (:meth:`for_policy` resolves it,
    so recorded configs hold the value used). A single prefill ranks as without it, so, as for
    ``kvp_rescore``, only the records of :data:`CAPPED_PROTOCOLS` name it.
    """

    methods: list[str]
    policy: str | None = None
    kvp_rescore: bool = False
    kvp_age_decay: float | None = None
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
    recall_caps: list[Budget] = field(default_factory=lambda: [0.25])
    recall_tasks: list[str] = field(default_factory=lambda: list(RECALL_TASKS))
    recall_samples: int = 50
    recall_context_tokens: int = 1024
    recall_filler_tokens: int = 1024
    oracle: bool = True
    essays_dir: str | None = None
    seed: int = 0
    sink_tokens: int = 4
    window_tokens: int = 16

    def __post_init__(self) -> None:
        check_methods(self.methods, self.policy)
        if self.kvp_age_decay is not None:
            self.kvp_age_decay = checked_age_decay(self.kvp_age_decay, "kvp_age_decay")
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
        self.validate_recall()

    def validate_decode(self) -> None:
        for name, minimum in (
            ("decode_prompt_tokens", 1),
            ("decode_tokens", 2),
            ("decode_windows", 1),
            ("decode_chunk_tokens", 1),
            ("evict_every", 1),
        ):
            validate_count(name, getattr(self, name), minimum)
        if self.oracle_horizon is not None and self.oracle_horizon < 1:
            raise ValueError(
                f"oracle_horizon must be None (until the next eviction) or >= 1, got {self.oracle_horizon}"
            )
        self.decode_caps = self.validated_caps(DECODE)

    def validate_recall(self) -> None:
        unknown = sorted(set(self.recall_tasks) - set(NEEDLE_TASKS))
        if unknown:
            raise ValueError(f"recall_tasks must be among {', '.join(NEEDLE_TASKS)}; got {unknown}")
        if self.recall_caps and not self.recall_tasks:
            raise ValueError(
                "recall_tasks is empty; give needle tasks, or recall_caps=[] for no decode_recall"
            )
        for name, minimum in (
            ("recall_samples", 1),
            ("recall_context_tokens", 64),
            ("recall_filler_tokens", 1),
        ):
            validate_count(name, getattr(self, name), minimum)
        self.recall_caps = self.validated_caps(DECODE_RECALL)

    def validated_caps(self, protocol: str) -> list[Budget]:
        """The caps of ``protocol`` (``decode`` or ``decode_recall``) validated: each keeps at least the
        sinks and the window."""
        name = "recall_caps" if protocol == DECODE_RECALL else "decode_caps"
        caps = [validate_budget(cap) for cap in getattr(self, name)]
        protected = self.sink_tokens + self.window_tokens
        small = [cap for cap in caps if self.cap_tokens(cap, protocol) < protected]
        if small:
            raise ValueError(
                f"{name} {small} keep fewer than sink_tokens + window_tokens = {protected} tokens "
                f"(shares are of {self.capped_length(protocol)} tokens)"
            )
        return caps

    @classmethod
    def from_record(cls, record: dict) -> BenchmarkConfig:
        """The config a ``benchmark.json`` recorded: JSON spells the per-length counts' keys as
        strings, and fields a later version dropped are left out."""
        known = {f.name for f in fields(cls)}
        counts = {name: {int(n): c for n, c in record[name].items()} for name in ("samples", "text_windows")}
        # Records made before the policy-level default ran without a decay.
        made = {"kvp_age_decay": 0.0, **record, **counts}
        return cls(**{k: v for k, v in made.items() if k in known})

    def for_policy(self, policy) -> BenchmarkConfig:
        """This config with :attr:`kvp_age_decay` resolved: the policy's own when None (0 without a
        policy)."""
        if self.kvp_age_decay is not None:
            return self
        return replace(self, kvp_age_decay=policy.age_decay if policy is not None else 0.0)

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

    def recall_grid(self) -> list[tuple[str, Budget | None]]:
        """Every row of a ``decode_recall`` cell: the uncapped cache, then each (method, cap); no oracle
        (:mod:`eval.recall` says why)."""
        return [(FULL, None)] + [(m, cap) for m in self.capped_methods() for cap in self.recall_caps]

    def capped_length(self, protocol: str = DECODE) -> int:
        """The tokens a capped cache of ``protocol`` reads before its answer: prompt and text read."""
        if protocol == DECODE_RECALL:
            return self.recall_context_tokens + self.recall_filler_tokens
        return self.decode_prompt_tokens + self.decode_tokens

    def cap_tokens(self, cap: Budget, protocol: str = DECODE) -> int:
        """``max_cache_tokens`` of a cap: a token count, or a share of :meth:`capped_length`."""
        return cap if isinstance(cap, int) else round(cap * self.capped_length(protocol))

    def decode_fields(self, windows: str) -> dict:
        """What every ``decode`` record depends on besides the fingerprint and its cell (records
        carry them; :class:`~eval.shards.Shard` reads no record made with others); windows:
        :attr:`Fingerprint.text_windows`."""
        return {
            "windows": windows,
            "decode_tokens": self.decode_tokens,
            "chunk_tokens": self.decode_chunk_tokens,
            "evict_every": self.evict_every,
            "oracle_horizon": self.oracle_horizon,
        }

    def recall_fields(self) -> dict:
        """What every ``decode_recall`` record depends on besides the fingerprint and its cell (task,
        context), like :meth:`decode_fields`."""
        return {
            "windows": realtext.WINDOWS,
            "filler_corpus": RECALL_CORPUS,
            "filler_tokens": self.recall_filler_tokens,
            "chunk_tokens": self.decode_chunk_tokens,
            "evict_every": self.evict_every,
        }

    def fingerprint(
        self,
        policy_sha256: str | None,
        calibration_sha256: str | None = None,
        text_windows: str = realtext.WINDOWS,
    ) -> Fingerprint:
        """What the shard records of a run with the policy of ``policy_sha256`` must match.

        The hash covers what EVERY answer of a record depends on: the samples (seed, essays, the
        room left for the template, the continuation length) and the cache geometry (sink and
        window). Methods, budgets and the policy stay out of it: a record names each answer by
        method and budget (:func:`~eval.shards.method_key`), one method's answers never depend on
        the others', and the record names the policy of its learned answers, so another method list,
        budget list or policy tops records up instead of discarding them. ``calibration_sha256``: the
        policy's cross-head calibration, which its adaptive answers also depend on
        (:func:`~eval.shards.is_calibrated`). ``min_per_head`` stays out of it too: only adaptive
        answers depend on it (:func:`~eval.shards.is_adaptive`), and records name it, so another
        value recomputes those alone. ``text_windows``: how the model's real-text windows start
        (:func:`eval.realtext.placement`), which only real-text records depend on.
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
        minimum = minimum_label(self.min_per_head)
        return Fingerprint(
            digest(keys),
            policy_sha256,
            digest(legacy),
            calibration_sha256,
            minimum,
            text_windows,
            self.kvp_rescore,
            self.kvp_age_decay,
        )


def ranking_suffix(rescore: bool, age_decay: float) -> str:
    """What records append to a policy's sha256 for its learned answers under a cap, where they
    depend on how held entries are ranked: :data:`RESCORED`, then ``+age_decay=<value>``."""
    return (RESCORED if rescore else "") + (f"+age_decay={age_decay:g}" if age_decay else "")


def minimum_label(min_per_head: int | None) -> int | str:
    """How records name the minimum per head of their adaptive answers: the number, or for the
    cache's default (None) its rule with today's constant, so that changing
    :data:`~kvp_cache.allocation.MIN_EXTRA_PER_HEAD` recomputes them."""
    return min_per_head if min_per_head is not None else f"protected+{MIN_EXTRA_PER_HEAD}"


def digest(keys: dict) -> str:
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Fingerprint:
    """Which shard records a run reads.

    config: the hash of what every answer depends on (:meth:`BenchmarkConfig.fingerprint`), stored
        in each record; records of another one are never read.
    policy: sha256 of the policy's ``model.safetensors`` (None without a policy); learned answers of
        a record naming another policy are recomputed. The shards of :data:`CAPPED_PROTOCOLS` read it
        followed by :data:`RESCORED` with ``rescore`` (:meth:`for_protocol`).
    legacy: the fingerprint records had when it also hashed the method list, budgets and policy.
        Records carrying it were made with this configuration and policy: they are read as
        complete records of ``policy`` (and rewritten in today's format by the next run).
    calibration: sha256 of the policy's cross-head calibration (None without one); a record's
        learned adaptive answers (:func:`~eval.shards.is_calibrated`) are recomputed when it names
        another one.
    min_per_head: :func:`minimum_label` of :attr:`BenchmarkConfig.min_per_head`; a record's adaptive
        answers (:func:`~eval.shards.is_adaptive`) are recomputed when it names another one
        (:func:`~eval.shards.recorded_minimum` reads records made before the label).
    text_windows: what the real-text records read must carry as ``windows``
        (:func:`eval.realtext.placement`).
    rescore, age_decay: :attr:`BenchmarkConfig.kvp_rescore` and :attr:`BenchmarkConfig.kvp_age_decay`.
    """

    config: str
    policy: str | None
    legacy: str
    calibration: str | None
    min_per_head: int | str
    text_windows: str
    rescore: bool = False
    age_decay: float = 0.0

    def for_protocol(self, protocol: str) -> Fingerprint:
        """The fingerprint the shards of ``protocol`` carry: under a cap, learned answers also name
        how held entries were ranked, since only there do the ways answer differently."""
        if protocol not in CAPPED_PROTOCOLS or not self.policy:
            return self
        return replace(self, policy=self.policy + ranking_suffix(self.rescore, self.age_decay))
