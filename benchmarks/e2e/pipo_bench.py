"""PIPO (LOSSY) against plain decoding of the unmodified model, in one interleaved run.

Speed, on the same forward (transformers modules, float32 weights, ``--threads`` threads):
time to first token on long prompts (``--ttft-lengths``: a request to summarize this repository's
docs/ text, cut to length), then per-token latency and tokens/s over ``--prompts`` held-out
store prompts (``data/selfdistill/smollm2`` val split: never training prompts, never benchmark
prompts), methods interleaved per prompt, one warm-up generation of each method excluded.
Quality: agreement with plain greedy output (identical share, common-prefix share), repetition
ratio (1 - distinct 4-grams / 4-grams), NLL of the teacher's replies (val split) under the student
in each mode, and GSM8K exact match (``--gsm8k`` test questions). Every PIPO directory in ``--pipo``
(``label=DIR``, e.g. snapshots at several step counts) is measured the same way; speed columns use
the plain run of the same pass.

Usage (timings need a quiet machine: run it through /work/bin/quiet or alone):
    python benchmarks/e2e/pipo_bench.py --pipo 60=runs/pipo/step-000060 final=runs/pipo/final \\
        --out runs/pipo-bench.json --plot runs/pipo-bench.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.bench.metrics import repetition_ratio  # noqa: E402
from cadence.pipo.decode import PipoDecoder  # noqa: E402
from cadence.pipo.evaluate import agreement, reply_nll  # noqa: E402
from cadence.pipo.config import StudentConfig  # noqa: E402
from cadence.pipo.student import load_student, Student  # noqa: E402


@torch.inference_mode()
def plain_generate(base, ids: list[int], max_new: int, eos) -> dict:
    """Plain greedy decoding of the unmodified model on the same modules PIPO's plain steps use."""
    from transformers import DynamicCache

    t0 = time.perf_counter()
    cache = DynamicCache(config=base.config)
    h = base.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).last_hidden_state[0, -1]
    a = int(base.get_output_embeddings()(h).argmax())
    ttft = time.perf_counter() - t0
    out = [a]
    while a not in eos and len(out) < max_new:
        h = base.model(input_ids=torch.tensor([[a]]), past_key_values=cache, use_cache=True).last_hidden_state[0, -1]
        a = int(base.get_output_embeddings()(h).argmax())
        out.append(a)
    wall = time.perf_counter() - t0
    return {"tokens": out, "ttft_s": ttft, "wall_s": wall, "forwards": len(out)}


def long_prompt(bb, tokens: int) -> list[int]:
    text = "\n\n".join(p.read_text() for p in sorted((common.ROOT / "docs").glob("*.md")))
    ask = "Summarize the following text in three sentences.\n\n"
    overhead = len(bb.encode_prompt(ask, chat=True))
    body = bb.tokenizer.encode(text, add_special_tokens=False)[: max(0, tokens - overhead)]
    ids = bb.encode_prompt(ask + bb.tokenizer.decode(body), chat=True)
    return ids[:tokens - 5] + ids[-5:] if len(ids) > tokens else ids


def methods(students: dict, args) -> list[tuple[str, str, object]]:
    """(label, pipo dir label, decoder) of every PIPO configuration measured."""
    out = []
    for lab, st in students.items():
        out.append((f"{lab}:prompt", lab, PipoDecoder(st, "prompt")))
        for thr in args.thresholds:
            out.append((f"{lab}:pairs@{thr:g}", lab, PipoDecoder(st, "pairs", "confidence", thr)))
        if args.verify:
            out.append((f"{lab}:pairs-verify", lab, PipoDecoder(st, "pairs", "verify")))
    return out


def run_one(dec, ids, max_new, eos) -> dict:
    if dec is None:
        return None
    r = dec.generate(ids, max_new, eos=eos)
    return {"tokens": r.tokens, "ttft_s": r.ttft_s, "wall_s": r.wall_s, "forwards": r.forwards,
            "pair_steps": r.pair_steps}


