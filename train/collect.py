"""``python -m train collect``: run a model over prompts and store what training needs.

For every example, ONE forward over prompt + future (the model's greedy answer, or the true text
continuation) runs with a pre-hook on each attention module that keeps its input hidden states and
RoPE tables, and with a ``DynamicCache`` whose post-RoPE keys/values are exactly what an eviction
cache would hold. Per layer it stores the prompt's K/V and each prompt token's future-attention
importance (paper section 4):

    importance[h, i] = sum over future queries t of max over the query heads g of KV head h of A_g[t, i]

where ``A`` is the model's full causal softmax attention over prompt + future (not renormalized to
the prompt). Future queries are processed in chunks, never as a full ``T x T`` matrix.

For held-out splits it also stores the score of every query-aware baseline computed from the
prompt's own queries, so ``evaluate`` can rank them without the model.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from kvp_cache.capture import queries_of
from kvp_cache.compat import text_config
from kvp_cache.models import load_model
from kvp_cache.scorers import available_methods, make_scorer
from kvp_cache.scorers.base import rotate_half
from train import data
from train.traces import shard_dir, shard_done, write_shard

DEFAULT_ESSAYS = Path(__file__).resolve().parents[2] / "shared" / "data" / "pg_essays"


def query_aware_methods() -> list[str]:
    """Registry methods that need the prompt's queries (scored at collection time)."""
    return [m for m in available_methods() if m != "kvp" and make_scorer(m).needs_queries]


def attention_modules(model) -> list[torch.nn.Module]:
    """The attention module of every layer, in layer order (Llama-style: ``q_proj`` and ``layer_idx``)."""
    modules = sorted(
        (m for m in model.modules() if hasattr(m, "q_proj") and getattr(m, "layer_idx", None) is not None),
        key=lambda m: m.layer_idx,
    )
    layers = text_config(model.config).num_hidden_layers
    if len(modules) != layers:
        raise NotImplementedError(
            f"collect needs Llama-style attention modules (q_proj, layer_idx); found {len(modules)} of {layers}"
        )
    return modules


