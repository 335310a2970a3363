"""One tree for the whole generation (the Medusa / Hydra baselines)."""

from __future__ import annotations

from cadence.schedulers.base import Plan, StepInfo, StepState, register
from cadence.trees.tree import CompiledTree, compile_tree, preset


class StaticScheduler:
    def __init__(self, tree: CompiledTree):
        self.plan = Plan(tree)

    @classmethod
    def from_preset(cls, name: str, max_depth: int) -> "StaticScheduler":
        return cls(compile_tree(preset(name, max_depth), name=name))

    def choose(self, state: StepState) -> Plan:
        return self.plan

    def observe(self, info: StepInfo) -> None:
        pass


@register("static", lossy=False, help="one tree for the whole generation: --tree (lossless)")
def build_static(ctx):
    policy = ctx.policy
    return lambda sampling: StaticScheduler(policy.tree_for(sampling))
