"""KV cache of a transformers ``DynamicCache``: create, compact to the committed path, reset.

After a tree forward the cache holds ``past`` committed entries followed by one entry
per tree node. ``compact`` keeps the committed prefix plus the accepted nodes, in order.
Example: past=5, tree of 4 nodes, accepted nodes [0, 2] -> entries [0..4, 5, 7] remain,
length 7. A chain whose accepted nodes are [0, 1] is just cropped to length 7.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(backbone) -> DynamicCache:
    return DynamicCache(config=backbone.config)


def length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def compact(cache: DynamicCache, past: int, keep: list[int]) -> None:
    """Keep entries [0, past) and past + keep[i] for each accepted node, drop the rest."""
    total = cache.get_seq_length()
    if keep == list(range(len(keep))):
        if past + len(keep) < total:
            cache.crop(past + len(keep) - total)  # a negative count removes that many
        return
    for layer in cache.layers:
        idx = torch.tensor(keep, device=layer.keys.device) + past
        layer.keys = torch.cat([layer.keys[..., :past, :], layer.keys.index_select(-2, idx)], dim=-2)
        layer.values = torch.cat([layer.values[..., :past, :], layer.values.index_select(-2, idx)], dim=-2)


def reset(cache: DynamicCache) -> None:
    cache.reset()
