"""What the CPU at hand can do, read at run time from ``/proc/cpuinfo``.

Knows: the instruction-set flags that decide kernels and precision (AVX2, AVX-512,
AVX512-BF16, AMX), and whether oneDNN (mkldnn) is built into this torch.
Does not know: how fast anything is; the choices made from these flags are measured in
``benchmarks/verify_cost.py``. Nothing here is hard-coded per machine.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


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


def native_bf16() -> bool:
    """True when the CPU computes bf16 in hardware (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def has_amx() -> bool:
    return "amx_tile" in cpu_flags()


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def describe() -> dict:
    """The flags that matter here, for reports."""
    flags = cpu_flags()
    keep = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
            "amx_int8")
    return {"isa": [f for f in keep if f in flags], "native_bf16": native_bf16(), "amx": has_amx(),
            "onednn": onednn_available()}
