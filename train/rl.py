"""The paper's RL objective: REINFORCE with a leave-one-out baseline on a Plackett-Luce policy.

1. Each agent scores every prompt token of a batch of traces; all KV heads of a layer are one
   batched ``HeadAgents`` and each (sample, head) is one episode.
2. ``permutations`` rankings per episode are sampled from the Plackett-Luce policy by Gumbel-sort,
   ``argsort(s + Gumbel)``.
3. Their reward is ``-cost / oracle_cost`` (``train/reward.py``), clamped at -200.
4. REINFORCE with a leave-one-out baseline, per head: over the batch's traces with one
   permutation (the released trainer), over the permutations of the same trace with several
   (the paper's Alg. 1). Advantages are standardized and clamped to [-2, 2]; the loss is
   ``-mean(A * log pi(sigma_t | remaining))`` over every step of every episode, with the exact PL
   log-probability from a reverse logcumsumexp.
"""

from __future__ import annotations

import torch

from kvp_cache.policy import HeadAgents
from train.batch import Batch
from train.reward import REWARD_FLOOR, ranking_reward


def gumbel_sort(scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample a ranking (best first) from the Plackett-Luce policy of ``scores`` ``[..., n]``.

    ``argsort(s + g)`` with ``g ~ Gumbel(0, 1)`` is an exact PL sample; -inf (padding) sorts last.
    The noise is drawn on the CPU so a seed gives the same rankings on every device.
    """
    u = torch.rand(scores.shape, generator=generator).clamp(1e-10, 1 - 1e-7).to(scores.device)
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
    """Leave-one-out advantages, standardized and clamped, per head.

    rewards: ``[k, ..., heads]``; the ``k`` episodes along dim 0 share a baseline:
    ``A_j = R_j - mean_{i != j} R_i``. Then ``(A - mean) / std`` over every episode of a head.
    """
    k = rewards.shape[0]
    advantages = rewards - (rewards.sum(0, keepdim=True) - rewards) / (k - 1)
    flat = advantages.reshape(-1, advantages.shape[-1])
    flat = (flat - flat.mean(0, keepdim=True)) / (flat.std(0, keepdim=True) + 1e-8)
    return flat.clamp(-clip, clip).view_as(advantages)


def reinforce_loss(
    agents: HeadAgents, batch: Batch, generator: torch.Generator, advantage_clip: float, permutations: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE-RLOO loss of one batch and the sampled rankings' mean reward per episode ``[batch, heads]``."""
    scores = batch.scores(agents)  # [problems, h, n]
    valid = batch.valid[:, None, :].expand_as(scores)
    shape = (permutations, *scores.shape)
    rankings = gumbel_sort(scores.expand(shape), generator)  # [k, b, h, n]
    with torch.no_grad():
        rewards = ranking_reward(rankings, batch.importance.expand(shape), valid.expand(shape), REWARD_FLOOR)
        # One permutation per trace: the traces of the batch share the baseline (dim 1 moves to 0).
        grouped = rewards if permutations > 1 else rewards[0]
        advantages = rloo_advantages(grouped, advantage_clip).view(shape[:-1])
    log_probs = plackett_luce_log_probs(
        scores.masked_fill(~valid, 0.0).expand(shape), rankings, valid.expand(shape)
    )
    steps = valid.sum() * permutations
    return -(advantages[..., None] * log_probs).sum() / steps, rewards.mean(0)
