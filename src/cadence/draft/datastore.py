"""Datastore copy: propose the token that most often followed the same n-gram in the model's
own earlier replies (REST, arXiv 2311.08252; SuffixDecoding, arXiv 2411.04975).

The context copy (``context_copy``) looks back over the request itself; a datastore looks
over many replies the same model wrote before: the self-distilled store the heads train on
(``data/selfdistill/<model>``; ``cadence distill`` writes it). Greedy replies of one model
share their phrasing ("Here is a Python function that", "I hope this helps"), so where the
request has no earlier occurrence of its last tokens the store often has one. It is one
more source of copies: ``NgramIndex.lookup`` asks the request first and the datastore
second, so every tree that places context copies (static presets, dynamic trees, the
``ngram`` method) places datastore copies the same way, verified the same way (greedy
match at T = 0; a point-mass proposal at T > 0). Output never changes: verification is exact.

An entry maps an n-gram (``min_n <= n <= max_n``) to its most frequent next token over the
store's replies, kept when that token followed it at least ``min_count`` times and in at
least ``min_share`` of its occurrences. Lookup tries the longest n first.

Worked example, replies [1 2 3 4] and [9 2 3 4] and [2 3 5], n = 2, min_count 2, min_share
0.5: (2, 3) was followed by 4, 4, 5 -> 4 (2 of 3); (3, 4) ends both replies (no next
token); (1, 2) -> 3 once (below min_count): absent. ``lookup([7, 2, 3])`` -> 4.

Keys are the top 44 bits of a 64-bit polynomial hash of the n tokens (one sorted array per n,
searched by bisection), so a store of millions of tokens costs ~12 bytes per kept n-gram. Two
n-grams with one key (about one pair among five million n-grams) would share an entry; that
can only cost a draft, never change the output.

Knows: the store's layout on disk as ``cadence.training.store`` writes it (``manifest.json``
listing ``.npz`` shards of ``tokens`` / ``lengths`` / ``prompt_lens``; read-only here, train
split only). Does not know heads, trees, models or verification.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from cadence.errors import CadenceError
from cadence.system import cache
from cadence.system.atomic import atomic_write

_P = 0x9E3779B97F4A7C15  # odd 64-bit multiplier of the n-gram hash
_MASK = (1 << 64) - 1
TOKEN_BITS = 20  # an entry is one sorted uint64: the key's top 44 bits, then the next token's 20


@dataclass(frozen=True)
class DatastoreConfig:
    """Which n-grams of the store's replies become entries."""

    max_n: int = 4  # longest n-gram matched (tried first)
    min_n: int = 2  # shortest n-gram matched
    min_count: int = 2  # times the next token must have followed the n-gram
    min_share: float = 0.3  # share of the n-gram's occurrences that next token must have

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise CadenceError(f"datastore: need 1 <= min_n <= max_n, got {self.min_n}..{self.max_n}")
        if self.min_count < 1 or not 0 < self.min_share <= 1:
            raise CadenceError(f"datastore: need min_count >= 1 and 0 < min_share <= 1, got {self}")


def _mix(h: int) -> int:
    """splitmix64's finalizer: every output bit depends on every input bit (the polynomial alone
    leaves the last token in the low bits only)."""
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
    return h ^ (h >> 31)


def hash_tokens(tokens: Sequence[int]) -> int:
    """The 64-bit key of an n-gram: h = h * P + (t + 1) over its tokens, modulo 2^64, then mixed."""
    h = 0
    for t in tokens:
        h = (h * _P + int(t) + 1) & _MASK
    return _mix(h)


