"""Weight-only int8 (``--quant int8``): the kernel, the fast decoder on it, and refusals.

int8 is lossy against the unquantized model; what must hold is that speculation over the
int8 model gives that model's own plain greedy tokens, and that a row's output does not
depend on the other rows of its forward (the bf16 row consistency of ``fast.consistent``).
"""

from __future__ import annotations

import pytest
import torch
from test_fast_model import pair, reference_greedy, tree_greedy

from cadence.errors import CadenceError
from cadence.fast.kernels import Linear, quantize_int8
from cadence.fast.model import FastBackbone, check_quant


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    q, s = quantize_int8(torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]]))
    assert q.dtype == torch.int8 and q[0].tolist() == [64, -127, 32] and q[1].tolist() == [0, 0, 0]
    w = torch.randn(64, 32)
    q, s = quantize_int8(w)
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_the_dequantized_product_and_row_consistent(dtype):
    torch.manual_seed(0)
    w, b = torch.randn(96, 48).to(dtype), torch.randn(96).to(dtype)
    lin = Linear(w, b, "int8")
    x = torch.randn(9, 48).to(dtype)
    want = x.float() @ lin.to_dense().float().T + b.float()
    assert torch.allclose(lin(x).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    full = lin(x)
    for m in (1, 2, 3, 4, 5):
        assert torch.equal(lin(x[2:2 + m]), full[2:2 + m]), m
    assert lin.nbytes() == 96 * 48 + 96 * 2 * w.element_size()  # int8 weights + scales + bias


def test_int8_backbone_speculates_to_its_own_greedy_tokens():
    """Close to the unquantized model, and greedy tree decoding with compaction (accepted
    paths like [0, 2, 3]) reproduces the int8 model's plain greedy tokens."""
    ref, _ = pair("llama", seed=3)
    copy = type(ref.model)(ref.model.config).float()
    copy.load_state_dict(ref.model.state_dict())
    q8 = FastBackbone(copy, ref.tokenizer, "q8", quant="int8")
    prompt = list(range(40, 52))
    ids = torch.tensor([prompt])
    a, b = ref.forward(ids).logits, q8.forward(ids).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
    expected = reference_greedy(q8, prompt, 24)
    got, steps = tree_greedy(q8, prompt, 24, expected)
    assert got == expected and steps < 20


def test_quant_settings_are_refused_clearly(tmp_path):
    from test_training_support import tiny_model_dir

    from cadence.backbone import load_backbone

    with pytest.raises(CadenceError, match="unknown --quant"):
        check_quant("int4", torch.device("cpu"), torch.float32)
    with pytest.raises(CadenceError, match="CPU only"):
        check_quant("int8", torch.device("cuda"), torch.bfloat16)
    model = tiny_model_dir(tmp_path)
    with pytest.raises(CadenceError, match="needs the fast backend"):
        load_backbone(str(model), "float32", "cpu", backend="transformers", quant="int8")
    bb = load_backbone(str(model), "float32", "cpu", quant="int8")
    assert isinstance(bb, FastBackbone) and bb.quant == "int8"