def ttft_phase(bb, students, args, eos) -> dict:
    res = {}
    first = next(iter(students.values()))
    for L in args.ttft_lengths:
        ids = long_prompt(bb, L)
        dec = {lab: PipoDecoder(st, "prompt") for lab, st in students.items()}
        plain_generate(bb.model, ids[:64], 2, eos)  # warm-up
        for d in dec.values():
            d.generate(ids[:64], 2, eos=eos)
        rows = {"plain": [], **{k: [] for k in dec}}
        outs = {}
        for _ in range(args.ttft_repeats):
            r = plain_generate(bb.model, ids, args.ttft_new, eos)
            rows["plain"].append(r["ttft_s"])
            outs["plain"] = r["tokens"]
            for lab, d in dec.items():
                g = d.generate(ids, args.ttft_new, eos=eos)
                rows[lab].append(g.ttft_s)
                outs[lab] = g.tokens
        med = {k: statistics.median(v) for k, v in rows.items()}
        res[str(len(ids))] = {"prompt_tokens": len(ids), "ttft_s": {k: round(v, 4) for k, v in med.items()},
                              "speedup": {k: round(med["plain"] / v, 3) for k, v in med.items() if k != "plain"},
                              "prefix_share": {k: round(agreement(outs[k], outs["plain"])["prefix_share"], 3)
                                               for k in dec}}
        print(f"ttft {len(ids)}: {res[str(len(ids))]}", flush=True)
    del first
    return res


