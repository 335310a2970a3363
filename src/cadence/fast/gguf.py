"""A GGUF file's weight blocks, matched to the fast decoder's projections (``--quant gguf``).

Knows: how to read a GGUF's tensors through the ``gguf`` package's reader (raw bytes, no
dequantization), which GGUF tensor holds which Llama-family projection (``blk.N.attn_q``,
``attn_k``, ``attn_v``, ``attn_output``, ``ffn_gate``, ``ffn_up``, ``ffn_down``; the LM head is
``output``, or ``token_embd`` when the model ties them), and the row order of q and k:
llama.cpp's converter permutes their rows for its RoPE layout and transformers' loader
permutes them back (``_reverse_permute_weights``), so a GGUF row j of ``attn_q`` is the
transformers row ``head_rows(...)`` names. Every matrix is checked, not assumed: its blocks,
dequantized by the kernel's own decoder, must equal the model's fp32 weight (the file
dequantized by ``gguf.quants`` at conversion) bit for bit, in the file's row order or in one
of the un-permuted orders; only then does the projection run on the blocks.

What runs where (``Choice``):
- Q4_0, Q4_1, Q8_0 (and F16) matrices: the file's blocks (``kernels.Linear.from_blocks``);
- fused matrices (q|k|v, gate|up) whose parts are not all of one such type, matrices in other
  formats (Q4_K, Q5_*, Q6_K, ...), missing tensors or ones that fail the check: the model's
  fp32 weight through the same kernel (type F32, 4 bytes per weight), so the forward stays
  row-consistent; the reason is kept (``FastBackbone.gguf_report``);
- the embedding: the model's fp32 table (a lookup reads one row per token).
So the ``gguf`` path computes with the same weights as the fp32 path (the file's, dequantized),
in another summation order: lossless relative to the file, not to any fp32 original.

Does not know: the kernel's arithmetic (``native/gemm_q.cpp``) or what the model does with
the products (``fast.model``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

from cadence.fast.kernels import Linear, gguf_int8

F32, F16, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 8
# whether ``--quant auto`` takes ``gguf`` where it can run (fp32: CPUs without native bf16): yes.
# On the AMX Xeon limited to AVX2 (2026-12-06, commit e48d850, ``benchmarks/kernels/verify_cost.py``)
# the integer kernel's one-token forward took 10.9 ms against 39.9 on dense fp32 (docs/fast-path.md)
AUTO = True

# Whether ``--dtype auto --quant auto`` runs a GGUF model on its own blocks (fp32, ``--quant gguf``)
# on CPUs with native bf16 too (``backbone.load.auto_precision`` decides): yes. Plain decoding of
# the default Q4_1 GGUF, 28 held-out prompts, 128 tokens (``benchmarks/e2e/paths.py``): AMX Xeon
# 165 against bf16's 65 tok/s (2026-12-06, f6ef803), AMD EPYC Zen 4 132 against 50 (2026-12-06,
# 9b9f9e6); every speculative method measured was faster in tok/s on the blocks too, and both
# paths are as near the file as llama.cpp is (``benchmarks/analysis/quant_quality.py``).
GGUF_FIRST = True


def describe() -> str:
    """What ``--quant gguf`` computes, for ``quant_reason``."""
    if gguf_int8():
        return ("the GGUF file's own blocks, activations rounded to 8 bits per block of 32 as llama.cpp does "
                "(gemm_qi.cpp; CADENCE_GGUF_INT8=0: fp32 activations)")
    return "fp32 on the GGUF file's own blocks (the file's weights exactly; CADENCE_GGUF_INT8=0)"
BLOCK_TYPES = {F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}  # read as blocks by ``q_linear``
NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def head_rows(rows: int, heads: int) -> torch.Tensor:
    """The GGUF row each transformers row of q or k comes from (transformers'
    ``_reverse_permute_weights``): the file keeps each head's rows as (dim, 2) pairs, the
    model as (2, dim) halves. rows (heads * 2 * dim) -> index (rows,). Example: heads 1,
    rows 8 (dim 4): model rows 0..7 <- file rows [0, 2, 4, 6, 1, 3, 5, 7]."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(-1)


@dataclass
class Choice:
    """How one fast-path matrix runs: on the file's blocks (``qtype`` a ``BLOCK_TYPES`` key)
    or on fp32 weights (``qtype`` F32), and why."""
    name: str  # e.g. "blk.3.attn_q+attn_k+attn_v"
    qtype: int
    reason: str = ""

    def describe(self) -> str:
        what = BLOCK_TYPES.get(self.qtype, "F32")
        return f"{self.name}: {what}" + (f" ({self.reason})" if self.reason else "")


