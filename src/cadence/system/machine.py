"""The machine cadence runs on: its identity for reports and caches, and what its CPU can do.

Knows: the CPU model, cores, RAM, accelerator and library versions a measurement ran on
(``machine_info``, ``machine_line``), the key a per-machine measurement is cached under
(``machine_key``), and the instruction-set flags read at run time from ``/proc/cpuinfo``
that decide kernels and precision (AVX2, AVX-512, AVX512-BF16, AMX), and whether oneDNN
(mkldnn) is built into this torch.
Does not know: how fast anything is; the choices made from these flags are measured in
``benchmarks/kernels/verify_cost.py``. Nothing here is hard-coded per machine.


The CPU's flags say what the hardware has; what the kernels may use can be narrowed with
the libraries' own switches, ``ATEN_CPU_CAPABILITY=avx2`` (torch's vectorised kernels),
``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's GEMMs) and ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's). With both set, an AVX-512 machine runs the
instruction set of an AVX2-only one (not its caches, clocks or memory), and every choice
made here follows: e.g. ``native_bf16()`` is False, so ``--dtype auto`` is fp32.

``CADENCE_ISA=avx2|avx512`` narrows cadence's own view the same way: ``cpu_flags`` reports
only the flags of that instruction set (``-march=haswell``: AVX2, FMA, F16C; or
``-march=skylake-avx512``: AVX-512 F/CD/BW/DQ/VL, no BF16, VNNI or AMX), and the native
extension is built for it under its own name (``cadence.fast.native``). torch's kernels
read their own switches once, when torch is imported, so the process must have
``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA`` set to match before that
(``isa_env``; ``isa_mismatch`` says what is missing; ``cadence env`` prints it).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

import torch

# oneDNN ISA levels (``ONEDNN_MAX_CPU_ISA``) at or above which bf16 / AMX instructions are allowed
_ONEDNN_BF16 = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "ALL", "DEFAULT")
_ONEDNN_AMX = ("AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "ALL", "DEFAULT")


ISAS = ("native", "avx2", "avx512")  # CADENCE_ISA values
# what each forced instruction set compiles for, and the torch / oneDNN levels that match it
ISA_MARCH = {"native": "native", "avx2": "haswell", "avx512": "skylake-avx512"}
ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
           "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}}
# flags beyond each forced level (skylake-avx512 has AVX-512 F, CD, BW, DQ and VL only)
_BEYOND_AVX512 = ("avx512ifma", "avx512vbmi", "avx_vnni", "avx_vnni_int8", "avx_ifma")


def isa() -> str:
    """``CADENCE_ISA``: ``native`` (the default: every instruction the CPU has), ``avx2`` or
    ``avx512``. An unknown value is an error, not a silent fallback."""
    value = os.environ.get("CADENCE_ISA", "").strip().lower() or "native"
    if value not in ISAS:
        raise ValueError(f"CADENCE_ISA={value!r}: choose one of {', '.join(ISAS)}")
    return value


def isa_env(level: str | None = None) -> dict:
    """The variables torch must see at import for ``CADENCE_ISA=level`` ({} for native)."""
    return dict(ISA_ENV.get(level or isa(), {}))


def isa_mismatch() -> str | None:
    """What is wrong with the forced instruction set in this process, or None: a CPU without
    it, or torch's switches not set as ``isa_env`` says (they are read when torch is imported,
    so they must be in the process's environment from its start)."""
    level = isa()
    if level == "native":
        return None
    have = _hardware_flags()
    need = {"avx2": ("avx2", "fma", "f16c"), "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")}[level]
    missing = [f for f in need if f not in have]
    if missing:
        return f"CADENCE_ISA={level}: this CPU lacks {', '.join(missing)}"
    wrong = [f"{k}={v}" for k, v in isa_env(level).items() if os.environ.get(k, "").upper() != v.upper()]
    if wrong:
        return (f"CADENCE_ISA={level} needs {' '.join(wrong)} in the environment before torch is imported "
                f"(torch's own kernels run at {torch.backends.cpu.get_cpu_capability()} now)")
    return None


