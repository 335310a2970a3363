"""The scheduler interface and the per-step record it learns from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cadence.trees import CompiledTree


@dataclass
class StepInfo:
    """What one engine step did; the engine passes it to ``Scheduler.observe``."""

    tree: str  # name of the tree used
    nodes: int  # tree size including the root (width of the verify forward)
    accepted: int  # drafts accepted (committed tokens = accepted + 1)
    entropy: float  # nats, backbone entropy at the root node (its prediction of the first draft slot)
    seconds: float  # wall time of the step (draft + verify + commit)
    depth: int  # deepest node in the tree


class Scheduler(Protocol):
    def reset(self) -> None:
        """Start of a new request."""

    def choose(self) -> CompiledTree:
        """The tree for the next step."""

    def observe(self, info: StepInfo) -> None:
        """Outcome of the step just taken."""
