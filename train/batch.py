"""Padded batches of one layer's traces, the unit every objective and the validation consume."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.traces import LayerSample


@dataclass
class Batch:
    """Right-padded samples of one layer.

    keys, values: ``[batch, kv_heads, n, head_dim]`` float32; importance: ``[batch, kv_heads, n]``
    (the training target, 0 on padding); positions: ``[batch, n]`` token index (-1 on padding);
    valid: ``[batch, n]`` bool.
    """

    keys: torch.Tensor
    values: torch.Tensor
    importance: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(getattr(self, name).to(device) for name in self.__dataclass_fields__))


def pad_batch(samples: list[LayerSample]) -> Batch:
    """Stack samples of one layer, right-padded to the longest."""
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
    return Batch(keys, values, importance, positions, positions >= 0)
