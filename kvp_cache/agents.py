"""The KVP agents network: one small scoring MLP ("agent") per KV head, all heads of a layer batched.

Moschella et al., "Learning to Evict from Key-Value Cache" (arXiv 2602.10238). Each agent scores
one cached entry from its key, its value and its position; the cache keeps the top-scored
entries of each head. The agent follows the paper's released code (``KVSamplingGroupedQueryAgent``)::

    k_feat = LayerNorm(Linear(head_dim -> hidden)(k))
    v_feat = LayerNorm(Linear(head_dim -> hidden)(v))
    p_feat = LayerNorm(Embedding(max_positions, pos_dim)[position])
    h      = concat(k_feat, v_feat, p_feat)
    h      = SiLU(LayerNorm(Linear(h)))          # num_mlp_layers times, width hidden
    score  = Linear(hidden -> 1)(h)

All heads of a layer are one :class:`HeadAgents` module with stacked parameters. Its ``forward``
is the fused, batched computation used at run time; :meth:`HeadAgents.reference_forward` is the
definition above written out one head and one row at a time, the yardstick the fused one is
tested against.

Positions are the index of a token among its row's real tokens (0..n-1). ``position_strategy``
says what happens past the embedding table (see :data:`POSITION_STRATEGIES`). ``trained_length``
(the longest training prompt, when known) caps what any strategy reads at the last row training
reached: rows past it never received a gradient and hold their random initialization.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

POSITION_STRATEGIES = {
    "clamp": "positions >= max_positions share the last embedding row (the paper's code)",
    "scale": (
        "a row of n > max_positions real tokens is spread over the whole table (a relative position): "
        "position p reads fractional row p * (max_positions - 1) / (n - 1), linearly interpolating the "
        "position features of the two nearest rows; rows with n <= max_positions read exactly what "
        "'clamp' reads"
    ),
    "recency": (
        "position p of a row of n real tokens reads fractional row log2(1 + n - 1 - p) * "
        "(max_positions - 1) / 16: its distance to the row's last token on a log scale, linearly "
        "interpolating the two nearest rows (128 rows: about 8 per doubling, up to 65,536 tokens); "
        "the same distance reads the same row at every context length"
    ),
}
# "recency" spreads distances 0 .. 2**RECENCY_SPAN_LOG2 - 1 over the table.
RECENCY_SPAN_LOG2 = 16


def check_positive_int(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 1 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_trained_length(value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is None or an int >= 1."""
    if value is not None:
        check_positive_int("trained_length", value)


