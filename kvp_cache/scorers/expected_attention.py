from dataclasses import dataclass

import torch

from kvp_cache.scorers.base import QueryStates, Scorer, group_queries, rotate_half
from kvp_cache.scorers.registry import register_scorer


@register_scorer
@dataclass
class ExpectedAttentionScorer(Scorer):
    """Closed-form attention that future queries are expected to pay each key.

    Devoto, Jeblick, Jegou, "Expected Attention: KV Cache Compression by Estimating Attention from
    Future Queries Distribution" (arXiv 2510.00636), the kvpress method. The prompt's pre-RoPE
    queries are modelled as a Gaussian per query head; its mean and covariance are rotated by RoPE
    averaged over the next ``n_future_positions`` positions, which gives
    ``E[exp(q.k * s)] = exp(mu.k * s + s^2 k^T Sigma k / 2)``. The softmax of that over the keys is
    averaged over the GQA group, multiplied by ``||v||`` (``use_vnorm``) and offset by ``epsilon``.

    Queries seen: the Gaussian is fitted to every query of the evicting forward (the whole prompt
    at the prefill eviction); while decoding with ``max_cache_tokens``, to the queries of the
    tokens appended since the previous eviction.

    Across heads (:meth:`cross_head_scores`, as kvpress pairs it with Ada-KV): the scores without
    ``epsilon``. Each is the expected softmax attention of a future query of the KV head's group to
    the entry (every head's total is 1), times ``||v||`` with ``use_vnorm``: then the expected size
    of what the entry adds to the head's output, which compares across heads and layers as an
    output contribution rather than as a share adding up to 1.
    """

    name = "expected_attention"
    needs_queries = True
    comparable_across_heads = True
    query_window = -1
    n_future_positions: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def score(self, keys, values, positions, queries: QueryStates, layer_idx=0) -> torch.Tensor:
        b, h, n, d = keys.shape
        pre = queries.pre_rope_queries.float()  # [b, hq, m, d]
        valid = (positions[:, -pre.shape[-2] :] >= 0)[:, None, :, None].float()
        count = valid.sum(-2, keepdim=True).clamp_min(1.0)
        mean = (pre * valid).sum(-2, keepdim=True) / count  # [b, hq, 1, d]
        future = self._future_rotation(queries, d)  # x -> average future rotation of x
        mean_future = future(mean)
        logits = torch.einsum("bhgd,bhnd->bhgn", group_queries(mean_future, h)[..., 0, :], keys.float())
        logits = logits * queries.scaling
        if self.use_covariance:
            centered = (pre - mean) * valid
            covariance = centered.transpose(-1, -2) @ centered / count  # [b, hq, d, d]
            rotation = future(torch.eye(d, device=keys.device).expand(b, 1, d, d))  # rows: A e_i -> A^T
            covariance = rotation.transpose(-1, -2) @ covariance @ rotation
            cov = group_queries(covariance, h)  # [b, h, g, d, d]
            quadratic = torch.einsum("bhnd,bhgde,bhne->bhgn", keys.float(), cov, keys.float())
            logits = logits + 0.5 * queries.scaling**2 * quadratic
        logits = logits.masked_fill(~(positions >= 0)[:, None, None, :], float("-inf"))
        scores = logits.softmax(dim=-1).mean(dim=2)
        if self.use_vnorm:
            scores = scores * values.float().norm(dim=-1)
        return scores + self.epsilon

    def cross_head_scores(self, scores, valid, layer_idx=0) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` float32 expected attention shares (times ``||v||`` with
        ``use_vnorm``; see the class docstring), -inf where not ``valid``."""
        return (scores.float() - self.epsilon).masked_fill(~valid, float("-inf"))

    def _future_rotation(self, queries, head_dim: int):
        """Linear map ``x -> mean_j R(p_last + j) x`` over the next positions, per batch row."""
        steps = torch.arange(1, self.n_future_positions + 1, device=queries.rope_step.device).float()
        angles = steps[:, None] * queries.rope_step[None, :]
        mean_cos, mean_sin = angles.cos().mean(0), angles.sin().mean(0)  # [d]
        last_cos = queries.last_cos[:, None, None, :]
        last_sin = queries.last_sin[:, None, None, :]

        def apply(x: torch.Tensor) -> torch.Tensor:
            x = x * last_cos + rotate_half(x) * last_sin
            return x * mean_cos + rotate_half(x) * mean_sin

        return apply
