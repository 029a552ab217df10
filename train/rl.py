"""``python -m train fit``: train a KVPolicy on collected traces, one layer at a time.

The paper's trainer (section 5, and the released ``RLOOGumbelTrainer``):

1. Each agent scores every prompt token of a batch of traces; all KV heads of a layer are one
   batched ``HeadAgents`` and each (sample, head) is one episode.
2. A ranking is sampled from the Plackett-Luce policy by Gumbel-sort: ``argsort(s + Gumbel)``.
3. Its reward is ``-cost / oracle_cost`` (``train/reward.py``), clamped at -200.
4. REINFORCE with a leave-one-out baseline over the batch (per head), advantages normalized and
   clamped to [-2, 2]; the loss is ``-mean(A * log pi(sigma_t | remaining))`` over every step of
   every episode, with the exact PL log-probability from a reverse logcumsumexp.
5. AdamW (weight decay 1e-3), linear warmup then cosine decay, gradient clip 5, an EMA copy
   (decay 0.99, after warmup). Every ``eval_every`` steps the EMA ranks the validation traces by
   deterministic argsort; the best EMA weights are kept.

``--objective`` swaps step 2-4 for a supervised loss (``train/supervised.py``) for the ablation.
A finished layer is saved to ``<out>/layers/`` and skipped when the command runs again; the
final :class:`KVPolicy` is written with ``save_pretrained`` to ``<out>/policy``, and the validation
curves of every layer to ``<out>/training_curves.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from kvp_cache.policy import POSITION_STRATEGIES, HeadAgents, KVPolicy
from train import plots, supervised
from train.reward import REWARD_FLOOR, rank_by_scores, ranking_reward
from train.traces import LayerSample, TraceSplit

OBJECTIVES = ("rl", *supervised.LOSSES)


@dataclass
class FitConfig:
    """Everything ``fit`` needs; the CLI flags map one to one."""

    traces: str
    out: str
    objective: str = "rl"
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
    hidden_dim: int = 32
    pos_dim: int = 8
    max_positions: int = 1024
    num_mlp_layers: int = 2
    position_strategy: str = "clamp"
    layers: list[int] | None = None
    train_split: str = "train"
    val_split: str = "val"
    seed: int = 0
    command: str = field(default_factory=lambda: " ".join(["python -m train", *sys.argv[1:]]))

    def validate(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.position_strategy not in POSITION_STRATEGIES:
            raise ValueError(f"position_strategy must be one of {sorted(POSITION_STRATEGIES)}")
        for name in ("steps", "batch_size", "eval_every", "hidden_dim", "pos_dim", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.objective == "rl" and self.batch_size < 2:
            raise ValueError("batch_size must be >= 2 for the leave-one-out baseline")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be in [0, steps), got {self.warmup}")


# ---------------------------------------------------------------- Plackett-Luce policy


def gumbel_sort(scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample a ranking (best first) from the Plackett-Luce policy of ``scores`` ``[..., n]``.

    ``argsort(s + g)`` with ``g ~ Gumbel(0, 1)`` is an exact PL sample; -inf (padding) sorts last.
    """
    u = torch.rand(scores.shape, generator=generator, device=scores.device).clamp(1e-10, 1 - 1e-7)
    return (scores.detach().float() - torch.log(-torch.log(u))).argsort(dim=-1, descending=True)


