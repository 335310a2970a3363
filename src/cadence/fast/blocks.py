"""``--quant q8_0 | q4_1 | q4_0``: a model that is not a GGUF file, quantized at load into
GGUF blocks and run on the same integer kernel as a GGUF file's own blocks (``fast.gguf``).

Why: on a CPU without native bf16 a model from safetensors otherwise runs dense fp32, whose
one-token forward streams 4 bytes a weight (the default model's blocks took 7-11 ms a forward
where dense fp32 took 34-40, docs/fast-path.md). Quantizing at load gives such a model what a
GGUF download of it would give: the weights rounded once to the chosen block type (the LM head
to Q8_0, as GGUF files keep their output / embedding matrix at 8 bits or more), the activations
rounded to 8 bits per block of 32 inside the kernel. Lossy against the unquantized model, like
that GGUF file (``benchmarks/analysis/quant_quality.py --quants q8_0 q4_1``); speculation stays
identical to plain decoding of the quantized model (the kernel's rows do not depend on the
other rows).

Knows: the block types, and how to round fp32 weights into them (the ``gguf`` package's
``quants.quantize``, the same code that writes GGUF files). Does not know files, models or the
kernel's layout (``kernels.Linear.from_blocks`` repacks).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from cadence.fast.gguf import F32, Q4_0, Q4_1, Q8_0, Choice
from cadence.fast.kernels import Linear

SELF_QUANTS = {"q8_0": Q8_0, "q4_1": Q4_1, "q4_0": Q4_0}  # --quant value -> GGML block type
HEAD_QTYPE = Q8_0  # the LM head's blocks whatever --quant says (8 bits, as GGUF files keep it)


def quantize_rows(dense: torch.Tensor, qtype: int) -> torch.Tensor:
    """(out, in) fp32 -> (out, row bytes) uint8: each row as GGUF blocks of ``qtype``, exactly
    the bytes a GGUF writer stores. Example: (3072, 576) in Q8_0 -> (3072, 612): 18 blocks of
    32 weights, each 2 bytes of fp16 scale + 32 int8."""
    data = quants.quantize(dense.detach().float().contiguous().numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(data))


class Quantizer:
    """Stands in for a GGUF file while ``FastBackbone`` builds: every matrix quantized at load."""

    def __init__(self, quant: str):
        self.quant = quant
        self.qtype = SELF_QUANTS[quant]
        self.path = f"quantized at load ({quant.upper()}; LM head Q8_0)"  # ``gguf.Report.path``

    def build(self, label: str, parts: list[torch.Tensor], bias: torch.Tensor | None,
              head: bool = False) -> tuple[Linear | None, Choice]:
        """One matrix from its stacked parts (out_i, in) fp32 -> (``Linear`` of kind ``gguf``,
        ``Choice``); (None, why) where the input size is not a multiple of 32 (dense kernel)."""
        dense = torch.cat(parts).float().contiguous()
        k = dense.shape[1]
        if k % 32:
            return None, Choice(label, F32, f"input size {k} is not a multiple of 32; runs on the dense kernel")
        qtype = HEAD_QTYPE if head else self.qtype
        lin = Linear.from_blocks(quantize_rows(dense, qtype), qtype, k, bias)
        return lin, Choice(label, qtype, "quantized at load")
