"""Where the batched engine's greedy output differs from the single request's: was it a near-tie?

Every prompt runs once alone (``Engine.generate``, which is plain decoding's output: speculation
is lossless on one row) and once queued on a ``BatchEngine`` of ``--batch`` rows built as
``cadence serve`` builds it (default narrowing, prompts prefilled ``--prefill-chunk`` tokens a
step). A batched forward is not bit-identical to a one-row forward (its rows attend through
another kernel), so a greedy token may differ where the top two logits (nearly) tie. For every row that differs, the backbone's logits at the first differing position
are recomputed by one plain forward over prompt + the common prefix, and the script prints the
top-2 logit gap there and how far the batched row's token is below the top one. A gap of a few
fp32 rounding steps of the logits (about 1e-5 at these magnitudes; bf16 0.125) is a near-tie; a
larger one would be a defect.

With ``--serve-load FILE`` (a ``benchmarks/e2e/serve_load.py`` result) it checks that run's
batched responses that differed from the same server's sequential ones instead, from their
texts, each tokenized whole and compared token by token (a greedy reply re-tokenizes to its own
tokens except where a split is ambiguous).

Usage:  python benchmarks/analysis/batch_ties.py [--method hydra] [--batch 8] [--limit 56]
            [--max-new-tokens 128] [--prefill-chunk 256] [--dtype auto] [--out FILE]
        python benchmarks/analysis/batch_ties.py --serve-load runs/serve-load.json [--server cadence]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.batch.engine import BatchEngine  # noqa: E402
from cadence.decode.generation import GenerationConfig  # noqa: E402
from cadence.methods import MethodSpec, make_engine  # noqa: E402
from cadence.server.config import PREFILL_CHUNK, NarrowFlags  # noqa: E402


def batched(engine: BatchEngine, prompts: list[list[int]], cfg: GenerationConfig) -> list[list[int]]:
    """Queue every prompt at once and step until done: each row's tokens, in prompt order."""
    rids = [engine.add(p, cfg) for p in prompts]
    toks = {r: [] for r in rids}
    while engine.has_work():
        for ev in engine.step():
            toks[ev.rid] += ev.tokens
    return [toks[r] for r in rids]


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where a and b differ (the shorter length if one is a prefix).
    Example: [1, 2, 3], [1, 2, 4] -> 2; [1, 2], [1, 2, 3] -> 2."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.inference_mode()
def tie(bb, prompt: list[int], single: list[int], other: list[int]) -> dict:
    """At the first differing position of two outputs of ``prompt``: the plain forward's top-2
    logit gap, and how far below the top ``other``'s token is."""
    i = first_difference(single, other)
    logits = bb.forward(torch.tensor([prompt + single[:i]]), None).logits[0, -1].float()
    top2 = logits.topk(2)
    out = {"position": i, "single_token": single[i] if i < len(single) else None,
           "batched_token": other[i] if i < len(other) else None,
           "top2_gap": round(float(top2.values[0] - top2.values[1]), 6)}
    if out["batched_token"] is not None:
        out["batched_below_top"] = round(float(top2.values[0] - logits[out["batched_token"]]), 6)
    return out


def text_tie(bb, prompt: str, single: str, other: str) -> dict:
    """``tie`` for two replies known by their texts: each is tokenized whole (a greedy reply
    re-tokenizes to its own tokens but where a split is ambiguous) and compared token by token."""
    tok = bb.tokenizer
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in (single, other)]
    out = tie(bb, bb.encode_prompt(prompt, chat=True), *ids)
    for key in ("single_token", "batched_token"):
        out[key] = tok.decode([out[key]]) if out[key] is not None else None
    return out


def serve_ties(bb, path: str, server: str) -> list[dict]:
    """Every differing batched response of ``server`` in a serve_load result, traced."""
    res = json.loads(Path(path).read_text())
    srv = res["servers"][server]
    out = []
    for level in srv["levels"]:
        for d in level.get("differing", []):
            k = d["request"]
            out.append({"clients": level["clients"], "request": k,
                        **text_tie(bb, res["prompts"][k], srv["texts"][k], d["text"])})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--method", default="hydra")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", default=str(common.PROMPTS / "categories.jsonl"))
    ap.add_argument("--limit", type=int, default=56)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="as `cadence serve --prefill-chunk`")
    ap.add_argument("--serve-load", default=None, help="trace a serve_load.py result's differing responses")
    ap.add_argument("--server", default="cadence", help="which server of --serve-load")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bb = common.backbone(args.model, args.dtype, backend="fast", quant="auto")
    if args.serve_load:
        for d in serve_ties(bb, args.serve_load, args.server):
            print(f"{d['clients']} clients, request {d['request']}: first difference at token {d['position']} "
                  f"({d['single_token']!r} alone, {d['batched_token']!r} batched), top-2 logit gap {d['top2_gap']}, "
                  f"batched token {d.get('batched_below_top')} below the top")
        return
    engine = make_engine(bb, MethodSpec.parse(args.method))
    items = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][:args.limit]
    prompts = [bb.encode_prompt(it["prompt"], chat=True) for it in items]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    single = [engine.generate(p, cfg).tokens for p in prompts]
    served = BatchEngine.from_engine(engine, max_batch=args.batch, narrow=NarrowFlags().config(),
                                     prefill_chunk=args.prefill_chunk)
    rows = batched(served, prompts, cfg)
    diffs = [{"prompt": k, "category": items[k].get("category"), **tie(bb, prompts[k], single[k], rows[k])}
             for k in range(len(prompts)) if rows[k] != single[k]]
    info = common.machine()
    print(f"Machine: {common.machine_line(info)}; {bb.name}, {args.method}, batch {args.batch}, "
          f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy")
    print(f"{len(prompts) - len(diffs)}/{len(prompts)} batched rows equal the single request's output")
    for d in diffs:
        print(f"prompt {d['prompt']} ({d['category']}): first difference at token {d['position']}, "
              f"top-2 logit gap {d['top2_gap']}, batched token {d.get('batched_below_top')} below the top")
    if args.out:
        common.write_json(args.out, {"machine": info, "args": vars(args), "rows": len(prompts), "differ": diffs})


if __name__ == "__main__":
    main()