def plackett_luce_log_probs(scores: torch.Tensor, ranking: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-step log-probabilities ``log pi(sigma_t | sigma_<t)`` ``[..., n]`` (0 on padding steps).

    ``s_{sigma_t} - logsumexp_{j >= t} s_{sigma_j}``, the suffix logsumexp from one reverse
    ``logcumsumexp``. ranking must put padding last; valid ``[..., n]`` marks real tokens.
    """
    n_valid = valid.sum(-1, keepdim=True)
    step_valid = torch.arange(scores.shape[-1], device=scores.device) < n_valid
    # A finite floor instead of -inf keeps padding out of every sum without NaN gradients.
    ordered = torch.where(step_valid, scores.gather(-1, ranking), torch.full_like(scores, -1e4))
    suffix_lse = ordered.flip(-1).logcumsumexp(-1).flip(-1)
    return (ordered - suffix_lse) * step_valid


def rloo_advantages(rewards: torch.Tensor, clip: float) -> torch.Tensor:
    """Leave-one-out advantages over the batch (dim 0), normalized and clamped, per head.

    rewards: ``[batch, heads]``. ``A_k = R_k - mean_{j != k} R_j``, then ``(A - mean) / std``.
    """
    b = rewards.shape[0]
    baseline = (rewards.sum(0, keepdim=True) - rewards) / (b - 1)
    advantages = rewards - baseline
    advantages = (advantages - advantages.mean(0, keepdim=True)) / (advantages.std(0, keepdim=True) + 1e-8)
    return advantages.clamp(-clip, clip)


def rl_loss(agents: HeadAgents, batch: dict, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE-RLOO loss of one batch and the sampled rankings' rewards ``[batch, heads]``."""
    scores = agents(batch["keys"], batch["values"], batch["positions"])
    valid = batch["valid"][:, None, :].expand_as(scores)
    ranking = gumbel_sort(scores, generator)
    with torch.no_grad():
        rewards = ranking_reward(ranking, batch["importance"], valid, floor=REWARD_FLOOR)
        advantages = rloo_advantages(rewards, batch["advantage_clip"])
    log_probs = plackett_luce_log_probs(scores.masked_fill(~valid, 0.0), ranking, valid)
    steps = valid.sum()
    return -(advantages[..., None] * log_probs).sum() / steps, rewards


# ---------------------------------------------------------------- data and evaluation


def pad_batch(samples: list[LayerSample]) -> dict:
    """Stack samples of one layer, right-padded: keys/values ``[b, h, n, d]`` float32, importance
    ``[b, h, n]``, positions ``[b, n]`` (-1 on padding), valid ``[b, n]``."""
    n = max(s.keys.shape[1] for s in samples)
    h, _, d = samples[0].keys.shape
    b = len(samples)
    keys = torch.zeros(b, h, n, d)
    values = torch.zeros(b, h, n, d)
    importance = torch.zeros(b, h, n)
    positions = torch.full((b, n), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        m = s.keys.shape[1]
        keys[i, :, :m], values[i, :, :m] = s.keys.float(), s.values.float()
        importance[i, :, :m] = s.importance.float()
        positions[i, :m] = torch.arange(m)
    return {
        "keys": keys,
        "values": values,
        "importance": importance,
        "positions": positions,
        "valid": positions >= 0,
    }


@torch.no_grad()
def validation_reward(agents: HeadAgents, batches: list[dict]) -> tuple[float, list[float]]:
    """Mean reward of the deterministic argsort ranking over validation batches (and per head)."""
    per_head = []
    for batch in batches:
        scores = agents(batch["keys"], batch["values"], batch["positions"])
        valid = batch["valid"][:, None, :].expand_as(scores)
        per_head.append(ranking_reward(rank_by_scores(scores, valid), batch["importance"], valid))
    rewards = torch.cat(per_head)  # [samples, heads]
    return rewards.mean().item(), rewards.mean(0).tolist()


def lr_factor(step: int, config: FitConfig) -> float:
    """Linear warmup from 1% to 100%, then cosine decay to ``min_lr``."""
    if step < config.warmup:
        return 0.01 + 0.99 * step / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    floor = config.min_lr / config.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------- one layer


def fit_layer(
    agents: HeadAgents, train: list[LayerSample], val: list[LayerSample], config: FitConfig, desc: str = ""
) -> dict:
    """Train ``agents`` in place on one layer's traces; load the best EMA weights. Returns the history."""
    generator = torch.Generator().manual_seed(config.seed)
    val_batches = [pad_batch(val[i : i + 32]) for i in range(0, len(val), 32)]
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
        batch = pad_batch([train[i] for i in pick])
        if config.objective == "rl":
            batch["advantage_clip"] = config.advantage_clip
            loss, rewards = rl_loss(agents, batch, generator)
            history["train_reward"].append(rewards.mean().item())
        else:
            scores = agents(batch["keys"], batch["values"], batch["positions"])
            loss = supervised.loss(config.objective, scores, batch["importance"], batch["valid"], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(agents.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            decay = config.ema_decay if step > config.warmup else 0.0
            for target, source in zip(ema.parameters(), agents.parameters(), strict=True):
                target.lerp_(source, 1.0 - decay)
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


# ---------------------------------------------------------------- all layers


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
    )


def fit(config: FitConfig) -> Path:
    """Train every layer (skipping finished ones), then write ``<out>/policy`` with save_pretrained."""
    config.validate()
    train_split = TraceSplit(config.traces, config.train_split)
    val_split = TraceSplit(config.traces, config.val_split)
    info = train_split.model
    out = Path(config.out)
    layer_dir = out / "layers"
    layer_dir.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in asdict(config).items() if k not in {"command", "layers"}}
    settings_file = out / "fit.json"
    if settings_file.exists() and json.loads(settings_file.read_text()) != settings:
        raise ValueError(f"{out} holds layers trained with other settings ({settings_file}); use a new --out")
    settings_file.write_text(json.dumps(settings, indent=1))
    torch.manual_seed(config.seed)
    policy = new_policy(info, config)
    layers = config.layers if config.layers is not None else list(range(info["num_layers"]))
    started = time.time()
    for layer in tqdm(layers, desc=f"fit ({config.objective})", unit="layer"):
        weights, record = layer_dir / f"layer_{layer:02d}.safetensors", layer_dir / f"layer_{layer:02d}.json"
        if weights.exists() and record.exists():
            continue
        torch.manual_seed(config.seed * 1000 + layer)
        agents = policy.layers[layer]
        t0 = time.time()
        history = fit_layer(
            agents, train_split.layer(layer), val_split.layer(layer), config, f"layer {layer}"
        )
        history["seconds"] = round(time.time() - t0, 1)
        save_file({k: v.contiguous() for k, v in agents.state_dict().items()}, str(weights))
        record.write_text(json.dumps(history))
    missing = [
        i for i in range(info["num_layers"]) if not (layer_dir / f"layer_{i:02d}.safetensors").exists()
    ]
    if missing:
        print(f"layers still to train: {missing}; the policy is written once every layer is done")
        return out
    for i, agents in enumerate(policy.layers):
        agents.load_state_dict(load_file(str(layer_dir / f"layer_{i:02d}.safetensors")))
    histories = [
        json.loads((layer_dir / f"layer_{i:02d}.json").read_text()) for i in range(info["num_layers"])
    ]
    policy.training_info = {
        "data": f"{len(train_split)} training / {len(val_split)} validation traces of {info['name']} "
        f"({describe_sources(train_split)})",
        "steps": config.steps,
        "command": config.command,
        "objective": config.objective,
        "batch_size": config.batch_size,
        "lr": config.lr,
        "val_reward_initial": round(sum(h["initial_val_reward"] for h in histories) / len(histories), 4),
        "val_reward_best": round(sum(h["best_val_reward"] for h in histories) / len(histories), 4),
        "train_minutes": round(sum(h["seconds"] for h in histories) / 60, 1),
    }
    policy.save_pretrained(out / "policy")
    plots.training_curves(out, out / "training_curves.png")
    print(f"fit took {time.time() - started:.0f} s in this run; policy written to {out / 'policy'}")
    return out / "policy"


def describe_sources(split: TraceSplit) -> str:
    counts: dict[str, int] = {}
    for sample in split.samples:
        kind = "essay text" if sample["source"] in {"essay", "text"} else "synthetic RULER"
        counts[kind] = counts.get(kind, 0) + 1
    tokens = sorted(s["prompt_tokens"] for s in split.samples)
    return ", ".join(f"{v} {k}" for k, v in counts.items()) + f"; prompts of {tokens[0]}-{tokens[-1]} tokens"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = FitConfig(traces="", out="")
    parser.add_argument("--traces", required=True, help="directory written by `collect`")
    parser.add_argument("--out", required=True, help="run directory (layers/, fit.json, policy/); resumable")
    parser.add_argument("--objective", choices=OBJECTIVES, default="rl")
    for name in ("steps", "batch_size", "warmup", "eval_every", "hidden_dim", "pos_dim", "max_positions"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--num-mlp-layers", type=int, default=defaults.num_mlp_layers)
    for name in ("lr", "min_lr", "weight_decay", "grad_clip", "ema_decay", "advantage_clip"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--position-strategy", choices=sorted(POSITION_STRATEGIES), default="clamp")
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="train only these layers")
    parser.add_argument("--train-split", default="train")
    parser.add_argument("--val-split", default="val")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)


def fit_command(args: argparse.Namespace) -> None:
    fields = set(FitConfig.__dataclass_fields__) - {"command"}
    fit(FitConfig(**{k: v for k, v in vars(args).items() if k in fields}))
