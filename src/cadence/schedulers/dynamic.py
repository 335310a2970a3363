"""EAGLE-2's dynamic tree as a scheduler: every greedy step, the drafter grows the tree from
its own confidence and the verify-latency curve of this machine cuts it (``dynamic_tree``).

Lossless: only which drafts are verified changes. At T > 0 the request runs the static
tree of ``--tree`` (a dynamic tree picks candidates by draft probability, not by drawing
them from q, which lossless speculative sampling needs).
"""

from __future__ import annotations

from cadence.dynamic_tree import DynamicTree
from cadence.errors import CadenceError
from cadence.schedulers.base import Plan, StepInfo, StepState
from cadence.schedulers.registry import register
from cadence.schedulers.static import StaticScheduler
from cadence.trees import compile_tree

MARK = compile_tree([], name="dynamic")  # the plan's nominal tree: the drafter grows the real one


class DynamicScheduler:
    def __init__(self, spec: DynamicTree):
        self.plan = Plan(MARK, dynamic=spec)

    def choose(self, state: StepState) -> Plan:
        return self.plan

    def observe(self, info: StepInfo) -> None:
        pass


def dynamic_spec(ctx) -> DynamicTree:
    """The ``DynamicTree`` of the method spec (``--dyn-topk``, ``--dyn-nodes``, ``--copy-conf``,
    ``--copy-run-conf``)
    with this machine's verify latency and drafting cost from the tree policy."""
    s = ctx.spec
    if s.dyn_topk < 1 or s.dyn_nodes < 1:
        raise CadenceError(f"--dyn-topk and --dyn-nodes must be >= 1 (got {s.dyn_topk}, {s.dyn_nodes})")
    for name, v in (("--copy-conf", s.copy_conf), ("--copy-run-conf", s.copy_run_conf)):
        if not 0.0 < v <= 1.0:
            raise CadenceError(f"{name} must be in (0, 1], got {v}")
    policy = ctx.policy
    return DynamicTree(topk=s.dyn_topk, max_nodes=s.dyn_nodes, copy_conf=s.copy_conf, copy_run_conf=s.copy_run_conf,
                       latency=policy.latency, level_s=policy.draft_s)


@register("dynamic", lossy=False, help="EAGLE-2 dynamic tree: each greedy step's tree grown from the drafter's "
                                       "confidence and cut by this machine's verify latency (lossless; "
                                       "T > 0 runs --tree)")
def build_dynamic(ctx):
    spec = dynamic_spec(ctx)
    policy = ctx.policy
    return lambda sampling: (DynamicScheduler(spec) if sampling.greedy
                             else StaticScheduler(policy.tree_for(sampling)))
