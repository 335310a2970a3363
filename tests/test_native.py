"""The C++ layer loop (``cadence.fast.native``) gives the Python loop's bits.

Every forward the fast decoder sends through C++ (prefill, one-token steps, chains in
row-consistent bf16 with padded queries and blocked GEMMs, cache-free padded batches) is run
both ways on the same weights and cache contents, for each model family, in fp32 and bf16,
over each projection kernel; outputs and written cache entries must be equal bit for bit.
Skipped where the extension cannot be built (no C++ compiler): the Python loop then runs.
"""

from __future__ import annotations

import pytest
import torch
from test_fast_model import FAMILIES, tree_mask
from tiny import byte_tokenizer

from cadence.fast import native
from cadence.system.machine import onednn_available
from cadence.fast.model import FastBackbone

needs_native = pytest.mark.skipif(native.module() is None, reason="the C++ extension could not be built here")
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="oneDNN not in this torch")


def _model(family: str, dtype: torch.dtype, seed: int = 0, **config):
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    for k, v in config.items():
        setattr(model.config, k, v)
    return model.to(dtype)


def _run(bb: FastBackbone, use_native: bool, chain_rows: int = 40) -> list[torch.Tensor]:
    """Logits, hidden states and cache entries of a fixed sequence of forwards."""
    bb._resolve_native()  # the Python loop keeps the fused kernels (``FastBackbone._norm``, ``_rope``)
    loop = bb.__dict__.setdefault("_built_loop", bb._native)
    bb._native = loop if use_native else False
    g = torch.Generator().manual_seed(3)
    vocab = bb.vocab_size
    cache = bb.new_cache()
    outs = [bb.forward(torch.randint(0, vocab, (1, 70), generator=g), cache).logits]  # prefill
    for n in (1, 2, 3, 5, chain_rows):  # decode steps and chains (consistent bf16: pads, blocks)
        out = bb.forward(torch.randint(0, vocab, (1, n), generator=g), cache)
        outs += [out.logits, out.hidden]
    past = cache.length()
    mask = tree_mask([-1, 0, 1, 2])  # a chain as a tree mask with explicit positions
    pos = torch.arange(4)[None] + past
    outs.append(bb.forward(torch.randint(0, vocab, (1, 4), generator=g), cache, pos, mask).logits)
    past = cache.length()
    branching = tree_mask([-1, 0, 0, 1, 2])  # consistent bf16: one attention call per path (Python callback)
    pos = torch.tensor([[0, 1, 1, 2, 2]]) + past
    outs.append(bb.forward(torch.randint(0, vocab, (1, 5), generator=g), cache, pos, branching).logits)
    cache.compact(past, [0, 2, 4])
    outs += [cache.k[:, :, :, :cache.length()].clone(), cache.v[:, :, :, :cache.length()].clone()]
    outs += _rows(bb, g)
    batch = torch.randint(0, vocab, (3, 9), generator=g)
    pad = torch.ones(3, 9, dtype=torch.long)
    pad[1, 6:] = 0  # right padding (causal)
    pad[2, :2] = 0  # left padding (a mask)
    outs.append(bb.forward(batch).logits)
    outs.append(bb.hidden_states(batch, None, None, None, pad))
    return outs


