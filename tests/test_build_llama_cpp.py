"""benchmarks/peers/build_llama_cpp.py derives ggml's build flags from the CPU's."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))

from build_llama_cpp import derive_cmake_args, ISA_FLAGS  # noqa: E402

XEON = {"sse4_2", "avx", "avx2", "bmi2", "fma", "f16c", "avx_vnni", "avx512f", "avx512cd", "avx512vl",
        "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}


def test_amx_stays_off_unless_asked_for_and_missing_sets_are_off():
    """ggml's AMX kernels died with SIGILL on the AMX Xeon (2026-12-01): off by default."""
    args = derive_cmake_args(XEON)
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX512_BF16=ON" in args
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    assert {"-DGGML_AMX_TILE=ON", "-DGGML_AMX_INT8=ON", "-DGGML_AMX_BF16=ON"} <= set(derive_cmake_args(XEON, amx=True))
    avx2 = derive_cmake_args({"sse4_2", "avx", "avx2", "bmi2", "fma", "f16c"})
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2 and "-DGGML_AVX_VNNI=OFF" in avx2
    assert derive_cmake_args(XEON, x86=False)[0] == "-DGGML_NATIVE=OFF" and len(derive_cmake_args(XEON, x86=False)) == 2


def test_isa_limits_the_build_to_what_cadence_isa_runs():
    """--isa avx2 / avx512 on the AMX Xeon: the flags of that set only (CADENCE_ISA's)."""
    avx2 = set(derive_cmake_args(XEON & ISA_FLAGS["avx2"]))
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"} <= avx2
    assert {"-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF"} <= avx2
    avx512 = set(derive_cmake_args(XEON & ISA_FLAGS["avx512"]))
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX512_VBMI=OFF"} <= avx512
