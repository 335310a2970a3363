"""The fast decoder's layer loop compiled from C++ (``layers.cpp``), built once per machine.

Knows: how to build the extension with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja; about a minute on 2 cores, then cached under torch's extension directory, e.g.
``~/.cache/torch_extensions``), and how to hand it a ``FastBackbone``'s weights. The C++
loop makes the same ATen calls as ``FastBackbone._layers_forward`` in the same order, so
its outputs are bit-identical (``tests/test_native.py``); it only removes the Python
interpreter between them (about 4,000 calls per SmolLM2 forward).
``attention.cpp`` adds ``listed_attention``, the row-consistent attention of bf16 decode and
verify forwards (``FastBackbone.listed``). The build uses ``-march=native`` (named by the
CPU's model and flags, so a cached build never loads on another CPU) and no fused
multiply-adds outside explicit ones.
Does not know: which forwards it may run; ``FastBackbone`` decides (every forward; branching
trees without ``listed_attention`` and batched rows call their Python attention back).

``CADENCE_NATIVE=0`` turns it off (the Python loop runs); a failed build warns once and
falls back to Python too, and so does a run that finds another live process still building
after ``CADENCE_BUILD_WAIT`` seconds: a build never waits on a dead process or without end
(``build.py``).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import torch

from cadence.fast.native import build
from cadence.system.machine import ISA_MARCH, _hardware_flags, isa

_SOURCES = [Path(__file__).with_name(f) for f in ("layers.cpp", "linear.h", "fused.cpp", "fused.h", "attention.cpp", "attention.h",
                                                    "attention_amx.cpp", "attention_amx.h", "vec16.h", "amx.h", "fused_math.h",
                                                    "gemm_amx.cpp", "gemm_amx.h", "gemm_q.cpp", "gemm_q.h", "gemm_qi.cpp",
                                                    "draft_block.cpp", "draft_block.h")]
_CFLAGS = ["-O3", "-ffp-contract=off", "-march=native", "-fopenmp"]  # no fused multiply-adds: vector and scalar code agree
_LDFLAGS = ["-fopenmp"]
_state: dict = {}  # "module": the loaded extension, or "error": why there is none


def enabled() -> bool:
    """False when ``CADENCE_NATIVE=0`` (or ``false``/``off``)."""
    return os.environ.get("CADENCE_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def listed_enabled() -> bool:
    """False when ``CADENCE_LISTED=0``: decode and verify forwards then attend through
    PyTorch's kernel (branching bf16 trees once per path) instead of ``attention.cpp``."""
    return os.environ.get("CADENCE_LISTED", "1").strip().lower() not in ("0", "false", "off", "no")


def module():
    """The compiled extension, building it on first use; None when off or the build failed."""
    if not enabled():
        return None
    if "module" in _state or "error" in _state:
        return _state.get("module")
    try:
        _state["module"] = build.load(name(), _cpp_sources(), cflags(), _LDFLAGS, what="building the native layer loop",
                                      announce="cadence: compiling the native layer loop "
                                               "(once per machine and torch, about a minute)")
    except build.BuildBusy as exc:  # another live process is building it: never wait without end
        _state["error"] = str(exc)
        warnings.warn(f"cadence: {exc}; using the Python loop for this run (slower)", stacklevel=2)
    except Exception as exc:  # no compiler, no ninja, headers missing: the Python loop runs
        _state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        warnings.warn(f"cadence: native layer loop unavailable ({_state['error']}); using the Python loop "
                      "(set CADENCE_NATIVE=0 to silence)", stacklevel=2)
    return _state.get("module")


def loaded():
    """The extension if a forward already built or loaded it, else None (never builds)."""
    return _state.get("module")


def cflags(level: str | None = None) -> list[str]:
    """The compiler flags of this process's build: ``-march=native``, or the instruction set
    ``CADENCE_ISA`` (or ``level``) forces (``avx2``: ``-march=haswell``, AVX2 + FMA + F16C;
    ``avx512``: ``-march=skylake-avx512``, AVX-512 F/CD/BW/DQ/VL without BF16 or AMX), which
    then runs on this CPU as it would on one that has only that set (``cadence.system.machine``)."""
    march = ISA_MARCH[level or isa()]
    return [f if not f.startswith("-march=") else f"-march={march}" for f in _CFLAGS]


def build_for(level: str):
    """The extension as a process with ``CADENCE_ISA=level`` builds it (the same name, so the
    same cached build), loaded beside this process's own: tests compare their bits."""
    flags = cflags(level)
    return build.load(_name_for(level, _digest(flags)), _cpp_sources(), flags, _LDFLAGS,
                      what=f"building the native layer loop for {level}")


def build_variant(name: str, march: str):
    """The extension built for another instruction set (``-march=MARCH``) under its own
    name, e.g. ``x86-64-v3`` (AVX2 + FMA) on an AVX-512 machine: tests run the code paths
    of CPUs they are not on. Not cached by CPU; not for decoding."""
    flags = [f if not f.startswith("-march=") else f"-march={march}" for f in _CFLAGS]
    return build.load(f"{name}_{_digest()}", _cpp_sources(), flags, _LDFLAGS, what=f"building {name} for {march}")


def name() -> str:
    """The extension's name here: its sources, torch, flags and CPU (``_digest``); a build for
    a forced instruction set names it (``cadence_layers_avx2_<digest>``)."""
    return _name_for(isa(), _digest())


def _name_for(level: str, digest: str) -> str:
    return "cadence_layers_" + ("" if level == "native" else f"{level}_") + digest


def _cpp_sources() -> list[str]:
    return [str(p) for p in _SOURCES if p.suffix == ".cpp"]


def build_state() -> dict:
    """The native build's state without building (``build.state``), or ``off``."""
    if not enabled():
        return {"state": "off", "reason": "CADENCE_NATIVE=0"}
    if "error" in _state:
        return {"state": "failed", "reason": _state["error"]}
    return build.state(name())


def build_id() -> str:
    """The loaded extension's build (its sources, torch, flags and CPU), '' when there is
    none: what a latency curve measured through it holds for (``machine.machine_key``)."""
    return _digest() if module() is not None else ""


def _digest(flags: list[str] | None = None) -> str:
    """Names the build by the source and torch version, so an edit or a new torch rebuilds;
    ``flags``: another build's compiler flags than this process's (``build_for``)."""
    if flags is None and "digest" in _state:
        return _state["digest"]

    h = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES))
    h.update(torch.__version__.encode())
    h.update(" ".join(flags or cflags()).encode())
    h.update(_cpu_identity().encode())  # -march=native: a build for one CPU never loads on another
    if flags is not None:
        return h.hexdigest()[:12]
    _state["digest"] = h.hexdigest()[:12]
    return _state["digest"]


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (Linux), empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return model + " " + " ".join(sorted(_hardware_flags()))  # the real CPU, whatever CADENCE_ISA says


