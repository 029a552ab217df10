"""The benchmark (eval/benchmark.py): row schema, provenance, statistics, resuming, oracle, real text."""

from __future__ import annotations

import copy
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from test_policy import tiny_policy
from test_sweep import PROVENANCE_FIELDS, tiny_with_chat_tokenizer

import eval.benchmark as benchmark
from eval import benchmark_config, realtext, recall
from eval.__main__ import main
from eval.benchmark import Benchmark, benchmark_result
from eval.benchmark_config import (
    ALL,
    DECODE,
    DECODE_RECALL,
    KV_BYTES,
    PERPLEXITY,
    RESCORED,
    BenchmarkConfig,
    uniform_only,
)
from eval.compare import Run, compare
from eval.corpora import CORPORA, Corpus, is_held_out, refuse_held_out
from eval.oracle import ORACLE, OracleScorer, capped_oracle_scorer, future_states, oracle_scorer
from eval.report import (
    KV_PLOT,
    README_BEGIN,
    README_END,
    headline,
    pending_line,
    remaining_cpu_hours,
    report_markdown,
    update_docs,
)
from eval.shards import method_key
from eval.stats import bootstrap_interval, wilson_from_mean, wilson_interval, write_window_results
from eval.sweep import FULL, MAX_NEW_TOKENS, AnswerDecoder, Prompt, encode_prompt
from kvp_cache import KVPCache
from kvp_cache.allocation import MIN_EXTRA_PER_HEAD
from kvp_cache.cache import EvictingLayer
from kvp_cache.compat import cache_kwarg, evicting_layer_indices
from kvp_cache.policy import Calibration, load_policy
from kvp_cache.prefill import prefill
from kvp_cache.provenance import provenance
from kvp_cache.targets import decode_attention, eviction_points

NEEDLE_FIELDS = {"protocol", "task", "context_tokens", "method", "budget", "n", "metric", "score", "ci95"}
DECODE_FIELDS = {"protocol", "corpus", "kind", "context_tokens", "method", "budget", "n", "metric", "score",
                 "ci95", "nll", "nll_ci95"}  # fmt: skip
TEXT_FIELDS = DECODE_FIELDS | {"kv_bytes", "kv_share"}


@pytest.fixture(scope="module")
def tiny():
    return tiny_with_chat_tokenizer()


def small_config(**overrides) -> BenchmarkConfig:
    options = dict(
        methods=["knorm", "snapkv"],
        budgets=[0.25, 0.5],
        tasks=["niah_single", "niah_multikey"],
        screened_tasks=["vt"],
        screen_samples=2,
        contexts=[256],
        samples={256: 3},
        corpora=["kjv", "chitchat"],
        text_contexts=[96],
        text_windows={96: 3},
        continuation_tokens=12,
        decode_caps=[],
        recall_caps=[],
        allocations=["uniform"],
    )
    return BenchmarkConfig(**{**options, **overrides})


def decode_config(**overrides) -> BenchmarkConfig:
    """The decode protocol alone, at a smoke size: 24 prompt tokens, then 24 read 4 at a time."""
    options = dict(
        contexts=[], protocols=[], tasks=[], screened_tasks=[], text_contexts=[], corpora=["kjv", "angular"],
        methods=["knorm", "tova", "lagkv"], decode_caps=[10, 0.25, 64], decode_prompt_tokens=24,
        decode_tokens=24, decode_windows=2, decode_chunk_tokens=4, evict_every=3, sink_tokens=2, window_tokens=4,
    )  # fmt: skip
    return small_config(**{**options, **overrides})


def run(model, tokenizer, config, out: Path, policy=None) -> dict:
    bench = Benchmark(model, tokenizer, config, out, policy)
    bench.run()
    return benchmark_result(bench.config, out, bench.fingerprint, provenance("tiny", torch.float32, "cpu"))


def shard_lines(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out)): len(p.read_text().splitlines()) for p in sorted(out.rglob("*.jsonl"))}


def sample_shards(out: Path) -> list[Path]:
    """The shards of samples under ``out`` (not the KV-bytes measurements)."""
    return sorted(p for p in (out / "shards").rglob("*.jsonl") if p.parts[-2] != KV_BYTES)


def latest_records(out: Path) -> dict[tuple[str, int], dict]:
    """The last line of every sample of every shard under ``out``, as parsed JSON."""
    found = {}
    for shard in sample_shards(out):
        for record in map(json.loads, shard.read_text().splitlines()):
            found[str(shard.relative_to(out)), record["index"]] = record
    return found


