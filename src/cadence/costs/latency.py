"""Verify latency of this backbone on this machine: a short probe, cached per CPU.

Knows: how long one scored tree of n nodes takes after a fixed context (median of
interleaved rounds), where that curve is cached, and how to read it between the
measured sizes. Does not know heads, acceptance or which tree to pick (``tree_choice``).

Latency is a property of the machine, not of the heads: the same model's 3-node
forward cost 1.9x a 1-node forward on one CPU here and 1.5x on another, and trees
tuned on one were a slowdown on the other. So the curve is measured where decoding
runs, the first time it is needed (a few seconds for SmolLM2-135M), and cached under
``$CADENCE_CACHE/latency/`` keyed by CPU model and flags, core count, torch version,
device, dtype, backend and model.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cadence.system import cache as disk_cache
from cadence.system.atomic import atomic_write_json
from cadence.system.machine import cpu_model, machine_key
from cadence.trees.budget import AUTO_NODES
from cadence.trees.tree import chain, compile_tree, grow_tree, prior_acceptance
from cadence.verify.sampling import argmax
from cadence.verify.scorer import score

SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, AUTO_NODES)  # tree nodes, root included
FORMAT = 3  # 3: context 128, lower quartile of 9 rounds (1: context 256, median of 5)


@dataclass
class LatencyCurve:
    """Seconds of one verify forward over n tree nodes, at the measured sizes."""

    sizes: list[int]  # node counts measured, ascending (1 = the root alone)
    seconds: list[float]  # median seconds per forward at each size
    context: int = 256  # committed tokens in the cache while measuring
    key: str = ""  # what the curve is valid for (see ``machine_key``)

    def __call__(self, n: int) -> float:
        """Latency at ``n`` nodes: measured, else linear between neighbours (beyond the
        largest size: extrapolated from the last two).

        Example: sizes [1, 4], seconds [0.04, 0.07] -> n=2: 0.05."""
        s, t = self.sizes, self.seconds
        if n in s:
            return t[s.index(n)]
        hi = next((i for i, x in enumerate(s) if x > n), len(s) - 1)
        lo = max(hi - 1, 0)
        if s[hi] == s[lo]:
            return t[lo]
        return t[lo] + (t[hi] - t[lo]) * (n - s[lo]) / (s[hi] - s[lo])

    def ratio(self, n: int) -> float:
        """Cost of n nodes relative to the root alone."""
        return self(n) / self(1)


def probe_tree(n: int, chains_only: bool = False):
    """A representative tree of n nodes: a bushy one, as greedy growth makes them, or a
    chain for a backbone that verifies chains only cheaply (``Backbone.chains_only``)."""
    if chains_only:
        return compile_tree(chain(n - 1), name=f"probe-chain-{n}")
    return compile_tree(grow_tree(prior_acceptance(8, ranks=n), n - 1), name=f"probe-{n}")


@torch.inference_mode()
def measure(backbone, sizes=SIZES, context: int = 128, rounds: int = 9,
            chains: bool | None = None) -> LatencyCurve:
    """Seconds of one scored tree per size (``chains``: chains or bushy trees; default the
    backbone's ``chains_only``): the lower quartile over ``rounds`` interleaved
    passes (plus one warm-up pass), on a cache holding ``context`` tokens. On a shared,
    noisy machine the delays are one-sided (a step is never faster than its work), so
    the lower quartile is steadier than the median: here the median of 5 rounds put
    1 node at 15-21 ms across runs, the steps it predicts ran at 15."""
    context = min(context, backbone.max_positions - max(sizes) - 1)
    gen = torch.Generator().manual_seed(0)
    dev = backbone.device
    ctx = torch.randint(0, backbone.vocab_size, (1, context), generator=gen).to(dev)
    cache = backbone.new_cache()
    backbone.forward(ctx, cache, need_logits=False)
    chains = getattr(backbone, "chains_only", False) if chains is None else chains
    trees = [probe_tree(n, chains) for n in sizes]
    samples: list[list[float]] = [[] for _ in sizes]
    for r in range(rounds + 1):
        for i, tree in enumerate(trees):
            tokens = torch.randint(0, backbone.vocab_size, (tree.size,), generator=gen).to(dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            logits = score(backbone, cache, context, tree, tokens).logits
            int(argmax(logits[0, 0]))  # a verdict needs the logits on the host
            elapsed = time.perf_counter() - t
            cache.compact(context, [])
            if r:
                samples[i].append(elapsed)
    low = [statistics.quantiles(s, n=4)[0] if len(s) > 1 else s[0] for s in samples]
    return LatencyCurve(list(sizes), low, context, machine_key(backbone))


def cache_path(backbone) -> Path:
    return disk_cache.root() / "latency" / f"{machine_key(backbone)}.json"


def latency_curve(backbone, sizes=SIZES, rounds: int = 9, remeasure: bool = False,
                  verbose: bool = False) -> LatencyCurve:
    """The cached curve for this machine and backbone, measuring it the first time."""
    path = cache_path(backbone)
    if path.is_file() and not remeasure:
        try:
            data = json.loads(path.read_text())
            if data.get("format") == FORMAT and data["curve"]["key"] == machine_key(backbone):
                return LatencyCurve(**data["curve"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable cache: measure again
    if verbose:
        print(f"cadence: measuring verify latency on this machine (once; cached in {path})",
              file=sys.stderr, flush=True)
    curve = measure(backbone, sizes, rounds=rounds)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"format": FORMAT, "cpu": cpu_model(), "curve": asdict(curve)})
    return curve
