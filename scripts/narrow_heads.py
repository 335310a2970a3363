"""Narrow the SwiGLU blocks of attention-bearing heads (eagle, mtp-attn) to a smaller width.

Usage: python scripts/narrow_heads.py SRC_DIR DST_DIR --width 1408
Keeps each block's strongest units (``cadence.heads.attn_block.narrow_mlp``) and writes a
heads directory with ``intermediate_size`` = width; continue it with
``cadence train --init-from DST_DIR`` (narrowing alone costs accuracy). Calibration is dropped.
"""

import argparse

from cadence.backbone.load import load_backbone
from cadence.heads import load_heads, save_heads
from cadence.heads.attn_block import Block, narrow_mlp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--width", type=int, required=True, help="SwiGLU units to keep per block")
    args = ap.parse_args()
    backbone = load_backbone()
    heads = load_heads(args.src, backbone)
    blocks = [m for m in heads.modules() if isinstance(m, Block)]
    if not blocks:
        raise SystemExit(f"{args.src}: {heads.cfg.kind} heads have no attention blocks to narrow")
    for b in blocks:
        narrow_mlp(b, args.width)
    heads.cfg.intermediate_size = args.width
    save_heads(heads, args.dst)
    n = sum(p.numel() for p in heads.parameters())
    print(f"{args.dst}: {len(blocks)} blocks narrowed to {args.width} units, {n / 1e6:.2f} M parameters")


if __name__ == "__main__":
    main()
