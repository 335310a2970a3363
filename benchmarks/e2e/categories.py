"""Speculative decoding vs plain decoding per prompt category, in one interleaved run.

The held-out prompts in ``benchmarks/prompts/categories.jsonl`` (4 each of code, math, chat,
writing, translation, summary, extraction, roleplay, reasoning, math-reasoning, stem,
humanities, qa, rag: the kinds Spec-Bench and MT-Bench ask, in this repository's own
wording; written for this check, never used to train or tune heads or trees, and kept out
of the distillation sources by ``training.sources``) are decoded by every method, methods interleaved per
prompt with the order alternating, after a warm-up that is not timed. Per category:
tokens/s of each method over vanilla (total tokens / total seconds), tau, and whether
the output is byte-identical to vanilla.

Usage:  python benchmarks/e2e/categories.py [--methods hydra mtp] [--max-new-tokens 128] [--repeats 1]
        [--backend auto] [--dtype float32] [--out runs/categories.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.decode.generation import GenerationConfig
from cadence.methods import MethodSpec, make_engine

PROMPTS = common.PROMPTS / "categories.jsonl"


def parse_method(text: str) -> MethodSpec:
    """A method name as ``cadence generate --method`` and ``cadence bench`` take it ('hydra',
    'hydra:auto-8', 'hydra+adaptive-k', 'hydra:auto+static/nocopy', 'hydra@runs/hydra/heads',
    'eagle,max_nodes=16') -> its MethodSpec (``MethodSpec.parse``; no peers here)."""
    return MethodSpec.parse(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["hydra"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1,
                    help="passes over the prompts (short replies, e.g. translations, give few tokens per pass)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--quant", default="none", help="none | int8 | int4 (weight-only; vanilla runs the same model)")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--out", default=str(common.RUNS / "categories.json"))
    args = ap.parse_args()
    bb = common.backbone(args.model, args.dtype, backend=args.backend, quant=args.quant)
    engines = {"vanilla": make_engine(bb, MethodSpec.parse("vanilla"))}
    for m in args.methods:
        engines[m] = make_engine(bb, parse_method(m))
    trees = {m: f"{e.scheduler_name}, --tree {e.tree_policy.name}"
             for m, e in engines.items() if e.drafter is not None}
    items = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    warm = bb.encode_prompt("Hello, how are you?", chat=True)
    for e in engines.values():  # warm-up, not timed
        e.generate(warm, GenerationConfig(max_new_tokens=16))
    rows = []
    for i, it in enumerate(items * args.repeats):
        ids = bb.encode_prompt(it["prompt"], chat=True)
        flip = (i + i // len(items)) % 2  # alternates per prompt, and per pass for the same prompt
        order = list(engines)[::-1] if flip else list(engines)
        out = {m: engines[m].generate(ids, cfg) for m in order}
        ref = out["vanilla"].tokens
        for m, g in out.items():
            rows.append({"id": it["id"], "category": it["category"], "method": m, "tokens": g.stats.new_tokens,
                         "seconds": g.stats.wall_s, "steps": g.stats.steps, "identical": g.tokens == ref,
                         "accepted_at_depth": g.stats.accepted_at_depth})
        print(f"{it['id']}: " + ", ".join(f"{m} {g.stats.tokens_per_s:.1f} tok/s tau {g.stats.tau:.2f}"
                                          for m, g in out.items()),
              flush=True)
    table = summarize(rows, list(engines))
    print_table(table, list(engines), trees)
    result = {"machine": common.machine(), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "backend": type(bb).__name__, "quant": args.quant,
              "dtype": str(bb.dtype), "trees": trees, "table": table, "rows": rows}
    common.write_json(args.out, result, quiet=True)
    print(f"\n{common.machine_line(result['machine'])}; backbone {type(bb).__name__} {bb.dtype}; wrote {args.out}")


def summarize(rows: list[dict], methods: list[str]) -> dict:
    """category -> method -> {tok_s, speedup, tau, acceptance_by_depth, identical}; 'all' pools
    every category. Acceptance at depth d: the share of steps that accepted at least d drafts."""
    acc: dict = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0, 0, 0, []]))
    for r in rows:
        for cat in (r["category"], "all"):
            a = acc[cat][r["method"]]
            a[0] += r["tokens"]
            a[1] += r["seconds"]
            a[2] += r["steps"]
            a[3] += r["identical"]
            a[4] += 1
            depth = r.get("accepted_at_depth") or []
            a[5] = add_counts(a[5], depth)
    table = {}
    for cat, per in acc.items():
        base = per["vanilla"][0] / per["vanilla"][1]
        table[cat] = {m: {"tok_s": round(per[m][0] / per[m][1], 2),
                          "speedup": round(per[m][0] / per[m][1] / base, 3),
                          "tau": round(per[m][0] / per[m][2], 3),
                          "acceptance_by_depth": [round(n / per[m][2], 4) for n in per[m][5]],
                          "identical": f"{per[m][3]}/{per[m][4]}"} for m in methods}
    return table


def add_counts(a: list[int], b: list[int]) -> list[int]:
    """Per-depth counts summed, the shorter padded with zeros: [4, 1] + [3, 2, 1] -> [7, 3, 1]."""
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


def print_table(table: dict, methods: list[str], trees: dict) -> None:
    cats = [c for c in table if c != "all"] + ["all"]
    print("\n| method (tree) | " + " | ".join(cats) + " | tau (all) | accept d1/d2/d3/d4 (all) | identical |")
    print("|---|" + "---:|" * (len(cats) + 1) + "---|---|")
    for m in methods:
        label = f"{m} ({trees[m]})" if m in trees else m
        cells = [f"{table[c][m]['speedup']:.2f}x" for c in cats]
        depth = "/".join(f"{a:.2f}" for a in table["all"][m]["acceptance_by_depth"][:4]) or "-"
        print(f"| {label} | " + " | ".join(cells) + f" | {table['all'][m]['tau']:.2f} | {depth} "
              f"| {table['all'][m]['identical']} |")
    print(f"\nvanilla: {table['all']['vanilla']['tok_s']:.1f} tok/s over all prompts")


if __name__ == "__main__":
    main()
