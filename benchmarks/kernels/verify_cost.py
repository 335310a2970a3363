"""Verify-latency curve and plain decoding speed: fast path vs transformers, on this machine.

1. The time of one backbone forward over n tree nodes (n = 1..64; a binary tree's mask
   and positions, or with ``--shape chain`` a chain's: what the engine drafts on a
   row-consistent bf16 backbone, where a branching tree attends once per root-to-leaf path;
   logits for every node, as a verify pass needs) on a fixed context, for
   each backend and dtype (fp32; bf16 only where the CPU computes bf16 natively), median of
   interleaved repetitions (every rep runs every (backend, n) once, the sizes in a new
   random order, the backend order alternating), relative to n = 1, and the knee: the first n whose cost exceeds 1.3x T(1).
2. Greedy decoding tokens/s on a few prompts: transformers ``generate`` against a plain
   greedy loop over the fast backbone's ``forward`` (and cadence's engine with no drafter,
   when ``cadence.decode.engine`` imports), interleaved per prompt, warm-up excluded, with the rate
   of outputs identical to ``generate`` in the same dtype.

Usage:  python benchmarks/kernels/verify_cost.py [--model smollm2] [--context 200] [--reps 7]
            [--max-new-tokens 128] [--dtypes float32 bfloat16] [--skip-generate] [--shape chain]
            [--kernels auto onednn]  (more than one: the fast path with each, interleaved in one run)
            [--quant gguf] [--quants none]  (the fast path's --quant; --quants: more fast paths in the run)
Writes runs/verify-cost-<cpu>[-chain].json (or --out) and prints markdown tables.
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
from cadence.system.machine import describe as cpu_features
from cadence.system.machine import native_bf16
from cadence.fast.model import FastBackbone

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PROMPTS = [
    "Explain how a hash table works, in a few sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
     "How many clips did Natalia sell altogether in April and May?"),
]


def binary_tree(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, n) bool ancestor mask and depths of the binary tree whose node i has parent (i-1)//2."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i in range(n):
        depth[i] = 0 if i == 0 else depth[parents[i]] + 1
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask, torch.tensor(depth)


@torch.inference_mode()
def tree_inputs(bb, sizes, context: int) -> tuple:
    """A cache holding a fixed random context of ``context`` tokens, and for each size n the
    (tokens (1, n), positions (1, n), mask (n, n)) of a binary tree after it: what
    ``phase_cost.py`` and ``gguf_prefetch.py`` time (``cache.compact(context, [])`` between forwards)."""
    ctx = torch.randint(100, 1000, (1, context), generator=torch.Generator().manual_seed(0))
    cache = bb.new_cache()
    bb.forward(ctx, cache, need_logits=False)
    gen = torch.Generator().manual_seed(1)
    inputs = {}
    for n in sizes:
        mask, depth = binary_tree(n)
        inputs[n] = (torch.randint(100, 1000, (1, n), generator=gen), (depth + context)[None], mask)
    return cache, inputs


def chain(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, n) causal mask and depths 0..n-1 of a chain of n nodes."""
    return torch.ones(n, n, dtype=torch.bool).tril(), torch.arange(n)


