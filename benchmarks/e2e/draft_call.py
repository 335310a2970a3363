"""What one drafter call costs: ``drafter.draft`` for top-1 chains of 1..``--depths`` drafts,
hot (right after the same call) and cold (after 64 MiB of other memory traffic, as after a
verify forward), median milliseconds over ``--calls`` calls each. The state, root and context
are fixed (a random state, a root outside the draft vocabulary, a 100-token context), so this
times the drafter's own work: head kernels, the draft-vocabulary LM head, the context
vocabulary and the Python around them, not acceptance.

Usage:  python benchmarks/e2e/draft_call.py [--method hydra] [--depths 3] [--calls 60]
            [--dtype float32 --quant gguf] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.methods import MethodSpec, make_engine  # noqa: E402
from cadence.trees.tree import chain, compile_tree  # noqa: E402
from cadence.verify.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="hydra", help="as cadence generate --method (a head drafter)")
    ap.add_argument("--depths", type=int, default=3)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quant", default="gguf")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    bb = common.backbone("smollm2", getattr(torch, args.dtype), backend="fast", quant=args.quant)
    drafter = make_engine(bb, MethodSpec.parse(args.method)).drafter
    hidden, context, root = torch.randn(bb.hidden_size), list(range(100, 200)), 5
    junk = torch.empty(64 << 20, dtype=torch.uint8)
    rows = {}
    for depth in range(1, args.depths + 1):
        tree = compile_tree(chain(depth))
        hot, cold = [], []
        for _ in range(args.calls + 5):  # the first 5 warm up
            junk.add_(1)
            t = time.perf_counter()
            drafter.draft(tree, root, hidden, context, SamplingParams(), None)
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            drafter.draft(tree, root, hidden, context, SamplingParams(), None)
            hot.append(time.perf_counter() - t)
        rows[f"chain-{depth}"] = {"hot_ms": statistics.median(hot[5:]) * 1e3, "cold_ms": statistics.median(cold[5:]) * 1e3}
    print(f"{args.method}, {args.dtype} / {args.quant}, median of {args.calls} calls\n")
    print("| tree | hot ms | cold ms |\n|---|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['hot_ms']:.3f} | {r['cold_ms']:.3f} |")
    info = common.machine()
    print("\n" + common.machine_line(info))
    if args.out:
        common.write_json(args.out, {"machine": info, "method": args.method, "dtype": args.dtype,
                                     "quant": args.quant, "calls": args.calls, "by_tree": rows})


if __name__ == "__main__":
    main()
