"""The training record a KVP policy carries in config.json, and the model card rendered from it.

``training`` is a JSON-able dict saved with the policy (``policy.training_info``): how it was
trained (``data``, ``datasets``, ``steps``, ``command``, any other keys) and an optional
``evaluation`` table of eviction cost (and accuracy) per budget. :func:`model_card` turns it, with
the policy's architecture, into the Hub model card (``README.md``) written by ``save_pretrained``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from huggingface_hub import ModelCard, ModelCardData

from kvp_cache.agents import POSITION_STRATEGIES
from kvp_cache.policy_loading import is_hub_id
from kvp_cache.tables import markdown_table

if TYPE_CHECKING:
    from kvp_cache.policy import KVPolicy

PAPER_URL = "https://arxiv.org/abs/2602.10238"
LIBRARY_NAME = "kvp_cache"
LICENSE = "apache-2.0"
TAGS = ["kv-cache-compression", "kv-cache-eviction", "kvp"]


def check_training(training: dict | None) -> dict:
    """Validate the ``training`` record (JSON-able dict) and its ``evaluation`` table; return it (``{}`` for None)."""
    if training is None:
        return {}
    if not isinstance(training, dict):
        raise ValueError(
            f"training must be a dict (a JSON-able record of the training run) or None, got {training!r}"
        )
    try:
        json.dumps(training)
    except TypeError as error:
        raise ValueError(f"training must be JSON-serialisable: {error}") from None
    datasets = training.get("datasets", [])
    if not isinstance(datasets, list) or not all(isinstance(d, str) for d in datasets):
        raise ValueError(f"training['datasets'] must be a list of Hub dataset ids, got {datasets!r}")
    if "evaluation" in training:
        check_evaluation(training["evaluation"])
    return training


def check_evaluation(evaluation: dict) -> None:
    """Validate ``training["evaluation"]``.

    Schema: ``{"budgets": [b1, ...], "methods": {name: [eviction cost at each budget]},
    "accuracy": {name: [accuracy at each budget]} (optional), "data": str (optional),
    "accuracy_task": str (optional)}``. Budgets are token counts or fractions of the prompt.
    """
    if not isinstance(evaluation, dict) or not isinstance(evaluation.get("budgets"), list):
        raise ValueError("training['evaluation'] must be a dict with a 'budgets' list")
    budgets = evaluation["budgets"]
    for table in ("methods", "accuracy"):
        rows = evaluation.get(table, {})
        if table == "methods" and not rows:
            raise ValueError("training['evaluation']['methods'] must map method names to costs per budget")
        if not isinstance(rows, dict):
            raise ValueError(
                f"training['evaluation'][{table!r}] must be a dict {{method: [value per budget]}}"
            )
        for name, values in rows.items():
            if not isinstance(values, list) or len(values) != len(budgets):
                raise ValueError(
                    f"training['evaluation'][{table!r}][{name!r}] must list one value per budget "
                    f"({len(budgets)}), got {values!r}"
                )


def evaluation_table(budgets: list, rows: dict[str, list], lower_is_better: bool = True) -> str:
    """Methods as rows, best mean first (config.json stores them by name), budgets as columns:
    ``rows`` maps a method to its value at each budget."""
    ranked = sorted(rows.items(), key=lambda row: sum(row[1]) / len(row[1]), reverse=not lower_is_better)
    return markdown_table(["method", *budgets], [[name, *values] for name, values in ranked])


def model_card_body(policy: KVPolicy, repo_id: str | None = None) -> str:
    """Markdown of the model card below the YAML header."""
    base = policy.base_model or "<the base model>"
    where = repo_id or "path/to/this/policy"
    training = policy.training_info
    parts = [
        f"# KVP eviction policy for {base}",
        "",
        f"A learned KV-cache eviction policy (KVP, [Learning to Evict from Key-Value Cache]({PAPER_URL})) "
        f"for `kvp_cache`. One small MLP per (layer, KV head) scores every cached entry from its key, "
        f"value and position; the cache keeps the top-scored entries of each head after the prefill.",
        "",
        "## Usage",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "from kvp_cache import KVPCache",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{base}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{base}")',
        f'cache = KVPCache.from_pretrained("{where}", model=model, budget=0.25)',
        'inputs = tokenizer("...a long prompt...", return_tensors="pt")',
        "output = model.generate(**inputs, cache=cache, max_new_tokens=64)  # past_key_values= before 5.24",
        "```",
        "",
        "## Architecture",
        "",
        f"- base model: `{policy.base_model or 'unknown'}`",
        f"- {evicting_layers(policy)} x {policy.num_kv_heads} KV heads (head_dim {policy.head_dim}), "
        f"{len(policy.layer_indices) * policy.num_kv_heads} agents, {policy.num_parameters():,} parameters "
        f"({policy.num_parameters() * 4 / 1e6:.2f} MB in float32)",
        f"- agent: hidden_dim {policy.hidden_dim}, pos_dim {policy.pos_dim}, max_positions "
        f"{policy.max_positions}, num_mlp_layers {policy.num_mlp_layers}",
        f"- position_strategy `{policy.position_strategy}`: {POSITION_STRATEGIES[policy.position_strategy]}",
    ]
    if policy.trained_length is not None:
        parts.append(
            f"- trained on prompts of up to {policy.trained_length} tokens: longer prompts read the position "
            "table only up to the last row those prompts reached"
        )
    if policy.age_decay:
        parts.append(
            f"- age_decay {policy.age_decay:g}: when the cache evicts again (`max_cache_tokens`, chunked "
            f"prefill, later turns) it ranks score - {policy.age_decay:g} * log2(1 + age), age the tokens read "
            "since the entry entered; a single prefill ranks by the score alone"
        )
    parts += calibration_section(policy)
    parts += ["", "## Training", ""]
    if not training:
        parts.append("No training record: this policy may be untrained.")
    else:
        labels = {"data": "data", "datasets": "datasets", "steps": "steps", "command": "command"}
        for key, label in labels.items():
            if key in training:
                value = training[key]
                shown = f"`{value}`" if key == "command" else ", ".join(value) if key == "datasets" else value
                parts.append(f"- {label}: {shown}")
        for key, value in training.items():
            if key not in labels and key != "evaluation":
                parts.append(f"- {key}: {json.dumps(value)}")
    evaluation = training.get("evaluation")
    if evaluation:
        parts += ["", "## Evaluation", ""]
        if "data" in evaluation:
            parts += [f"On {evaluation['data']}.", ""]
        parts += [
            "Eviction cost per budget (lower is better):",
            "",
            evaluation_table(evaluation["budgets"], evaluation["methods"]),
        ]
        if evaluation.get("accuracy"):
            task = evaluation.get("accuracy_task", "the downstream task")
            parts += ["", f"Accuracy on {task} per budget (higher is better):", ""]
            parts.append(
                evaluation_table(evaluation["budgets"], evaluation["accuracy"], lower_is_better=False)
            )
    return "\n".join(parts) + "\n"


def calibration_section(policy: KVPolicy) -> list[str]:
    """Model-card lines on the policy's calibration (none without one)."""
    calibration = policy.calibration
    if calibration is None:
        return []
    lines = [
        "",
        "## Calibration",
        "",
        "`calibration.safetensors` holds a temperature and a weight per (layer, KV head): "
        "`weight * softmax(score / temperature)` over a head's entries estimates each entry's share of "
        "the future attention, comparable across heads and layers (`KVPolicy.cross_head_scores`), "
        "for allocations that move budget between heads.",
        "",
        f"- temperature: {_spread(calibration.temperature)}",
        f"- weight: {_spread(calibration.weight)}",
    ]
    return lines + [f"- {key}: {json.dumps(value)}" for key, value in calibration.record.items()]


def _spread(values) -> str:
    return (
        f"median {values.median().item():.3g}, range {values.min().item():.3g} to {values.max().item():.3g}"
    )


def model_card(policy: KVPolicy, tags: list[str], repo_id: str | None = None) -> ModelCard:
    """The model card: YAML metadata, usage, architecture, training record and evaluation tables.

    ``tags``: the card's tags (:data:`TAGS` plus those the Hub mixin adds); ``repo_id`` goes in the
    usage example.
    """
    data = ModelCardData(
        library_name=LIBRARY_NAME,
        license=LICENSE,
        tags=sorted(tags),
        base_model=policy.base_model if is_hub_id(policy.base_model) else None,
        datasets=list(policy.training_info.get("datasets", [])) or None,
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{model_card_body(policy, repo_id)}")


def evicting_layers(policy) -> str:
    """The layers that have agents: "30 layers", or "3 of 18 layers (5, 11, 17)" for a hybrid model."""
    if len(policy.layer_indices) == policy.num_layers:
        return f"{policy.num_layers} layers"
    listed = ", ".join(map(str, policy.layer_indices))
    return f"{len(policy.layer_indices)} of {policy.num_layers} layers ({listed})"
