"""Greedy token ids of every shipped method on a fixed prompt set: a before/after check
for changes that must not change behaviour (refactors, moves, kernel edits).

    python scripts/greedy_snapshot.py --out runs/before.json          # on the old code
    python scripts/greedy_snapshot.py --out runs/after.json --compare runs/before.json

Prompts: every 4th of ``benchmarks/prompts/categories.jsonl`` (7 categories), 64 new tokens,
``--dtype auto``. ``--compare`` prints, per method, how many outputs equal the old file's and
plain decoding's, and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cadence.backbone.load import load_backbone
from cadence.decode.generation import GenerationConfig
from cadence.methods import MethodSpec, make_engine

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "categories.jsonl"
SPECS = {name: MethodSpec.parse(text) for name, text in (
    ("vanilla", "vanilla"), ("hydra", "hydra"), ("medusa", "medusa"), ("mtp", "mtp"), ("eagle", "eagle"),
    ("eagle-taps", "eagle@eagle-taps"))}


def snapshot(max_new_tokens: int) -> dict:
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()][::4][:7]
    bb = load_backbone("smollm2")
    out = {}
    for name, spec in SPECS.items():
        engine = make_engine(bb, spec)
        out[name] = [list(map(int, engine.generate(bb.encode_prompt(p, chat=True),
                                                   GenerationConfig(max_new_tokens=max_new_tokens)).tokens))
                     for p in prompts]
        print(name, flush=True)
    return {"prompts": prompts, "out": out}


def compare(new: dict, old: dict) -> bool:
    same_all = new["prompts"] == old["prompts"]
    for name, rows in new["out"].items():
        before = sum(a == b for a, b in zip(rows, old["out"].get(name, [])))
        plain = sum(a == b for a, b in zip(rows, new["out"]["vanilla"]))
        print(f"{name:11s} equal to before {before}/{len(rows)}, equal to plain decoding {plain}/{len(rows)}")
        same_all &= before == len(rows) == plain
    return same_all


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--compare", help="an earlier snapshot to compare with")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    snap = snapshot(args.max_new_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(snap))
    return 0 if not args.compare or compare(snap, json.loads(Path(args.compare).read_text())) else 1


if __name__ == "__main__":
    sys.exit(main())
