"""Do a tree forward and a one-token forward give the root the same logits?

For random contexts of 50-400 tokens, the root's logits from a one-token verify forward
are compared with those from trees of 2, 3, 8, 16 and 33 nodes at the same position, on
the fast backend. Prints how many differ and by how much. ``--off`` disables the
row-consistent padding (``cadence.fast.consistent``) to show what it fixes. ``--chain``
checks every node of a verify forward over a chain of 8 instead: node i's logits against
a one-token forward at its position after the chain's first i tokens were committed one
at a time (what plain decoding computes), on contexts that end just before a 64-key block.
``--tree`` does the same for every node of a branching 9-node tree (whose nodes' ancestors are
not all in the first slots after the context, as they are in plain decoding).

Usage:  python benchmarks/kernels/consistency.py [--dtype bfloat16] [--contexts 20] [--off] [--chain | --tree]
"""

from __future__ import annotations

import argparse

import sys
from pathlib import Path
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
import cadence.fast.consistent as consistent
from cadence.verify.scorer import score
from cadence.trees.tree import compile_tree, grow_tree, prior_acceptance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--contexts", type=int, default=20)
    ap.add_argument("--off", action="store_true", help="no row-consistent padding")
    ap.add_argument("--quant", default="none", help="none | int8 | int4 (weight-only)")
    ap.add_argument("--chain", action="store_true", help="every node of a chain of 8, not only the root")
    ap.add_argument("--tree", action="store_true", help="every node of a branching 9-node tree")
    args = ap.parse_args()
    if args.off:
        consistent.wanted = lambda kernel, dtype: False
    bb = common.backbone(args.model, args.dtype, backend="fast", quant=args.quant)
    probe = chain_probe if args.chain else tree_probe if args.tree else root_probe
    bad, total = probe(bb, args.contexts)
    print(f"{common.machine_line()}; {bb.dtype}, quant {bb.quant}, padding {'off' if args.off else 'on' if bb.consistent else 'not used'}")
    what = "chain-node" if args.chain else "tree-node" if args.tree else "root"
    print(f"{len(bad)} of {total} {what} logits differ; largest {max((d for *_, d in bad), default=0):.4f}")
    for past, n, diff in bad[:10]:
        print(f"  context {past}, {'nodes' if probe is root_probe else 'node'} {n}: {diff:.4f}")


def _compare(bad: list, past: int, label: int, a: torch.Tensor, b: torch.Tensor) -> int:
    """Record (past, label, max |a - b|) in ``bad`` when the logits differ; 1 probe."""
    diff = float((a - b).abs().max())
    if diff > 0:
        bad.append((past, label, diff))
    return 1


def _prefilled(bb, prompt: torch.Tensor):
    """A fresh cache holding ``prompt`` (1, P)."""
    cache = bb.new_cache()
    bb.forward(prompt, cache, need_logits=False)
    return cache


def chain_probe(bb, contexts: int) -> tuple[list, int]:
    """(differences, probes): contexts of 58-63 + 64 j tokens, a chain of 8 random tokens."""
    root = compile_tree([], name="root")
    chain8 = compile_tree([(0,) * d for d in range(1, 8)], name="chain-7")
    bad, total = [], 0
    for seed in range(contexts):
        g = torch.Generator().manual_seed(seed)
        past = 64 * (1 + seed % 6) - int(torch.randint(1, 7, (1,), generator=g))
        prompt = torch.randint(0, bb.vocab_size, (1, past), generator=g)
        toks = torch.randint(0, bb.vocab_size, (8,), generator=g)
        cache = _prefilled(bb, prompt)
        multi = score(bb, cache, past, chain8, toks).logits[0]  # (8, V)
        cache = _prefilled(bb, prompt)
        for i in range(8):
            one = score(bb, cache, past + i, root, toks[i:i + 1]).logits[0, 0]
            total += _compare(bad, past, i, multi[i], one)
    return bad, total


def tree_probe(bb, contexts: int) -> tuple[list, int]:
    """(differences, probes): each node of a branching 9-node tree against one-token forwards
    along its path (root first), on random contexts of 50-400 tokens (odd seeds: just before
    a 64-key block, where a deep node's keys reach into the next one)."""
    root = compile_tree([], name="root")
    tree = compile_tree(grow_tree(prior_acceptance(4, ranks=4), 8), name="tree-9")
    bad, total = [], 0
    for seed in range(contexts):
        g = torch.Generator().manual_seed(seed)
        past = int(torch.randint(50, 400, (1,), generator=g))
        if seed % 2:
            past = 64 * (1 + seed % 6) - int(torch.randint(1, 4, (1,), generator=g))
        prompt = torch.randint(0, bb.vocab_size, (1, past), generator=g)
        toks = torch.randint(0, bb.vocab_size, (tree.size,), generator=g)
        cache = _prefilled(bb, prompt)
        multi = score(bb, cache, past, tree, toks).logits[0]  # (9, V)
        for node in range(tree.size):
            path = [node]
            while path[-1] != 0:
                path.append(tree.parents[path[-1]])
            path = path[::-1]
            cache = _prefilled(bb, prompt)
            for i, n in enumerate(path):
                one = score(bb, cache, past + i, root, toks[n:n + 1]).logits[0, 0]
            total += _compare(bad, past, node, multi[node], one)
    return bad, total


def root_probe(bb, contexts: int) -> tuple[list, int]:
    bad, total = [], 0
    for seed in range(contexts):
        g = torch.Generator().manual_seed(seed)
        past = int(torch.randint(50, 400, (1,), generator=g))
        cache = bb.new_cache()
        bb.forward(torch.randint(0, bb.vocab_size, (1, past), generator=g), cache, need_logits=False)
        root = torch.randint(0, bb.vocab_size, (1,), generator=g)
        one = score(bb, cache, past, compile_tree([], name="root"), root).logits[0, 0]
        cache.compact(past, [])
        for n in (2, 3, 8, 16, 33):
            tree = compile_tree(grow_tree(prior_acceptance(8, ranks=n), n - 1), name=f"probe-{n}")
            tokens = torch.cat([root, torch.randint(0, bb.vocab_size, (tree.size - 1,), generator=g)])
            logits = score(bb, cache, past, tree, tokens).logits[0, 0]
            cache.compact(past, [])
            total += _compare(bad, past, n, logits, one)
    return bad, total


if __name__ == "__main__":
    main()
