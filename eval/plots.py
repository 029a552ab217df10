"""Accuracy-vs-budget plot of a sweep result, with the full cache as a reference line."""

from __future__ import annotations

from pathlib import Path

from kvp_cache.scorers import make_scorer


def _uses_queries(method: str) -> bool:
    """Query-aware methods see the prompt's attention (the paper draws them dashed)."""
    return method != "kvp" and make_scorer(method).needs_queries


def plot_accuracy_vs_budget(result: dict, path: Path) -> None:
    """One line per method over the budgets of ``result['tables']['all']``; dashed = uses prompt queries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = result["config"]
    table = result["tables"]["all"]
    budgets = config["budgets"]
    fractions = all(isinstance(b, float) for b in budgets)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in config["methods"]:
        ax.plot(
            budgets,
            [100 * table[method][str(b)] for b in budgets],
            marker="o",
            linestyle="--" if _uses_queries(method) else "-",
            linewidth=2.5 if method == "kvp" else 1.5,
            label=method,
        )
    ax.axhline(100 * table["full"], color="black", linestyle=":", label="full cache")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel(
        "budget (fraction of prompt tokens kept per head)" if fractions else "budget (tokens kept per head)"
    )
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-2, 102)
    protocol = "question after compression" if config["question_after"] else "question in compressed prefill"
    ax.set_title(
        f"RULER-style {', '.join(config['tasks'])}, {config['context_tokens']} tokens, {protocol}", fontsize=9
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
