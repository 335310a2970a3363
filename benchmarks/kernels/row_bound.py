"""The least a verify tree's extra rows can cost on this CPU: a roofline for T(n)/T(1).

One token (T(1)) streams the GGUF's 4-bit weights once; every further row of a tree forward does
the model's integer multiply-adds again on the same bytes (about 135 M for SmolLM2-135M: the 30
layers' projections and the LM head). So however the kernel is written, T(n) - T(1) is at least
(n - 1) x those multiply-adds at the fastest rate this CPU's 8-bit multiply instructions run.

This script measures that rate instead of assuming it: a small C file (inline assembly, built
with the system compiler) runs, on 1 and on all cores, back-to-back independent 8-bit
multiply-add instructions: AVX2 ``vpmaddubsw`` on ymm (32 multiply-adds each), AVX-512BW
``vpmaddubsw`` on zmm (64), AVX512-VNNI ``vpdpbusd`` on zmm (64); and a chain of dependent integer
multiplies (three cycles each) for the clock the cores run at meanwhile. Alone, the multiply
instruction gives the loosest bound. The tighter one times the instruction mix of one Q4_1 block
product without VNNI (``q4_block``: the multiplies, the int16 sums, widening, convert, scale, two
fused multiply-adds), which every block of 32 weights needs because each has its own scale and
minimum. Neither counts loads, nibble unpacking, attention, norms or activation quantization, so
both are below anything a real kernel reaches.

For each path of ``every_cpu.py`` (the instruction it may use) and T(1) from its verify curve
(``verify_cost.py``'s JSON; by default the AMX Xeon's 2026-12-07 runs), it prints the least
T(n)/T(1) = 1 + (n - 1) x MACs / (rate x T(1)) next to the measured one, and what T(n)/T(1) <= 1.3
would need: (n - 1) x MACs / (0.3 x T(1)).

Usage:  python benchmarks/kernels/row_bound.py [--model smollm2] [--rows 8] [--curves native=F avx512=F avx2=F]
            [--seconds 0.5] [--out FILE]
Knows: x86-64 Linux with a C compiler (``cc``). Does not know: other architectures (it refuses).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402

RESULTS = common.ROOT / "docs" / "results" / "xeon-amx" / "2026-12-07-every-cpu"
CURVES = {p: RESULTS / f"curve-{p}.json" for p in ("native", "avx512", "avx2")}
# path -> (its 8-bit multiply instruction's kernel, the block-product kernel or None, the instruction, CPU flags)
PATHS = {"native": ("vnni_zmm", None, "AVX512-VNNI vpdpbusd zmm", ("avx512_vnni",)),
         "avx512": ("maddubs_zmm", "q4_block_zmm", "AVX-512BW vpmaddubsw zmm", ("avx512bw",)),
         "avx2": ("maddubs_ymm", "q4_block_ymm", "AVX2 vpmaddubsw ymm", ("avx2",))}
KERNELS = ["clock", "maddubs_ymm", "maddubs_zmm", "vnni_zmm", "q4_block_ymm", "q4_block_zmm"]
# multiply-adds one loop iteration does: 12 instructions of 32 (ymm) / 64 (zmm); a block kernel: 3 blocks of
# 8 vpmaddubsw each
MACS_PER_ITER = {"maddubs_ymm": 12 * 32, "maddubs_zmm": 12 * 64, "vnni_zmm": 12 * 64,
                 "q4_block_ymm": 3 * 8 * 32, "q4_block_zmm": 3 * 8 * 64}
CLOCK_CYCLES = 36  # cycles of one clock iteration: 12 dependent imuls of latency 3


def _asm(lines: list[str]) -> str:
    return "".join(f'"{ln}\\n\\t"\n    ' for ln in lines)


def q4_block(r: str, acc: int) -> list[str]:
    """One row x one Q4_1 block (32 weights) x one vector of columns, as ``gemm_qi.cpp`` computes it
    without VNNI, loads left out: 8 ``vpmaddubsw`` (4 chunks x low / high nibbles), 7 ``vpaddw`` (int16
    sums), ``vpmaddwd`` by ones (to int32), convert, d_w x d_x, and the two fused multiply-adds of
    ``acc = fma(isum, d_w d_x, acc); acc = fma(m, s, acc)``."""
    x = lambda i: f"%%{r}{i}"  # noqa: E731
    out = [f"vpmaddubsw {x(0)}, {x(1)}, {x(t)}" for t in range(2, 10)]
    out += [f"vpaddw {x(a)}, {x(b)}, {x(b)}" for a, b in ((3, 2), (5, 4), (7, 6), (9, 8), (4, 2), (8, 6), (6, 2))]
    out += [f"vpmaddwd {x(10)}, {x(2)}, {x(2)}", f"vcvtdq2ps {x(2)}, {x(2)}", f"vmulps {x(11)}, {x(12)}, {x(3)}",
            f"vfmadd231ps {x(3)}, {x(2)}, {x(acc)}", f"vfmadd231ps {x(11)}, {x(12)}, {x(acc)}"]
    return out


def _kernel(name: str, r: str, body: list[str]) -> str:
    zero = "vpxord" if r == "zmm" else "vpxor"
    init = [f"{zero} %%{r}{i}, %%{r}{i}, %%{r}{i}" for i in range(16)]
    return (f"static void k_{name}(long n) {{\n  __asm__ volatile(\n    " + _asm(init) + '"1:\\n\\t"\n    '
            + _asm(body) + '"dec %0\\n\\tjnz 1b\\n\\tvzeroupper"\n    : "+r"(n) :: ' + _ACC + ', "cc");\n}\n')


_ACC = ", ".join(f'"xmm{i}"' for i in range(16))  # clobbers (xmm names: any compiler flags accept them)
_INDEP = lambda op, r: [f"{op} %%{r}0, %%{r}1, %%{r}{t}" for t in range(2, 14)]  # noqa: E731  12 independent
C_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#define R12(x) x x x x x x x x x x x x
static void k_clock(long n) {  /* 12 dependent imuls (3 cycles each on every x86-64 core since Sandy
  Bridge / Zen: recent Intel cores fold add-immediate chains at rename, so adds cannot be the clock) */
  uint64_t a = 1;
  __asm__ volatile("1:\n\t" R12("imul $3, %1, %1\n\t") "dec %0\n\tjnz 1b" : "+r"(n), "+r"(a) :: "cc");
}
""" + _kernel("maddubs_ymm", "ymm", _INDEP("vpmaddubsw", "ymm")) \
    + _kernel("maddubs_zmm", "zmm", _INDEP("vpmaddubsw", "zmm")) \
    + _kernel("vnni_zmm", "zmm", _INDEP("vpdpbusd", "zmm")) \
    + _kernel("q4_block_ymm", "ymm", q4_block("ymm", 13) + q4_block("ymm", 14) + q4_block("ymm", 15)) \
    + _kernel("q4_block_zmm", "zmm", q4_block("zmm", 13) + q4_block("zmm", 14) + q4_block("zmm", 15)) + r"""
typedef void (*kern)(long);
static kern KS[] = {k_clock, k_maddubs_ymm, k_maddubs_zmm, k_vnni_zmm, k_q4_block_ymm, k_q4_block_zmm};
typedef struct { int kind; long n; } job;
static void* work(void* p) {
  job* j = (job*)p;
  KS[j->kind](j->n);
  return 0;
}
/* wall seconds for `threads` threads each running `n` iterations of kernel `kind` */
double run(int kind, long n, int threads) {
  pthread_t t[64];
  job j = {kind, n};
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (int i = 0; i < threads; ++i) pthread_create(&t[i], 0, work, &j);
  for (int i = 0; i < threads; ++i) pthread_join(t[i], 0);
  clock_gettime(CLOCK_MONOTONIC, &b);
  return (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
}
"""


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build(workdir: Path) -> ctypes.CDLL:
    """Compile the C file above into a shared library and load it."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("row_bound.py needs a C compiler (cc)")
    src, lib = workdir / "row_bound.c", workdir / "row_bound.so"
    src.write_text(C_SOURCE)
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-pthread", str(src), "-o", str(lib)], check=True)
    so = ctypes.CDLL(str(lib))
    so.run.restype = ctypes.c_double
    so.run.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int]
    return so


def timed(so, kind: str, threads: int, seconds: float) -> tuple[float, int]:
    """(wall seconds, iterations per thread) of a run lasting about ``seconds``; best of 3."""
    n = 1 << 16
    while so.run(KERNELS.index(kind), n, threads) < 0.05:
        n *= 4
    n = max(1, int(n * seconds / max(so.run(KERNELS.index(kind), n, threads), 1e-6)))
    return min(so.run(KERNELS.index(kind), n, threads) for _ in range(3)), n


def rates(so, kinds: list[str], threads: int, seconds: float) -> dict:
    """The clock (GHz, from the dependent imuls) and, per kernel, GMAC/s on ``threads`` cores and
    multiply-adds per cycle and core."""
    s, n = timed(so, "clock", threads, seconds)
    ghz = CLOCK_CYCLES * n / s / 1e9
    out = {"threads": threads, "clock_ghz": round(ghz, 3), "kernels": {}}
    for k in kinds:
        s, n = timed(so, k, threads, seconds)
        gmacs = threads * n * MACS_PER_ITER[k] / s / 1e9
        out["kernels"][k] = {"gmac_s": round(gmacs, 1), "macs_per_cycle_core": round(gmacs / threads / ghz, 1)}
    return out


def row_macs(model: str) -> dict:
    """Multiply-adds of one row of a forward: every layer's projections and the LM head (the
    attention's own products over the context are left out: that keeps the bound low)."""
    bb = common.backbone(model, dtype="float32")
    c = bb.config
    d, layers = c.hidden_size, c.num_hidden_layers
    hd = getattr(c, "head_dim", None) or d // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * c.intermediate_size
    return {"layers": layers, "per_layer": per_layer, "lm_head": d * c.vocab_size,
            "total": layers * per_layer + d * c.vocab_size}


