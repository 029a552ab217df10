"""The learned KVP eviction policy of one LLM: a :class:`~kvp_cache.agents.HeadAgents` per evicting layer.

:class:`KVPolicy` is the unit that is trained, saved, shipped and loaded. Its jobs live in:

- :mod:`kvp_cache.agents`: the scoring network (one agent per KV head), fused and reference forward;
- :mod:`kvp_cache.policy_loading`: shipped names, local directories and Hub ids; strict safetensors;
- :mod:`kvp_cache.policy_card`: the training record and the model card;
- here: the policy's configuration, its fit to a model, its :class:`Calibration` (scores comparable
  across heads, for adaptive allocation), saving and pushing, and :func:`load_policy`.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import ModelCard, PyTorchModelHubMixin
from torch import Tensor, nn
from transformers import PretrainedConfig

from kvp_cache.agents import (
    POSITION_STRATEGIES,
    HeadAgents,
    check_position_strategy,
    check_positive_int,
    check_trained_length,
)
from kvp_cache.compat import attention_shape, evicting_layer_indices, text_config
from kvp_cache.policy_card import LIBRARY_NAME, LICENSE, PAPER_URL, TAGS, check_training, model_card
from kvp_cache.policy_loading import (
    ARCHITECTURE_KEYS,
    CALIBRATION_KEYS,
    CALIBRATION_NAME,
    CONFIG_NAME,
    POLICIES_DIR,
    WEIGHTS_NAME,
    calibration_file,
    check_state_dict,
    is_hub_id,
    policy_files,
    read_calibration,
    read_config,
    read_weights,
    shipped_policies,
)
from kvp_cache.provenance import sha256_of

# What a policy shares with its LLM: one agent per (evicting layer, KV head), each reading head_dim
# vectors; layer_indices are the layers the cache evicts (all of them unless the model is hybrid).
MODEL_SHAPE = ("num_layers", "num_kv_heads", "head_dim", "layer_indices")


@dataclass
class Calibration:
    """A per-(evicting layer, KV head) scale on the policy's ranking, so one sort ranks every head.

    The policy ranks a head's entries; ``weight * softmax(scores / temperature)`` over the head's
    entries (:func:`calibrated_shares`) estimates each entry's share of the future attention mass,
    a value comparable across heads and layers. Without a calibration both are 1 (the per-head
    softmax). ``python -m train calibrate`` fits them.

    temperature, weight: ``[len(layer_indices), num_kv_heads]`` float32, finite and positive; row
        ``i`` belongs to model layer ``policy.layer_indices[i]``.
    record: JSON-able record of the fit (command, data, loss, variant, ...), saved in config.json.
    """

    temperature: Tensor
    weight: Tensor
    record: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in CALIBRATION_KEYS:
            value = getattr(self, name)
            if not isinstance(value, Tensor) or value.ndim != 2:
                raise ValueError(f"calibration {name} must be a [layers, kv_heads] tensor, got {value!r}")
            if not (torch.isfinite(value).all() and (value > 0).all()):
                raise ValueError(f"calibration {name} must be finite and positive, got {value}")
            setattr(self, name, value.detach().float().cpu().contiguous())
        if self.temperature.shape != self.weight.shape:
            raise ValueError(
                f"calibration temperature {tuple(self.temperature.shape)} and weight "
                f"{tuple(self.weight.shape)} must have the same shape"
            )
        try:
            json.dumps(self.record)
        except TypeError as error:
            raise ValueError(f"calibration record must be JSON-serialisable: {error}") from None

    def to_bytes(self) -> bytes:
        """The ``calibration.safetensors`` file."""
        from safetensors.torch import save

        return save({name: getattr(self, name) for name in CALIBRATION_KEYS})


def checked_age_decay(value, name: str = "age_decay") -> float:
    """``value`` as a float, or a ``TypeError``/``ValueError`` naming ``name`` unless it is a finite
    number >= 0 (0: no decay)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 (0: no decay), got {value}")
    return float(value)


def calibrated_shares(scores: Tensor, valid: Tensor, temperature: Tensor, weight: Tensor) -> Tensor:
    """``weight * softmax(scores / temperature)`` over each head's valid entries: float32, -inf where
    not valid.

    scores, valid: ``[..., kv_heads, seq]``; temperature, weight: ``[kv_heads]``, or ``[layers,
    kv_heads]`` for scores ``[..., layers, kv_heads, seq]``.
    """
    logits = (scores.float() / temperature[..., None]).masked_fill(~valid, float("-inf"))
    # A head without valid entries softmaxes to NaN; the fill below replaces all of it.
    return (logits.softmax(-1) * weight[..., None]).masked_fill(~valid, float("-inf"))


