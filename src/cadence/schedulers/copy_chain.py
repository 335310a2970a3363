"""How deep a chain of copies pays, step by step (``--method ngram``, ``--tree auto``).

The ``ngram`` drafter has no confidence of its own: each level of its chain holds the token
that followed the same n-gram earlier (``draft.context_copy``, and with ``--datastore`` the
model's earlier replies, ``draft.datastore``). A chain of d copies is worth
``1 + a + a^2 + ... + a^d`` expected tokens per step when each copy is accepted with
probability ``a`` given its parent, and costs ``T(d + 1)`` to verify (this machine's verify
latency curve, ``costs.latency``). Where verify is flat (bf16 on AMX) the deepest chain pays;
where it is steep (a GGUF model on its integer kernels) a chain of 8 costs what it brings,
so the chain stops where the ratio peaks.

``a`` is this request's own rate: each verified chain of copies contributes its accepted
copies as successes and the copy that broke the chain (when one did) as a failure, with an
exponential decay (``decay``) so a request that starts copying (a long quote) is followed,
from a prior of ``prior`` successes in ``2 * prior`` trials at 0.5.

Worked example, T(n)/T(1) = 1.00, 1.09, 1.12, 1.10, 1.30, 1.50, 1.71 for n = 1..7 nodes and
a = 0.6: depth 1 gives 1.6 / 1.09 = 1.47, depth 2 1.96 / 1.12 = 1.75, depth 3 2.18 / 1.10 =
1.98, depth 4 2.31 / 1.30 = 1.77: the chain is 3 copies. At a = 0.9 it is 4 (4.10 / 1.30 =
3.15 against 3.13 at depth 3); on a flat curve, ``max_depth``.

Lossless: only how many copies are verified changes. Knows: the latency curve and the step
results. Does not know where copies come from.
"""

from __future__ import annotations

from typing import Callable

from cadence.schedulers.base import Plan, StepInfo, StepState
from cadence.trees.tree import CompiledTree, chain, compile_tree


def best_depth(a: float, latency: Callable[[int], float], max_depth: int) -> int:
    """The chain depth 1..max_depth of most expected tokens per second (module docstring)."""
    best, best_rate, value, term = 1, -1.0, 1.0, 1.0
    for d in range(1, max_depth + 1):
        term *= a
        value += term
        rate = value / max(latency(d + 1), 1e-12)
        if rate > best_rate:
            best, best_rate = d, rate
    return best


class CopyChainScheduler:
    """A chain of copies as deep as this request's copy acceptance and the latency curve pay."""

    def __init__(self, latency: Callable[[int], float], max_depth: int, prior: float = 2.0, decay: float = 0.95,
                 name: str = "ngram"):
        if max_depth < 1:
            raise ValueError(f"a copy chain needs max_depth >= 1, got {max_depth}")
        self.latency = latency  # seconds to verify n nodes on this machine
        self.max_depth = max_depth  # deepest chain (--copy-depth)
        self.decay = decay  # weight kept by the earlier observations at each step
        self.hits, self.trials = prior, 2 * prior  # decayed successes and trials of single copies
        self.name = name  # trees are named name-D
        self._trees: dict[int, CompiledTree] = {}

    @property
    def rate(self) -> float:
        """This request's estimated acceptance of a copy given its parent's."""
        return self.hits / self.trials

    def choose(self, state: StepState) -> Plan:
        d = best_depth(self.rate, self.latency, self.max_depth)
        if d not in self._trees:
            self._trees[d] = compile_tree(chain(d), name=f"{self.name}-{d}")
        return Plan(self._trees[d])

    def observe(self, info: StepInfo) -> None:
        proposed = info.nodes - 1  # copies verified this step (the drafter drops levels without one)
        if proposed <= 0:
            return
        broke = 1 if info.accepted < proposed else 0
        self.hits = self.hits * self.decay + info.accepted
        self.trials = self.trials * self.decay + info.accepted + broke
