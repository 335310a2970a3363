"""Drafting products by row count: the dense kernel against Q8_0 blocks (``--draft-weights``).

Times ``x @ W.T`` for the drafter-sized matrices of eagle on SmolLM2 (the 8,192-row draft LM
head, the layer's fused gate/up, eagle-taps' ``fc``) at 1..32 rows, hot (the same call
repeated) and cold (300 MB streamed between calls, as after a verify forward), for the dense
kind this machine picks for the heads' dtype (``kernels.resolve_kind``) and for ``Linear.q8_0``.
A dynamic tree at T = 0 drafts at most ``--dyn-topk`` (4) rows per level; static trees at T > 0
draft whole levels (often 8-16 rows).

Usage:  python benchmarks/kernels/draft_kernels.py [--dtype bfloat16] [--rows 1 4 8 16 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.fast.kernels import Linear, resolve_kind  # noqa: E402

SHAPES = {"lm_head_8192": (8192, 576), "gate_up": (3072, 576), "fc_taps": (576, 2880)}


def hot(f, x, n: int = 100) -> float:
    for _ in range(5):
        f(x)
    t = time.perf_counter()
    for _ in range(n):
        f(x)
    return (time.perf_counter() - t) / n


def cold(f, x, junk: torch.Tensor, n: int = 30) -> float:
    total = 0.0
    for _ in range(n):
        junk.add_(1.0)  # evict: stream 300 MB
        t = time.perf_counter()
        f(x)
        total += time.perf_counter() - t
    return total / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    torch.manual_seed(0)
    junk = torch.ones(75_000_000)
    rows = []
    for name, (out, inp) in SHAPES.items():
        w = (torch.randn(out, inp) * 0.05).to(dt)
        kind = resolve_kind("auto", w.device, dt)
        dense, q8 = Linear(w, None, kind), Linear.q8_0(w)
        for m in args.rows:
            x = torch.randn(m, inp).to(dt)
            r = {"matrix": name, "rows": m, "dense_kind": kind,
                 "dense_hot_ms": hot(dense, x) * 1e3, "q8_0_hot_ms": hot(q8, x) * 1e3,
                 "dense_cold_ms": cold(dense, x, junk) * 1e3, "q8_0_cold_ms": cold(q8, x, junk) * 1e3}
            rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    print(f"Machine: {common.machine_line()}; heads dtype {args.dtype}\n")
    print("| matrix | rows | dense kind | dense hot ms | Q8_0 hot ms | dense cold ms | Q8_0 cold ms |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['matrix']} | {r['rows']} | {r['dense_kind']} | {r['dense_hot_ms']} | {r['q8_0_hot_ms']} | "
              f"{r['dense_cold_ms']} | {r['q8_0_cold_ms']} |")
    if args.out:
        common.write_json(args.out, {"machine": common.machine(), "dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
