"""The AMX tile product (``fast/native/gemm_amx.cpp``, kernel kind ``amx``): its layout, its
numbers against an fp32 product, and rows whose bits do not depend on the other rows."""

import pytest
import torch

from cadence.fast import kernels
from cadence.fast.kernels import Linear, amx_pack, amx_unpack

needs_amx = pytest.mark.skipif(not kernels.amx_available(), reason="needs a CPU with AMX and the native extension")


def test_pack_puts_each_weight_where_the_docstring_says_and_unpacks_exactly():
    w = torch.arange(960 * 576, dtype=torch.float32).view(960, 576).to(torch.bfloat16)
    p = amx_pack(w)
    assert p.shape == (30, 18, 2, 16, 32)
    assert p[1, 0, 0, 3, 17] == w[40, 7]  # the docstring's example
    for n, k in [(0, 0), (959, 575), (517, 300), (47, 33)]:
        nb, j, c = n // 32, n % 32 // 16, n % 16
        kb, r, q = k // 32, k % 32 // 2, k % 2
        assert p[nb, kb, j, r, 2 * c + q] == w[n, k]
    odd = torch.randn(100, 70).to(torch.bfloat16)  # padded to (128, 96) with zeros
    po = amx_pack(odd)
    assert po.shape == (4, 3, 2, 16, 32)
    assert torch.equal(po[po != 0].sort().values, odd[odd != 0].sort().values)  # the rest is zeros
    assert torch.equal(amx_unpack(po, 100, 70), odd)


def test_an_explicit_amx_kernel_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(ValueError, match="kernel 'amx' needs bf16"):
        kernels.resolve_kind("amx", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="unknown kernel kind"):
        kernels.resolve_kind("tiles", torch.device("cpu"), torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("out_in_bias", [(960, 576, False), (100, 70, True), (576, 1536, True), (33, 32, False)])
def test_amx_products_match_fp32_and_rows_do_not_depend_on_the_others(out_in_bias):
    n, k, with_bias = out_in_bias
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    lin = Linear(w, b, "amx")
    assert torch.equal(lin.to_dense(), w)
    x = torch.randn(70, k, generator=gen).to(torch.bfloat16)
    y = lin(x)
    ref = x.float() @ w.float().T + (b.float() if with_bias else 0)
    # bf16 output: within one rounding (2^-8 relative) of the fp32 product plus fp32 sums' error
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-3).all()
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(16, 48), slice(31, 33), slice(0, 70)):
        assert torch.equal(lin(x[rows]), y[rows]), rows
    assert torch.equal(lin(x.view(2, 35, k)), y.view(2, 35, n))  # leading dimensions kept
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lin(x), y)
    finally:
        torch.set_num_threads(threads)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_every_block_is_rounded_into_the_output_whatever_the_blocks_per_thread(threads):
    """A block's epilogue runs during the next block's loop (``EPILOGUE_AT``) and the last
    one's after it: zero to ten column blocks a thread, one or two row blocks, weights
    shorter and longer than 16 steps; each output within bf16 rounding of the fp32 product
    (an epilogue skipped or written to the wrong block would leave garbage or another block's
    values)."""
    gen = torch.Generator().manual_seed(7)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for n in (16, 64, 320):  # 1, 2, 10 column blocks
            for k in (32, 576):  # 1 and 18 steps
                w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
                lin = Linear(w, None, "amx")
                for rows in (1, 17, 45):  # one row tile, two, two row blocks
                    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
                    ref = x.float() @ w.float().T
                    y = lin(x).float()
                    assert ((y - ref).abs() <= ref.abs() * 2 ** -8 + 1e-3).all(), (n, k, rows)
    finally:
        torch.set_num_threads(old)


@needs_amx
def test_amx_linear_refuses_a_mismatched_input_or_layout():
    lin = Linear(torch.randn(64, 64).to(torch.bfloat16), None, "amx")
    with pytest.raises(RuntimeError, match="input size 96"):
        lin(torch.randn(2, 96).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16 CPU input"):
        lin(torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="layout"):
        lin._amx(torch.randn(2, 64).to(torch.bfloat16), torch.zeros(2, 2, dtype=torch.bfloat16), None, 64)
    assert lin(torch.randn(0, 64).to(torch.bfloat16)).shape == (0, 64)


def test_swiglu_rows_interleave_gate_and_up_by_16_and_back():
    i = 32
    w = torch.arange(2 * i, dtype=torch.float32)[:, None].expand(2 * i, 3)
    inter = kernels.swiglu_rows(w)
    assert inter[:, 0].tolist() == list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))
    assert torch.equal(kernels.swiglu_rows(inter, inverse=True), w)
    b = torch.arange(2 * i, dtype=torch.float32)
    assert torch.equal(kernels.swiglu_rows(kernels.swiglu_rows(b), inverse=True), b)


@needs_amx
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_swiglu_epilogue_has_the_bits_of_the_plain_product_then_silu_mul(with_bias):
    from cadence.fast import native

    ops = native.module()
    gen = torch.Generator().manual_seed(7)
    inter, k = 96, 160  # 6 blocks of 16 outputs, K padded to 192
    w = (torch.randn(2 * inter, k, generator=gen) * 0.1).to(torch.bfloat16)
    b = torch.randn(2 * inter, generator=gen).to(torch.bfloat16) if with_bias else None
    fused, plain = Linear(w, b, "amx", swiglu=True), Linear(w, b, "amx")
    assert fused.swiglu and not plain.swiglu
    assert torch.equal(fused.to_dense(), w)
    x = (torch.randn(40, k, generator=gen) * 2).to(torch.bfloat16)
    y = fused(x)
    assert y.shape == (40, inter)
    assert torch.equal(y, ops.silu_mul(plain(x)))
    assert torch.equal(fused(x[7:8]), y[7:8])  # a row alone: the same bits
    assert not Linear(torch.randn(2 * 24, 64).to(torch.bfloat16), None, "amx", swiglu=True).swiglu  # I % 16 != 0
