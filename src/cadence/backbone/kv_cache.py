"""The KV cache interface the engine uses, and its implementation over transformers' cache.

Every backbone hands out caches through ``backbone.new_cache()``; the engine only ever
asks a cache for its length, compacts it to the accepted path, or resets it. The
transformers path wraps a ``DynamicCache`` (``HFCache``); the fast path has its own
preallocated cache with the same three methods.

After a tree forward the cache holds ``past`` committed entries followed by one entry
per tree node. ``compact`` keeps the committed prefix plus the accepted nodes, in order.
Example: past=5, tree of 4 nodes, accepted nodes [0, 2] -> entries [0..4, 5, 7] remain,
length 7. A chain whose accepted nodes are [0, 1] is just cropped to length 7.

Sliding-window layers (Mistral, Gemma 2/3, Qwen2 with ``use_sliding_window``) keep only
the last W entries, so "entry past + i" is not at index past + i once the window is
full and compaction by index would corrupt them: ``HFCache`` refuses such models (see
``check_supported``) instead of decoding them wrongly.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache

from cadence.errors import CadenceError


class KVCache(Protocol):
    def length(self) -> int:
        """Entries held (committed tokens plus the nodes of a tree not yet compacted)."""

    def compact(self, past: int, keep: list[int]) -> None:
        """Keep entries [0, past) and past + keep[i] for each accepted node, drop the rest."""

    def reset(self) -> None:
        """Drop every entry."""


def _sliding_layers(cache: DynamicCache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if "Sliding" in type(layer).__name__]


def check_supported(config) -> None:
    """Refuse configs whose cache has sliding-window layers (see the module docstring)."""
    sliding = _sliding_layers(DynamicCache(config=config))
    if sliding:
        window = getattr(config, "sliding_window", None)
        raise CadenceError(
            f"{getattr(config, 'model_type', 'this model')} uses sliding-window attention "
            f"(window {window}, layers {sliding[:4]}{'...' if len(sliding) > 4 else ''}); cadence's "
            "KV-cache compaction supports full-attention caches only")


class HFCache:
    """A transformers ``DynamicCache`` (``.hf``) behind the ``KVCache`` interface."""

    def __init__(self, config):
        self.hf = DynamicCache(config=config)

    def length(self) -> int:
        return self.hf.get_seq_length()

    def compact(self, past: int, keep: list[int]) -> None:
        total = self.length()
        if keep == list(range(len(keep))):
            if past + len(keep) < total:
                self.hf.crop(past + len(keep) - total)  # a negative count removes that many
            return
        for layer in self.hf.layers:
            idx = torch.tensor(keep, device=layer.keys.device) + past
            layer.keys = torch.cat([layer.keys[..., :past, :], layer.keys.index_select(-2, idx)], dim=-2)
            layer.values = torch.cat([layer.values[..., :past, :], layer.values.index_select(-2, idx)], dim=-2)

    def reset(self) -> None:
        self.hf.reset()
