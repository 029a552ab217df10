"""The learned KVP eviction policy: one small scoring MLP ("agent") per (layer, KV head).

Moschella et al., "Learning to Evict from Key-Value Cache" (arXiv 2602.10238). Each agent scores
one cached entry from its key, its value and its position; the cache keeps the top-scored
entries of each head. The agent follows the paper's released code (``KVSamplingGroupedQueryAgent``)::

    k_feat = LayerNorm(Linear(head_dim -> hidden)(k))
    v_feat = LayerNorm(Linear(head_dim -> hidden)(v))
    p_feat = LayerNorm(Embedding(max_positions, pos_dim)[position])
    h      = concat(k_feat, v_feat, p_feat)
    h      = SiLU(LayerNorm(Linear(h)))          # num_mlp_layers times, width hidden
    score  = Linear(hidden -> 1)(h)

All heads of a layer are one :class:`HeadAgents` module with stacked parameters, evaluated as
batched matrix products (no Python loop over heads). :class:`KVPolicy` holds one per model layer
and saves/loads through the Hugging Face Hub mixin, with safetensors only and strict key checks.

Positions are the index of a token among its row's real tokens (0..n-1). ``position_strategy``
says what happens past the embedding table (see :data:`POSITION_STRATEGIES`).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from huggingface_hub import ModelCard, ModelCardData, PyTorchModelHubMixin, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from torch import Tensor, nn
from transformers import PretrainedConfig

from kvp_cache.compat import text_config
from kvp_cache.provenance import sha256_of
from kvp_cache.tables import markdown_table

POLICIES_DIR = Path(__file__).resolve().parent / "policies"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
PICKLE_PATTERNS = ("pytorch_model.bin", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
PAPER_URL = "https://arxiv.org/abs/2602.10238"

POSITION_STRATEGIES = {
    "clamp": "positions >= max_positions share the last embedding row (the paper's code)",
    "scale": (
        "a row of n > max_positions real tokens is spread over the whole table (a relative position): "
        "position p reads fractional row p * (max_positions - 1) / (n - 1), linearly interpolating the "
        "position features of the two nearest rows; rows with n <= max_positions read exactly what "
        "'clamp' reads"
    ),
}

# Architecture keys config.json must hold; the rest of the config are optional settings and metadata.
ARCHITECTURE_KEYS = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "hidden_dim",
    "pos_dim",
    "max_positions",
    "num_mlp_layers",
)
OPTIONAL_KEYS = ("position_strategy", "base_model", "training", "kvp_cache_version")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_position_strategy(value: Any) -> None:
    if value not in POSITION_STRATEGIES:
        raise ValueError(f"position_strategy must be one of {sorted(POSITION_STRATEGIES)}, got {value!r}")


def _per_batch(weight: Tensor, batch: int) -> Tensor:
    """Per-head parameters ``[heads, ...]`` repeated for ``[batch * heads, ...]`` inputs (batch-major)."""
    return weight.repeat(batch, *(1,) * (weight.dim() - 1)) if batch > 1 else weight


class StackedLinear(nn.Module):
    """``heads`` independent ``Linear(in_dim -> out_dim)``: weight ``[heads, in, out]``, bias ``[heads, out]``."""

    def __init__(self, heads: int, in_dim: int, out_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, in_dim, out_dim))
        self.bias = nn.Parameter(torch.empty(heads, out_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default init, per head: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
        bound = 1.0 / math.sqrt(self.weight.shape[1])
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def centered_parameters(self) -> tuple[Tensor, Tensor]:
        """Weight and bias with their mean over the outputs removed, so every output vector has zero mean.

        Folding a following LayerNorm's centering into the weights leaves it only the RMS scaling,
        which runs much faster on CPU for narrow features than ``layer_norm``.
        """
        return self.weight - self.weight.mean(-1, keepdim=True), self.bias - self.bias.mean(-1, keepdim=True)

    def forward(self, x: Tensor, batch: int = 1, centered: bool = False) -> Tensor:
        """``[batch * heads, n, in]`` -> ``[batch * heads, n, out]``; ``centered``: minus the mean over outputs."""
        weight, bias = self.centered_parameters() if centered else (self.weight, self.bias)
        return torch.baddbmm(_per_batch(bias, batch)[:, None, :], x, _per_batch(weight, batch))


class StackedLayerNorm(nn.Module):
    """One ``LayerNorm(dim)`` per head: weight and bias ``[heads, dim]``."""

    def __init__(self, heads: int, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads, dim))
        self.bias = nn.Parameter(torch.zeros(heads, dim))

    def normalize(self, x: Tensor, centered: bool = False) -> Tensor:
        """LayerNorm without its affine; ``centered``: ``x`` has zero mean over its last dim already."""
        if centered:
            # An RMS norm in two passes over x (F.rms_norm takes four on CPU).
            mean_square = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.shape[-1]
            return x * torch.rsqrt(mean_square + self.eps)
        return F.layer_norm(x, x.shape[-1:], eps=self.eps)

    def forward(self, x: Tensor, batch: int = 1, centered: bool = False) -> Tensor:
        """``[batch * heads, n, dim]`` -> ``[batch * heads, n, dim]``."""
        weight, bias = _per_batch(self.weight, batch), _per_batch(self.bias, batch)
        return torch.addcmul(bias[:, None, :], self.normalize(x, centered), weight[:, None, :])


class MLPBlock(nn.Module):
    """``SiLU(LayerNorm(Linear(x)))`` per head."""

    def __init__(self, heads: int, in_dim: int, out_dim: int):
        super().__init__()
        self.linear = StackedLinear(heads, in_dim, out_dim)
        self.norm = StackedLayerNorm(heads, out_dim)

    def forward(self, x: Tensor, batch: int = 1) -> Tensor:
        """``[batch * heads, n, in]`` -> ``[batch * heads, n, out]``."""
        return F.silu(self.norm(self.linear(x, batch, centered=True), batch, centered=True))


class HeadAgents(nn.Module):
    """All KV heads of one layer, one agent each, evaluated as one batched op (no Python loop over heads).

    Args:
        num_heads: KV heads of the layer (one agent each).
        head_dim: size of each key and value vector.
        hidden_dim: width of the key/value features and of the MLP.
        pos_dim: size of the position embedding.
        max_positions: rows of the position embedding table.
        num_mlp_layers: Linear/LayerNorm/SiLU blocks before the output layer (>= 1).
        position_strategy: "clamp" or "scale", see :data:`POSITION_STRATEGIES`.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        hidden_dim: int,
        pos_dim: int,
        max_positions: int,
        num_mlp_layers: int,
        position_strategy: str,
    ):
        super().__init__()
        for name, value in (
            ("num_heads", num_heads),
            ("head_dim", head_dim),
            ("hidden_dim", hidden_dim),
            ("pos_dim", pos_dim),
            ("max_positions", max_positions),
            ("num_mlp_layers", num_mlp_layers),
        ):
            _check_positive_int(name, value)
        _check_position_strategy(position_strategy)
        self.num_heads, self.head_dim, self.max_positions = num_heads, head_dim, max_positions
        self.position_strategy = position_strategy
        self.key_proj = StackedLinear(num_heads, head_dim, hidden_dim)
        self.key_norm = StackedLayerNorm(num_heads, hidden_dim)
        self.value_proj = StackedLinear(num_heads, head_dim, hidden_dim)
        self.value_norm = StackedLayerNorm(num_heads, hidden_dim)
        # Embedding's default init, N(0, 1), per head.
        self.position_table = nn.Parameter(torch.randn(num_heads, max_positions, pos_dim))
        self.position_norm = StackedLayerNorm(num_heads, pos_dim)
        widths = [2 * hidden_dim + pos_dim] + [hidden_dim] * num_mlp_layers
        self.mlp = nn.ModuleList(MLPBlock(num_heads, widths[i], widths[i + 1]) for i in range(num_mlp_layers))
        self.out = StackedLinear(num_heads, hidden_dim, 1)

    def table_positions(self, positions: Tensor) -> Tensor:
        """Fractional table rows ``[batch, seq]`` (float32) for token positions ``[batch, seq]`` (-1 on padding)."""
        last = self.max_positions - 1
        rows = positions.clamp(min=0).float()
        if self.position_strategy == "scale":
            # n - 1 = the row's largest position; rows that fit in the table keep their exact indices.
            span = positions.amax(dim=-1, keepdim=True).clamp(min=last).float()
            rows = rows * (last / span)
        return rows.clamp(max=last)

    def forward(self, keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        """Score every entry of every head.

        keys, values: ``[batch, heads, seq, head_dim]``, any float dtype and device (cast to the
            agents' dtype).
        positions: ``[batch, seq]`` long, the index among the row's real tokens, -1 on padding.
        Returns float32 ``[batch, heads, seq]``; padding gets -inf.

        Computes exactly the module's definition (up to float rounding), arranged for speed:
        the LayerNorm affines feeding the first MLP Linear are folded into its weights, every
        Linear feeding a LayerNorm has that norm's centering folded in (leaving an RMS norm), and
        the position branch (LayerNorm and its slice of the first Linear) runs once per table
        row, not once per token; tokens gather their row's features.
        """
        if keys.dim() != 4 or keys.shape[1] != self.num_heads or keys.shape[-1] != self.head_dim:
            raise ValueError(
                f"keys must be [batch, {self.num_heads}, seq, {self.head_dim}], got {tuple(keys.shape)}"
            )
        if values.shape != keys.shape:
            raise ValueError(
                f"values must have the keys' shape {tuple(keys.shape)}, got {tuple(values.shape)}"
            )
        b, h, n, d = keys.shape
        if positions.shape != (b, n):
            raise ValueError(f"positions must be [batch, seq] = {(b, n)}, got {tuple(positions.shape)}")
        dtype = self.position_table.dtype
        positions = positions.to(keys.device)
        hidden = self.key_proj.weight.shape[-1]
        first = self.mlp[0]
        w_key, w_value, w_position = first.linear.weight.split(
            [hidden, hidden, self.position_table.shape[-1]], dim=1
        )
        # (LN(x) * g + beta) @ W = LN(x) @ (g[:, None] * W) + beta @ W, per head; then remove the
        # mean over the outputs from every term, so the LayerNorm that follows is an RMS norm.
        constant = first.linear.bias + (
            torch.bmm(self.key_norm.bias[:, None, :], w_key)
            + torch.bmm(self.value_norm.bias[:, None, :], w_value)
        ).squeeze(1)
        per_row = torch.bmm(self.position_norm(self.position_table), w_position) + constant[:, None, :]
        per_row = per_row - per_row.mean(-1, keepdim=True)
        w_key = self.key_norm.weight[:, :, None] * w_key
        w_value = self.value_norm.weight[:, :, None] * w_value
        w_key = _per_batch(w_key - w_key.mean(-1, keepdim=True), b)
        w_value = _per_batch(w_value - w_value.mean(-1, keepdim=True), b)

        def normalized_projection(x: Tensor, proj: StackedLinear, norm: StackedLayerNorm) -> Tensor:
            return norm.normalize(proj(x.to(dtype).reshape(b * h, n, d), b, centered=True), centered=True)

        pre = self.gather_rows(per_row, positions).reshape(b * h, n, hidden)
        pre = pre.baddbmm(normalized_projection(keys, self.key_proj, self.key_norm), w_key)
        pre = pre.baddbmm(normalized_projection(values, self.value_proj, self.value_norm), w_value)
        features = F.silu(first.norm(pre, b, centered=True))
        for block in self.mlp[1:]:
            features = block(features, b)
        scores = self.out(features, b).view(b, h, n).float()
        return scores.masked_fill((positions < 0)[:, None, :], float("-inf"))

    def gather_rows(self, per_row: Tensor, positions: Tensor) -> Tensor:
        """Each token's position features: ``per_row`` ``[heads, max_positions, f]`` -> ``[batch, heads, seq, f]``.

        "clamp" reads the token's row; "scale" interpolates linearly between the two rows around
        its fractional row.
        """
        rows = self.table_positions(positions)
        heads = torch.arange(self.num_heads, device=positions.device)[None, :, None]
        low = rows.floor().long()
        gathered = per_row[heads, low[:, None, :]]
        if self.position_strategy == "scale":
            high = (low + 1).clamp(max=self.max_positions - 1)
            fraction = (rows - low.float())[:, None, :, None].to(per_row.dtype)
            gathered = torch.lerp(gathered, per_row[heads, high[:, None, :]], fraction)
        return gathered


class KVPolicy(
    nn.Module,
    PyTorchModelHubMixin,
    library_name="kvp_cache",
    tags=["kv-cache-compression", "kv-cache-eviction", "kvp"],
    license="apache-2.0",
    paper_url=PAPER_URL,
):
    """The learned eviction policy of one LLM: a :class:`HeadAgents` per model layer.

    Args:
        num_layers, num_kv_heads, head_dim: the LLM's decoder (use :meth:`for_model`).
        hidden_dim, pos_dim, max_positions, num_mlp_layers: agent sizes (see :class:`HeadAgents`).
            The defaults are sized for SmolLM2-135M (bench/bench_policy.py): scoring all heads
            of a 4K prompt costs about 1% of its prefill on CPU, and the weights take 5.8 MB.
            Set ``max_positions`` to the training prompt length: table rows past the longest
            training prompt are never trained, while "clamp" and "scale" both map longer
            prompts onto trained rows.
        position_strategy: "clamp" (the paper) or "scale", see :data:`POSITION_STRATEGIES`;
            it has no weights, so it can be changed after loading (``policy.position_strategy = ...``).
        base_model: Hub id of the LLM the policy was trained for (checked by :meth:`check_compatible`).
        training: JSON-able record of how the policy was trained, saved in config.json and shown
            on the model card. Recognised keys: ``data`` (str), ``datasets`` (list of Hub dataset
            ids), ``steps`` (int), ``command`` (str), ``evaluation`` (see :func:`check_evaluation`);
            other keys are listed as they are. Stored as ``policy.training_info`` because
            ``nn.Module.training`` is the train/eval flag.

    ``forward(layer_idx, keys, values, positions)`` scores one layer: ``[batch, kv_heads, seq]``.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        hidden_dim: int = 32,
        pos_dim: int = 8,
        max_positions: int = 1024,
        num_mlp_layers: int = 2,
        position_strategy: str = "clamp",
        base_model: str = "",
        training: dict | None = None,
    ):
        super().__init__()
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            _check_positive_int(name, value)
        if not isinstance(base_model, str):
            raise ValueError(f"base_model must be a str (a Hub model id or ''), got {base_model!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.hidden_dim, self.pos_dim, self.max_positions = hidden_dim, pos_dim, max_positions
        self.num_mlp_layers = num_mlp_layers
        self.base_model = base_model
        self.training_info = check_training(training)
        self.layers = nn.ModuleList(
            HeadAgents(
                num_kv_heads, head_dim, hidden_dim, pos_dim, max_positions, num_mlp_layers, position_strategy
            )
            for _ in range(num_layers)
        )

    @property
    def position_strategy(self) -> str:
        return self.layers[0].position_strategy

    @position_strategy.setter
    def position_strategy(self, value: str) -> None:
        _check_position_strategy(value)
        for agents in self.layers:
            agents.position_strategy = value

    def forward(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        """Scores ``[batch, kv_heads, seq]`` (float32, -inf on padding) of layer ``layer_idx``."""
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be in [0, {self.num_layers - 1}], got {layer_idx}")
        return self.layers[layer_idx](keys, values, positions)

    @classmethod
    def for_model(cls, model_or_config: nn.Module | PretrainedConfig, **sizes) -> KVPolicy:
        """A freshly initialised policy shaped for ``model_or_config`` (a transformers model or config).

        ``sizes`` are the other ``__init__`` arguments (hidden_dim, ..., training, and base_model to
        override ``config.name_or_path``).
        """
        config = _config_of(model_or_config)
        derived = {"num_layers", "num_kv_heads", "head_dim"} & set(sizes)
        if derived:
            raise TypeError(f"for_model takes {sorted(derived)} from the model config; do not pass them")
        sizes.setdefault("base_model", getattr(config, "name_or_path", "") or "")
        return cls(**_decoder_shape(config), **sizes)

    def check_compatible(self, config: PretrainedConfig | nn.Module, check_base_model: bool = True) -> None:
        """Raise ``ValueError`` naming every mismatch between the policy and an LLM (model or config).

        Compares layers, KV heads, head_dim and, with ``check_base_model`` and when both are Hub
        ids, the base model id.
        """
        config = _config_of(config)
        shape = _decoder_shape(config)
        problems = [
            f"{name}: policy has {getattr(self, name)}, model has {shape[name]}"
            for name in ("num_layers", "num_kv_heads", "head_dim")
            if getattr(self, name) != shape[name]
        ]
        model_id = getattr(config, "name_or_path", "") or ""
        if (
            check_base_model
            and _is_hub_id(self.base_model)
            and _is_hub_id(model_id)
            and model_id != self.base_model
        ):
            problems.append(
                f"base model: policy was trained for '{self.base_model}', model is '{model_id}' (if you know it "
                "transfers, set policy.base_model = '' before KVPCache.from_pretrained)"
            )
        if problems:
            raise ValueError(
                "This KVP policy does not fit the model: " + "; ".join(problems) + ". Use a policy trained "
                f"for this model (shipped: {shipped_policies() or 'none'}) or train one (python -m train)."
            )

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def config_dict(self) -> dict:
        """What config.json records: architecture, options, base model and training record."""
        from kvp_cache import __version__

        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_dim": self.hidden_dim,
            "pos_dim": self.pos_dim,
            "max_positions": self.max_positions,
            "num_mlp_layers": self.num_mlp_layers,
            "position_strategy": self.position_strategy,
            "base_model": self.base_model,
            "training": self.training_info,
            "kvp_cache_version": __version__,
        }

    # ---- saving -------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | Path, *, config: None = None, **kwargs) -> str | None:
        """Write ``model.safetensors``, ``config.json`` and the model card ``README.md`` (all overwritten).

        Takes the keyword arguments of ``PyTorchModelHubMixin.save_pretrained`` (``push_to_hub``,
        ``repo_id``, ``model_card_kwargs``, ...); ``config`` is not accepted, since config.json
        always describes this policy (see :meth:`config_dict`).
        """
        if config is not None:
            raise TypeError("save_pretrained writes config.json from the policy itself; do not pass config=")
        check_training(self.training_info)
        # The mixin keeps an existing README.md; a stale card would describe another policy.
        (Path(save_directory) / "README.md").unlink(missing_ok=True)
        return super().save_pretrained(save_directory, **kwargs)

    def _save_pretrained(self, save_directory: Path) -> None:
        super()._save_pretrained(save_directory)  # model.safetensors via safetensors.torch.save_model
        # Written here so the mixin does not write its own snapshot of the __init__ arguments.
        (save_directory / CONFIG_NAME).write_text(
            json.dumps(self.config_dict(), indent=2, sort_keys=True) + "\n"
        )

    def push_to_hub(
        self, repo_id: str, *, config: None = None, model_card_kwargs: dict | None = None, **kwargs
    ) -> str:
        """Upload config.json, model.safetensors and README.md to the Hub repo ``repo_id`` (created if needed).

        Takes the keyword arguments of ``PyTorchModelHubMixin.push_to_hub`` (token, private, branch, ...).
        """
        if config is not None:
            raise TypeError("push_to_hub writes config.json from the policy itself; do not pass config=")
        model_card_kwargs = {"repo_id": repo_id, **(model_card_kwargs or {})}
        return super().push_to_hub(repo_id, model_card_kwargs=model_card_kwargs, **kwargs)

    def generate_model_card(self, repo_id: str | None = None, **kwargs) -> ModelCard:
        """The model card: YAML metadata, usage, architecture, training record and evaluation tables."""
        data = ModelCardData(
            library_name="kvp_cache",
            license="apache-2.0",
            tags=sorted(self._hub_mixin_info.model_card_data.tags or []),
            base_model=self.base_model if _is_hub_id(self.base_model) else None,
            datasets=list(self.training_info.get("datasets", [])) or None,
        )
        body = model_card_body(self, repo_id)
        return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")

    # ---- loading ------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | Path,
        *,
        map_location: str | torch.device = "cpu",
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | Path | None = None,
        force_download: bool = False,
        local_files_only: bool = False,
    ) -> KVPolicy:
        """Load a policy: a shipped name, a local directory or a Hub repo id (in that order).

        Replaces the mixin's loader, which is not strict by default and falls back to pickle
        weights: here the weights come only from ``model.safetensors`` and must match the
        config's architecture key for key and shape. Returns the policy in eval mode.
        """
        directory = resolve_local(pretrained_model_name_or_path)
        if directory is not None:
            config_file, weights_file = _local_files(directory)
        else:
            config_file, weights_file = _hub_files(
                str(pretrained_model_name_or_path),
                revision=revision,
                token=token,
                cache_dir=cache_dir,
                force_download=force_download,
                local_files_only=local_files_only,
            )
        return cls._load_files(
            config_file, weights_file, map_location, source=str(pretrained_model_name_or_path)
        )

    @classmethod
    def _load_files(cls, config_file: Path, weights_file: Path, map_location, source: str) -> KVPolicy:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        config = read_config(config_file, source)
        policy = cls(**config)
        try:
            state = load_file(str(weights_file), device="cpu")
        except SafetensorError as error:
            raise ValueError(
                f"Policy {source!r}: {weights_file.name} is not a valid safetensors file ({error})"
            ) from None
        check_state_dict(policy, state, source)
        policy.load_state_dict(state, strict=True)
        policy.source = source
        policy.weights_sha256 = sha256_of(weights_file)
        return policy.to(map_location).eval()


# ---- config, weights and card helpers ------------------------------------------------------------


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


def _evaluation_table(budgets: list, rows: dict[str, list]) -> str:
    return markdown_table(["method", *budgets], [[name, *values] for name, values in rows.items()])


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
        "output = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)",
        "```",
        "",
        "## Architecture",
        "",
        f"- base model: `{policy.base_model or 'unknown'}`",
        f"- {policy.num_layers} layers x {policy.num_kv_heads} KV heads (head_dim {policy.head_dim}), "
        f"{policy.num_layers * policy.num_kv_heads} agents, {policy.num_parameters():,} parameters "
        f"({policy.num_parameters() * 4 / 1e6:.2f} MB in float32)",
        f"- agent: hidden_dim {policy.hidden_dim}, pos_dim {policy.pos_dim}, max_positions "
        f"{policy.max_positions}, num_mlp_layers {policy.num_mlp_layers}",
        f"- position_strategy `{policy.position_strategy}`: {POSITION_STRATEGIES[policy.position_strategy]}",
        "",
        "## Training",
        "",
    ]
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
            _evaluation_table(evaluation["budgets"], evaluation["methods"]),
        ]
        if evaluation.get("accuracy"):
            task = evaluation.get("accuracy_task", "the downstream task")
            parts += ["", f"Accuracy on {task} per budget (higher is better):", ""]
            parts.append(_evaluation_table(evaluation["budgets"], evaluation["accuracy"]))
    return "\n".join(parts) + "\n"


def read_config(config_file: Path, source: str) -> dict:
    """The ``KVPolicy.__init__`` arguments recorded in a policy's config.json (strict about its keys)."""
    try:
        config = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"Policy {source!r}: config.json is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"Policy {source!r}: config.json must hold a JSON object")
    missing = [key for key in ARCHITECTURE_KEYS if key not in config]
    unknown = sorted(set(config) - set(ARCHITECTURE_KEYS) - set(OPTIONAL_KEYS))
    if missing or unknown:
        raise ValueError(
            f"Policy {source!r}: config.json is not a kvp_cache policy config"
            + (f"; missing keys {missing}" if missing else "")
            + (f"; unknown keys {unknown} (saved by a newer kvp_cache?)" if unknown else "")
        )
    config.pop("kvp_cache_version", None)
    return config


def check_state_dict(policy: nn.Module, state: dict[str, Tensor], source: str) -> None:
    """Raise ``ValueError`` unless ``state`` has exactly the policy's keys with the same shapes."""
    expected = policy.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    shapes = [
        f"{key}: file {tuple(state[key].shape)} vs config {tuple(expected[key].shape)}"
        for key in sorted(set(expected) & set(state))
        if state[key].shape != expected[key].shape
    ]
    if missing or extra or shapes:

        def some(names: list[str]) -> str:
            return ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")

        problems = []
        if missing:
            problems.append(f"missing keys: {some(missing)}")
        if extra:
            problems.append(f"unexpected keys: {some(extra)}")
        if shapes:
            problems.append(f"shape mismatches: {some(shapes)}")
        raise ValueError(
            f"Policy {source!r}: {WEIGHTS_NAME} does not match its config.json ({'; '.join(problems)}); "
            "refusing to load a partial policy."
        )


def _config_of(model_or_config: nn.Module | PretrainedConfig) -> PretrainedConfig:
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"expected a transformers model or config, got {type(model_or_config).__name__}")
    return text_config(config)