class KVPolicy(
    nn.Module,
    PyTorchModelHubMixin,
    library_name=LIBRARY_NAME,
    tags=TAGS,
    license=LICENSE,
    paper_url=PAPER_URL,
):
    """The learned eviction policy of one LLM: a :class:`HeadAgents` per evicting model layer.

    Args:
        num_layers, num_kv_heads, head_dim: the LLM's decoder (use :meth:`for_model`).
        layer_indices: the model layers that have agents, ascending: the layers the cache evicts
            (:func:`~kvp_cache.compat.evicting_layer_indices`). None means every layer (the
            models without sliding-window layers); a hybrid model such as Gemma 3 lists only
            its full-attention layers. ``self.layers[i]`` holds the agents of model layer
            ``layer_indices[i]``; :meth:`agents_for` maps a model layer to them.
        hidden_dim, pos_dim, max_positions, num_mlp_layers: agent sizes (see :class:`HeadAgents`).
            The defaults are sized for SmolLM2-135M (bench/bench_policy.py): scoring all heads
            of a 4K prompt costs about 1% of its prefill on CPU, and the weights take 5.8 MB.
            Rows past the longest training prompt are never trained; ``trained_length`` keeps
            every strategy off them.
        position_strategy: "clamp" (the paper), "scale" or "recency", see :data:`POSITION_STRATEGIES`;
            it has no weights, so it can be changed after loading (``policy.position_strategy = ...``).
        trained_length: the longest training prompt in tokens (``train fit`` records it), or None
            when unknown. Longer prompts read the table as if it ended at the last row training
            reached (:meth:`HeadAgents.last_trained_row`) instead of untrained rows.
        age_decay: the ranking under repeated evictions (``max_cache_tokens``, chunked prefill, later
            turns): each eviction ranks ``score - age_decay * log2(1 + age)``, ``age`` the tokens read
            since the entry's forward (:func:`kvp_cache.cache.age_decayed`). Chosen per policy on
            validation under a cap and saved in config.json; ``KVPCache(..., age_decay=...)``
            overrides it. A single prefill ranks the same at any value (every age is 0).
        base_model: Hub id of the LLM the policy was trained for (checked by :meth:`check_compatible`).
        training: JSON-able record of how the policy was trained, saved in config.json and shown
            on the model card. Recognised keys: ``data`` (str), ``datasets`` (list of Hub dataset
            ids), ``steps`` (int), ``command`` (str), ``evaluation`` (see
            :func:`kvp_cache.policy_card.check_evaluation`);
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
        layer_indices: list[int] | None = None,
        trained_length: int | None = None,
        age_decay: float = 0.0,
    ):
        super().__init__()
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            check_positive_int(name, value)
        if not isinstance(base_model, str):
            raise ValueError(f"base_model must be a str (a Hub model id or ''), got {base_model!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.layer_indices = check_layer_indices(layer_indices, num_layers)
        self._agent_of_layer = {layer: i for i, layer in enumerate(self.layer_indices)}
        self.hidden_dim, self.pos_dim, self.max_positions = hidden_dim, pos_dim, max_positions
        self.num_mlp_layers = num_mlp_layers
        self.base_model = base_model
        self.age_decay = age_decay
        self.training_info = check_training(training)
        self._calibration: Calibration | None = None
        self.layers = nn.ModuleList(
            HeadAgents(
                num_kv_heads,
                head_dim,
                hidden_dim,
                pos_dim,
                max_positions,
                num_mlp_layers,
                position_strategy,
                trained_length,
            )  # fmt: skip
            for _ in self.layer_indices
        )

    @property
    def position_strategy(self) -> str:
        return self.layers[0].position_strategy

    @position_strategy.setter
    def position_strategy(self, value: str) -> None:
        check_position_strategy(value)
        for agents in self.layers:
            agents.position_strategy = value

    @property
    def trained_length(self) -> int | None:
        return self.layers[0].trained_length

    @trained_length.setter
    def trained_length(self, value: int | None) -> None:
        check_trained_length(value)
        for agents in self.layers:
            agents.trained_length = value

    @property
    def age_decay(self) -> float:
        return self._age_decay

    @age_decay.setter
    def age_decay(self, value: float) -> None:
        self._age_decay = checked_age_decay(value)

    @property
    def calibration(self) -> Calibration | None:
        """The per-head scale of :meth:`cross_head_scores` (None: temperature 1 and weight 1)."""
        return self._calibration

    @calibration.setter
    def calibration(self, value: Calibration | None) -> None:
        if value is not None:
            if not isinstance(value, Calibration):
                raise TypeError(f"calibration must be a Calibration or None, got {type(value).__name__}")
            shape = (len(self.layer_indices), self.num_kv_heads)
            if tuple(value.temperature.shape) != shape:
                raise ValueError(
                    f"calibration must be [evicting layers, kv_heads] = {list(shape)} for this policy, "
                    f"got {list(value.temperature.shape)}"
                )
        self._calibration = value

    def cross_head_scores(self, layer_idx: int, scores: Tensor, valid: Tensor) -> Tensor:
        """Each entry's estimated share of the future attention mass, comparable across heads and
        layers: :func:`calibrated_shares` with the calibration of model layer ``layer_idx``.

        scores: ``[batch, kv_heads, seq]`` as :meth:`forward` returned them; valid: the same shape,
        bool. Returns float32 of that shape, -inf where not valid.
        """
        self.agents_for(layer_idx)  # a clear error for a layer without agents
        if scores.shape != valid.shape or scores.shape[-2] != self.num_kv_heads:
            raise ValueError(
                f"scores and valid must both be [batch, {self.num_kv_heads}, seq], got "
                f"{tuple(scores.shape)} and {tuple(valid.shape)}"
            )
        if self.calibration is None:
            ones = torch.ones(self.num_kv_heads, device=scores.device)
            return calibrated_shares(scores, valid, ones, ones)
        row = self._agent_of_layer[layer_idx]
        temperature = self.calibration.temperature[row].to(scores.device)
        return calibrated_shares(scores, valid, temperature, self.calibration.weight[row].to(scores.device))

    def agents_for(self, layer_idx: int) -> HeadAgents:
        """The agents of model layer ``layer_idx`` (one of :attr:`layer_indices`)."""
        if layer_idx not in self._agent_of_layer:
            raise ValueError(
                f"layer_idx must be one of the policy's layer_indices {self.layer_indices}, got {layer_idx}"
            )
        return self.layers[self._agent_of_layer[layer_idx]]

    def forward(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        """Scores ``[batch, kv_heads, seq]`` (float32, -inf on padding) of model layer ``layer_idx``."""
        return self.agents_for(layer_idx)(keys, values, positions)

    @classmethod
    def for_model(cls, model_or_config: nn.Module | PretrainedConfig, **sizes) -> KVPolicy:
        """A freshly initialised policy shaped for ``model_or_config`` (a transformers model or config).

        ``sizes`` are the other ``__init__`` arguments (hidden_dim, ..., training, and base_model to
        override ``config.name_or_path``).
        """
        config = _config_of(model_or_config)
        derived = set(MODEL_SHAPE) & set(sizes)
        if derived:
            raise TypeError(f"for_model takes {sorted(derived)} from the model config; do not pass them")
        sizes.setdefault("base_model", getattr(config, "name_or_path", "") or "")
        return cls(**model_shape(config), **sizes)

    def check_compatible(self, config: PretrainedConfig | nn.Module, check_base_model: bool = True) -> None:
        """Raise ``ValueError`` naming every mismatch between the policy and an LLM (model or config).

        Compares layers, KV heads, head_dim, the evicting layers (``layer_indices``) and, with
        ``check_base_model`` and when both are Hub ids, the base model id.
        """
        config = _config_of(config)
        shape = model_shape(config)
        problems = [
            f"{name}: policy has {getattr(self, name)}, model has {value}"
            for name, value in shape.items()
            if getattr(self, name) != value
        ]
        model_id = getattr(config, "name_or_path", "") or ""
        if (
            check_base_model
            and is_hub_id(self.base_model)
            and is_hub_id(model_id)
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

        architecture = {key: getattr(self, key) for key in ARCHITECTURE_KEYS}
        config = architecture | {
            "layer_indices": self.layer_indices,
            "position_strategy": self.position_strategy,
            "trained_length": self.trained_length,
            "age_decay": self.age_decay,
            "base_model": self.base_model,
            "training": self.training_info,
            "kvp_cache_version": __version__,
        }
        if self.calibration is not None:
            sha256 = hashlib.sha256(self.calibration.to_bytes()).hexdigest()
            config["calibration"] = {"sha256": sha256, "record": self.calibration.record}
        return config

    # ---- saving -------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | Path, *, config: None = None, **kwargs) -> str | None:
        """Write ``model.safetensors``, ``config.json``, the model card ``README.md`` and, if the policy
        has a :attr:`calibration`, ``calibration.safetensors`` (all overwritten; a calibration file
        left from another policy is removed).

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
        mode = (save_directory / CONFIG_NAME).stat().st_mode & 0o777
        # safetensors writes owner-only (0600) files: give the weights the mode the umask gave the config.
        (save_directory / WEIGHTS_NAME).chmod(mode)
        calibration = save_directory / CALIBRATION_NAME
        if self.calibration is None:
            calibration.unlink(missing_ok=True)  # config.json records none: a stale file would be refused
        else:
            calibration.write_bytes(self.calibration.to_bytes())
            calibration.chmod(mode)

    def push_to_hub(
        self, repo_id: str, *, config: None = None, model_card_kwargs: dict | None = None, **kwargs
    ) -> str:
        """Upload config.json, model.safetensors, README.md and any calibration.safetensors to the Hub repo
        ``repo_id`` (created if needed).

        Takes the keyword arguments of ``PyTorchModelHubMixin.push_to_hub`` (token, private, branch, ...).
        """
        if config is not None:
            raise TypeError("push_to_hub writes config.json from the policy itself; do not pass config=")
        model_card_kwargs = {"repo_id": repo_id, **(model_card_kwargs or {})}
        return super().push_to_hub(repo_id, model_card_kwargs=model_card_kwargs, **kwargs)

    def generate_model_card(self, repo_id: str | None = None, **kwargs) -> ModelCard:
        """The model card (see :func:`kvp_cache.policy_card.model_card`); called by the Hub mixin."""
        return model_card(self, self._hub_mixin_info.model_card_data.tags or [], repo_id)

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
        config's architecture key for key and shape; a calibration config.json records must be in
        ``calibration.safetensors`` with that sha256, keys and shapes. Returns the policy in eval
        mode, with ``source``, ``weights_sha256`` and ``calibration_sha256`` (None without one).
        """
        source = str(pretrained_model_name_or_path)
        config_file, weights_file = policy_files(
            pretrained_model_name_or_path,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only,
        )
        config = read_config(config_file, source)
        recorded = config.pop("calibration", None)
        policy = cls(**config)
        state = read_weights(weights_file, source)
        check_state_dict(policy, state, source)
        policy.load_state_dict(state, strict=True)
        download = dict(revision=revision, token=token, cache_dir=cache_dir, force_download=force_download)
        path = calibration_file(
            pretrained_model_name_or_path, recorded is not None, local_files_only=local_files_only, **download
        )
        policy.calibration_sha256 = None
        if path is not None:
            shape = (len(policy.layer_indices), policy.num_kv_heads)
            tensors = read_calibration(path, source, recorded, shape)
            policy.calibration = Calibration(**tensors, record=recorded.get("record", {}))
            policy.calibration_sha256 = recorded["sha256"]
        policy.source = source
        policy.weights_sha256 = sha256_of(weights_file)
        return policy.to(map_location).eval()


def _config_of(model_or_config: nn.Module | PretrainedConfig) -> PretrainedConfig:
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"expected a transformers model or config, got {type(model_or_config).__name__}")
    return text_config(config)


def model_shape(config: PretrainedConfig) -> dict[str, int | list[int]]:
    """The :data:`MODEL_SHAPE` of a decoder config (sizes and evicting layers), as ``KVPolicy`` arguments."""
    shape = attention_shape(config)
    sizes = {name: getattr(shape, name) for name in MODEL_SHAPE if name != "layer_indices"}
    return sizes | {"layer_indices": evicting_layer_indices(config)}


def check_layer_indices(layer_indices: list[int] | None, num_layers: int) -> list[int]:
    """``layer_indices`` as a list (every layer when None); a clear error unless it is a non-empty,
    strictly ascending list of ints in ``[0, num_layers)``."""
    if layer_indices is None:
        return list(range(num_layers))
    indices = list(layer_indices) if isinstance(layer_indices, list | tuple) else None
    if (
        not indices
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices)
        or indices != sorted(set(indices))
        or not 0 <= indices[0] <= indices[-1] < num_layers
    ):
        raise ValueError(
            f"layer_indices must be a non-empty ascending list of distinct layer indices in "
            f"[0, {num_layers - 1}] (or None for every layer), got {layer_indices!r}"
        )
    return indices


def load_policy(name_or_path: str | Path, map_location: str | torch.device = "cpu") -> KVPolicy:
    """Load a :class:`KVPolicy`: a shipped name (:func:`shipped_policies`), a local directory or a Hub repo id."""
    return KVPolicy.from_pretrained(name_or_path, map_location=map_location)


__all__ = [
    "POLICIES_DIR",
    "POSITION_STRATEGIES",
    "Calibration",
    "HeadAgents",
    "KVPolicy",
    "calibrated_shares",
    "checked_age_decay",
    "load_policy",
    "shipped_policies",
]
