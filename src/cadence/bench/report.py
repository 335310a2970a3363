"""Reports of a bench run: results.json, report.md, PNG plots, and ``--compare``.

Knows: aggregating records per task x method (through ``metrics``), the flags a reader
must see (a lossless method that changed the output), table layout, matplotlib (Agg).
Does not know: how records were measured.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
from pathlib import Path

import torch
import transformers

from cadence.bench import metrics as M
from cadence.errors import CadenceError
from cadence.system.atomic import atomic_write, atomic_write_json
from cadence.system.machine import machine_info

ALL = "all"  # the pseudo-task pooling every task


def machine() -> dict:
    try:
        return machine_info()
    except ImportError:  # pragma: no cover - cadence.system.machine ships with the package

        return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                "torch": torch.__version__, "transformers": transformers.__version__}


def _lossless_run(cfg: dict) -> bool:
    return float(cfg.get("temperature", 0)) <= 0 and str(cfg.get("rule", "auto")) in ("auto", "greedy")


def summarize_all(records: list[dict], labels: list[str], tasks: list[str], greedy: bool) -> dict:
    """{task: {method: metrics}} plus ``all`` pooling every task (when there are several)."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        by.setdefault((r["task"], r["method"]), []).append(r)
    groups = {t: {m: by.get((t, m), []) for m in labels} for t in tasks}
    if len(tasks) > 1:
        groups[ALL] = {m: [r for t in tasks for r in by.get((t, m), [])] for m in labels}
    out = {}
    for t, per_method in groups.items():
        base = per_method.get("vanilla") or None
        out[t] = {m: M.summarize(recs, base, compare_outputs=greedy)
                  for m, recs in per_method.items() if recs}
    return out


def flags_for(summary: dict, methods, cfg: dict) -> list[str]:
    flags = []
    if not _lossless_run(cfg):
        return flags
    lossless = {e.label for e in methods if e.lossless}
    for t, per in summary.items():
        if t == ALL:
            continue
        for m, s in per.items():
            if m in lossless and s["identical_rate"] is not None and s["identical_rate"] < 1.0:
                flags.append(f"{m} on {t}: identical-output rate {s['identical_rate']:.0%} < 100% "
                             "for a lossless method at T=0")
    return flags


def timing_notes(records: list[dict]) -> list[str]:
    """A note per generation that ran much slower per step than its method usually does."""
    return [f"timing: the steps of {g['method']} on {g['task']}:{g['key']} took {g['ratio']:.1f}x as long as "
            "that method's usually do (something else on the CPU?); recompute without that prompt: "
            f"python benchmarks/e2e/ratios.py OUT --drop {g['task']}:{g['key']}" for g in M.slow_generations(records)]


