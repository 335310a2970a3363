"""Matrix-product kernels for the fast decoder's projections, chosen for the device at hand.

Knows: three ways to compute ``x @ W.T + b`` and when each applies.
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on the weights in oneDNN's blocked
  layout (prepacked once). On CPU this streams the weights once for all rows: measured on
  a Zen 5 EPYC, 2 threads, fp32, LM head 49152x576, M = 1/3/8/32 rows: F.linear 6.8/20.4/
  11.3/15.6 ms, oneDNN dense 2.3/3.1/4.1/6.9, oneDNN prepacked 2.0/2.2/2.4/4.9. The packed
  weights are a copy (oneDNN's layout is opaque), so the dense original is freed or never kept.
- ``onednn-dense``: the same call on the plain weights (no copy, a bit slower at M > 1).
- ``aten``: ``F.linear`` (CUDA, or a torch without oneDNN).
- ``int8``: weight-only int8 (``--quant int8``, lossy against the unquantized model):
  per-output-channel symmetric scales, ``torch.ops.aten._weight_int8pack_mm`` on
  activations in the model's dtype. Half the bytes of bf16 to stream per token; its rows
  do not depend on the other rows (tested), so it keeps bf16's row consistency. On the Zen
  5 EPYC, cache-hot, M = 1/2/4/8 rows: LM head 0.85/0.71/0.88/1.82 ms against 1.06/1.14/
  1.25/1.40 for prepacked bf16; past about 4 rows its dequantize-then-multiply is compute-bound.
Does not know: which weights are fused (``model`` decides) or how long anything takes on a
machine it has not run on; ``benchmarks/verify_cost.py`` measures that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cadence.fast.cpu import onednn_available

KINDS = ("auto", "onednn", "onednn-dense", "aten", "int8")
# the resolved overload: calling the packet (``torch.ops.mkldnn._linear_pointwise``) picks the
# overload again on every call, about 4 us each, 121 calls per SmolLM2 forward
_ONEDNN = torch.ops.mkldnn._linear_pointwise.default if onednn_available() else None
PACK_ROWS = 8  # oneDNN's batch-size hint when prepacking; measured fastest for 1..32 rows


def resolve_kind(kind: str, device: torch.device, dtype: torch.dtype) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown kernel kind {kind!r}; choose one of {KINDS}")
    if kind == "int8":
        return kind
    cpu_ok = device.type == "cpu" and onednn_available() and dtype in (torch.float32, torch.bfloat16)
    if kind == "auto":
        return "onednn" if cpu_ok else "aten"
    if kind.startswith("onednn") and not cpu_ok:
        return "aten"
    return kind


class Linear:
    """``y = x @ W.T + b`` for x of shape (..., in); W (out, in) is taken over, not copied
    unless the kind packs it. ``dense`` is W for kinds that keep it (else None)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str):
        self.kind = kind
        self.min_rows = 1  # inputs with fewer rows are padded (``consistent``: same bits at any M)
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        w = weight.detach()
        self.scale = None
        if kind == "onednn":
            self.w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS)
            self.dense = None
        elif kind == "int8":
            self.w, self.scale = quantize_int8(w)
            self.dense = None
        else:
            self.w = w.contiguous()
            self.dense = self.w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "aten":
            return F.linear(x, self.w, self.bias)
        if self.kind != "int8" and x.numel() >= self.min_rows * self.in_features and x.is_contiguous():
            return _ONEDNN(x, self.w, self.bias, "none", [], "")  # (..., in) as is: same bits as 2-D
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if m < self.min_rows:
            x2 = torch.cat([x2, x2[-1:].expand(self.min_rows - m, -1)])
        if self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.w, self.scale)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = _ONEDNN(x2.contiguous(), self.w, self.bias, "none", [], "")
        return y[:m].view(*lead, self.out_features)

    def to_dense(self) -> torch.Tensor:
        """W (out, in) as a plain tensor: the kept one, oneDNN's unpacked, or int8's dequantized."""
        if self.dense is not None:
            return self.dense
        if self.kind == "int8":
            return (self.w.float() * self.scale.float()[:, None]).to(self.scale.dtype)
        return self.w.to_dense()

    def nbytes(self) -> int:
        n = self.out_features * self.in_features * torch.empty((), dtype=self.w.dtype).element_size()
        n += 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: W ~ q * scale[:, None], q in [-127, 127].
    w: (out, in) -> q (out, in) int8, scale (out,) in w's dtype. Example: a row
    [0.5, -1.0, 0.25] -> scale 1/127, q [64, -127, 32] (0.5 * 127 = 63.5 rounds to 64)."""
    wf = w.detach().float()
    scale = (wf.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = (wf / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale.to(w.dtype)
