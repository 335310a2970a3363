"""Where speculation stops paying as the batch grows: whole-batch tokens/s of the batched
engine at batch 1/2/4/8, without speculation, with it (each row's own scheduler, never
narrowed) and with the narrowing policy, in one interleaved run; plus this machine's
(batch, nodes) verify-latency grid that the policy is built on.

Held-out prompts (``benchmarks/prompts/categories.jsonl``, never used to train or tune
heads, trees or the policy) are spread round-robin over categories; every prompt of a
run is queued at once on a ``BatchEngine`` of ``max_batch = B`` (continuous batching: a
finished row's slot goes to the next prompt). Tokens/s = all tokens / wall time of the
run. Methods are interleaved per batch size, their order alternating, after an untimed
warm-up. "identical" counts rows whose tokens equal the plain single-request output.

Usage (a long run: give it a quiet machine):
    python benchmarks/e2e/batch_sweep.py [--batches 1 2 4 8] [--limit 16] [--max-new-tokens 96]
        [--repeats 1] [--out runs/batch-sweep.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.batch import narrow
from cadence.batch.engine import BatchEngine
from cadence.decode.generation import GenerationConfig
from cadence.methods import MethodSpec, make_engine
from cadence.verify.sampling import SamplingParams

PROMPTS = common.PROMPTS / "categories.jsonl"


def pick_prompts(path: Path, limit: int) -> list[dict]:
    """``limit`` prompts, round-robin over categories (file order within each)."""
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_cat: dict = defaultdict(list)
    for it in items:
        by_cat[it["category"]].append(it)
    out, i = [], 0
    while len(out) < min(limit, len(items)):
        for cat in by_cat.values():
            if i < len(cat) and len(out) < limit:
                out.append(cat[i])
        i += 1
    return out


def run_batch(engine: BatchEngine, prompts: list[list[int]], cfg: GenerationConfig) -> dict:
    """Queue every prompt, step until done: tokens, seconds, steps, per-row outputs."""
    t = time.perf_counter()
    rids = [engine.add(p, cfg) for p in prompts]
    toks = {r: [] for r in rids}
    stats, steps, batch_sum = {}, 0, 0
    while engine.has_work():
        batch_sum += engine.running + min(engine.queued, engine.max_batch - engine.running)
        steps += 1
        for ev in engine.step():
            toks[ev.rid] += ev.tokens
            if ev.finished:
                stats[ev.rid] = ev.stats
    seconds = time.perf_counter() - t
    total = sum(len(v) for v in toks.values())
    row_steps = sum(s.steps for s in stats.values())
    nodes = [i.nodes for s in stats.values() for i in s.step_log]
    return {"tokens": total, "seconds": seconds, "engine_steps": steps, "mean_batch": batch_sum / max(steps, 1),
            "tau": total / max(row_steps, 1), "mean_nodes": sum(nodes) / max(len(nodes), 1),
            "outputs": [toks[r] for r in rids]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--remeasure", action="store_true", help="measure the (batch, nodes) latency grid again")
    ap.add_argument("--out", default=str(common.RUNS / "batch-sweep.json"))
    args = ap.parse_args()
    bb = common.backbone(args.model, args.dtype, backend="fast")
    hydra = make_engine(bb, MethodSpec.parse("hydra"))
    grid = narrow.batch_latency(bb, remeasure=args.remeasure, verbose=True)
    makers = {
        "vanilla": lambda b: BatchEngine(bb, max_batch=b),
        "hydra": lambda b: BatchEngine.from_engine(hydra, b, narrow=narrow.NarrowConfig(mode="none")),
        "hydra+narrow": lambda b: BatchEngine.from_engine(hydra, b, latency=grid),
    }
    probe = makers["hydra+narrow"](max(args.batches))
    copying = hydra.drafter.copy is not None
    table = hydra.tree_policy.table(copying)
    caps = {b: probe.narrowing.cap(b, table, hydra.drafter.max_depth(SamplingParams())) for b in args.batches}
    items = pick_prompts(Path(args.prompts), args.limit)
    prompts = [bb.encode_prompt(it["prompt"], chat=True) for it in items]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    reference = [hydra.generate(p, cfg).tokens for p in prompts]  # also warms the single path
    warm = prompts[:2]
    for make in makers.values():  # warm-up, not timed
        run_batch(make(2), warm, GenerationConfig(max_new_tokens=16))
    runs = []
    for rep in range(args.repeats):
        for i, b in enumerate(args.batches):
            order = list(makers) if (i + rep) % 2 == 0 else list(makers)[::-1]
            for m in order:
                r = run_batch(makers[m](b), prompts, cfg)
                same = sum(o == ref for o, ref in zip(r.pop("outputs"), reference))
                runs.append({"method": m, "batch": b, "repeat": rep, "identical": f"{same}/{len(prompts)}", **r})
                print(f"B={b} {m}: {r['tokens'] / r['seconds']:.1f} tok/s, tau {r['tau']:.2f}, "
                      f"nodes {r['mean_nodes']:.2f}, identical {same}/{len(prompts)}", flush=True)
    summary = summarize(runs, list(makers), args.batches)
    print_tables(summary, grid, caps, list(makers), args.batches)
    result = {"machine": common.machine(), "backend": type(bb).__name__, "dtype": str(bb.dtype),
              "max_new_tokens": args.max_new_tokens, "prompts": [it["id"] for it in items],
              "latency_grid": {"batches": grid.batches, "sizes": grid.sizes, "seconds": grid.seconds,
                               "context": grid.context},
              "narrow_caps": caps, "summary": summary, "runs": runs}
    common.write_json(args.out, result, quiet=True)
    print(f"\n{common.machine_line(result['machine'])}; backbone {type(bb).__name__} {bb.dtype}; wrote {args.out}")


def summarize(runs: list[dict], methods: list[str], batches: list[int]) -> dict:
    """batch -> method -> tok_s (pooled over repeats), speedup over vanilla at that batch, tau."""
    out = {}
    for b in batches:
        per = {}
        for m in methods:
            rs = [r for r in runs if r["batch"] == b and r["method"] == m]
            tok, sec = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
            per[m] = {"tok_s": round(tok / sec, 2), "tau": round(sum(r["tau"] for r in rs) / len(rs), 3),
                      "mean_nodes": round(sum(r["mean_nodes"] for r in rs) / len(rs), 2),
                      "identical": rs[-1]["identical"]}
        for m in methods:
            per[m]["speedup"] = round(per[m]["tok_s"] / per["vanilla"]["tok_s"], 3)
        out[b] = per
    return out


def print_tables(summary: dict, grid, caps: dict, methods: list[str], batches: list[int]) -> None:
    print("\nVerify latency T(B, n) in ms (B rows x n nodes per row), and T(B, n) / T(B, 1):")
    print("| B | " + " | ".join(f"n={n}" for n in grid.sizes) + " |")
    print("|---|" + "---:|" * len(grid.sizes))
    for b, row in zip(grid.batches, grid.seconds):
        print(f"| {b} | " + " | ".join(f"{s * 1e3:.1f} ({s / row[0]:.2f})" for s in row) + " |")
    print("\nWhole-batch tokens/s (speedup over vanilla at the same batch size; tau; nodes per row):")
    print("| method | " + " | ".join(f"B={b}" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for m in methods:
        cells = [f"{summary[b][m]['tok_s']:.1f} ({summary[b][m]['speedup']:.2f}x, tau {summary[b][m]['tau']:.2f}, "
                 f"n {summary[b][m]['mean_nodes']:.1f}, {summary[b][m]['identical']})" for b in batches]
        print(f"| {m} | " + " | ".join(cells) + " |")
    print("\nnarrowing caps (nodes per row, root included): " + ", ".join(f"B={b}: {c}" for b, c in caps.items()))


if __name__ == "__main__":
    main()
