"""How the trees of many rows become one backbone forward (tokens, positions, mask).

Knows: the ragged layout of ``cadence.fast.cache.BatchKVCache`` (row b's committed
entries at [0, past_b), its new nodes written at [past_b, past_b + n)) and how to pad
trees of different sizes to the largest. Does not know: how trees were drafted, which
nodes will be accepted, or models.

Every row's tree is padded to n = max node count with dummy nodes; a dummy node repeats
the row's root token at the root's position and sees only the row's committed entries
and itself (its output is never read; seeing nothing would make its softmax NaN).
Keys are read up to L = max(past) + n for every row; the mask hides, per row, keys it
does not own (another row's longer past, stale entries of its own past its end).

Worked example: rows with past [5, 3]; row 0 runs a 2-node chain (root r0 -> a), row 1 a
3-node tree (root r1 with children x, y). n = 3, L = 8.
  tokens     [[r0, a, r0], [r1, x, y]]
  positions  [[5, 6, 5], [3, 4, 4]]
  row 0 writes keys 5, 6, 7 (7: dummy); row 1 writes keys 3, 4, 5.
  mask[0] (queries x keys 0..7):  q0 11111 100    q1 11111 110    q2 (dummy) 11111 001
  mask[1]:                        q0 111 100 00   q1 111 110 00   q2 111 101 00
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.trees.tree import CompiledTree


@dataclass
class Packed:
    """One batched verify forward's inputs."""

    tokens: torch.Tensor  # (B, n) long
    positions: torch.Tensor  # (B, n) long, absolute positions
    mask: torch.Tensor  # (B, 1, n, L) bool, L = max(starts) + n
    starts: list[int]  # (B,) committed length of each row: where its nodes are written
    sizes: list[int]  # (B,) real nodes of each row (the rest is padding)


def pack(pasts: list[int], trees: list[CompiledTree], tokens: list[torch.Tensor], device) -> Packed:
    """Pad each row's tree to the largest and build the ragged mask (see the module
    docstring). tokens[b]: (trees[b].size,) long."""
    b = len(trees)
    sizes = [t.size for t in trees]
    n = max(sizes)
    end = max(pasts) + n
    ids = torch.empty(b, n, dtype=torch.long)
    pos = torch.empty(b, n, dtype=torch.long)
    keys = torch.arange(end)
    mask = (keys[None, None, :] < torch.tensor(pasts)[:, None, None]).expand(b, n, end).clone()
    for r, (past, tree, toks) in enumerate(zip(pasts, trees, tokens)):
        m = tree.size
        ids[r, :m] = toks.cpu()
        ids[r, m:] = int(toks[0])
        pos[r, :m] = torch.tensor(tree.depths) + past
        pos[r, m:] = past
        mask[r, :m, past:past + m] = tree.mask
        pad = torch.arange(m, n)
        mask[r, pad, past + pad] = True
    return Packed(ids.to(device), pos.to(device), mask[:, None].to(device), list(pasts), sizes)
