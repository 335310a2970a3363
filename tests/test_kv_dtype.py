"""A float16 KV cache under a float32 backbone (``--kv-dtype``; the default on a GGUF's own blocks).

What must hold: the store rounds to float16 with saturation, the same bits from the C++ loop and
from torch; ``listed_attention`` over a float16 cache gives exactly what it gives over the same
values widened to float32 (widening is exact: nothing else changes); a tree node still gets the
bits of its one-token forward, so speculation stays identical to plain decoding with that cache;
and the flag refuses what it cannot do.
"""

from __future__ import annotations

import pytest
import torch

from cadence.errors import CadenceError
from cadence.fast import native
from cadence.fast.quant import resolve_kv_dtype

needs_native = pytest.mark.skipif(native.module() is None, reason="the C++ extension could not be built here")
CPU = torch.device("cpu")


@needs_native
def test_the_store_rounds_to_float16_with_saturation_as_torch_does():
    ops = native.module()
    x = torch.tensor([1.0, -7e4, 7e4, float("nan"), 65519.0, 65520.0, 1e-8, 3.14159, -0.0, 2.5e-5, 1e30])
    x = torch.cat([x, torch.randn(1000) * 300, x])  # the vector body and the scalar tail
    got = ops.kv_half(x)
    want = x.clamp(-65504, 65504).to(torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.isfinite(got[~torch.isnan(x)]).all()  # no inf from a large key: saturated


@needs_native
@pytest.mark.parametrize("n,extras", [(1, [[]]), (5, [[], [3], [3, 4], [3, 5], [3, 4, 6]])])
def test_listed_attention_over_a_float16_cache_is_the_widened_values_exactly(n, extras):
    ops = native.module()
    g = torch.Generator().manual_seed(0)
    H, KV, D, L = 9, 3, 64, 160
    k, v = (torch.randn(1, KV, L, D, generator=g).half() for _ in range(2))
    q = torch.randn(1, H, n, D, generator=g)
    e = max(1, max(len(x) for x in extras))
    extra = torch.zeros(1, n, e, dtype=torch.int32)
    for r, x in enumerate(extras):
        extra[0, r, :len(x)] = torch.tensor([137 + j for j in x], dtype=torch.int32)
    prefix = torch.full((1, n), 137, dtype=torch.int32)
    count = torch.tensor([[len(x) for x in extras]], dtype=torch.int32)
    half = ops.listed_attention(q, k, v, prefix, extra, count, D ** -0.5)
    wide = ops.listed_attention(q, k.float(), v.float(), prefix, extra, count, D ** -0.5)
    assert half.dtype == torch.float32 and torch.equal(half, wide)
    with pytest.raises(RuntimeError, match="listed_attention"):  # float16 queries are not a cache
        ops.listed_attention(q.half(), k, v, prefix, extra, count, D ** -0.5)


def test_kv_dtype_auto_and_what_it_refuses():
    assert resolve_kv_dtype("auto", CPU, torch.float32, "gguf") == torch.float16
    assert resolve_kv_dtype("auto", CPU, torch.float32, "none") == torch.float32
    assert resolve_kv_dtype("auto", CPU, torch.bfloat16, "none") == torch.bfloat16
    assert resolve_kv_dtype("float32", CPU, torch.float32, "gguf") == torch.float32
    assert resolve_kv_dtype("float16", CPU, torch.float32, "none") == torch.float16
    with pytest.raises(CadenceError, match="--kv-dtype float16 with a bfloat16 backbone"):
        resolve_kv_dtype("float16", CPU, torch.bfloat16, "none")
    with pytest.raises(CadenceError, match="unknown --kv-dtype"):
        resolve_kv_dtype("int8", CPU, torch.float32, "gguf")


@needs_native
def test_a_float16_cache_keeps_speculation_identical_to_plain_decoding(tmp_path):
    pytest.importorskip("gguf")
    from test_fast_model import assert_tree_rows_are_one_token_forwards, reference_greedy, tree_greedy
    from test_gemm_q import gguf_model

    from cadence.fast.model import FastBackbone

    model, tok, path = gguf_model(tmp_path)
    wide = FastBackbone(model, tok, "q32", quant="gguf", gguf_path=path, kv_dtype="float32")
    (tmp_path / "b").mkdir()
    model, tok, path = gguf_model(tmp_path / "b")
    q = FastBackbone(model, tok, "q16", quant="gguf", gguf_path=path)  # auto: float16 on the blocks
    assert q.kv_dtype == torch.float16 and q.kernels.endswith("/kv-float16") and "kv-" not in wide.kernels
    assert q.new_cache().k.dtype == torch.float16 and q.new_batch_cache(2).k.dtype == torch.float16
    prompt = list(range(40, 60))
    ids = torch.tensor([prompt])
    got = q.forward(ids, q.new_cache()).logits
    want = wide.forward(ids, wide.new_cache()).logits
    assert 0 < (got - want).abs().max() < 0.05 * want.abs().max()  # rounded keys and values: near, not equal
    assert_tree_rows_are_one_token_forwards(q, prompt)  # a node's bits are its one-token forward's
    expected = reference_greedy(q, prompt, 24)
    got_tokens, steps = tree_greedy(q, prompt, 24, expected)
    assert got_tokens == expected and steps < 20


@needs_native
def test_the_batched_rows_store_float16_too(tmp_path):
    pytest.importorskip("gguf")
    from test_gemm_q import gguf_model

    from cadence.fast.model import FastBackbone

    model, tok, path = gguf_model(tmp_path)
    q = FastBackbone(model, tok, "q16", quant="gguf", gguf_path=path, kv_dtype="float16")
    prompt = torch.tensor([list(range(40, 52))])
    single = q.new_cache()
    want = q.forward(prompt, single).logits[0, -1]
    batch = q.new_batch_cache(2)
    got = q.forward_rows(prompt.expand(2, -1), batch, 0, [0, 0]).logits[:, -1]
    assert torch.equal(batch.k[:, 0, :, :12], single.k[:, 0, :, :12])  # the same rounded entries
    assert torch.allclose(got[0], want, atol=1e-4) and torch.equal(got[0], got[1])