def _decoder_shape(config: PretrainedConfig) -> dict[str, int]:
    heads = config.num_attention_heads
    return {
        "num_layers": config.num_hidden_layers,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
    }


def _is_hub_id(name: str) -> bool:
    return bool(name) and bool(HUB_ID.match(name)) and not Path(name).expanduser().exists()


def shipped_policies() -> list[str]:
    """Names of the policies shipped in ``kvp_cache/policies/`` (dirs with config.json and model.safetensors)."""
    if not POLICIES_DIR.is_dir():
        return []
    return sorted(
        d.name for d in POLICIES_DIR.iterdir() if (d / CONFIG_NAME).is_file() and (d / WEIGHTS_NAME).is_file()
    )


def resolve_local(name_or_path: str | Path) -> Path | None:
    """The directory a shipped name or a local path points to; None for a Hub repo id.

    Shipped names win over local directories, which win over Hub ids, so a shipped name is never
    looked up on the Hub. Anything else (a name without '/', a missing path) is an error.
    """
    name = str(name_or_path)
    if not isinstance(name_or_path, Path) and name in shipped_policies():
        return POLICIES_DIR / name
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(
            f"Policy path {name!r} is a file; pass the directory holding config.json and {WEIGHTS_NAME}"
        )
    if isinstance(name_or_path, str) and HUB_ID.match(name):
        return None
    if "/" not in name and "\\" not in name:
        raise ValueError(
            f"Unknown policy {name!r}: not a shipped policy ({', '.join(shipped_policies()) or 'none shipped'}), "
            "a local directory or a Hub repo id ('owner/name')"
        )
    raise ValueError(f"Policy directory {name!r} does not exist (and it is not a Hub repo id 'owner/name')")


