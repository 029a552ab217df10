"""Supervised learning-to-rank objectives (ListNet, as shipped, and the paper's ablation baselines).

Same agents, same features, same traces as the RL trainer; only the loss changes
(``python -m train fit --objective <name>``). Each loss takes scores ``[batch, heads, n]``,
importance ``[batch, heads, n]`` and valid ``[batch, heads, n]``:

- ``regression``: MSE between the score and the log of the normalized importance;
- ``ranknet``: pairwise logistic loss on random token pairs (Burges et al. 2005);
- ``listnet``: cross-entropy between the normalized importance and ``softmax(scores)`` (Cao et al. 2007);
- ``softsort``: length-normalized MSE between soft ranks of the scores and the true ranks
  (the v1 paper's baseline, soft ranks after Blondel et al. 2020, here the pairwise-sigmoid form).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvp_cache.policy import HeadAgents
from train.batch import Batch
from train.reward import normalized

PAIRS_PER_ROW = 4096
SOFTSORT_TOKENS = 256
SOFTSORT_TEMPERATURE = 0.1


def regression(scores, importance, valid, generator=None) -> torch.Tensor:
    target = torch.log(normalized(importance, valid) + 1e-8)
    error = (scores.masked_fill(~valid, 0.0) - target) ** 2
    return (error * valid).sum() / valid.sum()


def ranknet(scores, importance, valid, generator=None) -> torch.Tensor:
    b, h, n = scores.shape
    lengths = valid[:, 0].sum(-1)  # [b] real tokens per row (padding is at the end)
    u = torch.rand(2, b, 1, PAIRS_PER_ROW, generator=generator).to(scores.device)
    index = (u * lengths[None, :, None, None]).long().expand(2, b, h, PAIRS_PER_ROW)
    s_i, s_j = scores.gather(-1, index[0]), scores.gather(-1, index[1])
    c_i, c_j = importance.gather(-1, index[0]), importance.gather(-1, index[1])
    label = (c_i > c_j).float()
    informative = (c_i != c_j).float()
    losses = F.binary_cross_entropy_with_logits(s_i - s_j, label, reduction="none")
    return (losses * informative).sum() / informative.sum().clamp_min(1)


def listnet(scores, importance, valid, generator=None) -> torch.Tensor:
    target = normalized(importance, valid)
    log_p = scores.masked_fill(~valid, -1e4).log_softmax(-1)
    return -(target * log_p).sum(-1).mean()


def softsort(scores, importance, valid, generator=None) -> torch.Tensor:
    b, h, n = scores.shape
    lengths = valid[:, 0].sum(-1)
    m = SOFTSORT_TOKENS
    # A random subset of tokens per row keeps the pairwise soft ranks at m x m.
    u = torch.rand(b, 1, m, generator=generator).to(scores.device)
    index = (u * lengths[:, None, None]).long().expand(b, h, m)
    s, c = scores.gather(-1, index), importance.gather(-1, index)
    soft_rank = torch.sigmoid((s[..., None, :] - s[..., :, None]) / SOFTSORT_TEMPERATURE).sum(-1) - 0.5
    true_rank = (c[..., None, :] > c[..., :, None]).float().sum(-1)
    return ((soft_rank - true_rank) / m).pow(2).mean()


LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "regression": regression,
    "ranknet": ranknet,
    "listnet": listnet,
    "softsort": softsort,
}


def supervised_objective(
    loss: Callable[..., torch.Tensor], agents: HeadAgents, batch: Batch, generator: torch.Generator
) -> tuple[torch.Tensor, None]:
    """``(loss, None)`` of one batch: a supervised objective reports no sampled reward."""
    scores = batch.scores(agents)
    valid = batch.valid[:, None, :].expand_as(scores)
    return loss(scores, batch.importance, valid, generator), None
