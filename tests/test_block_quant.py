"""``--quant q8_0 | q4_1 | q4_0``: a model that is not a GGUF quantized at load into GGUF blocks
(``fast.blocks``) and run on the GGUF integer kernel.

What must hold: every projection runs on the blocks of the asked type and the LM head on Q8_0;
the weights are the blocks' dequantized values, within the type's rounding of the model's own;
a tree node gets its one-token forward's bits, so speculation is identical to plain decoding of
the quantized model; and what cannot run is refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch

from cadence.errors import CadenceError
from cadence.fast import native

needs_native = pytest.mark.skipif(native.module() is None, reason="the C++ extension could not be built here")


@needs_native
@pytest.mark.parametrize("quant, qtype, step", [("q8_0", 8, 1 / 127), ("q4_1", 3, 1 / 15), ("q4_0", 2, 1 / 8)])
def test_a_dense_model_quantized_at_load_runs_on_blocks_and_speculates_to_its_own_tokens(quant, qtype, step):
    from test_fast_model import assert_tree_rows_are_one_token_forwards, reference_greedy, tree_greedy
    from tiny import tiny_backbone

    from cadence.fast.model import FastBackbone

    plain = tiny_backbone("llama")
    weight = plain.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    bb = FastBackbone.from_backbone(plain, quant=quant)
    assert bb.quant == quant and bb.layer_kind == "gguf" and bb.consistent and bb.listed
    assert bb.kernels.startswith("gguf-") and bb.kv_dtype == torch.float16  # auto: float16, as on a GGUF's blocks
    kinds = {c.name: c.qtype for c in bb.gguf_report.choices}
    assert kinds["output"] == 8 and all(q == qtype for name, q in kinds.items() if name != "output")
    assert bb._head.kind == "gguf" and all(getattr(layer, n).kind == "gguf" for layer in bb._layers
                                           for n in ("qkv", "o", "gate_up", "down"))
    # the weights are the blocks' values: each within the type's rounding step of the model's own
    q = bb._layers[0].qkv.to_dense()[:weight.shape[0]]
    per_block = weight.abs().view(weight.shape[0], -1, 32).amax(-1, keepdim=True)
    assert ((q - weight).abs().view_as(per_block.expand(-1, -1, 32)) <= per_block * step + 1e-6).all()
    assert not torch.equal(q, weight)
    prompt = list(range(40, 60))
    assert_tree_rows_are_one_token_forwards(bb, prompt)
    expected = reference_greedy(bb, prompt, 24)
    got, steps = tree_greedy(bb, prompt, 24, expected)
    assert got == expected and steps < 24


@needs_native
def test_quantizing_at_load_needs_float32_on_cpu_and_auto_takes_float32(tmp_path):
    from tiny import save_tiny, tiny_backbone

    from cadence.backbone.load import load_backbone
    from cadence.fast.model import FastBackbone

    plain = tiny_backbone("llama")
    plain.model.to(torch.bfloat16)
    with pytest.raises(CadenceError, match="--quant q4_1 computes in float32"):
        FastBackbone.from_backbone(plain, quant="q4_1")
    save_tiny(tmp_path / "m", "llama")
    bb = load_backbone(str(tmp_path / "m"), "auto", "cpu", quant="q8_0")
    assert bb.dtype == torch.float32 and bb.quant == "q8_0"
    with pytest.raises(CadenceError, match="--quant q8_0 needs the fast backend"):
        load_backbone(str(tmp_path / "m"), "float32", "cpu", backend="transformers", quant="q8_0")
