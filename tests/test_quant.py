"""Weight-only int8 / int4 (``--quant int8|int4``): the kernels, the fast decoder on them, and refusals.

Both are lossy against the unquantized model; what must hold is that speculation over the
int8 model gives that model's own plain greedy tokens, and that a row's output does not
depend on the other rows of its forward (the bf16 row consistency of ``fast.consistent``).
"""

from __future__ import annotations

import pytest
import torch
from test_fast_model import pair, reference_greedy, tree_greedy

from cadence.errors import CadenceError
from cadence.fast import native
from cadence.fast.kernels import INT4_GROUP, Linear, dequantize_int4, int4_fits, quantize_int4, quantize_int8
from cadence.fast.model import FastBackbone
from cadence.fast.quant import check_quant


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    q, s = quantize_int8(torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]]))
    assert q.dtype == torch.int8 and q[0].tolist() == [64, -127, 32] and q[1].tolist() == [0, 0, 0]
    w = torch.randn(64, 32)
    q, s = quantize_int8(w)
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()


def test_quantize_int4_keeps_every_weight_within_half_a_step_of_its_group():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 2 * INT4_GROUP, generator=g)
    w[0, :INT4_GROUP] = torch.linspace(-0.3, 1.2, INT4_GROUP)  # the docstring's group: step 0.1
    packed, pairs = quantize_int4(w)
    assert packed.dtype == torch.uint8 and pairs.shape == (2, 32, 2)
    assert torch.allclose(pairs[0, 0], torch.tensor([0.1, -0.3 + 0.8]), atol=1e-6)
    step = pairs[..., 0].T.repeat_interleave(INT4_GROUP, dim=1)  # (out, in): each weight's group step
    deq = dequantize_int4(packed, pairs, 32, 2 * INT4_GROUP)
    assert ((deq - w).abs() <= step / 2 + 1e-5).all()
    assert int4_fits(w) and not int4_fits(torch.zeros(100, 64)) and not int4_fits(torch.zeros(32, 48))


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_linear_is_the_dequantized_product_and_row_consistent(kind, dtype):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
    lin = Linear(w, b, kind)
    assert lin.kind == kind
    x = torch.randn(9, 64).to(dtype)
    want = x.float() @ lin.to_dense().float().T + b.float()
    assert torch.allclose(lin(x).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    full = lin(x)
    for m in (1, 2, 3, 4, 5):
        assert torch.equal(lin(x[2:2 + m]), full[2:2 + m]), m
    if kind == "int8":
        assert lin.nbytes() == 96 * 64 + 96 * 2 * w.element_size()  # int8 weights + scales + bias
    else:
        assert lin.nbytes() < 96 * 64  # under a byte per weight (half a byte + group scales + bias)
        odd = Linear(torch.randn(100, 64).to(dtype), None, "int4")  # out not a multiple of 16: int8
        assert odd.kind == "int8" and odd(x).shape == (9, 100)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_backbone_speculates_to_its_own_greedy_tokens(quant):
    """Close to the unquantized model, and greedy tree decoding with compaction (accepted
    paths like [0, 2, 3]) reproduces the quantized model's plain greedy tokens."""
    ref, _ = pair("llama", seed=3)
    copy = type(ref.model)(ref.model.config).float()
    copy.load_state_dict(ref.model.state_dict())
    q = FastBackbone(copy, ref.tokenizer, "q", quant=quant)
    prompt = list(range(40, 52))
    ids = torch.tensor([prompt])
    a, b = ref.forward(ids).logits, q.forward(ids).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > (0.99 if quant == "int8" else 0.8)  # 4-bit random weights: ~9% error per matrix
    expected = reference_greedy(q, prompt, 24)
    got, steps = tree_greedy(q, prompt, 24, expected)
    assert got == expected and steps < 20


def test_quant_settings_are_refused_clearly(tmp_path):
    from test_training_support import tiny_model_dir

    from cadence.backbone.load import load_backbone

    with pytest.raises(CadenceError, match="unknown --quant"):
        check_quant("int2", torch.device("cpu"), torch.float32)
    for quant in ("int8", "int4"):
        with pytest.raises(CadenceError, match="CPU only"):
            check_quant(quant, torch.device("cuda"), torch.bfloat16)
    model = tiny_model_dir(tmp_path)
    with pytest.raises(CadenceError, match="needs the fast backend"):
        load_backbone(str(model), "float32", "cpu", backend="transformers", quant="int8")
    bb = load_backbone(str(model), "float32", "cpu", quant="int8")
    assert isinstance(bb, FastBackbone) and bb.quant == "int8"


def test_int4_leaves_the_head_unquantized_and_latency_curves_are_per_kernels(monkeypatch):
    """The LM head stays in the model's dtype under int4 (4-bit GGUF files keep it at 8 bits
    or more), and a verify-latency curve measured with other kernels is not reused."""
    from cadence.costs.latency import machine_key

    ref, _ = pair("llama", seed=3)
    keys = {}
    for quant in ("none", "int8", "int4"):
        copy = type(ref.model)(ref.model.config).float()
        copy.load_state_dict(ref.model.state_dict())
        bb = FastBackbone(copy, ref.tokenizer, "q", quant=quant)
        keys[quant] = (machine_key(bb), bb.kernels)
        if quant == "int4":
            assert bb._head.kind not in ("int4", "int8")
            assert all(layer.gate_up.kind == "int4" for layer in bb._layers)  # (256, 64): fits the kernel
    assert len({k for k, _ in keys.values()}) == 3
    loop = "cpp" if native.module() is not None else "python"
    assert keys["int8"][1] == f"int8/int8/{loop}" and keys["int4"][1].startswith("int4/")
    from cadence.system.machine import onednn_available
    if onednn_available():  # same dtype and quant, other kernels: another curve
        dense = FastBackbone(type(ref.model)(ref.model.config).float(), ref.tokenizer, "q", kernel="aten")
        assert dense.kernels == f"aten/aten/{loop}" != keys["none"][1]
        assert machine_key(dense) != keys["none"][0]
    if native.module() is not None:  # the Python loop (CADENCE_NATIVE=0) runs at another speed: another curve
        monkeypatch.setenv("CADENCE_NATIVE", "0")
        copy = type(ref.model)(ref.model.config).float()
        copy.load_state_dict(ref.model.state_dict())
        slow = FastBackbone(copy, ref.tokenizer, "q")
        assert slow.kernels.endswith("/python") and machine_key(slow) != keys["none"][0]


def test_a_latency_curve_is_not_reused_after_the_native_kernels_change(monkeypatch):
    """The curve's key names the native build (its sources), not only the kernels' kind: a
    cadence upgrade that makes multi-row forwards faster measures the curve again."""
    from cadence.costs.latency import machine_key

    if native.module() is None:
        pytest.skip("no native extension here")
    ref, _ = pair("llama", seed=3)
    bb = FastBackbone(ref.model, ref.tokenizer, "q")
    before = machine_key(bb)
    assert bb.native_build == native.build_id() != ""
    monkeypatch.setattr(native, "build_id", lambda: "another-build")
    assert bb.native_build == "another-build" and machine_key(bb) != before
