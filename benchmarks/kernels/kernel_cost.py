"""Which projection kernel suits this CPU? Milliseconds per call of each ``cadence.fast.kernels``
kind on the default model's matrix shapes, for a few row counts (tree nodes).

Weights are "cold" as in a real forward, where each matrix is read once per token and the
whole model does not fit in the cache: every timed call uses another copy of the matrix
(enough copies to exceed twice the largest CPU cache, at least 64 MiB), the LM head too. The
figure is the median over rounds of the mean per call. Kinds: ``onednn`` (prepacked bf16 /
fp32, the default), ``int8`` (``--quant int8``), ``int4`` (``--quant int4``'s projections).

It also times a warm, compute-bound product (1024 x 1024 x 1024, the same dtype) on 1 and on
all threads: the machine's matrix throughput, and whether its threads have matrix units of
their own (two vCPUs sharing one core's AMX unit scale by about 1.1x, not 2x). Rows of a tree
cost 2 * rows * parameters FLOP per forward; against this peak that bounds how cheap a
32-node verify can be.

Usage:  python benchmarks/kernels/kernel_cost.py [--dtype bfloat16] [--rows 1 4 8] [--kinds onednn] [--rounds 5]
Writes runs/kernel-cost-<cpu>.json (or --out) and prints a markdown table.
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
from cadence.fast.kernels import Linear

# SmolLM2-135M: fused q/k/v, o, fused gate/up, down, LM head (out, in)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
KINDS = ("onednn", "int8", "int4")


def last_level_cache_bytes() -> int:
    """Size of the CPU's largest cache (sysfs; 0 when unknown). One AMX Xeon (a KVM guest)
    reported a 480 MiB L3: a fixed 64 MiB of copies stayed in it and looked twice as fast."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=0)


COLD_BYTES = max(64 << 20, 2 * last_level_cache_bytes())  # the copies of a matrix exceed this


def time_kind(kind: str, shape: tuple[int, int], rows: int, dtype: torch.dtype, rounds: int) -> float:
    out, inp = shape
    copies = max(1, COLD_BYTES // (out * inp * 2))
    gen = torch.Generator().manual_seed(0)
    lins = [Linear((torch.randn(out, inp, generator=gen) * 0.05).to(dtype), None, kind) for _ in range(copies)]
    for lin in lins:
        lin.min_rows = 2  # as the row-consistent bf16 path pads them
    x = torch.randn(rows, inp, generator=gen).to(dtype)
    reps = max(3, 64 // copies)
    for lin in lins:
        lin(x)
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            for lin in lins:
                lin(x)
        per_round.append((time.perf_counter() - t0) / (reps * copies) * 1e3)
    return statistics.median(per_round)


def peak_tflops(dtype: torch.dtype, threads: int, n: int = 1024, calls: int = 100) -> float:
    """Warm n x n x n matrix products on ``threads`` threads: TFLOP/s, best of 3 rounds."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        for _ in range(10):
            a @ b
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(calls):
                a @ b
            best = min(best, (time.perf_counter() - t) / calls)
        return round(2 * n ** 3 / best / 1e12, 3)
    finally:
        torch.set_num_threads(before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--out", default="", help="default runs/kernel-cost-<cpu>.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    table = {}
    for name, shape in SHAPES.items():
        for kind in args.kinds:
            for rows in args.rows:
                table.setdefault(name, {}).setdefault(kind, {})[rows] = round(
                    time_kind(kind, shape, rows, dtype, args.rounds), 4)
    info = common.machine()
    print(f"{common.machine_line(info)}; {args.dtype}, cold weights (copies of each matrix over {COLD_BYTES >> 20} MiB)\n")
    print("| matrix (out x in) | " + " | ".join(f"{k} {r} rows" for k in args.kinds for r in args.rows) + " |")
    print("|---|" + "---:|" * (len(args.kinds) * len(args.rows)))
    for name, shape in SHAPES.items():
        cells = " | ".join(f"{table[name][k][r]:.3f}" for k in args.kinds for r in args.rows)
        print(f"| {name} ({shape[0]} x {shape[1]}) | {cells} |")
    per_layer = {k: {r: round(sum(table[n][k][r] for n in ("qkv", "o", "gate_up", "down")), 4) for r in args.rows}
                 for k in args.kinds}
    print("| one decoder layer | " + " | ".join(f"{per_layer[k][r]:.3f}" for k in args.kinds for r in args.rows) + " |")
    threads = torch.get_num_threads()
    peak = {1: peak_tflops(dtype, 1), threads: peak_tflops(dtype, threads)}
    print(f"\nwarm 1024^3 {args.dtype} product: " + ", ".join(f"{t} thread(s) {v} TFLOP/s" for t, v in peak.items()))
    print("\n(milliseconds per call)")
    common.write_json(common.out_path(args.out, f"kernel-cost-{common.cpu_slug()}.json"),
                      {"machine": info, "dtype": args.dtype, "cold_bytes": COLD_BYTES, "ms": table,
                       "decoder_layer_ms": per_layer, "peak_tflops_by_threads": peak}, indent=2)


if __name__ == "__main__":
    main()