@pytest.fixture
def work(monkeypatch) -> Counter:
    """Counts what the benchmark computes: prefills, scorers built (by method), oracles, full-cache
    needle answers and real-text NLL forwards."""
    counts = Counter()

    def counted(name, function):
        def wrapper(*args, **kwargs):
            counts[name(*args, **kwargs) if callable(name) else name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(benchmark, "prefill", counted("prefill", benchmark.prefill))
    monkeypatch.setattr(benchmark, "make_scorer", counted(lambda method, **_: method, benchmark.make_scorer))
    monkeypatch.setattr(benchmark, "oracle_scorer", counted(ORACLE, benchmark.oracle_scorer))
    monkeypatch.setattr(AnswerDecoder, "full_answer", counted("full_answer", AnswerDecoder.full_answer))
    monkeypatch.setattr(realtext, "continuation_nll", counted("continuation_nll", realtext.continuation_nll))
    return counts


def saved_policy(model, seed: int, directory: Path):
    """A tiny random policy, saved and loaded back (so it has its ``weights_sha256``)."""
    tiny_policy(model, seed=seed).save_pretrained(directory)
    return load_policy(directory)


def test_rows_schema_and_statistics(tiny, tmp_path, fake_corpora):
    model, tokenizer = tiny
    config = small_config()
    result = run(model, tokenizer, config, tmp_path)
    assert next(iter(result)) == "provenance" and set(result["provenance"]) == PROVENANCE_FIELDS
    assert result["pending"] == []
    # The random model never answers: vt is excluded with its full-cache score.
    assert [(e["task"], e["context_tokens"], e["n"]) for e in result["excluded"]] == [("vt", 256, 2)]
    needle = [r for r in result["rows"] if r["protocol"] != PERPLEXITY]
    text = [r for r in result["rows"] if r["protocol"] == PERPLEXITY]
    assert all(set(r) == NEEDLE_FIELDS for r in needle)
    # Every compressed text row but the first method's is also paired with the first method's.
    for r in text:
        paired = r["method"] not in (FULL, "knorm")
        assert set(r) == TEXT_FIELDS | ({"paired"} if paired else set())
    cells = 1 + len(config.row_methods()) * len(config.budgets)
    assert len(needle) == len(config.protocols) * (len(config.tasks) + 1) * cells  # + the pooled task
    assert len(text) == (len(config.corpora) + 1) * cells
    assert {r["method"] for r in result["rows"]} == {FULL, ORACLE, "knorm", "snapkv"}
    for row in result["rows"]:
        low, high = row["ci95"]
        assert low <= row["score"] <= high
        pooled = row.get("task", row.get("corpus")) == ALL
        per_cell = len(config.tasks) if row["protocol"] != PERPLEXITY else len(config.corpora)
        assert row["n"] == 3 * (per_cell if pooled else 1)
    # Scores are the means of the shard records; intervals come from eval.stats.
    shard = tmp_path / "shards" / PERPLEXITY / "kjv" / "96.jsonl"
    records = [json.loads(line) for line in shard.read_text().splitlines()]
    row = next(r for r in text if (r["corpus"], r["method"], r["budget"]) == ("kjv", "snapkv", 0.25))
    increase = [r["nll"]["snapkv@0.25"] - r["nll"][FULL] for r in records]
    assert row["score"] == pytest.approx(sum(increase) / 3)
    assert row["ci95"] == list(bootstrap_interval(increase))
    difference = [r["nll"]["snapkv@0.25"] - r["nll"]["knorm@0.25"] for r in records]
    assert row["paired"]["against"] == "knorm"
    assert row["paired"]["difference"] == pytest.approx(sum(difference) / 3)
    assert row["paired"]["ci95"] == list(bootstrap_interval(difference))
    shard = tmp_path / "shards" / "question_after" / "niah_multikey" / "256.jsonl"
    records = [json.loads(line) for line in shard.read_text().splitlines()]
    row = next(r for r in needle if (r["protocol"], r["task"], r["method"], r["budget"])
               == ("question_after", "niah_multikey", "knorm", 0.5))  # fmt: skip
    scores = [r["scores"]["knorm@0.5"] for r in records]
    # Prompt and answer fit in the context length.
    assert all(r["prompt_tokens"] + MAX_NEW_TOKENS["niah_multikey"] <= 256 for r in records)
    assert max(r["prompt_tokens"] for r in records) > 256 * 0.6
    assert row["score"] == pytest.approx(sum(scores) / 3) and row["ci95"] == list(wilson_interval(scores))


def test_budget_covering_the_prompt_matches_the_full_cache(tiny, tmp_path, fake_corpora):
    model, tokenizer = tiny
    config = small_config(budgets=[1.0], screened_tasks=[], samples={256: 2}, text_windows={96: 2})
    for row in run(model, tokenizer, config, tmp_path)["rows"]:
        if row["protocol"] == PERPLEXITY:
            assert row["score"] == pytest.approx(0.0, abs=1e-4)
    for shard in (tmp_path / "shards").rglob("*.jsonl"):
        for record in map(json.loads, shard.read_text().splitlines()):
            if "predictions" in record:
                full = record["predictions"][FULL]
                assert all(text == full for text in record["predictions"].values())


def test_resumes_where_it_stopped(tiny, tmp_path, fake_corpora):
    model, tokenizer = tiny
    config = small_config(screened_tasks=[], protocols=["question_in"])
    first = run(model, tokenizer, config, tmp_path)
    lines = shard_lines(tmp_path)
    # A rerun computes nothing new and gives the same rows.
    assert run(model, tokenizer, config, tmp_path)["rows"] == first["rows"]
    assert shard_lines(tmp_path) == lines
    # An interrupted shard (last sample lost, a torn line left) is completed, to the same rows.
    shard = tmp_path / "shards" / "question_in" / "niah_single" / "256.jsonl"
    kept = shard.read_text().splitlines()[:-1]
    shard.write_text("\n".join(kept) + '\n{"index": 2, "predic')
    partial = benchmark_result(
        config, tmp_path, Benchmark(model, tokenizer, config, tmp_path).fingerprint, {}
    )
    assert {"protocol": "question_in", "task": "niah_single", "context_tokens": 256, "done": 2, "n": 3,
            "missing": sorted([FULL, ORACLE, "knorm", "snapkv"])} in partial["pending"]  # fmt: skip
    assert run(model, tokenizer, config, tmp_path)["rows"] == first["rows"]
    # Fewer budgets read the same records; other samples or another cache geometry never do.
    fewer = small_config(screened_tasks=[], protocols=["question_in"], budgets=[0.5])
    subset = benchmark_result(fewer, tmp_path, fewer.fingerprint(None), {})
    assert subset["pending"] == [] and subset["rows"] == [
        r for r in first["rows"] if r["budget"] in (None, 0.5)
    ]
    for other in (small_config(screened_tasks=[], protocols=["question_in"], seed=1),
                  small_config(screened_tasks=[], protocols=["question_in"], sink_tokens=2)):  # fmt: skip
        pending = benchmark_result(other, tmp_path, other.fingerprint(None), {})["pending"]
        assert [p["done"] for p in pending] == [0, 0, 0, 0]


def test_adding_a_method_computes_only_that_method(tiny, tmp_path, fake_corpora, work):
    model, tokenizer = tiny
    options = dict(screened_tasks=[], protocols=["question_after"], corpora=["kjv"], samples={256: 2},
                   text_windows={96: 2})  # fmt: skip
    first = run(model, tokenizer, small_config(methods=["knorm"], **options), tmp_path)
    before, lines = latest_records(tmp_path), shard_lines(tmp_path)
    # 6 samples, then the text rows' KV bytes: one more prefill, measured once per prefix length.
    assert work["knorm"] == 7 and work[ORACLE] == 7 and work["prefill"] == 7 and work["full_answer"] == 4
    work.clear()
    config = small_config(methods=["knorm", "tova"], **options)
    # Before tova runs, the finished rows stay reported and each cell names tova as not done.
    waiting = benchmark_result(config, tmp_path, config.fingerprint(None), {})
    assert waiting["rows"] == first["rows"]
    assert [(p["done"], p["missing"]) for p in waiting["pending"]] == [(0, ["tova"])] * 3
    assert remaining_cpu_hours(waiting) is None  # no cell holds every row yet, so none prices a sample
    result = run(model, tokenizer, config, tmp_path)
    # One prefill per sample, tova's scorer only; no full cache, no oracle; one NLL forward per budget;
    # then one prefill for the KV bytes of tova's text rows.
    assert work == Counter({"prefill": 7, "tova": 7, "continuation_nll": 2 * len(config.budgets)})
    after = latest_records(tmp_path)
    added = {method_key("tova", b) for b in config.budgets}
    for key, record in after.items():
        old = before[key]
        for name in ("predictions", "scores", "nll"):
            if name in old:
                assert set(record[name]) == set(old[name]) | added
                assert {k: record[name][k] for k in old[name]} == old[name]  # byte-identical after JSON
        assert record["seconds"] > old["seconds"] and record["policy"] is None
    # The merged records, appended; the KV bytes of the new rows, one line.
    assert shard_lines(tmp_path) == {path: n + (1 if KV_BYTES in path else 2) for path, n in lines.items()}
    # The topped-up rows are a from-scratch run's.
    work.clear()
    assert result["pending"] == [] and run(model, tokenizer, config, tmp_path)["rows"] == result["rows"]
    assert not work
    assert run(model, tokenizer, config, tmp_path / "scratch")["rows"] == result["rows"]


def test_another_policy_recomputes_only_the_learned_rows(tiny, tmp_path, fake_corpora, work):
    model, tokenizer = tiny
    first, second = saved_policy(model, 1, tmp_path / "a"), saved_policy(model, 2, tmp_path / "b")
    assert first.weights_sha256 != second.weights_sha256
    options = dict(screened_tasks=[], protocols=["question_in"], corpora=["chitchat"], samples={256: 2},
                   text_windows={96: 2})  # fmt: skip
    config = small_config(methods=["knorm", "kvp"], policy="tiny", **options)
    out = tmp_path / "out"
    run(model, tokenizer, config, out, first)
    before = latest_records(out)
    assert {r["policy"] for r in before.values()} == {first.weights_sha256}
    # Records of the first policy are not complete for the second.
    pending = benchmark_result(config, out, config.fingerprint(second.weights_sha256), {})["pending"]
    assert [p["done"] for p in pending] == [0, 0, 0]
    work.clear()
    result = run(model, tokenizer, config, out, second)
    assert work == Counter({"prefill": 6, "kvp": 6, "continuation_nll": 2 * len(config.budgets)})
    for key, record in latest_records(out).items():
        assert record["policy"] == second.weights_sha256
        for name in ("predictions", "scores", "nll"):
            if name in record:
                assert set(record[name]) == set(before[key][name])
                unchanged = {k: v for k, v in record[name].items() if not k.startswith("kvp@")}
                assert unchanged == {k: v for k, v in before[key][name].items() if not k.startswith("kvp@")}
    # The text NLLs show the learned rows really were recomputed with the second policy.
    assert any(
        record["nll"][k] != before[key]["nll"][k]
        for key, record in latest_records(out).items()
        if "nll" in record
        for k in record["nll"]
        if k.startswith("kvp@")
    )
    assert run(model, tokenizer, config, tmp_path / "scratch", second)["rows"] == result["rows"]
    # A method list without learned methods reads the records whatever policy they name.
    work.clear()
    rows = run(model, tokenizer, small_config(methods=["knorm"], **options), out)["rows"]
    assert not work and rows == [r for r in result["rows"] if r["method"] != "kvp"]
    # Back to the first policy at one budget: the second policy's learned answers at the other go too,
    # as the record names one policy.
    run(
        model,
        tokenizer,
        small_config(methods=["knorm", "kvp"], policy="tiny", budgets=[0.5], **options),
        out,
        first,
    )
    assert work == Counter({"prefill": 6, "kvp": 6, "continuation_nll": 2})
    for record in latest_records(out).values():
        learned = {
            k
            for name in ("predictions", "scores", "nll")
            for k in record.get(name, {})
            if k.startswith("kvp@")
        }
        assert learned == {"kvp@0.5"} and record["policy"] == first.weights_sha256
    with pytest.raises(ValueError, match="weights_sha256"):
        Benchmark(model, tokenizer, config, out, tiny_policy(model))


def test_records_of_the_former_format_stay_usable(tiny, tmp_path, fake_corpora, work):
    """Records fingerprinted the former way (methods, budgets and policy hashed in, no policy field)
    are complete for that configuration and policy, and keep their other rows under another policy."""
    model, tokenizer = tiny
    first, second = saved_policy(model, 1, tmp_path / "a"), saved_policy(model, 2, tmp_path / "b")
    config = small_config(methods=["knorm", "kvp"], policy="tiny", protocols=["question_in"], corpora=["kjv"],
                          samples={256: 2}, text_windows={96: 2})  # fmt: skip
    out = tmp_path / "out"
    expected = run(model, tokenizer, config, out, first)
    legacy = config.fingerprint(first.weights_sha256).legacy
    for shard in sample_shards(out):  # the former format had no KV-bytes shards
        records = [json.loads(line) for line in shard.read_text().splitlines()]
        shard.write_text("".join(json.dumps({**{k: v for k, v in r.items() if k != "policy"},
                                             "fingerprint": legacy}) + "\n" for r in records))  # fmt: skip
    former = {shard: shard.read_text() for shard in sample_shards(out)}
    # Read as they are (as --no-run does), then resumed: nothing to compute, same rows.
    assert (
        benchmark_result(config, out, config.fingerprint(first.weights_sha256), {})["rows"]
        == expected["rows"]
    )
    work.clear()
    assert run(model, tokenizer, config, out, first)["rows"] == expected["rows"]
    assert not work
    # The run appended each record in the current format, after the former lines.
    for shard, text in former.items():
        assert shard.read_text().startswith(text) and len(shard.read_text().splitlines()) == 2 * len(
            text.splitlines()
        )
    # So another policy recomputes only the learned rows; the screen keeps its records.
    result = run(model, tokenizer, config, out, second)
    assert work == Counter({"prefill": 6, "kvp": 6, "continuation_nll": 2 * len(config.budgets)})
    assert result["excluded"] == expected["excluded"]
    assert [r for r in result["rows"] if r["method"] != "kvp"] == [
        r for r in expected["rows"] if r["method"] != "kvp"
    ]


def test_cli_writes_json_report_and_plots(tiny, tmp_path, monkeypatch, fake_corpora):
    model, tokenizer = tiny
    monkeypatch.setattr("eval.__main__.load_model", lambda name, device: (model, tokenizer))
    monkeypatch.setattr("sys.argv", ["python -m eval", "benchmark"])
    out = tmp_path / "bench"
    args = ["benchmark", "--methods", "knorm,tova", "--policy", "", "--budgets", "0.1,0.25", "--contexts", "256",
            "--samples", "2", "--tasks", "niah_single", "--screened-tasks", "", "--protocols", "question_in",
            "--corpora", "angular", "--text-contexts", "96", "--text-windows", "2", "--continuation-tokens", "8",
            "--essays-dir", "", "--decode-caps", "", "--recall-caps", ""]  # fmt: skip
    # --no-run reports what is done so far: nothing yet.
    assert main([*args, "--out", str(tmp_path / "empty"), "--no-run"]) == 0
    empty = json.loads((tmp_path / "empty" / "benchmark.json").read_text())
    assert empty["rows"] == [] and [p["done"] for p in empty["pending"]] == [0, 0]
    assert not (tmp_path / "empty" / "shards").exists()
    code = main([*args, "--out", str(out)])
    assert code == 0
    result = json.loads((out / "benchmark.json").read_text())
    assert list(result)[0] == "provenance" and result["provenance"]["command"] == "python -m eval benchmark"
    # By default tova and the oracle also get a head-allocation row; knorm cannot rank across heads.
    assert {r["method"] for r in result["rows"]} == {
        FULL,
        ORACLE,
        "oracle+head",
        "knorm",
        "tova",
        "tova+head",
    }
    assert result["corpora"] == {"angular": {"kind": "code", "requirement": CORPORA["angular"].requirement}}
    for name in ("accuracy_vs_budget.png", "nll_vs_budget.png", KV_PLOT):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    table = (out / "benchmark.md").read_text()
    assert "| oracle |" in table and "| tova |" in table and "budget 0.25" in table
    assert "CPU s per sample" in table and "| perplexity/angular/96 | 2 |" in table
    paired = next(
        r["paired"]
        for r in result["rows"]
        if (r.get("corpus"), r["method"], r["budget"]) == (ALL, "tova", 0.1)
    )
    assert "NLL difference per token, each method minus `knorm` on the same windows" in table
    assert "| tova | {:+.3f} ({:+.3f} to {:+.3f}) |".format(paired["difference"], *paired["ci95"]) in table
    gain = next(
        r["allocation_gain"]
        for r in result["rows"]
        if (r.get("corpus"), r["method"], r["budget"]) == (ALL, "tova+head", 0.25)
    )
    assert gain["against"] == "tova" and "adaptive allocation's NLL gain per token" in table
    assert (
        "| tova+head | " in table
        and "{:+.3f} ({:+.3f} to {:+.3f})".format(gain["difference"], *gain["ci95"]) in table
    )
    assert (
        "Uniform rows only (scores not comparable across heads, so no adaptive allocation): knorm." in table
    )
    assert result["seconds"]["question_in/niah_single/256"]["n"] == 2
    snippet = (out / "headline.md").read_text()
    assert snippet == headline(result, KV_PLOT) and f"]({KV_PLOT})" in snippet
    assert "Budget 10%" in snippet and "Budget 5%" not in snippet and "| tova+head |" in snippet
    # `report` regenerates the same files from the JSON alone.
    (out / "headline.md").unlink()
    assert main(["report", str(out / "benchmark.json")]) == 0
    assert (out / "headline.md").read_text() == snippet


def test_cli_prefill_in_chunks_gives_the_same_rows(tiny, tmp_path, monkeypatch, fake_corpora, capsys):
    model, tokenizer = tiny
    monkeypatch.setattr("eval.__main__.load_model", lambda name, device: (model, tokenizer))
    args = ["benchmark", "--methods", "snapkv,expected_attention", "--policy", "", "--budgets", "0.25",
            "--contexts", "256", "--samples", "2", "--tasks", "niah_single", "--screened-tasks", "",
            "--protocols", "question_in,question_after", "--corpora", "kjv", "--text-contexts", "96",
            "--text-windows", "2", "--continuation-tokens", "8", "--essays-dir", "", "--decode-caps", "", "--recall-caps", ""]  # fmt: skip
    rows = {}
    for chunk in (None, 40):
        out = tmp_path / str(chunk)
        assert main([*args, "--out", str(out), *(["--prefill-chunk", str(chunk)] if chunk else [])]) == 0
        rows[chunk] = json.loads((out / "benchmark.json").read_text())["rows"]
    assert len(rows[None]) == len(rows[40]) > 8
    noisy = {"score": None, "nll": None, "ci95": None, "nll_ci95": None}
    for whole, chunked in zip(rows[None], rows[40], strict=True):
        assert {**whole, **noisy} == {**chunked, **noisy}
        assert chunked["score"] == pytest.approx(whole["score"], abs=1e-4)
    with pytest.raises(SystemExit):
        main([*args, "--out", str(tmp_path / "bad"), "--prefill-chunk", "0"])
    assert "--prefill-chunk must be >= 1 token, got 0" in capsys.readouterr().err


def test_report_marks_the_best_and_every_overlapping_method(tmp_path):
    def row(method, score, low, high, budget=0.25):
        return {"protocol": "question_in", "task": ALL, "context_tokens": 2048, "method": method, "budget": budget,
                "n": 50, "metric": "accuracy", "score": score, "ci95": [low, high]}  # fmt: skip

    rows = [row(FULL, 0.9, 0.8, 0.95, None), row(ORACLE, 0.95, 0.9, 0.99), row("kvp", 0.7, 0.6, 0.8),
            row("snapkv", 0.62, 0.5, 0.7), row("knorm", 0.3, 0.2, 0.4)]  # fmt: skip
    result = {
        "rows": rows,
        "excluded": [],
        "config": {
            "protocols": ["question_in"],
            "contexts": [2048],
            "text_contexts": [],
            "budgets": [0.25],
            "corpora": [],
            "min_full_score": 0.3,
        },  # fmt: skip
        "provenance": {"model": "m", "command": "c", "git_commit": "abc", "policy": None},
    }
    docs = tmp_path / "eval.md"
    docs.write_text("# Eval\n\nHand-written text.\n")
    update_docs(result, "m", docs)
    update_docs(result, "m", docs)  # the block is replaced, not appended twice
    text = docs.read_text()
    assert (
        text.startswith("# Eval\n\nHand-written text.\n") and text.count("generated by eval/report.py") == 1
    )
    assert "| **kvp** | **70.0 (60-80)** |" not in text  # the name column is never bold
    assert "| kvp | **70.0 (60-80)** |" in text and "| snapkv | **62.0 (50-70)** |" in text
    assert "| knorm | 30.0 (20-40) |" in text and "| oracle | 95.0 (90-99) |" in text

    # The README's headline block is replaced where its model's marker is, never appended.
    readme, other = tmp_path / "README.md", tmp_path / "OTHER.md"
    marker = README_BEGIN.format(model="m")
    readme.write_text(f"# R\n\n{marker}\nold numbers\n{README_END}\n\nAfter.\n")
    other.write_text("# No marker\n")
    update_docs(result, "m", docs, readme)
    update_docs(result, "m", docs, other)
    text = readme.read_text()
    assert (
        "old numbers" not in text and headline(result) in text and text.endswith(f"{README_END}\n\nAfter.\n")
    )
    assert other.read_text() == "# No marker\n"


def test_headline_shows_every_length_pooled_or_its_only_task():
    def row(task, length, method="kvp"):
        return {"protocol": "question_in", "task": task, "context_tokens": length, "method": method,
                "budget": 0.1, "n": 20, "metric": "accuracy", "score": 0.5, "ci95": [0.3, 0.7]}  # fmt: skip

    rows = [row(ALL, 2048), row("niah_single", 2048), row("niah_multikey", 2048),  # every task: pooled
            row("niah_single", 8192),  # one task run at this length: its own column
            row("niah_single", 16384), row("niah_multikey", 16384, "tova")]  # fmt: skip
    result = {
        "rows": rows,
        "config": {
            "protocols": ["question_in", "question_after"],
            "contexts": [2048, 8192, 16384],
            "text_contexts": [],
        },
        "provenance": {"model": "m", "command": "c", "git_commit": "abc", "policy": None},
    }
    header = headline(result).splitlines()[2]
    assert (
        header == "| method | needles 2K, q. inside (acc. %) | needles 8K niah_single, q. inside (acc. %) |"
    )


def test_wilson_and_bootstrap_intervals():
    # Reference values of the Wilson score interval (z = 1.96).
    assert wilson_from_mean(0.5, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    assert wilson_interval([0.0] * 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval([1.0] * 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert bootstrap_interval([2.5] * 7) == (2.5, 2.5)
    values = [float(i) for i in range(40)]
    low, high = bootstrap_interval(values)
    standard_error = math.sqrt(sum((v - 19.5) ** 2 for v in values) / 39 / 40)
    assert low < 19.5 < high and high - low == pytest.approx(2 * 1.96 * standard_error, rel=0.2)
    assert bootstrap_interval(values) == (low, high)  # seeded
    with pytest.raises(ValueError, match="at least one sample"):
        wilson_interval([])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        wilson_interval([1.5])


def test_oracle_keeps_the_entries_the_future_attends_to_most():
    model = tiny_model("llama")
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    future = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    scorer = oracle_scorer(model, prefill(model, prompt), future[0].tolist())
    # Reference: the eager model's own attention over prompt + future, max over each GQA group,
    # summed over the future queries.
    with torch.no_grad():
        attentions = model(torch.cat([prompt, future], -1), output_attentions=True).attentions
    for layer, attention in enumerate(attentions):
        grouped = attention[0, :, 40:, :40].reshape(2, 2, 6, 40)  # [kv_heads, group, future, prompt]
        torch.testing.assert_close(scorer.importance[layer], grouped.amax(1).sum(1), rtol=1e-4, atol=1e-5)
    cache = KVPCache(model, method=scorer, budget=10, sink_tokens=0, window_tokens=0, track_positions=True)
    with torch.no_grad():
        model(prompt, **{cache_kwarg(model): cache})
    for layer, kept in zip(range(2), cache.evicting_layers, strict=True):
        expected = scorer.importance[layer].topk(10, dim=-1).indices.sort(-1).values
        assert torch.equal(kept.positions[0].sort(-1).values, expected)
    with pytest.raises(ValueError, match="built for"):
        OracleScorer(scorer.importance).score(torch.zeros(1, 2, 30, 16), None, None, layer_idx=0)


def test_continuation_nll_is_the_full_forward_nll():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(3))
    prefix, continuation = ids[:, :38], ids[:, 38:]
    with torch.no_grad():
        logits = model(ids).logits[0, 37:-1]
    expected = F.cross_entropy(logits, ids[0, 38:])
    prefilled = prefill(model, prefix)
    full = realtext.continuation_nll(model, prefilled, copy.deepcopy(prefilled.cache), continuation)
    torch.testing.assert_close(full, expected[None], rtol=1e-4, atol=1e-5)
    kept_all = KVPCache.from_prefill(prefilled, model, method="knorm", budget=1.0)
    torch.testing.assert_close(realtext.continuation_nll(model, prefilled, kept_all, continuation), full)
    compressed = KVPCache.from_prefill(
        prefilled, model, method="knorm", budget=4, sink_tokens=0, window_tokens=0
    )
    assert not torch.allclose(realtext.continuation_nll(model, prefilled, compressed, continuation), full)


def test_windows_are_disjoint_spread_and_independent_of_their_count():
    stream = torch.arange(1050)  # 10 slots of 100 tokens, 50 left over
    windows = realtext.windows(stream, 100, 4)
    starts = [int(w[0, 0]) for w in windows]
    assert starts == [0, 500, 200, 700] and all(w.shape == (1, 100) for w in windows)
    every = [int(w[0, 0]) for w in realtext.windows(stream, 100, 10)]
    assert every[:4] == starts and sorted(every) == list(range(0, 1000, 100))
    assert realtext.spread_order(1) == [0] and sorted(realtext.spread_order(37)) == list(range(37))
    with pytest.raises(ValueError, match="too few for 11 windows"):
        realtext.windows(stream, 100, 11)
    with pytest.raises(ValueError, match="length must be >= 2"):
        realtext.windows(stream, 1, 1)


def test_more_text_windows_top_up_and_other_placements_are_never_read(tiny, tmp_path, fake_corpora, work):
    model, tokenizer = tiny
    options = dict(contexts=[], screened_tasks=[], corpora=["kjv"], methods=["knorm"], budgets=[0.5])
    first = run(model, tokenizer, small_config(text_windows={96: 2}, **options), tmp_path)
    work.clear()
    more = small_config(text_windows={96: 3}, **options)
    result = run(model, tokenizer, more, tmp_path)
    assert work["prefill"] == 1  # only the new window
    assert run(model, tokenizer, more, tmp_path / "scratch")["rows"] == result["rows"]
    # Records of another window placement (without the marker) are never read.
    shard = tmp_path / "shards" / PERPLEXITY / "kjv" / "96.jsonl"
    lines = [json.loads(line) for line in shard.read_text().splitlines()]
    shard.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "windows"}) + "\n" for r in lines)
    )
    pending = benchmark_result(more, tmp_path, more.fingerprint(None), {})["pending"]
    assert first["pending"] == [] and pending == [
        {"protocol": PERPLEXITY, "corpus": "kjv", "context_tokens": 96, "done": 0, "n": 3,
         "missing": sorted([FULL, ORACLE, "knorm"])}
    ]  # fmt: skip


