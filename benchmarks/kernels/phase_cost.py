"""Where a verify forward's extra time goes: wall time per phase of the fast backbone's C++
layer loop (``fast/native/layers.cpp``: the qkv GEMM, RoPE, attention with the cache store,
o GEMM, residual add + norm, gate/up GEMM, SwiGLU, down GEMM, add + norm), summed over the
30 layers, for a one-token forward and for a binary tree of ``--nodes`` nodes on a fixed
context, as ``verify_cost.py`` times them (bf16, or ``--dtype float32 --quant gguf`` for the
fp32 path on the GGUF's blocks; the two sizes alternate, warm-up excluded).
"rest" is the forward's time outside the layer loop (embedding, final norm, LM head, Python).
Phase boundaries read a clock (about 0.1 us each) and nothing else changes.

Usage:  python benchmarks/kernels/phase_cost.py [--nodes 32] [--context 200] [--forwards 200] [--kernel auto]
        [--dtype bfloat16|float32] [--quant none|gguf] [--out FILE]
Prints a markdown table (ms per forward) and writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.fast.model import FastBackbone
from verify_cost import tree_inputs


@torch.inference_mode()
def measure(bb, sizes: list[int], context: int, forwards: int) -> dict:
    layers = bb._native
    cache, inputs = tree_inputs(bb, sizes, context)
    sums = {n: {} for n in sizes}
    wall = {n: 0.0 for n in sizes}
    for rep in range(forwards + 1):  # rep 0 warms up
        for n in (sizes if rep % 2 else sizes[::-1]):
            toks, pos, mask = inputs[n]
            layers.phase_times(rep > 0)
            t = time.perf_counter()
            bb.forward(toks, cache, pos, mask)
            dt = time.perf_counter() - t
            cache.compact(context, [])
            for name, s in layers.phase_times(False):
                sums[n][name] = sums[n].get(name, 0.0) + s
            if rep:
                wall[n] += dt
    out = {}
    for n in sizes:
        ms = {name: s / forwards * 1000 for name, s in sums[n].items()}
        ms["rest"] = wall[n] / forwards * 1000 - sum(ms.values())
        ms["total"] = wall[n] / forwards * 1000
        out[str(n)] = {k: round(v, 3) for k, v in ms.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--forwards", type=int, default=200)
    ap.add_argument("--kernel", default="auto", help="projection kernel (fast.kernels.KINDS)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--quant", default="none", help="the fast path's --quant (gguf: the GGUF's blocks; fp32)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.quant != "none":
        bb = common.backbone(args.model, dtype, backend="fast", quant=args.quant)
    else:
        bb = FastBackbone.from_backbone(common.backbone(args.model, dtype, backend="transformers"), kernel=args.kernel)
    bb.forward(torch.tensor([[1, 2]]), None)  # builds the native loop
    if not bb._native:
        raise SystemExit("the C++ layer loop is not available here (see cadence.fast.native)")
    sizes = [1, args.nodes]
    res = measure(bb, sizes, args.context, args.forwards)
    one, tree = res["1"], res[str(args.nodes)]
    print(f"| phase (ms per forward, {bb.spec.layers} layers) | 1 node | {args.nodes} nodes | extra |\n|---|---:|---:|---:|")
    for name in one:
        print(f"| {name} | {one[name]:.3f} | {tree[name]:.3f} | {tree[name] - one[name]:+.3f} |")
    print(f"T({args.nodes})/T(1) = {tree['total'] / one['total']:.3f} ({bb.kernels})")
    info = common.machine()
    print(common.machine_line(info))
    if args.out:
        common.write_json(args.out, {"machine": info, "threads": torch.get_num_threads(), "kernel": bb.kernels,
                                     "context": args.context, "forwards": args.forwards, "ms": res})


if __name__ == "__main__":
    main()
