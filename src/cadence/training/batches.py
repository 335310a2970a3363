"""From distilled shards to packed training rows, and from rows to ``losses.Batch``.

Knows: reading the shards of one split (checked), the part of each sequence a head set
trains on, packing those parts into rows of at most ``max_len`` tokens, and how to fill a
row's backbone features, either from the hidden-state cache or by running the backbone.
Does not know: heads, losses, optimisation.

Each sequence contributes the segment ``[start, end)`` with ``start = max(0, plen - 1 - K)``
(the earliest position whose head-K target is a reply token) and ``end = min(len, start +
max_len)`` (longer sequences are truncated). Hidden states always come from the backbone
running over the whole prefix ``[0, end)``, so trimming the prompt changes nothing but the
cost. Rows are filled first-fit in a seeded shuffled order; a row never splits a segment.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from cadence.errors import CadenceError
from cadence.training.data import read_shard
from cadence.training.losses import STATS_CHUNK, Batch, entropy_boundaries, logits_stats


@dataclass
class SeqRef:
    """Where one sequence lives: shard (index into the corpus), token offset, sizes."""

    shard: int
    index: int  # sequence number inside the shard
    offset: int  # first token inside the shard's flat token array
    length: int
    plen: int
    topk_row: int  # first row of the shard's top-k arrays (reply position 0), -1 if none


class Corpus:
    """The sequences of a list of shards (one split), loaded and checked.

    Tokens are small (int32), so they are held in memory; hidden states are not.
    """

    def __init__(self, data_dir: str | Path, files: list[str], vocab_size: int | None = None):
        self.dir = Path(data_dir)
        self.files = list(files)
        self.tokens: list[torch.Tensor] = []
        self.topk: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.seqs: list[SeqRef] = []
        for si, name in enumerate(self.files):
            path = self.dir / name
            data = read_shard(path)
            tok, off, plens = data["tokens"], data["offsets"], data["prompt_lens"]
            n = plens.numel()
            if (tok.dim() != 1 or off.dim() != 1 or off.numel() != n + 1 or int(off[0]) != 0
                    or int(off[-1]) != tok.numel() or bool((off[1:] < off[:-1]).any())):
                raise CadenceError(f"shard {path} is corrupt: offsets do not match its tokens")
            lens = (off[1:] - off[:-1]).tolist()
            if any(p < 0 or p > L for p, L in zip(plens.tolist(), lens)):
                raise CadenceError(f"shard {path} is corrupt: a prompt length exceeds its sequence")
            if tok.numel() and (int(tok.min()) < 0 or (vocab_size is not None and int(tok.max()) >= vocab_size)):
                raise CadenceError(f"shard {path} holds token ids outside the backbone's vocabulary "
                                   f"({vocab_size}); was it made with another model?")
            topk = None
            if "topk_ids" in data:
                reply = sum(L - p for p, L in zip(plens.tolist(), lens))
                if data["topk_ids"].shape[0] != reply or data["topk_logits"].shape != data["topk_ids"].shape:
                    raise CadenceError(f"shard {path} is corrupt: top-k rows do not match its reply tokens")
                topk = (data["topk_ids"], data["topk_logits"])
            row = 0
            for i, (o, L, p) in enumerate(zip(off[:-1].tolist(), lens, plens.tolist())):
                self.seqs.append(SeqRef(si, i, o, L, p, row if topk is not None else -1))
                row += L - p
            self.tokens.append(tok)
            self.topk.append(topk)

    @property
    def has_topk(self) -> bool:
        return bool(self.topk) and all(t is not None for t in self.topk)

    def seq_tokens(self, ref: SeqRef, end: int | None = None) -> torch.Tensor:
        end = ref.length if end is None else end
        return self.tokens[ref.shard][ref.offset:ref.offset + end].long()

    def num_reply_tokens(self) -> int:
        return sum(s.length - s.plen for s in self.seqs)


@dataclass
class Segment:
    seq: int  # index into Corpus.seqs
    start: int  # first position (in the sequence) kept
    length: int


def segments(corpus: Corpus, num_heads: int, max_len: int, whole: bool = False) -> list[Segment]:
    """The trained part of every sequence that has a reply (see the module docstring).
    ``whole``: start at token 0 instead (heads that attend over the context, which then
    sees the whole prompt, as it does when decoding)."""
    out = []
    for i, s in enumerate(corpus.seqs):
        if s.length <= s.plen:
            continue
        start = 0 if whole else max(0, s.plen - 1 - num_heads)
        end = min(s.length, start + max_len)
        if end <= s.plen:
            continue
        out.append(Segment(i, start, end - start))
    return out


def pack(segs: list[Segment], max_len: int, seed: int | None = 0) -> list[list[Segment]]:
    """First-fit packing into rows of at most ``max_len`` tokens; ``seed=None`` keeps the order."""
    order = list(segs)
    if seed is not None:
        random.Random(seed).shuffle(order)
    rows: list[list[Segment]] = []
    free: list[int] = []
    for sg in order:
        for r, room in enumerate(free):
            if room >= sg.length:
                rows[r].append(sg)
                free[r] -= sg.length
                break
        else:
            rows.append([sg])
            free.append(max_len - sg.length)
    return rows


class RowDataset(Dataset):
    """Packed rows as dicts of tensors; features from the hidden cache when one is given.

    Keys: ids, seg, reply (T,); with a cache: hidden (T, d), argmax (T,), boundary (T,),
    and with ``taps`` taps (T, n_taps, d); with ``topk``: topk_ids, topk_logits (T, k),
    topk_ok (T,); without a cache: ``prefixes``, the token prefixes the backbone must run over.
    """

    def __init__(self, corpus: Corpus, rows: list[list[Segment]], cache=None, need_argmax: bool = False,
                 boundary: tuple[int, float] | None = None, topk: bool = False, taps: tuple[int, ...] = ()):
        self.corpus, self.rows, self.cache = corpus, rows, cache
        self.need_argmax, self.boundary, self.topk = need_argmax, boundary, topk
        self.taps = tuple(taps)
        if cache is not None and self.taps:
            self.tap_index = cache.tap_index(self.taps)  # columns of the cache's taps array, in order

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        T = sum(sg.length for sg in row)
        ids = torch.zeros(T, dtype=torch.long)
        seg = torch.full((T,), -1, dtype=torch.long)
        reply = torch.zeros(T, dtype=torch.bool)
        item: dict = {"ids": ids, "seg": seg, "reply": reply}
        if self.cache is not None:
            item["hidden"] = torch.zeros(T, self.cache.hidden_size, dtype=self.cache.dtype)
            if self.taps:
                item["taps"] = torch.zeros(T, len(self.taps), self.cache.hidden_size, dtype=self.cache.dtype)
            if self.need_argmax:
                item["argmax"] = torch.zeros(T, dtype=torch.long)
            if self.boundary is not None:
                item["boundary"] = torch.zeros(T, dtype=torch.bool)
        else:
            item["prefixes"] = []
        if self.topk:
            kk = self.corpus.topk[0][0].shape[1]
            item["topk_ids"] = torch.zeros(T, kk, dtype=torch.int32)
            item["topk_logits"] = torch.zeros(T, kk, dtype=torch.float16)
            item["topk_ok"] = torch.zeros(T, dtype=torch.bool)
        p = 0
        for j, sg in enumerate(row):
            ref = self.corpus.seqs[sg.seq]
            a, b = sg.start, sg.start + sg.length
            ids[p:p + sg.length] = self.corpus.seq_tokens(ref, b)[a:]
            seg[p:p + sg.length] = j
            reply[p:p + sg.length] = torch.arange(a, b) >= ref.plen
            if self.cache is not None:
                name = self.corpus.files[ref.shard]
                item["hidden"][p:p + sg.length] = self.cache.read(name, "hidden", ref.offset + a, ref.offset + b)
                if self.taps:
                    got = self.cache.read(name, "taps", ref.offset + a, ref.offset + b)  # (n, cached taps, d)
                    item["taps"][p:p + sg.length] = got[:, self.tap_index[name]]
                if self.need_argmax:
                    item["argmax"][p:p + sg.length] = self.cache.read(name, "argmax", ref.offset + a,
                                                                      ref.offset + b).long()
                if self.boundary is not None:
                    ent = self.cache.read(name, "entropy", ref.offset, ref.offset + ref.length)
                    item["boundary"][p:p + sg.length] = entropy_boundaries(ent, *self.boundary)[a:b]
            else:
                item["prefixes"].append((self.corpus.seq_tokens(ref, b), a, p))
            if self.topk:
                # stored row r of a sequence is the distribution at position plen - 1 + r
                tids, tlog = self.corpus.topk[ref.shard]
                lo = max(a, ref.plen - 1)
                hi = min(b, ref.length - 1)
                if hi > lo:
                    r0 = ref.topk_row + lo - (ref.plen - 1)
                    q = p + lo - a
                    item["topk_ids"][q:q + hi - lo] = tids[r0:r0 + hi - lo]
                    item["topk_logits"][q:q + hi - lo] = tlog[r0:r0 + hi - lo]
                    item["topk_ok"][q:q + hi - lo] = True
            p += sg.length
        return item


def collate(items: list[dict]) -> dict:
    """Stack rows, padding to the longest (seg -1 on padding); prefixes keep their row index."""
    T = max(it["ids"].shape[0] for it in items)
    out: dict = {}
    for key, val in items[0].items():
        if key == "prefixes":
            out[key] = [(toks, a, b, p) for b, it in enumerate(items) for toks, a, p in it[key]]
            continue
        fill = -1 if key == "seg" else 0
        stacked = torch.full((len(items), T) + tuple(val.shape[1:]), fill, dtype=val.dtype)
        for b, it in enumerate(items):
            stacked[b, :it[key].shape[0]] = it[key]
        out[key] = stacked
    return out


@torch.inference_mode()
def sequence_features(backbone, seqs: list[torch.Tensor], want_entropy: bool, want_argmax: bool,
                      chunk: int = STATS_CHUNK, taps: tuple[int, ...] = ()) -> list[tuple]:
    """Run the backbone over whole sequences (one right-padded batch): per sequence
    (hidden (L, d), entropy (L,) or None, argmax (L,) or None, taps (L, n_taps, d) or None),
    on the backbone's device."""
    dev = backbone.device
    width = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :s.numel()] = s
        mask[i, :s.numel()] = 1
    fwd = backbone(ids.to(dev), attention_mask=mask.to(dev), need_logits=False, **({"taps": taps} if taps else {}))
    out = []
    for i, s in enumerate(seqs):
        h = fwd.hidden[i, :s.numel()]
        ent, arg = (logits_stats(backbone.logits, h, chunk, want_entropy, want_argmax)
                    if (want_entropy or want_argmax) else (None, None))
        out.append((h, ent, arg, fwd.taps[i, :s.numel()] if taps else None))
    return out


