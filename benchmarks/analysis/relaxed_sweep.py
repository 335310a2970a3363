"""Relaxed verification sweep: speedup gained against task score lost, for a sweep of DELTA.

On the default model with its shipped hydra heads (calibrated tree, context copy, greedy),
decodes HumanEval and GSM8K prompts with plain decoding (vanilla) and with
``--rule relaxed --drift DELTA --top-m M`` for each DELTA, methods interleaved per prompt
(the order rotates from prompt to prompt), one untimed warm-up generation per method.
Reports, per DELTA: speedup over vanilla (pooled tokens/s, Spec-Bench convention, via
``cadence.bench.metrics``), tau, HumanEval pass@1, GSM8K accuracy, the identical-output
rate against vanilla greedy and the mean share of each reply that matches vanilla before
the first differing token. ``DELTA = 0`` is greedy verification, so its output must be
identical to vanilla (checked and reported).

    python benchmarks/analysis/relaxed_sweep.py                     # 8 prompts per task, 192 new tokens
    python benchmarks/analysis/relaxed_sweep.py --deltas 0 1 2 --limit 4 --max-new-tokens 128

Writes runs/relaxed-sweep-<cpu>.json and .png (or --out) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.bench import metrics as M
from cadence.bench.tasks import load_task, seeded_subset
from cadence.decode.generation import GenerationConfig
from cadence.system.machine import cpu_model
from cadence.methods import MethodSpec, make_engine
from cadence.verify.rules import Rule

TASKS = ("humaneval", "gsm8k")


def cpu_slug(cpu: str) -> str:
    low = cpu.lower()
    for key, slug in (("epyc", "amd-epyc"), ("xeon", "intel-xeon"), ("ryzen", "amd-ryzen"),
                      ("apple", "apple")):
        if key in low:
            return slug
    return re.sub(r"[^a-z0-9]+", "-", re.sub(r"\(.*?\)", "", low)).strip("-")[:32] or "cpu"


def label(delta: float | None) -> str:
    return "vanilla" if delta is None else f"relaxed d={delta:g}"


def agreement(tokens: list[int], ref: list[int]) -> float:
    """Share of the longer reply covered by the common prefix with the reference."""
    n = 0
    for a, b in zip(tokens, ref):
        if a != b:
            break
        n += 1
    return n / max(len(tokens), len(ref), 1)


def run(args) -> dict:
    torch.manual_seed(0)
    bb = common.backbone(args.model)
    vanilla = make_engine(bb, MethodSpec.parse("vanilla"))
    hydra = make_engine(bb, MethodSpec.parse("hydra"))
    eos = set(bb.eos_token_ids)
    methods: list[float | None] = [None] + list(args.deltas)

    def cfg_for(delta, n):
        if delta is None:
            return GenerationConfig(max_new_tokens=n)
        return GenerationConfig(max_new_tokens=n, rule=Rule.RELAXED, drift=float(delta), top_m=args.top_m)

    prompts = []
    tasks = {}
    for name in TASKS:
        task = load_task(name)
        tasks[name] = task
        for item in seeded_subset(task.items, args.limit, args.subset_seed):
            prompts.append((name, item, bb.encode_prompt(item.prompt, chat=True)))

    # warm-up (untimed): one short generation per method on the first prompt
    for delta in methods:
        (vanilla if delta is None else hydra).generate(prompts[0][2], cfg_for(delta, 16))

    records: dict[str, list[dict]] = {label(d): [] for d in methods}
    t0 = time.perf_counter()
    for i, (name, item, ids) in enumerate(prompts):
        order = methods[i % len(methods):] + methods[:i % len(methods)]
        for delta in order:
            g = (vanilla if delta is None else hydra).generate(ids, cfg_for(delta, args.max_new_tokens))
            toks = list(g.tokens)
            while toks and toks[-1] in eos:
                toks.pop()
            score = tasks[name].score(item, g.text).value
            records[label(delta)].append({
                "task": name, "key": item.key, "repeat": 0, "method": label(delta), "tokens": toks,
                "new_tokens": g.stats.new_tokens, "steps": g.stats.steps, "wall_s": g.stats.wall_s,
                "score": score, "tau": g.stats.tau})
        print(f"[{i + 1}/{len(prompts)}] {name} {item.key}  {time.perf_counter() - t0:.0f}s",
              file=sys.stderr, flush=True)

    base = records["vanilla"]
    ref = {(r["task"], r["key"]): r["tokens"] for r in base}
    rows = []
    for delta in methods:
        recs = records[label(delta)]
        row = {"method": label(delta), "delta": delta, "top_m": None if delta is None else args.top_m,
               "lossless": delta == 0 if delta is not None else True,
               "tokens_per_s": M.tokens_per_s(recs), "speedup": M.speedup(recs, base), "tau": M.tau(recs),
               "identical_rate": M.identical_rate(recs, base),
               "agreement": M.mean(agreement(r["tokens"], ref[(r["task"], r["key"])]) for r in recs)}
        for name in TASKS:
            sub = [r for r in recs if r["task"] == name]
            bsub = [r for r in base if r["task"] == name]
            row[f"{name}_speedup"] = M.speedup(sub, bsub)
            row[f"{name}_score"] = M.task_score(sub)
            row[f"{name}_identical"] = M.identical_rate(sub, bsub)
        rows.append(row)
    info = common.machine()
    return {"machine": info, "machine_line": common.machine_line(info), "model": args.model,
            "heads": "shipped hydra (calibrated tree, context copy)", "top_m": args.top_m,
            "deltas": list(args.deltas), "limit_per_task": args.limit, "max_new_tokens": args.max_new_tokens,
            "subset_seed": args.subset_seed, "tasks": list(TASKS), "wall_s": round(time.perf_counter() - t0, 1),
            "rows": rows, "records": records,
            "note": "relaxed is LOSSY for DELTA > 0; DELTA = 0 is greedy verification (must be identical)"}


def fmt(v, pct=False, x=False, d=2):
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.0f}%"
    return f"{v:.{d}f}x" if x else f"{v:.{d}f}"


def table(res: dict) -> str:
    lines = [(f"Relaxed verification sweep, {res['model']}, {res['heads']}, top-M {res['top_m']}, greedy, "
              f"{res['limit_per_task']} prompts per task, {res['max_new_tokens']} new tokens."),
             f"Machine: {res['machine_line']}", "",
             ("| Method | DELTA | speedup | HumanEval speedup | GSM8K speedup | tau | tok/s | HumanEval pass@1 | "
              "GSM8K acc | identical to vanilla | prefix agreement |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(
            f"| {r['method']}{'' if r['lossless'] else ' (lossy)'} | {'-' if r['delta'] is None else r['delta']} | "
            f"{fmt(r['speedup'], x=True)} | {fmt(r['humaneval_speedup'], x=True)} | {fmt(r['gsm8k_speedup'], x=True)} | "
            f"{fmt(r['tau'])} | {fmt(r['tokens_per_s'], d=1)} | {fmt(r['humaneval_score'], pct=True)} | "
            f"{fmt(r['gsm8k_score'], pct=True)} | {fmt(r['identical_rate'], pct=True)} | {fmt(r['agreement'], pct=True)} |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if r["delta"] is not None]
    van = res["rows"][0]
    d = [r["delta"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.plot(d, [r["speedup"] for r in rows], "o-", color="C0", label="speedup over vanilla")
    a.set_xlabel("DELTA (nats, cumulative log-prob gap budget)")
    a.set_ylabel("speedup (x)", color="C0")
    a.axhline(1.0, color="C0", ls=":", lw=0.8)
    a2 = a.twinx()
    for name, c, lab in (("humaneval", "C1", "HumanEval pass@1"), ("gsm8k", "C2", "GSM8K accuracy")):
        a2.plot(d, [r[f"{name}_score"] for r in rows], "s-", color=c, label=lab)
        a2.axhline(van[f"{name}_score"], color=c, ls="--", lw=0.8)
    a2.plot(d, [r["identical_rate"] for r in rows], "^-", color="C3", label="identical to vanilla")
    a2.set_ylim(-0.05, 1.05)
    a2.set_ylabel("score / rate (dashed: vanilla)")
    h1, l1 = a.get_legend_handles_labels()
    h2, l2 = a2.get_legend_handles_labels()
    a.legend(h1 + h2, l1 + l2, fontsize=8, loc="center right")
    a.set_title(f"relaxed verification, top-M {res['top_m']}: sweep of DELTA")
    for name, c, lab in (("humaneval", "C1", "HumanEval"), ("gsm8k", "C2", "GSM8K")):
        xs = [r[f"{name}_speedup"] for r in rows]
        ys = [r[f"{name}_score"] - van[f"{name}_score"] for r in rows]
        b.plot(xs, ys, "o-", color=c, label=lab)
        for x, y, r in zip(xs, ys, rows):
            b.annotate(f"{r['delta']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    b.axhline(0, color="k", lw=0.6)
    b.set_xlabel("speedup over vanilla (x)")
    b.set_ylabel("task score - vanilla's")
    b.set_title("speedup gained vs score lost (labels: DELTA)")
    b.legend(fontsize=8)
    fig.suptitle(res["machine_line"][:140], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--deltas", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0, 4.0])
    p.add_argument("--top-m", type=int, default=3)
    p.add_argument("--limit", type=int, default=8, help="prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--subset-seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output stem (default runs/relaxed-sweep-<cpu>)")
    args = p.parse_args(argv)
    res = run(args)
    stem = common.out_path(args.out, f"relaxed-sweep-{cpu_slug(cpu_model())}")
    common.write_json(stem.with_suffix(".json"), res, quiet=True)
    plot(res, stem.with_suffix(".png"))
    print(table(res))
    zero = next((r for r in res["rows"] if r["delta"] == 0), None)
    if zero is not None and zero["identical_rate"] != 1.0:
        print("\nWARNING: DELTA = 0 output differs from vanilla greedy (it must not)", file=sys.stderr)
    print(f"\nwrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')} ({res['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
