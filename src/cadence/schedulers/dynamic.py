"""EAGLE-2's dynamic tree as a scheduler: every step that speculates, the drafter grows the
tree from its own confidence and the verify-latency curve of this machine cuts it
(``draft.grow``).

*Whether* a step speculates is the ``adaptive`` scheduler's call (on calibrated heads): it
runs the root alone, with shadow drafts, while this request's drafts do not pay (a
translation), and tries again later; when it would speculate, the step's tree is the
dynamic one instead of its static candidate. Its acceptance factors then measure the
dynamic trees against the static candidate's calibrated reach, a proxy for how
predictable the request is. Uncalibrated heads (no acceptance table or latency curve)
speculate every step.

Lossless: only which drafts are verified changes. At T > 0 a request runs what ``adaptive``
(or ``--tree``) plans: trees of i.i.d. draws from q. With ``--dyn-sampled`` it grows the
dynamic tree from the drafter's distribution under its sampling settings instead, every node
verified as a point-mass proposal (``draft.grow``; exact too), which measured slower on
the Zen 4 EPYC (2026-12-03, e9a3866, T = 0.7, 40 prompts: hydra 1.26x against 1.53x, eagle-taps
1.40x against 1.53x): larger trees for a tau that rose less than their cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cadence.draft.grow import DynamicTree
from cadence.errors import CadenceError
from cadence.schedulers.adaptive import build_adaptive
from cadence.schedulers.base import Plan, StepInfo, StepState, register
from cadence.schedulers.static import StaticScheduler
from cadence.trees.budget import check_nodes
from cadence.trees.tree import compile_tree

@dataclass(frozen=True)
class DynamicOptions:
    """Settings of the ``dynamic`` scheduler; CLI flags and method-name options derive from them."""

    dyn_topk: int = field(default=4, metadata={
        "help": "dynamic scheduler: children per expanded node and nodes expanded per level (EAGLE-2's top-k)"})
    max_nodes: int = field(default=64, metadata={
        "help": "the node budget: most draft nodes a dynamic tree verifies per step, the root excluded (at most "
                "cadence.trees.budget.MAX_NODES - 1); this machine's verify latency curve cuts each step's tree to "
                "the size that pays (fewer nodes), so the cap rarely binds"})
    dyn_depth: int = field(default=0, metadata={
        "help": "dynamic scheduler: levels the heads draft (0 = their K); eagle's layer serves any depth, "
                "other heads stop at K"})
    dyn_sampled: bool = field(default=False, metadata={
        "help": "dynamic scheduler at T > 0: grow dynamic trees verified as point masses (lossless) instead of "
                "adaptive's trees of i.i.d. draws from q (slower on the Zen 4 EPYC, 2026-12-03: hydra 1.26x "
                "against 1.53x at T = 0.7)"})
    copy_conf: float = field(default=0.4, metadata={
        "help": "dynamic scheduler: a context copy's value relative to its parent (at least; the heads' "
                "probability when higher)"})
    copy_run_conf: float = field(default=0.7, metadata={
        "help": "dynamic scheduler: the same for a copy whose parent is a copy (a copied run tends to go on)"})


MARK = compile_tree([], name="dynamic")  # the plan's nominal tree: the drafter grows the real one


class CopyTrust:
    """This request's estimate of how often a context copy is accepted (given its parent was),
    first copies and copied runs apart: the spec's ``copy_conf`` / ``copy_run_conf`` are a
    prior worth ``prior`` observations. Copies pay in a code listing that repeats itself and
    hardly in an essay, so the value they get in the tree follows what this request shows.

    Example: copy_conf 0.4, prior 4, then 6 first copies of which 0 accepted -> 1.6 / 10 = 0.16."""

    def __init__(self, spec: DynamicTree, prior: float = 4.0):
        self.base = spec
        self.n = [prior, prior]  # observations of first copies, copied runs (prior included)
        self.hits = [prior * spec.copy_conf, prior * spec.copy_run_conf]

    def observe(self, copies) -> None:
        for run, accepted in copies:
            self.n[run] += 1
            self.hits[run] += accepted

    def spec(self) -> DynamicTree:
        first, run = (max(h / n, 0.01) for h, n in zip(self.hits, self.n))
        return replace(self.base, copy_conf=first, copy_run_conf=run)


class DynamicScheduler:
    def __init__(self, spec: DynamicTree):
        self.trust = CopyTrust(spec)

    def choose(self, state: StepState) -> Plan:
        return Plan(MARK, dynamic=self.trust.spec())

    def observe(self, info: StepInfo) -> None:
        self.trust.observe(info.copies)


class GatedDynamic:
    """``adaptive`` decides whether to speculate; a speculating step drafts a dynamic tree."""

    def __init__(self, gate, spec: DynamicTree):
        self.gate, self.trust = gate, CopyTrust(spec)

    def choose(self, state: StepState) -> Plan:
        plan = self.gate.choose(state)
        if plan.tree.size == 1:
            return plan
        # the gate's candidate, renamed: reports name the plan "dynamic", not a static tree that never runs
        return replace(plan, tree=compile_tree(plan.tree.paths, name="dynamic"), dynamic=self.trust.spec())

    def observe(self, info: StepInfo) -> None:
        self.gate.observe(info)
        self.trust.observe(info.copies)


def dynamic_spec(ctx) -> DynamicTree:
    """The ``DynamicTree`` of the scheduler's options (``--dyn-topk``, ``--max-nodes``, ``--dyn-depth``,
    ``--copy-conf``, ``--copy-run-conf``) with this machine's verify latency and drafting cost
    from the tree policy."""
    s = ctx.options
    if s.dyn_topk < 1 or s.dyn_depth < 0:
        raise CadenceError(f"--dyn-topk must be >= 1 and --dyn-depth >= 0 (got {s.dyn_topk}, {s.dyn_depth})")
    check_nodes(s.max_nodes + 1, "--max-nodes", drafts=True)
    for name, v in (("--copy-conf", s.copy_conf), ("--copy-run-conf", s.copy_run_conf)):
        if not 0.0 < v <= 1.0:
            raise CadenceError(f"{name} must be in (0, 1], got {v}")
    policy = ctx.policy
    return DynamicTree(topk=s.dyn_topk, max_nodes=s.max_nodes, depth=s.dyn_depth, copy_conf=s.copy_conf,
                       copy_run_conf=s.copy_run_conf,
                       latency=policy.latency, level_s=policy.draft_s)


@register("dynamic", lossy=False, help="EAGLE-2 dynamic tree: each greedy step's tree grown from the drafter's "
                                       "confidence and cut by this machine's verify latency; adaptive decides "
                                       "when to speculate (lossless; T > 0 runs adaptive's trees unless "
                                       "--dyn-sampled)", options=DynamicOptions)
def build_dynamic(ctx):
    spec = dynamic_spec(ctx)
    gate = build_adaptive(ctx)

    def factory(sampling):
        inner = gate(sampling)
        if not sampling.greedy and not ctx.options.dyn_sampled:
            return inner
        if isinstance(inner, StaticScheduler):  # uncalibrated heads: speculate every step
            return DynamicScheduler(spec)
        return GatedDynamic(inner, spec)
    return factory
