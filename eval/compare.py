"""Two benchmark runs that differ only in their policy, compared sample by sample.

``python -m eval compare NEW BASE`` reads the shards of two ``python -m eval benchmark`` output
directories made on the same samples (the same config fingerprint, :class:`~eval.benchmark_config.Fingerprint`)
and pairs every cell's samples by index. For each learned row both runs hold (``kvp@0.1``,
``kvp+head@0.25``, ...), per task or corpus and pooled over them, it reports BASE's score with its
95% interval, NEW's score, and the paired difference NEW - BASE with its 95% bootstrap interval.
``beyond`` marks a cell where NEW falls past BASE's interval on the losing side: a lower needle
accuracy, a higher NLL increase. That is the rule for replacing a shipped policy: no cell of the
canonical benchmark lost beyond its 95% interval.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from eval import realtext
from eval.benchmark_config import ALL, DECODE, PERPLEXITY, BenchmarkConfig, Fingerprint
from eval.benchmark_rows import needle_cells, text_cells
from eval.shards import is_learned, missing_rows, shard
from eval.stats import bootstrap_interval, wilson_interval
from eval.sweep import FULL
from kvp_cache.provenance import git_commit, portable_command, portable_path


@dataclasses.dataclass
class Run:
    """One benchmark output directory: its config, the fingerprint its records carry, its provenance."""

    out: Path
    config: BenchmarkConfig
    fingerprint: Fingerprint
    provenance: dict

    @classmethod
    def load(cls, out: Path) -> Run:
        path = Path(out) / "benchmark.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: give a directory written by `python -m eval benchmark`"
            )
        result = json.loads(path.read_text())
        config = BenchmarkConfig.from_record(result["config"])
        policy = result["provenance"].get("policy") or {}
        # The recorded hash, not a recomputed one: recorded paths are portable names. Results
        # written before they recorded the window placement read windows without a BOS.
        placement = result.get("text_windows", realtext.WINDOWS)
        fingerprint = dataclasses.replace(
            config.fingerprint(policy.get("sha256"), policy.get("calibration_sha256"), placement),
            config=result["fingerprint"],
        )
        return cls(Path(out), config, fingerprint, result["provenance"])

    def records(self, protocol: str, name: str, length: int, fields: dict | None) -> dict[int, dict]:
        return shard(self.out, self.fingerprint, protocol, name, length, fields=fields).records()


def sample_value(record: dict, key: str, text: bool) -> float:
    """A sample's score for row ``key``: the NLL increase over the full cache, or the needle score."""
    return record["nll"][key] - record["nll"][FULL] if text else record["scores"][key]


def is_text(protocol: str) -> bool:
    return protocol in (PERPLEXITY, DECODE)


def cells(run: Run) -> list[tuple[str, str, int, dict | None]]:
    """``(protocol, task or corpus, length, fields)`` of every cell of ``run``'s config."""
    found = [(protocol, task, n, fields) for protocol, task, n, _, _, fields in needle_cells(run.config)]
    for protocol, length, _, _, _, fields in text_cells(run.config, run.fingerprint):
        found += [(protocol, name, length, fields) for name in run.config.corpora]
    return found


def paired_samples(new: Run, base: Run) -> dict[tuple, list[tuple[float, float]]]:
    """``{(protocol, task or corpus, length, row key): [(new, base) per sample]}`` for every learned
    row both runs hold fresh (their own policy's answers), on the samples both runs finished."""
    if new.fingerprint.config != base.fingerprint.config:
        raise ValueError(
            f"the runs were made on different samples (config fingerprints {new.fingerprint.config} and "
            f"{base.fingerprint.config}): compare runs of the same benchmark settings"
        )
    if new.fingerprint.text_windows != base.fingerprint.text_windows:
        raise ValueError(
            f"the runs read real-text windows differently ({new.fingerprint.text_windows} and "
            f"{base.fingerprint.text_windows}): run `python -m eval benchmark --no-run` on the older one"
        )
    pairs: dict[tuple, list[tuple[float, float]]] = {}
    for protocol, name, length, fields in cells(new):
        text = is_text(protocol)
        ours, theirs = (
            new.records(protocol, name, length, fields),
            base.records(protocol, name, length, fields),
        )
        for index in sorted(set(ours) & set(theirs)):
            a, b = ours[index], theirs[index]
            if text and abs(a["nll"][FULL] - b["nll"][FULL]) > 1e-3:
                raise ValueError(f"{protocol}/{name}/{length} sample {index}: the full cache's NLL differs")
            keys = [k for k in a.get("nll" if text else "scores", {}) if is_learned(k)]
            for key in keys:
                row = tuple(key.split("@"))  # (row name, budget as the key spells it)
                # Under a cap, records name the policy with its ranking (Fingerprint.for_protocol).
                if missing_rows([row], new.fingerprint.for_protocol(protocol), a) or missing_rows(
                    [row], base.fingerprint.for_protocol(protocol), b
                ):
                    continue
                value = (sample_value(a, key, text), sample_value(b, key, text))
                pairs.setdefault((protocol, name, length, key), []).append(value)
    for (protocol, _, length, key), values in list(pairs.items()):
        pairs.setdefault((protocol, ALL, length, key), []).extend(values)
    return pairs


