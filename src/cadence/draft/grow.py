"""EAGLE-2's dynamic draft tree: the drafter's own confidence shapes each step's tree.

A static tree spends its nodes on the same ranks at every step; the drafter knows better
step by step (EAGLE-2, arXiv 2406.16858: a draft token's probability under the drafter is
close to its acceptance rate). Per step, at T = 0:

  1. **expand**: the root's top-``topk`` candidates form level 1; a candidate's *value* is
     the product of the draft probabilities along its path. For each level below the deepest,
     the level's ``topk`` best candidates by value (the frontier) run through the heads in one
     batched call and each gets its top-``topk`` children. With context copy, a frontier
     node's copy (the token that followed the same n-gram earlier) is one more child, valued
     at least ``copy_conf`` x its parent's value (``copy_run_conf`` when the parent is a copy:
     a copied run tends to go on); past the heads' depth K copies alone
     extend the frontier (as in the static copy trees).
  2. **rerank**: every candidate, best value first; a candidate is taken when its parent was
     (a child's value never exceeds its parent's, so the best N form a tree).
  3. **depth**: a level is drafted only while it can pay (``worth_a_level``): its expected
     tokens are at most the frontier's summed value, its cost one more heads call.
  4. **size**: N is the count maximising expected tokens per second,
     ``(1 + sum of the N values) / (verify(N + 1) + drafting)``, under this machine's verify
     latency curve (``cadence.costs.latency``), capped at ``max_nodes``; without a curve, ``max_nodes``.

Verification is unchanged, so output stays identical to plain greedy decoding: only which
tokens are verified changes.

At T > 0 the same tree is grown from the drafter's distribution under the request's sampling
settings (temperature, top-k, top-p: ``sampling.probs``) and every node is verified as a
point-mass proposal (``Draft.q`` is None; ``verify.speculative``): a candidate x is accepted
with the residual's probability of x, and a rejected x leaves the residual. That is lossless
however the candidates were chosen (they do not depend on the verification's random draws),
and a node's chance to be the accepted child is then exactly the backbone's p(x): a path is
accepted with the product of p along it, which the product of the drafter's tempered
probabilities estimates, as at T = 0.

Knows: the drafter's heads, context copies and context vocabulary, through ``HeadDrafter``'s
public drafting calls (``begin``, ``logits``, ``heads``, ``copy``); ``HeadDrafter.draft_dynamic`` calls it.
Does not know: verification, schedulers, or where the latency curve comes from.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from cadence.draft.context_copy import NgramIndex
from cadence.draft.base import Draft, DraftState, GrowingDrafter
from cadence.verify.sampling import SamplingParams, probs
from cadence.trees.tree import CompiledTree, compile_tree


@dataclass(frozen=True)
class DynamicTree:
    """How a dynamic tree is grown and cut (``--scheduler dynamic``)."""

    topk: int = 4  # children per expanded node and nodes expanded per level (EAGLE-2's top-k)
    max_nodes: int = 64  # most draft nodes verified per step (the root excluded; the latency curve cuts fewer)
    depth: int = 0  # levels the heads draft (0: their K; heads with ``any_depth``, eagle, may go deeper)
    copy_conf: float = 0.4  # value of a context copy relative to its parent (at least; the head's own if higher)
    copy_run_conf: float = 0.7  # the same for a copy whose parent is a copy too (a copied run tends to go on)
    latency: Callable[[int], float] | None = None  # seconds to verify n nodes here (None: always max_nodes)
    level_s: float = 0.0  # seconds one more level of head drafting costs here (0: always draft K levels)


@dataclass
class _Cand:
    """A drafted candidate: node ``id`` (root 0), its parent's id, token, depth and log value."""

    id: int
    parent: int
    token: int
    depth: int
    logv: float
    copy: bool = False  # a context copy (valued at least by copy_conf / copy_run_conf)


def select(cands: list[_Cand], n: int) -> list[_Cand]:
    """The best ``n`` candidates by value whose ancestors are all selected (root = id 0).

    Example: a (v .9, root), b (v .5, root), c (v .6, parent a), d (v .55, parent b), n = 3 ->
    [a, c, b] (d's parent b is taken, but d ranks fourth)."""
    taken, out = {0}, []
    for c in sorted(cands, key=lambda c: (-c.logv, c.depth)):
        if len(out) == n:
            break
        if c.parent in taken:
            taken.add(c.id)
            out.append(c)
    return out


