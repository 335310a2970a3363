"""Every CPU in one command: the default path (a GGUF model on its own blocks) against llama.cpp on
this CPU's own instruction set and on the ones forced below it, with the verify curve of each.

Per path (``native``, ``avx512``: AVX-512 F/CD/BW/DQ/VL without BF16, VNNI or AMX, ``avx2``: AVX2 +
FMA + F16C; ``cadence.system.machine``'s ``CADENCE_ISA``), one ``cadence bench`` run of plain
decoding, the shipped heads and llama.cpp on held-out prompts, interleaved per prompt, and
``benchmarks/kernels/verify_cost.py``'s T(n) for binary trees, each in its own process with the
variables that force the path set from its start. llama.cpp must be built for the same level
(``python benchmarks/peers/build_llama_cpp.py --isa avx2 --target runs/llama-avx2``); a forced path
reads the build in ``--llama-root``/llama-<path> and runs without the peer (said so) when there is
none. A path this CPU cannot run is reported, not run.

The table is what the every-CPU goals are judged on: cadence's best lossless method and its plain
decoding against llama.cpp's plain decoding of the same GGUF, outputs identical to plain decoding
on the same path, and T(8)/T(1).

Usage:  python benchmarks/e2e/every_cpu.py [--paths native avx512 avx2] [--limit 28] [--out runs/every-cpu]
        python benchmarks/e2e/every_cpu.py --summarize runs/every-cpu   (the table of finished runs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.system.machine import ISAS, isa_env  # noqa: E402

PATHS = ("native", "avx512", "avx2")
METHODS = ("vanilla", "hydra", "eagle@eagle-taps", "mtp", "llama.cpp")
PEER = "llama.cpp"


def path_env(path: str, llama_root: Path) -> tuple[dict, str]:
    """(the environment a process on ``path`` starts with, a note about its llama.cpp peer)."""
    env = dict(os.environ)
    for var in ("CADENCE_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(var, None)  # each path starts from this CPU's own set
    if path == "native":
        return env, "llama.cpp as installed"
    env["CADENCE_ISA"] = path
    env.update(isa_env(path))
    if path == "avx2":
        env["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"
    build = llama_root / f"llama-{path}"
    if not build.is_dir():
        return env, f"no llama.cpp built for {path} in {build}: the peer is left out"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(build.resolve()), env.get("PYTHONPATH", "")) if p)
    return env, f"llama.cpp from {build}"


def run_path(path: str, args, out: Path) -> dict:
    """Bench and verify curve on one path; what ran and where its results are."""
    env, note = path_env(path, Path(args.llama_root))
    methods = [m for m in args.methods if m != PEER or "left out" not in note]
    exe = Path(sys.executable).with_name("cadence")  # this environment's command, else the one on PATH
    bench = [str(exe) if exe.is_file() else "cadence", "bench", "--tasks", "custom", "--custom", args.prompts, "--methods", *methods,
             "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--out", str(out / path)]
    curve = [sys.executable, str(common.BENCH / "kernels" / "verify_cost.py"), "--dtypes", "float32", "--quant", "gguf",
             "--skip-generate", "--sizes", "1", "4", "8", "16", "--out", str(out / f"{path}-curve.json")]
    done = {"path": path, "peer": note, "bench": bench, "curve": curve}
    for name, cmd in (("bench", bench), ("curve", curve)):
        print(f"[{path}] {' '.join(cmd)}", file=sys.stderr, flush=True)
        rc = subprocess.run(cmd, env=env).returncode
        if rc != 0:
            done["error"] = f"{name} exited {rc} (a CPU without this instruction set, or a failed build)"
            break
    return done


def summarize(out: Path, paths: list[str]) -> list[dict]:
    """One row per path with a finished bench under ``out``: the every-CPU table's numbers."""
    rows = []
    for path in paths:
        res = out / path / "results.json"
        if not res.is_file():
            continue
        summary = json.loads(res.read_text())["summary"]["custom"]
        plain = summary["vanilla"]["tokens_per_s"]
        ours = {m: s for m, s in summary.items() if m not in ("vanilla", PEER)}
        best = max(ours, key=lambda m: ours[m]["tokens_per_s"]) if ours else "vanilla"
        best_tps = ours[best]["tokens_per_s"] if ours else plain
        peer = summary.get(PEER, {}).get("tokens_per_s")
        row = {"path": path, "plain_tps": plain, "best": best, "best_tps": best_tps, "llama_tps": peer,
               "plain_vs_llama": plain / peer if peer else None, "best_vs_llama": best_tps / peer if peer else None,
               "identical": min((s.get("identical_rate") or 0.0) for s in ours.values()) if ours else None,
               "t8_t1": None}
        curve = out / f"{path}-curve.json"
        if curve.is_file():
            rel = json.loads(curve.read_text())["by_dtype"]["float32"]["curve"]["fast"]["relative"]
            row["t8_t1"] = rel.get("8")
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    lines = ["| path | plain tok/s | best lossless | tok/s | llama.cpp tok/s | plain / llama.cpp | best / llama.cpp "
             "| identical | T(8)/T(1) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['path']} | {r['plain_tps']:.1f} | {r['best']} | {r['best_tps']:.1f} | {f(r['llama_tps'], '.1f')} "
                     f"| {f(r['plain_vs_llama'], '.2f')}x | {f(r['best_vs_llama'], '.2f')}x "
                     f"| {f(None if r['identical'] is None else 100 * r['identical'], '.0f')}% | {f(r['t8_t1'], '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(ISAS))
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--prompts", default=str(common.PROMPTS / "categories.jsonl"))
    ap.add_argument("--limit", type=int, default=28)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--llama-root", default=str(common.RUNS), help="where the forced paths' llama.cpp builds are")
    ap.add_argument("--out", default=str(common.RUNS / "every-cpu"))
    ap.add_argument("--summarize", metavar="DIR", help="only print the table of the runs already in DIR")
    args = ap.parse_args(argv)
    out = Path(args.summarize or args.out)
    if not args.summarize:
        out.mkdir(parents=True, exist_ok=True)
        runs = [run_path(p, args, out) for p in args.paths]
        (out / "every-cpu.json").write_text(json.dumps({"machine": common.machine(), "runs": runs}, indent=1))
        for r in runs:
            print(f"{r['path']}: {r['peer']}" + (f"; {r['error']}" if "error" in r else ""))
    rows = summarize(out, args.paths)
    if not rows:
        print(f"no finished bench under {out}", file=sys.stderr)
        return 1
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
