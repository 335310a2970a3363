"""``--quant``: which weight format the fast decoder's projections run on; ``--kv-dtype``: which
dtype its KV cache holds.

Knows: the values (``none``; weight-only ``int8`` / ``int4`` of ``kernels``; ``gguf``, the
GGUF file's own blocks through ``gguf``; ``auto``; cache dtypes) and when each can run (device,
dtype, the model's file, the native extension). Does not know how the products are computed or
how attention reads the cache.
"""

from __future__ import annotations

import torch

from cadence.errors import CadenceError
from cadence.fast import gguf, native

# --quant: weight-only int8 / int4 of the fast decoder (``kernels``), a GGUF's own blocks (``gguf``),
# or ``auto`` (``gguf`` where the model is a GGUF of block types it reads and the dtype is fp32,
# which ``--dtype auto`` then is: ``backbone.load.auto_precision``)
QUANTS = ("none", "int8", "int4", "gguf", "q8_0", "q4_1", "q4_0", "auto")
BLOCK_QUANTS = ("q8_0", "q4_1", "q4_0")  # the model's weights quantized at load into GGUF blocks (``fast.blocks``)


def check_quant(quant: str, device: torch.device, dtype: torch.dtype) -> str:
    """``--quant``: none, int8 or int4 (weight-only, CPU: lossy against the unquantized
    model; speculative output is then compared with plain decoding of the same quantized model).
    ``gguf`` and ``auto`` are resolved by ``resolve_quant``."""
    if quant not in QUANTS:
        raise CadenceError(f"unknown --quant {quant!r}; choose one of {', '.join(QUANTS)}")
    if quant != "none" and device.type != "cpu":
        raise CadenceError(f"--quant {quant} runs on CPU only (weight-only {quant} through torch's CPU kernels)")
    return quant


def gguf_blocker(device: torch.device, dtype: torch.dtype, gguf_path) -> str | None:
    """Why ``--quant gguf`` cannot run for this model here (None where it can): it needs a CPU,
    fp32, a model loaded from a GGUF whose layers hold Q4_0, Q4_1, Q8_0 or F16 matrices, and the
    native extension (built here if it is not yet)."""
    if device.type != "cpu":
        return "runs on CPU only"
    if dtype != torch.float32:
        return f"computes in float32 and the model is {str(dtype).replace('torch.', '')} (--dtype float32)"
    if gguf_path is None:
        return "needs a model loaded from a GGUF file"
    if native.module() is None:
        return "needs the native extension (CADENCE_NATIVE=0, or its build failed: cadence env)"
    types = gguf.layer_types(gguf_path)
    if not any(t in gguf.BLOCK_TYPES.values() for t in types):
        return f"reads Q4_0, Q4_1, Q8_0 and F16 blocks; the file's layers are {', '.join(sorted(types))}"
    return None


def block_reason(quant: str, device: torch.device, dtype: torch.dtype) -> str:
    """What ``--quant q8_0 | q4_1 | q4_0`` computes (``fast.blocks``), or a CadenceError where it
    cannot run: a CPU, float32 and the native extension, as ``--quant gguf``."""
    if device.type != "cpu":
        raise CadenceError(f"--quant {quant} runs on CPU only")
    if dtype != torch.float32:
        raise CadenceError(f"--quant {quant} computes in float32 and the model is "
                           f"{str(dtype).replace('torch.', '')} (--dtype float32)")
    if native.module() is None:
        raise CadenceError(f"--quant {quant} needs the native extension (CADENCE_NATIVE=0, or its build failed: "
                           "cadence env)")
    return (f"the model's weights quantized at load into {quant.upper()} blocks (LM head Q8_0), activations "
            "rounded to 8 bits per block of 32 as llama.cpp does: lossy against the unquantized model, as a "
            "GGUF file of that type is")


def resolve_quant(quant: str, device: torch.device, dtype: torch.dtype, gguf_path) -> tuple[str, str]:
    """(the quant that runs, why). ``gguf``: fp32 products on the GGUF file's own blocks
    (``fast.gguf``; ``gguf_blocker`` says what it needs), an error where it cannot run. ``auto``:
    ``gguf`` where it can run, else ``none``. With ``--dtype auto`` too, a GGUF model it reads
    runs in fp32 on its blocks even on CPUs with native bf16 (``backbone.load.auto_precision``:
    there plain decoding on the blocks measured 2.5-2.6x bf16's). Neither is the file exactly:
    bf16 rounds the dequantized weights, ``gguf`` rounds the activations as llama.cpp does; both
    stay as near fp32 on the file's weights as llama.cpp is
    (``benchmarks/analysis/quant_quality.py``, docs/fast-path.md). Speculation is lossless
    against plain decoding on whichever path runs."""
    if quant in BLOCK_QUANTS:
        return quant, block_reason(quant, device, dtype)
    if quant not in ("gguf", "auto"):
        return check_quant(quant, device, dtype), ""
    why_not = gguf_blocker(device, dtype, gguf_path)
    if why_not is not None:
        if quant == "gguf":
            raise CadenceError(f"--quant gguf {why_not}")
        return "none", f"auto: dense weights (--quant gguf {why_not})"
    if quant == "auto" and not gguf.AUTO:
        return "none", ("auto: dense fp32 weights (the gguf kernel measured slower than oneDNN's fp32 product at "
                        "1 row on the AMX Xeon limited to AVX2; --quant gguf forces it)")
    return "gguf", gguf.describe()


# --kv-dtype: the KV cache's dtype. float16 halves the bytes a decode step reads from the cache
# (the whole cache, every step: at 1,000 tokens of context about 46 MB per forward for
# SmolLM2-135M in float32, as much as its Q4_1 weights); llama.cpp's default cache is float16 too
KV_DTYPES = ("auto", "float32", "float16", "bfloat16")
F16_MAX = 65504.0  # the largest finite float16: stores saturate there


def resolve_kv_dtype(kv_dtype: str, device: torch.device, dtype: torch.dtype, quant: str) -> torch.dtype:
    """The cache dtype for ``--kv-dtype``: ``auto`` is float16 on GGUF blocks (``quant``: the
    projections' kind, ``gguf`` for a GGUF's own blocks and for weights quantized into blocks at
    load; a float32 backbone on 4- or 8-bit weights, as llama.cpp's default cache), else the
    backbone's dtype; ``float16`` needs a float32 CPU backbone (keys and values are rounded
    to float16, saturating, when stored, and widened exactly when read); otherwise the
    backbone's own dtype only. Speculation stays lossless against plain decoding with the
    same cache: both round the same entries the same way."""
    if kv_dtype not in KV_DTYPES:
        raise CadenceError(f"unknown --kv-dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "auto":
        return torch.float16 if quant == "gguf" else dtype
    want = getattr(torch, kv_dtype)
    if want == dtype:
        return want
    if want == torch.float16 and dtype == torch.float32 and device.type == "cpu":
        return want
    have = str(dtype).replace("torch.", "")
    raise CadenceError(f"--kv-dtype {kv_dtype} with a {have} backbone on {device.type}: the cache is the "
                       f"backbone's dtype ({have}), or float16 under a float32 CPU backbone")
