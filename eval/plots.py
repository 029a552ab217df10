"""Plots: a sweep's accuracy against budget, and the benchmark's accuracy and NLL increase against
budget with 95% interval bands, the full cache and the oracle as references."""

from __future__ import annotations

from pathlib import Path

from kvp_cache.scorers import methods


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
