"""A preallocated KV cache for the fast decoder, behind the engine's ``KVCache`` interface.

Knows: one key and one value buffer for all layers, shaped (layers, batch, kv_heads,
capacity, head_dim), a fill length, and how to append a forward's entries, compact to the
accepted path in place (an index copy of at most ``len(keep)`` entries per layer, done for
all layers in one op), and reset. Capacity starts small and doubles when a forward would
overflow it (a rare reallocation, amortised; never one per step) up to the model's
position limit.
A float16 cache under a float32 model: how entries are rounded when stored and widened when
read by other kernels (``stored``, ``widened``).
Does not know: models, trees or attention; ``model`` writes and reads the buffers.
"""

from __future__ import annotations

import torch

from cadence.errors import CadenceError
from cadence.fast.quant import F16_MAX

INITIAL_CAPACITY = 1024


def stored(x: torch.Tensor, kv_dtype: torch.dtype, ops=None) -> torch.Tensor:
    """Keys or values as a cache of ``kv_dtype`` holds them: unchanged, or (a float16 cache under
    a float32 model) rounded to nearest even with saturation at +-65504 by the native ``kv_half``
    where ``ops`` (the extension) is given, the C++ loop's own store, else by torch (same bits)."""
    if x.dtype == kv_dtype:
        return x
    return ops.kv_half(x) if ops is not None else x.clamp(-F16_MAX, F16_MAX).to(kv_dtype)


def widened(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached keys or values in the model's ``dtype`` (exact), for attention kernels other than
    ``listed_attention``, which reads a float16 cache itself."""
    return x if x.dtype == dtype else x.to(dtype)


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
        """Keep entries [0, past) and past + keep[i]; see ``cadence.backbone.kv_cache``."""
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


class BatchKVCache:
    """A KV cache for many sequences at once, each row with its own fill length (ragged).

    Layout: ``k``, ``v`` shaped (layers, slots, kv_heads, capacity, head_dim); row ``s``
    holds its committed entries at [0, lengths[s]). A batched forward writes row s's
    n new entries at [start_s, start_s + n) (``start_s`` = that row's committed length),
    so rows never share positions and never need shifting; attention reads every row up
    to the longest row's end and a mask hides what a row does not own.

    Worked example, two rows, lengths [5, 3], trees of 2 and 3 nodes padded to n = 3:
    row 0 writes at 5, 6, 7 (7 is a dummy node), row 1 at 3, 4, 5; attention reads
    keys [0, 8) of both rows; row 1's keys 6 and 7 are stale and masked out. After
    verification row 0 keeps path [0, 1] -> length 7, row 1 keeps [0, 2] -> entries
    3 and 5 stay, 5 moves to 4, length 5.

    Slots are allocated by the caller; ``move`` copies one row into another slot (the
    batch engine keeps its running rows in slots 0..B-1 so a forward reads a contiguous
    block). Capacity doubles when a write would overflow it, up to ``max_positions``.
    Does not know: models, trees or attention masks.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_positions: int,
                 dtype: torch.dtype, device: torch.device, slots: int, capacity: int | None = None):
        self.max_positions = max_positions
        cap = min(capacity or INITIAL_CAPACITY, max_positions)
        shape = (layers, slots, kv_heads, cap, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * slots

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @torch.inference_mode()
    def reserve(self, end: int) -> None:
        """Make every row able to hold ``end`` entries (doubling the buffers if needed)."""
        if end <= self.capacity:
            return
        if end > self.max_positions:
            raise CadenceError(f"context of {end} tokens exceeds the model's {self.max_positions} positions")
        cap = self.capacity
        while cap < end:
            cap *= 2
        cap = min(cap, self.max_positions)
        keep = max(self.lengths, default=0)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[:3] + (cap,) + old.shape[4:])
            new[:, :, :, :keep] = old[:, :, :, :keep]
            setattr(self, name, new)

    @torch.inference_mode()
    def compact(self, slot: int, past: int, keep: list[int]) -> None:
        """Row ``slot`` keeps entries [0, past) and past + keep[i] (see ``cadence.backbone.kv_cache``)."""
        m = len(keep)
        if past + m > self.lengths[slot]:
            raise CadenceError(f"compact past={past} keep={keep} beyond row length {self.lengths[slot]}")
        if list(keep) != list(range(m)):
            idx = torch.as_tensor(keep, dtype=torch.long, device=self.k.device) + past
            for buf in (self.k, self.v):
                row = buf[:, slot]  # (layers, kv_heads, capacity, head_dim), a view
                row[:, :, past:past + m] = row.index_select(2, idx)
        self.lengths[slot] = past + m

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """Copy row ``src`` (its filled entries) into slot ``dst``; ``src`` becomes empty."""
        n = self.lengths[src]
        if src != dst:
            self.k[:, dst, :, :n] = self.k[:, src, :, :n]
            self.v[:, dst, :, :n] = self.v[:, src, :, :n]
            self.lengths[dst] = n
        self.lengths[src] = 0 if src != dst else n

    def row(self, slot: int) -> "RowCache":
        return RowCache(self, slot)

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class RowCache:
    """One row of a ``BatchKVCache`` behind the engine's ``KVCache`` interface (length,
    compact, reset), so a single-request ``engine.Request`` can decode in a batch row.
    ``slot`` is updated by the owner when the row moves."""

    def __init__(self, batch: BatchKVCache, slot: int):
        self.batch, self.slot = batch, slot

    def length(self) -> int:
        return self.batch.lengths[self.slot]

    def compact(self, past: int, keep: list[int]) -> None:
        self.batch.compact(self.slot, past, keep)

    def reset(self) -> None:
        self.batch.lengths[self.slot] = 0
