"""Which backbone path decodes fastest on this machine: plain (and optionally speculative)
decoding on two or more precision paths of the same model, interleaved in one run.

A path is ``DTYPE[:QUANT]`` as ``cadence generate --dtype D --quant Q`` takes them (QUANT left
out: ``auto``, as on the command line), e.g. ``auto`` (the default path: a GGUF model's own Q4/Q8
blocks with 8-bit activations), ``auto:none`` (bf16 where the CPU computes bf16 natively) and
``float32:gguf``. Every prompt runs on every (path, method) pair in an
order that alternates between prompts, after one warm-up generation each; speed is pooled
tokens over pooled seconds. ``agree`` is the share of generations whose tokens equal the
first path's plain decoding (paths round differently, so replies may part at near-ties);
``identical`` the share equal to the same path's plain decoding (speculation is lossless on
every path, so this must be 100%).

Usage:  python benchmarks/e2e/paths.py [--paths auto:none auto] [--methods vanilla eagle@eagle-taps]
            [--prompts benchmarks/prompts/categories.jsonl] [--limit 28] [--max-new-tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.decode.engine import Engine  # noqa: E402
from cadence.decode.generation import GenerationConfig  # noqa: E402
from cadence.methods import MethodSpec, make_engine  # noqa: E402
from cadence.prompts import jsonl_items  # noqa: E402


def parse_path(text: str) -> tuple[str, str]:
    """'float32:gguf' -> ('float32', 'gguf'); 'auto' -> ('auto', 'auto'); 'auto:none' -> ('auto', 'none')."""
    dtype, _, quant = text.partition(":")
    return dtype, quant or "auto"


def spread(items: list, n: int) -> list:
    """n items taken evenly over the list, so every category of a sorted file is in.
    Example: 8 items, n 4 -> items 0, 2, 4, 6."""
    if n <= 0 or n >= len(items):
        return items
    return [items[i * len(items) // n] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--paths", nargs="+", default=["auto:none", "auto"])
    ap.add_argument("--methods", nargs="+", default=["vanilla", "eagle@eagle-taps"])
    ap.add_argument("--prompts", default="benchmarks/prompts/categories.jsonl")
    ap.add_argument("--limit", type=int, default=28, help="prompts, spread over the file (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    items = spread(list(jsonl_items(args.prompts)), args.limit)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    runs = {}  # (path, method) -> engine
    for p in args.paths:
        dtype, quant = parse_path(p)
        bb = common.backbone(args.model, dtype, quant=quant)
        for m in args.methods:
            runs[(p, m)] = (bb, Engine(bb) if m == "vanilla" else make_engine(bb, MethodSpec.parse(m)))
    prompts = {p: [bb.encode_prompt(it.prompt, chat=True) for it in items]
               for p, bb in {p: runs[(p, args.methods[0])][0] for p in args.paths}.items()}
    for (p, m), (_, eng) in runs.items():  # warm-up (and the latency curve, measured once per path)
        eng.generate(prompts[p][0], cfg)
    tot = {k: {"tokens": 0, "seconds": 0.0, "agree": 0, "identical": 0} for k in runs}
    first = (args.paths[0], "vanilla")
    order = list(runs)
    for i in range(len(items)):
        outs = {}
        for key in (order if i % 2 == 0 else order[::-1]):
            p, _ = key
            t = time.perf_counter()
            out = runs[key][1].generate(prompts[p][i], cfg)
            tot[key]["seconds"] += time.perf_counter() - t
            tot[key]["tokens"] += len(out.tokens)
            outs[key] = out.tokens
        for (p, m) in runs:
            tot[(p, m)]["identical"] += outs[(p, m)] == outs.get((p, "vanilla"), outs[(p, m)])
            tot[(p, m)]["agree"] += outs[(p, m)] == outs.get(first, outs[(p, m)])
        print(f"prompt {i + 1}/{len(items)}", file=sys.stderr)
    base = tot.get(first)
    rows = []
    for (p, m), t in tot.items():
        rate = t["tokens"] / t["seconds"]
        rows.append({"path": p, "method": m, "tok_s": round(rate, 1),
                     "vs_first_plain": round(rate / (base["tokens"] / base["seconds"]), 3) if base else None,
                     "identical": f"{t['identical']}/{len(items)}", "agree": f"{t['agree']}/{len(items)}"})
    info = common.machine()
    print(f"Machine: {common.machine_line(info)}; {len(items)} prompts of {args.prompts}, "
          f"{args.max_new_tokens} new tokens, greedy\n")
    print(f"| path | method | tok/s | vs {args.paths[0]} plain | identical to its path's plain | same as {args.paths[0]} plain |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['path']} | {r['method']} | {r['tok_s']} | {r['vs_first_plain']}x | {r['identical']} | {r['agree']} |")
    if args.out:
        common.write_json(args.out, {"machine": info, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
