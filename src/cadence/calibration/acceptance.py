"""Acceptance measured on held-out data: teacher-forced, the rank of the true token under
each head, with and without the context copy ranked first (and the context vocabulary).

``a[k][i]`` = P(rank = i | heads 1..k-1 ranked their true token within the top R), i.e. the
chance that a rank-i node is right when its parent path is. Knows the store's shards
(``cadence.training.data``), the heads' teacher features and the copy index. Does not know
latency, trees or where the tables are written (``command``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from cadence.draft.context_copy import CopyConfig, NgramIndex, merge_candidates
from cadence.errors import CadenceError
from cadence.heads.base import teacher_features
from cadence.training.data import iter_sequences, load_manifest, read_shard
from cadence.verify.sampling import entropy


def _val_sequences(data_dir: str | Path, split: str = "val"):
    manifest = load_manifest(Path(data_dir))
    if manifest is None:
        raise CadenceError(f"{data_dir} has no manifest.json")
    shards = [s for s in manifest["shards"] if s["split"] == split]
    if not shards:
        raise CadenceError(f"{data_dir} has no {split!r} shards yet" + (" (--split train measures on the "
                           "training split)" if split == "val" else ""))
    for shard in shards:
        yield from iter_sequences(read_shard(Path(data_dir) / shard["file"]))


class RankHistogram:
    """Counts of the true token's candidate rank per depth, among positions whose path
    so far was covered (every earlier depth ranked its true token within ``ranks``)."""

    def __init__(self, depth: int, ranks: int):
        self.ranks = ranks
        self.hist = torch.zeros(depth, ranks + 1)  # last column: outside the top `ranks`
        self.cond = torch.zeros(depth)

    def add(self, rank_by_depth: list[torch.Tensor], keep: torch.Tensor | None = None) -> None:
        """rank_by_depth[k]: (n_k,) ranks at depth k+1 for positions t0.. (n_k shrinks with k);
        keep: (n_0,) bool, the positions to count (all when None)."""
        ok = keep
        for k, rank in enumerate(rank_by_depth):
            n = len(rank)
            prev_ok = torch.ones(n, dtype=torch.bool) if ok is None else ok[:n]
            self.hist[k] += torch.bincount(rank[prev_ok].clamp(max=self.ranks),
                                           minlength=self.ranks + 1)[:self.ranks + 1].cpu()
            self.cond[k] += int(prev_ok.sum())
            ok = prev_ok & (rank < self.ranks)

    def table(self) -> list[list[float]]:
        table = (self.hist[:, :self.ranks] / self.cond.clamp(min=1)[:, None]).tolist()
        return [[round(v, 5) for v in row] for row in table]


@dataclass
class SequenceRanks:
    """Teacher-forced ranks of the true token on one sequence, from position t0 on."""

    plain: list[torch.Tensor]  # plain[k]: (n_k,) rank under head k+1 alone (``ranks`` = absent)
    copied: list[torch.Tensor] | None  # the same with the context copy ranked first, depths 1..copy depth
    entropy: torch.Tensor | None  # (n_0,) backbone entropy (nats) at each root, when asked for


@torch.inference_mode()
def _context_logits(heads, feats: torch.Tensor, ids: torch.Tensor, t0: int
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The context vocabulary's columns for teacher-forced positions t = t0.. (as
    ``HeadDrafter`` scores them): logits (n, U) over the sequence's tokens outside the draft
    vocabulary, -inf where the token has not appeared in x[0..t+1] yet, and their ids (U,).
    (The drafter keeps the 256 most recent; a calibration sequence rarely has more.)
    Example: x = [5, 900, 7, 900], 900 outside, t0 = 0: 900 is visible from t = 0 on."""
    inside = torch.zeros(heads.cfg.vocab_size, dtype=torch.bool, device=ids.device)
    inside[heads.draft_vocab.to(ids.device)] = True
    outside = ~inside[ids]
    if not bool(outside.any()):
        return None
    uniq, inv = torch.unique(ids[outside], return_inverse=True)
    pos = torch.nonzero(outside).flatten()
    first = torch.full((uniq.numel(),), len(ids), dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, inv, pos, "amin")  # first position of each outside token
    w = heads.lm_rows(uniq)
    logits = (feats.to(w.dtype) @ w.T).float()  # (n, U)
    t = torch.arange(t0, t0 + feats.shape[0], device=ids.device)
    return logits.masked_fill(first[None, :] > t[:, None] + 1, float("-inf")), uniq


