"""PNG figures: eviction-cost curves (``evaluate``) and validation reward over training (``fit``)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def cost_curves(budgets: list[float], curves: dict[str, list[float]], path: str | Path, title: str) -> None:
    """Evicted share of future attention vs budget, one line per method; the oracle dashed."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in sorted(curves.items(), key=lambda item: -sum(item[1])):
        style = {"linestyle": "--", "color": "black"} if name == "oracle" else {}
        width = 2.5 if name.startswith("kvp") else 1.2
        ax.plot(budgets, values, label=name, linewidth=width, **style)
    ax.set_xlabel("budget (fraction of prompt tokens kept per head)")
    ax.set_ylabel("evicted share of future attention")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def training_curves(run_dir: str | Path, path: str | Path) -> None:
    """Validation reward of the EMA policy over steps: every layer (thin) and their mean (thick)."""
    records = sorted(Path(run_dir, "layers").glob("layer_*.json"))
    if not records:
        raise FileNotFoundError(f"no layer records under {run_dir}/layers; run `python -m train fit` first")
    histories = [json.loads(r.read_text()) for r in records]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for history in histories:
        ax.plot(history["eval_steps"], history["val_reward"], color="tab:blue", alpha=0.25, linewidth=0.8)
    steps = histories[0]["eval_steps"]
    same = [h for h in histories if h["eval_steps"] == steps]
    mean = [sum(h["val_reward"][i] for h in same) / len(same) for i in range(len(steps))]
    ax.plot(steps, mean, color="tab:red", linewidth=2.5, label=f"mean over {len(same)} layers")
    ax.set_xlabel("training step")
    ax.set_ylabel("validation reward (-cost / oracle cost; -1 = oracle)")
    ax.set_title("KVP policy (EMA, argsort) on held-out traces")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
