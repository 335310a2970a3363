"""Draft trees as data, and one pure function that compiles a tree for the engine.

A tree is a list of paths; a path is a tuple of candidate ranks. ``(0,)`` is head 1's
top-1 candidate, ``(0, 2)`` head 2's third candidate under head 1's top-1. The root
(the backbone's own next token, "Backbone-as-Architect") is implicit: it is node 0
and has the empty path ``()``.

Knows: presets, greedy growth from acceptance statistics (Medusa's method), compiling.
Does not know: heads, tokens, or models.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import torch

from cadence.errors import CadenceError

Path = tuple[int, ...]

# Acceptance prior used to grow the preset trees: probability that head k's rank-i
# candidate is right given its parent path was accepted, a_k(i) = TOP1[k] * RANK**i.
# Rough figures for small self-distilled heads; calibrated trees replace them (EntMTP).
PRIOR_TOP1 = (0.60, 0.50, 0.45, 0.40, 0.35, 0.30, 0.30, 0.30)
PRIOR_RANK_DECAY = 0.45


def prior_acceptance(depth: int, ranks: int = 10) -> list[list[float]]:
    """a[k][i] for k < depth heads and i < ranks candidates, from the default prior."""
    return [[PRIOR_TOP1[min(k, len(PRIOR_TOP1) - 1)] * PRIOR_RANK_DECAY ** i for i in range(ranks)]
            for k in range(depth)]


def grow_tree(acceptance: list[list[float]], budget: int) -> list[Path]:
    """Greedily grow a tree of ``budget`` draft nodes maximising expected tau.

    ``acceptance[k][i]`` is head k+1's probability that its rank-i candidate is accepted
    given its parent was. A node's value is the product along its path; the frontier
    node of highest value is added until the budget is spent. Example with
    ``acceptance=[[0.6, 0.3], [0.5, 0.2]]`` and budget 3: (0,) value .6, then (1,) value
    .30 ties (0,0) .30 (the earlier-pushed, the sibling (1,), wins), then the other. The
    result is sorted by (depth, ranks): [(0,), (1,), (0, 0)].
    """
    depth, ranks = len(acceptance), len(acceptance[0]) if acceptance else 0
    chosen: list[Path] = []
    counter = 0
    # heap of (-value, insertion order, path, value of the path's parent)
    frontier: list[tuple[float, int, Path, float]] = []
    if depth and ranks:
        frontier.append((-acceptance[0][0], counter, (0,), 1.0))
    while frontier and len(chosen) < budget:
        neg, _, path, parent_value = heapq.heappop(frontier)
        chosen.append(path)
        value = -neg
        k, i = len(path) - 1, path[-1]
        if i + 1 < ranks:  # next sibling
            counter += 1
            heapq.heappush(frontier, (-parent_value * acceptance[k][i + 1], counter, path[:-1] + (i + 1,),
                                      parent_value))
        if k + 1 < depth:  # first child
            counter += 1
            heapq.heappush(frontier, (-value * acceptance[k + 1][0], counter, path + (0,), value))
    return sorted(chosen, key=lambda p: (len(p), p))


def node_values(paths: list[Path], acceptance: list[list[float]]) -> list[float]:
    """Each node's chance of being on the accepted path: the product of ``acceptance``
    along its path (0 for ranks or depths the table does not cover). Example: table
    [[0.6, 0.3], [0.5, 0.2]], paths [(0,), (0, 1)] -> [0.6, 0.12]."""
    out = []
    for p in paths:
        v = 1.0
        for k, i in enumerate(p):
            v *= acceptance[k][i] if k < len(acceptance) and i < len(acceptance[k]) else 0.0
        out.append(v)
    return out


def expected_tau(paths: list[Path], acceptance: list[list[float]]) -> float:
    """1 + sum of node values (product of acceptance along each path)."""
    return 1.0 + sum(node_values(paths, acceptance))


def chain(depth: int) -> list[Path]:
    """The top-1 chain of ``depth`` drafts: [(0,), (0, 0), ...]."""
    return [(0,) * d for d in range(1, depth + 1)]


SPARSE_SIZES = (4, 8, 16, 32, 64)


def preset(name: str, max_depth: int) -> list[Path]:
    """Preset by name for a drafter that fills ``max_depth`` levels (K heads, or the copy
    depth when drafting with context copy).

    Names: ``root`` (no drafts: plain decoding), ``chain`` (depth K), ``chain-D``,
    ``tree-N`` for N in 4, 8, 16, 32, 64 (``tree-64`` is the Medusa-style sparse tree),
    grown from the default prior with depth <= K.
    """
    if name == "root":
        return []
    if name == "chain":
        return chain(max_depth)
    if name.startswith("chain-") and name[6:].isdigit():
        d = int(name[6:])
        if not 1 <= d <= max_depth:
            raise CadenceError(f"tree {name!r} is {d} levels deep; this drafter fills at most {max_depth} "
                               "(K heads; deeper with context copy, --copy-depth)")
        return chain(d)
    if name.startswith("tree-") and name[5:].isdigit() and int(name[5:]) in SPARSE_SIZES:
        return grow_tree(prior_acceptance(max_depth, ranks=int(name[5:])), int(name[5:]))
    raise CadenceError(f"unknown tree {name!r}; presets: {', '.join(preset_names(max_depth))}")


def preset_names(max_depth: int) -> list[str]:
    return ["root", "chain"] + [f"chain-{d}" for d in range(1, max_depth + 1)] + [
        f"tree-{n}" for n in SPARSE_SIZES]


@dataclass(frozen=True)
class CompiledTree:
    """A tree ready for one engine step. Node 0 is the root; nodes 1..N are drafts.

    Worked example, paths [(0,), (1,), (0, 0)]:
      nodes     0:()  1:(0,)  2:(1,)  3:(0,0)
      parents   [-1, 0, 0, 1]        depths [0, 1, 1, 2]      ranks [0, 0, 1, 0]
      mask row 3 (node (0,0)) sees nodes 0, 1, 3  ->  [T, T, F, T]
      leaves    [2, 3]; leaf_paths [[0, 2, -1], [0, 1, 3]]
      children  {0: [1, 2], 1: [3]}
    """

    name: str
    paths: tuple[Path, ...]  # draft paths in node order (node i+1 has paths[i])
    parents: tuple[int, ...]  # (N+1,) parent node of each node, -1 for the root
    depths: tuple[int, ...]  # (N+1,) 0 for the root
    ranks: tuple[int, ...]  # (N+1,) candidate rank of each node under its parent
    children: tuple[tuple[int, ...], ...]  # (N+1,) child nodes of each node, in rank order
    mask: torch.Tensor  # (N+1, N+1) bool: mask[i, j] = node j is i itself or its ancestor
    leaf_paths: torch.Tensor  # (n_leaves, max_depth+1) long, node indices root..leaf, -1 padded
    is_chain: bool  # every node has at most one child (plain causal attention suffices)

    @property
    def size(self) -> int:
        """Number of nodes including the root (the width of the verify forward)."""
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def width(self, node: int) -> int:
        """How many candidates the children of ``node`` need (max rank + 1)."""
        return 1 + max((self.ranks[c] for c in self.children[node]), default=-1)


def _validate(paths: list[Path]) -> None:
    seen = set(paths)
    if len(seen) != len(paths):
        raise CadenceError("tree has duplicate paths")
    for p in paths:
        if not p or any((not isinstance(r, int)) or r < 0 for r in p):
            raise CadenceError(f"bad tree path {p!r}: a non-empty tuple of ranks >= 0")
        if len(p) > 1 and p[:-1] not in seen:
            raise CadenceError(f"tree path {p!r} has no parent {p[:-1]!r} in the tree")


@lru_cache(maxsize=256)
def _compile_cached(name: str, paths: tuple[Path, ...]) -> CompiledTree:
    ordered = sorted(paths, key=lambda p: (len(p), p))
    index = {(): 0}
    for i, p in enumerate(ordered, 1):
        index[p] = i
    n = len(ordered) + 1
    parents = [-1] + [index[p[:-1]] for p in ordered]
    depths = [0] + [len(p) for p in ordered]
    ranks = [0] + [p[-1] for p in ordered]
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)
    for c in children:
        c.sort(key=lambda j: ranks[j])
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    leaves = [i for i in range(n) if not children[i]]
    max_d = max(depths)
    leaf_paths = torch.full((len(leaves), max_d + 1), -1, dtype=torch.long)
    for r, leaf in enumerate(leaves):
        chain_nodes = []
        j = leaf
        while j >= 0:
            chain_nodes.append(j)
            j = parents[j]
        leaf_paths[r, :len(chain_nodes)] = torch.tensor(chain_nodes[::-1])
    return CompiledTree(name=name, paths=tuple(ordered), parents=tuple(parents), depths=tuple(depths),
                        ranks=tuple(ranks), children=tuple(tuple(c) for c in children), mask=mask,
                        leaf_paths=leaf_paths, is_chain=all(len(c) <= 1 for c in children))


def compile_tree(paths: list[Path], name: str = "custom") -> CompiledTree:
    """Compile draft paths into parents, depths, ranks, mask and leaf paths (pure, cached)."""
    paths = [tuple(int(r) for r in p) for p in paths]
    _validate(paths)
    return _compile_cached(name, tuple(sorted(paths, key=lambda p: (len(p), p))))


def truncate(tree: CompiledTree, depth: int) -> CompiledTree:
    """The nodes of ``tree`` at depth <= ``depth`` (e.g. a copy-deepened tree when
    sampling, where only the K heads can draft)."""
    if tree.max_depth <= depth:
        return tree
    return compile_tree([p for p in tree.paths if len(p) <= depth], name=f"{tree.name}@{depth}")
