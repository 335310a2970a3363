"""What chunked prefill buys running rows: their inter-token latency while long prompts
arrive, with ``prefill_chunk`` = 0 (a whole prompt in one forward) and with chunks, in one
interleaved run on the batched engine (no HTTP), plus the prompt forward's cost curve.

Scenario, per chunk setting: ``--running`` short held-out prompts
(``benchmarks/prompts/categories.jsonl``) decode with the default method; once they are
running, a long prompt (``--long-tokens`` tokens: a request to summarize the repository's
own ``docs/`` text, which no head was trained on) arrives every ``--every`` steps,
``--arrivals`` times, each asking for ``--long-new`` tokens. Reported: the gaps between
a running row's consecutive tokens-bearing events (its inter-token latency as a server
streams it) p50 / p99 / max over the whole run and over the steps that spent prompt
tokens, the long requests' time to first token, and whether every request's greedy
tokens equal those of the ``prefill_chunk`` = 0 run (chunking changes only the float
rounding of the prompt's keys, which can matter at an exact near-tie).

Usage (a quiet machine; about a minute per setting):
    python benchmarks/e2e/prefill_chunk.py --chunks 0 64 128 256 --out runs/prefill-chunk.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.batch.engine import BatchEngine
from cadence.decode.generation import GenerationConfig
from cadence.methods import MethodSpec, make_engine

PROMPTS = common.PROMPTS / "categories.jsonl"


def short_prompts(n: int) -> list[str]:
    items = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [it["prompt"] for it in items[:n]]


def long_prompt(bb, tokens: int) -> list[int]:
    """A chat prompt of about ``tokens`` tokens: summarize this text (docs/*.md, cut to fit)."""
    text = "\n\n".join(p.read_text() for p in sorted((common.ROOT / "docs").glob("*.md")))
    ask = "Summarize the following text in three sentences.\n\n"
    overhead = len(bb.encode_prompt(ask, chat=True))
    body = bb.tokenizer.encode(text, add_special_tokens=False)[: max(0, tokens - overhead)]
    return bb.encode_prompt(ask + bb.tokenizer.decode(body), chat=True)


@torch.inference_mode()
def prefill_curve(bb, sizes: list[int], reps: int = 3) -> dict[int, float]:
    """Median ms of one prompt forward of n tokens (one row, from position 0)."""
    out = {}
    for n in sizes:
        ids = torch.randint(100, 1000, (1, n))
        times = []
        for _ in range(reps + 1):
            cache = bb.new_batch_cache(1, capacity=n)
            t = time.perf_counter()
            bb.forward_rows(ids, cache, 0, [0], need_logits=False)
            times.append(time.perf_counter() - t)
        out[n] = round(1000 * sorted(times[1:])[len(times[1:]) // 2], 2)
    return out


def scenario(engine, chunk: int, shorts: list[list[int]], long_ids: list[int], args) -> dict:
    be = BatchEngine.from_engine(engine, max_batch=len(shorts) + 1, prefill_chunk=chunk)
    cfg_short = GenerationConfig(max_new_tokens=args.short_new)
    cfg_long = GenerationConfig(max_new_tokens=args.long_new)
    rids = [be.add(p, cfg_short) for p in shorts]
    toks = {r: [] for r in rids}
    last_t: dict[int, float] = {}
    gaps, gaps_prefill, ttft, added = [], [], [], {}
    step, arrivals = 0, 0
    while be.has_work():
        if step >= args.warm and arrivals < args.arrivals and (step - args.warm) % args.every == 0:
            rid = be.add(long_ids, cfg_long)
            toks[rid], added[rid] = [], time.perf_counter()
            arrivals += 1
        filling = be.filling is not None or any(r.rid in added for r in be.waiting)
        events = be.step()
        now = time.perf_counter()
        for ev in events:
            toks[ev.rid] += ev.tokens
            if ev.rid in added:
                if ev.tokens and ev.rid not in last_t:
                    ttft.append(now - added[ev.rid])
                    last_t[ev.rid] = now
                continue
            if ev.tokens:
                if ev.rid in last_t and step > args.warm:
                    (gaps_prefill if filling else gaps).append(now - last_t[ev.rid])
                last_t[ev.rid] = now
        step += 1
    return {"gaps": gaps, "gaps_prefill": gaps_prefill, "ttft": ttft, "tokens": [toks[r] for r in sorted(toks)],
            "steps": step}


def q(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(p * len(xs)))], 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", nargs="+", type=int, default=[0, 64, 128, 256], help="prefill_chunk settings (0 = whole)")
    ap.add_argument("--running", type=int, default=4, help="short requests decoding throughout")
    ap.add_argument("--short-new", type=int, default=160, help="new tokens of each short request")
    ap.add_argument("--long-tokens", type=int, default=1536, help="tokens of each long prompt")
    ap.add_argument("--long-new", type=int, default=8, help="new tokens of each long request")
    ap.add_argument("--arrivals", type=int, default=3, help="long prompts per run")
    ap.add_argument("--every", type=int, default=12, help="steps between long arrivals")
    ap.add_argument("--warm", type=int, default=4, help="steps before the first arrival (not timed)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per setting, settings interleaved")
    ap.add_argument("--curve", nargs="*", type=int, default=[32, 64, 128, 256, 512, 1024, 2048],
                    help="prompt lengths of the prefill cost curve")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=None, help="result JSON (default runs/prefill-chunk.json)")
    args = ap.parse_args(argv)

    bb = common.backbone(args.model)
    engine = make_engine(bb, MethodSpec())
    shorts = [bb.encode_prompt(p, chat=True) for p in short_prompts(args.running)]
    long_ids = long_prompt(bb, args.long_tokens)
    curve = prefill_curve(bb, args.curve)
    print("prompt forward ms:", curve, flush=True)
    scenario(engine, args.chunks[-1], shorts[:1], long_ids[:64], argparse.Namespace(**{**vars(args), "arrivals": 1,
                                                                                       "short_new": 8}))  # warm-up
    runs: dict[int, list[dict]] = {c: [] for c in args.chunks}
    for r in range(args.repeats):
        order = args.chunks if r % 2 == 0 else args.chunks[::-1]
        for c in order:
            runs[c].append(scenario(engine, c, shorts, long_ids, args))
            print(f"repeat {r} chunk {c}: {runs[c][-1]['steps']} steps", flush=True)
    base = runs[args.chunks[0]][0]["tokens"]
    rows = []
    for c in args.chunks:
        gaps = [g for run in runs[c] for g in run["gaps"]]
        gp = [g for run in runs[c] for g in run["gaps_prefill"]]
        ttft = [t for run in runs[c] for t in run["ttft"]]
        same = sum(run["tokens"] == base for run in runs[c])
        rows.append({"prefill_chunk": c, "itl_ms": {"p50": q(gaps + gp, 0.5), "p99": q(gaps + gp, 0.99),
                                                    "max": q(gaps + gp, 1.0)},
                     "itl_during_prefill_ms": {"p50": q(gp, 0.5), "p99": q(gp, 0.99), "max": q(gp, 1.0)},
                     "long_ttft_ms": {"p50": q(ttft, 0.5), "max": q(ttft, 1.0)},
                     "runs_identical_to_first_setting": f"{same}/{len(runs[c])}"})
    result = {"machine": common.machine(), "args": vars(args), "long_prompt_tokens": len(long_ids), "prefill_forward_ms": curve, "method": MethodSpec().format(),
              "settings": rows}
    print(f"{'chunk':>6} {'ITL p50':>8} {'p99':>8} {'max':>8} | {'during prefill p50':>18} {'p99':>8} {'max':>8} | "
          f"{'long TTFT p50':>13} {'max':>8} | same")
    for row in rows:
        a, b, t = row["itl_ms"], row["itl_during_prefill_ms"], row["long_ttft_ms"]
        print(f"{row['prefill_chunk']:>6} {a['p50']:>8} {a['p99']:>8} {a['max']:>8} | {b['p50']!s:>18} {b['p99']!s:>8} "
              f"{b['max']!s:>8} | {t['p50']!s:>13} {t['max']!s:>8} | {row['runs_identical_to_first_setting']}")
    common.write_json(common.out_path(args.out, "prefill-chunk.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
