"""Are a dynamic tree's node values acceptance probabilities? (EAGLE-2's premise, checked here.)

Generates greedily with ``--scheduler dynamic`` on held-out-style prompts (``e2e/draft_cost.py``'s ``PROMPTS``)
plus the prompts of a val shard of the self-distilled store (never trained on), and for every
verified node records its value (the product of draft probabilities along its path, context
copies at least ``copy_conf`` / ``copy_run_conf`` of their parent) and whether it was accepted.
Prints acceptance per value bin, and per node kind (head candidate, first context copy,
copied run) the acceptance given the parent was accepted against the mean value ratio
(node value / parent value). A calibrated drafter has both columns equal; the latency-cut
tree size (``grow.best_size``) relies on it.

Usage:  python benchmarks/analysis/dynamic_calibration.py --method eagle [--heads eagle-taps] [--no-copy] [--shard data/selfdistill/smollm2/shard-00149.npz --shard-prompts 10]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
import cadence.draft.grow as dt
import cadence.decode.request as request_mod
from cadence.decode.generation import GenerationConfig
from cadence.methods import MethodSpec, make_engine

common.use("e2e")
from draft_cost import PROMPTS  # noqa: E402


def shard_prompts(path: str, n: int) -> list[list[int]]:
    """The prompt ids of the first ``n`` sequences of a store shard."""
    from cadence.training.store import read_store_shard

    sh = read_store_shard(path)
    out = []
    for i in range(min(n, len(sh["prompt_lens"]))):
        start = int(sh["offsets"][i])
        out.append(sh["tokens"][start:start + int(sh["prompt_lens"][i])].tolist())
    return out


class Recorder:
    """Wraps ``grow.to_draft`` (node values and kinds of the drafted tree) and the
    engine's ``Request.finish_step`` (the accepted path) to tally them."""

    def __init__(self):
        self.last = None
        self.bins = defaultdict(lambda: [0, 0, 0.0])  # value decile -> nodes, accepted, summed value
        self.kinds = defaultdict(lambda: [0, 0, 0.0])  # kind -> judged nodes, accepted, summed value ratio

    def to_draft(self, root, chosen, device):
        d = ORIG_TO_DRAFT(root, chosen, device)
        kids, path_of, info = {}, {0: ()}, {}
        by_id = {c.id: c for c in chosen}
        for c in chosen:
            r = kids.get(c.parent, 0)
            kids[c.parent] = r + 1
            path_of[c.id] = path_of[c.parent] + (r,)
            parent = by_id.get(c.parent)
            kind = "head" if not c.copy else ("copy-run" if parent is not None and parent.copy else "copy-first")
            info[path_of[c.id]] = (math.exp(c.logv), kind)
        self.last = [info[p] for p in d.tree.paths]
        return d

    def tally(self, tree, path, values) -> None:
        accepted = set(path)
        for i, (v, kind) in enumerate(values, start=1):
            b = self.bins[min(int(v * 10), 9)]
            b[0], b[1], b[2] = b[0] + 1, b[1] + (i in accepted), b[2] + v
            parent = tree.parents[i]
            if parent in accepted:  # judged: its parent was accepted
                pv = values[parent - 1][0] if parent > 0 else 1.0
                k = self.kinds[kind]
                k[0], k[1], k[2] = k[0] + 1, k[1] + (i in accepted), k[2] + v / pv


ORIG_TO_DRAFT = dt.to_draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--method", default="eagle")
    ap.add_argument("--heads", default="default", help="heads directory or shipped name (eagle-taps)")
    ap.add_argument("--no-copy", action="store_true")
    ap.add_argument("--shard", default="", help="a val shard of the store whose prompts are added")
    ap.add_argument("--shard-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="", help="write the tallies as JSON here")
    args = ap.parse_args()
    bb = common.backbone(args.model, "auto")
    eng = make_engine(bb, MethodSpec.parse(f"{args.method}+dynamic", MethodSpec(heads=args.heads, copy=not args.no_copy)))
    prompts = [bb.encode_prompt(p, chat=True) for p in PROMPTS]
    if args.shard:
        prompts += shard_prompts(args.shard, args.shard_prompts)
    rec = Recorder()
    dt.to_draft = rec.to_draft
    real_finish = request_mod.Request.finish_step

    def finish(self, job, logits, hidden):
        rule, seen = self.rule, {}

        def spy(*a, **kw):
            seen["v"] = rule(*a, **kw)
            return seen["v"]
        self.rule = spy
        try:
            return real_finish(self, job, logits, hidden)
        finally:
            self.rule = rule
            values, rec.last = rec.last, None
            if values is not None and len(values) + 1 == job.tree.size and "v" in seen:
                rec.tally(job.tree, seen["v"].path, values)

    request_mod.Request.finish_step = finish
    try:
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
        for ids in prompts:
            eng.generate(ids, cfg)
    finally:
        request_mod.Request.finish_step = real_finish
        dt.to_draft = ORIG_TO_DRAFT
    info = common.machine()
    print(f"Machine: {common.machine_line(info)}; {args.method} ({args.heads}), copy {not args.no_copy}, {len(prompts)} prompts\n")
    print("| node value | nodes | mean value | accepted |")
    print("|---|---:|---:|---:|")
    for b in sorted(rec.bins):
        n, a, s = rec.bins[b]
        print(f"| {b / 10:.1f}-{(b + 1) / 10:.1f} | {n} | {s / n:.3f} | {a / n:.3f} |")
    print("\n| node kind | judged | accepted given parent | mean value / parent value |")
    print("|---|---:|---:|---:|")
    for kind, (n, a, s) in sorted(rec.kinds.items()):
        print(f"| {kind} | {n} | {a / n:.3f} | {s / n:.3f} |")
    if args.out:
        common.write_json(args.out, {"machine": info, "method": args.method, "heads": args.heads,
                                     "copy": not args.no_copy, "prompts": len(prompts),
                                     "bins": {f"{b / 10:.1f}": v for b, v in sorted(rec.bins.items())},
                                     "kinds": dict(rec.kinds)}, indent=2)


if __name__ == "__main__":
    main()