def best_size(values: list[float], latency: Callable[[int], float] | None, draft_s: float, cap: int) -> int:
    """How many of the selected candidates (values = estimated acceptance, best first) to verify:
    the N <= cap maximising ``(1 + sum(values[:N])) / (latency(N + 1) + draft_s)``.

    Example: values [.9, .8, .1], latency 10 ms for 1-3 nodes and 30 ms for 4, draft 0 ->
    N = 2 (tau 2.7 in 10 ms; adding the third: 2.8 in 30 ms)."""
    cap = min(cap, len(values))
    if latency is None:
        return cap
    best, best_n, tau = 0.0, 0, 1.0
    for n in range(cap + 1):
        if n:
            tau += values[n - 1]
        rate = tau / (latency(n + 1) + draft_s)
        if rate > best:
            best, best_n = rate, n
    return best_n


def worth_a_level(frontier: list[_Cand], cands: list[_Cand], spec: DynamicTree, spent: float) -> bool:
    """Whether one more level of head drafting can pay: the level adds at most the frontier's
    summed value in expected tokens (children's probabilities sum to <= 1 per parent), and it
    costs ``level_s``, worth ``tau * level_s / step seconds`` tokens at the current tree's rate.

    Example: frontier values .05 and .02, the best tree so far tau 1.8 in 25 ms, a level 2 ms
    -> .07 < 1.8 * 2 / 27 = .13: stop; frontier .5 and .1 -> .6 > .13: draft it."""
    if spec.latency is None or spec.level_s <= 0.0:
        return True
    gain = sum(math.exp(c.logv) for c in frontier)
    best = sorted((math.exp(c.logv) for c in cands), reverse=True)[:spec.max_nodes]
    tau = 1.0 + sum(best)
    step = spec.latency(len(best) + 1) + spent + spec.level_s
    return gain > tau * spec.level_s / step


def to_draft(root: int, chosen: list[_Cand], device) -> Draft:
    """A ``Draft`` over the chosen candidates: paths of sibling ranks (by value), compiled,
    tokens in the compiled tree's node order (``compile_tree`` sorts paths by length, then
    ranks). Example: root 5, a (token 7) and b (token 8) under the root, c (token 9) under a,
    values a > b -> paths (0,), (1,), (0, 0); tokens [5, 7, 8, 9]. ``Draft.copy_nodes`` maps each
    context copy's node index to whether its parent is a copy too (a copied run)."""
    rank_path: dict[int, tuple[int, ...]] = {0: ()}
    kids: dict[int, int] = {}
    token_of: dict[tuple[int, ...], int] = {}
    for c in chosen:  # parents come before children (select's order)
        r = kids.get(c.parent, 0)
        kids[c.parent] = r + 1
        path = rank_path[c.parent] + (r,)
        rank_path[c.id] = path
        token_of[path] = c.token
    tree: CompiledTree = compile_tree(list(token_of), name=f"dynamic-{len(chosen)}")
    tokens = [root] + [token_of[p] for p in tree.paths]
    node = {p: i for i, p in enumerate(tree.paths, start=1)}
    is_copy = {c.id: c.copy for c in chosen}
    copies = {node[rank_path[c.id]]: is_copy.get(c.parent, False) for c in chosen if c.copy}
    return Draft(tokens=torch.tensor(tokens, dtype=torch.long, device=device), q=None, tree=tree, copy_nodes=copies)


@torch.inference_mode()
def head_levels(drafter: GrowingDrafter, spec: DynamicTree) -> int:
    """Levels the heads draft: ``spec.depth`` for heads that serve any depth (eagle's one
    layer), else at most their K. Example: eagle K = 3, depth 5 -> 5; hydra K = 3 -> 3."""
    if spec.depth <= 0:
        return drafter.num_heads
    return spec.depth if getattr(drafter.heads, "any_depth", False) else min(spec.depth, drafter.num_heads)


