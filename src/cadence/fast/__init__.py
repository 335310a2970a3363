"""The fast path: a lean decoder forward for Llama-family backbones.

Modules, one idea each:
- ``arch``: which configs the fast decoder supports, and why others are refused.
- ``cpu``: the CPU's features, read at run time (native bf16, AMX, oneDNN).
- ``kernels``: matrix products that suit the device (prepacked oneDNN on CPU).
- ``cache``: the preallocated KV cache with in-place compaction.
- ``rope``: RoPE from a precomputed table indexed by position ids.
- ``model``: ``FastBackbone``, the forward itself.
- ``native``: its layer loop in C++ (same ATen calls, same bits) and fused RMSNorm / RoPE
  kernels, built once per machine at the first forward (Python loop when it cannot build).

``make_fast(backbone, backend)`` is what ``cadence.backbone.load_backbone`` calls.
"""

from __future__ import annotations

from cadence.errors import CadenceError
from cadence.fast.arch import unsupported_reason

# --quant: weight-only int8 / int4 of the fast decoder (``kernels``), a GGUF's own blocks (``gguf``),
# or ``auto`` (``gguf`` where the model is a GGUF of block types it reads and the dtype is fp32)
QUANTS = ("none", "int8", "int4", "gguf", "auto")


def make_fast(backbone, backend: str = "auto", **kwargs):
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
    from cadence.fast.model import FastBackbone

    return FastBackbone.from_backbone(backbone, **kwargs)


__all__ = ["QUANTS", "make_fast", "unsupported_reason"]
