"""What the CPU at hand can do, read at run time from ``/proc/cpuinfo``.

Knows: the instruction-set flags that decide kernels and precision (AVX2, AVX-512,
AVX512-BF16, AMX), and whether oneDNN (mkldnn) is built into this torch.
Does not know: how fast anything is; the choices made from these flags are measured in
``benchmarks/kernels/verify_cost.py``. Nothing here is hard-coded per machine.

The CPU's flags say what the hardware has; what the kernels may use can be narrowed with
the libraries' own switches, ``ATEN_CPU_CAPABILITY=avx2`` (torch's vectorised kernels),
``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's GEMMs) and ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's). With both set, an AVX-512 machine runs the
instruction set of an AVX2-only one (not its caches, clocks or memory), and every choice
made here follows: e.g. ``native_bf16()`` is False, so ``--dtype auto`` is fp32.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import os

import torch

# oneDNN ISA levels (``ONEDNN_MAX_CPU_ISA``) at or above which bf16 / AMX instructions are allowed
_ONEDNN_BF16 = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "ALL", "DEFAULT")
_ONEDNN_AMX = ("AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "ALL", "DEFAULT")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The ``flags`` line of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


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
