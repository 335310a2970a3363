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


def vocab_map(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token id -> column of the draft vocabulary ``ids`` (-1 outside it).
    Example: ids [7, 2], vocab 8 -> [-1, -1, 1, -1, -1, -1, -1, 0]."""
    out = torch.full((vocab_size,), -1, dtype=torch.long)
    out[ids.cpu()] = torch.arange(len(ids))
    return out


def coverage(ids: torch.Tensor, data_dir: str | Path, train_files: list[str], vocab_size: int) -> float:
    """Share of the training reply tokens that the draft vocabulary ``ids`` holds."""
    counts = reply_token_counts(data_dir, vocab_size, files=train_files)
    return float(counts[ids.cpu()].sum() / max(counts.sum(), 1))


def choose_draft_vocab(size: int, heads, backbone, data_dir: str | Path, train_files: list[str]) -> torch.Tensor:
    """Give ``heads`` the ``size`` most frequent reply tokens of the training shards (EOS always
    in) and record their coverage; return the id -> column map."""
    counts = reply_token_counts(data_dir, backbone.vocab_size, files=train_files)
    ids, cov = frequent_tokens(counts, size, always=backbone.eos_token_ids)
    heads.set_draft_vocab(ids)
    heads.draft_vocab_coverage = cov
    return vocab_map(ids, backbone.vocab_size)
