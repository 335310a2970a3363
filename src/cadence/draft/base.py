"""What every drafter returns and shares: a ``Draft`` (tokens, q, the tree that runs),
per-request ``DraftState``, the ``Drafter`` protocol the engine calls, and the helpers that
cut a tree to the nodes that were filled.

Knows: compiled trees. Does not know heads, copies or how candidates are chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from cadence.draft.context_copy import CopyConfig, NgramIndex
from cadence.trees.tree import CompiledTree, compile_tree
from cadence.verify.sampling import SamplingParams


@dataclass
class DraftState:
    """One request's drafter state (attention heads): backbone states not yet consumed by the
    heads' cache, and the cache itself (``heads.new_cache()``, made at the first draft)."""

    pending: list = field(default_factory=list)  # (m, d) tensors: h of committed tokens, in order
    cache: object = None
    committed: int = 0  # tokens reported through ``commit``


@dataclass
class Draft:
    tokens: torch.Tensor  # (N+1,) long: node 0 is the root token
    q: torch.Tensor | None  # (N+1, V) distribution each node's children were drawn from (T > 0)
    tree: CompiledTree | None = None  # the tree actually filled, when nodes were dropped (else the one asked for)
    copy_nodes: dict | None = None  # dynamic trees: node -> whether its parent is a copy too, for each context copy
    fixed: frozenset = frozenset()  # T > 0: nodes proposed as a point mass (context copies), not drawn from q


class LearnsReplies:
    """For drafters whose copies may come from a ``datastore`` attribute: ``learn`` hands a finished
    request's reply to it when it is an online store (``online_store.OnlineStore``: it has ``add``),
    unless ``learning`` is off (``decode.engine.not_learning``: untimed warm-ups)."""

    learning = True  # finished replies go to an online store

    def learn(self, reply) -> None:
        if self.learning and hasattr(getattr(self, "datastore", None), "add"):
            self.datastore.add(reply)


class Drafter(Protocol):
    num_heads: int  # K: the deepest level the heads draft

    def draft(self, tree: CompiledTree, root: int, hidden: torch.Tensor, context: list[int],
              sampling: SamplingParams, generator: torch.Generator | None,
              copies: NgramIndex | None = None, state: DraftState | None = None) -> Draft:
        """hidden: (d,) backbone state that produced ``root``; context: committed ids;
        copies: the request's n-gram index (``new_index``), or None for no context copy;
        state: the request's ``new_state()`` (optional: pass it only when it is not None)."""
        ...

    # Optional (engines call them when present, see ``engine.Request``):
    # new_state() -> DraftState | None: per-request state, None when the drafter needs none.
    # commit(state, hidden (n, d), tokens (n,)): tokens were committed, hidden[i] the backbone
    #     state after tokens[i] (the prompt after prefill; the accepted path after each verify).

    def new_index(self) -> NgramIndex | None:
        """Per-request context-copy state, or None when this drafter does not copy."""
        ...

    def max_depth(self, sampling: SamplingParams) -> int:
        """Deepest tree level this drafter can fill under ``sampling``."""
        ...


def path_tail(tree: CompiledTree, tokens: list[int], node: int, context, need: int) -> list[int]:
    """The last ``need`` known tokens ending at ``node``: context, root, then the path down
    to ``node`` (what a context copy is looked up by). Example: context [1, 2], root 3,
    node 2 = child of node 1 (token 4) with token 5, need 3 -> [3, 4, 5]."""
    path = []
    j = node
    while j >= 0:
        path.append(tokens[j])
        j = tree.parents[j]
    path.reverse()
    if len(path) < need:
        path = list(context[-(need - len(path)):]) + path
    return path[-need:]


def drop_unfilled(tree: CompiledTree, tokens: list[int], filled: list[bool], q, device,
                  fixed: frozenset = frozenset()) -> Draft:
    """The draft over the nodes that got a candidate (and whose ancestors all did); ``fixed``
    (point-mass proposals) renumbered with them.

    Example: chain (0,), (0,0), (0,0,0) named "c" with no candidate for node 2 -> nodes 2
    and 3 go, Draft.tree is the chain (0,) named "c~2" (2 nodes) and Draft.tokens is
    [root, token of node 1]."""
    for node in range(1, tree.size):  # parents come before children in node order
        filled[node] = filled[node] and filled[tree.parents[node]]
    if all(filled):
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long, device=device), q=q, fixed=frozenset(fixed))
    keep = [i for i in range(1, tree.size) if filled[i]]
    sub = compile_tree([tree.paths[i - 1] for i in keep], name=f"{tree.name}~{len(keep) + 1}")
    new_index = {old: new for new, old in enumerate([0] + keep)}
    return Draft(tokens=torch.tensor([tokens[0]] + [tokens[i] for i in keep], dtype=torch.long, device=device),
                 q=None if q is None else q[[0] + keep], tree=sub,
                 fixed=frozenset(new_index[i] for i in fixed if i in new_index))


class GrowingDrafter(Protocol):
    """What growing a dynamic tree (``grow.draft_dynamic``) uses of a drafter: the public
    drafting calls ``HeadDrafter`` gives it."""

    heads: object  # the draft heads (``heads.base.DraftHeads``)
    num_heads: int  # K: levels the heads draft
    copy_depth: int  # deepest level a context copy may fill
    context_vocab: int  # context-vocabulary tokens per request (0 = off)
    copy: CopyConfig | None  # the context copy's settings (None = off)

    def begin(self, state: DraftState | None, hidden: torch.Tensor, context, root: int):
        """Extend the request's head cache to the committed context and start a draft."""

    def logits(self, feats: torch.Tensor, extra):
        """Head features -> (logits over the draft vocabulary [+ context tokens], their ids or None)."""
