"""Context vocabulary: the request's own tokens that the heads' draft vocabulary lacks.

Heads with a draft vocabulary (SmolLM2's shipped heads draft from 8,192 of 49,152 ids) can
never propose a token outside it. On held-out benchmark outputs (2026-12-01, 50e2690), 6-18% of
the tokens plain decoding produced were outside eagle's vocabulary, and most of those had
already appeared earlier in the same request: identifiers in code, numbers, names,
non-English words, emoji bytes, and every token of a repetition loop. ``ContextVocab``
keeps, per request, the most recent ``limit`` such tokens; the drafter scores them with
their rows of the frozen LM head next to the draft vocabulary (``HeadDrafter``), so a head
can propose them like any other token. Lossless: verification is unchanged; the cost is a
(P, d) x (d, n) product per tree level with n <= ``limit``.

Knows: which context tokens fall outside a vocabulary, most recent first. Does not know
heads, trees or the engine. ``ContextVocabs`` finds a request's tracker from its context
list (the engine extends one list per request), so no engine state is needed.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class ContextVocab:
    """Tokens of one growing context outside a vocabulary, most recent last.

    Example: inside = {1, 2}, limit 2; update([1, 7, 2, 8, 7]) keeps 8, 7 (7 seen again
    last); ids() -> tensor([8, 7]); update([1, 7, 2, 8, 7, 9]) -> ids() = [7, 9].
    """

    def __init__(self, inside: list[bool], limit: int, device: torch.device | str = "cpu"):
        self.inside = inside  # inside[t]: token t is in the draft vocabulary (a list: fast to index)
        self.limit = limit
        self.device = device
        self.seen = 0  # context tokens scanned
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._ids: torch.Tensor | None = None  # cached result of ids(), None when stale
        self.with_root = None  # (root, ids(), ids with the root added): ``ContextVocabs.extra_ids``'s last

    def update(self, context: list[int]) -> None:
        """Scan the tokens appended to ``context`` since the last call."""
        new = context[self.seen:]
        if not new:
            return
        inside, recent = self.inside, self._recent
        changed = False
        for t in new:
            if not inside[t]:
                recent[t] = None
                recent.move_to_end(t)
                changed = True
        while len(recent) > self.limit:
            recent.popitem(last=False)
        self.seen = len(context)
        if changed:  # tokens inside the vocabulary leave ids() as it was (the same tensor: callers may key on it)
            self._ids = None

    def __contains__(self, token: int) -> bool:
        return token in self._recent

    def ids(self) -> torch.Tensor | None:
        """(n,) long: the tracked tokens, or None when there are none."""
        if not self._recent:
            return None
        if self._ids is None:
            self._ids = torch.tensor(list(self._recent), dtype=torch.long, device=self.device)
        return self._ids


class ContextVocabs:
    """One ``ContextVocab`` per live context list (keyed by the list object itself), the
    ``keep`` most recently used. A list that shrank or is new gets a fresh tracker."""

    def __init__(self, draft_vocab: torch.Tensor, vocab_size: int, limit: int, keep: int = 64):
        inside = torch.zeros(vocab_size, dtype=torch.bool)
        inside[draft_vocab.cpu()] = True
        self.inside = inside.tolist()
        self.limit, self.keep = limit, keep
        self.device = draft_vocab.device
        self._live: OrderedDict[int, tuple[list[int], ContextVocab]] = OrderedDict()

    def extra_ids(self, context: list[int], root: int) -> torch.Tensor | None:
        """The context tokens (and the root) outside the vocabulary, at most ``limit``."""
        key = id(context)
        hit = self._live.get(key)
        if hit is None or hit[0] is not context or hit[1].seen > len(context):
            hit = (context, ContextVocab(self.inside, self.limit, self.device))
            self._live[key] = hit
        self._live.move_to_end(key)
        while len(self._live) > self.keep:
            self._live.popitem(last=False)
        track = hit[1]
        track.update(context)
        ids = track.ids()
        if not self.inside[root] and root not in track:
            memo = track.with_root
            if memo is not None and memo[0] == root and memo[1] is ids:
                return memo[2]  # the same tensor for the same ids and root
            root_t = torch.tensor([root], dtype=torch.long, device=self.device)
            out = root_t if ids is None else torch.cat([ids[1:] if ids.numel() >= self.limit else ids, root_t])
            track.with_root = (root, ids, out)
            return out
        return ids
