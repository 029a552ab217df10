"""``python -m eval.headroom``: what adaptive per-head budgets could give, measured with the oracle.

Every KV head keeps the same share of its prompt today. This measures, at equal total entries, the
oracle (:mod:`eval.oracle`: each entry scored by the gold future's attention to it) under the
three allocations of :mod:`kvp_cache.allocation`: ``uniform`` (today's oracle row), ``layer``
(per-layer budgets) and ``head`` (one global top-k over every layer, head and token, with a small
minimum per head). A headroom study, not a method: the oracle knows the future.

Each example is prefilled once with the model's own attention. Each (allocation, budget) then runs
the future on a copy of that cache with :func:`prompt_mask`: an eager attention in which, on the
evicting layers (:func:`kvp_cache.compat.evicting_layer_indices`), every KV head sees only ITS OWN
kept prompt entries, and every other mask is the model's own (causal, sliding windows). That is
what a cache holding those entries computes, for any per-head counts (``tests/test_headroom.py``
checks it against the per-head mask of ``tests/reference.py`` for uneven counts, and against
``KVPCache``'s oracle row for the uniform allocation).

Validation data only, never the benchmark's held-out corpora (:mod:`eval.corpora`):

- text: windows of ``context_tokens`` plus ``continuation_tokens`` from the documents the training
  corpora hold out (:func:`train.data.is_held_out_document`, cut as ``train collect`` cuts its
  held-out windows); the score is the continuation's NLL per token minus the full cache's;
- needles: ``kvp_cache.ruler`` samples of the ``val`` split (as ``train collect`` builds them, gold
  answer as the oracle's future), question inside the compressed prompt (``question_in``) or asked
  after it (``question_after``): greedy answers scored by :func:`kvp_cache.ruler.score`, and the
  gold answer's NLL per token minus the full cache's, which still tells allocations apart when
  they all find the needle.

``--scores`` picks what drives the allocations (:data:`SCORE_KINDS`, :func:`entry_scores`): the
oracle (default), or a scorer's scores on the same prefill, to see whether the oracle's gain from a
global ranking carries over to scores a cache can compute. ``kvp`` softmaxes the policy's scores
over each head's prompt (its ListNet training makes that each entry's estimated share of its head's
importance); ``kvp_raw`` leaves them raw; ``kvp_calibrated`` and the baselines use the values the
cache's adaptive allocation ranks, :meth:`Scorer.cross_head_scores` (for ``kvp``, the policy's
calibration, ``python -m train calibrate``). ``kvp_oracle_counts`` splits the two decisions: the
oracle's allocation sets how many entries each head keeps, the policy's ranking picks them, so its
``uniform`` rows are plain KVP's and its ``head`` rows tell how much of the oracle's allocation gain
the policy's ranking keeps. ``kvp_oracle_weights`` keeps the calibrated shape of each head's shares
but gives the head the oracle's weight in this prompt: how much a prompt-dependent head weight could
recover of what the counts lose; ``kvp_window_weights`` takes that weight from the attention of the
prompt's last queries instead (:func:`window_attention`), one a cache could compute.

Records go to ``<out>/headroom_<model>[_<scores>][_<tag>].jsonl`` as they finish (a rerun reuses
those made with the same settings and tokens); the summary to ``headroom_<model>[_<scores>][_<tag>]
.{json,md}``, with provenance (the oracle's files carry no suffix; ``--tag`` keeps runs of different
policies apart). ``--compare`` instead regenerates the tables that put several summaries side by
side in a hand-written report (:func:`compare_tables`).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import itertools
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from eval.__main__ import comma_list
from eval.benchmark_config import TEMPLATE_TOKENS, digest
from eval.oracle import oracle_scorer
from eval.realtext import continuation_nll
from eval.report import signed_interval
from eval.stats import bootstrap_interval, wilson_interval
from eval.sweep import FULL, MAX_NEW_TOKENS
from kvp_cache import ruler
from kvp_cache.allocation import MIN_EXTRA_PER_HEAD, MODES, allocate
from kvp_cache.budget import Budget, parse_budget
from kvp_cache.capture import append_queries
from kvp_cache.cli import add_protected_tokens_arguments
from kvp_cache.compat import evicting_layer_indices
from kvp_cache.models import load_model
from kvp_cache.policy import load_policy
from kvp_cache.prefill import Prefill, prefill
from kvp_cache.provenance import portable_argument, portable_config, provenance
from kvp_cache.scorers import Scorer, make_scorer
from kvp_cache.scorers.base import grouped_attention
from kvp_cache.tables import markdown_table
from kvp_cache.targets import evictable_only
from train.calibrate import corpus_windows
from train.collect import greedy_continue, parse_windows, uses_chat
from train.data import Example, interleave, synthetic_examples

HEADROOM_ATTENTION = "kvp_headroom"
PERPLEXITY = "perplexity"
PROTOCOLS = ("question_in", "question_after")
ALL = "all"
REFERENCE = "uniform"
"""The allocation every other one is compared with, example by example."""
ORACLE = "oracle"
ORACLE_COUNTS = "kvp_oracle_counts"
ORACLE_WEIGHTS = "kvp_oracle_weights"
WINDOW_WEIGHTS = "kvp_window_weights"
WEIGHT_WINDOW = 32
"""The prompt queries whose attention gives ``kvp_window_weights`` its head weights."""
CALIBRATED_KINDS = ("kvp_calibrated", ORACLE_WEIGHTS, WINDOW_WEIGHTS)
"""The score kinds that read the policy's calibration, so their records depend on it."""
SCORE_KINDS = {
    ORACLE: "the oracle (the gold future's attention mass to each entry)",
    "kvp": "the learned policy's scores, softmaxed over each head's prompt tokens (each entry's "
    "estimated share of its head's future importance, what ListNet trains)",
    "kvp_raw": "the learned policy's raw scores (no normalization across heads)",
    "kvp_calibrated": "the learned policy's scores made comparable across heads by its calibration "
    "(weight * softmax(score / temperature) per head: each entry's estimated share of the future "
    "attention, KVPolicy.cross_head_scores)",
    "snapkv": "SnapKV's scores (the last prompt queries' pooled attention: softmax mass per head)",
    "tova": "TOVA's scores (the last prompt query's attention, averaged over each layer's heads)",
    "h2o": "H2O's scores (the prompt queries' accumulated attention, per query)",
    "expected_attention": "Expected Attention's scores (expected future attention times ||v||)",
    ORACLE_COUNTS: "the oracle's allocation (how many entries each head keeps) with the learned "
    "policy's ranking inside each head: what KVP's ranking loses under a perfect allocation",
    ORACLE_WEIGHTS: "the calibrated policy's shares with each head's weight replaced by the oracle's "
    "evictable mass of that head in this prompt: what a perfect prompt-dependent head weight gives",
    WINDOW_WEIGHTS: "the calibrated policy's shares with each head's weight replaced by the attention "
    "its last 32 prompt queries give its evictable entries: a head weight a cache could compute",
}
"""What drives the allocation (``--scores``): every kind is computed on the same prefill."""
SCORER_OF = {
    "kvp": "kvp",
    "kvp_raw": "kvp",
    "kvp_calibrated": "kvp",
    "snapkv": "snapkv",
    "tova": "tova",
    "h2o": "h2o",
    "expected_attention": "expected_attention",
    ORACLE_COUNTS: "kvp",
    ORACLE_WEIGHTS: "kvp",
    WINDOW_WEIGHTS: "kvp",
}
"""The registered method behind each non-oracle score kind; the kinds other than ``kvp`` and
``kvp_raw`` rank the scorer's :meth:`~kvp_cache.scorers.Scorer.cross_head_scores`."""