def check_position_strategy(value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` names one of :data:`POSITION_STRATEGIES`."""
    if value not in POSITION_STRATEGIES:
        raise ValueError(f"position_strategy must be one of {sorted(POSITION_STRATEGIES)}, got {value!r}")


def _inference() -> bool:
    """Whether scoring may overwrite its intermediates: scoring a 4K prompt spends much of its time
    on element-wise passes over them, and in place they need no new buffers. Training keeps them,
    as autograd needs them."""
    return not torch.is_grad_enabled()


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
        weight, bias = _per_batch(weight, batch), _per_batch(bias, batch)[:, None, :]
        if weight.shape[-1] == 1:
            # One output is a dot product per row: bmm runs it 5x slower on CPU than this.
            return (x * weight.transpose(1, 2)).sum(-1, keepdim=True).add_(bias)
        # Adding the bias afterwards beats baddbmm's broadcast copy of it into the output.
        return torch.bmm(x, weight).add_(bias)


class StackedLayerNorm(nn.Module):
    """One ``LayerNorm(dim)`` per head: weight and bias ``[heads, dim]``."""

    def __init__(self, heads: int, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads, dim))
        self.bias = nn.Parameter(torch.zeros(heads, dim))

    def normalize(self, x: Tensor, centered: bool = False) -> Tensor:
        """LayerNorm without its affine; ``centered``: ``x`` has zero mean over its last dim already.

        Without autograd, a centered ``x`` is overwritten (callers pass fresh intermediates)."""
        if centered:
            # An RMS norm in two passes over x (F.rms_norm takes four on CPU).
            mean_square = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.shape[-1]
            inverse_rms = torch.rsqrt(mean_square + self.eps)
            return x.mul_(inverse_rms) if _inference() else x * inverse_rms
        return F.layer_norm(x, x.shape[-1:], eps=self.eps)

    def forward(self, x: Tensor, batch: int = 1, centered: bool = False) -> Tensor:
        """``[batch * heads, n, dim]`` -> ``[batch * heads, n, dim]``."""
        weight, bias = _per_batch(self.weight, batch), _per_batch(self.bias, batch)
        normalized = self.normalize(x, centered)
        out = normalized if _inference() else None
        return torch.addcmul(bias[:, None, :], normalized, weight[:, None, :], out=out)


class MLPBlock(nn.Module):
    """``SiLU(LayerNorm(Linear(x)))`` per head."""

    def __init__(self, heads: int, in_dim: int, out_dim: int):
        super().__init__()
        self.linear = StackedLinear(heads, in_dim, out_dim)
        self.norm = StackedLayerNorm(heads, out_dim)

    def forward(self, x: Tensor, batch: int = 1) -> Tensor:
        """``[batch * heads, n, in]`` -> ``[batch * heads, n, out]``."""
        return F.silu(
            self.norm(self.linear(x, batch, centered=True), batch, centered=True), inplace=_inference()
        )


class HeadAgents(nn.Module):
    """All KV heads of one layer, one agent each, evaluated as one batched op (no Python loop over heads).

    Args:
        num_heads: KV heads of the layer (one agent each).
        head_dim: size of each key and value vector.
        hidden_dim: width of the key/value features and of the MLP.
        pos_dim: size of the position embedding.
        max_positions: rows of the position embedding table.
        num_mlp_layers: Linear/LayerNorm/SiLU blocks before the output layer (>= 1).
        position_strategy: "clamp", "scale" or "recency", see :data:`POSITION_STRATEGIES`.
        trained_length: the longest training prompt in tokens, or None (unknown: every row is read);
            see :meth:`last_trained_row`.
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
        trained_length: int | None = None,
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
            check_positive_int(name, value)
        check_position_strategy(position_strategy)
        check_trained_length(trained_length)
        self.num_heads, self.head_dim, self.max_positions = num_heads, head_dim, max_positions
        self.position_strategy, self.trained_length = position_strategy, trained_length
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

    def last_trained_row(self) -> float:
        """The highest (fractional) table row that prompts of ``trained_length`` tokens read: the
        row of position ``trained_length - 1`` ("clamp", "scale") or of that distance ("recency").
        Positions are read as if the table ended there. The last row when the length is unknown."""
        last = self.max_positions - 1
        if self.trained_length is None:
            return float(last)
        if self.position_strategy == "recency":
            return min(last, math.log2(self.trained_length) * last / RECENCY_SPAN_LOG2)
        return float(min(last, self.trained_length - 1))

    def table_positions(self, positions: Tensor) -> Tensor:
        """Fractional table rows ``[batch, seq]`` (float32) for token positions ``[batch, seq]`` (-1 on padding)."""
        top = self.last_trained_row()
        if self.position_strategy == "recency":
            distance = (positions.amax(dim=-1, keepdim=True) - positions).clamp(min=0).float()
            rows = torch.log2(1 + distance) * ((self.max_positions - 1) / RECENCY_SPAN_LOG2)
            return rows.clamp(max=top)
        rows = positions.clamp(min=0).float()
        if self.position_strategy == "scale":
            # n - 1 = the row's largest position; rows that fit below ``top`` keep their exact indices.
            span = positions.amax(dim=-1, keepdim=True).float().clamp(min=max(top, 1.0))
            rows = rows * (top / span)
        return rows.clamp(max=top)

    def forward(self, keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        """Score every entry of every head.

        keys, values: ``[batch, heads, seq, head_dim]``, any float dtype and device (cast to the
            agents' dtype).
        positions: ``[batch, seq]`` long, the index among the row's real tokens, -1 on padding.
        Returns float32 ``[batch, heads, seq]``; padding gets -inf.

        Computes what :meth:`reference_forward` computes (up to float rounding), arranged for speed:
        the LayerNorm affines feeding the first MLP Linear are folded into its weights, every
        Linear feeding a LayerNorm has that norm's centering folded in (leaving an RMS norm), and
        the position LayerNorm runs once per table row, not once per token; tokens gather their
        row's normalized features.
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
        # The position branch is linear in the normalized table row, so interpolating rows commutes
        # with it: tokens gather the narrow normalized rows, with a 1 appended that carries the
        # constant, and one narrow product per token maps them to the hidden width.
        table = self.position_norm(self.position_table)
        table = torch.cat([table, torch.ones_like(table[..., :1])], dim=-1)
        w_table = torch.cat([w_position, constant[:, None, :]], dim=1)
        w_table = _per_batch(w_table - w_table.mean(-1, keepdim=True), b)
        w_key = self.key_norm.weight[:, :, None] * w_key
        w_value = self.value_norm.weight[:, :, None] * w_value
        w_key = _per_batch(w_key - w_key.mean(-1, keepdim=True), b)
        w_value = _per_batch(w_value - w_value.mean(-1, keepdim=True), b)

        def normalized_projection(x: Tensor, proj: StackedLinear, norm: StackedLayerNorm) -> Tensor:
            return norm.normalize(proj(x.to(dtype).reshape(b * h, n, d), b, centered=True), centered=True)

        pre = torch.bmm(self.gather_rows(table, positions).reshape(b * h, n, -1), w_table)
        pre = pre.baddbmm_(normalized_projection(keys, self.key_proj, self.key_norm), w_key)
        pre = pre.baddbmm_(normalized_projection(values, self.value_proj, self.value_norm), w_value)
        features = F.silu(first.norm(pre, b, centered=True), inplace=_inference())
        for block in self.mlp[1:]:
            features = block(features, b)
        scores = self.out(features, b).view(b, h, n).float()
        return scores.masked_fill((positions < 0)[:, None, :], float("-inf"))

    def reference_forward(self, keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        """The agents' definition, one head and one row at a time: what :meth:`forward` computes, slowly.

        Same inputs and output as :meth:`forward` (``keys``, ``values`` ``[batch, heads, seq, head_dim]``,
        ``positions`` ``[batch, seq]``; float32 scores ``[batch, heads, seq]``, -inf on padding), written
        without its folding, fusing or gathering, so tests can hold the fast path against it.
        """
        table_dtype, device = self.position_table.dtype, self.position_table.device
        keys, values, positions = (
            keys.to(device, table_dtype),
            values.to(device, table_dtype),
            positions.to(device),
        )
        out = torch.empty(keys.shape[:3], device=device)
        last, top = self.max_positions - 1, self.last_trained_row()

        def layer_norm(x: Tensor, norm: StackedLayerNorm, h: int) -> Tensor:
            return F.layer_norm(x, x.shape[-1:], norm.weight[h], norm.bias[h], norm.eps)

        def linear(x: Tensor, lin: StackedLinear, h: int) -> Tensor:
            return x @ lin.weight[h] + lin.bias[h]

        for row in range(keys.shape[0]):
            real = positions[row] >= 0
            n = int(real.sum())
            p = positions[row].clamp(min=0).float()
            if self.position_strategy == "scale" and n - 1 > top:
                p = p * top / (n - 1)
            if self.position_strategy == "recency":
                p = torch.log2((n - p).clamp(min=1)) * last / RECENCY_SPAN_LOG2
            p = p.clamp(max=top)
            low, high = p.floor().long(), (p.floor().long() + 1).clamp(max=last)
            for h in range(keys.shape[1]):
                table = layer_norm(self.position_table[h], self.position_norm, h)
                position = torch.lerp(table[low], table[high], (p - low)[:, None])
                x = torch.cat(
                    [
                        layer_norm(linear(keys[row, h], self.key_proj, h), self.key_norm, h),
                        layer_norm(linear(values[row, h], self.value_proj, h), self.value_norm, h),
                        position,
                    ],
                    dim=-1,
                )
                for block in self.mlp:
                    x = F.silu(layer_norm(linear(x, block.linear, h), block.norm, h))
                out[row, h] = linear(x, self.out, h).squeeze(-1).masked_fill(~real, float("-inf"))
        return out

    def gather_rows(self, per_row: Tensor, positions: Tensor) -> Tensor:
        """Each token's position features: ``per_row`` ``[heads, max_positions, f]`` -> ``[batch, heads, seq, f]``.

        "clamp" reads the token's row; "scale" and "recency" interpolate linearly between the two rows
        around its fractional row.
        """
        rows = self.table_positions(positions)
        b, n = rows.shape

        def read(index: Tensor) -> Tensor:
            # Whole-row copies; indexing by (head, token) pairs is slower on CPU.
            return per_row.index_select(1, index.reshape(-1)).view(self.num_heads, b, n, -1).transpose(0, 1)

        low = rows.floor().long()
        gathered = read(low)
        if self.position_strategy != "clamp":
            high = (low + 1).clamp(max=self.max_positions - 1)
            fraction = (rows - low.float())[:, None, :, None].to(per_row.dtype)
            gathered = torch.lerp(gathered, read(high), fraction)
        return gathered
