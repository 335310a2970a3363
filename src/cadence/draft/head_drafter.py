"""Drafters fill a compiled tree with candidate tokens; they never verify.

``HeadDrafter`` walks the tree depth by depth: at depth d it runs head d+1 once,
batched over every node that has children, on the state of that node's path.
At T = 0 children are the head's top-ranked tokens; at T > 0 they are independent
draws from the head's distribution q (the same sampling parameters as the backbone),
and q is returned so that verification can be lossless. With context copy a node's
candidates start with the token that followed the same n-gram earlier in the request,
and levels deeper than K are filled by copies alone; at T > 0 a copy is a point-mass
proposal (``Draft.fixed``), the heads' draws beside it come from q without the copy's token. With a context
vocabulary (``context_vocab``), heads restricted to a draft vocabulary may also propose the
request's own tokens outside it (``context_vocab.ContextVocabs``).

Per-request state (attention-bearing heads, ``heads.attends``): such heads attend over the
request's context through their own KV cache, so a request holds a ``DraftState``
(``new_state()``; None for per-position heads) and reports every committed token's backbone
state with ``commit(state, hidden, tokens)``: once for the prompt after prefill, then after
each verification for the accepted path (root first). The state keeps only entries built
from committed tokens and the backbone's *true* states; a draft's tree entries (built from
predicted features) are scratch and are dropped when the draft returns, so the head cache
is compacted to the accepted path by construction: the next draft extends it with the
accepted tokens' true states (EAGLE's rule). ``draft(..., state=None)`` still works for
every head: attention heads then see only h_t and the draft path (no earlier context).
"""

from __future__ import annotations

import torch

from cadence.draft.context_copy import CopyConfig, NgramIndex, copy_after, merge_candidates
from cadence.draft.base import Draft, LearnsReplies, DraftState, drop_unfilled, path_tail
from cadence.draft.context_vocab import ContextVocabs
from cadence.draft.grow import DynamicTree, draft_dynamic
from cadence.verify.sampling import SamplingParams, argmax, categorical, probs


