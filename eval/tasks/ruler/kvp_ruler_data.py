"""Data for the ``kvp_ruler_*`` lm-eval tasks: offline RULER-style samples from :mod:`kvp_cache.ruler`.

lm-eval calls :func:`load` (the tasks' ``custom_dataset``) with the task metadata, which the CLI
fills with ``--model_args`` and ``--metadata``:

- ``tokenizer`` or ``pretrained`` (required: a registered offline name such as ``smollm2``, a
  directory or a Hub id): sizes the prompts and applies its chat template, so do not add
  ``--apply_chat_template``;
- ``max_seq_lengths`` (default ``[4096]``): one sample set per length; a sample's prompt is sized
  to ``length - max_gen_toks`` tokens so prompt and answer fit in ``length``, as RULER does;
- ``num_samples`` (default 500, RULER's), ``seed`` (default 0);
- ``essays_dir``: a folder of Paul Graham essays (``*.txt``) as haystack; default RULER's noise
  sentences (env ``KVP_ESSAYS_DIR`` also works).

Metrics are named after the lengths, as in lm-eval's ``ruler``: a doc scores under its own
length and reports -1 for the others, which :func:`aggregate` skips.
"""

from __future__ import annotations

import os

import datasets

from kvp_cache import ruler
from kvp_cache.models import load_tokenizer

# RULER's answer budgets (tokens_to_generate in its synthetic.yaml); the YAMLs use the same.
MAX_GEN_TOKS = {
    "niah_single": 128,
    "niah_multikey": 128,
    "niah_multivalue": 128,
    "niah_multiquery": 128,
    "vt": 30,
    "cwe": 120,
    "fwe": 50,
}
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def _tokenizer_name(kwargs: dict) -> str:
    for key in ("tokenizer", "pretrained"):
        value = kwargs.get(key)
        if isinstance(value, str) and value:
            return value
    raise ValueError(
        "kvp_ruler tasks build their prompts with the model's tokenizer: pass --model_args pretrained=<path> "
        'or --metadata \'{"tokenizer": "<path>"}\' (with a model object, TaskManager(metadata={"tokenizer": ...}))'
    )


def load(ruler_task: str, question_in_context: bool, **kwargs) -> datasets.DatasetDict:
    """The ``test`` split of ``ruler_task`` for every requested length.

    Rows: ``prefix`` (what gets compressed), ``suffix`` (asked after compression; empty when the
    question is in the context), ``answers``, ``max_length``, ``index``.
    """
    lengths = [int(n) for n in kwargs.get("max_seq_lengths", [4096])]
    unknown = sorted(set(lengths) - set(LENGTHS))
    if unknown:
        raise ValueError(f"max_seq_lengths {unknown} not supported; choose from {list(LENGTHS)}")
    num_samples = int(kwargs.get("num_samples", 500))
    seed = int(kwargs.get("seed", 0))
    tokenizer = load_tokenizer(_tokenizer_name(kwargs))
    haystack = ruler.load_haystack(kwargs.get("essays_dir") or os.environ.get("KVP_ESSAYS_DIR"))
    rows = []
    for length in lengths:
        samples = ruler.make_samples(
            ruler_task,
            tokenizer,
            length - MAX_GEN_TOKS[ruler_task],
            num_samples,
            seed=seed,
            haystack=haystack,
        )
        for index, sample in enumerate(samples):
            prefix, suffix = ruler.chat_prompt(sample, tokenizer, question_in_context=question_in_context)
            rows.append(
                {
                    "prefix": prefix,
                    "suffix": suffix,
                    "answers": sample.answers,
                    "max_length": length,
                    "index": index,
                }
            )
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """RULER's string match for the doc's length; -1 (skipped by :func:`aggregate`) for the others."""
    metrics = {str(length): -1.0 for length in LENGTHS}
    sample = ruler.Sample(task="", context="", question="", answers=list(doc["answers"]), answer_prefix="")
    metrics[str(doc["max_length"])] = ruler.score(sample, results[0].strip())
    return metrics


def aggregate(scores: list[float]) -> float:
    """Mean over the docs of one length; -1 when the run had none of that length."""
    kept = [s for s in scores if s != -1]
    return sum(kept) / len(kept) if kept else -1.0