def curve_t(path: Path) -> dict:
    """{n: ms} of the fast path's verify curve in ``verify_cost.py``'s JSON."""
    data = json.loads(Path(path).read_text())
    fast = data["by_dtype"]["float32"]["curve"]["fast"]["ms"]
    return {int(n): float(v) for n, v in fast.items()}


def bound_rows(macs: int, rows: int, rate: dict, curves: dict) -> list[dict]:
    """Per path: the least T(rows)/T(1) at the measured all-core rate of its multiply instruction
    alone (``least_ratio``) and of the Q4_1 block product's instruction mix (``least_ratio_block``),
    the measured ratio, and the rate T(rows)/T(1) <= 1.3 would need. Worked example: 135 M MACs a
    row, 8 rows, T(1) 7.0 ms, 300 GMAC/s -> extra >= 7 x 135e6 / 300e9 s = 3.15 ms, least ratio
    1 + 3.15 / 7.0 = 1.45; 1.3 would need 7 x 135e6 / (0.3 x 7.0 ms) = 450 GMAC/s."""
    out = []
    for path, file in curves.items():
        insn_kind, block_kind, insn, _ = PATHS[path]
        if insn_kind not in rate["kernels"]:
            continue
        t = curve_t(file)
        t1, tn = t[1], t.get(rows)
        row = {"path": path, "instruction": insn, "t1_ms": t1, "measured_ratio": round(tn / t1, 2) if tn else None,
               "needed_gmac_s_for_1.3": round((rows - 1) * macs / (0.3 * t1 * 1e-3) / 1e9, 1)}
        for key, kind in (("", insn_kind), ("_block", block_kind)):
            if kind in rate["kernels"]:
                gmacs = rate["kernels"][kind]["gmac_s"]
                extra_ms = (rows - 1) * macs / (gmacs * 1e9) * 1e3
                row.update({f"gmac_s{key}": gmacs, f"least_extra_ms{key}": round(extra_ms, 2),
                            f"least_ratio{key}": round(1 + extra_ms / t1, 2)})
        out.append(row)
    return out


