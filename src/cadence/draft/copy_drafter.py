"""Context copy as a drafter of its own: prompt-lookup speculation for any model, no heads.

``HeadDrafter`` ranks the context copy (``context_copy``) ahead of its heads' candidates;
``CopyDrafter`` drafts with the copy alone, so a model without trained heads still gets
lossless speculation where its replies repeat the prompt or themselves (the ``ngram``
method; transformers calls it prompt lookup, vLLM the n-gram proposer). Each tree node's
only candidate is the token that followed the same 3- (else 2-) gram earlier in the
request; a node without one is dropped with its subtree, so a step with no copy at all is
plain decoding (the root alone) and costs nothing extra.

Knows: the request's token ids (through the ``NgramIndex`` the engine keeps per request).
Does not know: heads, models, verification. At T > 0 a copy is a point-mass proposal (no q):
speculative sampling accepts it with the backbone's probability of the token
(``verify.speculative``), so the output distribution stays that of plain sampling.
"""

from __future__ import annotations

import torch

from cadence.draft.context_copy import CopyConfig, NgramIndex, copy_after
from cadence.draft.base import Draft, LearnsReplies, drop_unfilled, path_tail
from cadence.verify.sampling import SamplingParams
from cadence.trees.tree import CompiledTree


class CopyDrafter(LearnsReplies):
    num_heads = 0  # no heads: every level is filled by copies

    def __init__(self, copy: CopyConfig | None = None, depth: int = 8, datastore=None):
        if depth < 1:
            raise ValueError(f"copy depth must be at least 1, got {depth}")
        self.copy = copy or CopyConfig()
        self.copy_depth = depth
        self.datastore = datastore  # ``datastore.Datastore`` asked where the request has no copy (None: off)

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.copy, self.datastore)

    def max_depth(self, sampling: SamplingParams) -> int:
        return self.copy_depth

    def shadow_copy(self, root: int, context, copies: NgramIndex | None) -> int | None:
        """The copy after ``root``, without drafting a tree (schedulers' shadow drafts)."""
        return copy_after(root, context, copies)

    @torch.inference_mode()
    def draft(self, tree: CompiledTree, root: int, hidden: torch.Tensor, context, sampling: SamplingParams,
              generator, copies: NgramIndex | None = None, state=None) -> Draft:
        """The tree filled by copies alone (``draft_copies``)."""
        if tree.max_depth > self.max_depth(sampling):
            raise ValueError(f"tree depth {tree.max_depth} > {self.max_depth(sampling)} this drafter can fill")
        return draft_copies(tree, root, context, copies if copies is not None else self.new_index(), hidden.device)


def draft_copies(tree: CompiledTree, root: int, context, copies: NgramIndex, device) -> Draft:
    """``tree`` filled by copies alone: a rank-0 child gets the copy after its parent's path;
    every other node (and any node without a copy) is dropped with its subtree. Also how a
    head drafter runs a copies-only plan (``Plan.copies_only``): no head call. Example:
    context ... 5 6 7 ... 5 6, root 7, chain of 3 -> nodes 1..3 carry what followed 6 7, 7 x,
    x y earlier, as far as copies exist."""
    tokens = [root] + [0] * (tree.size - 1)
    filled = [True] * tree.size
    copies.sync(list(context) + [root])
    for node in range(1, tree.size):  # parents come before children in node order
        parent = tree.parents[node]
        tok = None
        if filled[parent] and tree.ranks[node] == 0:
            tok = copies.lookup(path_tail(tree, tokens, parent, context, copies.max_tail))
        filled[node] = tok is not None
        tokens[node] = tok if tok is not None else 0
    return drop_unfilled(tree, tokens, filled, None, device)
