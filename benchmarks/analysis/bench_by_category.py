"""A ``cadence bench`` run on ``--tasks custom --custom benchmarks/prompts/categories.jsonl``, per category.

``cadence bench`` pools a custom task into one row; the categories' prompt ids
(``code-0``, ``translation-3``, ...) say which kind each prompt is. This reads the run's
``records.jsonl`` and prints, per category and method: tokens/s over ``vanilla`` (total
tokens / total seconds of that category), tau, acceptance per depth (share of steps that
accepted at least d drafts), the share of steps that ran the root alone (no drafts
verified: the scheduler judged speculation would not pay), and how many outputs are
byte-identical to ``vanilla``'s.

Usage:  python benchmarks/analysis/bench_by_category.py runs/bench-categories-greedy [--out runs/by-category.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402


def category(key: str) -> str:
    """'math-reasoning-2' -> 'math-reasoning'."""
    return key.rsplit("-", 1)[0]


def add_counts(a: list[int], b: list[int]) -> list[int]:
    """Per-depth counts summed, the shorter padded with zeros: [4, 1] + [3, 2, 1] -> [7, 3, 1]."""
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


def summarize(records: list[dict]) -> dict:
    """category ('all' pools them) -> method -> {speedup, tau, acceptance_by_depth, root_share, identical}."""
    ref = {r["key"]: r["tokens"] for r in records if r["method"] == "vanilla"}
    acc: dict = defaultdict(lambda: defaultdict(lambda: {"tokens": 0, "seconds": 0.0, "steps": 0, "depth": [],
                                                         "root": 0, "logged": 0, "same": 0, "n": 0}))
    for r in records:
        log = r.get("step_log") or {}
        for cat in (category(r["key"]), "all"):
            a = acc[cat][r["method"]]
            a["tokens"] += r["new_tokens"]
            a["seconds"] += r["wall_s"]
            a["steps"] += r["steps"] or 0
            a["depth"] = add_counts(a["depth"], r.get("accepted_at_depth") or [])
            nodes = log.get("nodes") or []
            a["root"] += sum(n == 1 for n in nodes)
            a["logged"] += len(nodes)
            a["same"] += r["tokens"] == ref.get(r["key"])
            a["n"] += 1
    table = {}
    for cat, per in acc.items():
        base = per["vanilla"]["tokens"] / per["vanilla"]["seconds"]
        table[cat] = {m: {"speedup": round(a["tokens"] / a["seconds"] / base, 3),
                          "tau": round(a["tokens"] / a["steps"], 3) if a["steps"] else None,
                          "acceptance_by_depth": [round(c / a["steps"], 3) for c in a["depth"]] if a["steps"] else [],
                          "root_share": round(a["root"] / a["logged"], 3) if a["logged"] else None,
                          "identical": f"{a['same']}/{a['n']}"} for m, a in per.items()}
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a cadence bench --out directory (its records.jsonl)")
    ap.add_argument("--method", default="", help="print this method's rows only (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    records = [json.loads(line) for line in (Path(args.run) / "records.jsonl").read_text().splitlines() if line.strip()]
    table = summarize(records)
    cats = sorted(c for c in table if c != "all") + ["all"]
    methods = [m for m in table["all"] if m != "vanilla" and (not args.method or m == args.method)]
    print("| category | method | vs plain | tau | accept d1/d2/d3/d4 | root-only steps | identical |")
    print("|---|---|---:|---:|---|---:|---|")
    for c in cats:
        for m in methods:
            r = table[c].get(m)
            if r is None:
                continue
            depth = "/".join(f"{x:.2f}" for x in r["acceptance_by_depth"][:4]) or "-"
            root = f"{r['root_share']:.0%}" if r["root_share"] is not None else "-"
            tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
            print(f"| {c} | {m} | {r['speedup']:.2f}x | {tau} | {depth} | {root} | {r['identical']} |")
    if args.out:
        common.write_json(args.out, {"run": str(args.run), "table": table}, quiet=True)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