def table(rows_out: list[dict], rows: int) -> str:
    lines = [f"| path | instruction | GMAC/s: instruction alone / Q4_1 block mix (all cores) | T(1) ms "
             f"| least T({rows})/T(1): instruction / block mix | measured | GMAC/s that 1.3 needs |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows_out:
        g = lambda k: r.get(k, "–")  # noqa: E731
        lines.append(f"| {r['path']} | {r['instruction']} | {g('gmac_s')} / {g('gmac_s_block')} | {r['t1_ms']} "
                     f"| {g('least_ratio')} / {g('least_ratio_block')} | {r['measured_ratio']} "
                     f"| {r['needed_gmac_s_for_1.3']} |")
    return "\n".join(lines)


def parse_curves(items: list[str]) -> dict:
    curves = {}
    for it in items:
        path, sep, file = it.partition("=")
        if not sep or path not in PATHS:
            raise SystemExit(f"--curves takes PATH=FILE with PATH one of {sorted(PATHS)}, got {it!r}")
        if not Path(file).is_file():
            raise SystemExit(f"--curves: no file {file}")
        curves[path] = Path(file)
    return curves


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, default=8, help="tree rows n of T(n)/T(1)")
    ap.add_argument("--curves", nargs="*", default=[f"{p}={f}" for p, f in CURVES.items()],
                    help="PATH=verify_cost.py JSON, PATH one of native, avx512, avx2")
    ap.add_argument("--seconds", type=float, default=0.5, help="length of each timed run")
    ap.add_argument("--out", default="", help="write the result as JSON here")
    args = ap.parse_args(argv)
    if platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit(f"row_bound.py times x86-64 instructions; this machine is {platform.machine()}")
    if args.rows < 2:
        raise SystemExit("--rows must be at least 2")
    curves = parse_curves(args.curves)
    flags = cpu_flags()
    kinds = [k for insn, block, _, need in PATHS.values() if all(f in flags for f in need)
             for k in (insn, block) if k]  # what this CPU runs
    with tempfile.TemporaryDirectory() as tmp:
        so = build(Path(tmp))
        one = rates(so, kinds, 1, args.seconds)
        cores = common.machine().get("cores") or 1
        allc = rates(so, kinds, int(cores), args.seconds)
    macs = row_macs(args.model)
    rows_out = bound_rows(macs["total"], args.rows, allc, curves)
    result = {"machine": common.machine(), "model": args.model, "row_macs": macs, "rows": args.rows,
              "one_core": one, "all_cores": allc, "bound": rows_out,
              "curves": {p: str(f) for p, f in curves.items()}}
    print(common.machine_line(result["machine"]))
    print(f"\none row: {macs['total'] / 1e6:.1f} M multiply-adds ({macs['layers']} layers x "
          f"{macs['per_layer'] / 1e6:.2f} M + LM head {macs['lm_head'] / 1e6:.1f} M)")
    for r in (one, allc):
        ks = ", ".join(f"{k} {v['gmac_s']} GMAC/s ({v['macs_per_cycle_core']} a cycle and core)" for k, v in r["kernels"].items())
        print(f"{r['threads']} core(s) at {r['clock_ghz']} GHz: {ks}")
    print()
    print(table(rows_out, args.rows))
    if args.out:
        common.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
