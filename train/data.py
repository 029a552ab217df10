"""Collection prompts: synthetic RULER tasks, windows of real text (``train/corpora.py``), JSONL
or a HF dataset.

Every source yields :class:`Example` objects: the prompt token ids (the cache the policy will rank)
and the future whose queries define importance: for text the true continuation, for tasks the gold
answer teacher-forced after the answer prefix (or the model's greedy answer, the paper's choice),
preceded by the question for question-after traces. Lengths are drawn log-uniformly from a range.
``split_examples`` keeps a held-out split, chosen per sample with a seeded permutation.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from eval.corpora import refuse_held_out
from kvp_cache import ruler
from kvp_cache.models import leading_special_ids, prompt_for


@dataclass
class Example:
    """One collection prompt and the future that defines its tokens' importance.

    uid: stable name, e.g. ``"niah_single/3"`` or ``"code/17"``.
    source: the task name for synthetic prompts (``<task>-after`` for question-after ones), else
        the corpus name.
    prompt_ids: the tokens whose cache entries get ranked.
    question_ids: tokens fed after the prompt, before the answer (the question of a question-after
        trace: compress, then ask); they are future queries.
    future_ids: the answer or continuation whose queries (with ``question_ids``) define importance;
        None = the model's greedy answer.
    sample: the RULER sample, so ``collect`` can check that the full cache answers it.
    info: small JSON-able facts kept in the shard metadata (answers, corpus).
    held_out: fixed by the documents the example was cut from (:func:`is_held_out_document`);
        None lets :func:`split_examples` choose.
    """

    uid: str
    source: str
    prompt_ids: list[int]
    future_ids: list[int] | None = None
    question_ids: list[int] = field(default_factory=list)
    sample: ruler.Sample | None = None
    info: dict = field(default_factory=dict)
    held_out: bool | None = None


def log_uniform_length(rng: random.Random, low: int, high: int) -> int:
    """A length between ``low`` and ``high`` with a uniform logarithm (``low`` when they are equal)."""
    if not 1 <= low <= high:
        raise ValueError(f"lengths must satisfy 1 <= low <= high, got {low}..{high}")
    return low if low == high else round(math.exp(rng.uniform(math.log(low), math.log(high))))


def synthetic_examples(
    tokenizer,
    n: int,
    context_tokens: tuple[int, int],
    seed: int,
    essays_dir: str | Path | None,
    tasks: list[str] | None = None,
    question_after: bool = False,
    gold_future: bool = True,
    split: str = "train",
    chat: bool = True,
) -> list[Example]:
    """``n`` RULER-style prompts of ruler's ``split``, round-robin over ``tasks`` (default: all).

    Each prompt is about ``log_uniform_length(*context_tokens)`` tokens, in the chat template
    (``chat``, instruct models) or plain (base models), see :func:`kvp_cache.models.prompt_for`.
    With the question inside
    (``question_after=False``, the paper's protocol) the ranked cache is the whole prompt;
    with ``question_after=True`` it is the context alone and the question joins the future. The
    future answer is the gold one, teacher-forced (``gold_future``), or the model's greedy one.
    """
    tasks = list(tasks or ruler.TASKS)
    unknown = sorted(set(tasks) - set(ruler.TASKS))
    if unknown:
        raise ValueError(f"unknown synthetic task(s) {unknown}; available: {', '.join(ruler.TASKS)}")
    if n <= 0:
        return []
    haystack = ruler.load_haystack(essays_dir)
    rng = random.Random(f"synthetic/{seed}/{question_after}")
    kind = "-after" if question_after else ""
    examples = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        length = log_uniform_length(rng, *context_tokens)
        (sample,) = ruler.make_samples(task, tokenizer, length, 1, seed * 100_000 + i, haystack, split=split)
        prefix, suffix = prompt_for(sample, tokenizer, chat, question_in_context=not question_after)
        examples.append(
            Example(
                uid=f"{task}{kind}/{i}",
                source=f"{task}{kind}",
                prompt_ids=tokenizer(prefix, add_special_tokens=False)["input_ids"],
                future_ids=ruler.gold_answer_ids(sample, tokenizer) if gold_future else None,
                question_ids=tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else [],
                sample=sample,
                info={"answers": list(sample.answers)},
            )
        )
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
            refuse_held_out([path])
            with path.open() as handle:
                for line_no, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if jsonl_field not in record:
                        raise ValueError(f"{path}:{line_no} has no field {jsonl_field!r} (set --jsonl-field)")
                    documents.append(str(record[jsonl_field]))
        elif path.is_file():
            refuse_held_out([path])
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
    context_tokens: tuple[int, int],
    future_tokens: tuple[int, int],
    seed: int,
    prefix: str = "text",
    disjoint: bool = True,
) -> list[Example]:
    """``n`` windows cut at random places from the documents, joined by EOS into one token stream.

    Each window is a prompt of ``log_uniform_length(*context_tokens)`` tokens followed by its true
    continuation of a uniform ``future_tokens[0]..future_tokens[1]`` tokens. The prompt starts
    with the tokens the tokenizer puts before any text (Gemma's BOS; none for SmolLM2), as every
    prompt the model sees does.

    ``disjoint``: no two windows share a token, so a window held out for validation never
    overlaps one trained on. ``False`` rebuilds collections made before that (each window placed
    independently; with a small corpus most validation windows overlapped training ones).
    """
    if n <= 0:
        return []
    if not documents:
        raise ValueError("no text documents to cut windows from")
    rng = random.Random(seed)
    order = list(range(len(documents)))
    rng.shuffle(order)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    start_ids = leading_special_ids(tokenizer)
    stream: list[int] = []
    for i in order:
        stream += tokenizer(documents[i], add_special_tokens=False)["input_ids"] + eos
    longest = context_tokens[1] + future_tokens[1]
    if len(stream) < longest:
        raise ValueError(
            f"the text has {len(stream)} tokens, fewer than the longest window (context + future = {longest}); "
            "add documents or shorten the prompts"
        )
    windows = []  # (context, start, length)
    for _ in range(n):
        context = log_uniform_length(rng, *context_tokens)
        length = context + rng.randint(*future_tokens)
        start = None if disjoint else rng.randrange(0, len(stream) - length + 1)
        windows.append((context, start, length))
    if disjoint:
        spare = len(stream) - sum(length for _, _, length in windows)
        if spare < 0:
            raise ValueError(
                f"the text has {len(stream)} tokens, fewer than {n} disjoint windows need "
                f"({len(stream) - spare}); add documents, cut fewer windows or shorten them"
            )
        # The spare tokens fall into n + 1 random gaps around the windows, kept in stream order.
        gaps = sorted(rng.randint(0, spare) for _ in range(n))
        before = itertools.accumulate((length for _, _, length in windows), initial=0)  # n + 1 sums
        windows = [
            (c, gap + used, length) for gap, used, (c, _, length) in zip(gaps, before, windows, strict=False)
        ]
    examples = []
    for i, (context, start, length) in enumerate(windows):
        window = stream[start : start + length]
        examples.append(Example(f"{prefix}/{i}", prefix, start_ids + window[:context], window[context:]))
    return examples


def ids_digest(ids: list[int]) -> str:
    """sha256 of a token sequence: what a rebuilt sequence must match (every prompt has one length)."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def example_digest(example: Example) -> str:
    """:func:`ids_digest` of everything an example feeds the model: prompt, question and future."""
    return ids_digest(example.prompt_ids + example.question_ids + (example.future_ids or []))


def split_examples(examples: list[Example], val_fraction: float, seed: int) -> dict[str, list[Example]]:
    """Split into ``{"train": [...], "val": [...]}`` (order within a split kept).

    Examples whose side is fixed (``held_out``) keep it; of the others a seeded permutation holds
    out ``ceil(val_fraction * n)``.
    """
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction must be in [0, 1], got {val_fraction}")
    free = [i for i, e in enumerate(examples) if e.held_out is None]
    random.Random(seed).shuffle(free)
    n_val = math.ceil(val_fraction * len(free)) if val_fraction > 0 else 0
    val = set(free[:n_val]) | {i for i, e in enumerate(examples) if e.held_out}
    return {
        "train": [e for i, e in enumerate(examples) if i not in val],
        "val": [e for i, e in enumerate(examples) if i in val],
    }


def is_held_out_document(text: str, val_fraction: float) -> bool:
    """Whether a document is held out, by its text alone: the same answer in every collection, so
    no collection of any seed trains on a document another one validates on."""
    digest = hashlib.sha256(text.encode("utf-8", errors="replace")).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


def interleave(*groups: list[Example]) -> Iterator[Example]:
    """Alternate between sources so every shard mixes them."""
    longest = max((len(g) for g in groups), default=0)
    for i in range(longest):
        for group in groups:
            if i < len(group):
                yield group[i]
