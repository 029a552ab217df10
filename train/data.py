"""Where collection prompts come from: synthetic RULER tasks, plain text, JSONL or a HF dataset.

Every source yields :class:`Example` objects: the prompt token ids (the cache the policy will rank)
and, for plain text, the true continuation. Synthetic prompts have no continuation; ``collect``
lets the model answer them greedily, as the paper does. ``split_examples`` keeps a held-out split,
chosen per sample with a seeded permutation.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Example:
    """One collection prompt.

    uid: stable name, e.g. ``"niah_single_1/3"`` or ``"text/17"``.
    source: the task name for synthetic prompts, ``"text"`` for plain text.
    prompt_ids: the tokens whose cache entries get ranked.
    future_ids: the continuation whose queries define importance; None = the model's greedy answer.
    info: small JSON-able facts kept in the shard metadata (answers, file name).
    """

    uid: str
    source: str
    prompt_ids: list[int]
    future_ids: list[int] | None = None
    info: dict = field(default_factory=dict)


def synthetic_examples(
    tokenizer,
    n: int,
    context_tokens: int,
    seed: int,
    essays_dir: str | Path | None,
    tasks: list[str] | None = None,
) -> list[Example]:
    """``n`` RULER-style prompts spread round-robin over ``tasks`` (default: all of ``ruler.TASKS``).

    The question is inside the prompt (``question_in_context=True``), so the ranked cache is the
    whole chat prompt, and the model's answer supplies the future queries.
    """
    from kvp_cache import ruler

    tasks = list(tasks or ruler.TASKS)
    unknown = sorted(set(tasks) - set(ruler.TASKS))
    if unknown:
        raise ValueError(f"unknown synthetic task(s) {unknown}; available: {', '.join(ruler.TASKS)}")
    if n <= 0:
        return []
    haystack = ruler.load_haystack(essays_dir)
    per_task = [n // len(tasks) + (i < n % len(tasks)) for i in range(len(tasks))]
    examples = []
    for task_index, (task, count) in enumerate(zip(tasks, per_task, strict=True)):
        if count == 0:
            continue
        samples = ruler.make_samples(
            task, tokenizer, context_tokens, count, seed + 1000 * task_index, haystack
        )
        for i, sample in enumerate(samples):
            prefix, suffix = ruler.chat_prompt(sample, tokenizer, question_in_context=True)
            ids = tokenizer(prefix + suffix, add_special_tokens=False)["input_ids"]
            info = {"answers": list(sample.answers)}
            examples.append(Example(f"{task}/{i}", task, ids, None, info))
    return examples


def read_text_files(paths: Iterable[str | Path], jsonl_field: str = "text") -> list[str]:
    """Documents from ``.txt``/``.md`` files (one document each), directories of them, and ``.jsonl``
    files (one document per line, from ``jsonl_field``)."""
    documents = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            documents += read_text_files(
                sorted(p for p in path.iterdir() if p.suffix in {".txt", ".md", ".jsonl"})
            )
        elif path.suffix == ".jsonl":
            with path.open() as handle:
                for line_no, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if jsonl_field not in record:
                        raise ValueError(f"{path}:{line_no} has no field {jsonl_field!r} (set --jsonl-field)")
                    documents.append(str(record[jsonl_field]))
        elif path.is_file():
            documents.append(path.read_text(errors="replace"))
        else:
            raise FileNotFoundError(f"--text-files: {path} does not exist")
    return [d for d in documents if d.strip()]


def hf_dataset_texts(
    name: str, split: str = "train", text_field: str = "text", limit: int = 10_000
) -> list[str]:
    """Documents from a Hugging Face dataset (needs network or a local HF datasets cache)."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError("--hf-dataset needs the 'datasets' package: pip install datasets") from error
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as error:  # offline, unknown name, gated: all surface as different exception types
        raise RuntimeError(
            f"could not load Hugging Face dataset {name!r} (split {split!r}): {error}. "
            "It needs network access or a local datasets cache; use --text-files for local data."
        ) from error
    if text_field not in dataset.column_names:
        raise ValueError(f"dataset {name!r} has no column {text_field!r}; columns: {dataset.column_names}")
    return [str(t) for t in dataset.select(range(min(limit, len(dataset))))[text_field] if str(t).strip()]


def text_examples(
    tokenizer,
    documents: list[str],
    n: int,
    context_tokens: int,
    future_tokens: int,
    seed: int,
    prefix: str = "text",
) -> list[Example]:
    """``n`` windows cut at random places from the documents, joined by EOS into one token stream.

    Each window is ``context_tokens`` of prompt followed by its true ``future_tokens`` continuation.
    """
    if n <= 0:
        return []
    if not documents:
        raise ValueError("no text documents to cut windows from")
    rng = random.Random(seed)
    order = list(range(len(documents)))
    rng.shuffle(order)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for i in order:
        stream += tokenizer(documents[i], add_special_tokens=False)["input_ids"] + eos
    length = context_tokens + future_tokens
    if len(stream) < length:
        raise ValueError(
            f"the text has {len(stream)} tokens, fewer than context_tokens + future_tokens = {length}; "
            "add documents or shorten the prompts"
        )
    examples = []
    for i in range(n):
        start = rng.randrange(0, len(stream) - length + 1)
        window = stream[start : start + length]
        examples.append(Example(f"{prefix}/{i}", prefix, window[:context_tokens], window[context_tokens:]))
    return examples


def split_examples(examples: list[Example], val_fraction: float, seed: int) -> dict[str, list[Example]]:
    """Seeded per-sample split into ``{"train": [...], "val": [...]}`` (order within a split kept)."""
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction must be in [0, 1], got {val_fraction}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_val = math.ceil(val_fraction * len(examples)) if val_fraction > 0 else 0
    val = set(order[:n_val])
    return {
        "train": [e for i, e in enumerate(examples) if i not in val],
        "val": [e for i, e in enumerate(examples) if i in val],
    }


def interleave(*groups: list[Example]) -> Iterator[Example]:
    """Alternate between sources so every shard mixes them."""
    longest = max((len(g) for g in groups), default=0)
    for i in range(longest):
        for group in groups:
            if i < len(group):
                yield group[i]
