"""``python -m train fit``: train a KVPolicy on collected traces, one traced layer at a time.

Per layer, all KV heads train together as one batched ``HeadAgents``:

- the objective (``--objective``) is chosen once: ``rl``, the paper's REINFORCE-RLOO
  (``train/rl.py``), or a supervised ranking loss (``train/supervised.py``; ``listnet`` ships);
- the target (``--target``) is chosen once too (``train/targets.py``);
- around the loss, the paper's trainer: AdamW (weight decay 1e-3), linear warmup then cosine decay,
  gradient clip 5, an EMA copy (decay 0.99, after warmup). Every ``eval_every`` steps the EMA ranks
  the validation traces by deterministic argsort; the best EMA weights are kept.

``--init-from`` starts from a trained policy's weights (RL fine-tuning of the ListNet policy).
``--anchor a`` keeps the fine-tune near where it started: the objective sees the target ``(1 - a) *``
each ranked token's share of the importance ``+ a * softmax(start scores)``, the starting policy's
own ranking distribution (ListNet trains ``softmax(scores)`` to match that share). Validation keeps
the plain target, so the kept step is the one that ranks the new data best.
A finished layer is saved to ``<out>/layers/`` and skipped when the command runs again; the final
:class:`KVPolicy` is written with ``save_pretrained`` to ``<out>/policy``, and the validation curves
of every layer to ``<out>/training_curves.png``.

Scale out: under ``accelerate launch`` (or ``torchrun``) each process trains every
``world_size``-th layer; layers are seeded independently of which process trains them, so the
policy is the same as one process's up to float noise. The main process writes the policy.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from accelerate import PartialState
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from kvp_cache.policy import POSITION_STRATEGIES, HeadAgents, KVPolicy, load_policy
from kvp_cache.provenance import portable_command
from train import plots, rl, supervised
from train.batch import Batch, pad_batch
from train.reward import normalized, rank_by_scores, ranking_reward
from train.targets import TARGETS, target
from train.traces import LayerSample, TraceSplit, traced_layers

OBJECTIVES = ("rl", *supervised.LOSSES)
VALIDATION_BATCH = 32

# An objective maps (agents, batch, generator) to (loss, sampled rewards [batch, heads] or None).
Objective = Callable[[HeadAgents, Batch, torch.Generator], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class FitConfig:
    """Everything ``fit`` needs; the CLI flags map one to one."""

    traces: str
    out: str
    objective: str = "rl"
    target: str = "attention"
    steps: int = 150
    batch_size: int = 8
    lr: float = 3e-3
    min_lr: float = 1e-5
    warmup: int = 10
    weight_decay: float = 1e-3
    grad_clip: float = 5.0
    ema_decay: float = 0.99
    eval_every: int = 25
    advantage_clip: float = 2.0
    permutations: int = 1
    hidden_dim: int = 32
    pos_dim: int = 8
    max_positions: int = 1024
    num_mlp_layers: int = 2
    position_strategy: str = "clamp"
    init_from: str | None = None
    anchor: float = 0.0
    sinks: int = 4
    window: int = 16
    layers: list[int] | None = None
    train_split: str = "train"
    val_split: str = "val"
    seed: int = 0
    command: str = field(default_factory=lambda: portable_command(["python -m train", *sys.argv[1:]]))

    def validate(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {sorted(TARGETS)}, got {self.target!r}")
        if self.position_strategy not in POSITION_STRATEGIES:
            raise ValueError(f"position_strategy must be one of {sorted(POSITION_STRATEGIES)}")
        positive = (
            "steps",
            "batch_size",
            "eval_every",
            "hidden_dim",
            "pos_dim",
            "max_positions",
            "permutations",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.objective == "rl" and self.batch_size * self.permutations < 2:
            raise ValueError("rl needs batch_size >= 2 or permutations >= 2 for the leave-one-out baseline")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be in [0, steps), got {self.warmup}")
        if not 0.0 <= self.anchor < 1.0:
            raise ValueError(f"anchor must be in [0, 1), got {self.anchor}")
        if self.anchor > 0 and self.init_from is None:
            raise ValueError("anchor > 0 keeps the fit near its start weights: it needs --init-from")
        if self.sinks < 0 or self.window < 0:
            raise ValueError(f"sinks and window must be >= 0, got {self.sinks} and {self.window}")


def make_objective(config: FitConfig) -> Objective:
    """The loss of one batch, chosen once from ``config.objective``."""
    if config.objective == "rl":
        return functools.partial(
            rl.reinforce_loss, advantage_clip=config.advantage_clip, permutations=config.permutations
        )
    return functools.partial(supervised.supervised_objective, supervised.LOSSES[config.objective])


@torch.no_grad()
def anchored(samples: list[LayerSample], start: HeadAgents, weight: float) -> list[LayerSample]:
    """``samples`` with their target mixed with ``start``'s ranking distribution (see ``--anchor``).

    The start agents are frozen, so each sample's share is computed once, not at every step."""
    mixed = []
    for sample in samples:
        batch = pad_batch([sample])
        valid = batch.valid[:, None, :].expand_as(batch.importance)
        start_share = batch.scores(start).softmax(-1)  # -inf where not ranked: share 0
        target = (1.0 - weight) * normalized(batch.importance, valid) + weight * start_share
        mixed.append(replace(sample, importance=target.view(sample.importance.shape)))
    return mixed