def _hash_windows(seq: np.ndarray, n: int) -> np.ndarray:
    """(L,) token ids -> (L - n + 1,) uint64 keys of every window of n tokens
    (``hash_tokens`` of each, with numpy's wrapping uint64 arithmetic)."""
    m = seq.size - n + 1
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n):
            h = h * np.uint64(_P) + seq[i:i + m].astype(np.uint64) + np.uint64(1)
        h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def _most_frequent_next(keys: np.ndarray, nxt: np.ndarray, cfg: DatastoreConfig) -> tuple[np.ndarray, np.ndarray]:
    """Occurrences (64-bit key, next token) -> (sorted unique 44-bit keys ``key >> TOKEN_BITS``, their
    most frequent next token), filtered by ``min_count`` / ``min_share``. Ties go to the smaller
    token id. Example (keys shown after the shift): keys [7, 7, 7, 5], nxt [4, 4, 6, 1],
    min_count 2, min_share 0.5 -> ([7], [4])."""
    if nxt.size and int(nxt.max()) >= 1 << TOKEN_BITS:
        raise CadenceError(f"datastore: token ids must be below 2^{TOKEN_BITS}, got {int(nxt.max())}")
    both = np.sort((keys >> np.uint64(TOKEN_BITS)) << np.uint64(TOKEN_BITS) | nxt.astype(np.uint64))
    if both.size == 0:
        return both, both.astype(np.int32)
    starts = np.concatenate([[0], np.flatnonzero(both[1:] != both[:-1]) + 1])  # runs of one (key, token)
    counts = np.diff(np.concatenate([starts, [both.size]]))
    rk, rx = both[starts] >> np.uint64(TOKEN_BITS), both[starts] & np.uint64((1 << TOKEN_BITS) - 1)
    group = np.concatenate([[0], np.flatnonzero(rk[1:] != rk[:-1]) + 1])  # runs of one key
    sizes = np.diff(np.concatenate([group, [rk.size]]))
    totals, top = np.add.reduceat(counts, group), np.maximum.reduceat(counts, group)
    is_top = np.flatnonzero(counts == np.repeat(top, sizes))  # runs holding their key's top count
    owner = np.repeat(np.arange(group.size), sizes)[is_top]
    first = is_top[np.concatenate([[True], owner[1:] != owner[:-1]])]  # the smallest token among ties
    keep = (top >= cfg.min_count) & (top >= cfg.min_share * totals)
    return rk[first][keep], rx[first][keep].astype(np.int32)


class Datastore:
    """n-gram -> most frequent next token over a set of replies (module docstring). ``build``
    makes one from replies, ``load_datastore`` from a store directory (cached on disk)."""

    def __init__(self, tables: dict[int, tuple[np.ndarray, np.ndarray]], cfg: DatastoreConfig, tokens: int,
                 name: str = ""):
        self.cfg = cfg
        self._tables = tables  # n -> (sorted keys (E,) uint64, next token (E,) int32)
        self.tokens = tokens  # reply tokens it was built from
        self.name = name  # where the replies came from (shown by ``describe``)

    @classmethod
    def build(cls, replies: Sequence[Sequence[int]], cfg: DatastoreConfig | None = None,
              name: str = "") -> "Datastore":
        """Index ``replies`` (token id sequences): about 5 s for the 7.5 M reply tokens of the
        default model's store on one core."""
        cfg = cfg or DatastoreConfig()
        seqs = [np.asarray(r, dtype=np.int64) for r in replies if len(r) > 0]
        flat = np.concatenate(seqs) if seqs else np.zeros(0, np.int64)
        # reply of each position, to keep n-grams and their next token inside one reply
        reply = np.repeat(np.arange(len(seqs)), [s.size for s in seqs])
        tables = {}
        for n in range(cfg.min_n, cfg.max_n + 1):
            if flat.size > n:
                keys = _hash_windows(flat[:-1], n)  # window i = flat[i:i+n], followed by flat[i+n]
                inside = reply[:flat.size - n] == reply[n:]
                tables[n] = _most_frequent_next(keys[inside], flat[n:][inside], cfg)
            else:
                tables[n] = (np.zeros(0, np.uint64), np.zeros(0, np.int32))
        return cls(tables, cfg, int(flat.size), name)

    def save(self, path: Path) -> None:
        """Write the tables as one ``.npz`` (atomically)."""
        arrays = {"tokens": np.array(self.tokens)}
        for n, (keys, nxt) in self._tables.items():
            arrays[f"keys{n}"], arrays[f"next{n}"] = keys, nxt

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as fh:
                np.savez(fh, **arrays)
        atomic_write(path, write)

    @classmethod
    def read(cls, path: Path, cfg: DatastoreConfig, name: str = "") -> "Datastore":
        """The tables ``save`` wrote for ``cfg``."""
        with np.load(path) as z:
            tables = {n: (z[f"keys{n}"], z[f"next{n}"]) for n in range(cfg.min_n, cfg.max_n + 1)}
            return cls(tables, cfg, int(z["tokens"]), name)

    def __len__(self) -> int:
        """Entries over every n."""
        return sum(k.size for k, _ in self._tables.values())

    def lookup(self, tail: Sequence[int]) -> int | None:
        """The next token after ``tail`` (the last tokens of the current path), longest n first;
        None when no n-gram of the tail is an entry."""
        for n in range(self.cfg.max_n, self.cfg.min_n - 1, -1):
            if len(tail) < n:
                continue
            keys, nxt = self._tables[n]
            key = np.uint64(hash_tokens(tail[-n:]) >> TOKEN_BITS)
            i = int(np.searchsorted(keys, key))
            if i < keys.size and keys[i] == key:
                return int(nxt[i])
        return None

    def describe(self) -> str:
        """One line for logs and ``--json``: source, reply tokens, entries."""
        return f"datastore {self.name or '(in memory)'}: {self.tokens:,} reply tokens, {len(self):,} n-grams"


