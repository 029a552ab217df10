"""Budget sweep: accuracy of every (method, budget) on offline RULER-style tasks, one prefill per sample.

Each sample's prompt is prefilled ONCE (:func:`kvp_cache.prefill.prefill`, which also captures the
prompt queries); every (method, budget) then gets its own compressed cache from that prefill
(``KVPCache.from_prefill``). The caches of one budget keep the same number of entries, so they
are stacked into one batch and decoded greedily together. The full-cache answer, from an uncompressed copy
of the prefill, is the reference. The same outputs come from one ``model.generate`` per
(method, budget), which re-runs the prefill every time. The sweep times that path for
``separate_runs`` of the grid's answers (spread over the grid) on its first ``separate_samples``
samples, checks it gives the same answers, and extrapolates its mean cost per answer to the
whole sweep.

Protocols (``question_after``): False (the paper's RULER protocol) compresses the whole prompt,
question included; True compresses the context only and appends the question, the chat
template's generation prompt and the answer prefix uncompressed: caches are built with
``compress="first_prefill"``, so the question goes in as one forward (``question_whole=False``
feeds it token by token into default caches instead, the older and slower path, same answers).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from kvp_cache import KVPCache, ruler
from kvp_cache.budget import Budget, validate_budget
from kvp_cache.cache import EvictingLayer
from kvp_cache.compat import cache_kwarg
from kvp_cache.integrations import append_uncompressed, forward_tokens
from kvp_cache.prefill import Prefill, generate_after_prefill, prefill
from kvp_cache.provenance import portable_config
from kvp_cache.scorers import Scorer, methods

FULL = "full"
"""The method name of the uncompressed reference in records and tables."""

# Enough for each task's answer (digits are single tokens in most tokenizers); generation also
# stops at EOS. RULER's own budgets, used by the lm-eval tasks, are larger.
MAX_NEW_TOKENS = {
    "niah_single": 16,
    "niah_multikey": 16,
    "niah_multivalue": 48,
    "niah_multiquery": 48,
    "vt": 32,
    "cwe": 48,
    "fwe": 24,
}


@dataclass
class SweepConfig:
    """What to sweep. ``methods`` may include learned ones (``kvp``) only together with ``policy``.

    Samples come from ``split`` (``test`` for reported numbers, ``val`` for checkpoint selection).
    """

    methods: list[str]
    budgets: list[Budget]
    tasks: list[str] = field(default_factory=lambda: ["niah_single"])
    context_tokens: int = 2048
    samples: int = 8
    question_after: bool = False
    policy: str | None = None
    essays_dir: str | None = None
    seed: int = 0
    split: str = "test"
    question_whole: bool = (
        True  # False: feed an after-compression question token by token (slower, same answers)
    )
    sink_tokens: int = 4
    window_tokens: int = 16
    max_new_tokens: int | None = None  # None: MAX_NEW_TOKENS per task
    separate_samples: int = 1  # first samples of the sweep also timed as separate runs (0: skip)
    separate_runs: int | None = None  # answers timed per such sample, spread over the grid (None: all)

    def __post_init__(self) -> None:
        check_methods(self.methods, self.policy)
        if not self.budgets:
            raise ValueError("budgets is empty; give fractions in (0, 1] or token counts >= 1")
        self.budgets = [validate_budget(b) for b in self.budgets]
        unknown = sorted(set(self.tasks) - set(ruler.TASKS))
        if not self.tasks or unknown:
            raise ValueError(
                f"tasks must be a non-empty subset of {', '.join(ruler.TASKS)}; got {self.tasks}"
            )
        for name in ("context_tokens", "samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        total = self.samples * len(self.tasks)
        if not 0 <= self.separate_samples <= total:
            raise ValueError(
                f"separate_samples must be in [0, {total}] (all samples), got {self.separate_samples}"
            )
        if self.separate_runs is not None and self.separate_runs < 1:
            raise ValueError(f"separate_runs must be >= 1 or None (all), got {self.separate_runs}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.split not in ruler.SPLITS:
            raise ValueError(f"split must be one of {', '.join(ruler.SPLITS)}, got {self.split!r}")

    def answer_tokens(self, task: str) -> int:
        """Greedy tokens decoded per answer of ``task``."""
        return self.max_new_tokens or MAX_NEW_TOKENS[task]


def check_methods(names: list[str], policy) -> None:
    """Raise ``ValueError`` for an empty, unknown or duplicated method list, or a learned method without ``policy``."""
    if not names:
        raise ValueError("methods is empty; choose from " + ", ".join(methods()))
    unknown = sorted(set(names) - set(methods()))
    if unknown:
        raise ValueError(f"unknown methods {unknown}; available: {', '.join(methods())}")
    if len(set(names)) != len(names):
        raise ValueError(f"methods has duplicates: {names}")
    learned = sorted(set(names) & set(learned_methods()))
    if learned and policy is None:
        raise ValueError(f"method {learned[0]!r} needs policy=<shipped name, directory or Hub id>")


@dataclass
class Prompt:
    """A sample's prompt ids: ``prefix`` ``[1, p]`` gets compressed, ``suffix`` ``[1, s]`` is appended after."""

    prefix: torch.Tensor
    suffix: torch.Tensor

    @property
    def full(self) -> torch.Tensor:
        return torch.cat([self.prefix, self.suffix], dim=-1)


