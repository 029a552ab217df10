"""95% confidence intervals for benchmark cells (Wilson for accuracies, bootstrap for mean NLL changes),
and the results file of per-window measurements that experiment scripts write."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
BOOTSTRAP_RESAMPLES = 2000


def wilson_interval(scores: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of the mean of per-sample scores in [0, 1].

    A sample's score is its fraction of answers found (1 or 0 on single-answer tasks); partial
    scores count as that fraction of a success, which keeps the interval exact for 0/1 scores.
    """
    if any(not 0.0 <= s <= 1.0 for s in scores):
        raise ValueError("scores must lie in [0, 1] for a Wilson interval")
    return wilson_from_mean(sum(scores) / len(scores) if scores else 0.0, len(scores), z)


def wilson_from_mean(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson interval of a success rate ``p`` measured on ``n`` samples."""
    if n < 1:
        raise ValueError("scores is empty: an interval needs at least one sample")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must lie in [0, 1], got {p}")
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # At p = 0 or 1 the bound equals p exactly; rounding must not move it past the mean.
    low = 0.0 if p == 0.0 else max(0.0, center - half)
    high = 1.0 if p == 1.0 else min(1.0, center + half)
    return low, high


def bootstrap_interval(
    values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean of ``values`` (seeded, so reruns agree)."""
    n = len(values)
    if n == 0:
        raise ValueError("values is empty: an interval needs at least one sample")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    return means[int(0.025 * (resamples - 1))], means[math.ceil(0.975 * (resamples - 1))]


def overlaps(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two ``(low, high)`` intervals share a point."""
    return a[0] <= b[1] and b[0] <= a[1]


def write_window_results(path: Path, header: dict, settings: dict, rows: Sequence[dict]) -> None:
    """Write a results file of per-window measurements to ``path`` and print its means: provenance
    ``header``, ``settings``, the means over all rows and per source, then the rows (dicts with
    ``window``, ``source`` and numbers)."""
    keys = [k for k in rows[0] if k not in ("window", "source")]

    def mean(of: list[dict]) -> dict:
        return {k: sum(r[k] for r in of) / len(of) for k in keys}

    sources = sorted({r["source"] for r in rows})
    by_source = {s: mean([r for r in rows if r["source"] == s]) for s in sources}
    result = {"provenance": header, "settings": settings, "mean": mean(list(rows)), "by_source": by_source}
    path.write_text(json.dumps({**result, "rows": list(rows)}, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result["mean"], indent=1))
