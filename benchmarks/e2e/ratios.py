"""Speedups of a finished bench run recomputed from its per-generation records, optionally
without some prompts (e.g. a generation disturbed by another process), and ratios between
methods.

Reads ``records.jsonl`` (or ``records.jsonl.gz``) of a ``cadence bench --out`` directory and
pools tokens / wall time exactly as the report does (``cadence.bench.metrics``): speedup of a
method = its pooled tokens/s over vanilla's on the generations both have. ``--drop TASK:KEY``
removes that prompt's generations for every method (so the ratios stay paired); ``--ratio A B``
prints speedup(A) / speedup(B) too; ``--steps`` the per-step logs pooled per method: mean nodes
verified per step, share of steps that ran the root alone, mean step time.

Usage (a scheduler run where another process disturbed one hydra generation)::

    python benchmarks/e2e/ratios.py runs/bench-sched \
        --drop sharegpt:sharegpt:ZSF9WtY_0 --ratio hydra+entmtp hydra+static
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cadence.bench import metrics as M  # noqa: E402
from cadence.bench import runner  # noqa: E402


def read_records(run_dir: Path) -> list[dict]:
    """The run's records, from records.jsonl or records.jsonl.gz."""
    for name in ("records.jsonl", "records.jsonl.gz"):
        if (run_dir / name).is_file():
            return runner.read_records(run_dir / name)
    raise SystemExit(f"error: {run_dir} has no records.jsonl(.gz)")


def speedups(records: list[dict], drop: set[tuple[str, str]] = frozenset()) -> dict[str, float | None]:
    """{method: speedup over vanilla pooled over every kept generation}."""
    kept = [r for r in records if (r["task"], r["key"]) not in drop]
    by: dict[str, list[dict]] = {}
    for r in kept:
        by.setdefault(r["method"], []).append(r)
    base = by.get("vanilla")
    if not base:
        raise SystemExit("error: the run has no vanilla generations to compare with")
    return {m: M.speedup(recs, base) for m, recs in by.items()}


def step_stats(records: list[dict]) -> dict[str, tuple[float, float, float]]:
    """{method: (mean nodes per step, share of root-alone steps, mean step ms)} over every
    step of the method's generations (``step_log`` of each record). Example: steps of 1, 3
    and 5 nodes taking 20, 30 and 40 ms -> (3.0, 0.333, 30.0)."""
    by: dict[str, tuple[list, list]] = {}
    for r in records:
        log = r.get("step_log") or {}
        nodes, secs = by.setdefault(r["method"], ([], []))
        nodes += log.get("nodes", [])
        secs += log.get("seconds", [])
    return {m: (sum(n) / len(n), sum(x == 1 for x in n) / len(n), 1000 * sum(s) / len(s))
            for m, (n, s) in by.items() if n and s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a cadence bench --out directory")
    ap.add_argument("--drop", nargs="*", default=[], metavar="TASK:KEY",
                    help="prompts left out for every method (task, then the record's key)")
    ap.add_argument("--ratio", nargs=2, action="append", default=[], metavar=("A", "B"),
                    help="also print speedup(A) / speedup(B)")
    ap.add_argument("--steps", action="store_true",
                    help="also print mean nodes per step, root-alone share and mean step ms per method")
    args = ap.parse_args(argv)
    drop = set()
    for item in args.drop:
        task, sep, key = item.partition(":")
        if not sep or not key:
            ap.error(f"--drop takes TASK:KEY, got {item!r}")
        drop.add((task, key))
    records = read_records(args.run)
    missing = drop - {(r["task"], r["key"]) for r in records}
    if missing:
        ap.error(f"no generations for {', '.join(':'.join(d) for d in sorted(missing))} in {args.run}")
    ups = speedups(records, drop)
    for m, s in ups.items():
        print(f"{m:32s} {s:.3f}x" if s is not None else f"{m:32s} -")
    for a, b in args.ratio:
        if ups.get(a) is None or ups.get(b) is None:
            ap.error(f"--ratio {a} {b}: both must be methods of the run ({', '.join(ups)})")
        print(f"{a} / {b} = {ups[a] / ups[b]:.3f}")
    if args.steps:
        kept = [r for r in records if (r["task"], r["key"]) not in drop]
        for m, (nodes, alone, ms) in step_stats(kept).items():
            print(f"{m:32s} {nodes:5.2f} nodes/step, root alone {alone:.0%}, {ms:.1f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
