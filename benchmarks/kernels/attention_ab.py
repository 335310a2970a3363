"""Verify cost with bf16 ``listed_attention`` on AMX tiles against its fp32 vector kernel, in one
process, interleaved: the fast backbone's forward over binary trees of n nodes at a 200-token
context, switching the kernel (``set_listed_attention_amx``) before each round. Only on a CPU
with AMX; the two kernels reduce differently, so a real process never switches (the switch
is for tests and this comparison).

Usage:  python benchmarks/kernels/attention_ab.py [--sizes 1 8 16 32 64] [--reps 9] [--out FILE]
Prints ms per forward (median) and T(n)/T(1) for both kernels; writes JSON with --out.
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
from cadence.fast import native
from verify_cost import binary_tree


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 48, 64])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    bb = common.backbone("smollm2", torch.bfloat16, backend="fast")
    cache = bb.new_cache()
    bb.forward(torch.randint(100, 1000, (1, args.context), generator=torch.Generator().manual_seed(0)), cache,
               need_logits=False)  # builds the extension too
    ops = native.loaded()
    if ops is None or not ops.listed_attention_amx():
        raise SystemExit("attention_ab: needs the native extension on a CPU with AMX")
    gen = torch.Generator().manual_seed(1)
    times: dict[str, dict[int, list[float]]] = {"amx": {}, "vector": {}}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for kernel in (("amx", "vector") if rep % 2 else ("vector", "amx")):
            ops.set_listed_attention_amx(kernel == "amx")
            for n in args.sizes:
                mask, depth = binary_tree(n)
                toks = torch.randint(100, 1000, (1, n), generator=gen)
                t = time.perf_counter()
                bb.forward(toks, cache, (depth + args.context)[None], mask)
                dt = time.perf_counter() - t
                cache.compact(args.context, [])
                if rep:
                    times[kernel].setdefault(n, []).append(dt * 1000)
    ops.set_listed_attention_amx(True)
    ms = {k: {n: round(statistics.median(v), 2) for n, v in t.items()} for k, t in times.items()}
    info = common.machine()
    print(f"{common.machine_line(info)}; bf16, binary trees, context {args.context}, median of {args.reps}\n")
    print("| nodes | AMX ms | rel | vector ms | rel | AMX saves |\n|---:|---:|---:|---:|---:|---:|")
    first = args.sizes[0]
    for n in args.sizes:
        a, v = ms["amx"][n], ms["vector"][n]
        print(f"| {n} | {a} | {a / ms['amx'][first]:.3f} | {v} | {v / ms['vector'][first]:.3f} | {v - a:.2f} ms |")
    if args.out:
        print()
        common.write_json(args.out, {"machine": info, "context": args.context, "reps": args.reps, "ms": ms}, indent=2)


if __name__ == "__main__":
    main()
