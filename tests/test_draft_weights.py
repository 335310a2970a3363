"""Drafting weights in GGUF blocks (``MethodSpec.draft_weights``, ``--draft-weights q8_0|q4_1|q4_0``).

The drafter's kernels (attention blocks' projections, eagle's ``fc``, the MLP heads' layers, the
draft-vocabulary LM head) may hold their weights as Q8_0, Q4_1 or Q4_0 blocks on the integer
kernel (fp32 heads: Q4_1 by default); the heads keep their own
dtype and verification is unchanged, so output must stay plain decoding's."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_backbone

from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.fast import native
from cadence.fast.kernels import Linear, draft_linear
from cadence.fast.model import FastBackbone
from cadence.heads.base import _PACKED
from cadence.methods import Method, MethodSpec, make_engine

gguf = pytest.importorskip("gguf")
ops = native.module()
needs_kernel = pytest.mark.skipif(ops is None, reason="needs the native extension")
PROMPTS = ([5, 9, 11, 3, 7, 9, 11, 3], [40, 41, 42, 43, 40, 41], [7] * 12 + [100, 101, 7, 7])  # token ids


@needs_kernel
@pytest.mark.parametrize("fmt,tol", [("q8_0", 0.02), ("q4_1", 0.15), ("q4_0", 0.15)])
def test_block_kernels_take_bf16_rows_and_stay_close_to_the_dense_product(fmt, tol):
    """A bf16 caller gets bf16 rows: the fp32 kernel's result on the same values, rounded once;
    and the blocks' product is within their rounding of the dense one."""
    torch.manual_seed(0)
    w = torch.randn(96, 64) * 0.1
    lin = Linear.blocks(w, fmt)
    assert lin.kind == "gguf" and lin.block_format == fmt
    x = torch.randn(3, 64).bfloat16()
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 96)
    assert torch.equal(y, lin(x.float()).bfloat16())
    dense = x.float() @ w.T
    assert (y.float() - dense).abs().max() < tol * dense.abs().max()
    with pytest.raises(ValueError, match="draft weight format"):
        draft_linear(w, "q4")


def _bf16_backbone():
    plain = tiny_backbone("llama", hidden=128)
    plain.model.to(torch.bfloat16)
    return FastBackbone.from_backbone(plain)


@needs_kernel
def test_q8_0_drafting_changes_the_kernels_not_the_output():
    """``draft_weights=q8_0``: every drafting kernel of eagle heads (fc, the block's projections,
    the draft-vocabulary LM head) is a Q8_0 one; the output is plain decoding's; ``dense``
    rebuilds the original kinds."""
    bb = _bf16_backbone()
    cfg = GenerationConfig(max_new_tokens=24)
    ref = [Engine(bb).generate(p, cfg).tokens for p in PROMPTS]
    spec = MethodSpec(method=Method.EAGLE, heads="random", tree="tree-8", scheduler="static", copy=False,
                      draft_weights="q8_0")
    engine = make_engine(bb, spec)
    heads = engine.drafter.heads
    heads.set_draft_vocab(torch.arange(0, 200))
    heads.set_draft_format("q8_0")
    for p, r in zip(PROMPTS, ref):
        assert engine.generate(p, cfg).tokens == r
    block = heads.layers[0]
    assert {k.kind for k in block.decode_kernels().values()} == {"gguf"}
    assert heads._draft_kernel.kind == "gguf"
    heads.set_draft_format("dense")
    assert "gguf" not in {k.kind for k in block.decode_kernels().values()}
    assert heads._draft_kernel is None or heads._draft_kernel.kind != "gguf"
    with pytest.raises(CadenceError, match="draft weight format"):
        heads.set_draft_format("int3")


def test_the_method_grammar_carries_the_draft_weights():
    spec = MethodSpec.parse("eagle@eagle-taps,draft_weights=q8_0")
    assert spec.draft_weights == "q8_0"
    assert MethodSpec.parse(spec.format()).draft_weights == "q8_0"
    assert MethodSpec.parse("eagle").draft_weights == "auto"
    assert MethodSpec.parse("eagle,draft_weights=dense").format() == "eagle,draft_weights=dense"