@torch.inference_mode()
def curve(backbones: dict, context: int, sizes, reps: int, shape=binary_tree) -> dict:
    ctx = torch.randint(100, 1000, (1, context), generator=torch.Generator().manual_seed(0))
    caches, times = {}, {name: {n: [] for n in sizes} for name in backbones}
    for name, bb in backbones.items():
        caches[name] = bb.new_cache()
        bb.forward(ctx.to(bb.device), caches[name], need_logits=False)
    trees = {n: shape(n) for n in sizes}
    gen = torch.Generator().manual_seed(1)
    names = list(backbones)
    order = torch.Generator().manual_seed(2)
    for rep in range(reps + 1):  # rep 0 warms up every shape
        # sizes in a new random order each rep: the first forward after another backbone's
        # (whose weights evicted this one's from the caches) is not always the 1-node one
        perm = [sizes[i] for i in torch.randperm(len(sizes), generator=order).tolist()]
        for name in (names if rep % 2 else names[::-1]):
            bb, cache = backbones[name], caches[name]
            for n in perm:
                mask, depth = trees[n]
                toks = torch.randint(100, 1000, (1, n), generator=gen).to(bb.device)
                pos = (depth + context)[None].to(bb.device)
                t = time.perf_counter()
                bb.forward(toks, cache, pos, mask)
                dt = time.perf_counter() - t
                cache.compact(context, [])  # drop the tree again
                if rep:
                    times[name][n].append(dt)
    out = {}
    for name in names:
        med = {n: statistics.median(v) * 1000 for n, v in times[name].items()}
        knee = next((n for n in sizes if med[n] > 1.3 * med[sizes[0]]), None)
        out[name] = {"ms": {str(n): round(m, 2) for n, m in med.items()},
                     "relative": {str(n): round(m / med[sizes[0]], 3) for n, m in med.items()},
                     "knee_1.3x": knee}
    return out


@torch.inference_mode()
def greedy_loop(bb, ids: list[int], max_new: int) -> list[int]:
    cache, eos, out = bb.new_cache(), bb.eos_token_ids, []
    logits = bb.forward(torch.tensor([ids], device=bb.device), cache).logits[0, -1]
    while len(out) < max_new:
        out.append(int(logits.argmax()))
        if out[-1] in eos:
            break
        logits = bb.forward(torch.tensor([[out[-1]]], device=bb.device), cache).logits[0, -1]
    return out


def hf_generate(bb, ids: list[int], max_new: int) -> list[int]:
    x = torch.tensor([ids], device=bb.device)
    y = bb.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False)
    return y[0, len(ids):].tolist()


def engine_vanilla(bb):
    try:
        from cadence.decode.engine import Engine
        from cadence.decode.generation import GenerationConfig
    except ImportError:  # the engine is optional here
        return None
    engine = Engine(bb)

    def run(_bb, ids, max_new):
        return list(engine.generate(ids, GenerationConfig(max_new_tokens=max_new)).tokens)
    return run