def test_held_out_text_is_refused(prose_dir):
    for name in ("kjv", "chitchat-dataset", "xstatic-angular", "Angular"):
        with pytest.raises(ValueError, match="held-out evaluation corpus"):
            refuse_held_out([name])
    for path in ("/usr/share/dict/words", "/usr/lib/python3.11/json/decoder.py", "/usr/share"):
        with pytest.raises(ValueError, match="held out|standard library"):
            refuse_held_out([prose_dir, path])
    for corpus in CORPORA.values():
        try:
            location = corpus.location()
        except ModuleNotFoundError:
            continue
        assert is_held_out(location / "data") and is_held_out(location.parent)
    refuse_held_out([prose_dir, "essays", "/usr/lib/python3.11/site-packages/numpy/core.py"])
    with pytest.raises(TypeError, match="list"):
        refuse_held_out(str(prose_dir))
    missing = Corpus("missing", "prose", "no-such-dist", "1.0", "no_such_package.sub")
    with pytest.raises(ModuleNotFoundError, match="pip install 'no-such-dist==1.0'"):
        missing.location()


def test_config_errors():
    with pytest.raises(ValueError, match="unknown methods"):
        small_config(methods=["nope"])
    with pytest.raises(ValueError, match="needs policy"):
        small_config(methods=["kvp"])
    with pytest.raises(ValueError, match="protocols"):
        small_config(protocols=["question_before"])
    with pytest.raises(ValueError, match="corpora"):
        small_config(corpora=["wikipedia"])
    with pytest.raises(ValueError, match="no sample count"):
        small_config(contexts=[256, 320])
    with pytest.raises(ValueError, match="sample counts"):
        small_config(samples={256: 0})
    with pytest.raises(ValueError, match="min_full_score"):
        small_config(min_full_score=30)
    assert method_key(FULL, None) == FULL and method_key("kvp", 0.1) == "kvp@0.1"


