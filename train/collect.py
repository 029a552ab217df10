"""``python -m train collect``: run a model over prompts and store what training needs.

For every example the prompt is prefilled once into a ``DynamicCache``, whose post-RoPE keys and
values are exactly what an eviction cache would hold. When the future is the model's own answer, or
a RULER sample must be checked (``only_correct``: keep only samples the full cache answers), the
model then decodes greedily on a copy of the cache. Last, the future (question tokens, if asked
after, then the gold answer, the greedy answer or the true text continuation) runs over the cache
with query-capturing hooks on each traced attention module (:func:`kvp_cache.targets.captured_queries`).
Only the layers a ``KVPCache`` evicts are traced (:func:`kvp_cache.compat.evicting_layer_indices`:
every layer of SmolLM2, the 3 full-attention layers of Gemma 3 270M; the metadata lists them).
Per traced layer it stores the prompt's K/V and each prompt token's targets (:mod:`kvp_cache.targets`):
the future attention and its value-weighted twin, from the model's full causal softmax attention
over prompt + future. Future queries are processed in chunks, never as a full ``T x T`` matrix.

For held-out splits it also stores the score of every query-aware baseline computed from the
prompt's own queries, so ``evaluate`` can rank them without the model.

Collection resumes shard by shard: a finished shard (its ``meta.json`` written) is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from kvp_cache import ruler
from kvp_cache.capture import append_queries
from kvp_cache.compat import attention_shape, cache_kwarg, text_config
from kvp_cache.models import MODELS, load_model
from kvp_cache.scorers import make_scorer, methods
from kvp_cache.targets import attention_modules, captured_queries, future_attention, value_output_norms
from train import data
from train.corpora import CORPORA, Keep, documents, keep_all
from train.traces import shard_dir, shard_done, write_shard

TASK_FUTURES = ("gold", "greedy")
QUERY_SCORES = ("val", "all", "none")
# Characters of a corpus read per token a window needs; code and docs are far larger than needed.
CHARS_PER_TOKEN_READ = 8


@dataclass
class CollectConfig:
    """Everything ``collect`` needs; the CLI flags map one to one.

    context_tokens / future_tokens: ``(low, high)``; prompts are log-uniform, text continuations
    uniform in the range (``low == high``: fixed). windows: corpus name -> number of text windows.
    disjoint_windows, held_out_documents (no flags): ``False`` only to rebuild collections made
    before text windows were disjoint (``train.data.text_examples``), and before held-out windows
    came only from held-out documents (:func:`text_windows`).
    """

    out: str
    model: str = "smollm2"
    synthetic: int = 0
    synthetic_after: int = 0
    tasks: list[str] | None = None
    task_future: str = "gold"
    only_correct: bool = True
    ruler_split: str = "train"
    windows: dict[str, int] = field(default_factory=dict)
    essays_dir: str | None = None
    text_files: list[str] | None = None
    hf_dataset: str | None = None
    hf_split: str = "train"
    jsonl_field: str = "text"
    text_windows: int = 0
    context_tokens: tuple[int, int] = (1024, 1024)
    future_tokens: tuple[int, int] = (64, 64)
    max_new_tokens: int = 48
    val_fraction: float = 0.12
    train_name: str = "train"
    val_name: str = "val"
    query_scores: str = "val"
    shard_size: int = 8
    seed: int = 0
    disjoint_windows: bool = True
    held_out_documents: bool = True

    def validate(self) -> None:
        if self.task_future not in TASK_FUTURES:
            raise ValueError(f"task_future must be one of {TASK_FUTURES}, got {self.task_future!r}")
        if self.query_scores not in QUERY_SCORES:
            raise ValueError(f"query_scores must be one of {QUERY_SCORES}, got {self.query_scores!r}")
        unknown = sorted(set(self.windows) - set(CORPORA))
        if unknown:
            raise ValueError(f"windows: unknown corpus {unknown}; corpora: {sorted(CORPORA)}")
        for name in ("context_tokens", "future_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be 1 <= low <= high, got {low}..{high}")
        counts = {"synthetic": self.synthetic, "synthetic_after": self.synthetic_after}
        counts |= {"text_windows": self.text_windows, **{f"windows[{k}]": v for k, v in self.windows.items()}}
        for name, count in counts.items():
            if count < 0:
                raise ValueError(f"{name} must be >= 0, got {count}")
        if self.shard_size < 1 or self.max_new_tokens < 1:
            raise ValueError("shard_size and max_new_tokens must be >= 1")
        if self.held_out_documents and not self.disjoint_windows:
            raise ValueError("held_out_documents needs disjoint_windows (windows cut without overlap)")


def query_aware_methods() -> list[str]:
    """Baselines that need the prompt's queries (scored at collection time)."""
    return methods(query_aware=True, learned=False)