@dataclass
class HeadroomConfig:
    """What the study covers; the CLI flags map one to one.

    windows: held-out text windows per training corpus (``train.corpora``). dialogue holds out
    about 8K tokens, so 3 windows of 2K at most. samples: needle samples per task and protocol.
    """

    model: str = "smollm2"
    out: str = "docs/adaptive"
    windows: dict[str, int] = field(default_factory=lambda: {"code": 8, "docs": 8, "dialogue": 3})
    context_tokens: int = 2048
    continuation_tokens: int = 128
    text_budgets: list[Budget] = field(default_factory=lambda: [0.05, 0.1, 0.25])
    tasks: list[str] = field(default_factory=lambda: ["niah_single", "niah_multikey"])
    samples: int = 10
    needle_context: int = 2048
    protocols: list[str] = field(default_factory=lambda: list(PROTOCOLS))
    needle_budgets: list[Budget] = field(default_factory=lambda: [0.05, 0.1])
    min_per_head: int | None = None
    sink_tokens: int = 4
    window_tokens: int = 16
    val_fraction: float = 0.12
    essays_dir: str | None = None
    seed: int = 0
    scores: str = ORACLE
    policy: str = "smollm2-135m-instruct"
    tag: str = ""

    def __post_init__(self) -> None:
        if self.scores not in SCORE_KINDS:
            raise ValueError(f"scores must be one of {sorted(SCORE_KINDS)}, got {self.scores!r}")
        unknown = sorted(set(self.protocols) - set(PROTOCOLS))
        if unknown:
            raise ValueError(f"protocols must be among {PROTOCOLS}, got {unknown}")
        unknown = sorted(set(self.tasks) - set(MAX_NEW_TOKENS))
        if unknown:
            raise ValueError(f"tasks must be among {sorted(MAX_NEW_TOKENS)}, got {unknown}")
        for name in ("context_tokens", "continuation_tokens", "needle_context"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2 tokens, got {getattr(self, name)}")
        if self.samples < 0 or any(count < 0 for count in self.windows.values()):
            raise ValueError(f"samples and window counts must be >= 0, got {self.samples}, {self.windows}")

    def fingerprint(self) -> str:
        """What every record depends on besides its own tokens (which records hash themselves)."""
        keys = {
            "sink": self.sink_tokens,
            "window": self.window_tokens,
            "min_per_head": self.min_per_head,
            "min_extra": MIN_EXTRA_PER_HEAD,
            "essays_dir": Path(self.essays_dir).name if self.essays_dir else None,
        }
        if self.scores != ORACLE:  # added only here, so the oracle's existing records stay valid
            policy = load_policy(self.policy) if SCORER_OF[self.scores] == "kvp" else None
            keys.update(scores=self.scores, policy=policy.weights_sha256 if policy else None)
            if self.scores in CALIBRATED_KINDS:  # not in the uncalibrated kinds' older runs
                keys.update(calibration=policy.calibration_sha256)
        return digest(keys)

    def stem(self) -> str:
        """The results' file name without suffix: ``headroom_<model>[_<scores>][_<tag>]``."""
        scores = "" if self.scores == ORACLE else f"_{self.scores}"
        return f"headroom_{self.model}{scores}" + (f"_{self.tag}" if self.tag else "")


def budget_key(mode: str, budget: Budget) -> str:
    """How records name an answer: ``<mode>@<budget>``."""
    return f"{mode}@{budget}"


# -- the masked forward ------------------------------------------------------------------------

_KEPT: dict[int, torch.Tensor] = {}  # layer -> bool [kv_heads, prompt_tokens] while prompt_mask is active


def masked_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs
):
    """Eager attention (``query`` ``[b, q_heads, q, d]``, ``key``/``value`` ``[b, kv_heads, k, d]``,
    ``attention_mask`` the model's additive ``[b, 1, q, k]``) where, on a layer of ``_KEPT``, key ``j``
    of the prompt is seen by the query heads of KV head ``h`` only if ``_KEPT[layer][h, j]``."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    logits = (query @ key.transpose(-1, -2)) * (module.scaling if scaling is None else scaling)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if attention_mask is not None:
        logits = logits + attention_mask
    kept = _KEPT.get(module.layer_idx)
    if kept is not None:
        prompt = kept.shape[-1]
        hidden = ~kept.to(logits.device).repeat_interleave(groups, dim=0)[None, :, None, :]
        logits[..., :prompt] = logits[..., :prompt].masked_fill(hidden, torch.finfo(logits.dtype).min)
    weights = logits.softmax(-1, dtype=torch.float32).to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights


AttentionInterface.register(HEADROOM_ATTENTION, masked_attention)
AttentionMaskInterface.register(HEADROOM_ATTENTION, eager_mask)


@contextmanager
def prompt_mask(model, kept: dict[int, torch.Tensor]) -> Iterator[None]:
    """Inside, each forward of ``model`` on a cache that starts with the prompt lets KV head ``h`` of
    layer ``l`` see only the prompt entries ``kept[l][h]`` (bool ``[kv_heads, prompt_tokens]``);
    layers not in ``kept`` and every token after the prompt are seen as the model's own masks say."""
    previous = model.config._attn_implementation
    _KEPT.clear()
    _KEPT.update(kept)
    model.set_attn_implementation(HEADROOM_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        _KEPT.clear()


# -- the examples ------------------------------------------------------------------------------


def held_out_windows(config: HeadroomConfig, tokenizer, name: str, count: int) -> list[Example]:
    """``count`` disjoint windows of corpus ``name``'s held-out documents, cut as ``train collect``
    cuts its held-out windows (:func:`train.collect.text_windows`)."""
    return corpus_windows(
        tokenizer, name, count, config.context_tokens, config.continuation_tokens, config.seed,
        config.val_fraction, held_out=True, essays_dir=config.essays_dir,
    )  # fmt: skip


def needle_examples(config: HeadroomConfig, tokenizer, protocol: str) -> list[Example]:
    """``samples`` val-split RULER prompts per task, sized as the benchmark sizes its prompts."""
    answer = max(MAX_NEW_TOKENS[task] for task in config.tasks)
    target = int(config.needle_context * (1 - ruler.LENGTH_TOLERANCE)) - answer - TEMPLATE_TOKENS
    return synthetic_examples(
        tokenizer,
        config.samples * len(config.tasks),
        (target, target),
        config.seed,
        config.essays_dir,
        config.tasks,
        question_after=protocol == "question_after",
        split="val",
        chat=uses_chat(config.model, tokenizer),
    )


def protocol_of(example: Example) -> str:
    if example.sample is None:
        return PERPLEXITY
    return "question_after" if example.question_ids else "question_in"


def examples(config: HeadroomConfig, tokenizer) -> list[Example]:
    """Every example, sources interleaved so an unfinished run covers them all equally."""
    groups = [held_out_windows(config, tokenizer, name, n) for name, n in config.windows.items() if n]
    if config.samples:
        groups += [needle_examples(config, tokenizer, protocol) for protocol in config.protocols]
    return list(interleave(*groups))


def tokens_digest(example: Example) -> str:
    ids = [example.prompt_ids, example.question_ids, example.future_ids]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


# -- the scores --------------------------------------------------------------------------------


def score_source(config: HeadroomConfig) -> Scorer | None:
    """The scorer behind ``config.scores`` (None for the oracle, which is built per example)."""
    if config.scores == ORACLE:
        return None
    method = SCORER_OF[config.scores]
    return make_scorer(method, policy=config.policy) if method == "kvp" else make_scorer(method)


@torch.no_grad()
def entry_scores(
    kind: str,
    scorer: Scorer | None,
    model,
    prefilled: Prefill,
    future_ids: list[int],
    sink_tokens: int = 4,
    window_tokens: int = 16,
) -> dict[int, torch.Tensor]:
    """``{layer: float32 [kv_heads, prompt_tokens]}`` of every evicting layer for score ``kind``
    (:data:`SCORE_KINDS`) of one prefilled prompt (batch 1); ``scorer`` from :func:`score_source`.

    A scorer sees what ``KVPCache.from_prefill`` gives it: the prompt's keys and values, positions
    ``0..tokens-1`` and, if it needs them, the last ``query_window`` prompt queries. The protected
    tokens only matter to the ``*_weights`` kinds, whose head weights are a mass outside them."""
    if kind in (ORACLE, ORACLE_COUNTS):  # ORACLE_COUNTS: the oracle allocates, the policy picks
        return oracle_scorer(model, prefilled, future_ids).importance
    if kind in (ORACLE_WEIGHTS, WINDOW_WEIGHTS):
        if kind == ORACLE_WEIGHTS:
            mass = oracle_scorer(model, prefilled, future_ids).importance
        else:
            mass = window_attention(model, prefilled, WEIGHT_WINDOW)
        calibrated = entry_scores("kvp_calibrated", scorer, model, prefilled, future_ids)
        return {
            layer: shares
            / shares.sum(-1, keepdim=True)
            * evictable_only(mass[layer], sink_tokens, window_tokens).sum(-1, keepdim=True)
            for layer, shares in calibrated.items()
        }
    positions = torch.arange(prefilled.input_ids.shape[1], device=prefilled.input_ids.device)[None]
    scores = {}
    for layer in evicting_layer_indices(model.config):
        states = prefilled.cache.layers[layer]
        queries = (
            append_queries(None, prefilled.queries[layer], scorer.query_window)
            if scorer.needs_queries
            else None
        )
        raw = scorer.score(states.keys, states.values, positions, queries, layer).float()
        if kind == "kvp":
            scores[layer] = raw[0].softmax(-1)
        elif kind == "kvp_raw":
            scores[layer] = raw[0]
        else:
            scores[layer] = scorer.cross_head_scores(raw, torch.ones_like(raw, dtype=torch.bool), layer)[0]
    return scores


def window_attention(model, prefilled: Prefill, window: int) -> dict[int, torch.Tensor]:
    """``{layer: float32 [kv_heads, prompt_tokens]}``: the mean attention of the prompt's last
    ``window`` queries (over them and each KV head's query group) to every prompt entry."""
    tokens = prefilled.input_ids.shape[1]
    valid = torch.ones(1, tokens, dtype=torch.bool, device=prefilled.input_ids.device)
    attention = {}
    for layer in evicting_layer_indices(model.config):
        queries = append_queries(None, prefilled.queries[layer], window)
        keys = prefilled.cache.layers[layer].keys
        weights = grouped_attention(
            queries.queries, keys, queries.scaling, valid, tokens - queries.queries.shape[-2]
        )
        attention[layer] = weights.nan_to_num(0.0).mean(dim=(2, 3))[0]
    return attention


# -- one example -------------------------------------------------------------------------------


@torch.no_grad()
def measure(model, tokenizer, example: Example, config: HeadroomConfig, scorer: Scorer | None = None) -> dict:
    """One example's record: the full cache's and every (allocation, budget)'s NLL or answer, the
    allocations driven by ``config.scores`` (``scorer`` from :func:`score_source`)."""
    device = next(model.parameters()).device
    prefilled = prefill(model, torch.tensor([example.prompt_ids], device=device))
    future = example.question_ids + example.future_ids
    importance = entry_scores(
        config.scores, scorer, model, prefilled, future, config.sink_tokens, config.window_tokens
    )
    # Which entries each head keeps, once the allocation set how many: the allocation's own scores,
    # or for ORACLE_COUNTS the policy's.
    ranking = (
        entry_scores("kvp_raw", scorer, model, prefilled, future) if config.scores == ORACLE_COUNTS else None
    )
    text = example.sample is None
    budgets = config.text_budgets if text else config.needle_budgets

    def run(kept: dict[int, torch.Tensor]) -> tuple[str | None, float]:
        """The greedy answer (needles; None for text) and the gold future's NLL under ``kept``."""
        with prompt_mask(model, kept):
            nll = future_nll(model, prefilled, example.question_ids, example.future_ids)
            if text:
                return None, nll
            tokens = greedy_continue(
                model,
                copy.deepcopy(prefilled.cache),
                prefilled.next_token_logits[0],
                example.question_ids,
                MAX_NEW_TOKENS[example.sample.task],
            )
            return tokenizer.decode(tokens, skip_special_tokens=True), nll

    answers = {FULL: run({})}
    layer_share = {}
    for budget in budgets:
        for mode in MODES:
            kept = allocate(
                importance,
                budget,
                mode,
                config.min_per_head,
                config.sink_tokens,
                config.window_tokens,
                ranking=ranking,
            )
            answers[budget_key(mode, budget)] = run(kept)
            if mode == "head":
                layer_share[str(budget)] = [round(kept[layer].float().mean().item(), 5) for layer in kept]
    nll = {key: value for key, (_, value) in answers.items()}
    record = {
        "uid": example.uid,
        "source": example.source.removesuffix("-after"),
        "protocol": protocol_of(example),
        "prompt_tokens": len(example.prompt_ids),
        "future_tokens": len(example.question_ids) + len(example.future_ids),
        "tokens": tokens_digest(example),
        "head_layer_share": layer_share,
    }
    if text:
        return {**record, "nll": nll}
    predictions = {key: prediction for key, (prediction, _) in answers.items()}
    return {
        **record,
        "answers": list(example.sample.answers),
        "predictions": predictions,
        "scores": {key: ruler.score(example.sample, prediction) for key, prediction in predictions.items()},
        "nll": nll,
    }


def future_nll(model, prefilled, question_ids: list[int], answer_ids: list[int]) -> float:
    """Mean NLL per token of ``answer_ids`` teacher-forced after the prefilled prompt and
    ``question_ids``, on a copy of the prefill's cache."""
    sequence = torch.tensor([question_ids + answer_ids], device=prefilled.input_ids.device)
    cache = copy.deepcopy(prefilled.cache)
    return continuation_nll(model, prefilled, cache, sequence, scored=len(answer_ids)).item()


# -- the run and its summary -------------------------------------------------------------------


def expected_keys(config: HeadroomConfig, protocol: str) -> set[str]:
    budgets = config.text_budgets if protocol == PERPLEXITY else config.needle_budgets
    return {FULL} | {budget_key(mode, budget) for mode in MODES for budget in budgets}


def read_records(path: Path, fingerprint: str) -> dict[str, dict]:
    """The latest record of each uid made under ``fingerprint`` (a torn last line is ignored)."""
    found = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("fingerprint") == fingerprint:
                found[record["uid"]] = record
    return found


def run_headroom(
    config: HeadroomConfig, model=None, tokenizer=None, command: list[str] | None = None
) -> dict:
    """Measure every example not yet in the JSONL, then write the summary files.

    command: the command line recorded in the provenance (default: ``sys.argv``).
    """
    if model is None:
        model, tokenizer = load_model(config.model)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / config.stem()
    scorer = score_source(config)
    log = stem.with_suffix(".jsonl")
    fingerprint = config.fingerprint()
    done = read_records(log, fingerprint)
    items = examples(config, tokenizer)
    records = []
    for example in tqdm(items, desc=f"headroom {config.model}", unit="example"):
        old = done.get(example.uid)
        protocol = protocol_of(example)
        fields = ["nll"] if protocol == PERPLEXITY else ["nll", "scores"]
        complete = old and all(expected_keys(config, protocol) <= set(old.get(f, {})) for f in fields)
        if complete and old["tokens"] == tokens_digest(example):
            records.append(old)
            continue
        start, cpu = time.perf_counter(), time.process_time()
        record = measure(model, tokenizer, example, config, scorer)
        record.update(
            seconds=round(time.perf_counter() - start, 2),
            cpu_seconds=round(time.process_time() - cpu, 2),
            fingerprint=fingerprint,
        )
        torn = log.exists() and log.stat().st_size > 0 and not log.read_bytes().endswith(b"\n")
        with log.open("a", encoding="utf-8") as handle:
            # After an interrupted write, start on a new line so the torn one stays alone.
            handle.write(("\n" if torn else "") + json.dumps(record) + "\n")
        records.append(record)
    policy = scorer.policy if config.scores != ORACLE and SCORER_OF[config.scores] == "kvp" else None
    dtype = str(next(model.parameters()).dtype)
    result = {
        "provenance": provenance(config.model, dtype, "cpu", policy=policy, command=command),
        "config": portable_config(config),
        "modes": list(MODES),
        "reference": REFERENCE,
        "evicting_layers": evicting_layer_indices(model.config),
        **summarize(records, config),
        "records": records,
    }
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    stem.with_suffix(".md").write_text(markdown_report(result), encoding="utf-8")
    return result


def groups(records: list[dict], protocol: str) -> dict[str, list[dict]]:
    """One protocol's records by source, then all of them pooled under :data:`ALL`."""
    chosen = [r for r in records if r["protocol"] == protocol]
    by_source: dict[str, list[dict]] = {}
    for record in chosen:
        by_source.setdefault(record["source"], []).append(record)
    return {**dict(sorted(by_source.items())), **({ALL: chosen} if chosen else {})}


METRICS = {"nll": "NLL increase per token", "scores": "accuracy"}
"""Record fields summarized: the gold future's NLL (text and needles), needle answer scores."""


def summarize(records: list[dict], config: HeadroomConfig) -> dict:
    """``rows``: mean and 95% CI per (metric, protocol, source, mode, budget): ``nll``, the gold
    future's NLL per token minus the full cache's (bootstrap), or ``scores``, needle accuracy
    (Wilson); ``paired``: every other mode minus :data:`REFERENCE` on the same examples
    (bootstrap); ``head_layer_share``: the mean share of each evicting layer's entries the
    ``head`` allocation keeps, over the text windows."""
    rows, paired = [], []
    for protocol in (PERPLEXITY, *config.protocols):
        budgets = config.text_budgets if protocol == PERPLEXITY else config.needle_budgets
        for metric in ["nll"] if protocol == PERPLEXITY else ["scores", "nll"]:
            nll = metric == "nll"
            for source, group in groups(records, protocol).items():
                where = {"metric": metric, "protocol": protocol, "source": source, "n": len(group)}
                full = [r[metric][FULL] for r in group]
                rows.append({**where, "mode": FULL, "budget": None, **mean_row(full, nll)})
                for budget in budgets:
                    values = {m: [r[metric][budget_key(m, budget)] for r in group] for m in MODES}
                    for mode in MODES:
                        change = (
                            [v - f for v, f in zip(values[mode], full, strict=True)] if nll else values[mode]
                        )
                        rows.append({**where, "mode": mode, "budget": budget, **mean_row(change, nll)})
                        if mode != REFERENCE:
                            difference = [a - b for a, b in zip(values[mode], values[REFERENCE], strict=True)]
                            paired.append(
                                {**where, "mode": mode, "against": REFERENCE, "budget": budget,
                                 **mean_row(difference, True)}
                            )  # fmt: skip
    windows = [r for r in records if r["protocol"] == PERPLEXITY]
    share = {}
    for budget in config.text_budgets if windows else []:
        per_window = torch.tensor([r["head_layer_share"][str(budget)] for r in windows])
        share[str(budget)] = per_window.mean(0).tolist()
    return {"rows": rows, "paired": paired, "head_layer_share": share}


def mean_row(values: list[float], bootstrap: bool) -> dict:
    interval = bootstrap_interval(values) if bootstrap else wilson_interval(values)
    return {"mean": sum(values) / len(values), "ci95": list(interval)}


def cell(row: dict | None) -> str:
    """A table cell: accuracy % (CI), the full cache's NLL, or a signed NLL change (CI)."""
    if row is None:
        return "-"
    if row["metric"] == "scores" and "against" not in row:
        low, high = row["ci95"]
        return f"{100 * row['mean']:.0f} ({100 * low:.0f}-{100 * high:.0f})"
    if row["mode"] == FULL:
        return f"NLL {row['mean']:.3f}"
    return signed_interval(row["mean"], row["ci95"])


def markdown_report(result: dict) -> str:
    """The tables of ``headroom_<model>.md``."""
    config = result["config"]
    kind = config.get("scores", ORACLE)  # summaries written before --scores existed are the oracle's
    rows = {(r["metric"], r["protocol"], r["source"], r["mode"], r["budget"]): r for r in result["rows"]}
    paired = {(r["metric"], r["protocol"], r["source"], r["mode"], r["budget"]): r for r in result["paired"]}
    columns = [("nll", PERPLEXITY, b) for b in config["text_budgets"]]
    for metric in METRICS:
        columns += [(metric, p, b) for p in config["protocols"] for b in config["needle_budgets"]]
    present = [(m, p, b) for m, p, b in columns if (m, p, ALL, FULL, None) in rows]

    def label(metric: str, protocol: str, budget) -> str:
        what = (
            "text +NLL"
            if protocol == PERPLEXITY
            else f"{protocol} " + ("acc %" if metric == "scores" else "answer +NLL")
        )
        return f"{what} @{budget:g} (n={rows[metric, protocol, ALL, FULL, None]['n']})"

    def table(columns: list[tuple]) -> str:
        body = [[mode] + [cell(rows.get((m, p, ALL, mode, b))) for m, p, b in columns] for mode in MODES]
        body.append([FULL] + [cell(rows.get((m, p, ALL, FULL, None))) for m, p, _ in columns])
        return markdown_table(["allocation", *[label(*c) for c in columns]], body)

    sources = [s for (m, p, s, mode, b) in rows if p == PERPLEXITY and mode == FULL and s != ALL]
    per_corpus = [
        [f"{source} (n={rows['nll', PERPLEXITY, source, FULL, None]['n']}) {mode}"]
        + [cell(rows.get(("nll", PERPLEXITY, source, mode, b))) for b in config["text_budgets"]]
        for source in sources
        for mode in MODES
    ]
    every_budget = sorted({*config["text_budgets"], *config["needle_budgets"]})
    difference = [
        [f"{p} {s} {'accuracy' if m == 'scores' else 'NLL'} (n={rows[m, p, s, FULL, None]['n']}) {mode}"]
        + [cell(paired.get((m, p, s, mode, b))) for b in every_budget]
        for (m, p, s, full, _) in rows
        if full == FULL
        for mode in MODES
        if mode != REFERENCE
    ]
    minimum = config["min_per_head"] or (
        f"its {config['sink_tokens']} sinks and {config['window_tokens']} window tokens + {MIN_EXTRA_PER_HEAD}"
    )
    provenance_ = result["provenance"]
    lines = [
        f"# Headroom of adaptive budget allocation: {config['model']}, scores `{kind}`",
        "",
        f"Scores: {SCORE_KINDS[kind]}, at equal total KV entries under three allocations "
        f"(`kvp_cache.allocation`): "
        f"`uniform` (every head keeps its own top share: today's cache), `layer` (one global "
        f"sort sets each layer's total, split evenly over its heads) and `head` (one global top-k "
        f"over every layer, head and token; each head keeps at least {minimum}). Validation data "
        f"only: held-out documents of the training corpora "
        f"({', '.join(f'{k}={v}' for k, v in config['windows'].items())} windows of "
        f"{config['context_tokens']} + {config['continuation_tokens']} tokens) and `val`-split needles "
        f"({', '.join(config['tasks'])}, {config['samples']} each, about {config['needle_context']} tokens). "
        f"Text: NLL per continuation token minus the full cache's (bootstrap 95% CI); needles: accuracy "
        f"% (Wilson 95% CI) and the gold answer's NLL per token minus the full cache's. Budget = share "
        f"of the prompt's entries kept per head on average.",
        "",
        f"Command: `{provenance_['command']}` (commit {provenance_['git_commit']}, "
        f"{provenance_['threads']} thread(s)); wall time {total_seconds(result['records']) / 60:.1f} min.",
        "",
        table([c for c in present if (c[0], c[1]) == ("nll", PERPLEXITY) or c[0] == "scores"]),
        "",
    ]
    needles = [c for c in present if c[0] == "nll" and c[1] != PERPLEXITY]
    if needles:
        lines += ["## Needles: the gold answer's NLL increase (teacher-forced)", "", table(needles), ""]
    lines += [
        "## Text, per corpus (NLL increase over the full cache)",
        "",
        markdown_table(["corpus, allocation", *[f"@{b:g}" for b in config["text_budgets"]]], per_corpus),
        "",
        f"## Paired: allocation minus `{REFERENCE}` on the same examples (95% bootstrap CI)",
        "",
        "NLL: difference per token (negative: the allocation loses less). Accuracy: difference "
        "(positive: the allocation answers more).",
        "",
        markdown_table(["cell, allocation", *[f"@{b:g}" for b in every_budget]], difference),
    ]
    share = result["head_layer_share"]
    if share:
        lines += ["", "## Where `head` puts the entries (text): share kept of each evicting layer", ""]
        body = [[f"{float(b):g}", *[f"{v:.3f}" for v in values]] for b, values in share.items()]
        lines.append(markdown_table(["budget / layer", *result["evicting_layers"]], body))
    return "\n".join(lines) + "\n"


# -- several summaries side by side -------------------------------------------------------------

GENERATED_BEGIN = "<!-- tables generated by: {command} -->"
GENERATED_END = "<!-- end of generated tables -->"
NEEDLE_METRICS = {"scores": "accuracy", "nll": "answer NLL"}
"""A needle record's measures (its keys) and their names in the tables."""


def compare_tables(summaries: dict[str, dict], against: str | None = None) -> str:
    """Markdown tables putting headroom summaries (``{label: headroom_*.json content}``) side by side:
    text NLL increase per allocation, allocation minus ``uniform`` paired, every summary's allocations
    minus those of summary ``against`` on the examples they share (when given), where ``head`` puts
    the entries, and the needles' paired differences of the summaries that have them. Summaries
    without text windows (needles only) get the needle tables alone."""
    first = next(iter(summaries.values()))
    has_text = any(_text_all(r) and r["mode"] == FULL for r in first["rows"])
    lines = text_tables(summaries) if has_text else []
    if against is not None:
        lines += [versus_table(summaries, against), ""]
    if has_text:
        lines += share_table(summaries)
    needles = [
        (label, result)
        for label, result in summaries.items()
        if any(r["protocol"] != PERPLEXITY for r in result["rows"])
    ]
    if needles:
        needle_budgets = needles[0][1]["config"]["needle_budgets"]
        body = [
            [label, f"{protocol} {what}"]
            + [cell(_paired(result, metric, protocol, "head", b)) for b in needle_budgets]
            for label, result in needles
            for protocol in result["config"]["protocols"]
            for metric, what in NEEDLE_METRICS.items()
        ]
        lines += [
            "",
            f"## Needles: `head` − `{REFERENCE}` (accuracy: positive = more answers; answer NLL: negative = "
            "loses less)",
            "",
            markdown_table(["scores", "cell", *[f"@{b:g}" for b in needle_budgets]], body),
        ]
    return "\n".join(lines).strip("\n")


def text_tables(summaries: dict[str, dict]) -> list[str]:
    """The text NLL increase of every summary's allocations, and each allocation minus ``uniform``."""
    first = next(iter(summaries.values()))
    budgets = first["config"]["text_budgets"]
    text, paired = [], []
    for label, result in summaries.items():
        rows = {(r["mode"], r["budget"]): r for r in result["rows"] if _text_all(r)}
        differences = {(r["mode"], r["budget"]): r for r in result["paired"] if _text_all(r)}
        text += [[label, mode, *[cell(rows.get((mode, b))) for b in budgets]] for mode in MODES]
        paired += [
            [label, f"{mode} − {REFERENCE}", *[cell(differences.get((mode, b))) for b in budgets]]
            for mode in MODES
            if mode != REFERENCE
        ]
    full = next(r for r in first["rows"] if _text_all(r) and r["mode"] == FULL)
    return [
        f"## Text: NLL increase per token over the full cache (n = {full['n']}, bootstrap 95% CI; "
        f"full cache NLL {full['mean']:.3f})",
        "",
        markdown_table(["scores", "allocation", *[f"@{b:g}" for b in budgets]], text),
        "",
        f"## Paired on the same windows: allocation minus `{REFERENCE}` (negative: the allocation loses less)",
        "",
        markdown_table(["scores", "difference", *[f"@{b:g}" for b in budgets]], paired),
        "",
    ]


def share_table(summaries: dict[str, dict]) -> list[str]:
    """Where ``head`` puts the entries over the text windows: the share each layer keeps."""
    first = next(iter(summaries.values()))
    layers = first["evicting_layers"]
    # The first three layers one by one, the rest in up to two means (Gemma 3 270M evicts on 3 only).
    third = min(max(3, len(layers) // 3), len(layers) - 1)
    spans = [(f"layers {layers[3]}-{layers[third]} (mean)", slice(3, third + 1))] if len(layers) > 3 else []
    if third + 1 < len(layers):
        spans.append((f"layers {layers[third + 1]}-{layers[-1]} (mean)", slice(third + 1, None)))
    share = [
        [label, f"{float(b):g}", ", ".join(f"{v:.3f}" for v in values[:3])]
        + [f"{sum(values[part]) / len(values[part]):.3f}" for _, part in spans]
        for b in [str(b) for b in first["config"]["text_budgets"]]
        for label, result in summaries.items()
        if (values := result["head_layer_share"].get(b))
    ]
    return [
        "## Where `head` puts the entries: share kept per layer (mean over the windows)",
        "",
        markdown_table(
            ["scores", "budget", ", ".join(f"layer {layer}" for layer in layers[:3]), *[n for n, _ in spans]],
            share,
        ),
    ]


def versus_table(summaries: dict[str, dict], against: str) -> str:
    """Each summary's text NLL, needle accuracy and needle answer NLL under every allocation minus
    summary ``against``'s, paired on the examples both measured (same uid and tokens; bootstrap 95%
    CI): other scores, or another policy, on the same data."""
    if against not in summaries:
        raise ValueError(f"--against must be one of the labels {sorted(summaries)}, got {against!r}")

    def examples(result: dict, protocol: str) -> dict[tuple[str, str], dict]:
        return {(r["uid"], r["tokens"]): r for r in result["records"] if r["protocol"] == protocol}

    config = summaries[against]["config"]
    metrics = {PERPLEXITY: {"nll": "NLL"}} | {protocol: NEEDLE_METRICS for protocol in config["protocols"]}
    references = {protocol: examples(summaries[against], protocol) for protocol in metrics}
    text_budgets = config["text_budgets"] if references[PERPLEXITY] else []
    budgets = list(dict.fromkeys([*text_budgets, *config["needle_budgets"]]))
    others = {label: result for label, result in summaries.items() if label != against}
    body = []
    for (label, result), (protocol, measures) in itertools.product(others.items(), metrics.items()):
        reference = references[protocol]
        shared = [(r, reference[key]) for key, r in examples(result, protocol).items() if key in reference]
        if not shared:
            continue
        for (metric, what), mode in itertools.product(measures.items(), MODES):
            cells = []
            for b in budgets:
                key = budget_key(mode, b)
                if key not in shared[0][0][metric]:  # text and needles are measured at their own budgets
                    cells.append("-")
                    continue
                values = [r[metric][key] - o[metric][key] for r, o in shared]
                cells.append(
                    cell({"metric": metric, "mode": mode, "against": against, **mean_row(values, True)})
                )
            body.append(
                [f"{label} (n={len(shared)})", f"{protocol} {what}: {mode} − {against} {mode}", *cells]
            )
    return "\n".join(
        [
            f"## Paired against `{against}`: each allocation driven by other scores or another policy, on the "
            "shared examples (NLL: negative loses less; accuracy: positive answers more)",
            "",
            markdown_table(["scores", "difference", *[f"@{b:g}" for b in budgets]], body),
        ]
    )


def _text_all(row: dict) -> bool:
    return row["metric"] == "nll" and row["protocol"] == PERPLEXITY and row["source"] == ALL


def _paired(result: dict, metric: str, protocol: str, mode: str, budget) -> dict | None:
    return next(
        (
            r
            for r in result["paired"]
            if (r["metric"], r["protocol"], r["source"], r["mode"], r["budget"])
            == (metric, protocol, ALL, mode, budget)
        ),
        None,
    )


def rewrite_tables(report: Path, labelled: dict[str, str], against: str | None = None) -> None:
    """Replace the generated block of ``report`` (between its :data:`GENERATED_BEGIN` and
    :data:`GENERATED_END` lines) by :func:`compare_tables` of the ``{label: summary path}``."""
    text = report.read_text(encoding="utf-8")
    begin = GENERATED_BEGIN.split("{command}")[0]
    if begin not in text or GENERATED_END not in text:
        raise ValueError(f"{report} has no generated block: add the lines {begin!r}... and {GENERATED_END!r}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(GENERATED_END, 1)
    summaries = {
        label: json.loads(Path(path).read_text(encoding="utf-8")) for label, path in labelled.items()
    }
    specs = " ".join(f"{label}={portable_argument(path)}" for label, path in labelled.items())
    command = f"python -m eval.headroom --report {portable_argument(str(report))} --compare {specs}"
    command += f" --against {against}" if against else ""
    block = GENERATED_BEGIN.format(command=command) + "\n\n" + compare_tables(summaries, against) + "\n\n"
    report.write_text(head + block + GENERATED_END + tail, encoding="utf-8")


def total_seconds(records: list[dict]) -> float:
    return sum(r["seconds"] for r in records)


def build_parser() -> argparse.ArgumentParser:
    defaults = HeadroomConfig()
    parser = argparse.ArgumentParser(prog="python -m eval.headroom", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=defaults.model, help="'smollm2', 'gemma3-270m' or a model directory"
    )
    parser.add_argument("--out", default=defaults.out, help="folder for headroom_<model>.{jsonl,json,md}")
    parser.add_argument(
        "--windows",
        nargs="*",
        default=[f"{k}={v}" for k, v in defaults.windows.items()],
        metavar="CORPUS=COUNT",
        help="held-out text windows per training corpus (train.corpora)",
    )
    parser.add_argument("--context-tokens", type=int, default=defaults.context_tokens)
    parser.add_argument("--continuation-tokens", type=int, default=defaults.continuation_tokens)
    parser.add_argument("--text-budgets", type=comma_list(parse_budget), default=defaults.text_budgets)
    parser.add_argument("--tasks", type=comma_list(str), default=defaults.tasks)
    parser.add_argument("--samples", type=int, default=defaults.samples, help="needle samples per task")
    parser.add_argument("--needle-context", type=int, default=defaults.needle_context)
    parser.add_argument("--protocols", type=comma_list(str), default=defaults.protocols)
    parser.add_argument("--needle-budgets", type=comma_list(parse_budget), default=defaults.needle_budgets)
    parser.add_argument(
        "--min-per-head",
        type=int,
        default=None,
        help=f"entries every head keeps at least (default: its protected ones + {MIN_EXTRA_PER_HEAD})",
    )
    add_protected_tokens_arguments(parser)
    parser.add_argument("--val-fraction", type=float, default=defaults.val_fraction)
    parser.add_argument(
        "--essays-dir",
        default=None,
        help="Paul Graham essays *.txt as needle haystack (default: RULER noise)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--scores",
        choices=list(SCORE_KINDS),
        default=defaults.scores,
        help="what drives the allocation; results go to headroom_<model>_<scores>.* unless oracle",
    )
    parser.add_argument(
        "--policy", default=defaults.policy, help="the learned policy of kvp and kvp_raw (name or directory)"
    )
    parser.add_argument("--tag", default="", help="suffix of the results' file names")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="LABEL=SUMMARY",
        default=None,
        help="instead of measuring: regenerate the tables of --report from these headroom_*.json summaries",
    )
    parser.add_argument("--report", default=None, help="the report whose generated tables --compare rewrites")
    parser.add_argument(
        "--against",
        default=None,
        help="with --compare: a label the others are paired against, window by window",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        if not args.report:
            raise SystemExit("--compare needs --report (the markdown file whose tables it rewrites)")
        labelled = dict(spec.split("=", 1) for spec in args.compare)
        rewrite_tables(Path(args.report), labelled, args.against)
        return 0
    torch.set_num_threads(args.threads)
    values = {k: v for k, v in vars(args).items() if k in HeadroomConfig.__dataclass_fields__}
    config = HeadroomConfig(**{**values, "windows": parse_windows(args.windows)})
    result = run_headroom(config, command=None if argv is None else ["python -m eval.headroom", *argv])
    print(markdown_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
