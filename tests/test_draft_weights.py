"""Drafting weights in GGUF Q8_0 blocks (``MethodSpec.draft_weights``, ``--draft-weights q8_0``).

The drafter's kernels (attention blocks' projections, eagle's ``fc``, the MLP heads' layers, the
draft-vocabulary LM head) may hold their weights as Q8_0 blocks on the integer kernel; the heads keep their own
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
def test_q8_0_kernel_takes_bf16_rows_and_stays_close_to_the_dense_product():
    """A bf16 caller gets bf16 rows: the fp32 kernel's result on the same values, rounded once;
    and the Q8_0 product is within Q8_0's rounding of the dense one."""
    torch.manual_seed(0)
    w = torch.randn(96, 64) * 0.1
    lin = Linear.q8_0(w)
    assert lin.kind == "gguf"
    x = torch.randn(3, 64).bfloat16()
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 96)
    assert torch.equal(y, lin(x.float()).bfloat16())
    dense = x.float() @ w.T
    assert (y.float() - dense).abs().max() < 0.02 * dense.abs().max()
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
def test_q8_0_applies_where_it_runs_and_falls_back_to_dense_elsewhere():
    """``q8_0`` needs whole blocks (in % 32 == 0): other widths keep the dense kernel. ``auto``
    (``MethodSpec``'s default) is q8_0 for fp32 weights (faster at every row count) and dense
    for bf16 ones (AMX beats the integer kernel past about 4 rows); unmarked heads draft dense."""
    w = torch.randn(64, 64)
    assert draft_linear(w, "q8_0").kind == "gguf"
    assert draft_linear(torch.randn(64, 48), "q8_0").kind != "gguf"
    assert draft_linear(w).kind != "gguf"
    assert draft_linear(w, "auto").kind == "gguf"
    assert draft_linear(torch.randn(64, 48), "auto").kind != "gguf"
    assert draft_linear(w.to(torch.bfloat16), "auto").kind != "gguf"


@needs_kernel
def test_methods_draft_fp32_heads_in_q8_0_by_default():
    """An engine from a default ``MethodSpec`` on an fp32 backbone drafts through Q8_0 kernels
    (``draft_weights=auto``), and its output is still plain decoding's."""
    bb = FastBackbone.from_backbone(tiny_backbone("llama", hidden=128))
    cfg = GenerationConfig(max_new_tokens=16)
    ref = [Engine(bb).generate(p, cfg).tokens for p in PROMPTS]
    engine = make_engine(bb, MethodSpec(method=Method.EAGLE, heads="random", tree="tree-8", scheduler="static"))
    for p, r in zip(PROMPTS, ref):
        assert engine.generate(p, cfg).tokens == r
    assert {k.kind for k in engine.drafter.heads.layers[0].decode_kernels().values()} == {"gguf"}


@needs_kernel
@pytest.mark.parametrize("method", [Method.HYDRA, Method.MEDUSA, Method.MTP])
def test_mlp_heads_draft_through_q8_0_blocks_and_keep_the_output(method):
    """fp32 MLP heads (hydra's input projections, the ResBlocks of hydra and medusa, mtp's blocks)
    draft through Q8_0 kernels by default (``draft_weights=auto``) and the output is still plain
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
    assert {_PACKED[lin][1]["w"].kind for lin in linears} == {"gguf"}


@needs_kernel
def test_a_resblock_drafts_in_q8_0_trains_exactly_and_follows_its_mark():
    """Marked ``auto`` (fp32), a ResBlock without autograd is the Q8_0 product (close to, not
    equal to, the module's); with autograd (training) it is the module's, whatever the mark;
    marked ``dense`` it is the module's again."""
    bb = FastBackbone.from_backbone(tiny_backbone("llama", hidden=128))
    heads = make_engine(bb, MethodSpec(method=Method.HYDRA, heads="random")).drafter.heads
    block = heads.blocks[0]
    x = torch.randn(2, 128)
    with torch.no_grad():
        drafted = block(x)
        exact = x + torch.nn.functional.silu(block.linear(x))
    assert not torch.equal(drafted, exact) and torch.allclose(drafted, exact, atol=0.05)
    with torch.enable_grad():
        assert torch.equal(block(x), exact)
    heads.set_draft_format("dense")
    with torch.no_grad():
        assert torch.equal(block(x), exact)
