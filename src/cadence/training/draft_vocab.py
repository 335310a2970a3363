"""Choose the draft vocabulary: the most frequent reply tokens of a distillation set.

Heads draft only among these ids (``DraftHeads.set_draft_vocab``); verification keeps
the full vocabulary, so outputs do not change, only which drafts are possible.
``coverage`` reports the share of reply tokens inside the subset, i.e. an upper bound
on how often the right token can be drafted at all.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cadence.errors import CadenceError
from cadence.training.data import iter_sequences, load_manifest, read_shard


def reply_token_counts(data_dir: str | Path, vocab_size: int, split: str = "train",
                       files: list[str] | None = None) -> torch.Tensor:
    """(vocab_size,) counts of reply tokens over ``files`` (default: the shards of ``split``)."""
    data_dir = Path(data_dir)
    if files is None:
        manifest = load_manifest(data_dir)
        if manifest is None:
            raise CadenceError(f"{data_dir} has no manifest.json")
        files = [s["file"] for s in manifest["shards"] if s["split"] == split]
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for name in files:
        for ids, plen in iter_sequences(read_shard(data_dir / name)):
            counts += torch.bincount(ids[plen:], minlength=vocab_size)[:vocab_size]
    return counts


def frequent_tokens(counts: torch.Tensor, size: int, always: set[int] = frozenset()) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent ids (plus ``always``, e.g. EOS), sorted; and their coverage."""
    order = counts.argsort(descending=True)
    chosen = set(always)
    for i in order.tolist():
        if len(chosen) >= size:
            break
        chosen.add(i)
    ids = torch.tensor(sorted(chosen), dtype=torch.long)
    total = int(counts.sum())
    coverage = float(counts[ids].sum()) / total if total else 0.0
    return ids, coverage