@needs_kernel
def test_block_formats_apply_where_they_run_and_fall_back_to_dense_elsewhere(monkeypatch):
    """Block formats need whole blocks (in % 32 == 0): other widths keep the dense kernel. ``auto``
    (``MethodSpec``'s default) is q4_1 for fp32 weights (fewer bytes to read per draft, the same
    acceptance), dense for bf16 ones on AMX (it beats the integer kernel past about 4 rows) and
    q8_0 for bf16 ones elsewhere; unmarked heads draft dense."""
    import cadence.fast.kernels as kernels

    w = torch.randn(64, 64)
    for fmt in ("q8_0", "q4_1", "q4_0"):
        assert draft_linear(w, fmt).block_format == fmt
        assert draft_linear(torch.randn(64, 48), fmt).kind != "gguf"
    assert draft_linear(w, "q4_1").nbytes() < 0.6 * draft_linear(w, "q8_0").nbytes()
    assert draft_linear(w).kind != "gguf"
    assert draft_linear(w, "auto").block_format == "q4_1"
    assert draft_linear(torch.randn(64, 48), "auto").kind != "gguf"
    monkeypatch.setattr(kernels, "has_amx", lambda: True)
    assert draft_linear(w.to(torch.bfloat16), "auto").kind != "gguf"
    monkeypatch.setattr(kernels, "has_amx", lambda: False)
    assert draft_linear(w.to(torch.bfloat16), "auto").block_format == "q8_0"
    assert draft_linear(torch.randn(64, 48).to(torch.bfloat16), "auto").kind != "gguf"


@needs_kernel
def test_methods_draft_fp32_heads_in_q4_1_by_default():
    """An engine from a default ``MethodSpec`` on an fp32 backbone drafts through Q4_1 kernels
    (``draft_weights=auto``), and its output is still plain decoding's."""
    bb = FastBackbone.from_backbone(tiny_backbone("llama", hidden=128))
    cfg = GenerationConfig(max_new_tokens=16)
    ref = [Engine(bb).generate(p, cfg).tokens for p in PROMPTS]
    engine = make_engine(bb, MethodSpec(method=Method.EAGLE, heads="random", tree="tree-8", scheduler="static"))
    for p, r in zip(PROMPTS, ref):
        assert engine.generate(p, cfg).tokens == r
    kernels = engine.drafter.heads.layers[0].decode_kernels().values()
    assert {(k.kind, k.block_format) for k in kernels} == {("gguf", "q4_1")}


@needs_kernel
@pytest.mark.parametrize("method", [Method.HYDRA, Method.MEDUSA, Method.MTP])
def test_mlp_heads_draft_through_q4_1_blocks_and_keep_the_output(method):
    """fp32 MLP heads (hydra's input projections, the ResBlocks of hydra and medusa, mtp's blocks)
    draft through Q4_1 kernels by default (``draft_weights=auto``) and the output is still plain
    decoding's."""
    bb = FastBackbone.from_backbone(tiny_backbone("llama", hidden=128))
    cfg = GenerationConfig(max_new_tokens=16)
    ref = [Engine(bb).generate(p, cfg).tokens for p in PROMPTS]
    engine = make_engine(bb, MethodSpec(method=method, heads="random", tree="tree-8", scheduler="static"))
    heads = engine.drafter.heads
    for p, r in zip(PROMPTS, ref):
        assert engine.generate(p, cfg).tokens == r
    if method == Method.MTP:
        linears = [lin for m in heads.modules_ for lin in (m.proj, m.gate, m.up, m.down)]
    else:
        linears = [b.linear for b in heads.blocks] + (list(heads.proj) if method == Method.HYDRA else [])
    assert {(_PACKED[lin][1]["w"].kind, _PACKED[lin][1]["w"].block_format) for lin in linears} == {("gguf", "q4_1")}


@needs_kernel
def test_a_resblock_drafts_in_blocks_trains_exactly_and_follows_its_mark():
    """Marked ``auto`` (fp32), a ResBlock without autograd is the Q4_1 product (close to, not
    equal to, the module's); with autograd (training) it is the module's, whatever the mark;
    marked ``dense`` it is the module's again."""
    bb = FastBackbone.from_backbone(tiny_backbone("llama", hidden=128))
    heads = make_engine(bb, MethodSpec(method=Method.HYDRA, heads="random")).drafter.heads
    block = heads.blocks[0]
    x = torch.randn(2, 128)
    with torch.no_grad():
        drafted = block(x)
        exact = x + torch.nn.functional.silu(block.linear(x))
    assert not torch.equal(drafted, exact) and (drafted - exact).abs().max() < 0.05 * exact.abs().max()
    with torch.enable_grad():
        assert torch.equal(block(x), exact)
    heads.set_draft_format("dense")
    with torch.no_grad():
        assert torch.equal(block(x), exact)
