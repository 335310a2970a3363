"""The fused elementwise kernels alone (``fast/native/fused.cpp``): microseconds per call of
``silu_mul`` (SwiGLU gate), ``add_rms_norm`` (residual add + next norm), ``rms_norm`` and
``rope`` at SmolLM2's widths (intermediate 1536, hidden 576, 12 q+k heads of 64) in bf16, for
1-token (2 padded rows) and 32-node verify forwards, against ATen's form of the same op.
A decoder layer calls silu_mul and rope once and add_rms_norm twice. Median of ``--reps``
runs of ``--calls`` calls, kernels interleaved.

Usage:  python benchmarks/kernels/fused_cost.py [--rows 2 32] [--reps 7] [--calls 2000] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.fast import native, rope
from cadence.fast.model import _rms


def timed(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def kernels(ops, rows: int, gen: torch.Generator) -> dict:
    bf = torch.bfloat16
    gu = (torch.randn(1, rows, 3072, generator=gen) * 3).to(bf)
    x, d = ((torch.randn(1, rows, 576, generator=gen) * 3).to(bf) for _ in range(2))
    w = (torch.randn(576, generator=gen) * 0.5 + 1).to(bf)
    qk = torch.randn(1, rows, 12, 64, generator=gen).to(bf)
    cos, sin = (torch.randn(1, rows, 1, 64, generator=gen).to(bf) for _ in range(2))
    return {
        "silu_mul": (lambda: ops.silu_mul(gu), lambda: F.silu(gu[..., :1536]) * gu[..., 1536:]),
        "add_rms_norm": (lambda: ops.add_rms_norm(x, d, w, 1e-5), lambda: (x + d, _rms(x + d, w, 1e-5))),
        "rms_norm": (lambda: ops.rms_norm(x, w, 1e-5), lambda: _rms(x, w, 1e-5)),
        "rope": (lambda: ops.rope(qk, cos, sin), lambda: rope.apply(qk, cos, sin)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 32])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ops = native.module()
    if ops is None:
        raise SystemExit("the C++ extension could not be built here")
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    print("| kernel | rows | fused us | ATen us |\n|---|---:|---:|---:|")
    for rows in args.rows:
        for name, (fused, aten) in kernels(ops, rows, gen).items():
            for fn in (fused, aten):
                timed(fn, 50)
            a, b = [], []
            for _ in range(args.reps):
                a.append(timed(fused, args.calls))
                b.append(timed(aten, args.calls))
            out.setdefault(name, {})[str(rows)] = {"fused_us": round(statistics.median(a), 1),
                                                   "aten_us": round(statistics.median(b), 1)}
            print(f"| {name} | {rows} | {statistics.median(a):.1f} | {statistics.median(b):.1f} |", flush=True)
    layer = {r: out["silu_mul"][str(r)]["fused_us"] + out["rope"][str(r)]["fused_us"]
             + 2 * out["add_rms_norm"][str(r)]["fused_us"] for r in args.rows}
    print("per decoder layer (silu_mul + rope + 2 add_rms_norm): "
          + ", ".join(f"{r} rows {v:.1f} us" for r, v in layer.items()))
    info = common.machine()
    print(common.machine_line(info))
    if args.out:
        common.write_json(args.out, {"machine": info, "threads": torch.get_num_threads(), "kernels": out,
                                     "per_layer_us": layer})


if __name__ == "__main__":
    main()
