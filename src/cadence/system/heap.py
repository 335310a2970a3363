"""Python's cyclic garbage collector while a loaded model decodes (``settled``).

Knows: CPython's collector, when it collects its oldest generation, visits every tracked
container object alive. A loaded model (torch modules, transformers, the tokenizer, the GGUF
reader) leaves about 400,000 of them there, and decoding makes enough short-lived tuples,
lists and dicts that such full passes keep coming. ``gc.freeze()`` (CPython 3.7+) moves every
object alive into a permanent generation that the collector skips; objects made later are
collected as before (vLLM freezes its heap after start-up too). Measured with
``benchmarks/e2e/gc_freeze.py`` (AMD EPYC Zen 4, 2 cores, GGUF default path, 28 prompts, both
modes from a fresh collection, 2026-12-07): plain decoding 1.013x, hydra 1.031x, eagle-taps
1.016x, tokens unchanged: a small gain.
Reference counting still frees the frozen objects; only cycles among them wait for the thaw.

Does not know the caller's objects: the command-line entry points use it around their decode
loops, after loading, and thaw on the way out (tests call them in one long process).
``CADENCE_GC_FREEZE=0`` turns it off.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from typing import Iterator


def freeze_enabled() -> bool:
    """False when ``CADENCE_GC_FREEZE`` is 0 / false / off / no."""
    return os.environ.get("CADENCE_GC_FREEZE", "1").strip().lower() not in ("0", "false", "off", "no")


@contextmanager
def settled() -> Iterator[int]:
    """Collect once, freeze what survives (the loaded model), run the block, thaw. Yields the
    number of objects frozen (0 when turned off). Example::

        backbone = load_backbone("smollm2")
        with settled():
            engine.generate(ids, cfg)
    """
    if not freeze_enabled():
        yield 0
        return
    gc.collect()
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()
