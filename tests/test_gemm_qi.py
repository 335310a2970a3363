"""The integer kernel on a GGUF file's blocks (``fast/native/gemm_qi.cpp``, ``--quant gguf``).

What must hold: ``q_pack`` keeps every byte (``q_unpack`` gives the file's rows back, the
weights dequantize as before); ``q_linear`` on packed rows equals, bit for bit, a numpy model of
the arithmetic the file's header states (activations rounded to 8 bits per block of 32, exact
integer block sums, one fp32 accumulator per output over the blocks in order); a row's bits do not depend
on the other rows, the row count or the thread count; and (slow) the AVX2 and AVX-512 builds
give the same bits. Blocks are made here with numpy and ``gguf`` (no model download).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from cadence.fast import native

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
ops = native.module()
packs = ops is not None and ops.q_packed_type(int(T.Q4_1), 64) != int(T.Q4_1)
needs_kernel = pytest.mark.skipif(not packs, reason="needs the native extension built for AVX2 or AVX-512")
TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]
f32 = np.float32


def blocks(w: np.ndarray, qtype) -> torch.Tensor:
    data = gguf.quants.quantize(w.astype(np.float32), qtype)
    return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(w.shape[0], -1).copy())


def weights(out: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out, k)).astype(np.float32) * 0.05
    w[0, :32] = 0.0  # an all-zero block
    w[1, 32:64] = 3.0  # a constant block
    w[2, 64:96] = -1.0
    return w


def fields(b: torch.Tensor, qtype, k: int):
    """The file's blocks -> (q (out, nb, 32) int64 as the kernel reads them, d (out, nb), m (out, nb)) float32."""
    raw = b.numpy().reshape(b.shape[0], k // 32, -1)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(f32)
    if qtype == T.Q8_0:
        return raw[..., 2:].view(np.int8).astype(np.int64), d, None
    qs = raw[..., 4:] if qtype == T.Q4_1 else raw[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(f32) if qtype == T.Q4_1 else d
    return q, d, m


def fma(a, b, c):
    """fp32 a * b + c rounded once (float64 holds the product exactly)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(f32)


def reference(x: np.ndarray, b: torch.Tensor, qtype, bias) -> np.ndarray:
    """The header's arithmetic in numpy: x (m, k) float32 -> (m, out) float32."""
    m_rows, k = x.shape
    nb = k // 32
    xb = x.reshape(m_rows, nb, 32).astype(f32)
    amax = np.abs(xb).max(-1)
    d_x = (amax / f32(127)).astype(f32)
    with np.errstate(divide="ignore"):
        idx = np.where(d_x != 0, f32(1) / d_x, f32(0)).astype(f32)
    q_x = np.rint(xb * idx[..., None]).astype(np.int64)
    s_x = (d_x * q_x.sum(-1).astype(f32)).astype(f32)  # (m, nb)
    if qtype == T.Q4_0:
        s_x = (s_x * f32(-8)).astype(f32)
    q_w, d_w, m_w = fields(b, qtype, k)
    isum = np.einsum("onk,rnk->ron", q_w, q_x).astype(f32)  # (r, o, nb): exact block sums
    acc = np.zeros((m_rows, q_w.shape[0]), dtype=f32)
    for blk in range(nb):  # in order, one fp32 accumulator per output
        dd = (d_w[None, :, blk] * d_x[:, None, blk]).astype(f32)
        acc = fma(isum[..., blk], dd, acc)
        if qtype != T.Q8_0:
            acc = fma(np.broadcast_to(m_w[None, :, blk], acc.shape), np.broadcast_to(s_x[:, None, blk], acc.shape), acc)
    if bias is not None:
        acc = (acc + bias.numpy()[None]).astype(f32)
    return acc


def packed(b: torch.Tensor, qtype, k: int):
    pt = ops.q_packed_type(int(qtype), k)
    return ops.q_pack(b, int(qtype), k), pt


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 64, 576, 640])
def test_pack_keeps_every_byte(qtype, k):
    b = blocks(weights(24, k, int(qtype)), qtype)
    p, pt = packed(b, qtype, k)
    assert pt == int(qtype) | 256 and p.shape == b.shape
    assert torch.equal(ops.q_unpack(p, pt, k), b)
    assert torch.equal(ops.q_dequantize(p, pt, k), ops.q_dequantize(b, int(qtype), k))


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 96, 576, 1536])
def test_products_are_the_stated_arithmetic_bit_for_bit(qtype, k):
    out = 40
    b = blocks(weights(out, k, int(qtype) + k), qtype)
    p, pt = packed(b, qtype, k)
    rng = np.random.default_rng(k)
    x = rng.standard_normal((9, k)).astype(np.float32)
    x[0, :32] = 0.0  # a zero activation block (scale 0)
    x[1, 5] = 40.0  # an outlier
    bias = torch.from_numpy(rng.standard_normal(out).astype(np.float32))
    for bb in (None, bias):
        got = ops.q_linear(torch.from_numpy(x), p, pt, out, bb).numpy()
        want = reference(x, b, qtype, bb)
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), np.abs(got - want).max()
    # close to the product with the dequantized weights (only the 8-bit activations differ)
    dense = torch.from_numpy(x) @ ops.q_dequantize(b, int(qtype), k).T
    assert torch.allclose(ops.q_linear(torch.from_numpy(x), p, pt, out, None), dense, rtol=0.05, atol=0.05 * k ** 0.5)