def test_unfinished_cells_are_priced_from_finished_cells_of_the_same_length():
    seconds = {"question_in/niah_single/2048": {"n": 50, "cpu_seconds": 500.0},
               "perplexity/kjv/2048": {"n": 10, "cpu_seconds": 300.0}}  # fmt: skip
    pending = [{"protocol": "question_after", "task": "niah_single", "context_tokens": 2048, "done": 10, "n": 50},
               {"protocol": PERPLEXITY, "corpus": "angular", "context_tokens": 2048, "done": 0, "n": 12}]  # fmt: skip
    result = {"seconds": seconds, "pending": pending}
    assert remaining_cpu_hours(result) == pytest.approx((40 * 10 + 12 * 30) / 3600)
    assert "about 0.2 CPU hours left" in pending_line(result)
    pending.append(
        {"protocol": "question_in", "task": "niah_single", "context_tokens": 4096, "done": 0, "n": 20}
    )
    assert remaining_cpu_hours(result) is None and "CPU hours" not in pending_line(result)
    # A cell with a method still to run: its reported rows cost less than a sample, so they price nothing.
    seconds = {"question_in/niah_single/2048": {"n": 50, "cpu_seconds": 500.0},
               "question_in/niah_multikey/2048": {"n": 50, "cpu_seconds": 50.0}}  # fmt: skip
    pending = [{"protocol": "question_in", "task": "niah_multikey", "context_tokens": 2048, "done": 0, "n": 50,
                "missing": ["h2o"]}]  # fmt: skip
    assert remaining_cpu_hours({"seconds": seconds, "pending": pending}) == pytest.approx(50 * 10 / 3600)


# ---------------------------------------------------------------- decoding under a cap


def test_decode_rows_caps_and_resume(tiny, tmp_path, fake_corpora, work):
    model, tokenizer = tiny
    config = decode_config()
    result = run(model, tokenizer, config, tmp_path)
    assert result["pending"] == [] and config.cap_tokens(0.25) == 12
    rows = [r for r in result["rows"] if r["protocol"] == DECODE]
    grid = [(FULL, None)] + [(m, c) for m in ("knorm", "tova", ORACLE) for c in (10, 0.25, 64)]
    assert len(rows) == 3 * len(grid)  # two corpora, then both pooled; lagkv cannot rank decoded tokens
    assert {(r["method"], r["budget"]) for r in rows} == set(grid)
    for r in rows:
        paired = r["method"] not in (FULL, "knorm")
        assert set(r) == DECODE_FIELDS | ({"paired"} if paired else set()) and r["context_tokens"] == 24
    by_key = {(r["corpus"], r["method"], r["budget"]): r for r in rows}
    for (name, method, cap), row in by_key.items():
        full = by_key[name, FULL, None]["nll"]
        if cap == 64:  # a cap above the 48 tokens read never evicts: the uncapped cache's NLL
            assert row["nll"] == pytest.approx(full, abs=1e-5)
        if cap == 10 and method != ORACLE:
            assert abs(row["nll"] - full) > 1e-4  # the cap evicted something that mattered
    # The uncapped row, read in chunks, is the plain forward's NLL of the window's last 24 tokens.
    window = realtext.windows(realtext.corpus_tokens("kjv", tokenizer), 48, 2)[0]
    with torch.no_grad():
        logits = model(window).logits[0, 23:-1]
    expected = F.cross_entropy(logits, window[0, 24:]).item()
    record = latest_records(tmp_path)["shards/decode/kjv/24.jsonl", 0]
    assert record["nll"][FULL] == pytest.approx(expected, abs=1e-4)
    assert record["chunk_tokens"] == 4 and record["decode_tokens"] == 24
    table = (tmp_path / "report").joinpath("benchmark.md")
    from eval.report import write_report

    write_report(result, table.parent)
    text = table.read_text()
    assert "decoding under a cap" in text and "cap 25% (12)" in text and "| decode/kjv/24 | 2 |" in text
    # Resumed: nothing to compute; another chunk length reads none of these records.
    work.clear()
    assert run(model, tokenizer, config, tmp_path)["rows"] == result["rows"] and work["prefill"] == 0
    other = decode_config(decode_chunk_tokens=5)
    assert {p["done"] for p in benchmark_result(other, tmp_path, other.fingerprint(None), {})["pending"]} == {
        0
    }


