"""``cadence env`` and ``cadence cache``: what cadence chose on this machine, and what it keeps.

Knows: the CPU (model string, cores, the instruction sets that decide kernels and precision),
the library versions, the dtype ``--dtype auto`` takes here and why, the projection kernels
``auto`` picks for bf16 and fp32, the native build's state (built, being built by another
process, failed and why, off, not built), the cache paths and sizes, a CUDA device if any.
What users paste into a bug report; in the spirit of ``python -m torch.utils.collect_env``
and ``vllm collect-env``.
Does not know: any model: the dtype line is for models the fast decoder supports (Llama /
Qwen families); others run fp32 on CPU through transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata

import torch

from cadence.fast import native
from cadence.fast.gguf import AUTO, GGUF_FIRST
from cadence.system import cache as disk_cache
from cadence.system.machine import (
    cpu_flags, cpu_model, git_commit, has_amx, isa, isa_env, isa_limits, ISA_MARCH, isa_mismatch, native_bf16,
    onednn_available, ram_gib,
)

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def auto_dtype() -> tuple[str, str]:
    """(dtype, reason) that ``--dtype auto`` takes on this CPU for a fast-decoder model that is not
    a GGUF (``auto_quant`` says what a GGUF model gets)."""
    if os.environ.get("CADENCE_CPU_AUTO_DTYPE", "").lower() in ("float32", "fp32"):
        return "float32", "CADENCE_CPU_AUTO_DTYPE=float32 is set"
    if not native_bf16():
        return "float32", "no native bf16 math (AVX512-BF16 or AMX) usable here, so bf16 would not be lossless"
    if not onednn_available():
        return "float32", "this torch has no oneDNN, which the row-consistent bf16 forward needs"
    why = "native bf16 math and oneDNN: bf16 speculation is byte-identical to bf16 plain decoding"
    return "bfloat16", why + ("; a GGUF model the gguf kernel reads: float32 (quant auto)" if GGUF_FIRST else "")


def auto_kernels(native_state: str) -> dict:
    """The projection kernel ``auto`` picks per dtype, without building anything."""
    dense = "onednn" if onednn_available() else "aten"
    bf16 = dense
    if has_amx() and os.environ.get("CADENCE_AMX", "1") != "0":
        bf16 = "amx" if native_state == "built" else f"amx once the native build exists (else {dense})"
    return {"bfloat16": bf16, "float32": dense}


def forced_isa() -> dict:
    """``CADENCE_ISA``: the instruction set forced (``native`` when unset), what the native
    extension is compiled for, and what is wrong with the switch in this process (None: nothing)."""
    try:
        level = isa()
    except ValueError as exc:
        return {"isa": os.environ.get("CADENCE_ISA"), "march": None, "needs": {}, "problem": str(exc)}
    return {"isa": level, "march": ISA_MARCH[level], "needs": isa_env(level), "problem": isa_mismatch(),
            "extension": native.name() if native.enabled() else None}


def auto_quant(dtype: str) -> tuple[str, str]:
    """(quant, reason) that ``--quant auto`` takes for the default model (a Q4_1 GGUF) with
    ``--dtype auto``, without building anything; ``dtype``: what ``--dtype auto`` takes for a model
    that is not a GGUF (``auto_dtype``)."""
    if not native.enabled():
        return "none", "the native extension is off (CADENCE_NATIVE=0)"
    if dtype != "float32":
        if GGUF_FIRST:
            return "gguf", ("a GGUF model runs in float32 on its own blocks (--dtype auto takes float32 for it: plain "
                            f"decoding there measured 2.5-2.6x {dtype}'s); other models {dtype}, dense")
        return "none", f"{dtype} kernels (gguf products are fp32)"

    if not AUTO:
        return "none", "dense fp32 (the gguf kernel measured slower at 1 row; --quant gguf forces it)"
    return "gguf", ("fp32 on the GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks for a GGUF model (lossless relative to "
                    "the file), dense fp32 for other models")


def collect() -> dict:
    """Everything ``cadence env`` reports, as a dict (``--json`` prints it)."""
    flags = cpu_flags()
    build = native.build_state()
    dtype, why = auto_dtype()
    cuda = None
    if torch.cuda.is_available():
        cuda = {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
                "cuda": torch.version.cuda}
    sizes: dict[str, int] = {}
    for e in disk_cache.entries():
        sizes[e.kind] = sizes.get(e.kind, 0) + e.size
    return {
        "cadence": _version("cadence"), "commit": git_commit(), "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": {"model": cpu_model(), "cores": os.cpu_count(),
                "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "ram_gib": ram_gib(), "features": {f: f in flags for f in FLAGS}, "isa_limits": isa_limits()},
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "transformers": _version("transformers"), "cuda": cuda,
        "auto_dtype": {"dtype": dtype, "why": why},
        "auto_kernels": auto_kernels(build["state"]),
        "auto_quant": dict(zip(("quant", "why"), auto_quant(dtype))),
        "auto_kv_dtype": "float16 on GGUF blocks (--quant gguf, q8_0, q4_1, q4_0), else the model's dtype",
        "forced_isa": forced_isa(),
        "native": build,
        "cache": {"root": str(disk_cache.root()), "kernels_root": str(disk_cache.kernels_root()),
                  "bytes": sizes},
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("CADENCE_")},
    }


def format_report(info: dict) -> str:
    """``collect()`` as the lines ``cadence env`` prints."""
    cpu = info["cpu"]
    feats = " ".join(f"{f}{'+' if on else '-'}" for f, on in cpu["features"].items())
    nat = info["native"]
    detail = nat.get("by") or nat.get("reason") or nat.get("dir", "")
    sizes = info["cache"]["bytes"]
    lines = [
        f"cadence       {info['cadence']} (commit {info['commit'] or 'unknown'}), python {info['python']}",
        f"platform      {info['platform']}",
        f"cpu           {cpu['model']}",
        f"cores         {cpu['cores']} ({cpu['usable_cores']} usable), {cpu['ram_gib']} GiB RAM",
        f"features      {feats}",
        f"isa limits    torch {cpu['isa_limits']['torch']}, oneDNN {cpu['isa_limits']['onednn'] or 'default'}, "
        f"MKL {cpu['isa_limits']['mkl'] or 'default'}",
        f"torch         {info['torch']} ({info['torch_threads']} threads), transformers {info['transformers']}",
        f"cuda          {info['cuda']['name'] + ' x' + str(info['cuda']['count']) if info['cuda'] else 'none'}",
        f"dtype auto    {info['auto_dtype']['dtype']}: {info['auto_dtype']['why']}",
        f"kernels auto  bf16 {info['auto_kernels']['bfloat16']}; fp32 {info['auto_kernels']['float32']}",
        f"quant auto    {info['auto_quant']['quant']}: {info['auto_quant']['why']}",
        f"kv-dtype auto {info['auto_kv_dtype']}",
        f"CADENCE_ISA   {info['forced_isa']['isa']} (-march={info['forced_isa']['march']})"
        + (f": PROBLEM: {info['forced_isa']['problem']}" if info["forced_isa"]["problem"] else
           (": torch switches " + " ".join(f"{k}={v}" for k, v in info["forced_isa"]["needs"].items()) + " set"
            if info["forced_isa"]["needs"] else "")),
        f"native build  {nat['state']}" + (f" ({detail})" if detail else ""),
        f"cache         {info['cache']['root']}: models {disk_cache.human(sizes.get('models', 0))}, "
        f"latency curves {disk_cache.human(sizes.get('latency', 0))}, "
        f"datastores {disk_cache.human(sizes.get('datastore', 0))}",
        f"kernel cache  {info['cache']['kernels_root']}: {disk_cache.human(sizes.get('kernels', 0))}",
        "CADENCE_*     " + (" ".join(f"{k}={v}" for k, v in info["env"].items()) or "none set"),
    ]
    return "\n".join(lines)


def run_env(args: argparse.Namespace) -> int:
    if args.build:
        if not native.enabled():
            print("cadence: the native build is off (CADENCE_NATIVE=0); nothing to build", file=sys.stderr)
        elif native.module() is None:
            print(f"cadence: native build failed: {native.build_state().get('reason', '?')}", file=sys.stderr)
        else:
            print("cadence: native layer loop built", file=sys.stderr)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 1 if args.build and info["native"]["state"] not in ("built", "off") else 0


def run_cache(args: argparse.Namespace) -> int:
    kinds = disk_cache.KINDS if args.clear in (None, "all") else (args.clear,)
    if args.clear is not None:
        gone = disk_cache.clear(kinds)  # a kernel being built by a live process is kept
        freed = sum(e.size for e in gone)
        print(f"cadence: removed {len(gone)} cached entr{'y' if len(gone) == 1 else 'ies'} "
              f"({disk_cache.human(freed)}) of {', '.join(kinds)}")
        return 0
    found = disk_cache.entries()
    if args.json:
        print(json.dumps([e.as_dict() for e in found], indent=2))
        return 0
    print(f"cache root {disk_cache.root()}; kernels under {disk_cache.kernels_root()}")
    for e in found:
        print(f"{e.kind:8s} {disk_cache.human(e.size):>10s}  {e.path}" + (f"  [{e.note}]" if e.note else ""))
    print(f"total    {disk_cache.human(sum(e.size for e in found)):>10s}  in {len(found)} entries")
    return 0


def register(sub) -> None:
    p = sub.add_parser("env", help="what cadence chose on this machine (CPU, dtype, kernels, native build, caches)",
                       description="Print the machine, the choices --dtype auto and the kernels make here, the "
                                   "native build's state and the caches: paste it into a bug report.")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of lines")
    p.add_argument("--build", action="store_true",
                   help="build the native kernels now (what a first generate would do), then report; "
                        "exit status 1 if the build fails")
    p.set_defaults(func=run_env)
    c = sub.add_parser("cache", help="list or clear what cadence keeps on disk (converted models, kernels, "
                                     "latency curves, datastore tables)")
    c.add_argument("--clear", nargs="?", const="all", choices=(*disk_cache.KINDS, "all"), default=None,
                   help="remove cached entries: models, kernels, latency, datastore, or all (the default)")
    c.add_argument("--json", action="store_true", help="list as JSON")
    c.set_defaults(func=run_cache)
