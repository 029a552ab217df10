"""The benchmark's resumable store: one append-only JSONL shard per cell (:class:`Shard`), one record
per sample holding one answer per (method, budget) (:func:`method_key`).

A record names the policy of its learned answers, the calibration of its learned adaptive ones and the
minimum per head of its adaptive ones, so another method list, budget, policy, calibration or minimum
tops records up (:func:`missing_rows`, :func:`topped_up`) instead of recomputing them; records of
another :class:`~eval.benchmark_config.Fingerprint` are never read. A :class:`Cell` pairs a shard with
the computation of its samples.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eval.benchmark_config import PERPLEXITY, UNIFORM, Fingerprint, split_row
from eval.sweep import FULL
from kvp_cache.budget import Budget
from kvp_cache.scorers import methods


def shard(out: Path, fingerprint: Fingerprint, *parts: object, fields: dict | None = None) -> Shard:
    """The shard of cell ``parts`` (protocol, task or corpus, length) under ``out/shards``; ``fields``:
    what its records must carry (real text: the window placement, ``fingerprint.text_windows``).
    Its records are read and written under ``fingerprint.for_protocol(protocol)``."""
    fingerprint = fingerprint.for_protocol(parts[0])
    if parts[0] == PERPLEXITY:
        fields = {"windows": fingerprint.text_windows}
    return Shard(Path(out) / "shards" / Path(*map(str, parts)).with_suffix(".jsonl"), fingerprint, fields)


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
    minimum = recorded_minimum(record) == fingerprint.min_per_head
    return [
        (method, budget)
        for method, budget in grid
        if (key := method_key(method, budget)) not in held
        or (is_learned(key) and not fresh)
        or (is_calibrated(key) and not calibrated)
        or (is_adaptive(key) and not minimum)
    ]


LEGACY_DEFAULT_MINIMUM = "protected+8"
"""The minimum per head of records that name none (made before they named the default's rule, or
before the field existed): the cache's default while ``MIN_EXTRA_PER_HEAD`` was 8, as it always was
until then."""


def recorded_minimum(record: dict) -> int | str:
    """The minimum per head ``record``'s adaptive answers were made with
    (:func:`~eval.benchmark_config.minimum_label`)."""
    minimum = record.get("min_per_head")
    return LEGACY_DEFAULT_MINIMUM if minimum is None else minimum


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
    stale_minimum = adaptive and recorded_minimum(old) != fingerprint.min_per_head
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