def decode_speed(hf_bb, fast_bb, max_new: int, others: dict | None = None) -> dict:
    runners = {"transformers generate": (hf_bb, hf_generate), "fast greedy loop": (fast_bb, greedy_loop)}
    eng = engine_vanilla(fast_bb)
    if eng is not None:
        runners["fast engine vanilla"] = (fast_bb, eng)
    for name, bb in (others or {}).items():  # the other fast paths' engines, interleaved with the rest
        eng = engine_vanilla(bb)
        if eng is not None:
            runners[f"{name} engine vanilla"] = (bb, eng)
    prompts = [hf_bb.encode_prompt(p, chat=True) for p in PROMPTS]
    for bb, fn in runners.values():  # warm-up
        fn(bb, prompts[0], 8)
    tot = {k: [0, 0.0] for k in runners}
    outs = {k: [] for k in runners}
    for i, ids in enumerate(prompts):
        order = list(runners) if i % 2 == 0 else list(runners)[::-1]
        for name in order:
            bb, fn = runners[name]
            t = time.perf_counter()
            toks = fn(bb, ids, max_new)
            tot[name][1] += time.perf_counter() - t
            tot[name][0] += len(toks)
            outs[name].append(toks)
    base = tot["transformers generate"][0] / tot["transformers generate"][1]
    res = {}
    for name, (n, s) in tot.items():
        same = sum(a == b for a, b in zip(outs[name], outs["transformers generate"]))
        res[name] = {"tokens": n, "seconds": round(s, 3), "tok_s": round(n / s, 2),
                     "vs_generate": round(n / s / base, 3), "identical": f"{same}/{len(prompts)}"}
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", nargs="+", default=None,
                    help="default: float32, plus bfloat16 when the CPU has native bf16")
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--shape", choices=["binary", "chain"], default="binary", help="tree shape timed")
    ap.add_argument("--kernels", nargs="+", default=["auto"],
                    help="fast-path projection kernels timed side by side (fast.kernels.KINDS), e.g. auto onednn")
    ap.add_argument("--quant", default="none", help="the fast path's --quant (none, int8, int4, gguf, auto)")
    ap.add_argument("--quants", nargs="*", default=[],
                    help="more fast paths with these --quant values, timed side by side (e.g. none gguf)")
    ap.add_argument("--out", default=None, help="default runs/verify-cost-<cpu>[-chain].json")
    args = ap.parse_args()
    dtypes = args.dtypes or (["float32", "bfloat16"] if native_bf16() else ["float32"])
    info = common.machine()
    out_path = common.out_path(args.out, f"verify-cost-{common.cpu_slug()}{'-chain' if args.shape == 'chain' else ''}.json")
    result = {"machine": info, "cpu_features": cpu_features(), "model": args.model, "context": args.context,
              "shape": args.shape, "reps": args.reps, "max_new_tokens": args.max_new_tokens, "by_dtype": {}}
    print(f"Machine: {common.machine_line(info)}; CPU features {cpu_features()}\n")
    for dt in dtypes:
        hf = common.backbone(args.model, dt, backend="transformers")
        fast = common.backbone(args.model, dt, backend="fast", quant=args.quant)
        others = {f"fast-{k}": FastBackbone.from_backbone(common.backbone(args.model, dt, backend="transformers"),
                                                          kernel=k) for k in args.kernels[1:]}
        others.update({f"fast-quant-{q}": common.backbone(args.model, dt, backend="fast", quant=q) for q in args.quants})
        entry = {"fast_kernel": fast.kernel, "fast_quant": fast.quant, "fast_resident_bytes": fast.resident_bytes(),
                 "curve": curve({"transformers": hf, "fast": fast, **others}, args.context, args.sizes, args.reps,
                                binary_tree if args.shape == "binary" else chain)}
        entry["kernels"] = {"fast": fast.kernels, **{name: bb.kernels for name, bb in others.items()}}
        if not args.skip_generate:
            entry["decode"] = decode_speed(hf, fast, args.max_new_tokens, others)
        result["by_dtype"][dt] = entry
        c = entry["curve"]
        print(f"### {dt} (fast kernel: {fast.kernel}), {args.shape} trees, context {args.context}, "
              f"median of {args.reps}\n")
        print("| nodes | transformers ms | rel | fast ms | rel | fast speedup |\n|---:|---:|---:|---:|---:|---:|")
        for n in args.sizes:
            a, b = c["transformers"], c["fast"]
            print(f"| {n} | {a['ms'][str(n)]} | {a['relative'][str(n)]} | {b['ms'][str(n)]} | "
                  f"{b['relative'][str(n)]} | {a['ms'][str(n)] / b['ms'][str(n)]:.2f}x |")
        print(f"\nknee (first n with T(n) > 1.3 T(1)): transformers {c['transformers']['knee_1.3x']}, "
              f"fast {c['fast']['knee_1.3x']}\n")
        for name in others:
            print(f"{name} ({entry['kernels'][name]}) against fast ({entry['kernels']['fast']}): "
                  + ", ".join(f"T({n}) {c[name]['ms'][str(n)]} ms ({c[name]['relative'][str(n)]}) vs "
                              f"{c['fast']['ms'][str(n)]} ({c['fast']['relative'][str(n)]})" for n in args.sizes) + "\n")
        if "decode" in entry:
            print("| greedy decoding | tokens | tok/s | vs generate | identical to generate |\n|---|---:|---:|---:|---:|")
            for name, d in entry["decode"].items():
                print(f"| {name} | {d['tokens']} | {d['tok_s']} | {d['vs_generate']}x | {d['identical']} |")
            print()
        del hf, fast, others
        common.write_json(out_path, result, indent=2, quiet=True)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