def decode_phase(bb, students, prompts, args, eos, max_new, tag) -> dict:
    ms = methods(students, args)
    plain_generate(bb.model, prompts[0], 4, eos)
    for _, _, d in ms:
        d.generate(prompts[0], 4, eos=eos)
    recs: dict[str, list] = {"plain": [], **{lab: [] for lab, _, _ in ms}}
    for ids in prompts:
        recs["plain"].append(plain_generate(bb.model, ids, max_new, eos))
        for lab, _, d in ms:
            recs[lab].append(run_one(d, ids, max_new, eos))
    out = {}
    for lab, rs in recs.items():
        n = sum(len(r["tokens"]) for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        dec_s = sum(r["wall_s"] - r["ttft_s"] for r in rs)
        out[lab] = {"tokens": n, "tokens_per_s": round(n / wall, 3),
                    "per_token_ms": round(1000 * dec_s / max(sum(len(r["tokens"]) - 1 for r in rs), 1), 3),
                    "ttft_ms": round(1000 * statistics.mean(r["ttft_s"] for r in rs), 2),
                    "tokens_per_forward": round(n / sum(r["forwards"] for r in rs), 3),
                    "repetition": round(statistics.mean(repetition_ratio(r["tokens"]) or 0.0 for r in rs), 4),
                    "identical": round(statistics.mean(r["tokens"] == p["tokens"] for r, p in zip(rs, recs["plain"])), 3),
                    "prefix_share": round(statistics.mean(agreement(r["tokens"], p["tokens"])["prefix_share"]
                                                          for r, p in zip(rs, recs["plain"])), 3)}
    base = out["plain"]
    for lab, o in out.items():
        o["speedup_tok_s"] = round(o["tokens_per_s"] / base["tokens_per_s"], 3)
        o["speedup_per_token"] = round(base["per_token_ms"] / o["per_token_ms"], 3)
    print(f"{tag}: " + "; ".join(f"{k} {v['tokens_per_s']} tok/s x{v['speedup_tok_s']} agree {v['prefix_share']}"
                                 for k, v in out.items()), flush=True)
    return {"records": {k: [r["tokens"] for r in v] for k, v in recs.items()} if args.keep_tokens else None,
            "summary": out}


def gsm8k_phase(bb, students, args, eos) -> dict:
    from cadence.bench.tasks import gsm8k_items, score_gsm8k

    items = gsm8k_items()[: args.gsm8k]
    prompts = [bb.encode_prompt(it.prompt, chat=True) for it in items]
    ms = [(lab, d) for lab, ck, d in methods(students, args)
          if not lab.endswith("verify") and (not args.gsm8k_only or ck in args.gsm8k_only)]
    scores: dict[str, list[float]] = {"plain": [], **{lab: [] for lab, _ in ms}}
    for it, ids in zip(items, prompts):
        r = plain_generate(bb.model, ids, args.gsm8k_new, eos)
        scores["plain"].append(score_gsm8k(it, bb.tokenizer.decode(r["tokens"], skip_special_tokens=True)).value)
        for lab, d in ms:
            g = d.generate(ids, args.gsm8k_new, eos=eos)
            scores[lab].append(score_gsm8k(it, bb.tokenizer.decode(g.tokens, skip_special_tokens=True)).value)
    out = {k: {"correct": int(sum(v)), "n": len(v), "accuracy": round(sum(v) / max(len(v), 1), 4)} for k, v in scores.items()}
    print(f"gsm8k: {out}", flush=True)
    return out


def nll_phase(bb, students, args) -> dict:
    from cadence.pipo.data import load_pairs

    items = [(p, r[:args.nll_reply]) for p, r in load_pairs(args.data, "val", 192, limit=args.nll)]
    first = next(iter(students.values()))
    out = {"plain": reply_nll(first, items, "plain")}
    for lab, st in students.items():
        for mode in ("prompt", "pairs"):
            out[f"{lab}:{mode}"] = reply_nll(st, items, mode)
    out = {k: {"nll": round(v["nll"], 4), "tokens": v["tokens"]} for k, v in out.items()}
    print(f"nll: {out}", flush=True)
    return out


def tables(r: dict) -> str:
    """The run's numbers as markdown tables (decoding, time to first token, NLL, GSM8K)."""
    out = ["| Method | tok/s | x plain | per-token ms | x plain | tokens/forward | identical | prefix agreement | repetition |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, v in r["decode"]["summary"].items():
        out.append(f"| {k} | {v['tokens_per_s']:.1f} | {v['speedup_tok_s']:.2f} | {v['per_token_ms']:.1f} | "
                   f"{v['speedup_per_token']:.2f} | {v['tokens_per_forward']:.2f} | {v['identical']:.2f} | "
                   f"{v['prefix_share']:.3f} | {v['repetition']:.3f} |")
    if r.get("ttft"):
        labs = list(next(iter(r["ttft"].values()))["speedup"])
        out += ["", "| Prompt tokens | plain TTFT s | " + " | ".join(f"{lab} TTFT s | x plain | prefix agreement"
                                                                        for lab in labs) + " |",
                "|---:|---:|" + "---:|---:|---:|" * len(labs)]
        for v in r["ttft"].values():
            out.append(f"| {v['prompt_tokens']} | {v['ttft_s']['plain']:.3f} | " + " | ".join(
                f"{v['ttft_s'][lab]:.3f} | {v['speedup'][lab]:.2f} | {v['prefix_share'][lab]:.2f}" for lab in labs) + " |")
    if r.get("nll"):
        out += ["", "| Reader | NLL of teacher replies (nats/token) | tokens |", "|---|---:|---:|"]
        out += [f"| {k} | {v['nll']:.3f} | {v['tokens']} |" for k, v in r["nll"].items()]
    if r.get("gsm8k"):
        out += ["", "| GSM8K | correct | n | accuracy |", "|---|---:|---:|---:|"]
        out += [f"| {k} | {v['correct']} | {v['n']} | {v['accuracy']:.3f} |" for k, v in r["gsm8k"].items()]
    return "\n".join(out) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = result["decode"]["summary"]
    steps = result["steps"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (ykey, ylab) in zip(axes, (("prefix_share", "agreement with plain greedy (prefix share)"),
                                        ("nll", "NLL of teacher replies (nats/token)"))):
        series: dict[str, list] = {}
        for lab, o in summ.items():
            if lab == "plain":
                continue
            ck, mode = lab.split(":", 1)
            # verify reads the reply as plain positions: its NLL is the prompt mode's
            reader = "prompt" if mode.endswith("verify") else mode.split("@")[0]
            y = o[ykey] if ykey != "nll" else result["nll"].get(f"{ck}:{reader}", {}).get("nll")
            if y is None:
                continue
            series.setdefault(mode, []).append((o["speedup_tok_s"], y, steps.get(ck, ck)))
        for mode, pts in series.items():
            pts.sort(key=lambda p: (p[2] if isinstance(p[2], int) else 10 ** 9))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
            for x, y, s in pts:
                ax.annotate(str(s), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        base_y = 1.0 if ykey != "nll" else result["nll"]["plain"]["nll"]
        ax.scatter([1.0], [base_y], color="black", marker="*", s=80, label="plain", zorder=5)
        ax.set_xlabel("tokens/s relative to plain decoding")
        ax.set_ylabel(ylab)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("PIPO (lossy) on SmolLM2-135M: speed against quality; labels = training steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipo", nargs="+", required=True,
                    help="LABEL=DIR of PIPO directories (several budgets); LABEL=untrained: a new, untrained student")
    ap.add_argument("--model", default="smollm2", help="backbone")
    ap.add_argument("--data", default="data/selfdistill/smollm2", help="store (val split: prompts and NLL)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--ttft-lengths", type=int, nargs="*", default=[512, 1024, 2048, 4096], help="long prompt lengths")
    ap.add_argument("--ttft-repeats", type=int, default=3, help="timed repeats per length (median)")
    ap.add_argument("--ttft-new", type=int, default=16, help="tokens generated after each long prompt")
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts for per-token speed and agreement")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens per generation")
    ap.add_argument("--thresholds", type=float, nargs="*", default=[0.5], help="confidence thresholds (pairs mode)")
    ap.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True, help="also pairs + verify")
    ap.add_argument("--nll", type=int, default=48, help="held-out teacher replies for NLL")
    ap.add_argument("--nll-reply", type=int, default=128, help="reply tokens per NLL sequence")
    ap.add_argument("--gsm8k", type=int, default=20, help="GSM8K test questions (0 = skip)")
    ap.add_argument("--gsm8k-new", type=int, default=160, help="tokens per GSM8K answer")
    ap.add_argument("--gsm8k-only", nargs="*", default=[], help="PIPO labels scored on GSM8K (default: all)")
    ap.add_argument("--keep-tokens", action="store_true", help="store every generation's tokens in the JSON")
    ap.add_argument("--out", default=None, help="JSON path (default runs/pipo-bench.json)")
    ap.add_argument("--plot", default=None, help="PNG path for the speed/quality plot")
    ap.add_argument("--tables", default=None, help="markdown path for the run's tables")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from cadence.backbone.load import load_backbone
    from cadence.pipo.data import load_pairs

    bb = load_backbone(args.model, "float32", "cpu", "transformers", "none")
    eos = bb.eos_token_ids
    students, steps = {}, {}
    for spec in args.pipo:
        lab, _, d = spec.partition("=")
        if d == "untrained":  # zero adapter and corrections: the compressor keeps each pair's second token
            students[lab], steps[lab] = Student(bb, StudentConfig()).eval(), 0
            continue
        students[lab], meta = load_student(bb, d)
        steps[lab] = meta.get("training", {}).get("step")
    t0 = time.time()
    result = {"command": " ".join(sys.argv), "lossy": True, "threads": args.threads,
              "backend": "transformers, float32 weights, greedy", "steps": steps,
              "pipo": {lab: spec.partition("=")[2] for lab, spec in zip(students, args.pipo)}}
    prompts = [p for p, _ in load_pairs(args.data, "val", 192, limit=args.prompts)]
    result["decode"] = decode_phase(bb, students, prompts, args, eos, args.max_new_tokens, "decode")
    result["ttft"] = ttft_phase(bb, students, args, eos) if args.ttft_lengths else {}
    result["nll"] = nll_phase(bb, students, args) if args.nll else {}
    result["gsm8k"] = gsm8k_phase(bb, students, args, eos) if args.gsm8k else {}
    result["seconds"] = round(time.time() - t0, 1)
    out = common.write_json(common.out_path(args.out, "pipo-bench.json"), result)
    if args.plot:
        plot(result, Path(args.plot))
        print(f"wrote {args.plot}")
    if args.tables:
        Path(args.tables).write_text(tables(result))
        print(f"wrote {args.tables}")
    del out
    return 0


if __name__ == "__main__":
    sys.exit(main())
