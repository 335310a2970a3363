"""Held-out acceptance against training tokens seen, from `cadence train` logs.

Knows: the ``train_log.jsonl`` records `cadence train` writes (``kind: eval`` with ``top1``,
``chain``, ``tau`` per held-out evaluation; ``kind: train`` with the running ``tokens`` count).
Does not know: models or data; which val shards an evaluation used (say so in the label).

Each log becomes one curve: held-out top-1 at depth 1..K and the chain's expected tau against
the training tokens seen by that step (the step-0 record, written when a run starts from
``--init-from``, sits at 0 tokens). A curve still rising at its last point says more data
(or more steps on it) would pay; a flat one says the drafter's capacity or its inputs are the
limit. Writes a markdown table, a JSON file and a plot.

Usage: python benchmarks/training/heldout_curve.py broad=runs/broad/run/train_log.jsonl \
           --out docs/results/xeon-amx/DATE-eagle-taps-broad/curve
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_curve(path: str | Path) -> list[dict]:
    """(step, tokens, top1 per depth, chain per depth, tau) per eval record, in step order."""
    tokens_at: dict[int, int] = {0: 0}
    evals = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("kind") == "train":
            tokens_at[int(rec["step"])] = int(rec["tokens"])
        elif rec.get("kind") == "eval":
            evals.append(rec)
    points = []
    for rec in evals:
        step = int(rec["step"])
        # the last train record at or before this step (logs every --log-every steps)
        known = [s for s in tokens_at if s <= step]
        points.append({"step": step, "tokens": tokens_at[max(known)], "top1": rec["top1"],
                       "chain": rec["chain"], "tau": rec["tau"], "positions": rec.get("positions")})
    return sorted(points, key=lambda p: p["step"])


def table(curves: dict[str, list[dict]]) -> str:
    depth = max(len(p["top1"]) for pts in curves.values() for p in pts)
    head = ["curve", "step", "tokens seen"] + [f"top-1 d{k + 1}" for k in range(depth)] + ["tau (chain)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for name, pts in curves.items():
        for p in pts:
            cells = [name, str(p["step"]), f"{p['tokens']:,}"] + [f"{x:.3f}" for x in p["top1"]] + [f"{p['tau']:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for name, pts in curves.items():
        xs = [p["tokens"] / 1e6 for p in pts]
        for k in range(len(pts[0]["top1"])):
            ax.plot(xs, [p["top1"][k] for p in pts], marker="o", label=f"{name} d{k + 1}")
        bx.plot(xs, [p["tau"] for p in pts], marker="o", label=name)
    ax.set(xlabel="training tokens seen (M)", ylabel="held-out top-1", title="acceptance per depth")
    bx.set(xlabel="training tokens seen (M)", ylabel="expected tau (top-1 chain)", title="chain")
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", help="LABEL=path/to/train_log.jsonl")
    ap.add_argument("--out", required=True, help="prefix: writes PREFIX.md, PREFIX.json, PREFIX.png")
    args = ap.parse_args()
    curves = {}
    for spec in args.logs:
        label, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"error: {spec!r} is not LABEL=PATH")
        pts = read_curve(path)
        if not pts:
            raise SystemExit(f"error: {path} has no held-out evaluations")
        curves[label] = pts
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table(curves))
    out.with_suffix(".json").write_text(json.dumps(curves, indent=1) + "\n")
    plot(curves, out.with_suffix(".png"))
    print(table(curves))


if __name__ == "__main__":
    main()
