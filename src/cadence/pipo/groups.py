"""How a token sequence becomes backbone positions under PIPO: pair positions and plain ones.

Knows: the grouping of a prompt (pairs from its first token; an odd prompt's last token is a
plain position), the token indices each position covers and predicts, and packing groups into
padded tensors. Does not know models or embeddings.

A *group* is a size: 2 = a pair position (the compressor's latent of tokens (a, b), read by the
adapted backbone), 1 = a plain position (the token's own embedding, read by the unmodified
weights). Groups never straddle the prompt/reply boundary: the prompt is grouped on its own, and
the reply's first group starts at the reply's first token. The hidden state of a group ending at
token index t - 1 predicts token t (LM head) and, given token t, token t + 1 (pair-out head).
"""

from __future__ import annotations

import torch

PAIR, PLAIN = 2, 1


def prompt_groups(n: int) -> list[int]:
    """Group sizes of an n-token prompt: n // 2 pairs, then one plain position when n is odd
    (the boundary choice: the token just before the reply is then read uncompressed)."""
    if n < 1:
        raise ValueError("an empty prompt has no positions")
    return [PAIR] * (n // 2) + [PLAIN] * (n % 2)


def starts(sizes: list[int]) -> list[int]:
    """Token index of each group's first token."""
    out, t = [], 0
    for z in sizes:
        out.append(t)
        t += z
    return out


def pack(tokens: list[int], sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence as (G, 2) token ids (a plain group's second slot is 0) and (G,) sizes."""
    if sum(sizes) != len(tokens):
        raise ValueError(f"groups cover {sum(sizes)} tokens, the sequence has {len(tokens)}")
    ids = torch.zeros(len(sizes), 2, dtype=torch.long)
    for g, (s, z) in enumerate(zip(starts(sizes), sizes)):
        ids[g, :z] = torch.tensor(tokens[s:s + z])
    return ids, torch.tensor(sizes, dtype=torch.long)


def pad_batch(items: list[tuple[torch.Tensor, torch.Tensor]], left: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad packed sequences to one length. Returns ids (B, G, 2), sizes (B, G) (pads: 1),
    attention mask (B, G) (1 = real), position ids (B, G) (0.. per sequence, pads 0)."""
    G = max(len(s) for _, s in items)
    B = len(items)
    ids = torch.zeros(B, G, 2, dtype=torch.long)
    sizes = torch.ones(B, G, dtype=torch.long)
    mask = torch.zeros(B, G, dtype=torch.long)
    for i, (t, s) in enumerate(items):
        n = len(s)
        sl = slice(G - n, G) if left else slice(0, n)
        ids[i, sl], sizes[i, sl], mask[i, sl] = t, s, 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, sizes, mask, pos