def write_all(out: Path, cfg: dict, records: list[dict], methods, labels: list[str], task_info: dict,
              notes: list[str], backbone_name: str, plots: bool = True) -> dict:
    out = Path(out)
    greedy = float(cfg.get("temperature", 0)) <= 0
    tasks = list(task_info)
    summary = summarize_all(records, labels, tasks, greedy)
    notes = list(notes)
    if "vanilla" not in labels:
        notes.append("no vanilla in this run: speedup and identical-output rate are not reported")
    if not greedy:
        notes.append("sampling run (T > 0): identical-output rate is defined against greedy decoding "
                     "and is not reported")
    notes += timing_notes(records)
    results = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": cfg.get("command"),
        "model": backbone_name,
        "machine": machine(),
        "config": cfg,
        "tasks": task_info,
        "methods": labels,
        "summary": summary,
        "flags": flags_for(summary, methods, cfg),
        "notes": notes,
        "records": len(records),
    }
    atomic_write_json(out / "results.json", results)
    images = draw_plots(out, summary, records, labels, tasks) if plots else []
    text = markdown(results, images)
    atomic_write(out / "report.md", lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return results


# ---------------------------------------------------------------- markdown

def _f(x, fmt="{:.2f}", none="–"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return fmt.format(x)


def _pct(x):
    return "–" if x is None else f"{100 * x:.0f}%"


def leaderboard(results: dict) -> str:
    """Speedup per task (columns) x method (rows), Spec-Bench style, plus overall tau and tok/s."""
    summary, labels = results["summary"], results["methods"]
    tasks = [t for t in summary if t != ALL]
    has_all = ALL in summary
    head = ["Method"] + tasks + (["Overall"] if has_all else []) + ["tau", "tok/s"]
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    pooled = summary[ALL] if has_all else (summary[tasks[0]] if tasks else {})
    for m in labels:
        cells = [m] + [_f(summary[t].get(m, {}).get("speedup"), "{:.2f}x") for t in tasks]
        if has_all:
            cells.append(_f(pooled.get(m, {}).get("speedup"), "{:.2f}x"))
        cells += [_f(pooled.get(m, {}).get("tau")), _f(pooled.get(m, {}).get("tokens_per_s"), "{:.1f}")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def task_table(per_method: dict, labels: list[str], score_name: str | None) -> str:
    head = ["Method", "tok/s", "speedup", "tau", "accept d1/d2/d3..", "identical", score_name or "score",
            "repetition", "tokens", "wall s"]
    rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for m in labels:
        s = per_method.get(m)
        if s is None:
            continue
        acc = "/".join(f"{a:.2f}" for a in s["acceptance_by_depth"]) or "–"
        rows.append("| " + " | ".join([
            m, _f(s["tokens_per_s"], "{:.1f}"), _f(s["speedup"], "{:.2f}x"), _f(s["tau"]), acc,
            _pct(s["identical_rate"]), _pct(s["score"]) if score_name else "–",
            _f(s["repetition"], "{:.3f}"), str(s["new_tokens"]), _f(s["wall_s"], "{:.1f}")]) + " |")
    return "\n".join(rows)


def markdown(results: dict, images: list[str]) -> str:
    cfg, mach = results["config"], results["machine"]
    lines = [f"# cadence bench: {results['model']}", ""]
    lines.append(f"- date: {results['date']}")
    if results.get("command"):
        lines.append(f"- command: `{results['command']}`")
    mline = ", ".join(f"{k} {mach[k]}" for k in ("cpu", "cores", "ram_gib", "gpu", "torch_threads", "torch",
                                                   "transformers", "commit") if mach.get(k) is not None)
    lines.append(f"- machine: {mline}")
    lines.append(f"- settings: max_new_tokens {cfg['max_new_tokens']}, temperature {cfg['temperature']}, "
                 f"top_p {cfg['top_p']}, top_k {cfg['top_k']}, rule {cfg['rule']}, repeats {cfg['repeats']}, "
                 f"heads {cfg['heads_dir'] or cfg['heads']}, subset seed {cfg['subset_seed']}, "
                 f"dtype {cfg.get('dtype', 'auto')}, quant {cfg.get('quant', 'none')}"
                 + (" (the GGUF file's blocks, 8-bit activations as llama.cpp; identical = same tokens as "
                    "plain decoding on that path)" if cfg.get("quant") == "gguf" else
                    f" (LOSSY: {cfg.get('quant')} weights; identical = same tokens as the quantized model's plain "
                    "decoding)" if cfg.get("quant", "none") not in ("none", "auto") else ""))
    lines.append("- speedup: tokens/s relative to `vanilla` (cadence's engine without drafts) on the same "
                 "prompts in this run, methods interleaved per prompt, warm-up excluded; tau: tokens per "
                 "step; identical: share of generations whose token ids equal vanilla's")
    lines += ["", "## Speedup", "", leaderboard(results), ""]
    if results["flags"]:
        lines += ["## Flags", ""] + [f"- **{f}**" for f in results["flags"]] + [""]
    for t, info in results["tasks"].items():
        lines += [f"## {t}", "", f"{info['prompts']} prompt(s) of {info['pool']}"
                  + (f"; {info['note']}" if info.get("note") else "") + ".", ""]
        lines += [task_table(results["summary"].get(t, {}), results["methods"], info.get("score")), ""]
    if ALL in results["summary"]:
        lines += ["## All tasks pooled", "", task_table(results["summary"][ALL], results["methods"], None), ""]
    if results["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in results["notes"]] + [""]
    if images:
        lines += ["## Plots", ""] + [f"![{Path(i).stem}]({i})" for i in images] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------- plots

def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def draw_plots(out: Path, summary: dict, records: list[dict], labels: list[str], tasks: list[str]) -> list[str]:
    """speedup.png, tau_hist.png and timeline-<task>.png; returns the file names written."""
    try:
        import matplotlib  # the bench extra: plots only
    except ImportError as exc:
        raise CadenceError("the bench plots need the package matplotlib (pip install 'cadence[bench]', "
                           "or pass --no-plots)") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend (above)

    written = []
    cols = [t for t in summary if summary[t]]
    # speedup per task and method
    fig, ax = plt.subplots(figsize=(min(14, max(6, 0.35 * len(cols) * len(labels) + 3)), 3.8))
    width = 0.8 / max(1, len(labels))
    for j, m in enumerate(labels):
        ys = [summary[t].get(m, {}).get("speedup") or 0.0 for t in cols]
        ax.bar([i + j * width for i in range(len(cols))], ys, width, label=m)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(cols))], cols)
    ax.set_ylabel("speedup vs vanilla")
    ax.set_title("Speedup per task")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)
    written.append("speedup.png")

    # tau histogram (share of steps by tokens committed), all tasks pooled
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    hists = {m: M.tau_histogram([r for r in records if r["method"] == m]) for m in labels}
    hists = {m: h for m, h in hists.items() if h}
    top = max((max(h) for h in hists.values()), default=1)
    width = 0.8 / max(1, len(hists))
    for j, (m, h) in enumerate(hists.items()):
        total = sum(h.values())
        ax.bar([k + j * width for k in range(1, top + 1)], [h.get(k, 0) / total for k in range(1, top + 1)],
               width, label=m)
    ax.set_xticks([k + width * (len(hists) - 1) / 2 for k in range(1, top + 1)], [str(k) for k in range(1, top + 1)])
    ax.set_xlabel("tokens committed per step")
    ax.set_ylabel("share of steps")
    ax.set_title("tau histogram (all tasks)")
    if hists:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out / "tau_hist.png", dpi=110)
    plt.close(fig)
    written.append("tau_hist.png")

    # per-step timeline of one generation per method (the first prompt of each task)
    for t in tasks:
        recs = [r for r in records if r["task"] == t and r.get("step_log") and r["repeat"] == 0]
        if not recs:
            continue
        key = min(recs, key=lambda r: r["time"])["key"]
        chosen = {r["method"]: r for r in recs if r["key"] == key}
        fig, axes = plt.subplots(3, 1, figsize=(9.5, 6.5), sharex=True)
        for m in labels:
            r = chosen.get(m)
            if r is None:
                continue
            log = r["step_log"]
            xs = range(1, len(log["accepted"]) + 1)
            axes[0].plot(xs, [a + 1 for a in log["accepted"]], lw=0.9, label=m, drawstyle="steps-mid")
            axes[1].plot(xs, log["entropy"], lw=0.9, label=m)
            axes[2].plot(xs, log["nodes"], lw=0.9, label=m, drawstyle="steps-mid")
        axes[0].set_ylabel("tokens / step")
        axes[1].set_ylabel("entropy (nats)")
        axes[2].set_ylabel("tree nodes")
        axes[2].set_xlabel("step")
        axes[0].set_title(f"{t}: {key}")
        axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        name = f"timeline-{_safe(t)}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


