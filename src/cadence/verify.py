"""Acceptance rules: pure functions from (tree, draft tokens, backbone logits) to a verdict.

Every rule has the signature ``rule(tree, tokens, logits, ctx) -> Verdict``:
  tree    CompiledTree with N+1 nodes (node 0 = root, the backbone's own token)
  tokens  (N+1,) long, token of each node
  logits  (N+1, V) backbone logits at each node (predicting that node's children)
  ctx     VerifyContext: sampling parameters, the drafts' distributions q, an RNG

The verdict names the accepted nodes (root first) and the bonus token: the
backbone's own token after the last accepted node, which roots the next step.
Lossless: ``greedy`` (T = 0) and ``speculative`` (T > 0). Lossy, opt-in: ``typical``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch

from cadence.errors import CadenceError
from cadence.sampling import SamplingParams, entropy, probs, sample, uniform
from cadence.trees import CompiledTree


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


def greedy(tree: CompiledTree, tokens: torch.Tensor, logits: torch.Tensor, ctx: VerifyContext) -> Verdict:
    """Accept a child iff its token is the argmax at its parent; first matching sibling wins.

    Example: tokens [r, a, b, c] for paths [(0,), (1,), (0,0)], argmax per node
    [b, c, _, _]: node 1 (a) != b, node 2 (b) == b -> accept 2; node 2 has no children,
    so path [0, 2] and bonus = argmax at node 2.
    """
    best = logits.argmax(-1).tolist()
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

    At a node with backbone distribution p and children x_1..x_m drawn from q:
    residual r = p; for each child i, accept with prob min(1, r(x_i)/q(x_i)); else
    r <- norm(max(0, r - q)). If every child is rejected, the bonus is drawn from r.
    Each child is an independent draw from q, so the emitted token is distributed
    exactly as p (SpecInfer / EAGLE). With greedy sampling this reduces to ``greedy``.
    """
    if ctx.sampling.greedy:
        return greedy(tree, tokens, logits, ctx)
    toks = tokens.tolist()
    node, path = 0, [0]
    while True:
        r = probs(logits[node], ctx.sampling)
        accepted = None
        for c in tree.children[node]:
            q = ctx.q[node] if ctx.q is not None else torch.nn.functional.one_hot(
                tokens[c], r.shape[-1]).float()
            x = toks[c]
            ratio = float(r[x]) / max(float(q[x]), 1e-20)
            u = uniform(ctx.generator)
            if u < min(1.0, ratio):
                accepted = c
                break
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
    bonus = int(last.argmax()) if ctx.sampling.greedy else sample(probs(last, ctx.sampling), ctx.generator)
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
                return Verdict(path, int(logits[node].argmax()))
            return Verdict(path, sample(probs(logits[node], ctx.sampling), ctx.generator))
        node = nxt
        path.append(node)


class Rule(str, Enum):
    """Verification rules selectable by name (CLI ``--rule``)."""

    AUTO = "auto"  # greedy at T=0, speculative sampling otherwise (both lossless)
    GREEDY = "greedy"  # T = 0 only
    SPECULATIVE = "speculative"
    TYPICAL = "typical"  # lossy

    def __str__(self) -> str:
        return self.value

    def lossless(self, sampling: SamplingParams) -> bool:
        """Whether this rule reproduces plain decoding under ``sampling`` (byte-identical
        at T = 0, distribution-identical at T > 0)."""
        if self is Rule.TYPICAL:
            return False
        return sampling.greedy or self is not Rule.GREEDY

    def check(self, sampling: SamplingParams) -> None:
        """Refuse combinations that would silently decode something else."""
        if self is Rule.GREEDY and not sampling.greedy:
            raise CadenceError(f"--rule greedy needs --temperature 0 (got {sampling.temperature}); "
                               "use --rule auto or speculative to sample losslessly")


RuleFn = Callable[[CompiledTree, torch.Tensor, torch.Tensor, VerifyContext], Verdict]
RULES: dict[Rule, RuleFn] = {Rule.AUTO: speculative, Rule.GREEDY: greedy,
                             Rule.SPECULATIVE: speculative, Rule.TYPICAL: typical}
