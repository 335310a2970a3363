"""Where a bench run's time went, by kind of step: the root alone, a chain of copies alone, or a
tree the heads drafted (with any copies in it).

``cadence bench`` records every step of every generation (``records.jsonl``: the tree that ran,
its verify nodes, drafts accepted, wall seconds). Per method this prints, for each kind, the
steps, tokens per step, milliseconds per step and tokens per millisecond, so one can see which
steps pay: e.g. whether a copies-only step (``schedulers.copy_first``; ``ngram``'s chains)
commits more tokens per millisecond than a heads step on this machine. A step is "root" when it
verified one node, "copies" when its tree is named ``copies-*`` or ``ngram-*``, else "heads".

With ``--repeat R`` only the generations of repeat R count (a ``--repeats 2`` run: R = 1 is each
prompt asked again, e.g. with an online store that learnt its first reply), and per method the
whole generations' tokens per second and their ratio to ``vanilla``'s are printed too, with the
prefill excluded as well (a long prompt's prefill can take as long as its reply).

Usage:  python benchmarks/analysis/step_kinds.py runs/bench/records.jsonl [--repeat R] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def kind(tree: str, nodes: int) -> str:
    """The step's kind. Example: ("copies-3~2", 3) -> "copies"; ("auto-2+copy", 1) -> "root"."""
    if nodes <= 1:
        return "root"
    return "copies" if tree.startswith(("copies-", "ngram-")) else "heads"


def summarize(records: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """method -> kind -> steps, tokens_per_step, ms_per_step, tokens_per_ms (methods without a
    step log, such as llama.cpp, are left out)."""
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))
    for r in records:
        log = r.get("step_log")
        if not log:
            continue
        for tree, nodes, accepted, seconds in zip(log["tree"], log["nodes"], log["accepted"], log["seconds"]):
            a = acc[r["method"]][kind(tree, nodes)]
            a[0] += 1
            a[1] += accepted + 1
            a[2] += seconds
    return {m: {k: {"steps": n, "tokens_per_step": round(t / n, 3), "ms_per_step": round(1000 * s / n, 3),
                    "tokens_per_ms": round(t / (1000 * s), 4) if s > 0 else 0.0}
                for k, (n, t, s) in sorted(kinds.items())}
            for m, kinds in acc.items()}


def speeds(records: list[dict], decode: bool = False) -> dict[str, float | None]:
    """method -> new tokens per second over its whole generations (prefill included), or with
    ``decode`` over their wall time after the prefill (None for a method that records no
    prefill time, e.g. llama.cpp)."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, True])
    for r in records:
        if r.get("wall_s"):
            acc[r["method"]][0] += r["new_tokens"]
            acc[r["method"]][1] += r["wall_s"] - (r.get("prefill_s") or 0.0 if decode else 0.0)
            acc[r["method"]][2] &= r.get("prefill_s") is not None
    return {m: round(t / s, 2) if s > 0 and (known or not decode) else None for m, (t, s, known) in acc.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", help="a cadence bench run's records.jsonl")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--repeat", type=int, default=None, help="only the generations of this repeat (0-based)")
    args = ap.parse_args(argv)
    path = Path(args.records)
    if not path.is_file():
        print(f"step_kinds: no such file: {path}", file=sys.stderr)
        return 2
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        print(f"step_kinds: {path} is not a records.jsonl ({e})", file=sys.stderr)
        return 2
    if args.repeat is not None:
        records = [r for r in records if r.get("repeat", 0) == args.repeat]
    out = summarize(records)
    rates, decode = speeds(records), speeds(records, decode=True)
    if args.json:
        print(json.dumps({"steps": out, "tokens_per_s": rates, "decode_tokens_per_s": decode}, indent=1))
        return 0
    print("| method | kind | steps | tokens / step | ms / step | tokens / ms |")
    print("|---|---|---:|---:|---:|---:|")
    for method, kinds in out.items():
        for k, v in kinds.items():
            print(f"| {method} | {k} | {v['steps']} | {v['tokens_per_step']:.2f} | {v['ms_per_step']:.2f} | "
                  f"{v['tokens_per_ms']:.3f} |")
    base, dbase = rates.get("vanilla"), decode.get("vanilla")
    print("\n| method | tok/s | vs vanilla | decode tok/s (prefill excluded) | vs vanilla |\n|---|---:|---:|---:|---:|")
    for method, rate in rates.items():
        d = decode[method]
        cells = [f"{rate:.1f}", f"{rate / base:.2f}x" if base else "", f"{d:.1f}" if d else "–",
                 f"{d / dbase:.2f}x" if d and dbase else ""]
        print(f"| {method} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
