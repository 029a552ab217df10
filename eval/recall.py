"""The benchmark's ``decode_recall`` protocol (issue 29): does a needle survive a long read under a cap?

Per needle sample (each of ``recall_tasks``, from the ``test`` split of :mod:`kvp_cache.ruler` like the
other needle cells), the needle context without its question (the ``question_after`` prompt's prefix,
sized for ``recall_context_tokens``) is prefilled once. Each (method, cap) gets a capped cache of that
prefill (``KVPCache.from_prefill``, budget 1.0 so only the cap evicts, ``max_cache_tokens`` the cap),
which reads ``recall_filler_tokens`` tokens of held-out prose
(:data:`~eval.benchmark_config.RECALL_CORPUS`; sample ``i`` of every task reads window ``i`` of
:func:`eval.realtext.windows`) in chunks of ``decode_chunk_tokens``, evicting between them as while
decoding. Then the question is asked and the answer decoded greedily on the same cache, which keeps
evicting on its schedule, and scored with the needle metric (:func:`kvp_cache.ruler.score`). The
uncapped cache (``full``) reads the same tokens the same way; the report gives every method's accuracy
as a share of its accuracy.

Every method that ranks decoded tokens runs (:meth:`~eval.benchmark_config.BenchmarkConfig.capped_methods`).
No oracle row: the capped oracle (:class:`~eval.oracle.CappedOracleScorer`) ranks each eviction by
the queries that follow it, known in advance for teacher-forced text, but here they include the
model's own answer, whose tokens and length (so the answer's eviction points) exist only once decoded.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from eval import realtext
from eval.benchmark_config import DECODE_RECALL, RECALL_CORPUS
from eval.shards import Cell, method_key
from eval.sweep import FULL, MAX_NEW_TOKENS, Prompt, encode_prompt
from kvp_cache import ruler
from kvp_cache.budget import Budget
from kvp_cache.integrations import forward_tokens

if TYPE_CHECKING:
    from eval.benchmark import Benchmark


def read_in_chunks(model, cache, tokens: torch.Tensor, chunk_tokens: int) -> None:
    """Append ``tokens`` (``[1, n]``) to ``cache``, ``chunk_tokens`` per forward, so a capped cache
    evicts between chunks as while decoding."""
    for start in range(0, tokens.shape[1], chunk_tokens):
        forward_tokens(model, cache, tokens[:, start : start + chunk_tokens], logits_to_keep=1)


def recall_cell(bench: Benchmark, task: str) -> Cell:
    """The ``decode_recall`` cell of needle ``task`` (shard ``decode_recall/<task>/<context>``)."""
    config = bench.config
    context = config.recall_context_tokens
    samples = bench.samples(task, context, config.recall_samples)
    stream = realtext.corpus_tokens(RECALL_CORPUS, bench.tokenizer)
    fillers = realtext.windows(stream, config.recall_filler_tokens, config.recall_samples)
    fields = config.recall_fields()
    decoder, tokens = bench.decoder, MAX_NEW_TOKENS[task]

    @torch.no_grad()
    def compute(index: int, rows: list[tuple[str, Budget | None]]) -> dict:
        sample = samples[index]
        prompt = encode_prompt(sample, bench.tokenizer, True, bench.device)
        filler = fillers[index].to(bench.device)
        prefilled = bench.prefill(prompt.prefix)
        # What the cache has read when the question comes: the needle context, then the filler.
        read = Prompt(torch.cat([prompt.prefix, filler], -1), prompt.suffix)

        def answer(cache) -> str:
            read_in_chunks(bench.model, cache, filler, config.decode_chunk_tokens)
            return decoder.decode(decoder.after_suffix(cache, read, tokens)[0])

        predictions = {FULL: answer(copy.deepcopy(prefilled.cache))} if (FULL, None) in rows else {}
        capped = [(method, cap) for method, cap in rows if method != FULL]
        for method, cap in tqdm(capped, desc=f"{DECODE_RECALL} {task} {index}", unit="cache", leave=False):
            cache = bench.capped_cache(prefilled, method, config.cap_tokens(cap, DECODE_RECALL))
            predictions[method_key(method, cap)] = answer(cache)
        return {
            **fields,
            "prompt_tokens": read.full.shape[1],
            "answers": sample.answers,
            "predictions": predictions,
            "scores": {key: ruler.score(sample, text) for key, text in predictions.items()},
        }

    shard = bench.shard(DECODE_RECALL, task, context, fields=fields)
    return Cell(shard, len(samples), compute, config.recall_grid())