@torch.no_grad()
def greedy_continue(
    model,
    cache,
    logits: torch.Tensor,
    question_ids: list[int],
    max_new_tokens: int,
    done: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """The model's greedy answer after the cached prompt (then ``question_ids``).

    logits: ``[vocab]`` of the prompt's last position. Stops at EOS (kept), after
    ``max_new_tokens``, or as soon as ``done(tokens)`` holds. The cache grows: pass a copy.
    """
    keyword = cache_kwarg(model)
    device = logits.device
    if question_ids:
        out = model(
            input_ids=torch.tensor([question_ids], device=device),
            use_cache=True,
            logits_to_keep=1,
            **{keyword: cache},
        )
        logits = out.logits[0, -1]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    tokens: list[int] = []
    while True:
        tokens.append(int(logits.argmax()))
        if tokens[-1] in eos or len(tokens) == max_new_tokens or (done is not None and done(tokens)):
            return tokens
        out = model(
            input_ids=torch.tensor([tokens[-1:]], device=device),
            use_cache=True,
            logits_to_keep=1,
            **{keyword: cache},
        )
        logits = out.logits[0, -1]


@dataclass
class Trace:
    """One traced example: per traced layer ``{"keys", "values", "importance", "value_importance",
    "score.<m>"...}`` of shapes ``[kv_heads, n, d]`` / ``[kv_heads, n]`` (None when the full cache
    answered wrong and the example is skipped), the future's length and the greedy answer."""

    layers: list[dict[str, torch.Tensor]] | None
    future_tokens: int
    answer_ids: list[int] | None
    correct: bool | None


@torch.no_grad()
def trace_example(
    model,
    modules: list[torch.nn.Module],
    example: data.Example,
    methods: list[str],
    max_new_tokens: int = 48,
    tokenizer=None,
    only_correct: bool = True,
) -> Trace:
    """Prefill, optionally answer greedily and check, then run the future over the prompt's cache.

    Runs on the model's device; the trace's tensors come back on the CPU.
    """
    n = len(example.prompt_ids)
    device = next(model.parameters()).device
    cache = DynamicCache(config=text_config(model.config))
    keyword = cache_kwarg(model)
    prompt_queries = captured_queries(model, modules) if methods else contextlib.nullcontext({})
    with prompt_queries as prompt_store:
        out = model(
            input_ids=torch.tensor([example.prompt_ids], device=device),
            use_cache=True,
            logits_to_keep=1,
            **{keyword: cache},
        )
    answer_ids, correct = None, None
    check = only_correct and example.sample is not None
    if check and tokenizer is None:
        raise ValueError("checking RULER answers (only_correct) needs the tokenizer")

    def answered(ids: list[int]) -> bool:
        return ruler.score(example.sample, tokenizer.decode(ids)) == 1.0

    if example.future_ids is None or check:
        # A gold future needs only the verdict, so decoding stops once the answer is complete.
        stop = answered if check and example.future_ids is not None else None
        # On a copy: a sliding-window layer cannot be cropped back to the prompt once it has slid.
        answer_ids = greedy_continue(
            model, copy.deepcopy(cache), out.logits[0, -1], example.question_ids, max_new_tokens, stop
        )
        if check:
            correct = answered(answer_ids)
            if not correct:
                return Trace(None, 0, answer_ids, correct)
    future = example.question_ids + (example.future_ids if example.future_ids is not None else answer_ids)
    if not future:
        raise ValueError(f"example {example.uid} has no future token")
    base = model.base_model
    with captured_queries(model, modules) as future_store:
        base(input_ids=torch.tensor([future], device=device), use_cache=True, **{cache_kwarg(base): cache})
    positions = torch.arange(n, device=device)[None]
    scorers = [(m, make_scorer(m)) for m in methods]
    layers = []
    for module in modules:
        layer = module.layer_idx
        keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [kv_heads, T, d]
        future_q = future_store[layer].queries[0]
        norms = value_output_norms(values[:, :n], module.o_proj.weight)
        importance, value_importance = future_attention(future_q, keys, n, module.scaling, norms)
        tensors = {
            "keys": keys[:, :n].half().cpu(),
            "values": values[:, :n].half().cpu(),
            "importance": importance.cpu(),
            "value_importance": value_importance.cpu(),
        }
        for name, scorer in scorers:
            q = append_queries(None, prompt_store[layer], scorer.query_window)  # its last query_window
            score = scorer.score(keys[None, :, :n], values[None, :, :n], positions, q, layer)[0]
            tensors[f"score.{name}"] = score.float().cpu()
        layers.append(tensors)
    return Trace(layers, len(future), answer_ids, correct)


def uses_chat(model_name: str, tokenizer) -> bool:
    """Whether RULER prompts go through the chat template: a registered model says so (base models
    such as Gemma 3 270M take plain prompts); otherwise, whether the tokenizer has a template."""
    if model_name in MODELS:
        return MODELS[model_name].chat
    return bool(getattr(tokenizer, "chat_template", None))


def build_examples(config: CollectConfig, tokenizer, chat: bool = True) -> list[data.Example]:
    """Every example the config asks for, deterministic given the seed, sources interleaved.

    chat: RULER prompts in the chat template (instruct models) or plain (base models).
    """
    groups = []
    gold = config.task_future == "gold"
    for count, after in ((config.synthetic, False), (config.synthetic_after, True)):
        if count:
            groups.append(
                data.synthetic_examples(
                    tokenizer,
                    count,
                    config.context_tokens,
                    config.seed,
                    config.essays_dir,
                    config.tasks,
                    question_after=after,
                    gold_future=gold,
                    split=config.ruler_split,
                    chat=chat,
                )
            )
    for offset, (corpus, count) in enumerate(sorted(config.windows.items())):
        if count:
            read = partial(documents, corpus, config.seed, essays_dir=config.essays_dir)
            groups += text_windows(config, tokenizer, read, count, config.seed + offset, corpus)
    if config.text_windows:
        texts = []
        if config.text_files:
            texts += data.read_text_files(config.text_files, config.jsonl_field)
        if config.hf_dataset:
            texts += data.hf_dataset_texts(config.hf_dataset, config.hf_split, config.jsonl_field)
        if not texts:
            raise ValueError("text_windows needs text_files or hf_dataset")

        def read(max_chars: int, keep: Keep = keep_all) -> list[str]:
            return [text for text in texts if keep(text)]

        groups += text_windows(config, tokenizer, read, config.text_windows, config.seed + 7, "text")
    examples = list(data.interleave(*groups))
    if not examples:
        raise ValueError(
            "nothing to collect: set --synthetic, --synthetic-after, --windows or --text-windows"
        )
    return examples


def split_collection(config: CollectConfig, tokenizer) -> dict[str, list[data.Example]]:
    """The collection's examples by split name: ``{train_name: [...], val_name: [...]}``."""
    examples = build_examples(config, tokenizer, uses_chat(config.model, tokenizer))
    splits = data.split_examples(examples, config.val_fraction, config.seed)
    return {config.train_name: splits["train"], config.val_name: splits["val"]}


# What the settings added since the first collections were, for a collect.json without them.
LEGACY_SETTINGS = {"disjoint_windows": False, "held_out_documents": False}


def recorded_config(traces: str | Path, split: str) -> CollectConfig:
    """The settings ``traces/split`` was collected with (its ``collect.json``)."""
    settings = json.loads((Path(traces) / split / "collect.json").read_text())["settings"]
    return CollectConfig(out=str(traces), **{**LEGACY_SETTINGS, **settings})


def text_windows(
    config: CollectConfig, tokenizer, read: Callable[..., list[str]], count: int, seed: int, name: str
) -> list[list[data.Example]]:
    """``count`` windows of one source, as groups of examples; ``read(max_chars, keep)`` gives its
    documents.

    With ``held_out_documents``, ``ceil(val_fraction * count)`` windows are cut from the documents
    :func:`data.is_held_out_document` holds out and marked held out; the rest from the other ones.
    """

    def cut(
        n: int, keep: Keep = keep_all, prefix: str = name, held_out: bool | None = None
    ) -> list[data.Example]:
        window_tokens = config.context_tokens[1] + config.future_tokens[1]
        texts = read(n * window_tokens * CHARS_PER_TOKEN_READ, keep=keep) if n else []
        try:
            examples = data.text_examples(
                tokenizer, texts, n, config.context_tokens, config.future_tokens, seed, prefix,
                config.disjoint_windows,
            )  # fmt: skip
        except ValueError as error:
            raise ValueError(f"{prefix} windows: {error}") from None
        return [replace(e, source=name, held_out=held_out) for e in examples]

    if not config.held_out_documents:
        return [cut(count)]
    n_val = math.ceil(config.val_fraction * count)
    held = partial(data.is_held_out_document, val_fraction=config.val_fraction)
    return [
        cut(count - n_val, lambda text: not held(text), held_out=False),
        cut(n_val, held, f"{name}-held-out", held_out=True),
    ]


def collect(config: CollectConfig, model=None, tokenizer=None, device: str = "cpu") -> Path:
    """Build the examples, split them, and trace every split into ``config.out``; resumable.

    device: where ``config.model`` runs when no ``model`` is given (the traces are the same on any
    device up to float noise, so it is not part of the collection's settings).
    """
    config.validate()
    torch.manual_seed(config.seed)
    if model is None:
        model, tokenizer = load_model(config.model, device=device)
    named = split_collection(config, tokenizer)
    scored = {"val": {config.val_name}, "all": set(named), "none": set()}[config.query_scores]
    settings = {k: v for k, v in asdict(config).items() if k != "out"}
    settings = json.loads(json.dumps(settings))  # tuples -> lists, as read back from collect.json
    out = Path(config.out)
    write_traces(
        model,
        out,
        named,
        scored,
        config.shard_size,
        config.max_new_tokens,
        settings,
        tokenizer,
        config.only_correct,
    )
    return out


def write_traces(
    model,
    out: Path,
    splits: dict[str, list[data.Example]],
    scored_splits: set[str],
    shard_size: int,
    max_new_tokens: int,
    settings: dict,
    tokenizer=None,
    only_correct: bool = True,
) -> None:
    """Trace every example into ``out/<split>/shard_*``; finished shards are skipped.

    scored_splits: the splits that also store the query-aware baselines' scores. Examples the full
    cache answers wrong (``only_correct``) are listed under ``skipped`` in the shard's meta.json.
    """
    modules = attention_modules(model)
    scored = {split: query_aware_methods() if split in scored_splits else [] for split in splits}

    def trace(split: str, example: data.Example) -> tuple[list[dict[str, torch.Tensor]] | None, dict]:
        trace = trace_example(model, modules, example, scored[split], max_new_tokens, tokenizer, only_correct)
        answer = (
            tokenizer.decode(trace.answer_ids)
            if trace.answer_ids is not None and tokenizer is not None
            else None
        )
        record = {
            "uid": example.uid,
            "source": example.source,
            "prompt_tokens": len(example.prompt_ids),
            "future_tokens": trace.future_tokens,
            "answer": answer,
            **example.info,
        }
        return trace.layers, record

    write_splits(
        model, out, splits, settings, shard_size, trace, {s: {"methods": m} for s, m in scored.items()}
    )


# Traces one example of a split: (per traced layer its tensors, or None to skip it; its meta record).
TraceFn = Callable[[str, data.Example], tuple[list[dict[str, torch.Tensor]] | None, dict]]


def model_record(model) -> dict:
    """What a trace's metadata says of the model: its name, shape and traced layers."""
    shape = attention_shape(model.config)
    return {
        "name": text_config(model.config).name_or_path or "",
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "layer_indices": [module.layer_idx for module in attention_modules(model)],
    }


def write_splits(
    model,
    out: Path,
    splits: dict[str, list[data.Example]],
    settings: dict,
    shard_size: int,
    trace: TraceFn,
    shard_meta: dict[str, dict],
) -> None:
    """Trace every example with ``trace`` into ``out/<split>/shard_*`` (resumable: finished shards are
    skipped; a split collected with other ``settings`` is refused), with a progress bar; then print
    the collection's size on disk and this run's tracing time. shard_meta: per split, extra fields of
    its shards' meta.json."""
    model_info = model_record(model)
    todo = []
    for split, items in splits.items():
        if not items:
            continue
        split_dir = Path(out) / split
        split_dir.mkdir(parents=True, exist_ok=True)
        settings_file = split_dir / "collect.json"
        if settings_file.exists() and json.loads(settings_file.read_text())["settings"] != settings:
            raise ValueError(
                f"{split_dir} was collected with other settings ({settings_file}); use a new --out or delete it"
            )
        settings_file.write_text(json.dumps({"settings": settings, "model": model_info}, indent=1))
        for index in range(0, len(items), shard_size):
            todo.append(
                (shard_dir(out, split, index // shard_size), items[index : index + shard_size], split)
            )
    total = sum(len(items) for _, items, _ in todo)
    done = sum(len(items) for shard, items, _ in todo if shard_done(shard))
    bar = tqdm(total=total, initial=done, desc="collect", unit="sample")
    kept = skipped = 0
    seconds = 0.0
    for shard, items, split in todo:
        if shard_done(shard):
            continue
        per_layer = [dict() for _ in model_info["layer_indices"]]
        metas, skips = [], []
        for example in items:
            started = time.time()
            layers, record = trace(split, example)
            record["seconds"] = round(time.time() - started, 2)
            seconds += record["seconds"]
            if layers is None:
                skips.append(record)
                skipped += 1
            else:
                for layer, tensors in zip(per_layer, layers, strict=True):
                    for name, tensor in tensors.items():
                        layer.setdefault(name, []).append(tensor)
                metas.append(record)
                kept += 1
            bar.update(1)
            bar.set_postfix(kept=kept, skipped=skipped)
        write_shard(
            shard,
            per_layer,
            {"model": model_info, **shard_meta.get(split, {}), "samples": metas, "skipped": skips},
        )
    bar.close()
    sizes = ", ".join(f"{name}={len(items)}" for name, items in splits.items() if items)
    print(
        f"traces in {out}: {sizes} examples; {trace_gigabytes(out):.2f} GB on disk; free {free_gigabytes(out):.0f} GB; "
        f"{seconds:.0f} s of tracing in this run ({kept} traced, {skipped} skipped) at "
        f"{torch.get_num_threads()} threads"
    )


def trace_gigabytes(root: str | Path) -> float:
    """Size of every file under ``root`` in GB."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file()) / 1e9


def free_gigabytes(path: str | Path) -> float:
    return shutil.disk_usage(path).free / 1e9


def parse_windows(specs: list[str]) -> dict[str, int]:
    """``["essays=100", "code=50"]`` -> ``{"essays": 100, "code": 50}``."""
    windows = {}
    for spec in specs:
        corpus, _, count = spec.partition("=")
        if corpus not in CORPORA or not count.isdigit():
            raise ValueError(f"--windows takes CORPUS=COUNT with CORPUS in {sorted(CORPORA)}; got {spec!r}")
        windows[corpus] = int(count)
    return windows


def token_range(values: list[int]) -> tuple[int, int]:
    """``[n]`` -> ``(n, n)``; ``[low, high]`` -> ``(low, high)``."""
    if len(values) not in (1, 2):
        raise ValueError(f"give one length or a LOW HIGH range, got {values}")
    return (values[0], values[-1])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = CollectConfig(out="")
    parser.add_argument(
        "--out", required=True, help="trace directory (resumable: finished shards are skipped)"
    )
    parser.add_argument(
        "--model", default=defaults.model, help="'smollm2' (offline default) or a local HF model dir"
    )
    parser.add_argument("--synthetic", type=int, default=0, help="RULER prompts, question inside the prefill")
    parser.add_argument(
        "--synthetic-after", type=int, default=0, help="RULER prompts, question asked after the context"
    )
    parser.add_argument(
        "--tasks", nargs="*", default=None, help="RULER tasks (default: all kvp_cache.ruler.TASKS)"
    )
    parser.add_argument(
        "--task-future",
        choices=TASK_FUTURES,
        default=defaults.task_future,
        help="teacher-forced gold or greedy answer",
    )
    parser.add_argument(
        "--keep-wrong",
        dest="only_correct",
        action="store_false",
        help="keep RULER samples the full cache answers wrong (skipped by default)",
    )
    parser.add_argument("--ruler-split", choices=ruler.SPLITS, default=defaults.ruler_split)
    parser.add_argument(
        "--windows",
        nargs="*",
        default=[],
        metavar="CORPUS=COUNT",
        help=f"text windows per corpus {sorted(CORPORA)}",
    )
    parser.add_argument(
        "--essays-dir",
        default=defaults.essays_dir,
        help="Paul Graham essays *.txt: the RULER haystack (default: RULER noise) and the essays corpus",
    )
    parser.add_argument("--text-files", nargs="*", default=None, help=".txt/.md/.jsonl files or directories")
    parser.add_argument("--hf-dataset", default=None, help="Hugging Face dataset name (needs network)")
    parser.add_argument("--hf-split", default="train")
    parser.add_argument("--jsonl-field", default="text", help="text field of JSONL records / HF dataset rows")
    parser.add_argument(
        "--text-windows", type=int, default=0, help="windows cut from --text-files/--hf-dataset"
    )
    parser.add_argument(
        "--context-tokens",
        type=int,
        nargs="+",
        default=[1024],
        help="prompt length, or LOW HIGH (log-uniform)",
    )
    parser.add_argument(
        "--future-tokens", type=int, nargs="+", default=[64], help="text continuation length, or LOW HIGH"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=defaults.max_new_tokens, help="greedy answer length"
    )
    parser.add_argument("--val-fraction", type=float, default=defaults.val_fraction, help="held-out share")
    parser.add_argument("--train-name", default="train")
    parser.add_argument("--val-name", default="val")
    parser.add_argument(
        "--query-scores", choices=QUERY_SCORES, default="val", help="splits that store baseline scores"
    )
    parser.add_argument(
        "--shard-size", type=int, default=defaults.shard_size, help="samples per shard (resume unit)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:1, ...")


def config_from_args(args: argparse.Namespace) -> CollectConfig:
    fields = set(CollectConfig.__dataclass_fields__)
    values = {k: v for k, v in vars(args).items() if k in fields}
    values.update(
        windows=parse_windows(args.windows),
        context_tokens=token_range(args.context_tokens),
        future_tokens=token_range(args.future_tokens),
    )
    return CollectConfig(**values)


def collect_command(args: argparse.Namespace) -> Path:
    return collect(config_from_args(args), device=args.device)