# ---------------------------------------------------------------- compare

def load_results(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise CadenceError(f"{path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CadenceError(f"{path} is not valid JSON: {exc}") from exc
    if "summary" not in data:
        raise CadenceError(f"{path} is not a cadence bench results.json")
    return data


def _delta(a, b, rel=True):
    if a is None or b is None:
        return "–"
    if rel:
        return f"{100 * (b - a) / a:+.1f}%" if a else "–"
    return f"{b - a:+.2f}"


def compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """Markdown table of B relative to A per task and method (tok/s, speedup, tau, score, identical)."""
    lines = [f"A = {name_a} ({a.get('date')}, {a.get('model')}), B = {name_b} ({b.get('date')}, {b.get('model')})", ""]
    if a.get("config", {}).get("max_new_tokens") != b.get("config", {}).get("max_new_tokens") or \
            a.get("config", {}).get("temperature") != b.get("config", {}).get("temperature"):
        lines += ["warning: the runs differ in max_new_tokens or temperature", ""]
    head = ["task", "method", "tok/s A", "tok/s B", "Δ tok/s", "speedup A", "speedup B", "tau A", "tau B",
            "score A", "score B", "identical A", "identical B"]
    lines += ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    tasks = list(dict.fromkeys(list(a["summary"]) + list(b["summary"])))
    for t in tasks:
        sa, sb = a["summary"].get(t, {}), b["summary"].get(t, {})
        for m in dict.fromkeys(list(sa) + list(sb)):
            x, y = sa.get(m, {}), sb.get(m, {})
            lines.append("| " + " | ".join([
                t, m, _f(x.get("tokens_per_s"), "{:.1f}"), _f(y.get("tokens_per_s"), "{:.1f}"),
                _delta(x.get("tokens_per_s"), y.get("tokens_per_s")),
                _f(x.get("speedup"), "{:.2f}x"), _f(y.get("speedup"), "{:.2f}x"),
                _f(x.get("tau")), _f(y.get("tau")), _pct(x.get("score")), _pct(y.get("score")),
                _pct(x.get("identical_rate")), _pct(y.get("identical_rate"))]) + " |")
    return "\n".join(lines)
