"""Attention alone: ``listed_attention`` (``fast/native/attention.cpp``) against PyTorch's CPU
kernel in the form the row-consistent path used before it (grouped query heads folded into
rows, at least 4 query rows, an additive mask), at SmolLM2's shape (9 heads, 3 KV heads,
head_dim 64, bf16) over a context of ``--keys`` cached keys, for 1..32 query rows (a chain:
row r sees the context and rows 0..r). Microseconds per call, median of ``--reps`` runs of
``--calls`` calls, both kernels interleaved.

Usage:  python benchmarks/kernels/attention_cost.py [--keys 320] [--rows 1 4 8 16 32] [--out FILE]
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
from cadence.fast import consistent, native


def timed(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=320)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ops = native.module()
    if ops is None:
        raise SystemExit("the C++ extension could not be built here")
    H, KV, D, bf = 9, 3, 64, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, KV, args.keys + 64, D, generator=gen).to(bf) for _ in range(2))
    rows = {}
    for n in args.rows:
        past = args.keys - n
        q = torch.randn(1, H, n, D, generator=gen).to(bf)
        lists = consistent.key_lists(torch.ones(n, n, dtype=torch.bool).tril_()[None], [past])
        mask = torch.zeros(n, args.keys + 64, dtype=torch.bool)  # keys rounded up as the padded path did
        mask[:, :past] = True
        mask[:, past:past + n] = torch.ones(n, n, dtype=torch.bool).tril_()
        m = max(n, consistent.MIN_QUERIES)
        qq = torch.cat([q, q[:, :, -1:].expand(-1, -1, m - n, -1)], dim=2) if m > n else q
        folded = consistent.fold_mask(consistent.pad_mask_rows(mask) if m > n else mask, H // KV, bf)

        def listed():
            return ops.listed_attention(q, k, v, *lists, D ** -0.5)

        def sdpa():
            return F.scaled_dot_product_attention(qq.reshape(1, KV, H // KV * m, D), k, v, attn_mask=folded)

        for fn in (listed, sdpa):
            timed(fn, 50)
        a, b = [], []
        for _ in range(args.reps):
            a.append(timed(listed, args.calls))
            b.append(timed(sdpa, args.calls))
        rows[n] = {"listed_us": round(statistics.median(a), 1), "sdpa_padded_us": round(statistics.median(b), 1)}
        print(f"{n:3d} rows: listed {rows[n]['listed_us']:7.1f} us   PyTorch (padded, folded) "
              f"{rows[n]['sdpa_padded_us']:7.1f} us", flush=True)
    info = common.machine()
    print(common.machine_line(info))
    if args.out:
        common.write_json(args.out, {"machine": info, "keys": args.keys, "heads": H, "kv_heads": KV, "head_dim": D,
                                     "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