def draft_dynamic(drafter: GrowingDrafter, spec: DynamicTree, root: int, hidden: torch.Tensor, context: list[int],
                  limit: int, copies: NgramIndex | None = None, state: DraftState | None = None,
                  sampling: SamplingParams | None = None) -> Draft:
    """A dynamic tree (module docstring). hidden: (d,) state that produced ``root``; limit:
    the deepest level the engine allows (the tokens left); the tree goes as deep as the heads
    draft (``head_levels``) or, with copies, the drafter's copy depth. ``sampling``: the
    request's settings (None or T = 0: greedy); at T > 0 values come from the drafter's
    distribution under them and the draft is for point-mass verification."""
    t0 = time.perf_counter()
    heads, k = drafter.heads, spec.topk
    levels = head_levels(drafter, spec)
    max_depth = min(limit, max(levels, drafter.copy_depth if copies is not None else 0))
    device = hidden.device
    if copies is not None:
        copies.sync(list(context) + [root])
    attends = getattr(heads, "attends", False)
    ctx = drafter.begin(state, hidden, context, root) if attends else None
    extra = drafter.context_vocab.extra_ids(context, root) if drafter.context_vocab is not None else None
    extra = (extra, heads.lm_rows(extra)) if extra is not None else None
    log_conf = (math.log(spec.copy_conf), math.log(spec.copy_run_conf))
    root_c = _Cand(0, -1, root, 0, 0.0)
    by_id = {0: root_c}
    state_of = {-1: heads.init_state(hidden[None])[0]}
    cands: list[_Cand] = []
    frontier = [root_c]
    heads_on = True
    for depth in range(max_depth):  # frontier at `depth` -> candidates at depth + 1
        children: list[_Cand] = []
        heads_on = heads_on and depth < levels and (
            depth == 0 or worth_a_level(frontier, cands, spec, time.perf_counter() - t0))
        if heads_on:
            children = _head_children(drafter, frontier, depth, state_of, ctx, extra, k, next_id=len(by_id),
                                      sampling=sampling)
        if copies is not None:
            children = _with_copies(children, frontier, by_id, context, copies, log_conf,
                                    first_id=len(by_id) + len(children))
        if not children:
            break
        for c in children:
            by_id[c.id] = c
        cands += children
        frontier = sorted(children, key=lambda c: -c.logv)[:k]
    chosen = select(cands, spec.max_nodes)
    spent = time.perf_counter() - t0
    n = best_size([math.exp(c.logv) for c in chosen], spec.latency, spent, spec.max_nodes)
    if n == 0:
        return Draft(tokens=torch.tensor([root], dtype=torch.long, device=device), q=None,
                     tree=compile_tree([], name="dynamic-0"))
    return to_draft(root, chosen[:n], device)


def _head_children(drafter: GrowingDrafter, frontier: list[_Cand], depth: int, state_of, ctx, extra,
                   k: int, next_id: int, sampling: SamplingParams | None = None) -> list[_Cand]:
    """The top-k children of each frontier node at ``depth`` (one batched heads call); node
    states go into ``state_of`` for the next level. At T > 0 the children and their values
    come from the drafter's distribution under ``sampling`` (tokens it gives no mass, e.g.
    outside top-p, are left out)."""
    heads = drafter.heads
    device = state_of[-1].device
    prev = torch.stack([state_of[c.parent] for c in frontier])
    toks = torch.tensor([c.token for c in frontier], device=device)
    if ctx is not None:
        states = heads.tree_step(depth + 1, prev, toks, ctx, [c.id for c in frontier], [c.parent for c in frontier])
        feats = heads.tree_logits_features(depth + 1, states)
    else:
        feats, states = heads.step_features(depth + 1, prev, toks)
    logits, vocab_ids = drafter.logits(feats, extra)  # (P, V'), (V',) or None
    if sampling is None or sampling.greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)
    else:
        logp = torch.log(probs(logits.float(), sampling))  # -inf where the settings give no mass
    logp, idx = logp.topk(k, dim=-1)  # (P, k) each
    if vocab_ids is not None:
        idx = vocab_ids[idx]
    out = []
    for j, (c, lp, ids) in enumerate(zip(frontier, logp.tolist(), idx.tolist())):
        state_of[c.id] = states[j]
        for p, t in zip(lp, ids):
            if p > -math.inf:
                out.append(_Cand(next_id + len(out), c.id, t, depth + 1, c.logv + p))
    return out


def _with_copies(children: list[_Cand], frontier: list[_Cand], by_id, context, copies: NgramIndex,
                 log_conf: tuple[float, float], first_id: int) -> list[_Cand]:
    """``children`` with each frontier node's context copy: an existing child with the copy's
    token is raised to at least its parent's value + ``log_conf[0]`` (``[1]`` when the parent is
    a copy too), else the copy is added with that value."""
    out = list(children)
    for c in frontier:
        tail = _path_tokens(c, by_id, context, copies.max_tail)
        tok = copies.lookup(tail)
        if tok is None:
            continue
        floor = c.logv + log_conf[c.copy]
        same = next((x for x in out if x.parent == c.id and x.token == tok), None)
        if same is not None:
            same.logv, same.copy = max(same.logv, floor), True
        else:
            out.append(_Cand(first_id, c.id, tok, c.depth + 1, floor, copy=True))
            first_id += 1
    return out


def _path_tokens(c: _Cand, by_id, context, need: int) -> list[int]:
    """The last ``need`` tokens ending at candidate ``c``: context, root, its path."""
    path = []
    while c.id != 0:
        path.append(c.token)
        c = by_id[c.parent]
    path.append(c.token)  # the root
    path.reverse()
    if len(path) < need:
        path = list(context[-(need - len(path)):]) + path
    return path[-need:]
