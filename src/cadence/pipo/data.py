"""Sequences for PIPO training and evaluation, read from a self-distillation store.

Knows: reading a store's train or held-out (val) shards through ``cadence.training.data``
(whose prompts already passed the evaluation filter: no benchmark prompt is ever in a store) and
keeping (prompt, teacher reply) pairs of bounded prompt length. Does not know models.
"""

from __future__ import annotations

from pathlib import Path

from cadence.errors import CadenceError
from cadence.training.data import iter_sequences, load_manifest, read_shard


def load_pairs(data: str | Path, split: str, max_prompt: int, min_reply: int = 4,
               limit: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, teacher reply ids) of every sequence in ``split`` ("train" | "val") shards whose
    prompt has at most ``max_prompt`` tokens and whose reply at least ``min_reply``."""
    root = Path(data)
    manifest = load_manifest(root)
    if not manifest or not manifest.get("shards"):
        raise CadenceError(f"{root} is not a self-distillation store with shards (see `cadence distill`)")
    out: list[tuple[list[int], list[int]]] = []
    for entry in manifest["shards"]:
        if entry.get("split", "train") != split:
            continue
        for ids, plen in iter_sequences(read_shard(root / entry["file"])):
            ids = ids.tolist()
            if plen <= max_prompt and len(ids) - plen >= min_reply:
                out.append((ids[:plen], ids[plen:]))
            if limit is not None and len(out) >= limit:
                return out
    if not out:
        raise CadenceError(f"{root} holds no {split} sequences with a prompt of at most {max_prompt} tokens")
    return out
