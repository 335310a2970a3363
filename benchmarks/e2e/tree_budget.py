"""How big a dynamic tree should be: node cap, head depth and top-k against plain decoding, in one run.

Every variant is one head set (``--method``, e.g. ``eagle@eagle-taps``) under the default
scheduler (dynamic trees on calibrated heads, context copy on) with some ``MethodSpec`` fields
overridden: ``nodes`` (``max_nodes``, the node budget, the most draft nodes a step verifies; this machine's
verify-latency curve may cut fewer), ``depth`` (``dyn_depth``, levels the heads draft; eagle's
layer serves any depth, other heads stop at K; context copy may go deeper), ``topk``
(``dyn_topk``, children per expanded node and nodes expanded per level). Variants and plain
decoding are interleaved per prompt, the order alternating, after one untimed warm-up each.

Per variant: tokens/s over plain decoding (total tokens / total seconds), tau, acceptance per
depth (share of steps that accepted at least d drafts), the mean verified nodes and depth, the
share of step time spent drafting (the drafter's calls, timed), and whether every output is
byte-identical to plain decoding.

The prompts default to ``benchmarks/prompts/tuning.jsonl``, the set for tuning (never the
judged ``categories.jsonl``).

Usage:  python benchmarks/e2e/tree_budget.py --method eagle@eagle-taps \
            --variants nodes=16 nodes=32 nodes=64 nodes=64,depth=5 [--max-new-tokens 128] [--out runs/tree-budget.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.methods import Method, MethodSpec, make_engine

FIELDS = {"nodes": "max_nodes", "depth": "dyn_depth", "topk": "dyn_topk"}  # DynamicOptions fields


def parse_variant(text: str) -> dict[str, int]:
    """'nodes=64,depth=5' -> {'max_nodes': 64, 'dyn_depth': 5}."""
    out = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in FIELDS or not value.isdigit():
            raise CadenceError(f"variant {text!r}: expected KEY=INT with KEY in {', '.join(FIELDS)}")
        out[FIELDS[key]] = int(value)
    return out


class DraftClock:
    """Seconds spent in the drafter's calls (drafting, dynamic drafting, shadow drafts, and
    ``commit``, where attention heads update their cache): wraps the engine's drafter."""

    CALLS = ("draft", "draft_dynamic", "commit", "shadow_copy", "shadow_key", "shadow_heads", "judge_shadows")

    def __init__(self, engine):
        self.seconds = 0.0
        for name in self.CALLS:
            if hasattr(engine.drafter, name):
                setattr(engine.drafter, name, self._timed(getattr(engine.drafter, name)))

    def _timed(self, inner):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def acceptance(at_depth: list[int], steps: int) -> list[float]:
    """Counts of steps accepting >= d drafts -> shares. Example: [6, 3], 10 steps -> [0.6, 0.3]."""
    return [round(n / steps, 4) for n in at_depth] if steps else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="eagle@eagle-taps", help="one head method as cadence bench names it")
    ap.add_argument("--variants", nargs="+", default=["nodes=16", "nodes=32", "nodes=64"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=str(common.PROMPTS / "tuning.jsonl"))
    ap.add_argument("--limit", type=int, default=0, help="first N prompts (0 = all)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=str(common.RUNS / "tree-budget.json"))
    args = ap.parse_args()
    common.use("e2e")
    from categories import add_counts, parse_method

    base = parse_method(args.method)
    if base.method in (Method.VANILLA, Method.NGRAM):
        raise CadenceError(f"{args.method}: a head method is needed")
    bb = common.backbone("smollm2", args.dtype)
    engines = {"vanilla": make_engine(bb, MethodSpec.parse("vanilla"))}
    for v in args.variants:
        engines[v] = make_engine(bb, replace(base, options={**base.options, **parse_variant(v)}))
    clocks = {v: DraftClock(engines[v]) for v in args.variants}
    items = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    items = items[:args.limit] if args.limit else items
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    warm = bb.encode_prompt("Hello, how are you?", chat=True)
    for e in engines.values():
        e.generate(warm, GenerationConfig(max_new_tokens=16))
    for c in clocks.values():
        c.seconds = 0.0
    totals = {m: {"tokens": 0, "seconds": 0.0, "steps": 0, "at_depth": [], "nodes": 0, "depth": 0,
                  "identical": 0, "n": 0} for m in engines}
    for i, it in enumerate(items):
        ids = bb.encode_prompt(it["prompt"], chat=True)
        order = list(engines)[::-1] if i % 2 else list(engines)
        out = {m: engines[m].generate(ids, cfg) for m in order}
        for m, g in out.items():
            t, s = totals[m], g.stats
            t["tokens"] += s.new_tokens
            t["seconds"] += s.wall_s
            t["steps"] += s.steps
            t["at_depth"] = add_counts(t["at_depth"], s.accepted_at_depth)
            t["nodes"] += sum(x.nodes for x in s.step_log)
            t["depth"] += sum(x.depth for x in s.step_log)
            t["identical"] += g.tokens == out["vanilla"].tokens
            t["n"] += 1
        print(f"{it['id']}: " + ", ".join(f"{m} {g.stats.tokens_per_s:.1f} tok/s tau {g.stats.tau:.2f}"
                                          for m, g in out.items()), flush=True)
    base_rate = totals["vanilla"]["tokens"] / totals["vanilla"]["seconds"]
    table = {}
    for m, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        table[m] = {"tok_s": round(rate, 2), "speedup": round(rate / base_rate, 3),
                    "tau": round(t["tokens"] / t["steps"], 3), "acceptance_by_depth": acceptance(t["at_depth"], t["steps"]),
                    "mean_nodes": round(t["nodes"] / t["steps"], 2), "mean_depth": round(t["depth"] / t["steps"], 2),
                    "draft_share": round(clocks[m].seconds / t["seconds"], 3) if m in clocks else 0.0,
                    "identical": f"{t['identical']}/{t['n']}"}
    print("\n| variant | tok/s | vs plain | tau | accept d1/d2/d3/d4/d5 | nodes | depth | drafting | identical |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---|")
    for m, r in table.items():
        acc = "/".join(f"{a:.2f}" for a in r["acceptance_by_depth"][:5]) or "-"
        print(f"| {m} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {r['tau']:.2f} | {acc} | {r['mean_nodes']:.1f} "
              f"| {r['mean_depth']:.1f} | {r['draft_share']:.0%} | {r['identical']} |")
    result = {"machine": common.machine(), "method": args.method, "max_new_tokens": args.max_new_tokens,
              "prompts": Path(args.prompts).name, "dtype": str(bb.dtype), "table": table}
    common.write_json(args.out, result, quiet=True)
    print(f"\n{common.machine_line(result['machine'])}; wrote {args.out}")


if __name__ == "__main__":
    main()
