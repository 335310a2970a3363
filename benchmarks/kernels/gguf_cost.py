"""The ``gguf`` kernel (``fast/native/gemm_q.cpp``) against fp32 dense products: ms per call
for 1..64 rows at the default model's shapes, with its real GGUF blocks (SmolLM2-135M Q4_1:
layers in Q4_1, the tied LM head / embedding in Q8_0).

Matrices as the fast decoder fuses them: qkv (960 x 576), o (576 x 576), gate_up (3072 x 576),
down (576 x 1536), each timed across all 30 layers' matrices in turn (as a forward meets
them: the weights stream from memory, not from L2), and the LM head (49152 x 576). Kernels:
``gguf`` (the file's blocks), ``onednn`` (prepacked fp32, what ``--dtype float32`` ran before)
and ``aten`` (``F.linear`` on the dense fp32 weights). The extension and torch run at this
process's instruction set: run it under ``CADENCE_ISA=avx2`` (with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``) or ``avx512`` to time those paths.
Median of ``--reps`` timings, kernels interleaved.

Usage:  python benchmarks/kernels/gguf_cost.py [--rows 1 2 4 8 16 32 64] [--reps 5] [--out FILE]
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
from cadence.backbone.load import smollm2_gguf_path
from cadence.fast import native
from cadence.system.machine import isa, isa_mismatch
from cadence.fast.gguf import GGUFWeights
from cadence.fast.kernels import Linear

LAYERS = 30
MATRICES = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
            "down": ("ffn_down",)}


def timed(lins: list, x: torch.Tensor, rounds: int) -> float:
    """ms per call, cycling through ``lins``."""
    t = time.perf_counter()
    for _ in range(rounds):
        for lin in lins:
            lin(x)
    return (time.perf_counter() - t) / (rounds * len(lins)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the layers' matrices per timing")
    ap.add_argument("--kinds", nargs="+", default=["gguf", "onednn", "aten"])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ops = native.module()
    if ops is None:
        sys.exit("the native extension is unavailable here")
    problem = isa_mismatch()
    if problem:
        sys.exit(problem)
    file = GGUFWeights(smollm2_gguf_path())
    out: dict = {}
    print(f"CADENCE_ISA {isa()}, gguf kernel built for {ops.q_isa()}, torch {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads\n")
    print("| matrix | kernel | MB/call | " + " | ".join(f"{r}" for r in args.rows) + " | T(8)/T(1) |\n|---|---|---:|"
          + "---:|" * (len(args.rows) + 1))
    gen = torch.Generator().manual_seed(0)
    for name in list(MATRICES) + ["head"]:
        if name == "head":
            groups = [["token_embd.weight"]]
        else:
            groups = [[f"blk.{i}.{t}.weight" for t in MATRICES[name]] for i in range(LAYERS)]
        qtype = file.qtype(groups[0][0])
        blocks = [torch.cat([file.rows(t) for t in g]) for g in groups]
        k = blocks[0].shape[1] // {2: 18, 3: 20, 8: 34}[qtype] * 32  # bytes per block of 32: Q4_0, Q4_1, Q8_0
        lins: dict = {}
        for b in blocks:
            q = Linear.from_blocks(b, qtype, k, None)
            lins.setdefault("gguf", []).append(q)
            dense = q.to_dense()  # the file's dequantized weights, as the fp32 path holds them
            for kind in args.kinds:
                if kind != "gguf":
                    lins.setdefault(kind, []).append(Linear(dense.clone(), None, kind))
        mb = {kind: lins[kind][0].nbytes() / 1e6 for kind in args.kinds}
        res: dict = {kind: {} for kind in args.kinds}
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen)
            for kind in args.kinds:
                timed(lins[kind], x, 1)
            times: dict = {kind: [] for kind in args.kinds}
            for rep in range(args.reps):
                for kind in (args.kinds if rep % 2 == 0 else args.kinds[::-1]):
                    times[kind].append(timed(lins[kind], x, args.rounds if name != "head" else 3 * args.rounds))
            for kind in args.kinds:
                res[kind][str(rows)] = round(statistics.median(times[kind]), 4)
        for kind in args.kinds:
            t = res[kind]
            ratio = t["8"] / t["1"] if "8" in t and "1" in t else float("nan")
            print(f"| {name} | {kind} | {mb[kind]:.2f} | " + " | ".join(f"{t[str(r)]:.3f}" for r in args.rows)
                  + f" | {ratio:.2f} |", flush=True)
        out[name] = {"ms": res, "mb_per_call": mb, "type": file.type_name(groups[0][0])}
        del lins, blocks
    info = common.machine()
    print("\n" + common.machine_line(info))
    if args.out:
        common.write_json(args.out, {"machine": info, "isa": isa(), "gguf_isa": ops.q_isa(),
                                     "torch_capability": torch.backends.cpu.get_cpu_capability(),
                                     "threads": torch.get_num_threads(), "rows": args.rows, "by_matrix": out})


if __name__ == "__main__":
    main()
