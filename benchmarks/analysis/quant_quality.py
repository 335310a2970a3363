"""How far is a quantized backbone from the unquantized one? cadence's --quant int8 / int4
against llama.cpp's GGUF (Q4_1 for the default model), on the bench prompts; with
``--dtype float32 --quants gguf``, how far fp32 products on the GGUF file's own blocks are from
fp32 products on the same weights dequantized (the same weights; activations rounded to 8 bits
per block of 32 as llama.cpp does, or with ``CADENCE_GGUF_INT8=0`` fp32 ones: other summation
orders only). Each model's argmax is also compared with llama.cpp's at the same positions.

The reference is the unquantized model (``--dtype``, default auto: bf16 on CPUs with native
bf16) decoding each prompt greedily. Every model then reads the prompt and that reply in
one teacher-forced forward, and at each reply position we count:

- top-1 agreement: its argmax equals the reference's greedy token;
- NLL: minus the log-probability it gives the reference's token (nats, mean over positions);
  its exp is the perplexity of the reference's reply under that model.

The unquantized model itself is listed too (teacher-forced: its agreement is just under 1.0
where a batched forward and one-token decoding round differently). llama.cpp gets the same
token ids (``llama_cpp.Llama(logits_all=True)``, its ``eval``) and is skipped when
``llama_cpp`` is not importable. Speed is not measured here (``cadence bench --quant``).

Usage:  python benchmarks/analysis/quant_quality.py [--quants int8 int4 gguf] [--dtype float32] [--limit 4]
            [--max-new-tokens 128]
            [--out runs/quant-quality-<cpu>.json]
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import sys
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.bench import tasks as T
from cadence.bench.peers import gguf_for, llama_cpp_available

TASKS = ("humaneval", "gsm8k", "sharegpt", "writing")


@torch.inference_mode()
def greedy(bb, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding through the backbone's cache, stopping at EOS."""
    cache = bb.new_cache()
    out = bb.forward(torch.tensor([prompt]), cache)
    tokens = []
    for _ in range(n):
        t = int(out.logits[0, -1].argmax())
        tokens.append(t)
        if t in bb.eos_token_ids:
            break
        out = bb.forward(torch.tensor([[t]]), cache)
    return tokens


def score(logits: torch.Tensor, reply: list[int]) -> tuple[int, float]:
    """logits: (len(reply), V) predicting each reply token -> (argmax matches, summed NLL)."""
    target = torch.tensor(reply)
    logp = torch.log_softmax(logits.float(), dim=-1)
    return int((logits.argmax(-1) == target).sum()), float(-logp.gather(1, target[:, None]).sum())


@torch.inference_mode()
def torch_logits(bb, prompt: list[int], reply: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + reply])
    return bb.forward(ids).logits[0, len(prompt) - 1:len(prompt) + len(reply) - 1]


def llama_logits(llm, prompt: list[int], reply: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(prompt + reply)
    return torch.from_numpy(llm.scores[len(prompt) - 1:len(prompt) + len(reply) - 1].copy())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quants", nargs="+", default=["int8", "int4"])
    ap.add_argument("--also-dtypes", nargs="*", default=[],
                    help="more unquantized dtypes scored against the reference, e.g. bfloat16 against --dtype "
                         "float32 (which path is nearer the file: bf16 rounds the dequantized weights)")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--limit", type=int, default=4, help="prompts per task (the bench's seeded subset)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="", help="default runs/quant-quality-<cpu>.json")
    args = ap.parse_args()

    ref = common.backbone(args.model, args.dtype, backend="fast")
    models = {f"cadence {ref.dtype} (reference)".replace("torch.", ""): ref}
    for dt in args.also_dtypes:
        models[f"cadence {dt}"] = common.backbone(args.model, dt, backend="fast")
    for q in args.quants:
        models[f"cadence --quant {q}"] = common.backbone(args.model, args.dtype, backend="fast", quant=q)
    llm = None
    ok, why = llama_cpp_available()
    gguf = gguf_for(args.model)
    if ok and gguf is not None:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(gguf), n_threads=2, n_ctx=2048, logits_all=True, verbose=False)
        match = re.search(r"\.(Q\w+|F16|F32|BF16)\.gguf$", gguf.name, re.IGNORECASE)
        llama_name = f"llama.cpp {match.group(1) if match else gguf.name}"
    else:
        llama_name = None
        print(why or f"llama.cpp skipped: {args.model} has no GGUF file")

    names = list(models) + ([llama_name] if llm is not None else [])
    totals = {n: {"positions": 0, "agree": 0, "nll": 0.0, "agree_llama": 0} for n in names}
    for task in args.tasks:
        items = T.seeded_subset(T.load_task(task).items, args.limit)
        for it in items:
            prompt = ref.encode_prompt(it.prompt, chat=True)
            reply = greedy(ref, prompt, args.max_new_tokens)
            top1 = {}
            for name, bb in models.items():
                logits = torch_logits(bb, prompt, reply)
                top1[name] = logits.argmax(-1)
                a, nll = score(logits, reply)
                t = totals[name]
                t["positions"] += len(reply)
                t["agree"] += a
                t["nll"] += nll
            if llm is not None:
                logits = llama_logits(llm, prompt, reply)
                a, nll = score(logits, reply)
                t = totals[llama_name]
                t["positions"] += len(reply)
                t["agree"] += a
                t["nll"] += nll
                t["agree_llama"] += len(reply)
                for name in models:  # the same positions' argmax as llama.cpp's
                    totals[name]["agree_llama"] += int((top1[name] == logits.argmax(-1)).sum())
            print(f"{task} {it.key}: {len(reply)} reply tokens", flush=True)

    rows = {}
    for name, t in totals.items():
        n = max(t["positions"], 1)
        rows[name] = {"positions": t["positions"], "top1_agreement": t["agree"] / n, "nll": t["nll"] / n,
                      "perplexity": math.exp(t["nll"] / n)}
        if llm is not None:
            rows[name]["top1_agreement_with_llama_cpp"] = t["agree_llama"] / n
    info = common.machine()
    print(f"\n{common.machine_line(info)}\n")
    print("| model | reply positions | top-1 agreement with the reference | with llama.cpp | NLL (nats) | perplexity |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        with_llama = f"{r['top1_agreement_with_llama_cpp']:.3f}" if "top1_agreement_with_llama_cpp" in r else "-"
        print(f"| {name} | {r['positions']} | {r['top1_agreement']:.3f} | {with_llama} | {r['nll']:.3f} | "
              f"{r['perplexity']:.2f} |")
    print()
    common.write_json(common.out_path(args.out, f"quant-quality-{common.cpu_slug()}.json"),
                      {"machine": info, "model": args.model, "tasks": args.tasks, "limit": args.limit,
                       "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=2)


if __name__ == "__main__":
    main()
