"""Where a speculative output differs from vanilla, was it a near-tie?

For every (task, prompt, method) of a `cadence bench` run whose tokens differ from
vanilla's, find the first differing position and recompute the backbone's logits there
(one plain forward over prompt + the common prefix, in the run's dtype and in float32).
Prints the gap between the top-2 logits and the two competing tokens. A gap near the
dtype's rounding noise (bf16: about 0.1 at these logit magnitudes; fp32: about 1e-5) means
the two kernels (one-token vs tree forward) legitimately rounded to different winners.

Usage: python benchmarks/analysis/near_ties.py runs/bench-bf16 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import sys
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.bench.tasks import load_task


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def gap_at(bb, ids: list[int]) -> tuple[float, list[int]]:
    logits = bb.forward(torch.tensor([ids], device=bb.device)).logits[0, -1]
    top = logits.topk(2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a cadence bench --out directory")
    ap.add_argument("--dtype", default=None, help="dtype of the run (default: from run.json)")
    args = ap.parse_args()
    run = Path(args.run)
    conf = json.loads((run / "run.json").read_text())
    dtype = args.dtype or conf.get("dtype", "auto")
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines() if line.strip()]
    vanilla = {(r["task"], r["key"], r["repeat"]): r["tokens"] for r in records if r["method"] == "vanilla"}
    models = {d: common.backbone(conf.get("model", "smollm2"), d) for d in (dtype, "float32")}
    prompts = {}
    print("| task | prompt | method | first diff | tokens (vanilla, method) | top-2 gap run dtype | top-2 gap fp32 |")
    print("|---|---|---|---|---|---|---|")
    for r in records:
        ref = vanilla.get((r["task"], r["key"], r["repeat"]))
        if r["method"] == "vanilla" or ref is None or r["tokens"] == ref:
            continue
        i = first_diff(ref, r["tokens"])
        if i is None or i >= min(len(ref), len(r["tokens"])):
            continue
        if r["task"] not in prompts:
            prompts[r["task"]] = {it.key: it.prompt for it in load_task(r["task"]).items}
        bb = models[dtype]
        ids = bb.encode_prompt(prompts[r["task"]][r["key"]], chat=True) + ref[:i]
        g_run, top = gap_at(bb, ids)
        g32, _ = gap_at(models["float32"], ids)
        print(f"| {r['task']} | {r['key']} | {r['method']} | {i} | {ref[i]}, {r['tokens'][i]} (top-2 {top}) "
              f"| {g_run:.4f} | {g32:.4f} |")


if __name__ == "__main__":
    main()