class WithBos:
    """A tokenizer that puts a BOS before any text, as Gemma 3's does."""

    bos_token_id = 1

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, text, add_special_tokens: bool = True, **options):
        encoded = self.inner(text, add_special_tokens=False, **options)
        if add_special_tokens:
            encoded["input_ids"] = [self.bos_token_id] + encoded["input_ids"]
        return encoded


def test_text_windows_start_with_the_models_bos(tiny, tmp_path, fake_corpora, monkeypatch):
    """Real-text windows (prefix compression and decoding under a cap) start as every prompt does, with
    the tokenizer's BOS; records read without it are not read for a model that has one."""
    model, tokenizer = tiny
    config = decode_config(corpora=["kjv"], text_contexts=[64], text_windows={64: 2}, decode_caps=[10])
    firsts, prefill = [], benchmark.prefill

    def spy(model, input_ids, **options):
        firsts.append(input_ids[0, :2].tolist())
        return prefill(model, input_ids, **options)

    def expected(lead: list[int], kv_bytes: bool) -> list[list[int]]:
        """The first two tokens of each prefill: KV bytes, the 2 text windows, the 2 decode windows."""
        stream, text, decode = realtext.corpus_tokens("kjv", tokenizer), 64 + 12, 24 + 24
        cells = [(text, 1)] * kv_bytes + [(text, 2), (decode, 2)]
        starts = [realtext.windows(stream, length - len(lead), n) for length, n in cells]
        return sorted((lead + w[0].tolist())[:2] for windows in starts for w in windows)

    monkeypatch.setattr(benchmark, "prefill", spy)
    plain = run(model, tokenizer, config, tmp_path)
    assert {r["windows"] for r in latest_records(tmp_path).values()} == {realtext.WINDOWS}
    assert sorted(firsts) == expected([], kv_bytes=True)
    firsts.clear()
    with_bos = run(model, WithBos(tokenizer), config, tmp_path)
    assert {r["windows"] for r in latest_records(tmp_path).values()} == {realtext.WINDOWS + "+bos"}
    # Every window is computed again, BOS first; the KV bytes, which no text changes, are not.
    assert sorted(firsts) == expected([WithBos.bos_token_id], kv_bytes=False)
    nll = {(r["protocol"], r["corpus"], r["method"], r["budget"]): r["nll"] for r in plain["rows"]}
    assert len(nll) == len(with_bos["rows"])
    for row in with_bos["rows"]:
        assert row["nll"] != nll[row["protocol"], row["corpus"], row["method"], row["budget"]]


def test_decode_caps_only_the_global_layers_of_a_hybrid_model(tiny, tmp_path, fake_corpora):
    """Gemma 3: sliding-window layers keep their own window, the global ones are capped (oracle included)."""
    model = tiny_model("gemma3")
    model.resize_token_embeddings(len(tiny[1]), mean_resizing=False)  # the fake corpora's token ids
    config = decode_config(methods=["knorm", "snapkv"], corpora=["kjv"])
    rows = {(r["method"], r["budget"]): r["nll"] for r in run(model, tiny[1], config, tmp_path)["rows"]}
    assert len(rows) == 1 + 3 * 3
    for (_, cap), nll in rows.items():
        if cap == 64:
            assert nll == pytest.approx(rows[FULL, None], abs=1e-5)
        elif cap == 10:
            assert abs(nll - rows[FULL, None]) > 1e-4


def test_capped_oracle_keeps_what_the_decode_target_ranks_highest():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 44), generator=torch.Generator().manual_seed(4))
    prompt, rest = ids[:, :20], ids[0, 20:].tolist()
    cap, every, sinks, window, chunk = 8, 3, 1, 2, 4
    forwards = [20] + [chunk] * 5  # 40 tokens read; the queries of the 4 after it rank the last eviction
    evictions = eviction_points(forwards, cap, every)
    prefilled = prefill(model, prompt)
    states = future_states(model, prefilled, rest)
    scorer = capped_oracle_scorer(states, evictions, sinks, window)
    # The target is the one defined in the core, on the uncapped model's states.
    torch.testing.assert_close(
        scorer.importance[1],
        decode_attention(states[1].queries, states[1].keys, states[1].scaling, evictions, 1, 2),
    )
    cache = KVPCache.from_prefill(
        prefilled, model, method=scorer, budget=1.0, max_cache_tokens=cap, evict_every=every,
        sink_tokens=sinks, window_tokens=window, track_positions=True,
    )  # fmt: skip
    scorer.bind(cache)
    held = {layer: torch.arange(20).expand(2, -1) for layer in range(2)}  # what each head held before
    read, checked = 20, 0
    for step, n in enumerate(forwards):
        if step:
            with torch.no_grad():
                model(torch.tensor([rest[read - 20 : read - 20 + n]]), **{cache_kwarg(model): cache})
            held = {
                layer: torch.cat([h, torch.arange(read, read + n).expand(2, -1)], -1)
                for layer, h in held.items()
            }
            read += n
        if read not in evictions:
            continue
        k = evictions.index(read)
        for layer, kept in enumerate(cache.evicting_layers):
            for head in range(2):
                candidates = held[layer][head]
                protected = candidates[(candidates < sinks) | (candidates >= read - window)]
                free = candidates[(candidates >= sinks) & (candidates < read - window)]
                best = free[scorer.importance[layer][k, head, free].topk(cap - sinks - window).indices]
                expected = torch.cat([protected, best]).sort().values
                assert torch.equal(kept.positions[0, head].sort().values, expected)
                checked += 1
            held[layer] = kept.positions[0].sort(-1).values
    assert checked == 2 * 2 * len(evictions) and len(evictions) >= 3
    with pytest.raises(ValueError, match="built for evictions"):
        KVPCache.from_prefill(
            prefilled, model, method=capped_oracle_scorer(states, evictions[1:], sinks, window), budget=1.0,
            max_cache_tokens=cap, evict_every=every, sink_tokens=sinks, window_tokens=window, track_positions=True,
        )  # fmt: skip


def test_decode_config_errors():
    with pytest.raises(ValueError, match="fewer than sink_tokens"):
        decode_config(decode_caps=[5])
    with pytest.raises(ValueError, match="fewer than sink_tokens"):
        decode_config(decode_caps=[0.1])  # 5 of 48 tokens
    with pytest.raises(ValueError, match="decode_chunk_tokens must be an int >= 1"):
        decode_config(decode_chunk_tokens=0)
    with pytest.raises(ValueError, match="oracle_horizon"):
        decode_config(oracle_horizon=0)


# ---------------------------------------------------------------- recall under a cap


def recall_config(**overrides) -> BenchmarkConfig:
    """The decode_recall protocol alone, at a smoke size: a 256-token needle context, then 24 filler
    tokens read 4 at a time; cap 0.1 is 28 tokens, 4096 holds everything."""
    options = dict(
        contexts=[], protocols=[], tasks=[], screened_tasks=[], text_contexts=[], methods=["knorm", "tova", "lagkv"],
        recall_caps=[0.1, 4096], recall_samples=2, recall_context_tokens=256, recall_filler_tokens=24,
        decode_chunk_tokens=4, evict_every=3, sink_tokens=2, window_tokens=4,
    )  # fmt: skip
    return small_config(**{**options, **overrides})


def recall_records(out: Path) -> dict[tuple[str, int], dict]:
    return {key: r for key, r in latest_records(out).items() if key[0].startswith(f"shards/{DECODE_RECALL}/")}