@lru_cache(maxsize=1)
def _hardware_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """The ``flags`` line of /proc/cpuinfo (empty where there is none, e.g. macOS), narrowed
    to the instruction set ``CADENCE_ISA`` forces: ``avx2`` drops every AVX-512, AMX and
    AVX-VNNI flag, ``avx512`` every AVX-512 extension past F/CD/BW/DQ/VL and AMX."""
    flags, level = _hardware_flags(), isa()
    if level == "avx2":
        return frozenset(f for f in flags if not f.startswith(("avx512", "amx", "avx_vnni", "avx_ifma")))
    if level == "avx512":
        return frozenset(f for f in flags if not (f.startswith(("avx512_", "amx")) or f in _BEYOND_AVX512))
    return flags


def isa_limits() -> dict:
    """The instruction-set limits in force: torch's kernel level (``AVX512``, ``AVX2``, ...),
    oneDNN's ``ONEDNN_MAX_CPU_ISA`` and MKL's ``MKL_ENABLE_INSTRUCTIONS`` (None when unset)."""
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
    return {"torch": torch.backends.cpu.get_cpu_capability(), "onednn": onednn.upper() if onednn else None,
            "mkl": mkl.upper() if mkl else None}


def _allows(levels: tuple[str, ...]) -> bool:
    lim = isa_limits()
    return lim["torch"].startswith("AVX512") and (lim["onednn"] is None or lim["onednn"] in levels)


def native_bf16() -> bool:
    """True when the CPU computes bf16 in hardware (AVX512-BF16 or AMX-BF16) and the kernels
    may use it (see the module docstring for the limits)."""
    flags = cpu_flags()
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and _allows(_ONEDNN_BF16)


def has_amx() -> bool:
    return "amx_tile" in cpu_flags() and _allows(_ONEDNN_AMX)


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def describe() -> dict:
    """The flags that matter here, for reports."""
    flags = cpu_flags()
    keep = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
            "amx_int8")
    return {"isa": [f for f in keep if f in flags], "native_bf16": native_bf16(), "amx": has_amx(),
            "onednn": onednn_available(), "limits": isa_limits()}


def isa_note() -> str | None:
    """A phrase for reports when the kernels run below the CPU's own instruction set, else None."""
    lim = isa_limits()
    flags = cpu_flags()
    narrowed = (lim["onednn"] is not None or lim["mkl"] is not None
                or ("avx512f" in flags and not lim["torch"].startswith("AVX512")))
    if not narrowed:
        return None
    return (f"instruction set limited to torch {lim['torch']}, oneDNN {lim['onednn'] or 'default'}, "
            f"MKL {lim['mkl'] or 'default'}")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    return None


def git_commit(repo: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=repo or Path(__file__).parent, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict:
    """CPU, cores, RAM, accelerator, library versions, commit."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "ram_gib": ram_gib(), "gpu": gpu,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": importlib.metadata.version("transformers"),
            "platform": platform.platform(), "commit": git_commit(), "isa_limit": isa_note()}



def machine_line(info: dict | None = None) -> str:
    info = info or machine_info()
    acc = info["gpu"] or "no GPU"
    limit = f" ({info['isa_limit']})" if info.get("isa_limit") else ""
    return (f"{info['cpu']}{limit}, {info['cores']} cores, {info['ram_gib']} GiB RAM, {acc}; torch {info['torch']}, "
            f"transformers {info['transformers']}, commit {info['commit']}")


def machine_key(backbone) -> str:
    """A file-name-safe key for the machine + backbone configuration a curve holds for."""
    dev = backbone.device
    where = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
             else f"{cpu_model()}|{' '.join(sorted(cpu_flags()))}|{sorted(isa_limits().items())}")
    parts = [where, str(os.cpu_count()), str(torch.get_num_threads()), torch.__version__, str(dev),
             str(backbone.dtype), type(backbone).__name__, backbone.name,
             str(backbone.hidden_size), str(backbone.vocab_size), str(backbone.config.num_hidden_layers)]
    if getattr(backbone, "chains_only", False):
        parts.append("chains")  # its curve is measured on chains
    if getattr(backbone, "quant", "none") != "none":
        parts.append(f"quant={backbone.quant}")
    if getattr(backbone, "kernels", None):
        parts.append(f"kernels={backbone.kernels}")  # a kernel change invalidates the curve
    if getattr(backbone, "native_build", ""):
        parts.append(f"native={backbone.native_build}")  # so does an edit of the native kernels
    digest = hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]
    return f"{backbone.name}-{str(backbone.dtype).replace('torch.', '')}-{digest}"
