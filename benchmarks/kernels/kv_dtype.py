"""The KV cache in float16 against float32 on the GGUF blocks' float32 path: speed of a forward
at several context lengths, and how far the outputs move.

Speed: ``verify_cost.curve`` on two backbones over the same weights, one with each cache,
interleaved (ms per forward of a binary tree of n nodes after ``--contexts`` tokens).
Quality, on the long prompts (``benchmarks/prompts/long_prompts.py``): each prompt is decoded
greedily (``--max-new-tokens``) with the float32 cache; both backbones then read prompt +
reply in one teacher-forced forward, and we count top-1 agreement with that reply and its NLL
(nats per token), as ``benchmarks/analysis/quant_quality.py`` does for weight formats. The
float16 cache's own greedy replies are compared with the float32 ones too (identical replies,
tokens before the first difference).

Usage:  python benchmarks/kernels/kv_dtype.py [--contexts 200 1000 2000] [--sizes 1 4 8] [--reps 15]
            [--prompts runs/long.jsonl] [--limit 12] [--max-new-tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from verify_cost import curve, greedy_loop  # noqa: E402
from cadence.backbone.load import load_backbone

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "analysis"))
from quant_quality import score  # noqa: E402


def backbones(model: str) -> dict:
    """The GGUF blocks' float32 backbone with a float32 and with a float16 KV cache (two loads)."""
    return {f"kv {kv}": load_backbone(model, "float32", quant="gguf", kv_dtype=kv) for kv in ("float32", "float16")}


@torch.inference_mode()
def cached_logits(bb, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """Logits predicting each reply token from one forward over prompt + reply that stores
    its keys and values in ``bb``'s cache and attends to what the cache holds (a float16 cache:
    the rounded entries, as decoding reads them)."""
    ids = torch.tensor([prompt + reply])
    return bb.forward(ids, bb.new_cache()).logits[0, len(prompt) - 1:len(prompt) + len(reply) - 1]


def quality(bbs: dict, prompts: list[str], max_new: int) -> dict:
    ref = bbs["kv float32"]
    rows = {name: {"agree": 0, "nll": 0.0, "positions": 0} for name in bbs}
    same, prefix, total = 0, 0, 0
    for text in prompts:
        ids = ref.encode_prompt(text, chat=True)
        reply = greedy_loop(ref, ids, max_new)
        own = greedy_loop(bbs["kv float16"], ids, max_new)
        same += own == reply
        prefix += next((i for i, (a, b) in enumerate(zip(own, reply)) if a != b), min(len(own), len(reply)))
        total += len(reply)
        for name, bb in bbs.items():
            agree, nll = score(cached_logits(bb, ids, reply), reply)
            rows[name]["agree"] += agree
            rows[name]["nll"] += nll
            rows[name]["positions"] += len(reply)
    out = {name: {"top1": round(r["agree"] / r["positions"], 4), "nll": round(r["nll"] / r["positions"], 4),
                  "positions": r["positions"]} for name, r in rows.items()}
    out["greedy"] = {"identical": f"{same}/{len(prompts)}", "tokens_before_first_difference": prefix,
                     "reply_tokens": total}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 1000, 2000])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--prompts", default="runs/long.jsonl", help="JSONL of {'prompt': ...} (long_prompts.py)")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    bbs = backbones(args.model)
    result = {"model": args.model, "kernels": {k: bb.kernels for k, bb in bbs.items()}, "speed": {}}
    print("| context | cache | " + " | ".join(f"T({n}) ms" for n in args.sizes) + f" | T({args.sizes[-1]})/T(1) |")
    print("|---:|---|" + "---:|" * (len(args.sizes) + 1))
    for context in args.contexts:
        res = curve(bbs, context, args.sizes, args.reps)
        result["speed"][str(context)] = res
        for name, r in res.items():
            ms = [r["ms"][str(n)] for n in args.sizes]
            print(f"| {context} | {name} | " + " | ".join(f"{m:.2f}" for m in ms) + f" | {ms[-1] / ms[0]:.2f} |",
                  flush=True)
    if args.limit and Path(args.prompts).is_file():
        prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines()][:args.limit]
        result["quality"] = q = quality(bbs, prompts, args.max_new_tokens)
        for name in bbs:
            print(f"{name}: top-1 agreement with the float32 cache's greedy replies {q[name]['top1']:.4f}, "
                  f"NLL {q[name]['nll']:.4f} nats/token ({q[name]['positions']} positions)")
        g = q["greedy"]
        print(f"greedy replies identical {g['identical']}; {g['tokens_before_first_difference']} of "
              f"{g['reply_tokens']} tokens before the first difference")
    print(common.machine_line())
    if args.out:
        common.write_json(args.out, {**result, "machine": common.machine()})


if __name__ == "__main__":
    main()