def test_recall_cap_holding_everything_answers_as_the_uncapped_cache(
    tiny, tmp_path, fake_corpora, monkeypatch
):
    model, tokenizer = tiny
    config = recall_config()
    chunks, forward = [], recall.forward_tokens
    monkeypatch.setattr(
        recall, "forward_tokens", lambda m, c, ids, **o: chunks.append(ids.shape) or forward(m, c, ids, **o)
    )
    result = run(model, tokenizer, config, tmp_path)
    # Every cache (uncapped, 2 methods x 2 caps) of every sample reads the 24 filler tokens 4 at a time.
    assert chunks == [(1, 4)] * 6 * 5 * 4
    assert result["pending"] == [] and config.cap_tokens(0.1, DECODE_RECALL) == 28
    records = recall_records(tmp_path)
    assert len(records) == 2 * 2 and {r["filler_tokens"] for r in records.values()} == {24}
    changed = 0
    for record in records.values():
        full = record["predictions"][FULL]
        for method in ("knorm", "tova"):  # lagkv cannot rank decoded tokens
            assert record["predictions"][f"{method}@4096"] == full
            changed += record["predictions"][f"{method}@0.1"] != full
        assert not any(key.startswith("lagkv") for key in record["predictions"])
    assert changed > 0  # a cap of 28 of the ~280 tokens read loses what the answer needed
    # The uncapped answer is plain greedy decoding of needle context + filler + question in one go.
    bench = Benchmark(model, tokenizer, config, tmp_path)
    sample = bench.samples("niah_single", 256, 2)[1]
    prompt = encode_prompt(sample, tokenizer, True, torch.device("cpu"))
    filler = realtext.windows(realtext.corpus_tokens("kjv", tokenizer), 24, 2)[1]
    read = Prompt(torch.cat([prompt.prefix, filler], -1), prompt.suffix)
    expected = bench.decoder.from_scratch(read, FULL, None, MAX_NEW_TOKENS["niah_single"])
    record = records[f"shards/{DECODE_RECALL}/niah_single/256.jsonl", 1]
    assert record["predictions"][FULL] == expected and record["prompt_tokens"] == read.full.shape[1]
    rows = [r for r in result["rows"] if r["protocol"] == DECODE_RECALL]
    grid = [(FULL, None)] + [(m, c) for m in ("knorm", "tova") for c in (0.1, 4096)]
    assert [(r["task"], r["method"], r["budget"]) for r in rows] == [
        (task, m, c) for task in ("niah_single", "niah_multikey", ALL) for m, c in grid
    ]
    for r in rows:
        assert (
            set(r) == NEEDLE_FIELDS | {"of_full"}
            and r["metric"] == "accuracy"
            and r["n"] == (2 if r["task"] != ALL else 4)
        )
        full = next(f for f in rows if f["task"] == r["task"] and f["method"] == FULL)["score"]
        assert r["of_full"] == (pytest.approx(r["score"] / full) if full else None)
    from eval.report import write_report

    write_report(result, tmp_path / "report")
    text = (tmp_path / "report" / "benchmark.md").read_text()
    assert (
        "recall under a cap" in text
        and "cap 10% (28)" in text
        and "| decode_recall/niah_single/256 | 2 |" in text
    )


def test_recall_resumes_and_another_filler_length_recomputes(tiny, tmp_path, fake_corpora, work):
    model, tokenizer = tiny
    config = recall_config(recall_tasks=["niah_single"], recall_caps=[0.1])
    first = run(model, tokenizer, config, tmp_path)
    assert work["prefill"] == 2
    work.clear()
    assert run(model, tokenizer, config, tmp_path)["rows"] == first["rows"] and work["prefill"] == 0
    other = recall_config(recall_tasks=["niah_single"], recall_caps=[0.1], recall_filler_tokens=20)
    pending = benchmark_result(other, tmp_path, other.fingerprint(None), {})["pending"]
    assert [(p["protocol"], p["done"]) for p in pending] == [(DECODE_RECALL, 0)]
    run(model, tokenizer, other, tmp_path)
    assert work["prefill"] == 2
    assert {r["filler_tokens"] for r in recall_records(tmp_path).values()} == {20}
    assert run(model, tokenizer, config, tmp_path)["rows"] == first["rows"] and work["prefill"] == 2
    # A new cap tops the records up: one prefill per sample, only the new rows computed.
    more = recall_config(recall_tasks=["niah_single"], recall_caps=[0.1, 4096])
    built, from_prefill = [], KVPCache.from_prefill
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            KVPCache,
            "from_prefill",
            lambda *a, **o: built.append(o["max_cache_tokens"]) or from_prefill(*a, **o),
        )
        run(model, tokenizer, more, tmp_path)
    assert work["prefill"] == 4 and built == [4096] * 2 * 2


