"""Online copies: n-grams of the replies this engine has finished, learnt while it serves.

A store on disk (``datastore``) holds the replies the model wrote when it was distilled; a server
sees new ones every second, and what users ask repeats: the same templates, the same questions,
agents that call the model in a loop (SuffixDecoding, arXiv 2411.04975, speculates from a
suffix tree over earlier outputs for this reason). ``OnlineStore`` keeps, for every n-gram
(``min_n <= n <= max_n``) of every finished reply, how often each token followed it, and
proposes the most frequent one under the same rule as a datastore entry (``DatastoreConfig``:
followed at least ``min_count`` times and in at least ``min_share`` of its occurrences; one
occurrence is enough by default, as for a context copy). Where it has nothing, the store behind
it (``then``, the ``--datastore`` store) is asked. It is a ``NgramIndex`` fallback like a
datastore, so copies from it are placed and verified like any other: output never changes.

Memory is bounded: at most ``max_ngrams`` n-grams are kept, the oldest dropped first (a Python
dict entry per n-gram, about 380 bytes measured: 200,000 n-grams ~ 75 MB).

Shared by every request of the engine, so one client's replies speed up another's. The output
is not affected, but a step's latency could reveal that a phrase was generated before (a
timing side channel, as with any shared cache): turn it on where the requests share a trust
domain.

Worked example, max_n 2, min_n 2: after add([1, 2, 3]) and add([1, 2, 4]), (1, 2) was followed
by 3 and 4 once each: lookup([1, 2]) -> 3 (the first of the tie, 1 of 2 >= min_share 0.3);
(2, 3) -> None (nothing followed it).

Knows: token ids of finished replies. Does not know requests, models, trees or verification;
the engine calls ``add`` when a request finishes (``drafter.learn``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from cadence.draft.datastore import DatastoreConfig
from cadence.errors import CadenceError

ONLINE = DatastoreConfig(min_count=1)  # one earlier occurrence suffices, as for a context copy


class OnlineStore:
    """Next-token counts of the n-grams of finished replies, most recent ``max_ngrams`` kept."""

    def __init__(self, max_ngrams: int, cfg: DatastoreConfig = ONLINE, then=None):
        if max_ngrams < 1:
            raise CadenceError(f"online store: max_ngrams must be >= 1, got {max_ngrams}")
        if then is not None and then.cfg.max_n > cfg.max_n:  # ``NgramIndex.max_tail`` reads this cfg
            raise CadenceError(f"online store: n-grams up to {cfg.max_n}, the store behind it {then.cfg.max_n}")
        self.max_ngrams = max_ngrams  # n-grams kept, oldest dropped first
        self.cfg = cfg  # n-gram lengths and the rule an entry must pass
        self.then = then  # asked where this store has nothing: a ``datastore.Datastore`` (or None)
        self.replies = 0  # replies added
        self.tokens = 0  # reply tokens added
        self._next: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        """N-grams kept now."""
        return len(self._next)

    def add(self, reply: Sequence[int]) -> None:
        """Count every n-gram of ``reply`` with the token after it. Example: add([5, 6, 7]) with
        n = 2 counts (5, 6) -> 7; (6, 7) has no next token."""
        reply = [int(t) for t in reply]
        table, cfg = self._next, self.cfg
        for i in range(cfg.min_n, len(reply)):
            nxt = reply[i]
            for n in range(cfg.min_n, min(cfg.max_n, i) + 1):
                key = tuple(reply[i - n:i])
                counts = table.get(key)
                if counts is None:
                    counts = table[key] = {}
                else:
                    table.move_to_end(key)  # recently seen: kept longest
                counts[nxt] = counts.get(nxt, 0) + 1
        while len(table) > self.max_ngrams:
            table.popitem(last=False)
        self.replies += 1
        self.tokens += len(reply)

    def clear(self) -> None:
        """Forget every reply (a bench's untimed warm-up must not feed the timed run)."""
        self._next.clear()
        self.replies = self.tokens = 0

    def lookup(self, tail: Sequence[int]) -> int | None:
        """The next token after ``tail``, longest n first; then the store behind (``then``)."""
        cfg = self.cfg
        for n in range(min(cfg.max_n, len(tail)), cfg.min_n - 1, -1):
            counts = self._next.get(tuple(int(t) for t in tail[-n:]))
            if not counts:
                continue
            tok, c = max(counts.items(), key=lambda kv: kv[1])
            if c >= cfg.min_count and c >= cfg.min_share * sum(counts.values()):
                return tok
        return self.then.lookup(tail) if self.then is not None else None

    def describe(self) -> dict:
        """For ``--json`` and logs: replies and tokens added, n-grams kept, the bound."""
        return {"replies": self.replies, "reply_tokens": self.tokens, "ngrams": len(self),
                "max_ngrams": self.max_ngrams}