# ---------------------------------------------------------------- one layer


@torch.no_grad()
def validation_reward(agents: HeadAgents, batches: list[Batch]) -> tuple[float, list[float]]:
    """Mean reward of the deterministic argsort ranking over validation batches (and per head)."""
    per_head = []
    for batch in batches:
        scores = batch.scores(agents)
        valid = batch.valid[:, None, :].expand_as(scores)
        per_head.append(ranking_reward(rank_by_scores(scores, valid), batch.importance, valid))
    rewards = torch.cat(per_head)  # [samples, heads]
    return rewards.mean().item(), rewards.mean(0).tolist()


def lr_factor(step: int, config: FitConfig) -> float:
    """Linear warmup from 1% to 100%, then cosine decay to ``min_lr``."""
    if step < config.warmup:
        return 0.01 + 0.99 * step / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    floor = config.min_lr / config.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def fit_layer(
    agents: HeadAgents,
    train: list[LayerSample],
    val: list[LayerSample],
    config: FitConfig,
    desc: str = "",
    objective: Objective | None = None,
) -> dict:
    """Train ``agents`` in place on one layer's traces; load the best EMA weights. Returns the history.

    The samples' ``importance`` is the training target (see :func:`layer_samples`).
    """
    objective = objective or make_objective(config)
    device = next(agents.parameters()).device
    generator = torch.Generator().manual_seed(config.seed)
    val_batches = [
        pad_batch(val[i : i + VALIDATION_BATCH]).to(device) for i in range(0, len(val), VALIDATION_BATCH)
    ]
    optimizer = torch.optim.AdamW(agents.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    ema = copy.deepcopy(agents).requires_grad_(False)
    best_reward, per_head = validation_reward(ema, val_batches)
    best_state, best_step = copy.deepcopy(ema.state_dict()), 0
    history = {
        "eval_steps": [0],
        "val_reward": [best_reward],
        "val_reward_per_head": [per_head],
        "train_reward": [],
    }
    batch_size = min(config.batch_size, len(train))
    bar = tqdm(range(1, config.steps + 1), desc=desc, leave=False)
    for step in bar:
        pick = torch.randperm(len(train), generator=generator)[:batch_size].tolist()
        loss, rewards = objective(agents, pad_batch([train[i] for i in pick]).to(device), generator)
        if rewards is not None:
            history["train_reward"].append(rewards.mean().item())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(agents.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            decay = config.ema_decay if step > config.warmup else 0.0
            for averaged, current in zip(ema.parameters(), agents.parameters(), strict=True):
                averaged.lerp_(current, 1.0 - decay)
        if step % config.eval_every == 0 or step == config.steps:
            reward, per_head = validation_reward(ema, val_batches)
            history["eval_steps"].append(step)
            history["val_reward"].append(reward)
            history["val_reward_per_head"].append(per_head)
            if reward > best_reward:
                best_reward, best_state, best_step = reward, copy.deepcopy(ema.state_dict()), step
            bar.set_postfix(val=f"{reward:.3f}", best=f"{best_reward:.3f}")
    agents.load_state_dict(best_state)
    history.update(
        best_step=best_step, best_val_reward=best_reward, initial_val_reward=history["val_reward"][0]
    )
    return history


# ---------------------------------------------------------------- the steps of fit()


def layer_samples(split: TraceSplit, layer: int, config: FitConfig) -> list[LayerSample]:
    """The split's samples of ``layer`` with ``importance`` replaced by the configured target."""
    return [
        replace(s, importance=target(config.target, s, config.sinks, config.window))
        for s in split.layer(layer)
    ]


def prepare_run_dir(config: FitConfig, state: PartialState) -> Path:
    """``<out>/layers`` exists and ``<out>/fit.json`` holds these settings (a resumed run must match)."""
    out = Path(config.out)
    settings = {k: v for k, v in asdict(config).items() if k not in {"command", "layers"}}
    settings_file = out / "fit.json"
    if state.is_main_process:
        (out / "layers").mkdir(parents=True, exist_ok=True)
        # A run written before a setting existed holds that setting's default.
        defaults = {k: v for k, v in asdict(FitConfig(config.traces, config.out)).items() if k in settings}
        if settings_file.exists() and {**defaults, **json.loads(settings_file.read_text())} != settings:
            raise ValueError(
                f"{out} holds layers trained with other settings ({settings_file}); use a new --out"
            )
        settings_file.write_text(json.dumps(settings, indent=1))
    state.wait_for_everyone()
    return out


def new_policy(info: dict, config: FitConfig, training: dict | None = None) -> KVPolicy:
    return KVPolicy(
        num_layers=info["num_layers"],
        num_kv_heads=info["num_kv_heads"],
        head_dim=info["head_dim"],
        hidden_dim=config.hidden_dim,
        pos_dim=config.pos_dim,
        max_positions=config.max_positions,
        num_mlp_layers=config.num_mlp_layers,
        position_strategy=config.position_strategy,
        base_model=info["name"] if "/" in info["name"] else "",
        training=training,
        layer_indices=traced_layers(info),
    )


def initial_policy(info: dict, config: FitConfig) -> KVPolicy:
    """Seeded fresh agents, or the weights of ``config.init_from`` (same architecture, strictly)."""
    torch.manual_seed(config.seed)
    policy = new_policy(info, config)
    if config.init_from is not None:
        start = load_policy(config.init_from)
        try:
            policy.load_state_dict(start.state_dict(), strict=True)
        except RuntimeError as error:
            raise ValueError(
                f"--init-from {config.init_from} has another architecture than this fit "
                "(hidden_dim, pos_dim, max_positions, num_mlp_layers and the model's heads must match)"
            ) from error
        policy.trained_length = start.trained_length
        policy.start_sha256 = start.weights_sha256
    return policy


def layer_paths(out: Path, layer: int) -> tuple[Path, Path]:
    return out / "layers" / f"layer_{layer:02d}.safetensors", out / "layers" / f"layer_{layer:02d}.json"


def train_layers(
    policy: KVPolicy,
    layers: list[int],
    train: TraceSplit,
    val: TraceSplit,
    config: FitConfig,
    out: Path,
    state: PartialState,
) -> None:
    """Fit and save each of ``layers`` that has no saved weights yet, on this process's device."""
    objective = make_objective(config)
    for layer in tqdm(layers, desc=f"fit ({config.objective}, {config.target})", unit="layer"):
        weights, record = layer_paths(out, layer)
        if weights.exists() and record.exists():
            continue
        torch.manual_seed(config.seed * 1000 + layer)
        agents = policy.agents_for(layer).to(state.device)
        started = time.time()
        train_samples = layer_samples(train, layer, config)
        if config.anchor > 0:
            train_samples = anchored(train_samples, agents, config.anchor)
        history = fit_layer(
            agents, train_samples, layer_samples(val, layer, config), config, f"layer {layer}", objective
        )
        history.update(seconds=round(time.time() - started, 1), process=state.process_index)
        save_file({k: v.detach().cpu().contiguous() for k, v in agents.state_dict().items()}, str(weights))
        record.write_text(json.dumps(history))


def assemble_policy(
    policy: KVPolicy, train: TraceSplit, val: TraceSplit, config: FitConfig, out: Path
) -> Path:
    """Load every saved layer, attach the training record, and write ``<out>/policy``."""
    policy = policy.cpu()
    histories = []
    for layer, agents in zip(policy.layer_indices, policy.layers, strict=True):
        weights, record = layer_paths(out, layer)
        agents.load_state_dict(load_file(str(weights)))
        histories.append(json.loads(record.read_text()))
    info = train.model
    # Rows reached by the start weights (--init-from) stay trained.
    policy.trained_length = max([s["prompt_tokens"] for s in train.samples] + [policy.trained_length or 0])
    policy.training_info = {
        "data": f"{len(train)} training / {len(val)} validation traces of {info['name']} ({describe_sources(train)})",
        "steps": config.steps,
        "command": config.command,
        "objective": config.objective,
        "target": config.target,
        "batch_size": config.batch_size,
        "lr": config.lr,
        "val_reward_initial": round(sum(h["initial_val_reward"] for h in histories) / len(histories), 4),
        "val_reward_best": round(sum(h["best_val_reward"] for h in histories) / len(histories), 4),
        "train_minutes": round(sum(h["seconds"] for h in histories) / 60, 1),
    }
    if config.init_from is not None:
        # A name such as the shipped one can point at other weights later: the sha256 says which.
        policy.training_info["init_from"] = f"{config.init_from} (sha256 {policy.start_sha256})"
    policy.save_pretrained(out / "policy")
    plots.training_curves(out, out / "training_curves.png")
    return out / "policy"


def describe_sources(split: TraceSplit) -> str:
    counts: dict[str, int] = {}
    for sample in split.samples:
        counts[sample["source"]] = counts.get(sample["source"], 0) + 1
    tokens = sorted(s["prompt_tokens"] for s in split.samples)
    return (
        ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        + f"; prompts of {tokens[0]}-{tokens[-1]} tokens"
    )


def fit(config: FitConfig) -> Path:
    """Train every layer (skipping finished ones; split across processes when launched
    distributed), then write ``<out>/policy``. Returns the policy dir, or ``out`` while layers remain."""
    config.validate()
    state = PartialState(cpu=not torch.cuda.is_available())
    train = TraceSplit(config.traces, config.train_split)
    val = TraceSplit(config.traces, config.val_split)
    out = prepare_run_dir(config, state)
    policy = initial_policy(train.model, config)
    layers = config.layers if config.layers is not None else train.layer_indices
    untraced = sorted(set(layers) - set(train.layer_indices))
    if untraced:
        raise ValueError(
            f"layers {untraced} are not traced in {config.traces}; traced: {train.layer_indices}"
        )
    started = time.time()
    train_layers(policy, layers[state.process_index :: state.num_processes], train, val, config, out, state)
    state.wait_for_everyone()
    if not state.is_main_process:
        return out
    missing = [i for i in train.layer_indices if not layer_paths(out, i)[0].exists()]
    if missing:
        print(f"layers still to train: {missing}; the policy is written once every layer is done")
        return out
    policy_dir = assemble_policy(policy, train, val, config, out)
    print(f"fit took {time.time() - started:.0f} s in this run; policy written to {policy_dir}")
    return policy_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = FitConfig(traces="", out="")
    parser.add_argument("--traces", required=True, help="directory written by `collect`")
    parser.add_argument("--out", required=True, help="run directory (layers/, fit.json, policy/); resumable")
    parser.add_argument("--objective", choices=OBJECTIVES, default=defaults.objective)
    parser.add_argument(
        "--target", choices=sorted(TARGETS), default=defaults.target, help="see train/targets.py"
    )
    integers = ("steps", "batch_size", "warmup", "eval_every", "hidden_dim", "pos_dim", "max_positions")
    for name in (*integers, "num_mlp_layers", "permutations", "sinks", "window", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("lr", "min_lr", "weight_decay", "grad_clip", "ema_decay", "advantage_clip"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument(
        "--position-strategy", choices=sorted(POSITION_STRATEGIES), default=defaults.position_strategy
    )
    parser.add_argument(
        "--init-from", default=None, help="start from this policy's weights (dir or shipped name)"
    )
    parser.add_argument(
        "--anchor",
        type=float,
        default=defaults.anchor,
        help="weight in [0, 1) of the --init-from policy's own ranking in the training target (0: off)",
    )
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="train only these layers")
    joined = "a split name, or several joined with '+' (train+train_native)"
    parser.add_argument("--train-split", default=defaults.train_split, help=joined)
    parser.add_argument("--val-split", default=defaults.val_split, help=joined)
    parser.add_argument("--threads", type=int, default=2)


def fit_command(args: argparse.Namespace) -> Path:
    fields = set(FitConfig.__dataclass_fields__) - {"command"}
    return fit(FitConfig(**{k: v for k, v in vars(args).items() if k in fields}))
