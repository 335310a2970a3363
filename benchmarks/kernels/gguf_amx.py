"""The GGUF integer kernel's AMX int8 tiles against its vector code, in one process.

``q_linear`` runs calls of 16 rows or more on AMX int8 tiles where the CPU has them
(``native/gemm_qi.cpp``); the bits are the vector code's, so only time differs. This switches
the tiles on and off around each call (``set_q_amx``), interleaved: per matrix of SmolLM2's shapes
(Q4_1 gate/up and down, the Q8_0 LM head; hot, the same weights repeated) and for whole
``--quant gguf`` forwards over binary trees after a 200-token context (``verify_cost.curve``).
Calls of fewer than 16 rows never take the tiles, so both columns time the vector code there.

Usage:  python benchmarks/kernels/gguf_amx.py [--rows 2 8 16 32] [--sizes 1 8 16 32] [--reps 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import verify_cost  # noqa: E402
from cadence.fast import native  # noqa: E402

SHAPES = {"gate_up Q4_1": ("Q4_1", 576, 3072), "down Q4_1": ("Q4_1", 1536, 576), "lm_head Q8_0": ("Q8_0", 576, 49152)}


class Switched:
    """A backbone whose forwards run with the AMX tiles on or off."""

    def __init__(self, bb, ops, on: bool):
        self.bb, self.ops, self.on = bb, ops, on

    @property
    def device(self):
        return self.bb.device

    def new_cache(self):
        return self.bb.new_cache()

    def forward(self, *args, **kwargs):
        self.ops.set_q_amx(self.on)
        return self.bb.forward(*args, **kwargs)


def kernel_rows(ops, rows: list[int]) -> dict:
    import gguf
    from gguf.quants import quantize

    out = {}
    for name, (qt, k, n) in SHAPES.items():
        tid = int(getattr(gguf.GGMLQuantizationType, qt))
        w = torch.randn(n, k).numpy()
        blocks = torch.from_numpy(quantize(w, tid).view(np.uint8)).reshape(n, -1).contiguous()
        packed, pt = ops.q_pack(blocks, tid, k), ops.q_packed_type(tid, k)
        reps = 20 if n < 10000 else 5
        out[name] = {}
        for m in rows:
            x = torch.randn(m, k)
            best = {False: float("inf"), True: float("inf")}
            for _ in range(3):
                for on in (False, True):
                    ops.set_q_amx(on)
                    for _ in range(2):
                        ops.q_linear(x, packed, pt, n, None)
                    t = time.perf_counter()
                    for _ in range(reps):
                        ops.q_linear(x, packed, pt, n, None)
                    best[on] = min(best[on], (time.perf_counter() - t) / reps * 1e6)
            out[name][str(m)] = {"vector_us": round(best[False], 1), "amx_us": round(best[True], 1)}
            print(f"{name}, {m} rows: vector {best[False]:.0f} us, AMX tiles {best[True]:.0f} us", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 8, 16, 32])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ops = native.module()
    if ops is None or not ops.q_amx():
        sys.exit("gguf_amx: needs the native extension on a CPU with AMX-INT8 (and CADENCE_AMX not 0)")
    torch.set_num_threads(2)
    print(f"Machine: {common.machine_line(common.machine())}\n")
    result = {"machine": common.machine(), "kernels": kernel_rows(ops, args.rows)}
    bb = common.backbone("smollm2", "float32", backend="fast", quant="gguf")
    curve = verify_cost.curve({"vector": Switched(bb, ops, False), "amx": Switched(bb, ops, True)}, 200,
                              args.sizes, args.reps)
    ops.set_q_amx(True)
    result["forward_ms"] = {name: c["ms"] for name, c in curve.items()}
    for name, c in curve.items():
        print(f"whole forwards, {name}: " + ", ".join(f"T({n}) {ms} ms" for n, ms in c["ms"].items()))
    if args.out:
        common.write_json(args.out, result)


if __name__ == "__main__":
    main()
