"""Keep the C heap bounded while training (glibc only; a no-op elsewhere).

Why (measured, ``/tmp/heavy`` runs of ``cadence train --kind mtp`` on the SmolLM2 hidden
cache, RSS sampled every 0.5 s): anonymous RSS grew by about 17 MiB per optimizer step and
never came back (1.1 -> 2.1 GiB in 60 steps, 16 GiB over the 1000-step run in the model
card), while the tensors alive per step stay far below 1 GiB. glibc raises its mmap
threshold each time a large block is freed (up to 32 MiB), so the next large tensors come
from the heap instead of ``mmap``; packed rows change length every step, the freed heap
blocks rarely fit the next shapes, and the heap only grows (fragmentation, not a leak).
Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the dynamic
adjustment off) makes every large tensor an ``mmap`` returned to the system on free: in
the same run RSS stayed flat at 0.8-1.1 GiB at the same speed.
``MALLOC_MMAP_THRESHOLD_=1048576`` in the environment does the same for any process.

Building the hidden cache is the opposite case: the same few shapes every batch (32-row
logits chunks of 6 MiB, the forward's activations), so a 1 MiB threshold only turns each of
them into a fresh ``mmap`` and its page faults: 903 tok/s against 1,700-1,800 with glibc's
own threshold (AMX Xeon, 2026-12-01, c3906c5; system time 84 of 209 CPU-seconds). The trainer builds
the cache under ``heap_threshold(BUILD_THRESHOLD)`` and bounds the heap again after.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from contextlib import contextmanager

M_MMAP_THRESHOLD = -3  # glibc malloc.h


def bound_heap(threshold: int = 1 << 20) -> bool:
    """Serve allocations of ``threshold`` bytes and more by mmap from now on; True if set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False


BUILD_THRESHOLD = 256 << 20  # the cache build's blocks come from the heap and are reused


@contextmanager
def heap_threshold(threshold: int = BUILD_THRESHOLD, after: int = 1 << 20):
    """Within the block, allocations below ``threshold`` come from the heap; ``after`` is
    the threshold set again on leaving (the trainer's bound)."""
    changed = bound_heap(threshold)
    try:
        yield changed
    finally:
        if changed:
            bound_heap(after)