def sequence_ranks(backbone, heads, ids: torch.Tensor, plen: int, ranks: int, copy: CopyConfig | None = None,
                   depth: int = 0, want_entropy: bool = False, context_vocab: bool = False) -> SequenceRanks | None:
    """Ranks for one distilled sequence (None when its reply is too short). Position t's
    root is x[t+1] (the backbone's token), head k drafts x[t+1+k]; t0 = plen - 1. With
    ``context_vocab`` the candidates include the context's tokens outside the draft vocabulary."""
    K = heads.K
    ids = ids.to(backbone.device)
    T = len(ids)
    if T - plen < K + 2:
        return None
    out, feats = teacher_features(heads, backbone, ids[None])
    hidden = out.hidden
    t0 = max(plen - 1, 0)  # first position whose next token is a reply token
    tops = []  # tops[k-1]: (T-1-k-t0, ranks) head k's candidate ids at t = t0..
    for k in range(1, K + 1):
        f = feats[k - 1][0][t0:]
        logits, vocab_ids = heads.draft_logits(f), heads.draft_vocab
        extra = (_context_logits(heads, f, ids, t0) if context_vocab and vocab_ids is not None
                 and not getattr(heads, "own_lm_head", False) else None)
        if extra is not None:
            logits, vocab_ids = torch.cat([logits, extra[0]], -1), torch.cat([vocab_ids, extra[1]])
        top = logits.topk(ranks, dim=-1).indices
        tops.append(vocab_ids[top] if vocab_ids is not None else top)
    plain = [_rank_in(top, ids[t0 + k + 1:], ranks) for k, top in enumerate(tops, 1)]
    copied = None
    if copy is not None:
        copied = _copy_ranks(ids.tolist(), t0, [t.tolist() for t in tops], copy, max(depth, K), ranks)
    ent = None
    if want_entropy:
        ent = torch.cat([entropy(backbone.logits(h)) for h in hidden[0, t0:T - 2].split(256)]).cpu()
    return SequenceRanks(plain, copied, ent)


def rank_tables(backbone, heads, data_dir: str | Path, tokens: int, ranks: int,
                copy: CopyConfig | None = None, copy_depth: int = 0, split: str = "val",
                context_vocab: bool = False) -> tuple[list[list[float]], list[list[float]] | None]:
    """a[k][i] from teacher-forced held-out sequences (see module docstring): for the heads
    alone, and (``copy`` set) with the context copy ranked first, down to ``copy_depth``."""
    K = heads.K
    depth = max(copy_depth, K)
    plain, copied = RankHistogram(K, ranks), RankHistogram(depth, ranks) if copy else None
    seen = 0
    bar = tqdm(total=tokens, desc="acceptance", unit="tok")
    for ids, plen in _val_sequences(data_dir, split):
        if seen >= tokens:
            break
        r = sequence_ranks(backbone, heads, ids, plen, ranks, copy, depth, context_vocab=context_vocab)
        if r is None:
            continue
        plain.add(r.plain)
        if copied is not None:
            copied.add(r.copied)
        seen += len(ids) - plen
        bar.update(len(ids) - plen)
    bar.close()
    return plain.table(), copied.table() if copied is not None else None


def rank_table(backbone, heads, data_dir: str | Path, tokens: int, ranks: int) -> list[list[float]]:
    """The heads-alone table of ``rank_tables``."""
    return rank_tables(backbone, heads, data_dir, tokens, ranks)[0]


def _rank_in(top: torch.Tensor, target: torch.Tensor, ranks: int) -> torch.Tensor:
    """Rank of each target among its row of candidates (``ranks`` if absent).
    top: (n', ranks) candidate ids; target: (n,) with n <= n'."""
    top = top[:len(target)]
    hit = top == target[:, None]
    return torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(target, ranks))


def _copy_ranks(x: list[int], t0: int, tops: list[list[list[int]]], copy: CopyConfig,
                depth: int, ranks: int) -> list[torch.Tensor]:
    """Ranks of the true token when the context copy leads each candidate list.

    At position t the committed tokens are x[0..t] and the root is x[t+1] (both indexed);
    depth k's path is x[t+2..t+k] (teacher forcing) and its target is x[t+k+1]. Example:
    x = [1, 2, 3, 1, 2, ?], t = 3: root x[4] = 2, the tail (1, 2) was followed by 3, so
    depth 1's copy is 3. Depths past K have the copy as their only candidate.
    """
    index = NgramIndex(copy)
    index.extend(x[:t0 + 1])
    T = len(x)
    out: list[list[int]] = [[] for _ in range(depth)]
    for t in range(t0, T - 2):
        index.extend(x[t + 1:t + 2])
        for k in range(1, depth + 1):
            if t + k + 1 >= T:
                break
            tail = x[max(0, t + k + 1 - copy.max_n):t + k + 1]
            heads_ranked = tops[k - 1][t - t0] if k <= len(tops) else []
            cand = merge_candidates(index.lookup(tail), heads_ranked, ranks)
            target = x[t + k + 1]
            out[k - 1].append(cand.index(target) if target in cand else ranks)
    return [torch.tensor(r, dtype=torch.long) for r in out if r]