@pytest.mark.skipif(not packs or not ops.q_amx(), reason="needs a build with AMX-INT8 on a CPU that has it")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [96, 576])
def test_amx_tiles_give_the_vector_codes_bits(qtype, k):
    """Calls of 16 rows or more run on AMX int8 tiles: the same exact block sums, the same
    epilogue, so the same bits as the stated arithmetic and as the vector code."""
    out = 72  # four full groups and a scalar one
    b = blocks(weights(out, k, int(qtype) + 3 * k), qtype)
    p, pt = packed(b, qtype, k)
    rng = np.random.default_rng(k + 1)
    bias = torch.from_numpy(rng.standard_normal(out).astype(np.float32))
    for m in (16, 17, 40):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[3, :32] = 0.0
        x[m - 1, 7] = -50.0
        got = ops.q_linear(torch.from_numpy(x), p, pt, out, bias)
        want = reference(x, b, qtype, bias)
        assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), (m, np.abs(got.numpy() - want).max())
        was = ops.set_q_amx(False)
        try:
            vector = ops.q_linear(torch.from_numpy(x), p, pt, out, bias)
        finally:
            ops.set_q_amx(was)
        assert torch.equal(got, vector), m


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_do_not_depend_on_the_other_rows_or_threads(qtype):
    k, out = 576, 70  # columns not a multiple of the tiles
    b = blocks(weights(out, k, 7), qtype)
    p, pt = packed(b, qtype, k)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(1))
    y = ops.q_linear(x, p, pt, out, None)
    for n in range(1, 12):
        assert torch.equal(ops.q_linear(x[:n], p, pt, out, None), y[:n]), n
    for i in range(0, 33, 5):
        assert torch.equal(ops.q_linear(x[i:i + 1], p, pt, out, None), y[i:i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.q_linear(x, p, pt, out, None), y)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_prefetch_distance_changes_no_bit(qtype):
    """The weight stream is prefetched ``q_prefetch`` bytes ahead (timing only): any distance,
    none, or one far past the end of the weights gives the stated arithmetic's bits."""
    k, out = 576, 88
    b = blocks(weights(out, k, 11), qtype)
    p, pt = packed(b, qtype, k)
    x = np.random.default_rng(5).standard_normal((9, k)).astype(np.float32)
    want = reference(x, b, qtype, None)
    was = ops.set_q_prefetch(0)
    try:
        assert ops.q_prefetch() == 0
        for dist in (0, 64, 8192, 1 << 20):
            ops.set_q_prefetch(dist)
            for m in (1, 4, 9):
                got = ops.q_linear(torch.from_numpy(x[:m]), p, pt, out, None).numpy()
                assert np.array_equal(got.view(np.int32), want[:m].view(np.int32)), (dist, m)
        assert ops.set_q_prefetch(-5) == 1 << 20 and ops.q_prefetch() == 0  # negative: off
    finally:
        ops.set_q_prefetch(was)
    if "CADENCE_GGUF_PREFETCH" not in os.environ:
        assert was == 8192  # the default


@needs_kernel
def test_only_the_block_formats_are_packed():
    assert ops.q_packed_type(int(T.Q4_1), 96) == int(T.Q4_1) | 256  # 3 blocks: any block count packs
    assert ops.q_packed_type(int(T.F16), 64) == int(T.F16)
    f16 = torch.zeros(4, 128, dtype=torch.uint8)
    assert ops.q_pack(f16, int(T.F16), 64) is f16


@needs_kernel
def test_the_packed_layout_is_the_headers_worked_example():
    """Q4_1, K = 64, 16 columns: block 1, chunk 2 of column 5 at byte 404; its d at 554, its m at 618."""
    b = blocks(weights(16, 64, 11), T.Q4_1)
    p, _ = packed(b, T.Q4_1, 64)
    flat, row5 = p.reshape(-1), b[5]
    block1 = row5[20:40]  # the file's block: d (2 bytes), m (2), 16 quant bytes
    assert torch.equal(flat[404:408], block1[4 + 8:4 + 12])
    assert torch.equal(flat[554:556], block1[0:2])
    assert torch.equal(flat[618:620], block1[2:4])


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_avx2_and_avx512_builds_give_the_same_bits(level):
    other = native.build_for(level)
    for qtype in TYPES:
        b = blocks(weights(24, 576, 5), qtype)
        p, pt = packed(b, qtype, 576)
        assert other.q_packed_type(int(qtype), 576) == pt
        x = torch.randn(7, 576, generator=torch.Generator().manual_seed(2))
        assert torch.equal(other.q_linear(x, p, pt, 24, None), ops.q_linear(x, p, pt, 24, None)), qtype
