"""Self-distillation throughput: transformers' batched `generate` against cadence's batched
fast path (`cadence distill --backend transformers | fast`), same prompts, greedy.

Each setting is ``backend:batch`` (``hf:64``, ``fast:32``); the first one is the reference
for the identical-reply count. Warm-up (a few tokens) is not timed.

Usage:  python benchmarks/training/distill_speed.py [--prompts 64] [--max-new-tokens 128]
                                                     [--settings hf:64 fast:16 fast:32 fast:64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.training.data import DistillConfig, batched_replies, generate_batch
from cadence.training.sources import mixed_items


def run(kind: str, batch: int, prompts: list[list[int]], bb, new: int) -> tuple[list[list[int]], float]:
    cfg = DistillConfig(max_new_tokens=new, batch_size=batch)
    warm = DistillConfig(max_new_tokens=4, batch_size=batch)
    if kind == "hf":
        generate_batch(bb, prompts[:4], warm)
        t = time.perf_counter()
        out = [r for i in range(0, len(prompts), batch) for r in generate_batch(bb, prompts[i:i + batch], cfg)[0]]
    else:
        batched_replies(bb, prompts[:2], warm)
        t = time.perf_counter()
        out = batched_replies(bb, prompts, cfg)
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--settings", nargs="+", default=["hf:64", "fast:16", "fast:32", "fast:64"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=7, help="prompt shuffle of the distill sources")
    args = ap.parse_args()
    items = [it for _, it in itertools.islice(mixed_items(["sharegpt", "gsm8k", "code", "writing"], args.seed),
                                               args.prompts * 2)]
    ref = None
    for setting in args.settings:
        kind, _, batch = setting.partition(":")
        bb = common.backbone("smollm2", args.dtype, backend="transformers" if kind == "hf" else "fast")
        prompts = [p for p in (bb.encode_prompt(it.prompt, chat=True) for it in items) if len(p) <= 256]
        out, seconds = run(kind, int(batch), prompts[:args.prompts], bb, args.max_new_tokens)
        ref = ref or out
        n = sum(map(len, out))
        same = sum(a == b for a, b in zip(ref, out))
        print(f"{setting}: {n} reply tokens in {seconds:.1f} s = {n / seconds:.1f} tok/s; "
              f"replies identical to {args.settings[0]}: {same}/{len(out)}", flush=True)
    print(common.machine_line())


if __name__ == "__main__":
    main()
