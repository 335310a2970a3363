"""Which static tree a request runs, resolved per request from its sampling settings.

Knows: the ``--tree`` names (presets, ``auto``, ``auto-N``), the heads' acceptance
tables (with and without context copy), the verify-latency curve of this machine and
the drafting cost, and how to weigh them. Does not know how trees are drafted or
verified.

Context copies reach deeper than K, so a request with copies may run a copy tree deeper
than K, grown from the heads' table with copies; one without runs a tree of the heads
alone. At T > 0 the tables (measured at T = 0) are an optimistic guide: the adaptive
schedulers correct them from what each request accepts.

``auto`` picks, among the trees grown greedily from the acceptance table for every
node budget (and the root alone, i.e. plain decoding), the one with the highest
expected tokens per second, ``expected_tau / (verify(n) + draft)``, using the verify
latency measured on this machine (``cadence.costs.latency``). Speculation must beat plain
decoding by ``margin`` in expectation, else the root alone runs: the engine is never
planned to be slower than vanilla.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from cadence.errors import CadenceError
from cadence.costs.latency import LatencyCurve
from cadence.verify.sampling import SamplingParams
from cadence.trees.budget import AUTO_NODES
from cadence.trees.tree import CompiledTree, chain, compile_tree, expected_tau, grow_tree, preset

@dataclass
class Choice:
    """A tree with its expected value under a table and a latency model."""

    paths: list  # draft paths (empty = the root alone)
    tau: float  # expected tokens per step
    seconds: float  # expected seconds per step
    speedup: float  # expected tokens/s over the root alone


def step_seconds(latency: LatencyCurve, size: int, depth: int, draft_s: float, num_heads: int) -> float:
    """Expected seconds of one step on a tree of ``size`` nodes (root included) and
    ``depth`` levels: its verify latency plus one head call per level the heads draft
    (copy-only levels cost a lookup). Example: 4 nodes at 60 ms, depth 3, 1 ms per head
    call, K = 2 -> 62 ms."""
    return latency(size) + draft_s * min(depth, num_heads)


def best_tree(table: list[list[float]], latency: LatencyCurve, draft_s: float, num_heads: int,
              max_depth: int, margin: float = 0.05, max_budget: int = AUTO_NODES - 1) -> Choice:
    """The tree of highest expected tokens/s among greedy growths of 0..max_budget nodes.

    Step cost of a tree of b drafts and depth d: ``latency(b + 1) + draft_s * min(d, K)``
    (one head call per level the heads draft; copy-only levels cost a lookup). Example:
    latency 40 ms for 1 node and 60 ms for 4, table [[.8], [.7], [.6]], draft 1 ms/level:
    the 3-chain has tau 1 + .8 + .56 + .336 = 2.70 in 63 ms (1.71x the root's 1/40ms).
    """
    table = [list(row) for row in table[:max_depth]]
    base = 1.0 / latency(1)
    best = Choice([], 1.0, latency(1), 1.0)
    for b in range(1, max_budget + 1):
        paths = grow_tree(table, b)
        if len(paths) < b:  # the table cannot fill more nodes
            break
        depth = max(map(len, paths))
        seconds = step_seconds(latency, b + 1, depth, draft_s, num_heads)
        tau = expected_tau(paths, table)
        speedup = tau / seconds / base
        if speedup > best.speedup and speedup >= 1.0 + margin:
            best = Choice(paths, tau, seconds, speedup)
    return best


def draft_seconds(drafter, hidden_size: int, device, dtype, reps: int = 3) -> float:
    """Seconds per tree level of drafting with the heads (a K-chain, best of ``reps``)."""
    tree = compile_tree(chain(drafter.num_heads), name="probe")
    hidden = torch.zeros(hidden_size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(reps + 1):
        t = time.perf_counter()
        drafter.draft(tree, 0, hidden, [0, 0], SamplingParams(), None, None)
        best = min(best, time.perf_counter() - t)
    return best / drafter.num_heads


@dataclass
class TreePolicy:
    """Resolves ``--tree NAME`` for each request's sampling settings (cached per case)."""

    name: str  # the --tree setting: a preset, auto or auto-N
    heads: object  # the heads (their config holds the acceptance tables)
    drafter: object  # fills trees; knows how deep it can draft under given sampling
    latency: LatencyCurve | None = None  # this machine's verify latency (needed by auto)
    draft_s: float = 0.0  # seconds per drafted level
    margin: float = 0.05  # auto: required expected gain over plain decoding
    chains_only: bool = False  # grow chains only (the backbone's ``chains_only``: branching trees cost more)
    _cache: dict = field(default_factory=dict, repr=False)
    choices: dict = field(default_factory=dict, repr=False)  # auto: copying -> Choice (for reports)

    def tree_for(self, sampling: SamplingParams) -> CompiledTree:
        copying = self.drafter.copy is not None
        if copying not in self._cache:
            self._cache[copying] = self._resolve(copying, self.drafter.max_depth(sampling))
        return self._cache[copying]

    def table(self, copying: bool, shaped: bool = True):
        """The heads' calibrated acceptance table with or without context copy (None if
        uncalibrated); ``shaped``: as trees chosen for the user may use it (``shape``)."""
        policy = self.heads.policy
        table = policy.copy_acceptance if copying else policy.acceptance
        return self.shape(table) if shaped else table

    def shape(self, table):
        """An acceptance table as trees may use it: with ``chains_only``, the top-ranked
        candidate of each depth alone, so every tree grown from it is a chain. Example:
        [[.6, .1], [.5, .1]] -> [[.6], [.5]]."""
        if table is None or not self.chains_only:
            return table
        return [list(row[:1]) for row in table]

    def _resolve(self, copying: bool, max_depth: int) -> CompiledTree:
        suffix = "+copy" if copying else ""
        if self.name == "auto":
            table = self.table(copying)
            if table is None or self.latency is None:  # uncalibrated heads: the top-1 chain
                return compile_tree(chain(min(self.heads.K, max_depth)), name=f"chain{suffix}")
            choice = best_tree(table, self.latency, self.draft_s, self.heads.K, max_depth, self.margin)
            self.choices[copying] = choice
            return compile_tree(choice.paths, name=f"auto-{len(choice.paths)}{suffix}")
        if self.name.startswith("auto-"):
            size = self.name[len("auto-"):]
            if not size.isdigit() or int(size) < 1:
                raise CadenceError(f"bad tree {self.name!r}: auto-N needs a node count N >= 1, e.g. auto-8")
            table = self.table(copying, shaped=False)  # the user asked for N nodes: any shape
            if table is None:
                raise CadenceError(f"--tree {self.name} needs the acceptance table of `cadence calibrate` "
                                   f"({'copy_acceptance' if copying else 'acceptance'} in the heads' draft_config.json)")
            return compile_tree(grow_tree(table[:max_depth], int(size)), name=f"{self.name}{suffix}")
        return compile_tree(preset(self.name, max_depth), name=f"{self.name}{suffix}")
