"""Where a speculative step's time goes: drafting, the verify forward, and the rest.

Generates greedily with each method on a few held-out-style prompts (not the bench's or
the categories' prompts) and times, per step, the drafter's calls (``draft``, shadow drafts,
``commit``: heads, context copy, attention heads' cache updates), the backbone's verify forward
(``scorer.score`` as the engine calls it), and everything else (acceptance, cache compaction, scheduling).
Methods are interleaved per prompt after a warm-up generation each, and each method's output
is compared with plain decoding's (``identical``).

Methods are named as for ``cadence generate --method`` (``MethodSpec.parse``: ``eagle@DIR``,
``eagle+dynamic,max_nodes=8``, ...) and may carry this script's variants after ``~``: ``~fp32`` drafts
with float32 heads on a bf16 backbone (``MethodSpec.heads_dtype``; the default, auto, drafts in bf16
there), ``~py`` runs the attention heads' drafter block in Python instead of C++
(``fast/native/draft_block.cpp``), e.g. ``eagle/nocopy eagle/nocopy~fp32~py``.

Usage:  python benchmarks/e2e/draft_cost.py [--methods hydra eagle mtp-attn] [--max-new-tokens 128]
            [--dtype float32 --quant gguf]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
import cadence.decode.request as request_mod
from cadence.decode.engine import Engine
from cadence.heads import attn_block
from cadence.decode.generation import GenerationConfig
from cadence.methods import MethodSpec, make_engine

PROMPTS = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "A train travels 60 miles in 1.5 hours. At that speed, how far does it go in 4 hours?",
    "Give three tips for staying focused while studying at home.",
    "Describe a quiet harbour town at dawn in one paragraph.",
]


DRAFTER_CALLS = ("draft", "draft_dynamic", "shadow_heads", "shadow_copy", "judge_shadows", "commit")


class _Timer:
    """Wraps a callable and sums its wall time; ``outer_seconds`` leaves out calls made from
    inside another timed call (``judge_shadows`` calls ``shadow_heads``), so a total over
    timers counts each moment once."""

    active = 0  # timed calls in progress (all timers)

    def __init__(self, fn):
        self.fn, self.seconds, self.outer_seconds, self.calls = fn, 0.0, 0.0, 0

    def __call__(self, *args, **kwargs):
        outer = _Timer.active == 0
        _Timer.active += 1
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            _Timer.active -= 1
            dt = time.perf_counter() - t
            self.seconds += dt
            self.outer_seconds += dt if outer else 0.0
            self.calls += 1


def spec_of(name: str) -> tuple[MethodSpec, bool]:
    """A method name of ``MethodSpec.parse``'s grammar (as ``cadence generate --method`` and
    ``cadence bench`` read it), with this script's own variants after '~': 'eagle/nocopy~fp32~py'
    -> (its MethodSpec with heads_dtype float32, whether the drafter block runs in Python);
    e.g. 'eagle+dynamic/nocopy,max_nodes=8'."""
    text, *flags = name.split("~")
    bad = set(flags) - {"fp32", "py"}
    if bad:
        raise SystemExit(f"unknown variant flag(s) {sorted(bad)} in {name!r}: use ~fp32 and/or ~py")
    spec = MethodSpec.parse(text)
    if "fp32" in flags:
        spec.heads_dtype = "float32"
    return spec, "py" in flags


def add_drafter_times(tot: dict, timers: dict) -> None:
    """Add one generation's drafter timers to a method's totals: ``draft_s`` (all calls) and
    ``calls[name] = [seconds, calls]`` (a call inside another counts in its own entry, once in
    ``draft_s``). Example: draft 2 ms (1 call), commit 1 ms (3 calls) -> draft_s += 0.003,
    calls["draft"] += [0.002, 1], calls["commit"] += [0.001, 3]."""
    calls = tot.setdefault("calls", {})
    for name, timer in timers.items():
        tot["draft_s"] += timer.outer_seconds
        acc = calls.setdefault(name, [0.0, 0])
        acc[0] += timer.seconds
        acc[1] += timer.calls


def install_timers(drafter) -> dict:
    """Wrap each of ``DRAFTER_CALLS`` that ``drafter`` has (drafts, shadow drafts, drafter-state
    commits) in a ``_Timer`` on the instance; {name: timer}. A drafter without some of them (the
    ngram method's ``CopyDrafter`` has no dynamic or head drafts) gets timers for the rest; None
    (plain decoding) gets none."""
    timers = {}
    for name in DRAFTER_CALLS:
        if drafter is not None and hasattr(drafter, name):
            timers[name] = _Timer(getattr(drafter, name))
            setattr(drafter, name, timers[name])
    return timers


def measure(bb, methods: list[str], max_new: int, repeats: int) -> dict:
    specs = {m: spec_of(m) for m in methods}
    engines = {m: make_engine(bb, spec) for m, (spec, _) in specs.items()}
    native_block = attn_block._native_block
    cfg = GenerationConfig(max_new_tokens=max_new)
    prompts = [bb.encode_prompt(p, chat=True) for p in PROMPTS]
    refs = [Engine(bb).generate(ids, cfg).tokens for ids in prompts]

    def python_block(m: str) -> None:
        attn_block._native_block = (lambda *a: None) if specs[m][1] else native_block

    for m, eng in engines.items():  # warm-up
        python_block(m)
        eng.generate(prompts[0], cfg)
    real_score = request_mod.score
    totals = {m: {"draft_s": 0.0, "verify_s": 0.0, "total_s": 0.0, "steps": 0, "tokens": 0, "identical": 0,
                  "runs": 0} for m in methods}
    try:
        for r in range(repeats):
            for i, ids in enumerate(prompts):
                order = list(engines.items())
                for m, eng in (order if (r * len(prompts) + i) % 2 == 0 else order[::-1]):
                    python_block(m)
                    timers = install_timers(eng.drafter)
                    verify = _Timer(real_score)
                    request_mod.score = verify
                    t = time.perf_counter()
                    out = eng.generate(ids, cfg)
                    tot = totals[m]
                    tot["total_s"] += time.perf_counter() - t
                    request_mod.score = real_score
                    for name in timers:
                        delattr(eng.drafter, name)  # back to the class method
                    add_drafter_times(tot, timers)
                    tot["verify_s"] += verify.seconds
                    tot["steps"] += verify.calls
                    tot["tokens"] += len(out.tokens)
                    tot["identical"] += out.tokens == refs[i]
                    tot["runs"] += 1
    finally:
        request_mod.score = real_score
        attn_block._native_block = native_block
    rows = {}
    for m, t in totals.items():
        steps = max(t["steps"], 1)
        rows[m] = {"tok_s": round(t["tokens"] / t["total_s"], 2), "tokens_per_step": round(t["tokens"] / steps, 3),
                   "draft_ms_per_step": round(1e3 * t["draft_s"] / steps, 3),
                   "verify_ms_per_step": round(1e3 * t["verify_s"] / steps, 3),
                   "other_ms_per_step": round(1e3 * (t["total_s"] - t["draft_s"] - t["verify_s"]) / steps, 3),
                   "steps": t["steps"], "tokens": t["tokens"], "identical": f"{t['identical']}/{t['runs']}",
                   "drafter_calls": {n: {"ms_per_step": round(1e3 * s / steps, 3),
                                         "calls_per_step": round(k / steps, 3)}
                                     for n, (s, k) in t.get("calls", {}).items() if k}}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quant", default="none", help="the backbone's --quant (gguf: the GGUF file's blocks, with --dtype float32)")
    ap.add_argument("--methods", nargs="+", default=["vanilla", "hydra", "eagle", "mtp-attn"],
                    help="method names (MethodSpec.parse, as cadence generate --method), then variant flags "
                         "~fp32 (float32 heads) and ~py (drafter block in Python)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    args = ap.parse_args()
    bb = common.backbone(args.model, args.dtype, quant=args.quant)
    rows = measure(bb, args.methods, args.max_new_tokens, args.repeats)
    info = common.machine()
    print(f"Machine: {common.machine_line(info)}; backbone {bb.dtype}\n")
    print("| method | tok/s | tokens/step | draft ms/step | verify ms/step | other ms/step | identical |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m, r in rows.items():
        print(f"| {m} | {r['tok_s']} | {r['tokens_per_step']} | {r['draft_ms_per_step']} | "
              f"{r['verify_ms_per_step']} | {r['other_ms_per_step']} | {r['identical']} |")
    print("\nDrafter calls, ms per step (calls per step):")
    for m, r in rows.items():
        calls = ", ".join(f"{n} {c['ms_per_step']} ({c['calls_per_step']})" for n, c in r["drafter_calls"].items())
        print(f"- {m}: {calls or 'none'}")
    if args.out:
        common.write_json(args.out, {"machine": info, "dtype": str(bb.dtype), "rows": rows,
                                     "max_new_tokens": args.max_new_tokens, "repeats": args.repeats}, indent=2)


if __name__ == "__main__":
    main()
