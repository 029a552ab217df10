"""``python -m eval benchmark``: the canonical report, ``eval/results/<model>/benchmark.json``.

Five protocols, every method at every budget (cap), plus the full cache and the oracle (:mod:`eval.oracle`):

- ``question_in``: a RULER-style needle prompt is compressed whole, question included (the paper's);
- ``question_after``: the context is compressed, then the question is asked on the compressed cache;
- ``perplexity``: a held-out real-text prefix (:mod:`eval.corpora`) is compressed and the next
  ``continuation_tokens`` tokens are scored (:mod:`eval.realtext`);
- ``decode``: a held-out real-text prompt, then ``decode_tokens`` teacher-forced tokens, all read
  through a cache capped at ``max_cache_tokens`` (each of ``decode_caps``) in chunks of
  ``decode_chunk_tokens``, the cache evicting between chunks as while decoding; the NLL of the
  read tokens is scored. Methods that cannot rank decoded tokens (``scores_decoded_tokens``) sit
  it out; its oracle is :class:`eval.oracle.CappedOracleScorer`.
- ``decode_recall`` (:mod:`eval.recall`): a needle context (question left out), then
  ``recall_filler_tokens`` of held-out prose read through a cache capped at each of ``recall_caps``
  as in ``decode``, then the question, answered greedily on that cache; needle accuracy, against
  the uncapped cache's. The methods of ``decode`` run, without an oracle.

Needle samples come from the ``test`` split of :mod:`kvp_cache.ruler`, so none of them, nor their
needles, depths or haystack windows, was seen in training. Besides the ``niah_*`` tasks, every other
task whose full-cache accuracy reaches ``min_full_score`` (screened on its own samples) is
benchmarked; the rest are listed as excluded with their full-cache scores.

Allocations (``allocations``): every method whose scores are comparable across heads
(``Scorer.comparable_across_heads``, the oracle's too) gets a row per allocation, named
``<method>+<allocation>`` (``kvp+head``) beside its uniform row ``<method>``; the other methods get
their uniform row only; every KV head of an adaptive row keeps at least ``min_per_head`` entries.
The capped protocols (``decode``, ``decode_recall``) stay uniform. Real-text rows carry the KV bytes
of their cache and its share of the full cache's (measured once per prefix length,
:meth:`Benchmark.measure_kv_bytes`), and each adaptive row its paired NLL gain over the uniform row
of its method.

Every sample is prefilled ONCE; every (method, budget) is compressed from that prefill
(``KVPCache.from_prefill``) and all uniform methods of one budget decode together as one batch
(an adaptive cache keeps different entries per head, so it decodes on its own). Each
finished sample is appended to a per-cell JSONL shard under ``<out>/shards``, so an interrupted run
resumes where it stopped. A record holds one answer per (method, budget) and names the policy of its
learned answers, so a new method, budget or policy tops records up (:meth:`Benchmark.run`) instead
of recomputing them; ``benchmark.json`` holds one flat row per cell, built from the shards
(:func:`~eval.benchmark_rows.collect_rows`), under the provenance of the run.

The parts live beside it: the configuration, row names and fingerprint in :mod:`eval.benchmark_config`,
the resumable shard records in :mod:`eval.shards`, the rows of ``benchmark.json`` in
:mod:`eval.benchmark_rows`, the caches and scorers built per prefill in :mod:`eval.benchmark_caches`.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from eval import realtext
from eval.benchmark_caches import AllocatedDecoder, scored_once
from eval.benchmark_config import (
    DECODE,
    KV_BYTES,
    PERPLEXITY,
    TEMPLATE_TOKENS,
    UNIFORM,
    BenchmarkConfig,
    Fingerprint,
    split_row,
)
from eval.benchmark_rows import collect_rows
from eval.corpora import corpus
from eval.oracle import ORACLE, capped_oracle_scorer, future_states, oracle_scorer
from eval.recall import recall_cell
from eval.shards import Cell, Shard, method_key, missing_rows, shard, topped_up
from eval.sweep import FULL, MAX_NEW_TOKENS, encode_prompt
from kvp_cache import KVPCache, ruler
from kvp_cache.allocation import MODES
from kvp_cache.budget import Budget
from kvp_cache.cache import cache_bytes
from kvp_cache.prefill import prefill
from kvp_cache.provenance import portable_config
from kvp_cache.scorers import Scorer, make_scorer, methods
from kvp_cache.targets import eviction_points


class Benchmark:
    """Runs the cells of a :class:`~eval.benchmark_config.BenchmarkConfig` into shards under
    ``out / "shards"``."""

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
        self.config = config = config.for_policy(policy)
        self.out = Path(out)
        self.device = next(model.parameters()).device
        self.decoders = {
            allocation: AllocatedDecoder(
                model,
                tokenizer,
                config.sink_tokens,
                config.window_tokens,
                policy,
                # Explicit: records name both (Fingerprint.for_protocol).
                learned_options={"rescore": config.kvp_rescore, "age_decay": config.kvp_age_decay},
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
        self.fingerprint = config.fingerprint(sha256, calibration_sha256, realtext.placement(tokenizer))
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
        if self.config.recall_caps:
            cells += [recall_cell(self, task) for task in self.config.recall_tasks]
        for cell in cells:
            cell.shard.upgrade()
        work = [
            (cell, index, rows)
            for index in range(max((cell.count for cell in cells), default=0))
            for cell in cells
            if index < cell.count
            and (rows := missing_rows(cell.grid, cell.shard.fingerprint, cell.records.get(index)))
        ]
        top_ups = sum(index in cell.records for cell, index, _ in work)
        for cell, index, rows in tqdm(work, desc=f"benchmark ({top_ups} top-ups)", unit="sample"):
            start, cpu_start = time.perf_counter(), time.process_time()
            new = cell.compute(index, rows)
            new.update(seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu_start)
            cell.records[index] = topped_up(cell.records.get(index), new, cell.shard.fingerprint)
            cell.shard.append({"index": index, **cell.records[index]})
        for context in self.config.text_contexts if self.config.corpora else []:
            self.measure_kv_bytes(context)

    def measure_kv_bytes(self, context: int) -> None:
        """The bytes each real-text row's cache holds (``KVPCache.kv_bytes``) and the full cache's, at
        prefix length ``context``, into the shard ``kv_bytes/<context>``.

        They depend on the prefix length, the budget and the allocation (adaptive caches keep the
        same total entries as uniform ones, whatever their minimum per head), never on the text, so
        the first window of the first corpus measures them, once per row: one prefill, then each
        missing row compressed.
        """
        sizes = self.shard(KV_BYTES, context)
        held = sizes.records().get(0, {}).get(KV_BYTES, {})
        rows = [(m, b) for m, b in self.config.grid() if method_key(m, b) not in held]
        if not rows:
            return
        name = self.config.corpora[0]
        length = context + self.config.continuation_tokens
        window = realtext.corpus_windows(name, self.tokenizer, length, 1)[0].to(self.device)
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
            {
                "index": 0,
                "corpus": name,
                "windows": self.fingerprint.text_windows,
                KV_BYTES: {**held, **measured},
            }
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
        count = self.config.text_windows[context]
        windows = realtext.corpus_windows(
            name, self.tokenizer, context + self.config.continuation_tokens, count
        )

        @torch.no_grad()
        def compute(index: int, rows: list[tuple[str, Budget | None]]) -> dict:
            window = windows[index].to(self.device)
            prefix, continuation = window[:, :context], window[:, context:]
            prefilled = self.prefill(prefix)

            def nll(cache) -> list[float]:
                return realtext.continuation_nll(self.model, prefilled, cache, continuation).tolist()

            return {
                "windows": self.fingerprint.text_windows,
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
        length = prompt_tokens + config.decode_tokens
        windows = realtext.corpus_windows(name, self.tokenizer, length, config.decode_windows)
        fields = config.decode_fields(self.fingerprint.text_windows)
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
                tokens = config.cap_tokens(cap)
                if method != ORACLE:
                    answers[method_key(method, cap)] = nll(self.capped_cache(prefilled, method, tokens))
                    continue
                states = states or future_states(self.model, prefilled, ids(continuation[:, :-1]))
                oracle = capped_oracle_scorer(
                    states,
                    eviction_points(forwards, tokens, config.evict_every),
                    config.sink_tokens,
                    config.window_tokens,
                    config.oracle_horizon,
                )
                cache = self.capped_cache(prefilled, oracle, tokens, track_positions=True)
                oracle.bind(cache)
                answers[method_key(method, cap)] = nll(cache)
            return {**fields, "nll": answers}

        return Cell(self.shard(DECODE, name, prompt_tokens, fields=fields), config.decode_windows, compute,
                    config.decode_grid())  # fmt: skip

    def capped_cache(self, prefilled, method: str | Scorer, tokens: int, **options) -> KVPCache:
        """A cache of the prefill under ``max_cache_tokens=tokens`` (budget 1.0: only the cap evicts),
        evicting ``evict_every`` tokens past it; ``options``: more ``KVPCache`` options."""
        return KVPCache.from_prefill(
            prefilled,
            self.model,
            **self.decoder.cache_options(method, 1.0),
            **options,
            max_cache_tokens=tokens,
            evict_every=self.config.evict_every,
        )

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


def ids(tokens: torch.Tensor) -> list[int]:
    """The token ids of a batch-1 ``[1, n]`` tensor."""
    return tokens[0].tolist()


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
        "text_windows": fingerprint.text_windows,
        **collected,
    }