def _local_files(directory: Path) -> tuple[Path, Path]:
    config_file, weights_file = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    if not weights_file.is_file():
        pickles = sorted({p.name for pattern in PICKLE_PATTERNS for p in directory.glob(pattern)})
        if pickles:
            raise ValueError(
                f"Policy directory {str(directory)!r} holds only pickle checkpoints ({', '.join(pickles)}) and no "
                f"{WEIGHTS_NAME}; kvp_cache loads safetensors only (pickle files can run code when loaded). "
                "Convert it with KVPolicy.save_pretrained from a trusted environment."
            )
        raise ValueError(f"Policy directory {str(directory)!r} has no {WEIGHTS_NAME}")
    if not config_file.is_file():
        raise ValueError(f"Policy directory {str(directory)!r} has no {CONFIG_NAME}")
    return config_file, weights_file


def _hub_files(repo_id: str, **download) -> tuple[Path, Path]:
    """Download (or find in the HF cache) a Hub policy's config.json and model.safetensors."""
    files = []
    for filename in (CONFIG_NAME, WEIGHTS_NAME):
        try:
            files.append(Path(hf_hub_download(repo_id=repo_id, filename=filename, **download)))
        except LocalEntryNotFoundError:
            raise ValueError(
                f"Policy {repo_id!r} ({filename}) is not in the local Hugging Face cache and could not be downloaded "
                "(HF_HUB_OFFLINE=1, local_files_only=True or no network). Download it once with "
                f"`hf download {repo_id}`, or pass a local directory or a shipped policy "
                f"({', '.join(shipped_policies()) or 'none shipped'})."
            ) from None
        except RepositoryNotFoundError:
            raise ValueError(
                f"Hub repo {repo_id!r} does not exist or is private (pass token=... for a private repo)"
            ) from None
        except EntryNotFoundError:
            hint = (
                " kvp_cache loads only safetensors weights, never pickle checkpoints."
                if filename == WEIGHTS_NAME
                else ""
            )
            raise ValueError(
                f"Hub repo {repo_id!r} has no {filename}; it is not a kvp_cache policy.{hint}"
            ) from None
        except HfHubHTTPError as error:
            raise ValueError(f"Could not download {filename} of policy {repo_id!r}: {error}") from None
    return files[0], files[1]


def load_policy(name_or_path: str | Path, map_location: str | torch.device = "cpu") -> KVPolicy:
    """Load a :class:`KVPolicy`: a shipped name (:func:`shipped_policies`), a local directory or a Hub repo id."""
    return KVPolicy.from_pretrained(name_or_path, map_location=map_location)


__all__ = ["HeadAgents", "KVPolicy", "POSITION_STRATEGIES", "load_policy", "shipped_policies"]