def test_recall_caps_only_the_global_layers_of_a_hybrid_model(tiny, tmp_path, fake_corpora, monkeypatch):
    """Gemma 3: sliding-window layers keep their own window, the global ones hold at most the cap."""
    model = tiny_model("gemma3")
    model.resize_token_embeddings(len(tiny[1]), mean_resizing=False)
    config = recall_config(methods=["knorm", "snapkv"], recall_tasks=["niah_single"])
    caches, from_prefill = [], KVPCache.from_prefill

    def spy(*args, **options):
        caches.append((options["max_cache_tokens"], from_prefill(*args, **options)))
        return caches[-1][1]

    monkeypatch.setattr(KVPCache, "from_prefill", spy)
    run(model, tiny[1], config, tmp_path)
    records = recall_records(tmp_path)
    read = [records[f"shards/{DECODE_RECALL}/niah_single/256.jsonl", i]["prompt_tokens"] for i in (0, 1)]
    assert len(caches) == 2 * 2 * 2
    for k, (cap, cache) in enumerate(caches):  # sample 0's four caches, then sample 1's
        evicting = [i for i, layer in enumerate(cache.layers) if isinstance(layer, EvictingLayer)]
        assert evicting == evicting_layer_indices(model.config) == [1, 3]
        # Each read context, filler and question (and the answer but its last token).
        assert all(cache.layers[i].cumulative_length >= read[k // 4] for i in evicting)
        held = [cache.layers[i].physical_length() for i in evicting]
        if cap == 28:
            assert max(held) <= cap + config.evict_every
        else:
            assert held == [cache.layers[i].cumulative_length for i in evicting]
    for record in recall_records(tmp_path).values():
        assert (
            record["predictions"]["knorm@4096"]
            == record["predictions"]["snapkv@4096"]
            == record["predictions"][FULL]
        )


def test_recall_config_errors_and_options(tiny, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="recall_caps .* fewer than sink_tokens"):
        recall_config(recall_caps=[5])
    with pytest.raises(ValueError, match="recall_caps .* fewer than sink_tokens"):
        recall_config(recall_caps=[0.01])  # 3 of 280 tokens
    for name, value in (("recall_samples", 0), ("recall_context_tokens", 32), ("recall_filler_tokens", 0)):
        with pytest.raises(ValueError, match=f"{name} must be an int"):
            recall_config(**{name: value})
    with pytest.raises(ValueError, match="recall_tasks must be among"):
        recall_config(recall_tasks=["vt"])
    with pytest.raises(ValueError, match="recall_tasks is empty"):
        recall_config(recall_tasks=[])
    assert recall_config(recall_tasks=[], recall_caps=[]).recall_grid() == [(FULL, None)]
    model, tokenizer = tiny
    monkeypatch.setattr("eval.__main__.load_model", lambda name, device: (model, tokenizer))
    args = ["benchmark", "--methods", "knorm", "--policy", "", "--contexts", "", "--protocols", "", "--tasks", "",
            "--screened-tasks", "", "--text-contexts", "", "--decode-caps", "", "--essays-dir", "", "--no-run",
            "--recall-caps", "0.5,64", "--recall-tasks", "niah_multikey", "--recall-samples", "3",
            "--recall-context-tokens", "512", "--recall-filler-tokens", "100", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert {k: v for k, v in result["config"].items() if k.startswith("recall_")} == {
        "recall_caps": [0.5, 64], "recall_tasks": ["niah_multikey"], "recall_samples": 3,
        "recall_context_tokens": 512, "recall_filler_tokens": 100,
    }  # fmt: skip
    assert [(p["protocol"], p["task"], p["context_tokens"], p["n"]) for p in result["pending"]] == [
        (DECODE_RECALL, "niah_multikey", 512, 3)
    ]
    assert main([*args[:-2], "--recall-caps", "", "--out", str(tmp_path / "off")]) == 0
    assert json.loads((tmp_path / "off" / "benchmark.json").read_text())["pending"] == []


def adaptive_config(**overrides) -> BenchmarkConfig:
    options = dict(screened_tasks=[], protocols=["question_after"], tasks=["niah_single"], corpora=["kjv"],
                   samples={256: 2}, text_windows={96: 2}, allocations=["uniform", "head"])  # fmt: skip
    return small_config(**{**options, **overrides})


def test_adaptive_rows_for_comparable_methods_only(tiny, tmp_path, fake_corpora, work):
    """knorm gets no adaptive row; snapkv's and the oracle's are the caches a user builds with
    allocation="head", paired with their uniform rows; a rerun computes nothing."""
    model, tokenizer = tiny
    config = adaptive_config()
    assert config.row_methods() == ["knorm", "snapkv", "snapkv+head", ORACLE, "oracle+head"]
    result = run(model, tokenizer, config, tmp_path)
    assert result["pending"] == []
    for protocol in ("question_after", PERPLEXITY):
        methods = {r["method"] for r in result["rows"] if r["protocol"] == protocol}
        assert methods == {FULL, "knorm", "snapkv", "snapkv+head", ORACLE, "oracle+head"}
    records = latest_records(tmp_path)
    text = [records["shards/perplexity/kjv/96.jsonl", i] for i in range(2)]
    windows = realtext.windows(realtext.corpus_tokens("kjv", tokenizer), 96 + 12, 2)
    for budget in config.budgets:
        for index, record in enumerate(text):  # the NLL of the cache a user builds
            with torch.no_grad():
                prefilled = prefill(model, windows[index][:, :96])
                cache = KVPCache.from_prefill(
                    prefilled,
                    model,
                    method="snapkv",
                    budget=budget,
                    allocation="head",
                    compress="first_prefill",
                )
                nll = realtext.continuation_nll(model, prefilled, cache, windows[index][:, 96:]).item()
            assert record["nll"][method_key("snapkv+head", budget)] == pytest.approx(nll, abs=1e-5)
        row = next(
            r
            for r in result["rows"]
            if (r.get("corpus"), r["method"], r["budget"]) == (ALL, "snapkv+head", budget)
        )
        gain = [
            r["nll"][method_key("snapkv", budget)] - r["nll"][method_key("snapkv+head", budget)] for r in text
        ]
        assert row["allocation_gain"] == {"against": "snapkv", "difference": pytest.approx(sum(gain) / 2),
                                          "ci95": list(bootstrap_interval(gain))}  # fmt: skip
        uniform = next(
            r
            for r in result["rows"]
            if (r.get("corpus"), r["method"], r["budget"]) == (ALL, "snapkv", budget)
        )
        assert "allocation_gain" not in uniform
        # Equal total entries: the ragged cache's bytes are the uniform one's, up to its per-head metadata.
        assert row["kv_share"] == pytest.approx(uniform["kv_share"], rel=0.05) and 0 < row["kv_share"] < 1
    assert any(
        r["nll"][method_key(name + "+head", b)] != r["nll"][method_key(name, b)]
        for r in text for name in ("snapkv", ORACLE) for b in config.budgets
    )  # fmt: skip
    # The KV bytes were measured on one window: the other window's caches hold the same bytes.
    with torch.no_grad():
        prefilled = prefill(model, windows[1][:, :96])
        cache = KVPCache.from_prefill(
            prefilled, model, method="snapkv", budget=0.25, allocation="head", compress="first_prefill"
        )
    row = next(
        r
        for r in result["rows"]
        if (r.get("corpus"), r["method"], r["budget"]) == ("kjv", "snapkv+head", 0.25)
    )
    assert row["kv_bytes"] == cache.kv_bytes()
    work.clear()
    assert run(model, tokenizer, config, tmp_path)["rows"] == result["rows"] and not work
    with pytest.raises(ValueError, match="allocations"):
        adaptive_config(allocations=["uniform", "global"])
    with pytest.raises(ValueError, match="allocations"):
        adaptive_config(allocations=["head", "head"])


def test_adaptive_rows_top_up_uniform_records(tiny, tmp_path, fake_corpora, work):
    """Records without an allocation are the uniform rows: adding allocations computes the adaptive
    rows only and leaves every uniform answer as it was."""
    model, tokenizer = tiny
    uniform = adaptive_config(allocations=["uniform"])
    adaptive = adaptive_config()
    assert uniform.fingerprint(None) == adaptive.fingerprint(None)  # the legacy hash included
    before = run(model, tokenizer, uniform, tmp_path)
    records = latest_records(tmp_path)
    assert not any("+" in key for r in records.values() for key in r.get("nll", r.get("scores", {})))
    work.clear()
    result = run(model, tokenizer, adaptive, tmp_path)
    # One prefill per sample (2 needle, 2 text) plus the adaptive rows' KV bytes; snapkv's and the
    # oracle's scorers only; one NLL forward per window, budget and adaptive method.
    assert work == Counter({"prefill": 5, "snapkv": 5, ORACLE: 5, "continuation_nll": 2 * 2 * 2})
    for key, record in latest_records(tmp_path).items():
        for name in ("predictions", "scores", "nll"):
            if name in record:
                assert {k: v for k, v in record[name].items() if "+" not in k} == records[key][name]
    assert [r for r in result["rows"] if "+" not in r["method"]] == before["rows"]


def test_another_calibration_recomputes_only_the_learned_adaptive_rows(tiny, tmp_path, fake_corpora, work):
    model, tokenizer = tiny
    plain = saved_policy(model, 1, tmp_path / "plain")
    tilted = tiny_policy(model, seed=1)
    shape = (len(tilted.layer_indices), model.config.num_key_value_heads)
    weight = torch.linspace(0.2, 5.0, shape[0] * shape[1]).view(shape)
    tilted.calibration = Calibration(torch.ones(shape), weight)
    tilted.save_pretrained(tmp_path / "tilted")
    tilted = load_policy(tmp_path / "tilted")
    assert tilted.weights_sha256 == plain.weights_sha256
    config = adaptive_config(methods=["knorm", "kvp"], policy="tiny", protocols=[], oracle=False)
    run(model, tokenizer, config, tmp_path / "out", plain)
    before = latest_records(tmp_path / "out")
    assert {r.get("calibration") for r in before.values()} == {None}
    work.clear()
    run(model, tokenizer, config, tmp_path / "out", tilted)
    # One prefill per window, no KV bytes (the calibration does not change them); kvp+head's rows only.
    assert work == Counter({"prefill": 2, "kvp": 2, "continuation_nll": 2 * 2})
    for key, record in latest_records(tmp_path / "out").items():
        assert (
            record["calibration"]
            == Benchmark(model, tokenizer, config, tmp_path, tilted).fingerprint.calibration
        )
        assert {k: v for k, v in record["nll"].items() if "+" not in k} == {
            k: v for k, v in before[key]["nll"].items() if "+" not in k
        }
        assert any(record["nll"][k] != before[key]["nll"][k] for k in record["nll"] if "+" in k)


def test_another_min_per_head_recomputes_only_the_adaptive_rows(
    tiny, tmp_path, fake_corpora, work, monkeypatch
):
    """Adaptive answers are tied to min_per_head as learned ones are to the policy: the hash stays, records
    made before the field existed are the default's, and another value recomputes the adaptive rows
    alone, with caches built with it."""
    model, tokenizer = tiny
    config, fewer = adaptive_config(), adaptive_config(min_per_head=21)
    assert config.fingerprint(None).config == fewer.fingerprint(None).config
    before = run(model, tokenizer, config, tmp_path)
    for shard in sample_shards(tmp_path):  # as written before the field existed
        records = [json.loads(line) for line in shard.read_text().splitlines()]
        assert {r["min_per_head"] for r in records} == {f"protected+{MIN_EXTRA_PER_HEAD}"}
        shard.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "min_per_head"}) + "\n"
                                 for r in records))  # fmt: skip
    records = latest_records(tmp_path)
    assert benchmark_result(config, tmp_path, config.fingerprint(None), {})["rows"] == before["rows"]
    with monkeypatch.context() as patch:  # another default minimum is another minimum
        patch.setattr(benchmark_config, "MIN_EXTRA_PER_HEAD", MIN_EXTRA_PER_HEAD + 1)
        pending = benchmark_result(config, tmp_path, config.fingerprint(None), {})["pending"]
        assert [(p["done"], p["missing"]) for p in pending] == [(0, [ORACLE + "+head", "snapkv+head"])] * 2
    pending = benchmark_result(fewer, tmp_path, fewer.fingerprint(None), {})["pending"]
    assert [(p["done"], p["missing"]) for p in pending] == [(0, [ORACLE + "+head", "snapkv+head"])] * 2
    built, from_prefill = [], KVPCache.from_prefill

    def spy(prefilled, model, **options):
        built.append((options.get("allocation", "uniform"), options.get("min_per_head")))
        return from_prefill(prefilled, model, **options)

    monkeypatch.setattr(KVPCache, "from_prefill", spy)
    work.clear()
    result = run(model, tokenizer, fewer, tmp_path)
    # One prefill per sample (2 needle, 2 text), no KV bytes (the total entries are the same);
    # snapkv's and the oracle's adaptive caches only, each built with the new minimum.
    assert work == Counter({"prefill": 4, "snapkv": 4, ORACLE: 4, "continuation_nll": 2 * 2 * 2})
    assert built == [("head", 21)] * (2 + 2) * 2 * 2
    after = latest_records(tmp_path)
    for key, record in after.items():
        assert record["min_per_head"] == 21
        for name in ("predictions", "scores", "nll"):
            if name in record:
                assert {k: v for k, v in record[name].items() if "+" not in k} == {
                    k: v for k, v in records[key][name].items() if "+" not in k
                }
    assert any(
        r["nll"][k] != records[key]["nll"][k] for key, r in after.items() if "nll" in r for k in r["nll"]
    )
    assert [r for r in result["rows"] if "+" not in r["method"]] == [
        r for r in before["rows"] if "+" not in r["method"]
    ]
    # Back to the default: the adaptive rows are recomputed, to the first run's.
    built.clear()
    assert run(model, tokenizer, config, tmp_path)["rows"] == before["rows"]
    assert set(built) == {("head", None)}
    with pytest.raises(ValueError, match="min_per_head"):
        adaptive_config(min_per_head=0)
    with pytest.raises(ValueError, match="min_per_head"):
        adaptive_config(budgets=[16], min_per_head=21)


def test_oracle_scores_are_comparable_across_heads():
    importance = {0: torch.tensor([[0.5, 0.1, 0.0, 0.3], [0.2, 0.0, 0.9, 0.1]])}
    oracle = OracleScorer(importance)
    assert OracleScorer.comparable_across_heads and not uniform_only([ORACLE, "snapkv"], ["head"])
    keys = torch.zeros(2, 2, 4, 8)
    scores = oracle.score(keys, keys, torch.arange(4).expand(2, -1), layer_idx=0)
    valid = torch.ones(2, 2, 4, dtype=torch.bool)
    valid[1, :, 3] = False
    shared = oracle.cross_head_scores(scores, valid, 0)
    assert shared.dtype == torch.float32 and shared.shape == (2, 2, 4)
    assert torch.equal(shared[0], importance[0]) and torch.equal(shared[1, :, :3], importance[0][:, :3])
    assert bool((shared[1, :, 3] == float("-inf")).all())
    assert uniform_only(["knorm", "snapkv", "streaming_llm"], ["uniform", "head"]) == [
        "knorm",
        "streaming_llm",
    ]
    assert uniform_only(["knorm"], ["uniform"]) == []


