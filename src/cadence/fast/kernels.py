"""Matrix-product kernels for the fast decoder's projections, chosen for the device at hand.

Knows: the ways to compute ``x @ W.T + b`` here and when each applies.
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on the weights in oneDNN's blocked
  layout (prepacked once). On CPU this streams the weights once for all rows: measured on
  a Zen 5 EPYC, 2 threads, fp32, LM head 49152x576, M = 1/3/8/32 rows: F.linear 6.8/20.4/
  11.3/15.6 ms, oneDNN dense 2.3/3.1/4.1/6.9, oneDNN prepacked 2.0/2.2/2.4/4.9. The packed
  weights are a copy (oneDNN's layout is opaque), so the dense original is freed or never kept.
- ``onednn-dense``: the same call on the plain weights (no copy, a bit slower at M > 1).
- ``aten``: ``F.linear`` (CUDA, or a torch without oneDNN).
- ``amx``: bf16 on a CPU with AMX, through the native extension's tile kernel
  (``native/gemm_amx.cpp``) on weights in its layout (``amx_pack``). It streams the weights
  once with less per-call overhead than oneDNN (AMX Xeon, 2 threads, SmolLM2's qkv/o/
  gate_up/down at 1 row: 25/16/91/40 us against oneDNN's 42/30/127/58; 32 rows cost both
  about the same extra, ``benchmarks/kernels/gemm_cost.py``), and a row's bits do not depend on the other rows, so
  row-consistent forwards need no padding or row blocks for it. ``auto`` picks it on bf16
  AMX CPUs where the extension builds.
- ``int8``: weight-only int8 (``--quant int8``, lossy against the unquantized model):
  per-output-channel symmetric scales, ``torch.ops.aten._weight_int8pack_mm`` on
  activations in the model's dtype. Half the bytes of bf16 to stream per token; its rows
  do not depend on the other rows (tested), so it keeps bf16's row consistency. On the Zen
  5 EPYC, cache-hot, M = 1/2/4/8 rows: LM head 0.85/0.71/0.88/1.82 ms against 1.06/1.14/
  1.25/1.40 for prepacked bf16; past about 4 rows its dequantize-then-multiply is compute-bound.
- ``int4``: weight-only 4-bit (``--quant int4``, lossy against the unquantized model, the
  class of llama.cpp's Q4_1): groups of ``INT4_GROUP`` input weights share a bf16 scale and
  minimum (``quantize_int4``), ``torch.ops.aten._weight_int4pack_mm_for_cpu``. A quarter of
  bf16's bytes; its rows do not depend on the other rows either (tested). Needs out % 16 == 0
  and in % INT4_GROUP == 0; a matrix that does not fit falls back to ``int8``. Where it wins
  depends on the CPU: ``benchmarks/kernels/verify_cost.py --quant int4`` measures it.
- ``gguf``: fp32 activations times weights kept in a GGUF file's own blocks (Q4_0, Q4_1,
  Q8_0; F16 / F32 rows too) through the native extension's ``q_linear``
  (``native/gemm_q.cpp``), built by ``Linear.from_blocks`` from ``fast.gguf``. The weights
  are the file's dequantized values bit for bit (the fp32 path's weights), only the
  summation order differs from oneDNN's; a row's bits do not depend on the other rows. A
  Q4_1 projection streams 0.625 bytes per weight instead of fp32's 4.
Does not know: which weights are fused (``model`` decides) or how long anything takes on a
machine it has not run on; ``benchmarks/kernels/verify_cost.py`` measures that.
"""

from __future__ import annotations

import os

import gguf
import torch
import torch.nn.functional as F

from cadence.fast import native
from cadence.fast.consistent import MAX_ROWS
from cadence.system.machine import has_amx, onednn_available

