"""What drawing one token costs at T > 0, before and after the nucleus rewrite: ``sampling.probs`` with
top-p through a full sort (the old rule) against ``outside_nucleus`` (top-k 128/1024 first),
and ``torch.multinomial`` against ``sampling.categorical``'s inverse CDF, on SmolLM2's
vocabulary (49,152) with logits from the real model's replies when ``--model`` loads,
else Gaussian logits scaled to a peaked distribution. Milliseconds per call, median of
``--reps`` runs of ``--calls`` calls, old and new interleaved. Greedy's share: torch's
``argmax`` against ``sampling.argmax`` (the native kernel) for one row and for 32 rows.

Usage:  python benchmarks/kernels/sampling_cost.py [--temperature 0.7] [--top-p 0.9] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.fast import native
from cadence.verify.sampling import SamplingParams, argmax, probs, sample


def old_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``probs`` as it was before ``outside_nucleus`` (top-p by sorting the whole vocabulary)."""
    logits = logits.float() / p.temperature
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def timed(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3


def model_logits(n: int) -> torch.Tensor | None:
    """(n, V) logits of the default model along a short greedy reply, or None if it cannot load."""
    try:
        from cadence.decode.engine import Engine
        from cadence.decode.generation import GenerationConfig

        bb = common.backbone("smollm2")
        ids = bb.encode_prompt("Write a short story about a lighthouse keeper.", chat=True)
        reply = Engine(bb).generate(ids, GenerationConfig(max_new_tokens=n)).tokens
        with torch.inference_mode():
            return bb.forward(torch.tensor([ids + reply])).logits[0, len(ids) - 1:len(ids) - 1 + n].float()
    except Exception as e:  # noqa: BLE001 - a benchmark falls back to synthetic logits
        print(f"default model not loaded ({e}); Gaussian logits")
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(2)
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    rows = model_logits(args.calls)
    if rows is None:
        rows = torch.randn(args.calls, 49152, generator=torch.Generator().manual_seed(0)) * 4
    dists = [probs(r, sp) for r in rows]
    g = torch.Generator().manual_seed(0)

    def over(seq, fn):  # each call takes the next row, round and round
        items = itertools.cycle(seq)
        return lambda: fn(next(items))

    cases = {
        "probs, full sort (old)": over(rows, lambda r: old_probs(r, sp)),
        "probs, outside_nucleus (new)": over(rows, lambda r: probs(r, sp)),
        "draw, torch.multinomial (old)": over(dists, lambda d: torch.multinomial(d, 1, replacement=True, generator=g)),
        "draw, inverse CDF (new)": over(dists, lambda d: sample(d, g)),
    }
    if native.module() is not None:  # greedy: the argmax of a row, and of a 32-node tree's rows
        block = torch.stack([rows[i % len(rows)] for i in range(32)])
        cases.update({
            "argmax 1 row, torch (old)": over(rows, lambda r: r.argmax(-1)),
            "argmax 1 row, native (new)": over(rows, argmax),
            "argmax 32 rows, torch (old)": lambda: block.argmax(-1),
            "argmax 32 rows, native (new)": lambda: argmax(block),
        })
    for fn in cases.values():  # warm-up
        timed(fn, 8)
    runs: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.reps):
        for name, fn in cases.items():
            runs[name].append(timed(fn, args.calls))
    result = {name: statistics.median(v) for name, v in runs.items()}
    kept = statistics.median(float((d > 0).sum()) for d in dists)
    info = common.machine()
    print(common.machine_line(info))
    print(f"T {args.temperature}, top-p {args.top_p}, vocabulary {rows.shape[-1]}, median nucleus {kept:.0f} tokens")
    for name, ms in result.items():
        print(f"  {name:32s} {ms:7.3f} ms")
    if args.out:
        common.write_json(args.out, {"machine": info, "temperature": args.temperature, "top_p": args.top_p,
                                     "nucleus_median": kept, "ms": result}, indent=2)


if __name__ == "__main__":
    main()