def to_batch(raw: dict, device, backbone=None, need_argmax: bool = False,
             boundary: tuple[int, float] | None = None, max_seqs: int = 16, taps: tuple[int, ...] = ()) -> Batch:
    """A collated row dict -> ``Batch`` on ``device``; without a cache, runs the backbone
    (tapping ``taps`` when the heads read them)."""
    mv = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in raw.items()}
    batch = Batch(ids=mv["ids"], seg=mv["seg"], reply=mv["reply"], hidden=mv.get("hidden"),
                  argmax=mv.get("argmax"), boundary=mv.get("boundary"), topk_ids=mv.get("topk_ids"),
                  topk_logits=mv.get("topk_logits"), topk_ok=mv.get("topk_ok"), taps=mv.get("taps"))
    if "prefixes" in raw:
        if backbone is None:
            raise CadenceError("no hidden cache and no backbone to compute hidden states")
        B, T = batch.ids.shape
        batch.hidden = torch.zeros(B, T, backbone.hidden_size, dtype=backbone.dtype, device=device)
        if need_argmax:
            batch.argmax = torch.zeros(B, T, dtype=torch.long, device=device)
        if boundary is not None:
            batch.boundary = torch.zeros(B, T, dtype=torch.bool, device=device)
        if taps:
            batch.taps = torch.zeros(B, T, len(taps), backbone.hidden_size, dtype=backbone.dtype, device=device)
        pre = sorted(raw["prefixes"], key=lambda x: x[0].numel())  # similar lengths share a forward
        for i in range(0, len(pre), max_seqs):
            group = pre[i:i + max_seqs]
            feats = sequence_features(backbone, [g[0] for g in group], boundary is not None, need_argmax,
                                      taps=taps)
            for (toks, a, b, p), (h, ent, arg, tp) in zip(group, feats):
                n = toks.numel() - a
                batch.hidden[b, p:p + n] = h[a:]
                if taps:
                    batch.taps[b, p:p + n] = tp[a:]
                if need_argmax:
                    batch.argmax[b, p:p + n] = arg[a:]
                if boundary is not None:
                    batch.boundary[b, p:p + n] = entropy_boundaries(ent, *boundary)[a:]
    return batch
