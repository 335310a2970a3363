"""Copy trained heads into the package (bf16 weights) as the default set for SmolLM2.

Usage: python scripts/ship_heads.py runs/hydra/heads hydra
Keeps the training metadata and calibration (tree, acceptance) from the source config.
"""

import json
import shutil
import sys
from pathlib import Path

import torch

from cadence.backbone.load import load_backbone
from cadence.heads import load_heads, save_heads


def main(src: str, kind: str) -> None:
    src_dir = Path(src)
    dst = Path(__file__).resolve().parents[1] / "src/cadence/assets/heads/smollm2" / kind
    backbone = load_backbone()
    heads = load_heads(src_dir, backbone)
    conf = json.loads((src_dir / "config.json").read_text())
    extra = {k: v for k, v in conf.items() if k not in heads.cfg.to_dict()}
    save_heads(heads, dst, dtype=torch.bfloat16, extra_config=extra)
    if (src_dir / "calibration.json").exists():
        shutil.copy(src_dir / "calibration.json", dst / "calibration.json")
    size = sum(p.stat().st_size for p in dst.iterdir()) / 1e6
    print(f"{dst}: {size:.1f} MB")


if __name__ == "__main__":
    main(*sys.argv[1:3])