def future_importance(
    queries: torch.Tensor, keys: torch.Tensor, prompt_len: int, scaling: float, chunk: int = 128
) -> torch.Tensor:
    """Attention each prompt token receives from the future queries.

    queries: ``[q_heads, F, d]`` post-RoPE queries at positions ``T - F .. T - 1``;
    keys: ``[kv_heads, T, d]`` post-RoPE keys of prompt + future. Causal softmax in float32 over
    all ``T`` keys; the attention is maxed over each GQA group, then summed over the queries.
    Returns ``[kv_heads, prompt_len]`` float32.
    """
    kv_heads, total, d = keys.shape
    q_heads, future, _ = queries.shape
    grouped = queries.float().view(kv_heads, q_heads // kv_heads, future, d)
    keys = keys.float()
    importance = torch.zeros(kv_heads, prompt_len)
    key_pos = torch.arange(total)
    for start in range(0, future, chunk):
        q = grouped[:, :, start : start + chunk]
        query_pos = torch.arange(q.shape[2]) + (total - future + start)
        logits = torch.einsum("hgfd,htd->hgft", q, keys) * scaling
        logits = logits.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        attention = logits.softmax(-1)[..., :prompt_len]  # [kv_heads, group, chunk, prompt_len]
        importance += attention.amax(dim=1).sum(dim=1)
    return importance


class InputCapture:
    """Pre-hooks that keep each attention module's ``hidden_states`` and ``(cos, sin)`` of one forward."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = modules
        self.store: dict[int, tuple] = {}
        self.handles = []

    def __enter__(self):
        for module in self.modules:
            self.handles.append(module.register_forward_pre_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _hook(self, module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
        self.store[module.layer_idx] = (hidden, cos, sin)


def rope_keys(module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys ``[batch, kv_heads, seq, d]`` recomputed from the attention input (used only to
    cross-check the cache in tests)."""
    b, n, _ = hidden.shape
    pre = module.k_proj(hidden).view(b, n, -1, module.head_dim)
    if hasattr(module, "k_norm"):
        pre = module.k_norm(pre)
    pre = pre.transpose(1, 2)
    return pre * cos.unsqueeze(1) + rotate_half(pre) * sin.unsqueeze(1)


@torch.no_grad()
def greedy_answer(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The model's greedy continuation (stops at EOS, which is kept)."""
    ids = torch.tensor([prompt_ids])
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    return out[0, ids.shape[1] :].tolist()


@torch.no_grad()
def trace_example(
    model, modules, prompt_ids: list[int], future_ids: list[int], methods: list[str]
) -> list[dict]:
    """One forward over prompt + future; per layer ``{"keys", "values", "importance", "score.<m>"...}``
    with shapes ``[kv_heads, n, d]`` / ``[kv_heads, n]``, ``n = len(prompt_ids)``."""
    if not future_ids:
        raise ValueError("an example needs at least one future token")
    n = len(prompt_ids)
    ids = torch.tensor([prompt_ids + future_ids])
    cache = DynamicCache(config=text_config(model.config))
    base = model.base_model
    cache_arg = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    with InputCapture(modules) as capture:
        base(input_ids=ids, use_cache=True, **{cache_arg: cache})
    positions = torch.arange(n)[None]
    scorers = [(m, make_scorer(m)) for m in methods]
    layers = []
    for module in modules:
        layer = module.layer_idx
        keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [kv_heads, T, d]
        hidden, cos, sin = capture.store[layer]
        future_q = queries_of(module, hidden, cos, sin, len(future_ids)).queries[0]
        out = {
            "keys": keys[:, :n].half(),
            "values": values[:, :n].half(),
            "importance": future_importance(future_q, keys, n, module.scaling),
        }
        for name, scorer in scorers:
            q = queries_of(module, hidden[:, :n], cos[:, :n], sin[:, :n], scorer.query_window)
            score = scorer.score(keys[None, :, :n], values[None, :, :n], positions, q, layer)[0]
            out[f"score.{name}"] = score.float()
        layers.append(out)
    return layers


def build_examples(args, tokenizer) -> list[data.Example]:
    """Every example the arguments ask for, deterministic given the seed."""
    groups = []
    if args.synthetic:
        groups.append(
            data.synthetic_examples(
                tokenizer, args.synthetic, args.context_tokens, args.seed, args.essays_dir, args.tasks
            )
        )
    if args.essay_windows:
        essays = data.read_text_files([args.essays_dir])
        groups.append(
            data.text_examples(
                tokenizer,
                essays,
                args.essay_windows,
                args.context_tokens,
                args.future_tokens,
                args.seed,
                "essay",
            )
        )
    documents = []
    if args.text_files:
        documents += data.read_text_files(args.text_files, args.jsonl_field)
    if args.hf_dataset:
        documents += data.hf_dataset_texts(args.hf_dataset, args.hf_split, args.jsonl_field)
    if args.text_windows:
        if not documents:
            raise ValueError("--text-windows needs --text-files or --hf-dataset")
        groups.append(
            data.text_examples(
                tokenizer,
                documents,
                args.text_windows,
                args.context_tokens,
                args.future_tokens,
                args.seed + 7,
            )
        )
    examples = list(data.interleave(*groups))
    if not examples:
        raise ValueError("nothing to collect: set --synthetic, --essay-windows or --text-windows")
    return examples


def collect_command(args) -> None:
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model or "smollm2")
    examples = build_examples(args, tokenizer)
    splits = data.split_examples(examples, args.val_fraction, args.seed)
    named = {args.train_name: splits["train"], args.val_name: splits["val"]}
    scored = (
        {args.val_name} if args.query_scores == "val" else set(named) if args.query_scores == "all" else set()
    )
    settings = {k: v for k, v in vars(args).items() if k not in {"threads", "func", "command", "out"}}
    write_traces(
        model, Path(args.out), named, scored, args.shard_size, args.max_new_tokens, settings, tokenizer
    )


def write_traces(
    model,
    out: Path,
    splits: dict[str, list[data.Example]],
    scored_splits: set[str],
    shard_size: int,
    max_new_tokens: int,
    settings: dict,
    tokenizer=None,
) -> None:
    """Trace every example into ``out/<split>/shard_*``; finished shards are skipped.

    scored_splits: the splits that also store the query-aware baselines' scores.
    """
    modules = attention_modules(model)
    config = text_config(model.config)
    model_info = {
        "name": config.name_or_path or "",
        "num_layers": config.num_hidden_layers,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": modules[0].head_dim,
    }
    todo = []
    for split, items in splits.items():
        if not items:
            continue
        split_dir = out / split
        split_dir.mkdir(parents=True, exist_ok=True)
        settings_file = split_dir / "collect.json"
        if settings_file.exists() and json.loads(settings_file.read_text())["settings"] != settings:
            raise ValueError(
                f"{split_dir} was collected with other settings ({settings_file}); use a new --out or delete it"
            )
        settings_file.write_text(json.dumps({"settings": settings, "model": model_info}, indent=1))
        methods = query_aware_methods() if split in scored_splits else []
        for index in range(0, len(items), shard_size):
            todo.append(
                (shard_dir(out, split, index // shard_size), items[index : index + shard_size], methods)
            )
    total = sum(len(items) for _, items, _ in todo)
    done = sum(len(items) for shard, items, _ in todo if shard_done(shard))
    bar = tqdm(total=total, initial=done, desc="collect", unit="sample")
    for shard, items, methods in todo:
        if shard_done(shard):
            continue
        per_layer = [dict() for _ in modules]
        metas = []
        for example in items:
            started = time.time()
            future = example.future_ids or greedy_answer(model, example.prompt_ids, max_new_tokens)
            traced = trace_example(model, modules, example.prompt_ids, future, methods)
            for layer, tensors in zip(per_layer, traced, strict=True):
                for name, tensor in tensors.items():
                    layer.setdefault(name, []).append(tensor)
            answer = (
                tokenizer.decode(future) if example.future_ids is None and tokenizer is not None else None
            )
            metas.append(
                {
                    "uid": example.uid,
                    "source": example.source,
                    "prompt_tokens": len(example.prompt_ids),
                    "future_tokens": len(future),
                    "answer": answer,
                    "seconds": round(time.time() - started, 2),
                    **example.info,
                }
            )
            bar.update(1)
        write_shard(shard, per_layer, {"model": model_info, "methods": methods, "samples": metas})
    bar.close()
    print(f"traces in {out}: " + ", ".join(f"{name}={len(items)}" for name, items in splits.items() if items))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", required=True, help="trace directory (resumable: finished shards are skipped)"
    )
    parser.add_argument(
        "--model", default="smollm2", help="'smollm2' (offline default) or a local HF model dir"
    )
    parser.add_argument("--synthetic", type=int, default=0, help="number of synthetic RULER prompts")
    parser.add_argument(
        "--tasks", nargs="*", default=None, help="RULER tasks (default: all kvp_cache.ruler.TASKS)"
    )
    parser.add_argument(
        "--essay-windows", type=int, default=0, help="number of plain-text windows cut from essays"
    )
    parser.add_argument(
        "--essays-dir", default=str(DEFAULT_ESSAYS), help="essay .txt dir (haystack and text)"
    )
    parser.add_argument("--text-files", nargs="*", default=None, help=".txt/.md/.jsonl files or directories")
    parser.add_argument("--hf-dataset", default=None, help="Hugging Face dataset name (needs network)")
    parser.add_argument("--hf-split", default="train")
    parser.add_argument("--jsonl-field", default="text", help="text field of JSONL records / HF dataset rows")
    parser.add_argument(
        "--text-windows", type=int, default=0, help="windows cut from --text-files/--hf-dataset"
    )
    parser.add_argument("--context-tokens", type=int, default=1024, help="prompt length in tokens")
    parser.add_argument(
        "--future-tokens", type=int, default=64, help="true continuation length for plain text"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=48, help="greedy answer length for synthetic tasks"
    )
    parser.add_argument("--val-fraction", type=float, default=0.12, help="held-out share, split per sample")
    parser.add_argument("--train-name", default="train")
    parser.add_argument("--val-name", default="val")
    parser.add_argument(
        "--query-scores",
        choices=["val", "all", "none"],
        default="val",
        help="splits that store baseline scores",
    )
    parser.add_argument("--shard-size", type=int, default=8, help="samples per shard (the resume unit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
