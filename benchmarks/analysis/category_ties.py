"""Where `benchmarks/e2e/categories.py` found an output that differs from vanilla: was it a near-tie?

For every (prompt, method) row of a categories result whose tokens differed from
vanilla's, both are generated again in the run's dtype, and at the first differing
position the backbone's logits are recomputed by one plain forward over prompt + common
prefix. Prints the top-2 logit gap there and how far the speculative token's logit is
below the top one. A gap of about one rounding step of the dtype (bf16: 0.125 at these
magnitudes; fp32: about 1e-5) means the one-token and the tree forward legitimately
rounded to different winners. A rerun can also come out identical (the divergence
depended on state such as the cache's key blocks).

Usage:  python benchmarks/analysis/category_ties.py runs/categories.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import sys
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.decode.generation import GenerationConfig
from cadence.methods import MethodSpec, make_engine

common.use("e2e")
from categories import PROMPTS, parse_method  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", default=str(PROMPTS))
    args = ap.parse_args()
    res = json.loads(Path(args.result).read_text())
    dtype = res["dtype"].replace("torch.", "")
    bb = common.backbone(args.model, dtype, backend="fast" if res["backend"] == "FastBackbone" else "transformers")
    items = {it["id"]: it for it in map(json.loads, Path(args.prompts).read_text().splitlines()) if it}
    vanilla = make_engine(bb, MethodSpec.parse("vanilla"))
    cfg = GenerationConfig(max_new_tokens=res["max_new_tokens"])
    for row in res["rows"]:
        if row["identical"] or row["method"] == "vanilla":
            continue
        ids = bb.encode_prompt(items[row["id"]]["prompt"], chat=True)
        a = vanilla.generate(ids, cfg).tokens
        b = make_engine(bb, parse_method(row["method"])).generate(ids, cfg).tokens
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            print(f"{row['id']} {row['method']}: identical on rerun")
            continue
        with torch.inference_mode():
            logits = bb.forward(torch.tensor([ids + a[:i]], device=bb.device)).logits[0, -1].float()
        top = logits.topk(2)
        print(f"{row['id']} {row['method']}: first difference at token {i} (vanilla {a[i]}, speculative {b[i]}); "
              f"top-2 logit gap {float(top.values[0] - top.values[1]):.4f}, speculative token "
              f"{float(logits.max() - logits[b[i]]):.4f} below the top")


if __name__ == "__main__":
    main()
