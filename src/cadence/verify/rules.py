"""Acceptance rules: pure functions from (tree, draft tokens, backbone logits) to a verdict.

Every rule has the signature ``rule(tree, tokens, logits, ctx) -> Verdict``:
  tree    CompiledTree with N+1 nodes (node 0 = root, the backbone's own token)
  tokens  (N+1,) long, token of each node
  logits  (N+1, V) backbone logits at each node (predicting that node's children)
  ctx     VerifyContext: sampling parameters, the drafts' distributions q, an RNG

The verdict names the accepted nodes (root first) and the bonus token: the
backbone's own token after the last accepted node, which roots the next step.
Lossless: ``greedy`` (T = 0) and ``speculative`` (T > 0). Lossy, opt-in: ``typical`` and
``relaxed`` (chain-aware, bounded drift; ``relaxed`` with drift 0 is ``greedy``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch

from cadence.errors import CadenceError
from cadence.verify.sampling import SamplingParams, argmax, entropy, probs, sample, uniform
from cadence.trees.tree import CompiledTree


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, starting with the root (0)
    bonus: int  # the backbone's token after the last accepted node


@dataclass
class VerifyContext:
    sampling: SamplingParams = SamplingParams()  # how the backbone samples
    q: torch.Tensor | None = None  # (N+1, V): q[n] = distribution node n's children were drawn from
    generator: torch.Generator | None = None  # RNG for acceptance tests and residual draws
    typical_eps: float = 0.09  # typical: hard threshold
    typical_alpha: float = 0.3  # typical: entropy-scaled threshold
    drift: float = 1.0  # relaxed: budget DELTA on the cumulative log-prob gap of an accepted chain (nats)
    top_m: int = 3  # relaxed: a draft must be within the backbone's top-M at its parent
    fixed: frozenset = frozenset()  # nodes proposed as a point mass, not drawn from q (context copies)

    def __post_init__(self):
        if not isinstance(self.top_m, int) or isinstance(self.top_m, bool) or self.top_m < 1:
            raise CadenceError(f"--top-m must be an integer >= 1, got {self.top_m!r}")
        if not (self.drift >= 0 and math.isfinite(self.drift)):  # also refuses NaN
            raise CadenceError(f"--drift must be a finite number >= 0, got {self.drift!r}")


def greedy(tree: CompiledTree, tokens: torch.Tensor, logits: torch.Tensor, ctx: VerifyContext) -> Verdict:
    """Accept a child iff its token is the argmax at its parent; first matching sibling wins.

    Example: tokens [r, a, b, c] for paths [(0,), (1,), (0,0)], argmax per node
    [b, c, _, _]: node 1 (a) != b, node 2 (b) == b -> accept 2; node 2 has no children,
    so path [0, 2] and bonus = argmax at node 2.
    """
    best = argmax(logits).tolist()
    toks = tokens.tolist()
    node, path = 0, [0]
    while True:
        nxt = next((c for c in tree.children[node] if toks[c] == best[node]), None)
        if nxt is None:
            return Verdict(path, best[node])
        node = nxt
        path.append(node)


def speculative(tree: CompiledTree, tokens: torch.Tensor, logits: torch.Tensor, ctx: VerifyContext) -> Verdict:
    """Lossless speculative sampling over a tree (multi-candidate recursive rejection).

    At a node with backbone distribution p and children x_1..x_m, child i proposed from
    q_i: residual r = p; for each child i, accept with prob min(1, r(x_i)/q_i(x_i)); else
    r <- norm(max(0, r - q_i)). If every child is rejected, the bonus is drawn from r.
    Each round is one speculative-sampling step towards r, so the emitted token is
    distributed exactly as p (SpecInfer / EAGLE) whenever x_i is drawn from q_i
    independently of the earlier rounds' tests. q_i is ``ctx.q[node]`` (children drawn by the
    heads), or a point mass on x_i for the nodes in ``ctx.fixed`` (context copies) and for
    every node without q (a deterministic drafter): a point mass on x is accepted with
    probability r(x) and, rejected, leaves r without x.

    Example: p = (.6, .3, .1), a copy of token 1 then a head draw from q = (1, 0, 0) (the heads
    drew it with the copy's token excluded): the copy is accepted w.p. .3; else r = (6/7, 0,
    1/7) and the draw, token 0, is accepted w.p. 6/7; else the bonus is token 2. Token 0:
    .7 * 6/7 = .6, token 1: .3, token 2: .7 * 1/7 = .1 = p.
    With greedy sampling this reduces to ``greedy``.
    """
    if ctx.sampling.greedy:
        return greedy(tree, tokens, logits, ctx)
    toks = tokens.tolist()
    node, path = 0, [0]
    while True:
        r = probs(logits[node], ctx.sampling)
        accepted = None
        for c in tree.children[node]:
            x = toks[c]
            point = ctx.q is None or c in ctx.fixed
            q = None if point else ctx.q[node]
            ratio = float(r[x]) if point else float(r[x]) / max(float(q[x]), 1e-20)
            u = uniform(ctx.generator)
            if u < min(1.0, ratio):
                accepted = c
                break
            if point:  # max(0, r - onehot(x)) without building the one-hot: r[x] <= 1 becomes 0
                r[x] = 0.0
            else:
                r = torch.clamp(r - q, min=0)
            total = float(r.sum())
            if total <= 1e-12:  # p == q where it matters: any draw from q is fine, fall back to p
                r = probs(logits[node], ctx.sampling)
                break
            r = r / total
        if accepted is None:
            return Verdict(path, sample(r, ctx.generator))
        node = accepted
        path.append(node)


def unverified(tree: CompiledTree, tokens: torch.Tensor, logits: torch.Tensor, ctx: VerifyContext) -> Verdict:
    """Commit the drafted top chain without checking it (LOSSY; only for schedulers whose
    plan says ``verify=False``, e.g. CLP's unverified mode): follow each node's first child
    to a leaf. The bonus is still the backbone's own token after the last node (argmax,
    or a sample at T > 0), since the forward that fills the cache computes it anyway.

    Example: paths [(0,), (1,), (0, 0)] -> path [0, 1, 3] whatever the logits say."""
    node, path = 0, [0]
    while tree.children[node]:
        node = tree.children[node][0]
        path.append(node)
    last = logits[node]
    bonus = int(argmax(last)) if ctx.sampling.greedy else sample(probs(last, ctx.sampling), ctx.generator)
    return Verdict(path, bonus)


def typical(tree: CompiledTree, tokens: torch.Tensor, logits: torch.Tensor, ctx: VerifyContext) -> Verdict:
    """Medusa's typical acceptance (lossy): accept x iff p(x) > min(eps, alpha * exp(-H(p))).

    p is the backbone's softmax at temperature T (T = 1 when decoding greedily). Among acceptable siblings the first in rank order is taken; the
    bonus is the argmax (T = 0) or a sample from p.
    """
    temp = ctx.sampling.temperature if ctx.sampling.temperature > 0 else 1.0
    p_all = torch.softmax(logits.float() / temp, dim=-1)
    h = entropy(logits.float() / temp)
    thresh = torch.minimum(torch.full_like(h, ctx.typical_eps), ctx.typical_alpha * torch.exp(-h))
    toks = tokens.tolist()
    node, path = 0, [0]
    while True:
        nxt = next((c for c in tree.children[node] if float(p_all[node, toks[c]]) > float(thresh[node])), None)
        if nxt is None:
            if ctx.sampling.greedy:
                return Verdict(path, int(argmax(logits[node])))
            return Verdict(path, sample(probs(logits[node], ctx.sampling), ctx.generator))
        node = nxt
        path.append(node)


def relaxed(tree: CompiledTree, tokens: torch.Tensor, logits: torch.Tensor, ctx: VerifyContext) -> Verdict:
    """Chain-aware relaxed acceptance (LOSSY, opt-in; docs/methods.md section 4).

    With ``g(x) = log p_B(argmax) - log p_B(x) >= 0`` the gap of token x at its parent,
    a draft x_j at depth j is acceptable iff
      * x_j is the argmax at its parent (gap 0, always acceptable, as in ``greedy``), or
      * x_j is in the backbone's top-M at its parent (``ctx.top_m``; ties included: fewer
        than M tokens have a strictly larger logit) and the cumulative gap
        along the path ``D_j = sum_{i<=j} g(x_i)`` stays ``<= ctx.drift`` (DELTA, nats),
        with DELTA > 0.
    A token other than the argmax is never free: even one whose logit ties the argmax's
    is refused at DELTA = 0, so DELTA = 0 is ``greedy`` exactly, tie-breaking included.
    The budget bounds the drift of the whole accepted chain, not of one token.

    Among acceptable siblings the one with the **smallest gap** is taken (ties: rank
    order, i.e. the drafter's order). So the argmax child wins whenever it is drafted
    (output stays as close to greedy as the tree allows and no budget is spent), and a
    sub-argmax draft is taken only when no sibling has the backbone's own token.

    Gaps are differences of raw logits (the log-softmax normalizer cancels), so no
    softmax is computed at T = 0; the top-M test is a ``topk(M)`` per visited parent.
    They are measured on the backbone's untempered distribution at every temperature,
    so DELTA means the same thing at T = 0 and T > 0.

    Bonus: the argmax at the last accepted node (T = 0). At T > 0 the same deterministic
    test is applied to the drafts (which the drafter sampled), a draft must also lie in
    the support of the backbone's tempered / top-p / top-k filtered distribution, and the
    bonus is a sample from that distribution at the last accepted node (no residual:
    nothing corrects for the accepted drafts, so the output distribution is not the
    backbone's; only the drift bound holds).

    Worked example, M = 3, DELTA = 1.0; a chain root -> 1 -> 2 -> 3 with tokens
    [r, a, b, c]. At the root the logits rank (x: 2.0, a: 1.6, ...): a is rank 2,
    g(a) = 0.4, D_1 = 0.4 <= 1 -> accept node 1. At node 1, b is the argmax: g = 0,
    D_2 = 0.4 -> accept node 2. At node 2 the ranks are (y: 3.0, z: 2.9, c: 2.5): c is
    in the top-3 but D_3 = 0.4 + 0.5 = 0.9 <= 1 -> accept node 3; path [0, 1, 2, 3], bonus =
    argmax at node 3. With DELTA = 0.8 the chain stops at node 2 (0.9 > 0.8): path
    [0, 1, 2], bonus y. With DELTA = 0 it stops at the root (a is not the argmax):
    path [0], bonus x, exactly ``greedy``.
    """
    toks = tokens.tolist()
    delta, m = float(ctx.drift), int(ctx.top_m)
    sampling = ctx.sampling
    if not sampling.greedy and sampling.top_k > 0:
        m = min(m, sampling.top_k)  # same ranking: the top-k filter keeps the top-min(M, k)
    node, path, spent = 0, [0], 0.0
    while True:
        row = logits[node]
        kids = tree.children[node]
        p_t = None if sampling.greedy else probs(row, sampling)
        nxt, nxt_gap = None, math.inf
        if kids:
            best = int(argmax(row))
            relax = delta > 0 and m > 1
            if relax:  # the M-th largest logit: x is in the top-M iff its logit reaches it
                top = row.float().topk(min(m, row.shape[-1])).values
                best_logit, floor = float(top[0]), float(top[-1])
            for c in kids:
                x = toks[c]
                if x == best:  # free, and nothing beats it (not even a sibling tied with it)
                    nxt, nxt_gap = c, 0.0
                    break
                if not relax:
                    continue
                lx = float(row[x])
                gap = max(best_logit - lx, 0.0)
                if lx < floor or spent + gap > delta:
                    continue
                if p_t is not None and float(p_t[x]) <= 0.0:
                    continue  # outside the sampling support at T > 0
                if gap < nxt_gap:
                    nxt, nxt_gap = c, gap
        if nxt is None:
            bonus = int(argmax(row)) if p_t is None else sample(p_t, ctx.generator)
            return Verdict(path, bonus)
        node = nxt
        spent += nxt_gap
        path.append(node)


class Rule(str, Enum):
    """Verification rules selectable by name (CLI ``--rule``)."""

    AUTO = "auto"  # greedy at T=0, speculative sampling otherwise (both lossless)
    GREEDY = "greedy"  # T = 0 only
    SPECULATIVE = "speculative"
    TYPICAL = "typical"  # lossy
    RELAXED = "relaxed"  # lossy: chain-aware, cumulative drift <= --drift within --top-m (drift 0 = greedy)

    def __str__(self) -> str:
        return self.value

    def lossless(self, sampling: SamplingParams) -> bool:
        """Whether this rule reproduces plain decoding under ``sampling`` (byte-identical
        at T = 0, distribution-identical at T > 0)."""
        if self in (Rule.TYPICAL, Rule.RELAXED):
            return False
        return sampling.greedy or self is not Rule.GREEDY

    def check(self, sampling: SamplingParams) -> None:
        """Refuse combinations that would silently decode something else."""
        if self is Rule.GREEDY and not sampling.greedy:
            raise CadenceError(f"--rule greedy needs --temperature 0 (got {sampling.temperature}); "
                               "use --rule auto or speculative to sample losslessly")


RuleFn = Callable[[CompiledTree, torch.Tensor, torch.Tensor, VerifyContext], Verdict]
RULES: dict[Rule, RuleFn] = {Rule.AUTO: speculative, Rule.GREEDY: greedy,
                             Rule.SPECULATIVE: speculative, Rule.TYPICAL: typical,
                             Rule.RELAXED: relaxed}
