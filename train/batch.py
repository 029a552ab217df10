"""Padded batches of one layer's traces, the unit every objective and the validation consume.

A batch holds sequences (a prefill sample's prompt; a decode sample's whole sequence) and the
ranking problems over them (a prefill sample: one, over its prompt; a decode sample: one per
eviction, over the tokens read by then). The policy scores every token as it entered the cache:
in the forward that read it, at its index among the sequence's tokens (``KVPCache`` scores a
prompt as one row and each decoded chunk as its own row, so a ``"scale"`` or ``"recency"``
position depends on the row), see :meth:`Batch.scores`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvp_cache.policy import HeadAgents
from train.traces import LayerSample


@dataclass
class Batch:
    """Right-padded sequences and ranking problems of one layer.

    keys, values: ``[sequences, kv_heads, n, head_dim]`` float32;
    importance: ``[problems, kv_heads, n]``, the training target (0 where not ranked);
    valid: ``[problems, n]`` bool, the tokens each problem ranks;
    sequence: ``[problems]`` long, the sequence each problem ranks;
    entries: the rows the tokens entered the cache with, rows of one length stacked: per length
        ``L``, ``(index [rows, L]`` into the flattened ``[sequences * n]`` tokens, ``positions
        [rows, L])``, the tokens' indices in their sequence.
    """

    keys: torch.Tensor
    values: torch.Tensor
    importance: torch.Tensor
    valid: torch.Tensor
    sequence: torch.Tensor
    entries: list[tuple[torch.Tensor, torch.Tensor]]

    def to(self, device: torch.device | str) -> Batch:
        moved = {name: getattr(self, name).to(device) for name in ("keys", "values", "importance", "valid")}
        entries = [(index.to(device), positions.to(device)) for index, positions in self.entries]
        return Batch(**moved, sequence=self.sequence.to(device), entries=entries)

    def scores(self, agents: HeadAgents) -> torch.Tensor:
        """``[problems, kv_heads, n]`` float32: every token scored as it entered the cache, -inf
        where its problem does not rank it."""
        s, h, n, d = self.keys.shape
        flat_keys = self.keys.transpose(1, 2).reshape(s * n, h, d)
        flat_values = self.values.transpose(1, 2).reshape(s * n, h, d)
        flat = self.keys.new_full((s * n, h), float("-inf"))
        for index, positions in self.entries:
            merged = one_row_positions(agents, positions)
            if merged is not None:  # [1, rows * L]: one wide row instead of many short ones
                index = index.reshape(1, -1)
            rows = agents(
                flat_keys[index].transpose(1, 2),
                flat_values[index].transpose(1, 2),
                positions if merged is None else merged,
            )
            flat = flat.index_put((index.reshape(-1),), rows.transpose(1, 2).reshape(-1, h))
        per_sequence = flat.view(s, n, h).transpose(1, 2)
        return per_sequence[self.sequence].masked_fill(~self.valid[:, None, :], float("-inf"))


def one_row_positions(agents: HeadAgents, positions: torch.Tensor) -> torch.Tensor | None:
    """Positions ``[1, rows * L]`` of ONE row whose tokens read the same position-table rows as
    ``positions`` ``[rows, L]`` read as separate rows, or None when there are none.

    A token's score depends on its key, its value and its table row alone, so such a row scores
    every token as its own row would (up to float rounding). It exists for one-token rows (decoded tokens: "clamp" and
    "scale" read row ``min(p, top)``, "recency" row 0), and is checked, not assumed. The agents
    repeat their weights per row, so thousands of one-token rows would cost far more than one.
    """
    if positions.shape[0] == 1:
        return None
    wanted = agents.table_positions(positions).reshape(1, -1)
    merged = wanted.round().long()
    # Up to float rounding (p * (top / p) need not be exactly top): a 1e-4 row apart is the same row.
    return merged if torch.allclose(agents.table_positions(merged), wanted, rtol=0, atol=1e-4) else None


def entry_forwards(sample: LayerSample) -> list[int]:
    """The forwards whose tokens entered the cache together: ``forward_tokens``, or the prompt."""
    n = sample.keys.shape[1]
    forwards = sample.forward_tokens or [n]
    if sum(forwards) != n or min(forwards) < 1:
        raise ValueError(
            f"{sample.uid}: forward_tokens {forwards} must be >= 1 each and sum to its {n} tokens"
        )
    return forwards


def pad_batch(samples: list[LayerSample]) -> Batch:
    """Stack samples of one layer, right-padded to the longest; a decode sample adds one problem per
    eviction."""
    n = max(s.keys.shape[1] for s in samples)
    h, _, d = samples[0].keys.shape
    keys = torch.zeros(len(samples), h, n, d)
    values = torch.zeros(len(samples), h, n, d)
    importance, ranked, sequence = [], [], []
    starts: dict[int, list[tuple[int, int]]] = {}  # row length -> (flat index, position) of each row start
    for i, sample in enumerate(samples):
        m = sample.keys.shape[1]
        keys[i, :, :m], values[i, :, :m] = sample.keys.float(), sample.values.float()
        position = 0
        for length in entry_forwards(sample):
            starts.setdefault(length, []).append((i * n + position, position))
            position += length
        if sample.evictions is None:
            problems, reads = sample.importance.float()[None], [m]
        else:
            problems, reads = sample.importance.float(), sample.evictions
        importance.append(torch.nn.functional.pad(problems, (0, n - m)))
        ranked += reads
        sequence += [i] * len(reads)
    entries = []
    for length, firsts in starts.items():
        first = torch.tensor(firsts)  # [rows, 2]
        offsets = torch.arange(length)
        entries.append((first[:, :1] + offsets, first[:, 1:] + offsets))
    valid = torch.arange(n)[None, :] < torch.tensor(ranked)[:, None]
    return Batch(keys, values, torch.cat(importance), valid, torch.tensor(sequence), entries)