KINDS = ("auto", "amx", "onednn", "onednn-dense", "aten", "int8", "int4", "gguf")
INT4_GROUP = 32  # input weights per scale/minimum pair (llama.cpp's Q4_1 blocks are 32 too)
# the resolved overload: calling the packet (``torch.ops.mkldnn._linear_pointwise``) picks the
# overload again on every call, about 4 us each, 121 calls per SmolLM2 forward
_ONEDNN = torch.ops.mkldnn._linear_pointwise.default if onednn_available() else None
ROW_FREE = ("amx", "int8", "int4", "gguf")  # kinds whose rows' bits do not depend on the row count (tested)
PACK_ROWS = 8  # oneDNN's batch-size hint when prepacking; measured fastest for 1..32 rows


def resolve_kind(kind: str, device: torch.device, dtype: torch.dtype) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown kernel kind {kind!r}; choose one of {KINDS}")
    if kind in ("int8", "int4"):
        return kind
    if kind == "gguf":  # weights from ``Linear.from_blocks`` only; ``model`` builds them
        raise ValueError("kernel 'gguf' is chosen with --quant gguf (fp32, a GGUF model), not as --kernel")
    cpu_ok = device.type == "cpu" and onednn_available() and dtype in (torch.float32, torch.bfloat16)
    amx_ok = device.type == "cpu" and dtype == torch.bfloat16 and amx_available()
    if kind == "amx" and not amx_ok:
        raise ValueError("kernel 'amx' needs bf16 weights on a CPU with AMX and the native extension "
                         f"(this one: device {device.type}, {dtype}, AMX {'yes' if has_amx() else 'no'}, "
                         f"extension {'on' if _native() is not None else 'off'}); use kernel 'auto'")
    if kind == "auto":
        return "amx" if amx_ok else ("onednn" if cpu_ok else "aten")
    if kind.startswith("onednn") and not cpu_ok:
        return "aten"
    return kind


def _native():
    """The native extension (built on first use), or None where it is off or failed to build."""
    return native.module()


def amx_available() -> bool:
    """Whether ``amx`` products run here: a CPU with AMX, the native extension built, the
    kernel granted tile data and CADENCE_AMX not 0."""
    if not has_amx():
        return False
    mod = _native()
    return mod is not None and bool(mod.amx_gemm_available())