def store_replies(directory: str | Path) -> list[np.ndarray]:
    """The reply tokens (prompt excluded) of every training-split sequence of a self-distilled
    store (``manifest.json`` + shards, as ``cadence.training.store`` writes them)."""
    root = Path(directory)
    try:
        manifest = json.loads((root / "manifest.json").read_text())
        shards = [s for s in manifest["shards"] if s.get("split", "train") == "train"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CadenceError(f"datastore: {root} is not a readable self-distilled store ({e})") from e
    out = []
    for s in shards:
        try:
            with np.load(root / s["file"]) as z:
                toks, lengths, prompts = z["tokens"], z["lengths"], z["prompt_lens"]
        except (OSError, ValueError, KeyError) as e:
            raise CadenceError(f"datastore: cannot read shard {root / s['file']} ({e})") from e
        ends = np.cumsum(lengths.astype(np.int64))
        for end, length, plen in zip(ends, lengths, prompts):
            out.append(toks[end - int(length) + int(plen): end])
    return out


CACHE_VERSION = 1  # bump when the tables' layout or hash changes


@functools.lru_cache(maxsize=4)
def load_datastore(directory: str, cfg: DatastoreConfig = DatastoreConfig()) -> Datastore:
    """The datastore of a store directory: built once per process (engines of one bench share it)
    and kept in the cache (``datastore/``, keyed by the manifest's bytes and ``cfg``), so a later
    process reads it in well under a second instead of building it again."""
    root = Path(directory)
    try:
        manifest = (root / "manifest.json").read_bytes()
    except OSError as e:
        raise CadenceError(f"datastore: {root} is not a readable self-distilled store ({e})") from e
    digest = hashlib.sha256(manifest + repr((CACHE_VERSION, cfg)).encode()).hexdigest()[:16]
    cached = cache.datastore_dir() / f"{root.resolve().name}-{digest}.npz"
    if cached.is_file():
        try:
            return Datastore.read(cached, cfg, name=str(directory))
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry is built again
    ds = Datastore.build(store_replies(root), cfg, name=str(directory))
    try:
        ds.save(cached)
    except OSError:  # a read-only cache still decodes; it just builds again next time
        pass
    return ds
