"""Teacher-forced top-1 per depth on the store's val split, with and without the context vocabulary.

For each heads directory: the share of reply positions where head k's top candidate is the
backbone's token (``acceptance.sequence_ranks``, rank 0), drafting over the draft vocabulary
alone and over the draft vocabulary plus the context's own tokens outside it (what
``HeadDrafter(context_vocab=...)`` and ``cadence calibrate`` use), and how many targets were
outside the draft vocabulary but already in the context.

    python benchmarks/analysis/context_vocab_acceptance.py --heads src/cadence/assets/heads/smollm2/eagle runs/eagle-cv/heads
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import sys
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.calibration.acceptance import _val_sequences, sequence_ranks
from cadence.heads import load_heads


def measure(bb, heads, data: str, sequences: int) -> dict:
    K = heads.K
    hits = {False: [0] * K, True: [0] * K}
    n = [0] * K
    outside = outside_seen = outside_hit = 0
    inside = torch.zeros(bb.vocab_size, dtype=torch.bool)
    inside[heads.draft_vocab.cpu()] = True
    done = 0
    for ids, plen in _val_sequences(data, "val"):
        if done >= sequences:
            break
        runs = {cv: sequence_ranks(bb, heads, ids, plen, 10, None, 0, context_vocab=cv) for cv in (False, True)}
        if runs[False] is None:
            continue
        done += 1
        for cv, r in runs.items():
            for k in range(K):
                hits[cv][k] += int((r.plain[k] == 0).sum())
                if not cv:
                    n[k] += r.plain[k].numel()
        t0 = max(plen - 1, 0)
        d1 = runs[True].plain[0]
        for i, t in enumerate(ids[t0 + 2:t0 + 2 + d1.numel()].tolist()):  # depth-1 targets x[t+2]
            if not inside[t]:
                outside += 1
                seen = bool((ids[:t0 + i + 2] == t).any())  # in x[0..t+1]
                outside_seen += seen
                outside_hit += int(d1[i] == 0)
    return {"sequences": done, "positions": n,
            "top1": [h / max(c, 1) for h, c in zip(hits[False], n)],
            "top1_context_vocab": [h / max(c, 1) for h, c in zip(hits[True], n)],
            "depth1_targets_outside": outside, "of_them_in_context": outside_seen,
            "of_them_hit_with_context_vocab": outside_hit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs="+", required=True)
    ap.add_argument("--data", default="data/selfdistill/smollm2")
    ap.add_argument("--sequences", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bb = common.backbone(dtype="bfloat16")
    out = {"machine": common.machine(), "data": args.data, "heads": {}}
    for d in args.heads:
        res = measure(bb, load_heads(d, bb), args.data, args.sequences)
        out["heads"][d] = res
        print(d, json.dumps(res), flush=True)
    if args.out:
        common.write_json(args.out, out)


if __name__ == "__main__":
    main()
