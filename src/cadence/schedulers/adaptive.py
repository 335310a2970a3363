"""Adaptive speculation: each step, the candidate tree of highest expected tokens per
second under the acceptance this request has shown so far (the default scheduler for
``--tree auto``), and ``adaptive-k``, the same rule over chains of 0..K heads.

Knows: a set of candidate trees with their calibrated reach (``reach[d]`` = P(accepted
length >= d+1), from the heads' acceptance table), the step cost of each (verify latency
on this machine + drafting), and the accepted length of every step of this request.
Does not know how trees are drafted or verified; it only changes which tree is drafted,
so it is lossless under every lossless rule. A candidate's predicted seconds are scaled by
what this engine's steps have really cost so far (``step_costs.StepCosts``, root and
speculative steps apart), so a latency curve that flatters speculation on this machine
is corrected after a few steps.

The calibrated table says how often drafts are right on average; a given request can be
far from average (a translation's reply is not predictable from its prompt, a code
listing repeats itself). Per depth d the scheduler keeps decayed sums (window W) of what
happened (the accepted length reached d, given it reached d-1) and of what the table
predicted for the same steps; their ratio f_d rescales the table: a tree's expected
tokens per step become ``1 + sum_d reach_d * prod_{j<=d} f_j`` (capped at 1 per depth).
When no tree beats the root alone by ``margin``, the root runs (plain decoding), and
after ``explore_every`` such steps the cheapest tree is tried once so that a request
whose text becomes predictable again gets speculation back (the interval doubles, up to
64, while tries fail).

A request starts cautiously: until one of its drafts has been accepted, only the root
and the cheapest tree are candidates. The table is an average over requests, and a
request the heads cannot predict (a translation: every draft misses) would otherwise pay
for the table's favourite, a tree of several nodes, for the few steps it takes the
factors to fall; a miss of the cheapest tree costs a fraction of that. One accepted
draft opens the whole frontier.

Shadow drafts (greedy decoding): a miss of even the cheapest tree costs its verify
width (on this CPU a 2-node step costs about 1.2 root steps). So at T = 0, until a draft
has been accepted, and instead of real tries during a run of root steps, the root runs
alone with a *shadow* draft (``Plan.shadow``): the depth-1 top candidate is drafted and
checked against the token the root's forward produces, at no verify cost. A shadow counts
as evidence for depth 1 like a real step (hit or miss against the table's top-1
acceptance). A shadow hit lets the cheapest tree run; only a real accepted draft opens the
whole frontier. Head-drafted shadows are judged ``shadow_batch`` (4) at a time in one head
call (``Plan.shadow_batch``: four cost about 1.5x one, 0.22 ms each instead of 0.57 on a
2-core EPYC; eagle's, one LM-head call over features its cache computes anyway), so every
root step can carry one; context copies are judged at once, and so is a request's first
shadow (a predictable request then speculates from its second step, not its fifth). With
``max_shadow_every`` > 1 shadows are spaced 2, 4, ... root steps apart while they miss
after the first ``first_shadows``. Replayed under this machine's step costs
(``benchmarks/prompts/tuning.jsonl``), batches of 4 on every root step beat one shadow at a
time with spacing (expected speedup over all tuning prompts 1.18 vs 1.16; translations
1.03 vs 1.01). At T > 0 the real tries above remain (a shadow would consume the request's
random stream).

Worked example: candidates root (40 ms) and a 1-draft chain (44 ms) with reach [0.7]:
expected 1.7 / 44 ms vs 1 / 40 ms -> the chain. If the drafts of this request are
accepted 10% of the time, f_1 -> 0.1 / 0.7 and the chain's value -> 1.1 / 44 ms < 1 / 40
ms -> the root, with a try of the chain after 8, 16, 32, ... root steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadence.schedulers.base import Plan, StepInfo, StepState, register
from cadence.schedulers.static import StaticScheduler
from cadence.costs.step_costs import StepCosts
from cadence.costs.tree_choice import step_seconds
from cadence.trees.budget import AUTO_NODES
from cadence.trees.tree import CompiledTree, chain, compile_tree, grow_tree, node_values


@dataclass(frozen=True)
class Candidate:
    tree: CompiledTree
    reach: tuple[float, ...]  # reach[d] = P(accepted length >= d + 1) under the calibrated table
    seconds: float  # expected seconds per step (verify latency of its size + drafting)

    @classmethod
    def of(cls, paths, table, latency, draft_s: float, num_heads: int, name: str) -> "Candidate":
        tree = compile_tree(paths, name=name)
        values = node_values(paths, table)
        reach = [0.0] * tree.max_depth
        for p, v in zip(tree.paths, values):
            reach[len(p) - 1] += v
        seconds = step_seconds(latency, tree.size, tree.max_depth, draft_s, num_heads)
        return cls(tree, tuple(min(r, 1.0) for r in reach), seconds)


SCALES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5)  # acceptance levels planned for


def frontier(table, latency, draft_s: float, num_heads: int, max_depth: int, max_budget: int = AUTO_NODES - 1,
             suffix: str = "") -> list[Candidate]:
    """The root alone plus, for each acceptance level s in ``SCALES`` (the calibrated table
    with every depth's acceptance scaled by s), the greedy growth of highest expected
    tokens/s: the trees the scheduler could ever prefer. Example: on a CPU where 3 nodes
    cost more than 4, the 2-draft tree is never among them."""
    table = [list(row) for row in table[:max_depth]]
    grown = [Candidate.of([], table, latency, draft_s, num_heads, "root")]
    for b in range(1, max_budget + 1):
        paths = grow_tree(table, b)
        if len(paths) < b:
            break
        grown.append(Candidate.of(paths, table, latency, draft_s, num_heads, f"auto-{b}{suffix}"))
    probe = AdaptiveScheduler(grown)
    kept = {grown[0].tree.name: grown[0]}
    for s in SCALES:
        f = [s] * len(table)
        best = max(grown, key=lambda c: probe.value(c, f))
        kept[best.tree.name] = best
    return sorted(kept.values(), key=lambda c: c.seconds)


def chains(table, latency, draft_s: float, num_heads: int, depth: int, suffix: str = "") -> list[Candidate]:
    """Chains of 0..depth drafts (adaptive-k's candidates)."""
    table = [list(row) for row in table[:depth]]
    return [Candidate.of(chain(k), table, latency, draft_s, num_heads, f"chain-{k}{suffix}" if k else "root")
            for k in range(depth + 1)]


class AdaptiveScheduler:
    """See the module docstring. One instance per request."""

    def __init__(self, candidates: list[Candidate], window: int = 16, explore_every: int = 8,
                 margin: float = 0.05, prior_weight: float = 1.0, max_explore_every: int = 64,
                 shadow_q: float | None = None, max_shadow_every: int = 1, first_shadows: int = 8,
                 shadow_batch: int = 4, costs: StepCosts | None = None):
        """shadow_q: the table's P(the depth-1 top candidate is accepted); set it to plan
        shadow drafts (greedy requests only), None for real tries. costs: the engine's
        observed step costs (shared by its requests; a fresh one when None)."""
        self.costs = costs if costs is not None else StepCosts()
        self.cands = sorted(candidates, key=lambda c: c.seconds)
        depth = max((len(c.reach) for c in self.cands), default=0)
        self.beta = 1.0 - 1.0 / window
        self.hits = [0.0] * depth  # decayed count of steps that reached depth d+1 (given d)
        self.expected = [0.0] * depth  # decayed sum of the calibrated chance of that
        self.prior_weight = prior_weight  # pseudo-observations at the level above's factor
        self.explore_every, self.margin = explore_every, margin
        self.base_explore, self.max_explore = explore_every, max_explore_every
        self.root_streak = 0
        self.exploring = False
        self.proven = False  # a draft of this request has been accepted: every candidate is open
        self.last: Candidate | None = None
        self.shadow_q = shadow_q if len(self.cands) > 1 else None
        self.shadow_every, self.max_shadow_every = 1, max_shadow_every
        self.shadows_left = first_shadows  # shadows before spacing them out
        self.shadow_batch = shadow_batch  # head-drafted shadows judged together (Plan.shadow_batch)
        self.first_shadow = True  # a request's first shadow is judged at once: predictable text speculates at step 2
        self.opened = False  # a draft (shadow or real) of this request would have been accepted

    def factors(self) -> list[float]:
        """f_d = observed / calibrated conditional acceptance at depth d+1, each shrunk
        towards the level above (depth 1 towards 1: the table): a level seldom reached has
        little evidence of its own, and text that defeats depth 1 rarely favours depth 2.
        Example (prior weight 1): depth 1 missed with calibrated chance 0.65 four times,
        depth 2 never reached -> f_1 = 1 / (1 + 2.6) = 0.28 and f_2 = 0.28, not 1."""
        f, above, w = [], 1.0, self.prior_weight
        for h, e in zip(self.hits, self.expected):
            above = (h + w * above) / (e + w) if e + w > 0 else above
            f.append(above)
        return f

    def value(self, c: Candidate, f: list[float]) -> float:
        """Expected tokens per second of ``c`` under the learned factors."""
        tau, scale, prev = 1.0, 1.0, 1.0
        for d, r in enumerate(c.reach):
            scale *= f[d]
            prev = min(r * scale, prev)  # reaching d+1 is never likelier than reaching d
            tau += prev
        return tau / (c.seconds * self.costs.factor(c.tree.size > 1))

    def choose(self, state: StepState) -> Plan:
        f = self.factors()
        root = self.cands[0]
        best, best_v = root, self.value(root, f) * (1.0 + self.margin)
        for c in (self.cands[1:] if self.proven else self.cands[1:2]):
            v = self.value(c, f)
            if v > best_v:
                best, best_v = c, v
        self.exploring = False
        if self.shadow_q is not None and (best is root or not self.opened):
            self.last = root
            self.root_streak += 1
            if self.root_streak >= self.shadow_every:
                self.root_streak = 0
                first, self.first_shadow = self.first_shadow, False
                return Plan(root.tree, shadow=True, shadow_batch=1 if first else self.shadow_batch)
            return Plan(root.tree)
        if best is root and len(self.cands) > 1:
            self.root_streak += 1
            if self.root_streak >= self.explore_every:
                self.root_streak, best, self.exploring = 0, self.cands[1], True
        else:
            self.root_streak = 0
        self.last = best
        return Plan(best.tree)

    def _observe_shadow(self, hit: bool) -> None:
        """A shadow draft: depth-1 evidence at the table's top-1 acceptance."""
        self.opened = self.opened or hit
        self.shadows_left -= 1
        if hit or self.shadows_left > 0:
            self.shadow_every = 1
        else:
            self.shadow_every = min(2 * self.shadow_every, self.max_shadow_every)
        self.hits[0] = self.beta * self.hits[0] + hit
        self.expected[0] = self.beta * self.expected[0] + self.shadow_q

    def observe(self, info: StepInfo) -> None:
        c = self.last
        if c is not None and info.rows == 1 and not info.shadows:  # this step's own, plain cost
            self.costs.record(c.tree.size > 1, info.seconds, c.seconds)
        if self.shadow_q is not None:
            for hit in info.shadows:
                self._observe_shadow(hit)
        if c is None or not c.reach:
            return
        self.proven = self.proven or info.accepted > 0
        self.opened = self.opened or self.proven
        if self.exploring:  # back off while tries keep failing: 8, 16, 32, ... root steps
            self.explore_every = (self.base_explore if info.accepted else
                                  min(2 * self.explore_every, self.max_explore))
        prev = 1.0
        for d in range(min(len(c.reach), info.depth)):  # levels that were verified
            if info.accepted < d:
                break
            q = c.reach[d] / prev if prev > 0 else 0.0  # calibrated P(reach d+1 | reached d)
            self.hits[d] = self.beta * self.hits[d] + (info.accepted >= d + 1)
            self.expected[d] = self.beta * self.expected[d] + q
            prev = c.reach[d]


def _tables(ctx, sampling):
    """(acceptance table, deepest level, name suffix) for this request's sampling."""
    policy = ctx.policy
    copying = ctx.drafter.copy is not None
    return policy.table(copying), ctx.drafter.max_depth(sampling), "+copy" if copying else ""


def _builder(make_candidates):
    def build(ctx):
        cache: dict = {}
        costs = StepCosts()  # shared by this engine's requests

        def factory(sampling):
            table, depth, suffix = _tables(ctx, sampling)
            if table is None or ctx.policy.latency is None:  # uncalibrated heads: static tree
                return StaticScheduler(ctx.policy.tree_for(sampling))
            key = (suffix, depth)
            if key not in cache:
                cache[key] = make_candidates(ctx, table, depth, suffix)
            shadow_q = table[0][0] if sampling.greedy and table and table[0] else None
            return AdaptiveScheduler(cache[key], margin=ctx.policy.margin, shadow_q=shadow_q, costs=costs)
        return factory
    return build


build_adaptive = register("adaptive", lossy=False,
                          help="each step the tree of highest expected tokens/s under the acceptance seen so far in "
                               "the request (calibrated table x this machine's verify latency; lossless)")(
    _builder(lambda ctx, table, depth, suffix: frontier(
        table, ctx.policy.latency, ctx.policy.draft_s, ctx.heads.K, depth, suffix=suffix)))

register("adaptive-k", lossy=False,
         help="each step how many heads to engage (a chain of 0..K drafts) to maximise expected "
              "tokens/s from per-depth acceptance seen so far and measured latency (lossless)")(
    _builder(lambda ctx, table, depth, suffix: chains(
        table, ctx.policy.latency, ctx.policy.draft_s, ctx.heads.K, min(depth, ctx.heads.K), suffix)))
