"""The integer kernel's software prefetch (``gemm_qi.cpp``, ``CADENCE_GGUF_PREFETCH``): whole
fast-backbone forwards on the GGUF's blocks (``--dtype float32 --quant gguf``) over a fixed
context, one node and binary trees of ``--sizes`` nodes, with each prefetch distance in
``--distances`` (bytes; 0 is the hardware prefetcher alone), all in one process: every
repetition runs every (distance, size) once, the distance order alternating, warm-up
excluded. Prints the median ms per forward, T(n)/T(1), and whether the logits are
bit-identical across distances (the prefetch is timing only). Run it under
``CADENCE_ISA=avx2`` (with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``) or ``avx512``
to time those paths.

Usage:  python benchmarks/kernels/gguf_prefetch.py [--distances 0 8192] [--sizes 8] [--context 200]
            [--reps 30] [--out FILE]
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
from cadence.fast.native import module
from cadence.system.machine import isa
from verify_cost import tree_inputs


@torch.inference_mode()
def measure(bb, ops, distances: list[int], sizes: list[int], context: int, reps: int) -> tuple[dict, bool]:
    cache, inputs = tree_inputs(bb, sizes, context)
    times = {(d, n): [] for d in distances for n in sizes}
    logits: dict = {}
    was = ops.q_prefetch()
    try:
        for rep in range(reps + 1):  # rep 0 warms up
            for d in (distances if rep % 2 else distances[::-1]):
                ops.set_q_prefetch(d)
                for n in sizes:
                    toks, pos, mask = inputs[n]
                    t = time.perf_counter()
                    out = bb.forward(toks, cache, pos, mask)
                    dt = time.perf_counter() - t
                    cache.compact(context, [])
                    if rep:
                        times[(d, n)].append(dt * 1000)
                    else:
                        logits[(d, n)] = out.logits.clone()
    finally:
        ops.set_q_prefetch(was)
    same = all(torch.equal(logits[(d, n)], logits[(distances[0], n)]) for d in distances for n in sizes)
    ms = {str(d): {str(n): round(statistics.median(times[(d, n)]), 3) for n in sizes} for d in distances}
    return ms, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--distances", type=int, nargs="+", default=[0, 8192])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8], help="tree sizes besides one node")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ops = module()
    if ops is None or not hasattr(ops, "set_q_prefetch"):
        sys.exit("the native extension is unavailable here")
    bb = common.backbone(args.model, torch.float32, backend="fast", quant="gguf")
    bb.forward(torch.tensor([[1, 2]]), None)  # builds the native loop
    sizes = sorted({1, *args.sizes})
    ms, same = measure(bb, ops, args.distances, sizes, args.context, args.reps)
    print(f"| prefetch (bytes) | " + " | ".join(f"T({n}) ms" for n in sizes) + " | "
          + " | ".join(f"T({n})/T(1)" for n in sizes if n > 1) + " |")
    print("|---:|" + "---:|" * (2 * len(sizes) - 1))
    for d in args.distances:
        row = ms[str(d)]
        print(f"| {d} | " + " | ".join(f"{row[str(n)]:.2f}" for n in sizes) + " | "
              + " | ".join(f"{row[str(n)] / row['1']:.2f}" for n in sizes if n > 1) + " |")
    print(f"logits bit-identical across distances: {same} ({bb.kernels}; CADENCE_ISA {isa()})")
    info = common.machine()
    print(common.machine_line(info))
    if args.out:
        common.write_json(args.out, {"machine": info, "isa": isa(), "kernel": bb.kernels, "context": args.context,
                                     "reps": args.reps, "threads": torch.get_num_threads(), "ms": ms,
                                     "identical": same})


if __name__ == "__main__":
    main()
