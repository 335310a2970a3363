"""Engine overhead and the cost of verification on this machine.

1. `vanilla` (cadence's engine with no drafter) vs transformers `generate` on the same
   model and prompts, interleaved per prompt, warm-up excluded: tokens/s and ratio.
2. The time of one backbone forward over 1, 2, 4, 8, 16, 32, 64 tree nodes (``--sizes``;
   logits for every node, as the engine does; the latency probe's trees: bushy, or chains
   on a ``chains_only`` backbone such as lossless bf16) on a fixed-length context, lower
   quartile of several runs, relative to 1 node.

Usage:  python benchmarks/kernels/overhead.py [--model smollm2] [--max-new-tokens 128] [--repeats 2]
Writes runs/overhead.json (or --out) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.costs.latency import measure

PROMPTS = [
    "Explain how a hash table works, in a few sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a short poem about autumn leaves.",
]


def time_hf(bb, ids, n):
    t = time.perf_counter()
    out = bb.model.generate(torch.tensor([ids], device=bb.device), max_new_tokens=n, do_sample=False)
    return out.shape[1] - len(ids), time.perf_counter() - t


def time_engine(engine, ids, n):
    g = engine.generate(ids, GenerationConfig(max_new_tokens=n))
    return g.stats.new_tokens, g.stats.wall_s


def engine_vs_generate(bb, max_new, repeats):
    engine = Engine(bb)
    ids0 = bb.encode_prompt(PROMPTS[0], chat=True)
    time_hf(bb, ids0, 16), time_engine(engine, ids0, 16)  # warm-up
    tot = {"hf": [0, 0.0], "vanilla": [0, 0.0]}
    for r in range(repeats):
        for p in PROMPTS:
            ids = bb.encode_prompt(p, chat=True)
            order = [("hf", time_hf), ("vanilla", time_engine)]
            if r % 2:
                order.reverse()  # alternate who goes first
            for name, fn in order:
                n, s = fn(bb if name == "hf" else engine, ids, max_new)
                tot[name][0] += n
                tot[name][1] += s
    tps = {k: v[0] / v[1] for k, v in tot.items()}
    return {"hf_generate_tok_s": tps["hf"], "vanilla_tok_s": tps["vanilla"],
            "vanilla_over_hf": tps["vanilla"] / tps["hf"], "tokens": {k: v[0] for k, v in tot.items()}}


def forward_costs(bb, context=200, sizes=(1, 4, 16, 32, 64), reps=9, chains=None):
    """The verify-latency probe of ``cadence.costs.latency`` (the forward the engine runs)."""
    curve = measure(bb, sizes, context=context, rounds=reps, chains=chains)
    base = curve(sizes[0])
    return {str(n): {"ms": round(curve(n) * 1000, 2), "relative": round(curve(n) / base, 2)} for n in sizes}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="backbone dtype: auto | float32 | bfloat16")
    ap.add_argument("--skip-generate", action="store_true", help="only the forward-cost curve")
    ap.add_argument("--quant", default="none", help="none | int8 | int4 (weight-only)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="tree sizes to time")
    ap.add_argument("--shape", default="auto", choices=["auto", "chain", "bushy"],
                    help="probe trees: auto = what the backbone's trees are (chains where chains_only)")
    ap.add_argument("--out", default=str(common.RUNS / "overhead.json"))
    args = ap.parse_args()
    bb = common.backbone(args.model, args.dtype, quant=args.quant)
    info = common.machine()
    speed = None if args.skip_generate else engine_vs_generate(bb, args.max_new_tokens, args.repeats)
    chains = None if args.shape == "auto" else args.shape == "chain"
    costs = forward_costs(bb, sizes=tuple(args.sizes), chains=chains)
    if chains is None:
        chains = getattr(bb, "chains_only", False)
    shape = "chains" if chains else "bushy trees"
    result = {"machine": info, "model": bb.name, "dtype": str(bb.dtype), "quant": args.quant, "tree_shape": shape,
              "max_new_tokens": args.max_new_tokens,
              "prompts": len(PROMPTS), "repeats": args.repeats, "engine_vs_generate": speed,
              "forward_cost_by_nodes": costs}
    common.write_json(args.out, result, indent=2)
    print(f"Machine: {common.machine_line(info)}; backbone {bb.dtype}, quant {args.quant}, probe trees: {shape}\n")
    if speed:
        print("| decoder | tok/s |\n|---|---|")
        print(f"| transformers generate | {speed['hf_generate_tok_s']:.2f} |")
        print(f"| cadence vanilla | {speed['vanilla_tok_s']:.2f} ({speed['vanilla_over_hf']:.3f}x) |\n")
    print("| tree nodes | forward ms | relative to 1 |\n|---|---|---|")
    for n, c in costs.items():
        print(f"| {n} | {c['ms']} | {c['relative']} |")


if __name__ == "__main__":
    main()
