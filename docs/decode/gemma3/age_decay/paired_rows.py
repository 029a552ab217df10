"""Two rows of one ``downstream-decode`` record file, paired on the sequences both hold.

``python -m train downstream-decode`` summarizes the policies and methods of its own run; a row
recorded by an earlier run on the same sequences (another ranking of the same policy, say) stays in
its JSONL. This pairs ``NEW`` against ``BASE`` there: per cap, both means and NEW - BASE with its
95% bootstrap interval, pooled and per source.

Run from the repository root: ``PYTHONPATH=. python docs/decode/gemma3/age_decay/paired_rows.py
JSONL NEW BASE CAPS`` (e.g. ``... d0.5 a03LE 256,512``), the JSONL's summary ``.json`` beside it
(whose provenance this copies, with the policies it names); writes ``<JSONL stem>_<NEW>_vs_<BASE>.json``
next to the JSONL and prints it.
"""

import json
import sys
from pathlib import Path

from eval.stats import bootstrap_interval
from kvp_cache.provenance import provenance


def paired(records: list[dict], new: str, base: str, cap: str) -> dict:
    """Both rows' mean NLL increase over the full cache and their paired difference."""
    rows = [r for r in records if f"{new}@{cap}" in r["nll"] and f"{base}@{cap}" in r["nll"]]
    increase = {name: [r["nll"][f"{name}@{cap}"] - r["nll"]["full"] for r in rows] for name in (new, base)}
    difference = [a - b for a, b in zip(increase[new], increase[base], strict=True)]
    return {
        "n": len(rows),
        new: sum(increase[new]) / len(rows),
        base: sum(increase[base]) / len(rows),
        "difference": sum(difference) / len(rows),
        "ci95": list(bootstrap_interval(difference)),
    }


def main() -> None:
    log, new, base, caps = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    merged: dict[str, dict] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)  # a later record of a sequence adds to (tops up) the earlier one
        merged.setdefault(record["uid"], {"source": record["source"], "nll": {}})["nll"].update(record["nll"])
    records = list(merged.values())
    sources = sorted({r["source"] for r in records})
    measured = json.loads(log.with_suffix(".json").read_text())  # the downstream-decode run's summary
    result = {
        "provenance": provenance(measured["provenance"]["model"], "float32", "cpu", command=sys.argv),
        "measured_by": {key: measured[key] for key in ("provenance", "policies")},
        "pooled": {cap: paired(records, new, base, cap) for cap in caps},
        "by_source": {
            s: {cap: paired([r for r in records if r["source"] == s], new, base, cap) for cap in caps}
            for s in sources
        },
    }
    out = log.with_name(f"{log.stem}_{new}_vs_{base}.json")
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