def compared_row(cell: tuple, values: list[tuple[float, float]]) -> dict:
    """One row of the comparison: both means, BASE's interval, the paired difference and its interval."""
    protocol, name, length, key = cell
    text = is_text(protocol)
    ours, theirs = [a for a, _ in values], [b for _, b in values]
    base_interval = bootstrap_interval(theirs) if text else wilson_interval(theirs)
    difference = [a - b for a, b in values]
    new_mean = sum(ours) / len(ours)
    return {
        "protocol": protocol,
        "name": name,
        "length": length,
        "row": key,
        "metric": "nll_increase" if text else "accuracy",
        "n": len(values),
        "base": sum(theirs) / len(theirs),
        "base_ci95": list(base_interval),
        "new": new_mean,
        "difference": sum(difference) / len(difference),
        "difference_ci95": list(bootstrap_interval(difference)),
        "beyond": new_mean > base_interval[1] if text else new_mean < base_interval[0],
    }


def compare(new: Run, base: Run) -> list[dict]:
    """The rows of :func:`compared_row`, pooled rows first within each protocol and length."""
    pairs = paired_samples(new, base)
    order = sorted(pairs, key=lambda c: (c[0], c[2], c[3], c[1] != ALL, c[1]))
    return [compared_row(cell, pairs[cell]) for cell in order]


def markdown(rows: list[dict], new: Run, base: Run) -> str:
    def policy(run: Run) -> str:
        record = run.provenance.get("policy") or {}
        return f"`{portable_path(str(run.out))}` (policy `{record.get('name')}`, sha256 `{str(record.get('sha256'))[:12]}`)"

    lines = [
        f"# {policy(new)} against {policy(base)}",
        "",
        "Paired on the same samples; NEW - BASE with its 95% bootstrap interval (needles: accuracy, "
        "higher is better; text: NLL increase over the full cache, lower is better). **beyond**: NEW "
        "is past BASE's 95% interval on the losing side.",
        "",
        f"**{sum(r['beyond'] for r in rows)} of {len(rows)} rows beyond.**",
        "",
        "| protocol | task / corpus | length | row | n | BASE (95%) | NEW | NEW - BASE (95%) | |",
        "|---|---|---:|---|---:|---|---:|---|---|",
    ]
    for r in rows:
        digits = 3 if r["metric"] == "nll_increase" else 2
        low, high = r["base_ci95"]
        d_low, d_high = r["difference_ci95"]
        lines.append(
            f"| {r['protocol']} | {r['name']} | {r['length']} | {r['row']} | {r['n']} "
            f"| {r['base']:.{digits}f} ({low:.{digits}f}, {high:.{digits}f}) | {r['new']:.{digits}f} "
            f"| {r['difference']:+.{digits}f} ({d_low:+.{digits}f}, {d_high:+.{digits}f}) "
            f"| {'**beyond**' if r['beyond'] else ''} |"
        )
    return "\n".join(lines) + "\n"


def main(new_dir: Path, base_dir: Path, out: Path | None) -> None:
    new, base = Run.load(new_dir), Run.load(base_dir)
    rows = compare(new, base)
    if not rows:
        raise ValueError("the runs share no finished learned row: nothing to compare")
    text = markdown(rows, new, base)
    print(text)
    if out is not None:
        result = {
            "provenance": {"command": portable_command(sys.argv), "git_commit": git_commit()},
            "new": new.provenance,
            "base": base.provenance,
            "rows": rows,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(text)
        print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}")
