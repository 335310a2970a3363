"""One tree for the whole generation (the Medusa / Hydra baselines)."""

from __future__ import annotations

from cadence.schedulers.base import StepInfo
from cadence.trees import CompiledTree, compile_tree, preset


class StaticScheduler:
    def __init__(self, tree: CompiledTree):
        self.tree = tree

    @classmethod
    def from_preset(cls, name: str, num_heads: int) -> "StaticScheduler":
        return cls(compile_tree(preset(name, num_heads), name=name))

    def reset(self) -> None:
        pass

    def choose(self) -> CompiledTree:
        return self.tree

    def observe(self, info: StepInfo) -> None:
        pass
