"""Narrowing speculation as the batch grows: how many tree nodes each row may verify.

Knows: the verify latency of one batched forward of B rows x n nodes per row on this
machine (``BatchLatency``, measured through ``FastBackbone.forward_rows`` and cached per
machine like ``cadence.costs.latency``), an acceptance table (expected tokens per step of the
greedy growth of n nodes), and how to cut a planned tree to a node cap. Does not know
which tree a row's scheduler wants (it only caps it) or how nodes are verified, so it is
lossless under every lossless rule.

Why: on a CPU one forward of B rows with 1 node each already multiplies B rows through
every weight matrix; from about 8 rows the matrix products stop being memory-bound, and
every extra node a row verifies costs nearly its full share. A tree that pays at batch 1
can cost more than it gains at batch 8 (serving engines switch speculation off by batch
size for the same reason; vLLM's ``disable_by_batch_size``).

The cap for B rows is the node count of the tree of highest expected batch tokens/s,
``B * tau(n) / (T(B, n) + B * draft_s * depth)``, over greedy growths of the acceptance
table (``tree_choice.best_tree`` on the latency curve of batch B); the root alone
(cap 1: no speculation) wins unless speculation is expected to be ``margin`` better.
Example: T(8, 1) = 40 ms, T(8, 3) = 70 ms, tau(3) = 1.6 -> 1.6 / 70 < 1 / 40: cap 1.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from cadence.batch.layout import pack
from cadence.costs.latency import LatencyCurve, probe_tree
from cadence.costs.tree_choice import best_tree
from cadence.errors import CadenceError
from cadence.schedulers.base import Plan, StepInfo, StepState
from cadence.system import cache as disk_cache
from cadence.system.atomic import atomic_write_json
from cadence.system.machine import cpu_model, machine_key
from cadence.trees.budget import MAX_NODES, clamp_nodes
from cadence.trees.tree import CompiledTree, compile_tree, prior_acceptance
from cadence.verify.sampling import argmax

BATCHES = (1, 2, 4, 8)
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
FORMAT = 1


@dataclass
class NarrowConfig:
    """How speculation narrows as the batch grows (the batch engine's policy)."""

    mode: str = field(default="auto", metadata={
        "help": "auto: cap each row's tree at the size of highest expected batch tokens/s under this "
                "machine's measured (batch, nodes) verify latency; none: rows run their schedulers' "
                "trees; root: no speculation in batches of --narrow-min-batch rows or more"})
    min_batch: int = field(default=2, metadata={
        "help": "narrowing applies from this many running rows (a lone row runs its scheduler's tree)"})
    max_nodes: int = field(default=0, metadata={
        "help": "hard cap on nodes verified per row, root included (0 = none beyond the engine's "
                f"{MAX_NODES})"})
    margin: float = field(default=0.05, metadata={
        "help": "auto: speculation must beat the root alone by this expected fraction"})
    measured: bool = field(default=True, metadata={
        "help": "auto: also time whole batched steps, speculating and not, per batch size, and run the root "
                "alone at a batch size where that measures faster (cadence.batch.step_rates)"})

    def __post_init__(self):
        if self.mode not in ("auto", "none", "root"):
            raise CadenceError(f"narrow mode must be auto, none or root, got {self.mode!r}")
        if self.min_batch < 1 or self.max_nodes < 0 or self.margin < 0:
            raise CadenceError("narrow: min_batch >= 1, max_nodes >= 0 and margin >= 0 are required")


@dataclass
class BatchLatency:
    """Seconds of one batched verify forward: ``seconds[i][j]`` for ``batches[i]`` rows of
    ``sizes[j]`` nodes each (a context of ``context`` tokens per row)."""

    batches: list[int]
    sizes: list[int]
    seconds: list[list[float]]
    context: int = 128
    key: str = ""

    def curve(self, batch: int) -> LatencyCurve:
        """Latency over nodes per row for ``batch`` rows: measured, else linear between the
        neighbouring measured batch sizes (beyond the largest: extrapolated from the last
        two). Example: batches [1, 4], 1 node 10 / 22 ms -> batch 2: 14 ms."""
        bs, rows = self.batches, self.seconds
        if batch in bs:
            row = rows[bs.index(batch)]
        else:
            hi = next((i for i, x in enumerate(bs) if x > batch), len(bs) - 1)
            lo = max(hi - 1, 0)
            w = 0.0 if bs[hi] == bs[lo] else (batch - bs[lo]) / (bs[hi] - bs[lo])
            row = [a + (b - a) * w for a, b in zip(rows[lo], rows[hi])]
        return LatencyCurve(list(self.sizes), [max(s, 1e-9) for s in row], self.context, self.key)


class Narrowing:
    """The per-batch-size node cap of ``NarrowConfig`` (cached per batch size and table)."""

    def __init__(self, cfg: NarrowConfig, latency: BatchLatency | None = None, draft_s: float = 0.0,
                 num_heads: int = 1):
        self.cfg, self.latency, self.draft_s, self.num_heads = cfg, latency, draft_s, num_heads
        self._caps: dict = {}

    def cap(self, batch: int, table: list[list[float]] | None, max_depth: int) -> int:
        """Nodes (root included) a row may verify when ``batch`` rows decode together."""
        hard = clamp_nodes(self.cfg.max_nodes)
        if batch < self.cfg.min_batch or self.cfg.mode == "none":
            return hard
        if self.cfg.mode == "root":
            return 1
        if self.latency is None:
            return hard
        key = (batch, id(table), max_depth)
        if key not in self._caps:
            table = table or prior_acceptance(max(max_depth, 1))
            choice = best_tree(table, self.latency.curve(batch), batch * self.draft_s, self.num_heads,
                               max(max_depth, 1), self.cfg.margin, max_budget=max(self.latency.sizes) - 1)
            self._caps[key] = min(len(choice.paths) + 1, hard)
        return self._caps[key]


def prune(tree: CompiledTree, size: int) -> CompiledTree:
    """The ``size`` nodes of ``tree`` (root included) most likely accepted: drafts ordered by
    (sum of ranks, depth), which keeps every kept node's parent (it has a smaller rank sum,
    or the same and a smaller depth). Example: paths [(0,), (1,), (0, 0), (0, 1)], size 3 ->
    [(0,), (0, 0)] (rank sums 0 and 0 before (1,) and (0, 1))."""
    if tree.size <= size:
        return tree
    ranked = sorted(tree.paths, key=lambda p: (sum(p), len(p), p))[:max(size - 1, 0)]
    return compile_tree(ranked, name=f"{tree.name}^{size}")


ROOT_TREE = compile_tree([], name="root")  # the root alone: no drafts


class CappedScheduler:
    """A row's scheduler with its plans cut to ``cap`` nodes (set by the batch engine each
    step): a static tree is pruned, a dynamic tree's node budget lowered (cap 1: the root
    alone). What the scheduler observes is the step that ran, so it keeps learning."""

    def __init__(self, inner):
        self.inner, self.cap = inner, MAX_NODES

    def choose(self, state: StepState) -> Plan:
        plan = self.inner.choose(state)
        if plan.dynamic is not None:  # a tree the drafter grows itself: cap its node budget
            if self.cap <= 1:
                return replace(plan, tree=ROOT_TREE, dynamic=None)
            budget = self.cap - 1  # draft nodes, the root excluded
            if plan.dynamic.max_nodes > budget:
                plan = replace(plan, dynamic=replace(plan.dynamic, max_nodes=budget))
        if plan.tree.size <= self.cap:
            return plan
        return replace(plan, tree=prune(plan.tree, self.cap))

    def observe(self, info: StepInfo) -> None:
        self.inner.observe(info)

    def __getattr__(self, name):  # the wrapped scheduler's own attributes (reports, tests)
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


@torch.inference_mode()
def measure(backbone, batches=BATCHES, sizes=SIZES, context: int = 128, rounds: int = 5) -> BatchLatency:
    """Lower quartile over ``rounds`` interleaved passes (after one warm-up) of one
    ``forward_rows`` over B rows x n probe-tree nodes, logits for every real node."""
    context = min(context, backbone.max_positions - max(sizes) - 1)
    gen = torch.Generator().manual_seed(0)
    dev = backbone.device
    cache = backbone.new_batch_cache(max(batches), capacity=context + max(sizes))
    for slot in range(max(batches)):
        ctx = torch.randint(0, backbone.vocab_size, (1, context), generator=gen).to(dev)
        backbone.forward_rows(ctx, cache, slot, [0], need_logits=False)
    samples = {(b, n): [] for b in batches for n in sizes}
    for r in range(rounds + 1):
        for b in batches:
            for n in sizes:
                tree = probe_tree(n, getattr(backbone, "chains_only", False))
                toks = [torch.randint(0, backbone.vocab_size, (n,), generator=gen) for _ in range(b)]
                t = time.perf_counter()
                p = pack([context] * b, [tree] * b, toks, dev)
                out = backbone.forward_rows(p.tokens, cache, 0, p.starts, p.positions, p.mask)
                int(argmax(out.logits[0, 0]))
                if r:
                    samples[b, n].append(time.perf_counter() - t)
                for slot in range(b):
                    cache.lengths[slot] = context
    grid = [[statistics.quantiles(samples[b, n], n=4)[0] if rounds > 1 else samples[b, n][0] for n in sizes]
            for b in batches]
    return BatchLatency(list(batches), list(sizes), grid, context, machine_key(backbone))


def batch_latency(backbone, remeasure: bool = False, verbose: bool = False, **kwargs) -> BatchLatency:
    """The cached (batch, nodes) latency grid for this machine and backbone, measured once."""
    path = disk_cache.root() / "latency" / f"batch-{machine_key(backbone)}.json"
    if path.is_file() and not remeasure:
        try:
            data = json.loads(path.read_text())
            if data.get("format") == FORMAT and data["grid"]["key"] == machine_key(backbone):
                return BatchLatency(**data["grid"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if verbose:
        print(f"cadence: measuring batched verify latency on this machine (once; cached in {path})",
              file=sys.stderr, flush=True)
    grid = measure(backbone, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"format": FORMAT, "cpu": cpu_model(), "grid": asdict(grid)})
    return grid
