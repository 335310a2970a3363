"""A preallocated KV cache for the fast decoder, behind the engine's ``KVCache`` interface.

Knows: one key and one value buffer for all layers, shaped (layers, batch, kv_heads,
capacity, head_dim), a fill length, and how to append a forward's entries, compact to the
accepted path in place (an index copy of at most ``len(keep)`` entries per layer, done for
all layers in one op), and reset. Capacity starts small and doubles when a forward would
overflow it (a rare reallocation, amortised; never one per step) up to the model's
position limit.
Does not know: models, trees or attention; ``model`` writes and reads the buffers.
"""

from __future__ import annotations

import torch

from cadence.errors import CadenceError

INITIAL_CAPACITY = 1024


class StaticKVCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_positions: int,
                 dtype: torch.dtype, device: torch.device, batch: int = 1,
                 capacity: int | None = None):
        self.max_positions = max_positions
        cap = min(capacity or INITIAL_CAPACITY, max_positions)
        shape = (layers, batch, kv_heads, cap, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._len = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def length(self) -> int:
        return self._len

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more entries (doubling the buffers if needed)."""
        need = self._len + n
        if need <= self.capacity:
            return
        if need > self.max_positions:
            raise CadenceError(f"context of {need} tokens exceeds the model's {self.max_positions} positions")
        cap = self.capacity
        while cap < need:
            cap *= 2
        cap = min(cap, self.max_positions)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[:3] + (cap,) + old.shape[4:])
            new[:, :, :, :self._len] = old[:, :, :, :self._len]
            setattr(self, name, new)

    def advance(self, n: int) -> None:
        self._len += n

    def compact(self, past: int, keep: list[int]) -> None:
        """Keep entries [0, past) and past + keep[i]; see ``cadence.kv_cache``."""
        m = len(keep)
        if past + m > self._len:
            raise CadenceError(f"compact past={past} keep={keep} beyond cache length {self._len}")
        if list(keep) != list(range(m)):
            idx = torch.as_tensor(keep, dtype=torch.long, device=self.k.device) + past
            self.k[:, :, :, past:past + m] = self.k.index_select(3, idx)
            self.v[:, :, :, past:past + m] = self.v.index_select(3, idx)
        self._len = past + m

    def reset(self) -> None:
        self._len = 0

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
