"""Cut a distilled store down to some of its shards, for training on a machine without its
hidden cache (rebuilding the cache for the whole store takes hours on 2 cores).

Writes OUT/manifest.json (the store's manifest with the chosen shards) and symlinks to the
shards, so ``cadence train --data OUT`` reads only those. Keeps every val shard (held-out
numbers stay comparable with runs on the whole store) and, of the train shards, the first
``--first`` and every ``--every``-th (an even spread over the store's sources and ages), or
with ``--since N`` the train shards from the N-th on (those a shipped drafter never saw), with
``--until N`` only those before the N-th (combine with ``--every``), and ``--val N`` keeps only
the first N val shards (a cache for fewer shards builds sooner, but held-out rows are packed
from the shards kept, so the training log's held-out figures are then not comparable with runs
on every val shard: evaluate on all of them afterwards, as the model card's ``eagle-taps/``
figures were); ``--val-last N`` adds the last N val shards (e.g. those of newly added prompt
families).

Usage: python scripts/subset_store.py data/selfdistill/smollm2 runs/sub --every 8 --first 2
       python scripts/subset_store.py data/selfdistill/smollm2 runs/new --since 109
       python scripts/subset_store.py data/selfdistill/smollm2 runs/mix --until 81 --every 4 --val 8   # eagle-taps/
       python scripts/subset_store.py data/selfdistill/smollm2 runs/broad --since 133 --val 4 --val-last 7
"""

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("out")
    ap.add_argument("--every", type=int, default=8, help="keep every N-th train shard")
    ap.add_argument("--first", type=int, default=0, help="and the first N train shards")
    ap.add_argument("--since", type=int, default=None,
                    help="keep only the train shards from the N-th on (overrides --every / --first)")
    ap.add_argument("--until", type=int, default=None, help="keep only train shards before the N-th")
    ap.add_argument("--val", type=int, default=None, help="keep only the first N val shards (default: all)")
    ap.add_argument("--val-last", type=int, default=0, help="and the last N val shards")
    args = ap.parse_args()
    src, out = Path(args.store).resolve(), Path(args.out)
    m = json.loads((src / "manifest.json").read_text())
    train = [s["file"] for s in m["shards"] if s.get("split", "train") == "train"]
    if args.until is not None:
        train = train[:args.until]
    if args.since is not None:
        keep = set(train[args.since:])
    else:
        keep = set(train[:args.first]) | set(train[::max(1, args.every)])
    val = [s["file"] for s in m["shards"] if s.get("split") == "val"]
    keep |= set(val[:args.val]) | set(val[len(val) - args.val_last:] if args.val_last else [])
    out.mkdir(parents=True, exist_ok=True)
    for name in keep:
        if not (out / name).exists():
            os.symlink(src / name, out / name)
    shards = [s for s in m["shards"] if s["file"] in keep]
    (out / "manifest.json").write_text(json.dumps(dict(m, shards=shards)))
    tr = [s for s in shards if s.get("split", "train") == "train"]
    print(f"{out}: {len(tr)} train shards ({sum(s['tokens'] for s in tr):,} tokens, "
          f"{sum(s['reply_tokens'] for s in tr):,} reply), {len(shards) - len(tr)} val")


if __name__ == "__main__":
    main()
