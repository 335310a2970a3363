"""Decoding with the loaded model's objects frozen out of Python's cyclic collector
(``cadence.system.heap.settled``, what ``cadence generate`` / ``bench`` / ``serve`` do) against
the collector left as it is, in one process.

Per prompt, both heap modes run every method, the mode order alternating between prompts;
each mode starts from a full collection (``settled`` collects, then freezes; the plain mode
collects too), outside the timing. Speed is pooled tokens over pooled seconds; ``identical``
checks that freezing changes no token.

Usage:  python benchmarks/e2e/gc_freeze.py [--methods vanilla hydra] [--limit 28] [--max-new-tokens 128]
            [--dtype auto] [--quant auto] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.decode.engine import Engine  # noqa: E402
from cadence.decode.generation import GenerationConfig  # noqa: E402
from cadence.methods import MethodSpec, make_engine  # noqa: E402
from cadence.prompts import jsonl_items  # noqa: E402
from cadence.system.heap import settled  # noqa: E402

common.use("e2e")
from paths import spread  # noqa: E402

MODES = ("collector", "frozen")


def heap(mode: str):
    """The context a mode decodes in: ``settled()`` (frozen) or a plain full collection first."""
    if mode == "frozen":
        return settled()
    gc.collect()
    return nullcontext()


def measure(engines: dict, prompts: list, cfg: GenerationConfig) -> dict:
    tot = {(mode, m): {"tokens": 0, "seconds": 0.0, "identical": 0} for mode in MODES for m in engines}
    for i, ids in enumerate(prompts):
        outs = {}
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            with heap(mode):
                for m, eng in engines.items():
                    t = time.perf_counter()
                    out = eng.generate(ids, cfg)
                    tot[(mode, m)]["seconds"] += time.perf_counter() - t
                    tot[(mode, m)]["tokens"] += len(out.tokens)
                    outs[(mode, m)] = out.tokens
        for (mode, m) in tot:
            tot[(mode, m)]["identical"] += outs[(mode, m)] == outs[("collector", m)]
        print(f"prompt {i + 1}/{len(prompts)}", file=sys.stderr)
    return tot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--methods", nargs="+", default=["vanilla", "hydra"])
    ap.add_argument("--prompts", default="benchmarks/prompts/categories.jsonl")
    ap.add_argument("--limit", type=int, default=28, help="prompts, spread over the file (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bb = common.backbone(args.model, args.dtype, quant=args.quant)
    engines = {m: Engine(bb) if m == "vanilla" else make_engine(bb, MethodSpec.parse(m)) for m in args.methods}
    items = spread(list(jsonl_items(args.prompts)), args.limit)
    prompts = [bb.encode_prompt(it.prompt, chat=True) for it in items]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    for eng in engines.values():  # warm-up
        eng.generate(prompts[0], cfg)
    tot = measure(engines, prompts, cfg)
    rows = []
    for m in engines:
        rate = {mode: tot[(mode, m)]["tokens"] / tot[(mode, m)]["seconds"] for mode in MODES}
        rows.append({"method": m, "collector_tok_s": round(rate["collector"], 1),
                     "frozen_tok_s": round(rate["frozen"], 1),
                     "gain": round(rate["frozen"] / rate["collector"], 3),
                     "identical": f"{tot[('frozen', m)]['identical']}/{len(prompts)}"})
    info = common.machine()
    print(f"Machine: {common.machine_line(info)}; {len(prompts)} prompts of {args.prompts}, "
          f"{args.max_new_tokens} new tokens, greedy, {bb.name} ({args.dtype}, {args.quant})\n")
    print("| method | collector tok/s | frozen tok/s | frozen / collector | identical |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['collector_tok_s']} | {r['frozen_tok_s']} | {r['gain']}x | {r['identical']} |")
    if args.out:
        common.write_json(args.out, {"machine": info, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
