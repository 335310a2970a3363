"""The fast backbone's batched forward: B requests' trees in one pass over a ragged cache.

Knows: ``BatchKVCache`` rows (each request in its own slot at its own length), writing each
row's new keys at its own offset, and the row-consistent attention modes (listed in C++,
per-path in Python) that give each row the bits its request alone would get.
Does not know: which trees rows hold or how they are packed (``cadence.batch.layout``), or
verification (``cadence.batch.engine``). Mixed into ``FastBackbone``; reads its spec, rope,
ops and layer loop.
"""

from __future__ import annotations

import math

import torch

from cadence.backbone.base import ForwardOut, check_taps
from cadence.errors import CadenceError
from cadence.fast import consistent
from cadence.fast.cache import BatchKVCache, stored


class RowsForward:
    """``new_batch_cache`` and ``forward_rows`` for ``FastBackbone``."""

    def new_batch_cache(self, slots: int, capacity: int | None = None) -> BatchKVCache:
        """A ragged cache of ``slots`` rows for ``forward_rows`` (the batch engine)."""
        s = self.spec
        return BatchKVCache(s.layers, s.kv_heads, s.head_dim, self.max_positions, self._cache_dtype(),
                            self.device, slots=slots, capacity=capacity)

    @torch.inference_mode()
    def forward_rows(self, input_ids: torch.Tensor, cache: BatchKVCache, first: int, starts: list[int],
                     position_ids: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                     need_logits: bool = True, taps: tuple[int, ...] = ()) -> ForwardOut:
        """One forward over rows ``first .. first + B - 1`` of ``cache``, each at its own offset.

        input_ids: (B, n) new tokens of each row (a row with fewer nodes is padded).
        starts: B committed lengths; row b's entries are written at [starts[b], starts[b] + n).
        position_ids: (B, n) absolute positions (default starts[b] + j).
        attn_mask: (B, 1, n, L) bool, L = max(starts) + n: True where query j of row b may
        attend key l of its row. None: causal over the new tokens, only when every start is
        0 (a prefill). Each row's length becomes starts[b] + n; the caller compacts it.
        taps: as ``Backbone.forward``: ``ForwardOut.taps`` is (B, n, len(taps), d).
        Example: starts [5, 3], n = 3 -> row 0 writes keys 5..7, row 1 keys 3..5, both
        attend keys [0, 8) through the mask (see ``BatchKVCache``).
        """
        b, n = input_ids.shape
        if taps:
            check_taps(taps, self.spec.layers)
        if len(starts) != b or first < 0 or first + b > cache.slots:
            raise CadenceError(f"rows {first}..{first + b - 1} with {len(starts)} starts do not fit "
                               f"a cache of {cache.slots} slots")
        end = max(starts) + n
        cache.reserve(end)
        dev = self.device
        cols = torch.tensor(starts, device=dev)[:, None] + torch.arange(n, device=dev)  # (B, n)
        rows = torch.arange(first, first + b, device=dev)[:, None].expand(b, n)
        if position_ids is None:
            position_ids, top = cols, end - 1
        else:
            position_ids = position_ids.to(dev)
            top = int(position_ids.max())
        cos, sin = self.rope.lookup(position_ids, top)
        if attn_mask is None:
            if any(starts):
                raise CadenceError("forward_rows without a mask is for prefills (every start 0)")
            mask, causal = None, n > 1
        else:
            mask, causal = attn_mask.to(device=dev, dtype=torch.bool), False
        block = slice(first, first + b)

        def store(i, k, v):  # k, v: (B, kv_heads, n, head_dim) -> row b at [starts[b], starts[b] + n)
            k, v = stored(k, self.kv_dtype, self._ops), stored(v, self.kv_dtype, self._ops)  # as the cache holds them
            if b == 1:
                cache.k[i, first, :, starts[0]:starts[0] + n] = k[0]
                cache.v[i, first, :, starts[0]:starts[0] + n] = v[0]
            else:
                cache.k[i][rows, :, cols] = k.transpose(1, 2)
                cache.v[i][rows, :, cols] = v.transpose(1, 2)
            return cache.k[i, block, :, :end], cache.v[i, block, :, :end]

        if self.consistent and mask is not None and self.listed:
            attention = self._rows_listed(store, starts, mask)
        elif self.consistent and mask is not None:
            attention = self._rows_consistent(cache, first, starts, position_ids, mask)
        else:
            attention = self._attention(store, mask, causal)
        self._block_rows(self.consistent and mask is not None)
        with torch.autocast(dev.type, enabled=False):
            tap_out = self._tap_buffer(input_ids, tuple(taps))
            hidden = self._layers_forward(input_ids, cos, sin, attention, tuple(taps), tap_out)
            for j, start in enumerate(starts):
                cache.lengths[first + j] = start + n
            return ForwardOut(hidden=hidden, logits=self.logits(hidden) if need_logits else None, taps=tap_out)

    def _rows_listed(self, store, starts: list[int], mask: torch.Tensor):
        """``attend`` for a row-consistent batched forward through ``listed_attention``: row r
        attends its committed entries [0, starts[r]) then the new slots its mask allows, in
        slot order (the keys a one-token forward of that request alone would see). mask:
        (B, 1, n, L) as ``forward_rows`` takes it; every row must allow its committed entries."""
        n = mask.shape[2]
        trees = torch.stack([mask[r, 0, :, s:s + n] for r, s in enumerate(starts)]).cpu()
        for r, s in enumerate(starts):
            if s and not bool(mask[r, 0, :, :s].all()):
                raise CadenceError(f"forward_rows: row {r}'s mask hides some of its committed entries")
        prefix, extra, count = consistent.key_lists(trees, starts)
        scale = 1.0 / math.sqrt(self.spec.head_dim)
        ops = self._ops

        def attend(i, q, k, v):
            keys, values = store(i, k, v)  # (B, kv_heads, L, head_dim) views of the cache rows
            return ops.listed_attention(q, keys, values, prefix, extra, count, scale)
        return attend

    def _rows_consistent(self, cache: BatchKVCache, first: int, starts: list[int], position_ids: torch.Tensor,
                         mask: torch.Tensor):
        """``attend`` for a row-consistent batched forward: each row attends alone, its paths
        in plain decoding's slots (``consistent.PathAttention`` on its own cache row), so a
        node gets the bits a one-token forward of that request alone gives it; each row's
        ``PathAttention`` also writes that row's new entries at [start, start + n). mask: (B, 1,
        n, L) as ``forward_rows`` takes it; padding nodes (they see the committed entries and
        themselves, not the root) are not attended (output 0, never read)."""
        n = mask.shape[2]
        top = int(position_ids.max())
        cache.reserve(consistent.keys_for(top, cache.max_positions))  # before views of the buffers
        rows = []
        for r, start in enumerate(starts):
            tree = mask[r, 0, :, start:start + n]
            ancestors = [row.nonzero().flatten().tolist() for row in tree]
            ancestors = [a for a in ancestors if a[0] == 0]  # real nodes; padding ones (see ``layout``) come last
            s = first + r
            rows.append(consistent.PathAttention(cache.k[:, s:s + 1], cache.v[:, s:s + 1], start, ancestors,
                                                 cache.max_positions))
        gqa = self.spec.heads != self.spec.kv_heads

        def attend(i, q, k, v):
            out = q.new_empty(q.shape)
            for r, paths in enumerate(rows):
                out[r:r + 1] = paths(i, q[r:r + 1], k[r:r + 1], v[r:r + 1], gqa)
            return out
        return attend