class HeadDrafter(LearnsReplies):
    """Drafts with trained (or random) MTP heads, optionally with context copies.

    With ``copy`` set, each node's candidate list is the context copy (``context_copy``)
    followed by the head's ranked candidates (T > 0: its draws), and tree levels
    deeper than K hold copies only. A node past K with no copy is dropped with its
    subtree, and ``Draft.tree`` is the smaller tree: verification then pays only for
    the nodes that carry a candidate.
    """

    def __init__(self, heads, copy: CopyConfig | None = None, copy_depth: int = 0, context_vocab: int = 0,
                 datastore=None):
        self.heads = heads
        self.num_heads = heads.K
        self.vocab_size = heads.cfg.vocab_size
        self.copy = copy
        self.copy_depth = max(copy_depth, heads.K)  # deepest level a copy may fill
        self.datastore = datastore  # ``datastore.Datastore`` asked where the request has no copy (None: off)
        self._pinned = None  # (hidden, tokens) set by ``pin`` for the next draft call
        # up to ``context_vocab`` of the context's tokens outside the heads' draft vocabulary
        # are scored too (None: off, or heads that draft over the whole vocabulary)
        dv = heads.draft_vocab
        own = getattr(heads, "own_lm_head", False)  # eagle3: its logits are not the backbone LM head's
        self.context_vocab = (ContextVocabs(dv, self.vocab_size, context_vocab)
                              if context_vocab > 0 and dv is not None and not own else None)

    @property
    def taps(self) -> tuple[int, ...]:
        """Backbone layers the heads also read (``HeadConfig.taps``): the engine taps them in every
        forward and commits [h ; taps] rows (``engine.drafter_states``)."""
        return tuple(getattr(self.heads.cfg, "taps", ()) or ())

    def pin(self, hidden: torch.Tensor, tokens: list[int]) -> None:
        """One-shot, for schedulers that drafted the top-1 chain themselves to judge it (the
        confidence scheduler): the next ``draft`` call, if it is for this very ``hidden``
        tensor and root ``tokens[0]`` on a top-1 chain at T = 0, returns ``tokens`` (cut to
        the chain) instead of drafting, so the tokens committed are the ones judged. Any
        next call clears the pin."""
        self._pinned = (hidden, list(tokens))

    def new_index(self) -> NgramIndex | None:
        return NgramIndex(self.copy, self.datastore) if self.copy is not None else None

    @property
    def batches_shadows(self) -> bool:
        """Whether shadow drafts can wait and be judged several at a time (``judge_shadows``):
        per-position heads (one head call over the kept states) and eagle (one LM-head call
        over the features its cache computed for the roots' entries anyway). Other attention
        heads (mtp-attn) draft each shadow through ``draft`` at once."""
        return not getattr(self.heads, "attends", False) or hasattr(self.heads, "entry_features")

    def shadow_key(self, hidden: torch.Tensor, context) -> torch.Tensor | int:
        """What a deferred shadow draft keeps until it is judged: the root's state (d,), copied
        (a fast backbone may reuse the buffer it is in), or for eagle the position of the
        root's entry, ``len(context) - 1`` (its features are computed when the cache catches up)."""
        return len(context) - 1 if getattr(self.heads, "attends", False) else hidden.clone()

    @torch.inference_mode()
    def judge_shadows(self, keys: list, roots: list[int], state: DraftState | None, hidden: torch.Tensor,
                      context, root: int) -> list[int] | None:
        """Head 1's top candidate for each deferred shadow (``shadow_key``s, their roots), in
        one call; None when they cannot be judged (an eagle cache out of step with a request
        that just ended, or entries no longer kept). ``state``, ``hidden``, ``context``,
        ``root``: the request now, after its last commit (eagle's cache catches up to it,
        as the next draft would). Draft vocabulary only, as ``shadow_heads``."""
        if not getattr(self.heads, "attends", False):
            return self.shadow_heads(torch.stack(keys), roots)
        if state is None or state.committed != len(context):
            return None
        self.begin(state, hidden, context, root)  # the roots' entries: committed by now
        feats = self.heads.entry_features(state.cache, keys)
        if feats is None:
            return None
        logits, vocab_ids = self.logits(feats, None)
        best = argmax(logits)
        return (vocab_ids[best] if vocab_ids is not None else best).tolist()

    def new_state(self) -> DraftState | None:
        """Per-request state for attention heads; None for per-position heads (nothing to keep)."""
        return DraftState() if getattr(self.heads, "attends", False) else None

    def commit(self, state: DraftState | None, hidden: torch.Tensor, tokens) -> None:
        """Record committed tokens and their backbone states hidden (n, d), or (n, d * (1 +
        n_taps)) with the tapped layers appended; hidden[i] is the state after tokens[i].
        Cheap: the heads' cache is extended lazily at the next draft."""
        if state is None:
            return
        if hidden.shape[0] != len(tokens):
            raise ValueError(f"commit: {hidden.shape[0]} states for {len(tokens)} tokens")
        state.pending.append(hidden.detach())
        state.committed += len(tokens)

    def begin(self, state: DraftState | None, hidden: torch.Tensor, context, root: int):
        """Extend the request's head cache to the committed context and start a draft."""
        seq = list(context) + [root]
        if state is None:  # no request state: attend over the draft path only
            return self.heads.begin_draft(self.heads.new_cache(len(context) - 1), hidden[None], seq)
        if state.committed != len(context):
            raise ValueError(f"drafter state has {state.committed} committed tokens, the context "
                             f"{len(context)}: call commit after prefill and after every verification")
        if state.cache is None:
            state.cache = self.heads.new_cache(0)
        pending = torch.cat(state.pending) if state.pending else hidden.new_zeros(0, hidden.shape[-1])
        state.pending = []
        return self.heads.begin_draft(state.cache, pending, seq)

    def max_depth(self, sampling: SamplingParams) -> int:
        """Deepest tree level this drafter can fill under ``sampling``."""
        return self.copy_depth if self.copy is not None else self.num_heads

    @torch.inference_mode()
    def draft(self, tree, root, hidden, context, sampling, generator, copies=None, state=None) -> Draft:
        if tree.max_depth > self.max_depth(sampling):
            raise ValueError(f"tree depth {tree.max_depth} > {self.max_depth(sampling)} this drafter can fill")
        pinned, self._pinned = self._pinned, None
        if (pinned is not None and pinned[0] is hidden and pinned[1][0] == root and sampling.greedy
                and tree.size <= len(pinned[1]) and all(set(p) == {0} for p in tree.paths)):
            return Draft(tokens=torch.tensor(pinned[1][:tree.size], dtype=torch.long, device=hidden.device), q=None)
        n = tree.size
        device = hidden.device
        tokens = [root] + [0] * (n - 1)
        q = None
        copying = copies is not None
        if copying:
            copies.sync(list(context) + [root])
        attends = getattr(self.heads, "attends", False)
        ctx = self.begin(state, hidden, context, root) if attends else None
        extra = self.context_vocab.extra_ids(context, root) if self.context_vocab is not None else None
        extra = self._extra_rows(extra) if extra is not None else None  # ids (n,), rows (n, d)
        state_of: dict[int, torch.Tensor] = {-1: self.heads.init_state(hidden[None])[0]}
        by_depth: dict[int, list[int]] = {}
        for node in range(n):
            if tree.children[node]:
                by_depth.setdefault(tree.depths[node], []).append(node)
        filled = [True] * n
        fixed: set[int] = set()  # T > 0: children holding a context copy (a point-mass proposal)
        for depth in sorted(by_depth):
            for i in by_depth[depth]:  # a node under one that got no candidate goes with it
                if depth and not filled[tree.parents[i]]:
                    filled[i] = False
            nodes = [i for i in by_depth[depth] if filled[i]]
            if not nodes:
                continue
            widths = [tree.width(i) for i in nodes]
            found = [copies.lookup(path_tail(tree, tokens, i, context, copies.max_tail)) if copying else None
                     for i in nodes]
            cands: list[list[int]] = [[] for _ in nodes]
            if depth < self.num_heads:
                prev = torch.stack([state_of[tree.parents[i]] for i in nodes])
                node_tokens = torch.tensor([tokens[i] for i in nodes], device=device)
                if attends:
                    states = self.heads.tree_step(depth + 1, prev, node_tokens, ctx, nodes,
                                                  [tree.parents[i] for i in nodes])
                    feats = self.heads.tree_logits_features(depth + 1, states)
                else:
                    feats, states = self.heads.step_features(depth + 1, prev, node_tokens)
                logits, vocab_ids = self.logits(feats, extra)
                for j, node in enumerate(nodes):
                    state_of[node] = states[j]
                cands, q = self._candidates(logits, vocab_ids, nodes, widths, sampling, generator, q, n, found)
            for j, node in enumerate(nodes):
                cands[j] = merge_candidates(found[j], cands[j], widths[j])
                for child in tree.children[node]:
                    r = tree.ranks[child]
                    if r < len(cands[j]):
                        tokens[child] = cands[j][r]
                        if r == 0 and found[j] is not None and not sampling.greedy:
                            fixed.add(child)
                    else:
                        filled[child] = False
        return drop_unfilled(tree, tokens, filled, q, device, frozenset(fixed))

    def draft_dynamic(self, spec: DynamicTree, root: int, hidden: torch.Tensor, context, limit: int,
                      copies: NgramIndex | None = None, state: DraftState | None = None,
                      sampling: SamplingParams | None = None) -> Draft:
        """An EAGLE-2 dynamic tree (``grow.draft_dynamic``; ``spec`` a ``DynamicTree``),
        at most ``limit`` levels deep: the tree is chosen while drafting, ``Draft.tree`` says
        which. At T > 0 its nodes are point-mass proposals (``Draft.q`` None)."""
        return draft_dynamic(self, spec, root, hidden, context, limit, copies, state, sampling)

    @torch.inference_mode()
    def shadow(self, root: int, hidden: torch.Tensor, context, copies: NgramIndex | None = None) -> int:
        """The depth-1 top candidate at T = 0: the token a 1-draft chain would carry (the same
        as ``draft`` of that chain), made cheaply for a shadow draft: the context copy when
        there is one (no head call), else head 1's argmax. hidden: (d,) state that produced
        ``root``. Per-position heads only (attention heads go through ``draft``).

        Example: context [.., 5, 6], root 7, and 5 6 7 was followed by 9 earlier -> 9."""
        tok = self.shadow_copy(root, context, copies)
        return tok if tok is not None else self.shadow_heads(hidden[None], [root])[0]

    def shadow_copy(self, root: int, context, copies: NgramIndex | None) -> int | None:
        """The context copy's depth-1 candidate after ``root`` (no head call), or None."""
        return copy_after(root, context, copies)

    @torch.inference_mode()
    def shadow_heads(self, hidden: torch.Tensor, roots: list[int]) -> list[int]:
        """Head 1's argmax for B (state, root) pairs in one head call: hidden (B, d), row i
        the state that produced roots[i]. One call reads the head's weights once, so B
        shadow drafts cost far less than B calls (on a 2-core EPYC, fp32 hydra heads: 0.57 ms
        for 1 row, 0.87 ms for 4). Per-position heads only."""
        state = self.heads.init_state(hidden)  # (B, d)
        logits, vocab_ids, _ = self.heads.draft_step(1, state, torch.tensor(roots, device=hidden.device))
        best = argmax(logits)  # (B,)
        return (vocab_ids[best] if vocab_ids is not None else best).tolist()

    def _extra_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, their LM-head rows (n, d)), the rows kept while ``ContextVocabs`` hands out the same
        ids tensor (it does until the context brings a new token): gathering them cost about 15 us
        a draft."""
        hit = self.__dict__.get("_extra_hit")
        if hit is None or hit[0] is not ids:
            hit = (ids, self.heads.lm_rows(ids))
            self._extra_hit = hit
        return hit

    def logits(self, feats: torch.Tensor, extra: tuple[torch.Tensor, torch.Tensor] | None):
        """feats (P, d) -> (logits (P, V'), ids (V',) or None for the whole vocabulary): the
        draft vocabulary's columns, then those of the context tokens outside it (``extra``:
        their ids (n,) and LM-head rows (n, d))."""
        logits, vocab_ids = self.heads.draft_logits(feats), self.heads.draft_vocab
        if extra is None:
            return logits, vocab_ids
        ids, w = extra
        more = (feats.to(w.dtype) @ w.T).float()
        return torch.cat([logits, more], dim=-1), torch.cat([vocab_ids, ids])

    def _candidates(self, logits, vocab_ids, nodes, widths, sampling, generator, q, n, copied=None):
        """Ranked candidate ids per node: top-k at T = 0, iid draws from q at T > 0.

        logits: (P, V') for the P ``nodes`` (V' the draft vocabulary, ``vocab_ids`` its ids, or
        None for the whole vocabulary); ``copied``: per node, its context copy or None. At T > 0 a
        node with a copy gets ``width - 1`` draws from q with the copy's token taken out
        (renormalised; the copy itself is verified as a point mass, so a draw of the same token
        could never be accepted), and ``q`` (n, V) records that distribution for the node.
        Example: q = (.5, .3, .2), copy 0, width 3 -> two draws from (0, .6, .4)."""
        copied = copied or [None] * len(nodes)
        if sampling.greedy:  # top-1 through the native argmax (a tenth of ``topk``'s 19 us at one row)
            cand = argmax(logits)[:, None] if max(widths) == 1 else logits.topk(max(widths), dim=-1).indices
            if vocab_ids is not None:
                cand = vocab_ids[cand]
            return cand.tolist(), q
        dist = probs(logits, sampling)  # (P, V')
        draws = [w - (c is not None) for w, c in zip(widths, copied)]
        for j, c in enumerate(copied):
            if c is None:
                continue
            col = c if vocab_ids is None else _column(vocab_ids, c)
            if col is not None:
                dist[j, col] = 0.0
            total = float(dist[j].sum())
            if total <= 1e-12:  # q held nothing but the copy: no draws beside it
                dist[j] = 1.0 / dist.shape[-1]
                draws[j] = 0
            else:
                dist[j] /= total
        if q is None:
            q = torch.zeros(n, self.vocab_size, device=logits.device)
        if vocab_ids is None:
            q[nodes] = dist
        else:  # q lives on the full vocabulary, zero outside the draft subset
            q[nodes] = torch.zeros(len(nodes), self.vocab_size, device=logits.device).index_copy_(
                1, vocab_ids, dist)
        cand = categorical(dist, max(max(draws), 1), generator)  # (P, most draws)
        if vocab_ids is not None:
            cand = vocab_ids[cand]
        return [row[:d] for row, d in zip(cand.tolist(), draws)], q


def _column(vocab_ids: torch.Tensor, token: int) -> int | None:
    """Position of ``token`` in a draft vocabulary's ids (V',), None when it is not there."""
    hit = (vocab_ids == token).nonzero()
    return int(hit[0, 0]) if len(hit) else None