@pytest.mark.parametrize("path", ["eval/results/smollm2", "eval/results/gemma3-270m"])
def test_canonical_benchmarks_regenerate_their_reports(path):
    """Each canonical benchmark.json, with or without adaptive rows, regenerates its committed report
    (the headline links the KV-bytes plot exactly when one was drawn)."""
    folder = Path(__file__).resolve().parents[1] / path
    result = json.loads((folder / "benchmark.json").read_text())
    plot = KV_PLOT if (folder / KV_PLOT).exists() else None
    assert report_markdown(result) == (folder / "benchmark.md").read_text()
    assert headline(result, plot) == (folder / "headline.md").read_text()


def test_compare_pairs_two_policies_sample_by_sample(tiny, tmp_path, fake_corpora, capsys):
    """Text windows start with a BOS, as Gemma 3's do: compare reads the records of that placement."""

    model, tokenizer = tiny[0], WithBos(tiny[1])
    options = dict(screened_tasks=[], protocols=["question_in"], corpora=["chitchat", "kjv"], samples={256: 2},
                   text_windows={96: 3}, methods=["knorm", "kvp"], policy="tiny")  # fmt: skip
    runs = {}
    for name, seed, config in (("a", 1, small_config(**options)), ("b", 2, small_config(**options)),
                               ("other", 2, small_config(**options, seed=1))):  # fmt: skip
        policy = saved_policy(model, seed, tmp_path / f"policy-{name}")
        out = tmp_path / name
        bench = Benchmark(model, tokenizer, config, out, policy)
        bench.run()
        header = provenance("tiny", torch.float32, "cpu", policy=policy)
        result = benchmark_result(config, out, bench.fingerprint, header)
        (out / "benchmark.json").write_text(json.dumps(result))
        runs[name] = result
    rows = compare(Run.load(tmp_path / "a"), Run.load(tmp_path / "b"))
    assert {r["row"] for r in rows} == {"kvp@0.25", "kvp@0.5"}
    by_cell = {(r["protocol"], r["name"], r["row"]): r for r in rows}
    for name in ("chitchat", "kjv", ALL):
        for budget in (0.25, 0.5):
            row = by_cell[PERPLEXITY, name, f"kvp@{budget}"]
            # Each side's mean is its own benchmark row; the difference is paired, sample by sample.
            for side, result in (("new", runs["a"]), ("base", runs["b"])):
                (own,) = [r for r in result["rows"] if r["protocol"] == PERPLEXITY and r["corpus"] == name
                          and r["method"] == "kvp" and r["budget"] == budget]  # fmt: skip
                assert row[side] == pytest.approx(own["score"]) and row["n"] == own["n"]
            assert row["difference"] == pytest.approx(row["new"] - row["base"])
            assert row["beyond"] == (row["new"] > row["base_ci95"][1])
    needle = by_cell["question_in", ALL, "kvp@0.5"]
    assert needle["metric"] == "accuracy" and needle["n"] == 4
    itself = compare(Run.load(tmp_path / "a"), Run.load(tmp_path / "a"))
    assert all(r["difference"] == 0 and not r["beyond"] for r in itself)
    with pytest.raises(ValueError, match="different samples"):
        compare(Run.load(tmp_path / "a"), Run.load(tmp_path / "other"))
    assert Run.load(tmp_path / "a").fingerprint.text_windows == realtext.WINDOWS + "+bos"
    older = json.loads((tmp_path / "b" / "benchmark.json").read_text())
    del older["text_windows"]  # written before results recorded the placement: windows without a BOS
    (tmp_path / "b" / "benchmark.json").write_text(json.dumps(older))
    with pytest.raises(ValueError, match="read real-text windows differently"):
        compare(Run.load(tmp_path / "a"), Run.load(tmp_path / "b"))
    (tmp_path / "b" / "benchmark.json").write_text(json.dumps(runs["b"]))
    with pytest.raises(FileNotFoundError, match="python -m eval benchmark"):
        Run.load(tmp_path)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")]) == 0
    written = json.loads((tmp_path / "cmp.json").read_text())
    assert written["rows"] == json.loads(json.dumps(rows))
    assert written["new"]["policy"]["sha256"] != written["base"]["policy"]["sha256"]
    report = (tmp_path / "cmp.md").read_text()
    assert "| perplexity | all | 96 | kvp@0.5 |" in report
    assert f"**{sum(r['beyond'] for r in rows)} of {len(rows)} rows beyond.**" in report


def test_compare_pairs_decode_rows_ranked_otherwise(tiny, tmp_path, fake_corpora):
    """A run with ``kvp_age_decay`` (or ``kvp_rescore``) names its decode records ``<sha256>+...``;
    compare reads each side's records under its own ranking, so the same policy pairs with itself."""
    model, tokenizer = tiny
    policy = saved_policy(model, 0, tmp_path / "policy")
    options = dict(methods=["kvp", "knorm"], policy="tiny")
    for name, ranking in (("plain", {}), ("aged", {"kvp_age_decay": 4.0})):
        config = decode_config(**options, **ranking)
        bench = Benchmark(model, tokenizer, config, tmp_path / name, policy)
        bench.run()
        header = provenance("tiny", torch.float32, "cpu", policy=policy)
        result = benchmark_result(bench.config, tmp_path / name, bench.fingerprint, header)
        (tmp_path / name / "benchmark.json").write_text(json.dumps(result))
    rows = compare(Run.load(tmp_path / "aged"), Run.load(tmp_path / "plain"))
    pooled = {r["row"]: r for r in rows if r["name"] == ALL}
    assert set(pooled) == {"kvp@10", "kvp@0.25", "kvp@64"} and {r["n"] for r in pooled.values()} == {4}
    assert any(r["difference"] != 0 for r in pooled.values())  # the decay kept other entries


@pytest.mark.parametrize(
    "ranking, suffix",
    [
        ({"kvp_rescore": True}, RESCORED),
        ({"kvp_age_decay": 0.5}, "+age_decay=0.5"),
        ({"kvp_rescore": True, "kvp_age_decay": 2.0}, RESCORED + "+age_decay=2"),
    ],
)
def test_kvp_rescore_or_age_decay_recomputes_only_the_learned_decode_answers(
    ranking, suffix, tiny, tmp_path, fake_corpora, work
):
    """``kvp_rescore`` and ``kvp_age_decay`` pass ``rescore=True`` / ``age_decay`` to the learned rows;
    only the capped protocols' records name them with the policy, so there the learned answers of a
    run without them are recomputed and the baselines' reused, while the prefill protocols (one
    eviction: the same answers) are reused whole."""
    model, tokenizer = tiny
    policy = saved_policy(model, 0, tmp_path / "policy")
    options = dict(methods=["kvp", "knorm"], policy="tiny", text_contexts=[64], text_windows={64: 2})
    plain = run(model, tokenizer, decode_config(**options), tmp_path, policy)
    work.clear()
    rescored = run(model, tokenizer, decode_config(**options, **ranking), tmp_path, policy)
    assert work["continuation_nll"] == 2 * 2 * 3  # 2 corpora x 2 windows x 3 caps, kvp's decode rows only
    named = {shard.split("/")[1]: r["policy"] for (shard, _), r in latest_records(tmp_path).items()}
    assert named == {DECODE: policy.weights_sha256 + suffix, PERPLEXITY: policy.weights_sha256}
    nll = {(r["protocol"], r["corpus"], r["method"], r["budget"]): r["nll"] for r in plain["rows"]}
    changed = {
        (r["protocol"], r["method"])
        for r in rescored["rows"]
        if r["nll"] != nll[r["protocol"], r["corpus"], r["method"], r["budget"]]
    }
    assert changed == {(DECODE, "kvp")}


def test_the_policys_own_age_decay_names_the_capped_records(tiny, tmp_path, fake_corpora, work):
    """Without ``kvp_age_decay`` the learned rows rank with the policy's own decay, and the records and
    the recorded config name the value used: giving it explicitly reads the same records."""
    model, tokenizer = tiny
    tiny_policy(model, seed=0, age_decay=0.5).save_pretrained(tmp_path / "policy")
    policy = load_policy(tmp_path / "policy")
    options = dict(methods=["kvp"], policy="tiny")
    result = run(model, tokenizer, decode_config(**options), tmp_path / "out", policy)
    assert result["config"]["kvp_age_decay"] == 0.5
    named = {r["policy"] for r in latest_records(tmp_path / "out").values()}
    assert named == {policy.weights_sha256 + "+age_decay=0.5"}
    work.clear()
    run(model, tokenizer, decode_config(**options, kvp_age_decay=0.5), tmp_path / "out", policy)
    assert work["continuation_nll"] == 0
    # A benchmark.json written before the policy-level default ran without a decay.
    recorded = {k: v for k, v in result["config"].items() if k != "kvp_age_decay"}
    assert BenchmarkConfig.from_record(recorded).kvp_age_decay == 0.0


def test_window_results_average_every_number_pooled_and_per_source(tmp_path, capsys):
    rows = [
        {"window": "a/0", "source": "a", "kvp": 0.1, "snapkv": 0.4},
        {"window": "a/1", "source": "a", "kvp": 0.3, "snapkv": 0.2},
        {"window": "b/0", "source": "b", "kvp": 0.5, "snapkv": 0.0},
    ]
    write_window_results(tmp_path / "r.json", {"command": "c"}, {"cap": 256}, rows)
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["provenance"] == {"command": "c"} and written["settings"] == {"cap": 256}
    assert written["mean"] == pytest.approx({"kvp": 0.3, "snapkv": 0.2})
    assert written["by_source"]["a"] == pytest.approx({"kvp": 0.2, "snapkv": 0.3})
    assert written["by_source"]["b"] == pytest.approx({"kvp": 0.5, "snapkv": 0.0})
    assert written["rows"] == rows and '"kvp": 0.3' in capsys.readouterr().out