@dataclass
class Report:
    """Per matrix, what runs (``Choice``); ``summary`` counts them by format."""
    path: str
    choices: list[Choice] = field(default_factory=list)

    def summary(self) -> dict:
        out: dict[str, int] = {}
        for c in self.choices:
            key = BLOCK_TYPES.get(c.qtype, "F32 (fallback)")
            out[key] = out.get(key, 0) + 1
        return out

    def fallbacks(self) -> list[str]:
        return [c.describe() for c in self.choices if c.qtype not in BLOCK_TYPES]


class GGUFWeights:
    """The tensors of one GGUF file, by name, as raw bytes (the file is memory-mapped by the
    ``gguf`` reader; a matrix used is copied out once)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self._tensors = {t.name: t for t in GGUFReader(self.path).tensors}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def qtype(self, name: str) -> int:
        return int(self._tensors[name].tensor_type)

    def type_name(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def rows(self, name: str) -> torch.Tensor:
        """The tensor's bytes as (rows, row bytes) uint8, a copy (F32 / F16 rows as their bytes)."""
        data = np.ascontiguousarray(self._tensors[name].data)
        return torch.from_numpy(data.view(np.uint8).reshape(data.shape[0], -1).copy())


def layer_types(path: str | Path) -> set[str]:
    """The formats of the decoder layers' matrices in the file at ``path`` (e.g. {"Q4_1"})."""
    return {t.tensor_type.name for t in GGUFReader(str(path)).tensors
            if t.name.startswith("blk.") and len(t.shape) == 2}


def layer_tensor(layer: int, module: str) -> str:
    """``blk.3.attn_q.weight`` for (3, ``q_proj``)."""
    return f"blk.{layer}.{NAMES[module]}.weight"


def matched_blocks(ops, file: GGUFWeights, name: str, dense: torch.Tensor, heads: tuple[int, ...]):
    """The blocks of tensor ``name`` in the model's row order, checked against ``dense``
    (out, in) fp32: (blocks (out, row bytes) uint8, None), or (None, why not). Row orders
    tried: the file's, then ``head_rows`` for each head count in ``heads``."""
    if name not in file:
        return None, "not in the file"
    qtype = file.qtype(name)
    if qtype not in BLOCK_TYPES:
        return None, f"{file.type_name(name)} is not read as blocks"
    rows = file.rows(name)
    out, k = dense.shape
    if rows.shape[0] != out or ops.q_row_bytes(qtype, k) != rows.shape[1]:
        return None, f"shape {tuple(rows.shape)} does not fit ({out}, {k})"
    orders = [None] + [head_rows(out, h) for h in heads if h and out % (2 * h) == 0]
    for order in orders:
        cand = rows if order is None else rows[order].contiguous()
        if torch.equal(ops.q_dequantize(cand, qtype, k), dense):
            return cand, None
    return None, "dequantized blocks differ from the model's weights in every row order tried"


def build(ops, file: GGUFWeights, label: str, parts: list[tuple[str | None, torch.Tensor]],
          heads: tuple[int, ...], bias: torch.Tensor | None):
    """One fast-path matrix from its parts: ``parts`` = (GGUF tensor name or None, the model's
    weight (out_i, in) fp32) stacked in order. -> (``kernels.Linear`` of kind ``gguf``,
    ``Choice``). All parts in blocks of one type: their blocks, stacked; otherwise the stacked
    fp32 weights (type F32) through the same kernel."""
    k = parts[0][1].shape[1]
    blocks, qtypes, why = [], set(), ""
    for name, dense in parts:
        got, reason = (None, "no tensor") if name is None else matched_blocks(ops, file, name, dense, heads)
        if got is None:
            why = f"{name}: {reason}"
            break
        blocks.append(got)
        qtypes.add(file.qtype(name))
    if not why and len(qtypes) > 1:
        why = "parts in different formats (" + ", ".join(file.type_name(n) for n, _ in parts) + ")"
    if not why and k % 32:
        why = f"input size {k} is not a multiple of 32"
    if why:
        dense = torch.cat([d for _, d in parts]).float().contiguous()
        if k % 32:
            return None, Choice(label, F32, why + "; runs on the dense kernel")
        return Linear.from_blocks(dense.view(torch.uint8), F32, k, bias), Choice(label, F32, why)
    qtype = qtypes.pop()
    return Linear.from_blocks(torch.cat(blocks), qtype, k, bias), Choice(label, qtype)