def _rows(bb: FastBackbone, g: torch.Generator) -> list[torch.Tensor]:
    """The batch engine's ragged forward (``forward_rows``), prefill and a padded tree step."""
    from cadence.batch.layout import pack
    from cadence.trees.tree import compile_tree

    pasts = [21, 9]
    trees = [compile_tree([(0,), (0, 0)]), compile_tree([(0,), (1,), (0, 0)])]
    cache = bb.new_batch_cache(2)
    for slot, p in enumerate(pasts):
        bb.forward_rows(torch.randint(0, bb.vocab_size, (1, p), generator=g), cache, slot, [0], need_logits=False)
    toks = [torch.randint(0, bb.vocab_size, (t.size,), generator=g) for t in trees]
    p = pack(pasts, trees, toks, bb.device)
    logits = bb.forward_rows(p.tokens, cache, 0, p.starts, p.positions, p.mask).logits
    return [logits[r, :t.size] for r, t in enumerate(trees)] + [cache.k[:, :, :, :max(cache.lengths)].clone()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"output {i} differs by {(x.float() - y.float()).abs().max().item()}"


@needs_native
@pytest.mark.parametrize("family", ["llama", "llama-bias", "qwen2", "qwen3", "llama-tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["auto", "aten"])
def test_native_loop_gives_the_python_loops_bits(family, dtype, kernel):
    if dtype == torch.bfloat16 and kernel == "auto" and not onednn_available():
        pytest.skip("bf16 oneDNN")
    bb = FastBackbone(_model(family, dtype), byte_tokenizer(), "fast", kernel=kernel)
    _same(_run(bb, False), _run(bb, True))


@needs_native
@needs_onednn
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_native_loop_over_quantized_projections_gives_the_python_loops_bits(quant):
    """int8/int4 forwards of 1-3 rows are not padded up front: the C++ loop pads the
    attention queries itself, as ``consistent.attend`` does."""
    from tiny import tiny_backbone

    plain = tiny_backbone("llama", hidden=256, layers=2)
    plain.model.to(torch.bfloat16)
    bb = FastBackbone.from_backbone(plain, quant=quant)
    assert not bb.pad_up_front
    _same(_run(bb, False), _run(bb, True))


@needs_native
def test_phase_clock_sums_each_phase_only_while_on_and_changes_no_bits():
    """``Layers.phase_times`` (``benchmarks/kernels/phase_cost.py``): nothing summed while off; while
    on, every one of the 9 phases gets time and the phases add up to at most the forward's
    wall time; a forward with the clock on gives the same bits as with it off."""
    import time

    bb = FastBackbone(_model("llama", torch.bfloat16), byte_tokenizer(), "fast")
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = bb.forward(ids, bb.new_cache()).logits
    layers = bb._native
    assert layers not in (None, False)
    assert all(t == 0.0 for _, t in layers.phase_times(True))  # off until now
    t = time.perf_counter()
    timed = bb.forward(ids, bb.new_cache()).logits
    wall = time.perf_counter() - t
    phases = dict(layers.phase_times(False))
    assert list(phases) == ["qkv", "rope", "attention", "o", "add_norm_1", "gate_up", "swiglu", "down", "add_norm_2"]
    assert all(v > 0 for v in phases.values()) and sum(phases.values()) <= wall
    bb.forward(ids, bb.new_cache())
    assert all(t == 0.0 for _, t in layers.phase_times(False))  # off again: nothing summed
    assert torch.equal(plain, timed)


@needs_native
def test_native_loop_is_used_and_can_be_turned_off(monkeypatch):
    """On by default where it builds; ``CADENCE_NATIVE=0`` keeps the Python loop; a branching
    tree (``PathAttention``) stays in Python either way and keeps working after it."""
    bb = FastBackbone(_model("llama", torch.bfloat16), byte_tokenizer(), "fast")
    cache = bb.new_cache()
    bb.forward(torch.randint(0, 200, (1, 20)), cache)
    assert bb._native not in (None, False)
    if bb.consistent:
        mask = tree_mask([-1, 0, 0, 1])
        out = bb.forward(torch.randint(0, 200, (1, 4)), cache, torch.tensor([[20, 21, 21, 22]]), mask)
        assert torch.isfinite(out.logits).all()
    monkeypatch.setenv("CADENCE_NATIVE", "0")
    off = FastBackbone(_model("llama", torch.float32), byte_tokenizer(), "fast")
    off.forward(torch.randint(0, 200, (1, 5)), off.new_cache())
    assert off._native is False


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_and_rope_match_the_aten_form_and_keep_each_rows_bits(dtype):
    """RMSNorm: within one output rounding step of ``weight * rms_norm(x.float()).to(dtype)``
    (another summation order); RoPE: the ATen form's bits. Both give a row the same bits
    alone and among 37 others, and take non-contiguous qkv slices."""
    from cadence.fast import rope
    from cadence.fast.model import _rms

    ops = native.module()
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 19, 576, generator=g) * 3).to(dtype)
    w = (torch.randn(576, generator=g) * 0.5 + 1).to(dtype)
    got, ref = ops.rms_norm(x, w, 1e-5), _rms(x, w, 1e-5)
    step = 1e-6 if dtype == torch.float32 else 2 ** -7  # relative: one fp32 / bf16 rounding step
    assert ((got.float() - ref.float()).abs() <= step * ref.float().abs() + 1e-6).all()
    assert torch.equal(ops.rms_norm(x[1:2, 5:6], w, 1e-5), got[1:2, 5:6])
    qkv = torch.randn(2, 19, 15 * 64, generator=g).to(dtype)
    q = qkv[..., :12 * 64].view(2, 19, 12, 64)  # a slice: rows 960 apart
    cos = torch.randn(2, 19, 1, 64, generator=g).to(dtype)
    sin = torch.randn(2, 19, 1, 64, generator=g).to(dtype)
    out = ops.rope(q, cos, sin)
    assert torch.equal(out, rope.apply(q, cos, sin))
    assert torch.equal(ops.rope(q[1:2, 3:4], cos[1:2, 3:4], sin[1:2, 3:4]), out[1:2, 3:4])


@needs_native
def test_fused_bf16_rounding_keeps_atens_bits_for_denormals_nan_and_infinity():
    """The fused kernels round to bf16 with the CPU's conversion where it has one, which
    flushes denormals and keeps NaN payloads; rows holding those must still get ATen's bits
    (denormals rounded; NaN stays NaN, as c10's 0x7FC0): RoPE products that land in the
    denormal range, NaN and infinite inputs, residual sums and norms of such rows."""
    from cadence.fast import rope

    ops = native.module()
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 3, 4, 64, generator=gen).to(bf)
    cos = torch.full((1, 3, 1, 64), 3e-39).to(bf)  # x * cos: denormal floats
    sin = torch.randn(1, 3, 1, 64, generator=gen).to(bf) * 1e-37
    q[0, 1, 2, 5], q[0, 2, 0, 7], q[0, 2, 1, 40] = float("nan"), float("inf"), -float("inf")
    got, ref = ops.rope(q, cos, sin), rope.apply(q, cos, sin)
    assert (ref.float().abs() < 1.2e-38).logical_and(ref != 0).any()  # denormal results are in play
    def same(a, b):  # bit for bit, NaN for NaN (ATen's vector NaN bits vary)
        nan = b.isnan()
        return torch.equal(a.isnan(), nan) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))

    assert ref.isnan().any() and same(got, ref)
    x = torch.randn(2, 9, 64, generator=gen).to(bf) * 1e-38
    d = torch.randn(2, 9, 64, generator=gen).to(bf) * 1e-38
    x[1, 3, 2] = float("nan")
    w = torch.ones(64, dtype=bf)
    s, h = ops.add_rms_norm(x, d, w, 1e-5)
    assert same(s, x + d)
    assert torch.isnan(h[1, 3]).all() and torch.isfinite(h[0]).all()
    assert (h[1, 3].view(torch.int16) == 0x7FC0).all()  # ATen's NaN


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_matches_silu_times_up_and_keeps_each_rows_bits(dtype):
    """silu(gate) * up in one pass: within one rounding step (two in bf16, whose silu is
    rounded before the product, as in ATen) of ``F.silu(g) * u``, also for gates of +-100
    and zero, and a row's bits alone equal its bits among 40 others (sizes that are not a
    multiple of 16 included)."""
    import torch.nn.functional as F

    ops = native.module()
    gen = torch.Generator().manual_seed(3)
    for width in (1536, 37):
        gu = (torch.randn(2, 20, 2 * width, generator=gen) * 4).to(dtype)
        gu[0, 0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])
        got = ops.silu_mul(gu)
        g, u = gu.chunk(2, dim=-1)
        ref = (F.silu(g.double()) * u.double())
        step = 1e-6 if dtype == torch.float32 else 2 ** -7
        assert ((got.double() - ref).abs() <= 2 * step * ref.abs() + 1e-30).all(), width
        assert torch.equal(ops.silu_mul(gu[1:2, 7:8].clone()), got[1:2, 7:8])
    assert got.shape == (2, 20, 37) and got.dtype == dtype


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_add_and_norm_give_the_two_calls_bits(dtype):
    """``add_rms_norm(x, d, w)`` = (x + d, rms_norm(x + d)) bit for bit, row by row."""
    ops = native.module()
    gen = torch.Generator().manual_seed(4)
    x, d = ((torch.randn(2, 9, 576, generator=gen) * 3).to(dtype) for _ in range(2))
    w = (torch.randn(576, generator=gen) * 0.5 + 1).to(dtype)
    s, h = ops.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(s, x + d) and torch.equal(h, ops.rms_norm(x + d, w, 1e-5))
    s1, h1 = ops.add_rms_norm(x[1:2, 4:5].clone(), d[1:2, 4:5].clone(), w, 1e-5)
    assert torch.equal(s1, s[1:2, 4:5]) and torch.equal(h1, h[1:2, 4:5])
    with pytest.raises(RuntimeError, match="add_rms_norm"):
        ops.add_rms_norm(x, d[:, :3], w, 1e-5)


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("level", ["avx2", "x86-64"])
def test_the_avx2_and_generic_builds_of_the_fused_ops_give_the_native_bits(level):
    """rms_norm, add_rms_norm, rope, silu_mul and argmax_rows as CADENCE_ISA=avx2 builds them
    (16-float values as two 256-bit registers) and for plain x86-64 (GCC's vector form, SSE):
    bit for bit the native build's, NaN, infinities and denormals included. Minutes to compile
    each build (one CADENCE_ISA made already is reused)."""
    import platform

    from cadence.system.machine import _hardware_flags

    if platform.machine() not in ("x86_64", "AMD64") or "avx2" not in _hardware_flags():
        pytest.skip("x86-64 with AVX2 only")
    ops = native.module()
    other = native.build_for(level) if level != "x86-64" else native.build_variant("cadence_layers_x86_64", level)
    gen = torch.Generator().manual_seed(11)

    def same(a, b):  # bits, NaN for NaN
        nan = b.isnan()
        return torch.equal(a.isnan(), nan) and torch.equal(a[~nan], b[~nan])

    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3, 5, 576, generator=gen) * 3).to(dtype)
        x[0, 1, 7], x[1, 2, 3], x[2, 0, 9] = float("nan"), float("inf"), 1e-39
        d = torch.randn(3, 5, 576, generator=gen).to(dtype)
        w = (torch.randn(576, generator=gen) * 0.5 + 1).to(dtype)
        assert same(other.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5)), dtype
        for a, b in zip(other.add_rms_norm(x, d, w, 1e-5), ops.add_rms_norm(x, d, w, 1e-5)):
            assert same(a, b), dtype
        q = torch.randn(2, 7, 9, 64, generator=gen).to(dtype)
        cos, sin = (torch.randn(2, 7, 1, 64, generator=gen).to(dtype) for _ in range(2))
        assert same(other.rope(q, cos, sin), ops.rope(q, cos, sin)), dtype
        gu = (torch.randn(4, 2 * 1536 + 2 * 37, generator=gen) * 6).to(dtype)[:, :2 * 1536].contiguous()
        gu[0, :5] = torch.tensor([100.0, -100.0, 0.0, -0.0, -90.0])
        gu[1, 3] = float("nan")
        assert same(other.silu_mul(gu), ops.silu_mul(gu)), dtype
        gu37 = (torch.randn(3, 2 * 37, generator=gen) * 4).to(dtype)
        assert same(other.silu_mul(gu37), ops.silu_mul(gu37)), dtype
        logits = torch.randn(4, 49152 + 5, generator=gen).to(dtype)
        logits[1, 100] = float("nan")
        logits[2, 7] = logits[2, 8] = 50.0
        assert torch.equal(other.argmax_rows(logits), ops.argmax_rows(logits)), dtype
