"""``cadence distill`` and ``cadence train``: flags derive from DistillConfig / TrainConfig.

``cadence train`` runs unchanged under ``accelerate launch`` (DDP over processes); see
docs/training.md.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from accelerate import PartialState

from cadence.cliargs import add_fields, from_args
from cadence.errors import CadenceError
from cadence.training.data import DistillConfig, merge_datasets, run_distill
from cadence.training.train_config import TrainConfig
from cadence.training.trainer import train


def register(sub) -> None:
    p = sub.add_parser("distill", help="self-distillation data: the backbone answers training prompts",
                       description="Append self-distilled shards to a store (default "
                                   "data/selfdistill/smollm2): prompts the store already holds are "
                                   "skipped, so the same command resumes and later runs add to it.")
    add_fields(p, DistillConfig)
    p.set_defaults(func=run_distill_command)

    p = sub.add_parser("merge-data", help="combine distilled datasets (links, no copies)",
                       description="Make OUT a dataset of the shards of several others. Validation "
                                   "shards come from the first source only.")
    p.add_argument("--out", required=True, help="new dataset directory")
    p.add_argument("sources", nargs="+", metavar="DIR[:N]",
                   help="source dataset; ':N' keeps only its first N training shards")
    p.set_defaults(func=run_merge_command)

    p = sub.add_parser("train", help="train draft heads on a frozen backbone",
                       description="Train medusa/hydra/mtp heads on distilled shards; resumes from "
                                   "OUT/checkpoint.pt. Runs under `accelerate launch` for DDP.")
    add_fields(p, TrainConfig)
    p.set_defaults(func=run_train_command)


def run_distill_command(args) -> int:
    cfg = from_args(DistillConfig, args)
    manifest = run_distill(cfg)
    n_seq = sum(s["sequences"] for s in manifest["shards"])
    n_reply = sum(s["reply_tokens"] for s in manifest["shards"])
    mix = ", ".join(f"{k} {v['prompts']}" for k, v in sorted(manifest.get("mix", {}).items()))
    print(f"{cfg.out}: {manifest['prompts_done']} prompts ({manifest['skipped']} skipped as too long), "
          f"{len(manifest['shards'])} shards, {n_seq} sequences, {n_reply} reply tokens"
          + (f"; mix: {mix}" if mix else ""), file=sys.stderr)
    return 0


def run_merge_command(args) -> int:
    sources = []
    for spec in args.sources:
        path, _, limit = spec.partition(":")
        if limit and not limit.isdigit():
            raise CadenceError(f"bad source {spec!r}: expected DIR or DIR:N")
        sources.append((path, int(limit) if limit else None))
    manifest = merge_datasets(args.out, sources)
    n = {split: sum(s["reply_tokens"] for s in manifest["shards"] if s["split"] == split) for split in ("train", "val")}
    print(f"{args.out}: {len(manifest['shards'])} shards, {n['train']} train / {n['val']} val reply tokens",
          file=sys.stderr)
    return 0


def _leave_process_group() -> None:
    """End a multi-process run cleanly: every rank waits, then the process group is torn down
    before the interpreter exits (gloo's threads alive at exit can abort a rank)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_train_command(args) -> int:
    cfg = from_args(TrainConfig, args)
    result = train(cfg)
    try:
        main = PartialState().is_main_process
    except Exception:  # pragma: no cover
        main = True
    _leave_process_group()
    if main:
        s = result.summary
        if result.status == "cached":
            print(f"hidden cache ready: {s['cache']} ({s['shards']} shards)", file=sys.stderr)
            return 0
        line = (f"{result.status} at step {s['step']}/{s['steps']}: {s['tokens']} tokens, "
                f"{s['tokens_per_s']} tok/s, peak RSS {s['max_rss_mib']} MiB")
        ev = s.get("heldout")
        if ev:
            line += ("; held-out top-1 " + " / ".join(f"{a:.3f}" for a in ev["top1"])
                     + ", top-5 " + " / ".join(f"{a:.3f}" for a in ev["top5"]) + f", tau {ev['tau']:.3f}")
        print(line, file=sys.stderr)
        if result.status == "finished":
            print(f"next: cadence calibrate --heads {cfg.out}/heads --data {cfg.data} (until then the heads "
                  "draft the top-1 chain only; calibrated, they grow trees sized for this machine)", file=sys.stderr)
            print(json.dumps({"heads": str(cfg.out) + "/heads", **{k: s[k] for k in ("step", "tokens_per_s")}}))
    return 0
