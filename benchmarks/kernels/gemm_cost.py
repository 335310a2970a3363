"""The projections' matrix products alone: microseconds per call of each kernel kind
(``fast/kernels.py``: ``amx``, ``onednn``, ``int8``...) at SmolLM2's shapes (qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536, LM head 49152x576) in bf16, for 1..64 rows.
As a forward meets them, each layer's weights are read once per forward: a call cycles
through ``--copies`` different weight matrices of the shape (30 = SmolLM2's layers; the
head has one), so the weights stream from memory or the last-level cache, not from L2.
Median of ``--reps`` runs, kinds interleaved; the extra columns give T(rows) - T(1).

Usage:  python benchmarks/kernels/gemm_cost.py [--kinds amx onednn] [--rows 1 8 32] [--reps 5]
        [--copies 30] [--out FILE]
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
from cadence.fast.kernels import Linear, resolve_kind

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def timed(lins: list[Linear], x: torch.Tensor, rounds: int) -> float:
    t = time.perf_counter()
    for _ in range(rounds):
        for lin in lins:
            lin(x)
    return (time.perf_counter() - t) / (rounds * len(lins)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", nargs="+", default=["amx", "onednn"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=10, help="passes over the copies per timing")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cpu, bf = torch.device("cpu"), torch.bfloat16
    kinds = []
    for kind in args.kinds:
        try:
            kinds.append(resolve_kind(kind, cpu, bf))
        except ValueError as exc:
            print(f"skipping {kind}: {exc}")
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    print("| matrix | kernel | " + " | ".join(f"{r} rows us" for r in args.rows) + " | extra at "
          + f"{args.rows[-1]} us |\n|---|---|" + "---:|" * (len(args.rows) + 1))
    for name, (n, k) in SHAPES.items():
        copies = 1 if name == "head" else args.copies
        weights = [(torch.randn(n, k, generator=gen) * 0.05).to(bf) for _ in range(copies)]
        lins = {kind: [Linear(w, None, kind) for w in weights] for kind in kinds}
        del weights
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen).to(bf)
            for kind in kinds:
                timed(lins[kind], x, 1)
            times: dict = {kind: [] for kind in kinds}
            for _ in range(args.reps):
                for kind in kinds:
                    times[kind].append(timed(lins[kind], x, args.rounds))
            for kind in kinds:
                out.setdefault(name, {}).setdefault(kind, {})[str(rows)] = round(statistics.median(times[kind]), 1)
        for kind in kinds:
            t = out[name][kind]
            cells = " | ".join(f"{t[str(r)]:.1f}" for r in args.rows)
            print(f"| {name} | {kind} | {cells} | {t[str(args.rows[-1])] - t[str(args.rows[0])]:.1f} |", flush=True)
    info = common.machine()
    print(common.machine_line(info))
    if args.out:
        common.write_json(args.out, {"machine": info, "threads": torch.get_num_threads(), "copies": args.copies,
                                     "us": out})


if __name__ == "__main__":
    main()
