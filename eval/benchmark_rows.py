"""The rows of ``benchmark.json``, read from the shards (:mod:`eval.shards`): one flat row per cell,
method and budget (:func:`cell_row`) with its mean and 95% interval, for needles (:func:`needle_rows`)
and real text (:func:`text_rows`), rows pooled over the tasks (corpora) of each protocol and length
(``decode_recall`` rows also hold their share of the uncapped cache's accuracy, :func:`with_share_of_full`),
the pending cells and the excluded tasks (:func:`collect_rows`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from eval.benchmark_config import (
    ALL,
    DECODE,
    DECODE_RECALL,
    KV_BYTES,
    PERPLEXITY,
    BenchmarkConfig,
    Fingerprint,
    split_row,
)
from eval.corpora import corpus
from eval.shards import method_key, missing_rows, shard
from eval.stats import bootstrap_interval, wilson_interval
from eval.sweep import FULL
from kvp_cache.budget import Budget


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
    """Rows of one needle cell: the full cache, then every method x budget of ``grid`` (accuracy, Wilson
    CI); ``decode_recall`` rows also hold their share of the uncapped cache's accuracy."""
    where = {"protocol": protocol, "task": task, "context_tokens": context}
    rows = [
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
    return with_share_of_full(rows) if protocol == DECODE_RECALL else rows


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
    ``sizes``: the measured KV bytes by :func:`~eval.shards.method_key`
    (:meth:`~eval.benchmark.Benchmark.measure_kv_bytes`); rows found there hold ``kv_bytes`` and
    ``kv_share``, their share of the full cache's bytes."""
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


def needle_cells(config: BenchmarkConfig) -> Iterator[tuple]:
    """``(protocol, task, context, samples, grid, fields)`` of every needle cell: the needle protocols'
    (grid None: ``config.grid()``), then ``decode_recall``'s."""
    for context in config.contexts:
        for protocol in config.protocols:
            for task in config.tasks + config.screened_tasks:
                yield protocol, task, context, config.samples[context], None, None
    if config.recall_caps:
        for task in config.recall_tasks:
            yield (DECODE_RECALL, task, config.recall_context_tokens, config.recall_samples,
                   config.recall_grid(), config.recall_fields())  # fmt: skip


def text_cells(config: BenchmarkConfig, fingerprint: Fingerprint) -> list[tuple]:
    """``(protocol, length, windows, grid, reference, fields)`` of every real-text cell group, one per
    length, its cells one per corpus: ``perplexity`` (grid None: ``config.grid()``), then ``decode``'s.
    ``reference``: the method the others' paired differences are taken against."""
    cells = [
        (PERPLEXITY, n, config.text_windows[n], None, config.methods[0], None) for n in config.text_contexts
    ]
    if config.decode_caps:
        reference = next(iter(config.capped_methods()), None)
        cells.append(
            (DECODE, config.decode_prompt_tokens, config.decode_windows, config.decode_grid(), reference,
             config.decode_fields(fingerprint.text_windows))
        )  # fmt: skip
    return cells


def with_share_of_full(rows: list[dict]) -> list[dict]:
    """``rows`` (one ``decode_recall`` cell's, the full cache's first) with ``of_full``: each row's
    accuracy over the uncapped cache's (None when that is 0)."""
    full = rows[0]["score"]
    return [{**row, "of_full": row["score"] / full if full else None} for row in rows]


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
        protocol_fingerprint = fingerprint.for_protocol(cell["protocol"])
        missing = [set(missing_rows(cell_grid, protocol_fingerprint, found.get(i))) for i in range(wanted)]
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
    for protocol, task, context, wanted, grid, fields in needle_cells(config):
        if (task, context) in skipped and protocol != DECODE_RECALL:
            continue
        cell = {"protocol": protocol, "task": task, "context_tokens": context}
        done = finished(cell, records(protocol, task, context, fields=fields), wanted, grid)
        if done is None:
            unreported.add((protocol, context))
            continue
        rows += needle_rows(protocol, task, context, *done)
        pooled.setdefault((protocol, context), []).append(done)
        seconds[f"{protocol}/{task}/{context}"] = cost(done[0])
    for (protocol, context), cells in pooled.items():
        if (protocol, context) not in unreported:
            rows += needle_rows(protocol, ALL, context, *pooled_records(cells))
    sizes = {n: records(KV_BYTES, n).get(0, {}).get(KV_BYTES) for n in config.text_contexts}
    for protocol, context, wanted, grid, reference, fields in text_cells(config, fingerprint):
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