def encode_prompt(sample: ruler.Sample, tokenizer, question_after: bool, device: torch.device) -> Prompt:
    prefix, suffix = ruler.chat_prompt(sample, tokenizer, question_in_context=not question_after)

    def ids(text: str) -> torch.Tensor:
        return torch.tensor(
            [tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=torch.long, device=device
        )

    return Prompt(ids(prefix), ids(suffix))


def stack_caches(caches: list[KVPCache]) -> KVPCache:
    """One batch-``len(caches)`` cache whose row ``i`` is ``caches[i]`` (each of batch 1).

    The caches must come from one prompt and keep the same number of entries per layer (one
    budget, any methods), so rows need no padding. Evicting layers concatenate every per-row field
    (``EvictingLayer.BATCH_FIELDS``); the other layers hold the same uncompressed prompt state in
    every cache and are repeated. Decoding the stack appends to every row, as decoding each cache
    alone would; the stack is for decoding only, so per-method state that only a later eviction
    reads (stored scores of some methods, recent queries) is dropped when the rows differ in it.
    """
    stacked = copy.deepcopy(caches[0])
    for i, layer in enumerate(stacked.layers):
        if not isinstance(layer, EvictingLayer):
            layer.batch_repeat_interleave(len(caches))
            continue
        rows = [cache.layers[i] for cache in caches]
        if len({(row.physical_length(), row.cumulative_length) for row in rows}) != 1:
            raise ValueError(
                f"layer {i}: caches differ in kept or seen tokens; stack caches of one prompt and budget"
            )
        for name in EvictingLayer.BATCH_FIELDS:
            values = [getattr(row, name) for row in rows]
            stacked_value = None if any(v is None for v in values) else torch.cat(values)
            setattr(layer, name, stacked_value)
        layer.recent_queries = None
    return stacked


@dataclass
class AnswerDecoder:
    """Greedy answers of one model under a protocol, from a shared prefill or from scratch.

    Every compressed cache comes from the one factory, ``KVPCache.from_prefill(prefilled, model,
    method=..., policy=...)`` (``KVPCache(model, method=..., policy=...)`` for from-scratch runs);
    ``method`` is a registry name or a ready :class:`~kvp_cache.scorers.Scorer` (the oracle).
    """

    model: PreTrainedModel
    tokenizer: object
    sink_tokens: int
    window_tokens: int
    policy: object = None
    question_whole: bool = True
    learned_options: dict = field(default_factory=dict)  # more KVPCache options of the learned methods

    def __post_init__(self) -> None:
        self.pad = {"pad_token_id": self.tokenizer.pad_token_id or self.tokenizer.eos_token_id}
        self.generate_kwargs = {**self.pad, "do_sample": False}

    def cache_options(self, method: str | Scorer, budget: Budget) -> dict:
        options = dict(
            method=method,
            budget=budget,
            sink_tokens=self.sink_tokens,
            window_tokens=self.window_tokens,
            compress="first_prefill" if self.question_whole else "every_prefill",
        )
        if isinstance(method, str) and method in learned_methods():
            options |= {"policy": self.policy, **self.learned_options}
        return options

    def compressed(self, prefilled: Prefill, methods: list, budget: Budget) -> KVPCache:
        """One batch row per method: its compressed cache of the prefill, all at ``budget``."""
        caches = [
            KVPCache.from_prefill(prefilled, self.model, **self.cache_options(m, budget)) for m in methods
        ]
        return stack_caches(caches)

    def full_answer(self, prefilled: Prefill, prompt: Prompt, max_new_tokens: int) -> str:
        """The reference: decoding from an uncompressed copy of the prefill."""
        cache = copy.deepcopy(prefilled.cache)
        if prompt.suffix.shape[1] == 0:
            tokens = generate_after_prefill(self.model, prefilled, cache, max_new_tokens, **self.pad)
        else:
            tokens = self.after_suffix(cache, prompt, max_new_tokens)
        return self.decode(tokens[0])

    def budget_answers(
        self, prefilled: Prefill, prompt: Prompt, methods: list, budget: Budget, max_new_tokens: int
    ) -> list[str]:
        """Every method's answer at ``budget``: one compressed cache each, decoded together as a batch.

        The first answer token comes from the exact prefill logits when the whole prompt was
        prefilled (:func:`kvp_cache.prefill.generate_after_prefill`).
        """
        cache = self.compressed(prefilled, methods, budget)
        rows = len(methods)
        if prompt.suffix.shape[1] > 0:
            tokens = self.after_suffix(cache, prompt, max_new_tokens, rows)
        else:
            input_ids = prefilled.input_ids.expand(rows, -1)
            batch = dataclasses.replace(
                prefilled,
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                next_token_logits=prefilled.next_token_logits.expand(rows, -1),
            )
            tokens = generate_after_prefill(self.model, batch, cache, max_new_tokens, **self.pad)
        return [self.decode(row) for row in tokens]

    def from_scratch(self, prompt: Prompt, method: str, budget: Budget | None, max_new_tokens: int) -> str:
        """One answer the way a single run gets it: its own prefill, then ``generate``."""
        if method == FULL:
            out = self.model.generate(prompt.full, max_new_tokens=max_new_tokens, **self.generate_kwargs)
            return self.decode(out[0, prompt.full.shape[1] :])
        cache = KVPCache(self.model, **self.cache_options(method, budget))
        if prompt.suffix.shape[1] == 0:
            kwargs = {cache_kwarg(self.model): cache, **self.generate_kwargs}
            out = self.model.generate(prompt.full, max_new_tokens=max_new_tokens, **kwargs)
            return self.decode(out[0, prompt.full.shape[1] :])
        forward_tokens(self.model, cache, prompt.prefix, logits_to_keep=1)
        return self.decode(self.after_suffix(cache, prompt, max_new_tokens)[0])

    def after_suffix(self, cache, prompt: Prompt, max_new_tokens: int, rows: int = 1) -> torch.Tensor:
        """Append the suffix uncompressed and generate after it; ``[rows, max_new_tokens]``.

        With ``question_whole`` ``generate`` feeds the suffix in one forward, which a
        ``compress="first_prefill"`` cache appends whole; otherwise all but its last token go in
        one at a time first (one-token forwards never evict).
        """
        if not self.question_whole:
            append_uncompressed(self.model, cache, prompt.suffix[:, :-1].expand(rows, -1))
        ids = prompt.full.expand(rows, -1)
        kwargs = {cache_kwarg(self.model): cache, **self.generate_kwargs}
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **kwargs
        )
        return out[:, ids.shape[1] :]

    def decode(self, tokens: torch.Tensor) -> str:
        ids = tokens.tolist()
        eos = self.tokenizer.eos_token_id
        if eos in ids:
            ids = ids[: ids.index(eos)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def learned_methods() -> list[str]:
    """Registry methods that need a trained policy (``policy=``)."""
    return methods(learned=True)


def all_answers(
    decoder: AnswerDecoder, prompt: Prompt, methods: list, budgets: list[Budget], max_new_tokens: int
) -> dict[tuple, str]:
    """:func:`answers_from_prefill` after ONE prefill of ``prompt.prefix``."""
    with torch.no_grad():
        prefilled = prefill(decoder.model, prompt.prefix)
    return answers_from_prefill(decoder, prefilled, prompt, methods, budgets, max_new_tokens)


@torch.no_grad()
def answers_from_prefill(
    decoder: AnswerDecoder,
    prefilled: Prefill,
    prompt: Prompt,
    methods: list,
    budgets: list[Budget],
    max_new_tokens: int,
) -> dict[tuple, str]:
    """``{(method name, budget): answer}`` for the full cache (``(FULL, None)``) and every (method,
    budget), all from ``prefilled``; ``methods`` are names or Scorer instances."""
    names = [m if isinstance(m, str) else m.name for m in methods]
    answers = {(FULL, None): decoder.full_answer(prefilled, prompt, max_new_tokens)}
    for budget in budgets:
        batch = decoder.budget_answers(prefilled, prompt, methods, budget, max_new_tokens)
        answers.update({(name, budget): a for name, a in zip(names, batch, strict=True)})
    return answers


def answer_records(task: str, index: int, sample: ruler.Sample, prompt: Prompt, answers: dict) -> list[dict]:
    return [
        {
            "task": task,
            "index": index,
            "method": method,
            "budget": budget,
            "prompt_tokens": prompt.full.shape[1],
            "prediction": prediction,
            "answers": sample.answers,
            "score": ruler.score(sample, prediction),
        }
        for (method, budget), prediction in answers.items()
    ]


def time_separate_runs(
    decoder: AnswerDecoder, prompt: Prompt, grid: list, answers: dict, max_new_tokens: int
):
    """Each grid answer again as its own run (own prefill, then generate): seconds and same-answer check."""
    runs = []
    for method, budget in grid:
        start = time.perf_counter()
        with torch.no_grad():
            prediction = decoder.from_scratch(prompt, method, budget, max_new_tokens)
        seconds = time.perf_counter() - start
        runs.append(
            {
                "method": method,
                "budget": budget,
                "seconds": seconds,
                "same_answer": prediction == answers[(method, budget)],
                "prediction": prediction,
            }
        )
    return runs


def run_sweep(model: PreTrainedModel, tokenizer, config: SweepConfig, policy=None) -> dict:
    """Run the sweep; returns a JSON-able dict with the config, per-answer records, tables and timings
    (the caller puts :func:`kvp_cache.provenance.provenance` on top)."""
    device = next(model.parameters()).device
    decoder = AnswerDecoder(
        model, tokenizer, config.sink_tokens, config.window_tokens, policy, config.question_whole
    )
    haystack = ruler.load_haystack(config.essays_dir)
    grid = [(FULL, None)] + [(m, b) for m in config.methods for b in config.budgets]
    records: list[dict] = []
    timing = {"sweep_seconds": {}, "separate": []}
    for task in config.tasks:
        samples = ruler.make_samples(
            task, tokenizer, config.context_tokens, config.samples, config.seed, haystack, split=config.split
        )
        max_new_tokens = config.answer_tokens(task)
        sweep_seconds = []
        for index, sample in enumerate(tqdm(samples, desc=f"sweep {task}", unit="sample")):
            prompt = encode_prompt(sample, tokenizer, config.question_after, device)
            start = time.perf_counter()
            answers = all_answers(decoder, prompt, config.methods, config.budgets, max_new_tokens)
            sweep_seconds.append(time.perf_counter() - start)
            records += answer_records(task, index, sample, prompt, answers)
            if len(timing["separate"]) < config.separate_samples:
                runs = time_separate_runs(
                    decoder, prompt, spread(grid, config.separate_runs), answers, max_new_tokens
                )
                timing["separate"].append(
                    {"task": task, "index": index, "sweep_seconds": sweep_seconds[-1], "runs": runs}
                )
        timing["sweep_seconds"][task] = sweep_seconds
    return {
        "config": portable_config(config),
        "records": records,
        "tables": accuracy_tables(records, config),
        "cost": cost_summary(timing, config, len(grid)),
        "timing": timing,
    }


def spread(grid: list, count: int | None) -> list:
    """``count`` entries of ``grid`` evenly spaced from first to last (all of it for None)."""
    if count is None or count >= len(grid):
        return list(grid)
    if count == 1:
        return [grid[0]]
    return [grid[round(i * (len(grid) - 1) / (count - 1))] for i in range(count)]


def accuracy_tables(records: list[dict], config: SweepConfig) -> dict:
    """Mean score per task and overall (mean over tasks): ``{scope: {method: {budget: acc}}}``.

    The full-cache entry is ``{scope: {"full": acc}}``.
    """
    tables: dict = {}
    for task in config.tasks + ["all"]:
        rows = [r for r in records if task == "all" or r["task"] == task]
        table = {}
        for method in [FULL] + config.methods:
            cells = {}
            for budget in [None] if method == FULL else config.budgets:
                if task == "all":
                    per_task = [_mean(rows, t, method, budget) for t in config.tasks]
                    cells[str(budget)] = sum(per_task) / len(per_task)
                else:
                    cells[str(budget)] = _mean(rows, task, method, budget)
            table[method] = cells[str(None)] if method == FULL else cells
        tables[task] = table
    return tables


def _mean(rows: list[dict], task: str, method: str, budget) -> float:
    scores = [
        r["score"] for r in rows if r["task"] == task and r["method"] == method and r["budget"] == budget
    ]
    return sum(scores) / len(scores)


def cost_summary(timing: dict, config: SweepConfig, runs_per_sample: int) -> dict:
    """The sweep's measured time against one separate run per answer (M x B + 1 full per sample).

    Separate runs are timed for some answers of the first ``separate_samples`` samples; their
    mean time per answer times the answers of those samples, or of the whole sweep, is the
    separate-runs cost (measured, not extrapolated, when every answer of those samples was timed).
    """
    sweep_total = sum(sum(s) for s in timing["sweep_seconds"].values())
    summary = {"runs_per_sample": runs_per_sample, "sweep_seconds": sweep_total, "separate_timed_samples": 0}
    timed = timing["separate"]
    if not timed:
        return summary
    runs = [run for t in timed for run in t["runs"]]
    per_answer = sum(run["seconds"] for run in runs) / len(runs)
    samples = sum(len(s) for s in timing["sweep_seconds"].values())
    same_samples_sweep = sum(t["sweep_seconds"] for t in timed)
    summary.update(
        {
            "separate_timed_samples": len(timed),
            "separate_timed_runs": len(runs),
            "separate_seconds_measured": sum(run["seconds"] for run in runs),
            "separate_seconds_per_answer": per_answer,
            "sweep_seconds_same_samples": same_samples_sweep,
            "ratio_same_samples": per_answer * runs_per_sample * len(timed) / same_samples_sweep,
            "separate_seconds_extrapolated": per_answer * runs_per_sample * samples,
            "ratio_extrapolated": per_answer * runs_per_sample * samples / sweep_total,
            "separate_answers_differing": sum(not run["same_answer"] for run in runs),
        }
    )
    return summary


def markdown_report(result: dict) -> str:
    """Tables (percent) per task and overall, then the cost comparison."""
    config = result["config"]
    budgets = [str(b) for b in config["budgets"]]
    protocol = (
        "question after compression" if config["question_after"] else "question inside the compressed prefill"
    )
    lines = [
        f"RULER-style accuracy (%), {config['context_tokens']}-token contexts, {config['samples']} samples per task, "
        f"{protocol}.",
        "",
    ]
    for scope, table in result["tables"].items():
        title = "mean over tasks (" + ", ".join(config["tasks"]) + ")" if scope == "all" else scope
        lines += [f"**{title}**", "", "| method | " + " | ".join(f"budget {b}" for b in budgets) + " |"]
        lines.append("|---|" + "---:|" * len(budgets))
        lines.append("| full cache | " + " | ".join(f"{100 * table[FULL]:.1f}" for _ in budgets) + " |")
        for method in config["methods"]:
            lines.append(
                f"| {method} | " + " | ".join(f"{100 * table[method][b]:.1f}" for b in budgets) + " |"
            )
        lines.append("")
    lines.append(cost_text(result["cost"]))
    return "\n".join(lines) + "\n"


def cost_text(cost: dict) -> str:
    text = f"Sweep: {cost['sweep_seconds']:.1f} s, {cost['runs_per_sample']} answers per sample from one prefill."
    if cost["separate_timed_samples"]:
        exact = cost["separate_timed_runs"] == cost["separate_timed_samples"] * cost["runs_per_sample"]
        how = "all answers timed" if exact else "extrapolated from the timed answers"
        text += (
            f" Separate runs (one generate per answer, the prefill repeated each time): "
            f"{cost['separate_timed_runs']} answers of {cost['separate_timed_samples']} samples timed "
            f"({cost['separate_seconds_measured']:.1f} s), {cost['ratio_same_samples']:.2f}x the sweep on those samples "
            f"({how}); over the whole sweep {cost['separate_seconds_extrapolated']:.1f} s, "
            f"{cost['ratio_extrapolated']:.2f}x the sweep. Timed answers differing between the two paths: "
            f"{cost['separate_answers_differing']} of {cost['separate_timed_runs']}."
        )
    return text


def write_outputs(result: dict, out: Path) -> dict[str, Path]:
    """``results.json``, ``table.md`` and ``accuracy_vs_budget.png`` under ``out``."""
    from eval.plots import plot_accuracy_vs_budget

    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "results.json",
        "markdown": out / "table.md",
        "plot": out / "accuracy_vs_budget.png",
    }
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["markdown"].write_text(markdown_report(result))
    plot_accuracy_vs_budget(result, paths["plot"])
    return paths
