"""Plots: a sweep's accuracy against budget, the benchmark's accuracy and NLL increase against
budget with 95% interval bands, the full cache and the oracle as references, and its real-text NLL
increase against the KV bytes held, uniform and adaptive allocation side by side."""

from __future__ import annotations

from pathlib import Path

from eval.benchmark_config import PERPLEXITY, UNIFORM, split_row
from kvp_cache.scorers import methods

ALLOCATION_STYLES = {UNIFORM: ("-", "o"), "head": ("--", "s"), "layer": (":", "^")}
"""Line style and marker of each allocation in the KV-bytes plot (colour: the method)."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style(method: str) -> dict:
    """Query-aware methods dashed (they see the prompt's attention, as the paper draws them);
    learned ones thick."""
    return {
        "linestyle": "--" if method in methods(query_aware=True) else "-",
        "linewidth": 2.5 if method in methods(learned=True) else 1.5,
    }


def _budget_axis(ax, budgets: list) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    fractions = all(isinstance(b, float) for b in budgets)
    ax.set_xlabel(
        "budget (fraction of prompt tokens kept per head)" if fractions else "budget (tokens kept per head)"
    )
    ax.grid(alpha=0.3)


def plot_accuracy_vs_budget(result: dict, path: Path) -> None:
    """A sweep: one line per method over the budgets of ``result['tables']['all']``."""
    plt = _pyplot()
    config = result["config"]
    table = result["tables"]["all"]
    budgets = config["budgets"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in config["methods"]:
        ax.plot(
            budgets,
            [100 * table[method][str(b)] for b in budgets],
            marker="o",
            label=method,
            **_style(method),
        )
    ax.axhline(100 * table["full"], color="black", linestyle=":", label="full cache")
    _budget_axis(ax, budgets)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-2, 102)
    protocol = "question after compression" if config["question_after"] else "question in compressed prefill"
    ax.set_title(
        f"RULER-style {', '.join(config['tasks'])}, {config['context_tokens']} tokens, {protocol}", fontsize=9
    )
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _panel(ax, rows: list[dict], budgets: list, scale: float) -> None:
    """Lines with interval bands for every compressed method; the full cache and oracle as references."""
    by_method: dict[str, list[dict]] = {}
    for row in rows:
        by_method.setdefault(row["method"], []).append(row)
    for method, found in by_method.items():
        found = sorted((r for r in found if r["budget"] is not None), key=lambda r: r["budget"])
        if method == "full":
            row = by_method["full"][0]
            ax.axhline(scale * row["score"], color="black", linestyle=":", label="full cache")
            ax.axhspan(scale * row["ci95"][0], scale * row["ci95"][1], color="black", alpha=0.06)
            continue
        x = [r["budget"] for r in found]
        style = (
            {"color": "black", "linestyle": "-.", "linewidth": 2} if method == "oracle" else _style(method)
        )
        (line,) = ax.plot(
            x, [scale * r["score"] for r in found], marker="o", markersize=3, label=method, **style
        )
        low = [scale * r["ci95"][0] for r in found]
        high = [scale * r["ci95"][1] for r in found]
        ax.fill_between(x, low, high, color=line.get_color(), alpha=0.12)
    _budget_axis(ax, budgets)


def _grid(
    result: dict, panels: list[tuple[str, list[dict]]], path: Path, ylabel: str, scale: float, columns: int
):
    plt = _pyplot()
    panels = [(title, rows) for title, rows in panels if rows]
    if not panels:
        return
    grid_rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(grid_rows, columns, figsize=(4.6 * columns, 3.6 * grid_rows), squeeze=False)
    for ax, (title, rows) in zip(axes.flat, panels, strict=False):
        _panel(ax, rows, result["config"]["budgets"], scale)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(labels) > 7), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_benchmark_accuracy(result: dict, path: Path) -> None:
    """Accuracy (all tasks pooled) against budget: one panel per protocol and context length."""
    config = result["config"]
    panels = [
        (
            f"{protocol.replace('_', ' ')}, {length} tokens",
            [
                r
                for r in result["rows"]
                if r["protocol"] == protocol and r["context_tokens"] == length and r.get("task") == "all"
            ],
        )
        for protocol in config["protocols"]
        for length in config["contexts"]
    ]
    _grid(result, panels, path, "accuracy (%)", 100.0, max(1, len(config["contexts"])))


def plot_benchmark_nll(result: dict, path: Path) -> None:
    """Real-text NLL increase per token against budget: one panel per corpus and prefix length."""
    config = result["config"]
    panels = [
        (
            f"{corpus}, {length}-token prefix",
            [
                r
                for r in result["rows"]
                if r["protocol"] == "perplexity"
                and r["context_tokens"] == length
                and r.get("corpus") == corpus
            ],
        )
        for length in config["text_contexts"]
        for corpus in ["all", *config["corpora"]]
    ]
    _grid(result, panels, path, "NLL increase (nats/token)", 1.0, len(config["corpora"]) + 1)


def plot_nll_vs_kv_bytes(result: dict, path: Path) -> bool:
    """Real-text NLL increase against the KV bytes held (share of the full cache's), one panel per
    corpus (all pooled first) and prefix length: a colour per method, a line style per allocation, so
    each adaptive row sits beside its uniform one at the same bytes. Rows without measured bytes
    (``kv_share``, benchmarks before they were measured) are left out; returns whether any was drawn."""
    rows = [
        r
        for r in result["rows"]
        if r["protocol"] == PERPLEXITY and "kv_share" in r and r["budget"] is not None
    ]
    if not rows:
        return False
    plt = _pyplot()
    config = result["config"]
    panels = [
        (corpus, length, [r for r in rows if r["context_tokens"] == length and r["corpus"] == corpus])
        for length in config["text_contexts"]
        for corpus in ["all", *config["corpora"]]
    ]
    panels = [panel for panel in panels if panel[2]]
    columns = min(len(panels), len(config["corpora"]) + 1)
    grid_rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(grid_rows, columns, figsize=(4.6 * columns, 3.6 * grid_rows), squeeze=False)
    bases = list(dict.fromkeys(split_row(r["method"])[0] for r in rows))
    colours = {"oracle": "black"} | {m: f"C{i}" for i, m in enumerate(b for b in bases if b != "oracle")}
    for ax, (corpus, length, found) in zip(axes.flat, panels, strict=False):
        for method in dict.fromkeys(r["method"] for r in found):
            base, allocation = split_row(method)
            line = sorted((r for r in found if r["method"] == method), key=lambda r: r["kv_share"])
            linestyle, marker = ALLOCATION_STYLES[allocation]
            x = [100 * r["kv_share"] for r in line]
            ax.plot(x, [r["score"] for r in line], linestyle=linestyle, marker=marker, markersize=3,
                    color=colours[base], label=method, linewidth=2.5 if base in methods(learned=True) else 1.5)  # fmt: skip
            ax.fill_between(x, [r["ci95"][0] for r in line], [r["ci95"][1] for r in line], color=colours[base],
                            alpha=0.08)  # fmt: skip
        ax.set_xscale("log")
        ax.minorticks_off()
        # One tick per budget (methods that store scores hold a little more): the smallest share.
        by_budget: dict = {}
        for r in found:
            by_budget[r["budget"]] = min(by_budget.get(r["budget"], 1.0), r["kv_share"])
        shares = sorted(round(100 * share, 1) for share in by_budget.values())
        ax.set_xticks(shares, [f"{share:g}" for share in shares])
        ax.set_xlabel("KV bytes held (% of the full cache's)")
        ax.set_ylabel("NLL increase (nats/token)")
        ax.set_title(f"{corpus}, {length}-token prefix", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * ((len(labels) - 1) // 6), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
