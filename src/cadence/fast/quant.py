"""``--quant``: which weight format the fast decoder's projections run on.

Knows: the values (``none``; weight-only ``int8`` / ``int4`` of ``kernels``; ``gguf``, the
GGUF file's own blocks through ``gguf``; ``auto``) and when each can run (device, dtype,
the model's file, the native extension). Does not know how the products are computed.
"""

from __future__ import annotations

import torch

from cadence.errors import CadenceError
from cadence.fast import gguf, native

# --quant: weight-only int8 / int4 of the fast decoder (``kernels``), a GGUF's own blocks (``gguf``),
# or ``auto`` (``gguf`` where the model is a GGUF of block types it reads and the dtype is fp32)
QUANTS = ("none", "int8", "int4", "gguf", "auto")


def check_quant(quant: str, device: torch.device, dtype: torch.dtype) -> str:
    """``--quant``: none, int8 or int4 (weight-only, CPU: lossy against the unquantized
    model; speculative output is then compared with plain decoding of the same quantized model).
    ``gguf`` and ``auto`` are resolved by ``resolve_quant``."""
    if quant not in QUANTS:
        raise CadenceError(f"unknown --quant {quant!r}; choose one of {', '.join(QUANTS)}")
    if quant != "none" and device.type != "cpu":
        raise CadenceError(f"--quant {quant} runs on CPU only (weight-only {quant} through torch's CPU kernels)")
    return quant


def resolve_quant(quant: str, device: torch.device, dtype: torch.dtype, gguf_path) -> tuple[str, str]:
    """(the quant that runs, why). ``gguf``: fp32 products on the GGUF file's own blocks
    (``fast.gguf``; needs a CPU, fp32, a model loaded from a GGUF whose layers hold Q4_0, Q4_1,
    Q8_0 or F16 matrices, and the native extension), an error where it cannot run. ``auto``:
    ``gguf`` where it can run, else ``none`` (on a CPU with native bf16, ``--dtype auto`` is
    bf16, whose AMX / oneDNN kernels were faster than this one on the AMX Xeon, so auto leaves
    them be). Neither is the file exactly: bf16 rounds the dequantized weights, ``gguf`` rounds
    the activations as llama.cpp does; both stay as near fp32 on the file's weights as
    llama.cpp is (``benchmarks/analysis/quant_quality.py``, docs/fast-path.md). Speculation is
    lossless against plain decoding on whichever path runs."""
    if quant not in ("gguf", "auto"):
        return check_quant(quant, device, dtype), ""
    why_not = None
    if device.type != "cpu":
        why_not = "runs on CPU only"
    elif dtype != torch.float32:
        why_not = f"computes in float32 and the model is {str(dtype).replace('torch.', '')} (--dtype float32)"
    elif gguf_path is None:
        why_not = "needs a model loaded from a GGUF file"
    elif native.module() is None:
        why_not = "needs the native extension (CADENCE_NATIVE=0, or its build failed: cadence env)"
    else:
        types = gguf.layer_types(gguf_path)
        if not any(t in gguf.BLOCK_TYPES.values() for t in types):
            why_not = f"reads Q4_0, Q4_1, Q8_0 and F16 blocks; the file's layers are {', '.join(sorted(types))}"
    if why_not is not None:
        if quant == "gguf":
            raise CadenceError(f"--quant gguf {why_not}")
        return "none", f"auto: dense weights (--quant gguf {why_not})"
    if quant == "auto" and not gguf.AUTO:
        return "none", ("auto: dense fp32 weights (the gguf kernel measured slower than oneDNN's fp32 product at "
                        "1 row on the AMX Xeon limited to AVX2; --quant gguf forces it)")
    return "gguf", gguf.describe()
