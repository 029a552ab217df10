"""``python -m train collect-decode``: traces of long sequences a capped cache reads while decoding.

Each sequence is a prompt of ``prompt_tokens`` (the tokenizer's leading BOS, if any, included) from
the TRAINING corpora (``train/corpora.py``; held-out windows come from held-out documents, as
``collect`` cuts them) followed by
``decode_tokens`` more: the true text, teacher-forced (``--windows``), or the model's own sampled
continuation (``--sampled``). The capped cache reads the prompt in one forward, then the rest in
forwards of ``chunk_tokens`` (1: token by token, as ``generate``), and evicts on the schedule of
``KVPCache(budget=1.0, max_cache_tokens=cap, evict_every=E)``
(:func:`kvp_cache.targets.eviction_points`).

The sequence runs once through the uncapped model with query-capturing hooks. Per traced layer a
sample stores the keys and values of the tokens read by its last stored eviction (the features the
policy scores, each token as it entered: ``forward_tokens`` in its meta record) and, for up to
``max_evictions`` evictions spread evenly over the schedule, the decode-time target
(:func:`kvp_cache.targets.decode_attention`: the attention each token read so far receives from the
queries until the next eviction of the full schedule, or a ``horizon``; sinks and window zeroed).
Each stored eviction costs only its own span of queries, and its target is stored packed
(``train/traces.py``), so a small ``evict_every`` stays cheap.

Collection resumes shard by shard (``collect``'s :func:`train.collect.write_splits`), shows
progress and prints its size on disk and its tracing time.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from transformers import DynamicCache

from kvp_cache.compat import cache_kwarg, text_config
from kvp_cache.models import leading_special_ids, load_model
from kvp_cache.targets import attention_modules, captured_queries, decode_attention, eviction_points
from train import data
from train.collect import CollectConfig, build_examples, parse_windows, write_splits
from train.traces import pack_decode_importance

SAMPLED = "sampled"


@dataclass
class DecodeCollectConfig:
    """Everything ``collect-decode`` needs; the CLI flags map one to one.

    windows / sampled: corpus name -> sequences whose continuation is the true text / the model's
    sampled one (temperature ``temperature``, nucleus ``top_p``). cap, evict_every, sinks, window:
    the capped cache whose schedule and protected entries define the target; horizon: None (until
    the next eviction) or a number of queries. max_evictions: evictions stored per sequence, spread
    evenly over its schedule (0: all).
    """

    out: str
    model: str = "smollm2"
    windows: dict[str, int] = field(default_factory=dict)
    sampled: dict[str, int] = field(default_factory=dict)
    essays_dir: str | None = None
    prompt_tokens: int = 1024
    decode_tokens: int = 1024
    chunk_tokens: int = 1
    cap: int = 256
    evict_every: int = 64
    sinks: int = 4
    window: int = 16
    horizon: int | None = None
    max_evictions: int = 16
    temperature: float = 1.0
    top_p: float = 0.95
    val_fraction: float = 0.12
    train_name: str = "train"
    val_name: str = "val"
    shard_size: int = 4
    seed: int = 0

    def validate(self) -> None:
        positive = ("prompt_tokens", "decode_tokens", "chunk_tokens", "cap", "evict_every", "shard_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sinks < 0 or self.window < 0 or self.max_evictions < 0:
            raise ValueError("sinks, window and max_evictions must be >= 0")
        if self.cap <= self.sinks + self.window:
            raise ValueError(f"cap must exceed sinks + window = {self.sinks + self.window}, got {self.cap}")
        if self.horizon is not None and self.horizon < 1:
            raise ValueError(f"horizon must be None or >= 1, got {self.horizon}")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"temperature must be > 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}"
            )
        counts = {**{f"windows[{k}]": v for k, v in self.windows.items()}}
        counts |= {f"sampled[{k}]": v for k, v in self.sampled.items()}
        if any(v < 0 for v in counts.values()) or not any(counts.values()):
            raise ValueError(
                f"set --windows and/or --sampled CORPUS=COUNT (counts >= 0, not all 0), got {counts}"
            )

    def forwards(self) -> list[int]:
        """The forwards that read a sequence: the prompt, then the continuation in chunks."""
        chunks = range(0, self.decode_tokens, self.chunk_tokens)
        return [self.prompt_tokens] + [min(self.chunk_tokens, self.decode_tokens - c) for c in chunks]

    def window_config(self, windows: dict[str, int], seed: int, leading_tokens: int = 0) -> CollectConfig:
        """``collect``'s settings cutting these windows: prompt + continuation, held-out windows
        from held-out documents. leading_tokens: the ids the tokenizer puts before any text
        (Gemma's BOS), which the window's prompt starts with and ``prompt_tokens`` counts."""
        text_tokens = self.prompt_tokens - leading_tokens
        return CollectConfig(
            out=self.out,
            model=self.model,
            windows=windows,
            essays_dir=self.essays_dir,
            context_tokens=(text_tokens, text_tokens),
            future_tokens=(self.decode_tokens, self.decode_tokens),
            val_fraction=self.val_fraction,
            seed=seed,
        )


def decode_examples(config: DecodeCollectConfig, tokenizer) -> dict[str, list[data.Example]]:
    """``{train_name: [...], val_name: [...]}``: teacher-forced windows, then sampled ones (their
    ``future_ids`` None: the continuation is sampled when traced), cut with another seed."""
    groups = []
    leading = len(leading_special_ids(tokenizer))
    if any(config.windows.values()):
        groups.append(build_examples(config.window_config(config.windows, config.seed, leading), tokenizer))
    if any(config.sampled.values()):
        cut = build_examples(config.window_config(config.sampled, config.seed + 1, leading), tokenizer)
        groups.append(
            [
                replace(e, uid=f"{SAMPLED}/{e.uid}", source=f"{e.source}-{SAMPLED}", future_ids=None)
                for e in cut
            ]
        )
    splits = data.split_examples(list(data.interleave(*groups)), config.val_fraction, config.seed)
    return {config.train_name: splits["train"], config.val_name: splits["val"]}


@torch.no_grad()
def sample_continuation(
    model, prompt_ids: list[int], tokens: int, temperature: float, top_p: float, seed: int
):
    """``tokens`` sampled after the prompt (never stopping early), seeded: ``list[int]``."""
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    out = model.generate(
        torch.tensor([prompt_ids], device=device),
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        pad_token_id=model.generation_config.eos_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


def stored_evictions(evictions: list[int], most: int) -> list[int]:
    """Up to ``most`` of the schedule's evictions, spread evenly, first and last kept (0: all)."""
    if not most or len(evictions) <= most:
        return list(evictions)
    if most == 1:
        return [evictions[0]]
    return [evictions[round(i * (len(evictions) - 1) / (most - 1))] for i in range(most)]


@torch.no_grad()
def trace_decode_example(
    model, modules: list[torch.nn.Module], example: data.Example, config: DecodeCollectConfig, seed: int
) -> tuple[list[dict[str, torch.Tensor]] | None, dict]:
    """One sequence's layers (None when its schedule never evicts) and meta record."""
    prompt = example.prompt_ids
    if len(prompt) != config.prompt_tokens:
        raise ValueError(f"{example.uid}: prompt of {len(prompt)} tokens, expected {config.prompt_tokens}")
    continuation = example.future_ids
    if continuation is None:
        continuation = sample_continuation(
            model, prompt, config.decode_tokens, config.temperature, config.top_p, seed
        )
    ids = prompt + continuation
    total = len(ids)
    forwards = config.forwards()
    schedule = [t for t in eviction_points(forwards, config.cap, config.evict_every) if t < total]
    kept = stored_evictions(schedule, config.max_evictions)
    record = {
        "uid": example.uid,
        "source": example.source,
        "ids_sha256": data.ids_digest(prompt + continuation),
        "prompt_tokens": len(prompt),
        "future_tokens": len(continuation),
        "evictions": kept,
        "schedule_evictions": len(schedule),
    }
    if not kept:
        return None, record
    read = kept[-1]
    # The forwards that read the stored tokens: eviction points end forwards, so they sum to `read`.
    ends = torch.tensor(forwards).cumsum(0).tolist()
    record["forward_tokens"] = forwards[: ends.index(read) + 1]
    if example.future_ids is None:
        record["continuation_ids"] = continuation
    span_end = {
        t: end if config.horizon is None else min(t + config.horizon, total)
        for t, end in zip(schedule, [*schedule[1:], total], strict=True)
    }
    device = next(model.parameters()).device
    cache = DynamicCache(config=text_config(model.config))
    base = model.base_model
    with captured_queries(model, modules) as store:
        base(input_ids=torch.tensor([ids], device=device), use_cache=True, **{cache_kwarg(base): cache})
    layers = []
    for module in modules:
        layer = module.layer_idx
        keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [kv_heads, T, d]
        queries = store[layer].queries[0]  # [q_heads, T, d]
        importance = torch.zeros(len(kept), keys.shape[0], read, device=keys.device)
        for k, start in enumerate(kept):
            # Only this eviction's span of queries: a query attends to no key after itself.
            end = span_end[start]
            span = decode_attention(
                queries[:, start:end], keys[:, :end], module.scaling, [start], config.sinks, config.window
            )
            importance[k, :, :start] = span[0, :, :start]
        layers.append(
            {
                "keys": keys[:, :read].half().cpu(),
                "values": values[:, :read].half().cpu(),
                "decode_importance": pack_decode_importance(importance.cpu(), kept),
            }
        )
    return layers, record


def collect_decode(config: DecodeCollectConfig, model=None, tokenizer=None, device: str = "cpu") -> Path:
    """Build the sequences, split them, and trace every split into ``config.out``; resumable."""
    config.validate()
    if model is None:
        model, tokenizer = load_model(config.model, device=device)
    out = Path(config.out)
    write_decode_traces(model, out, decode_examples(config, tokenizer), config)
    return out


def write_decode_traces(
    model, out: Path, splits: dict[str, list[data.Example]], config: DecodeCollectConfig
) -> None:
    """Trace every sequence of ``splits`` into ``out/<split>/shard_*`` (resumable); each sampled
    continuation is seeded by the collection's seed and the sequence's uid."""
    settings = json.loads(json.dumps({k: v for k, v in asdict(config).items() if k != "out"}))
    modules = attention_modules(model)

    def trace(split: str, example: data.Example):
        seed = random.Random(f"{config.seed}/{example.uid}").randrange(2**31)
        return trace_decode_example(model, modules, example, config, seed)

    decode = {k: settings[k] for k in ("cap", "evict_every", "sinks", "window", "horizon", "chunk_tokens")}
    write_splits(
        model, out, splits, settings, config.shard_size, trace, {s: {"decode": decode} for s in splits}
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DecodeCollectConfig(out="")
    parser.add_argument(
        "--out", required=True, help="trace directory (resumable: finished shards are skipped)"
    )
    parser.add_argument(
        "--model", default=defaults.model, help="'smollm2' (offline default) or a local HF model dir"
    )
    parser.add_argument(
        "--windows", nargs="*", default=[], metavar="CORPUS=COUNT", help="teacher-forced sequences"
    )
    parser.add_argument(
        "--sampled", nargs="*", default=[], metavar="CORPUS=COUNT", help="sampled continuations"
    )
    parser.add_argument("--essays-dir", default=None, help="Paul Graham essays *.txt (the essays corpus)")
    for name in ("prompt_tokens", "decode_tokens", "chunk_tokens", "cap", "evict_every", "sinks", "window"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument(
        "--horizon", type=int, default=None, help="queries per eviction (default: until the next)"
    )
    parser.add_argument(
        "--max-evictions",
        type=int,
        default=defaults.max_evictions,
        help="evictions stored per sequence (0: all)",
    )
    parser.add_argument("--temperature", type=float, default=defaults.temperature)
    parser.add_argument("--top-p", type=float, default=defaults.top_p)
    parser.add_argument("--val-fraction", type=float, default=defaults.val_fraction)
    parser.add_argument("--train-name", default=defaults.train_name)
    parser.add_argument("--val-name", default=defaults.val_name)
    parser.add_argument("--shard-size", type=int, default=defaults.shard_size, help="sequences per shard")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, ...")


def collect_decode_command(args: argparse.Namespace) -> Path:
    fields = set(DecodeCollectConfig.__dataclass_fields__)
    values = {k: v for k, v in vars(args).items() if k in fields}
    values.update(windows=parse_windows(args.windows), sampled=parse_windows(args.sampled))
    return collect_decode(DecodeCollectConfig(**values), device=args.device)