def amx_pack(w: torch.Tensor) -> torch.Tensor:
    """W (out, in) bf16 -> the AMX kernel's layout (ceil(out / 32), ceil(in / 32), 2, 16, 32),
    zero-padded: packed[nb, kb, j, r, 2 c + p] = W[32 nb + 16 j + c, 32 kb + 2 r + p]. Example:
    W (960, 576) -> (30, 18, 2, 16, 32); W[40, 7] lands at nb 1, j 0, c 8, kb 0, r 3, p 1,
    i.e. packed[1, 0, 0, 3, 17]: a tile row holds one input pair of 16 output columns."""
    n, k = w.shape
    nb, kb = -(-n // 32), -(-k // 32)
    padded = w.new_zeros(nb * 32, kb * 32)
    padded[:n, :k] = w
    return padded.view(nb, 2, 16, kb, 16, 2).permute(0, 3, 1, 4, 2, 5).reshape(nb, kb, 2, 16, 32)


def swiglu_rows(w: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """[gate; up] (2 I, ...) with their rows interleaved by 16, so that each block of 32
    output columns the AMX kernel computes holds gate and up of the same 16 outputs (its
    SwiGLU epilogue). Example, I = 32: rows gate 0-15, up 0-15, gate 16-31, up 16-31.
    ``inverse`` undoes it. Works on weights (2 I, K) and biases (2 I,)."""
    i = w.shape[0] // 2
    if inverse:
        blocks = w.reshape(i // 16, 2, 16, *w.shape[1:])
        return torch.cat([blocks[:, 0].reshape(i, *w.shape[1:]), blocks[:, 1].reshape(i, *w.shape[1:])])
    gate, up = w[:i].reshape(i // 16, 16, *w.shape[1:]), w[i:].reshape(i // 16, 16, *w.shape[1:])
    return torch.stack([gate, up], dim=1).reshape(w.shape).contiguous()


def amx_unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``amx_pack``'s inverse: W (n, k)."""
    nb, kb = packed.shape[:2]
    return packed.view(nb, kb, 2, 16, 16, 2).permute(0, 2, 4, 1, 3, 5).reshape(nb * 32, kb * 32)[:n, :k].contiguous()


class Linear:
    """``y = x @ W.T + b`` for x of shape (..., in); W (out, in) is taken over, not copied
    unless the kind packs it. ``dense`` is W for kinds that keep it (else None).
    ``swiglu`` (W = [gate; up], 2 I rows): where the kind can (``amx``, I a multiple of 16)
    the call returns silu(gate) * up (..., I) from the product's epilogue and ``self.swiglu``
    is True; elsewhere it is False and the caller applies the gate."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, swiglu: bool = False):
        self.kind = kind
        self.swiglu = swiglu and kind == "amx" and weight.shape[0] % 32 == 0
        self.min_rows = 1  # inputs with fewer rows are padded (``consistent``: same bits at any M)
        self.max_rows = 0  # 0: any; else more rows run in blocks of at most this many (``consistent``)
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        w = weight.detach()
        self.scale = None
        self.qtype = -1  # gguf: the GGML type of the blocks in ``w``
        if kind == "onednn":
            self.w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS)
            self.dense = None
        elif kind == "amx":
            self.w = amx_pack(swiglu_rows(w) if self.swiglu else w)
            if self.swiglu and self.bias is not None:
                self.bias = swiglu_rows(self.bias)
            self.dense = None
            self._amx = _native().amx_linear
        elif kind == "int4" and int4_fits(w):
            self.w, self.scale = quantize_int4(w)
            self.dense = None
        elif kind in ("int8", "int4"):  # int4 that does not fit the kernel's shapes: int8
            self.kind = "int8"
            self.w, self.scale = quantize_int8(w)
            self.dense = None
        else:
            self.w = w.contiguous()
            self.dense = self.w

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, qtype: int, in_features: int, bias: torch.Tensor | None) -> Linear:
        """Kind ``gguf``: blocks (out, row bytes) uint8, row j the file's blocks of output j's
        weights in GGML type ``qtype`` (``fast.gguf``); bias (out,) fp32 or None."""
        self = cls.__new__(cls)
        self.kind, self.swiglu, self.min_rows, self.max_rows = "gguf", False, 1, 0
        self.out_features, self.in_features = blocks.shape[0], in_features
        self.bias = None if bias is None else bias.detach().float().contiguous()
        ops = _native()
        self.w, self.qtype, self.scale, self.dense = blocks.contiguous(), int(qtype), None, None
        if gguf_int8():  # Q4_0 / Q4_1 / Q8_0 on the integer kernel (``gemm_qi.cpp``): repacked once
            self.w, self.qtype = ops.q_pack(self.w, self.qtype, in_features), ops.q_packed_type(self.qtype, in_features)
        self._q = ops.q_linear
        return self

    @classmethod
    def q8_0(cls, weight: torch.Tensor) -> Linear:
        """Kind ``gguf`` from a dense W (out, in): W rounded to GGUF Q8_0 blocks (``blocks``)."""
        return cls.blocks(weight, "q8_0")

    @classmethod
    def blocks(cls, weight: torch.Tensor, fmt: str) -> Linear:
        """Kind ``gguf`` from a dense W (out, in): W rounded to GGUF blocks of 32 weights
        (``gguf.quants.quantize``): ``q8_0`` (int8 + an fp16 scale, 1.06 bytes per weight),
        ``q4_1`` (4 bits + an fp16 scale and minimum, 0.56 bytes) or ``q4_0`` (4 bits + a scale,
        0.5 bytes). Needs in % 32 == 0. For drafting weights (``draft_linear``): output is
        verified, never trusted."""
        qtype = BLOCK_DRAFTS[fmt]
        w = weight.detach().float().cpu().numpy()
        data = gguf.quants.quantize(w, qtype)
        lin = cls.from_blocks(torch.from_numpy(data).view(torch.uint8).reshape(w.shape[0], -1),
                              int(qtype), w.shape[1], None)
        lin.block_format = fmt  # which of ``BLOCK_DRAFTS`` (``qtype`` may name the packed layout)
        return lin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gguf":  # any row count: a row's bits do not depend on the others
            if x.dtype != torch.float32:  # bf16 drafting through Q8_0 weights (``q8_0``): fp32 in, x's dtype out
                return self._q(x.float(), self.w, self.qtype, self.out_features, self.bias).to(x.dtype)
            return self._q(x, self.w, self.qtype, self.out_features, self.bias)
        if self.kind == "aten":
            return F.linear(x, self.w, self.bias)
        if self.kind == "amx":  # any row count: a row's bits do not depend on the others
            return self._amx(x, self.w, self.bias, self.out_features, self.swiglu)
        rows = x.numel() // self.in_features
        if (self.kind not in ("int8", "int4") and self.min_rows <= rows and x.is_contiguous()
                and (not self.max_rows or rows <= self.max_rows)):
            return _ONEDNN(x, self.w, self.bias, "none", [], "")  # (..., in) as is: same bits as 2-D
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if not self.max_rows or rows <= self.max_rows:
            return self._rows(x2).view(*lead, self.out_features)
        y = x2.new_empty(rows, self.out_features)
        for i in range(0, rows, self.max_rows):  # e.g. 70 rows, max 32: [0, 32), [32, 64), [64, 70)
            y[i:i + self.max_rows] = self._rows(x2[i:i + self.max_rows])
        return y.view(*lead, self.out_features)

    def _rows(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 (m, in) -> (m, out), padded to min_rows rows for the call."""
        m = x2.shape[0]
        if m < self.min_rows:
            x2 = torch.cat([x2, x2[-1:].expand(self.min_rows - m, -1)])
        if self.kind in ("int8", "int4"):
            if self.kind == "int8":
                y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.w, self.scale)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self.w, INT4_GROUP, self.scale)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = _ONEDNN(x2.contiguous(), self.w, self.bias, "none", [], "")
        return y[:m]

    def to_dense(self) -> torch.Tensor:
        """W (out, in) as a plain tensor: the kept one, oneDNN's unpacked, or int8's dequantized."""
        if self.dense is not None:
            return self.dense
        if self.kind == "int8":
            return (self.w.float() * self.scale.float()[:, None]).to(self.scale.dtype)
        if self.kind == "int4":
            return dequantize_int4(self.w, self.scale, self.out_features, self.in_features)
        if self.kind == "gguf":
            return _native().q_dequantize(self.w, self.qtype, self.in_features)
        if self.kind == "amx":
            w = amx_unpack(self.w, self.out_features, self.in_features)
            return swiglu_rows(w, inverse=True) if self.swiglu else w
        return self.w.to_dense()

    def nbytes(self) -> int:
        n = self.w.numel() * self.w.element_size() if self.kind in ("int4", "amx", "gguf") else \
            self.out_features * self.in_features * torch.empty((), dtype=self.w.dtype).element_size()
        n += 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


DRAFT_FORMATS = ("auto", "dense", "q8_0", "q4_1", "q4_0")  # how drafting kernels hold their weights (``draft_linear``)
BLOCK_DRAFTS = {  # the formats held in GGUF blocks on the integer kernel (``Linear.blocks``)
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}


def q8_0_drafts_here(weight: torch.Tensor) -> bool:
    """Whether GGUF-block drafting kernels (``BLOCK_DRAFTS``: q8_0, q4_1, q4_0) run for W (out,
    in): a CPU tensor, the native extension built, and in % 32 == 0 (whole blocks)."""
    return weight.device.type == "cpu" and weight.shape[1] % 32 == 0 and _native() is not None


def resolve_draft_format(weight: torch.Tensor, fmt: str = "auto") -> str:
    """``auto`` -> ``q4_1`` for fp32 drafting weights where it runs (``q8_0_drafts_here``), ``q8_0``
    for bf16 ones on a CPU without AMX, else ``dense``; other formats as given. Why by dtype (``benchmarks/kernels/draft_kernels.py``,
    AMX Xeon, 2026-12-06): against fp32 weights (oneDNN) Q8_0 was 2-10x faster at every row
    count from 1 to 32, hot and cold (the draft-vocabulary LM head cold: 0.45 against 1.34 ms at 1
    row, 0.80 against 2.07 at 32); against bf16 on AMX it wins only up to about 4 rows, and
    sampled trees draft 8-16 rows per level (it ran slower sampled), so bf16 stays dense. Why
    Q4_1 over Q8_0 (Zen 4 EPYC, GGUF path, 2026-12-07, ``docs/results``): drafting reads the
    weights from memory after each verify forward evicted them, and half the bytes drafted
    eagle-taps in 1.43 instead of 1.77 ms per step, hydra in 0.68 instead of 0.90, at the same
    acceptance (tau 1.80 / 1.81, 1.64 / 1.65 on 28 held-out prompts). Why Q8_0 for bf16 without
    AMX (Zen 4 EPYC, bf16 backbone, 2026-12-07, tuning prompts, one interleaved run): bf16 through
    AVX512-BF16 reads twice Q8_0's bytes at a few rows, and eagle-taps ran 1.71x -> 1.86x plain
    decoding (tau 2.33 / 2.30; Q4_1 also 1.86x at tau 2.26), hydra 1.67x -> 1.74x; sampled
    (T 0.7, top-p 0.9) 1.46x -> 1.49x, 1.44x -> 1.45x."""
    if fmt != "auto":
        return fmt
    if not q8_0_drafts_here(weight):
        return "dense"
    if weight.dtype == torch.float32:
        return "q4_1"
    return "q8_0" if weight.dtype == torch.bfloat16 and not has_amx() else "dense"


def draft_linear(weight: torch.Tensor, fmt: str = "dense") -> Linear | None:
    """A drafting projection's kernel for W (out, in). ``fmt``: ``dense`` keeps W's dtype in
    the device's fastest kind (None where that is plain ``F.linear``: CUDA); ``q8_0``, ``q4_1``
    and ``q4_0`` round W to GGUF blocks on the integer kernel (``Linear.blocks``: Q8_0 about half
    bf16's bytes and a quarter of fp32's, Q4_1 / Q4_0 half of that again; the activations
    rounded to 8 bits per 32 as llama.cpp does) where it runs (``q8_0_drafts_here``), else
    ``dense``; ``auto`` picks by dtype (``resolve_draft_format``: ``q4_1`` for fp32 weights,
    ``q8_0`` for bf16 without AMX, ``dense`` for bf16 on AMX). Drafting reads these weights once per tree
    level, bound by memory, so fewer bytes are faster (AMX Xeon, eagle-taps: 4.5 -> 4.2 ms of
    drafting per step on the bf16 backbone, 4.9 -> 2.5 ms with fp32 heads on the GGUF path).
    Drafts are verified, so no format changes the output."""
    if fmt not in DRAFT_FORMATS:
        raise ValueError(f"unknown draft weight format {fmt!r}; choose one of {DRAFT_FORMATS}")
    fmt = resolve_draft_format(weight, fmt)
    if fmt in BLOCK_DRAFTS and q8_0_drafts_here(weight):
        return Linear.blocks(weight, fmt)
    kind = resolve_kind("auto", weight.device, weight.dtype)
    return Linear(weight, None, kind) if kind != "aten" else None


def gguf_int8() -> bool:
    """Whether ``gguf`` matrices in Q4_0 / Q4_1 / Q8_0 run the integer kernel (activations
    rounded to 8 bits per block of 32, as llama.cpp; ``native/gemm_qi.cpp``): yes unless
    ``CADENCE_GGUF_INT8=0``, which keeps fp32 activations (``gemm_q.cpp``: exact products of
    the file's weights, slower than dense fp32)."""
    return os.environ.get("CADENCE_GGUF_INT8", "1").strip().lower() not in ("0", "false", "off", "no")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: W ~ q * scale[:, None], q in [-127, 127].
    w: (out, in) -> q (out, in) int8, scale (out,) in w's dtype. Example: a row
    [0.5, -1.0, 0.25] -> scale 1/127, q [64, -127, 32] (0.5 * 127 = 63.5 rounds to 64)."""
    wf = w.detach().float()
    scale = (wf.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = (wf / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale.to(w.dtype)


def int4_fits(w: torch.Tensor) -> bool:
    """Whether ``_weight_int4pack_mm_for_cpu`` takes w (out, in): CPU, out a multiple of 16
    and in a multiple of INT4_GROUP. Example: SmolLM2's (960, 576) qkv fits; (100, 64) does not."""
    out, inp = w.shape
    return w.device.type == "cpu" and out % 16 == 0 and inp % INT4_GROUP == 0


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups along the input dimension: each run of INT4_GROUP weights of a
    row keeps its minimum m and step s = (max - m) / 15, and a weight becomes q in [0, 15]
    with W ~ q * s + m. w: (out, in) -> (packed (out, in / 2) uint8 in the kernel's layout,
    scales_and_zeros (in / INT4_GROUP, out, 2) in w's dtype: [s, m + 8 s], the kernel's
    convention, which reads W = (q - 8) * s + zero). Example: a group spanning [-0.3, 1.2]
    -> s = 0.1, 0.45 -> q = round(7.5) = 8 -> 0.5; every weight within s / 2 of its original."""
    out, inp = w.shape
    g = w.detach().float().reshape(out, inp // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = ((g - lo) / step).round().clamp(0, 15).to(torch.int32).reshape(out, inp)
    pairs = torch.cat([step, lo + 8 * step], dim=-1)  # (out, groups, 2)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    return packed, pairs.transpose(0, 1).contiguous().to(w.dtype)


def dequantize_int4(packed: torch.Tensor, pairs: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """W (out, in) from ``quantize_int4``'s output, through the kernel itself (an identity
    input), so it is exactly what the kernel multiplies by (up to the output rounding)."""
    eye = torch.eye(inp, dtype=pairs.dtype, device=packed.device)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, INT4_GROUP, pairs).T.contiguous()


# the native layer loop's view of the weights (``fast.native``: ``linear.h``, ``layers.cpp``)
KIND = {"aten": 0, "onednn": 1, "onednn-dense": 1, "int8": 2, "int4": 3, "amx": 4, "amx-swiglu": 5, "gguf": 6}


def linear_ints(lin, max_rows: int = 0) -> list[int]:
    """A ``kernels.Linear``'s fields as the C++ ``Lin`` takes them (``linear.h``: kind, in,
    out, min_rows, max_rows, group)."""
    kind = KIND["amx-swiglu"] if getattr(lin, "swiglu", False) else KIND[lin.kind]
    group = lin.qtype if lin.kind == "gguf" else INT4_GROUP  # gguf: the GGML type of its blocks
    return [kind, lin.in_features, lin.out_features, lin.min_rows, max_rows, group]


def build_layers(mod, bb):
    """A ``Layers`` object holding ``bb``'s weights (references, no copies)."""
    s = bb.spec
    blockable = {id(lin) for lin in bb._blockable}  # blocks of MAX_ROWS rows in steady forwards
    out = mod.Layers(s.heads, s.kv_heads, s.head_dim, float(s.eps), bool(s.qk_norm), bb.embed.weight.detach(),
                     bb.final_norm)
    for layer in bb._layers:
        lins = [layer.qkv, layer.o, layer.gate_up, layer.down]
        ints = [i for lin in lins for i in linear_ints(lin, MAX_ROWS if id(lin) in blockable else 0)]
        out.add_layer(layer.ln1, layer.ln2, layer.q_norm, layer.k_norm, [lin.w for lin in lins],
                      [lin.scale for lin in lins], [lin.bias for lin in lins], ints)
    return out
