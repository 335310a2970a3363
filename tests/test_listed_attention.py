"""Row-consistent attention over listed keys (``fast/native/attention.cpp``).

A row's output must be the softmax attention over its keys (checked against float64), and
its bits must depend on nothing but its query and the keys/values it lists, in order: not
on where they sit in the cache, on how the list splits into a contiguous prefix and extra
slots, on the other rows of the call, or on the thread count. That is what lets a branching
bf16 tree verify in one call and still give every node plain decoding's bits.
"""

from __future__ import annotations

import math

import pytest
import torch

from cadence.fast import consistent, native

needs_native = pytest.mark.skipif(native.module() is None, reason="the C++ extension could not be built here")


@pytest.fixture(params=["amx", "vector"])
def path(request):
    """bf16 calls through AMX tiles (``attention_amx.cpp``, CPUs with AMX only) or the fp32
    vector kernel; the contract is the same."""
    ops = native.module()
    if ops is None:
        pytest.skip("the C++ extension could not be built here")
    if request.param == "amx" and not ops.listed_attention_amx():
        pytest.skip("no AMX here (or CADENCE_AMX=0)")
    was = ops.set_listed_attention_amx(request.param == "amx")
    yield request.param
    ops.set_listed_attention_amx(was)


def _lists(prefix: list[int], extras: list[list[int]]):
    """One sequence: row r lists keys [0, prefix[r]) then extras[r]."""
    n, e = len(extras), max(1, max(len(x) for x in extras))
    extra = torch.zeros(1, n, e, dtype=torch.int32)
    for r, x in enumerate(extras):
        extra[0, r, :len(x)] = torch.tensor(x, dtype=torch.int32)
    count = torch.tensor([[len(x) for x in extras]], dtype=torch.int32)
    return torch.tensor([prefix], dtype=torch.int32), extra, count


def _reference(q, k, v, keys: list[int]) -> torch.Tensor:
    """float64 attention of one row q (H, D) over k, v (KV, L, D) at ``keys``."""
    g = q.shape[0] // k.shape[0]
    out = []
    for h in range(q.shape[0]):
        kk, vv = k[h // g, keys].double(), v[h // g, keys].double()
        w = torch.softmax(q[h].double() @ kk.T / math.sqrt(q.shape[-1]), -1)
        out.append(w @ vv)
    return torch.stack(out)


@needs_native
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 96, 128, 192, 256])
def test_each_row_is_softmax_attention_over_its_listed_keys(dtype, tol, head_dim, path):
    ops = native.module()
    gen = torch.Generator().manual_seed(0)
    H, KV, L = 6, 2, 200
    k, v = (torch.randn(1, KV, L, head_dim, generator=gen).to(dtype) for _ in range(2))
    q = (torch.randn(1, H, 4, head_dim, generator=gen) * 2).to(dtype)
    prefix = [150, 150, 37, 0]
    extras = [[150], [150, 152, 160], [40, 41, 199], [5, 3, 199]]  # any slots, any order
    out = ops.listed_attention(q, k, v, *_lists(prefix, extras), 1 / math.sqrt(head_dim))
    for r in range(4):
        want = _reference(q[0, :, r], k[0], v[0], list(range(prefix[r])) + extras[r])
        assert (out[0, :, r].double() - want).abs().max() < tol, r


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_slots_split_or_company(dtype, path):
    """A tree node (context prefix + ancestors at scattered slots, beside 15 other rows)
    and the same token decoded alone (its path copied right after the context, all of it
    one contiguous prefix) get equal bits, for contexts across block boundaries."""
    ops = native.module()
    gen = torch.Generator().manual_seed(1)
    H, KV, D, L = 9, 3, 64, 600
    anc = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 1, 3, 6], [0, 1, 3, 6, 7]]
    anc += [[0, 2, 5, 8 + i] for i in range(8)]  # 8 children of node 5
    n = len(anc)
    for past in (1, 15, 16, 17, 100, 255, 511):
        k, v = (torch.randn(1, KV, L, D, generator=gen).to(dtype) for _ in range(2))
        q = (torch.randn(1, H, n, D, generator=gen) * 3).to(dtype)
        tree = torch.zeros(n, n, dtype=torch.bool)
        for r, a in enumerate(anc):
            tree[r, a] = True
        out = ops.listed_attention(q, k, v, *consistent.key_lists(tree[None], [past]), 0.125)
        for r, a in enumerate(anc):
            K, V = k.clone(), v.clone()
            slots = [past + x for x in a]
            K[:, :, past:past + len(a)], V[:, :, past:past + len(a)] = k[:, :, slots], v[:, :, slots]
            alone = ops.listed_attention(q[:, :, r:r + 1].contiguous(), K, V, *_lists([past + len(a)], [[]]), 0.125)
            assert torch.equal(out[:, :, r], alone[:, :, 0]), (past, r)


@needs_native
def test_bits_do_not_depend_on_the_thread_count(path):
    ops = native.module()
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(2, 3, 300, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(2, 9, 5, 64, generator=gen).to(torch.bfloat16)
    tree = torch.ones(5, 5, dtype=torch.bool).tril_().expand(2, 5, 5)
    lists = consistent.key_lists(tree, [250, 120])
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(ops.listed_attention(q, k, v, *lists, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_native
def test_deep_chains_batches_and_wide_groups_keep_each_rows_bits(path):
    """Rows whose own keys span several 32-key chunks past the shared context (a 70-node
    chain), two sequences at different contexts, 4 query heads per kv head, head size 128:
    every row's bits equal its plain one-row forward's."""
    ops = native.module()
    gen = torch.Generator().manual_seed(5)
    H, KV, D, L, n = 8, 2, 128, 400, 70
    k, v = (torch.randn(2, KV, L, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = (torch.randn(2, H, n, D, generator=gen) * 2).to(torch.bfloat16)
    past = [70, 257]
    tree = torch.ones(n, n, dtype=torch.bool).tril_().expand(2, n, n)
    out = ops.listed_attention(q, k, v, *consistent.key_lists(tree, past), D ** -0.5)
    for bi in range(2):
        for r in (0, 1, 30, 31, 32, 33, 63, 69):
            alone = ops.listed_attention(q[bi:bi + 1, :, r:r + 1].contiguous(), k[bi:bi + 1], v[bi:bi + 1],
                                         *_lists([past[bi] + r + 1], [[]]), D ** -0.5)
            assert torch.equal(out[bi, :, r], alone[0, :, 0]), (bi, r)
            want = _reference(q[bi, :, r], k[bi], v[bi], list(range(past[bi] + r + 1)))
            assert (alone[0, :, 0].double() - want).abs().max() < 2e-2, (bi, r)


def test_key_lists_put_the_context_first_then_each_rows_tree_slots_in_order():
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    prefix, extra, count = consistent.key_lists(torch.stack([tree, tree]), [100, 7])
    assert prefix.tolist() == [[100] * 4, [7] * 4]
    assert count.tolist() == [[1, 2, 2, 3]] * 2
    assert [extra[0, r, :c].tolist() for r, c in enumerate(count[0].tolist())] == [[100], [100, 101], [100, 102],
                                                                                   [100, 101, 103]]
    assert extra[1, 3, :3].tolist() == [7, 8, 10]


@needs_native
@pytest.mark.parametrize("case", ["slot", "count", "empty", "prefix", "head_dim", "dtype"])
def test_bad_key_lists_are_refused_not_read(case):
    ops = native.module()
    k = v = torch.zeros(1, 1, 32, 64)
    q = torch.zeros(1, 1, 1, 64)
    prefix, extra, count = _lists([4], [[5]])
    if case == "slot":
        extra[0, 0, 0] = 32
    elif case == "count":
        count[0, 0] = 2
    elif case == "empty":
        prefix[0, 0], count[0, 0] = 0, 0
    elif case == "prefix":
        prefix[0, 0] = 33
    elif case == "head_dim":
        k = v = torch.zeros(1, 1, 32, 8)
        q = torch.zeros(1, 1, 1, 8)
    else:
        q = q.double()
    with pytest.raises(RuntimeError, match="listed_attention"):
        ops.listed_attention(q, k, v, prefix, extra, count, 0.125)


@needs_native
@pytest.mark.parametrize("listed", ["1", "0"])
def test_a_bf16_fast_backbone_grows_branching_trees_only_with_listed_attention(listed, monkeypatch):
    """With ``listed_attention`` a branching tree costs one attention call, so the tree
    policy may grow any tree; without it (``CADENCE_LISTED=0``) chains only. The kernels'
    name tells cached latency curves of the two apart."""
    from tiny import tiny_backbone

    from cadence.system.machine import onednn_available
    from cadence.fast.model import FastBackbone

    if not onednn_available():
        pytest.skip("row-consistent mode is for oneDNN bf16")
    monkeypatch.setenv("CADENCE_LISTED", listed)
    plain = tiny_backbone("llama")
    plain.model.to(torch.bfloat16)
    bb = FastBackbone.from_backbone(plain)
    assert bb.consistent and bb.listed == (listed == "1")
    assert bb.chains_only == (listed == "0")
    assert ("/listed" in bb.kernels) == (listed == "1")


@needs_native
def test_batched_rows_whose_mask_hides_committed_entries_are_refused():
    from tiny import tiny_backbone

    from cadence.errors import CadenceError
    from cadence.system.machine import onednn_available
    from cadence.fast.model import FastBackbone

    if not onednn_available():
        pytest.skip("row-consistent mode is for oneDNN bf16")
    plain = tiny_backbone("llama")
    plain.model.to(torch.bfloat16)
    bb = FastBackbone.from_backbone(plain)
    cache = bb.new_batch_cache(1)
    bb.forward_rows(torch.tensor([[1, 2, 3, 4]]), cache, 0, [0], need_logits=False)
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    mask[..., 1] = False  # committed entry 1 hidden
    with pytest.raises(CadenceError, match="hides"):
        bb.forward_rows(torch.tensor([[5]]), cache, 0, [4], attn_mask=mask)


@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 + FMA; SSE2 only (std::fma per lane)
def test_the_avx2_and_generic_builds_give_the_same_attention(march):
    """The kernel's other code paths, built for an AVX2-only CPU and for plain x86-64 (run
    here when this CPU has those instructions, which every AVX-512 CPU does): float64-close,
    row-consistent, and bit for bit the native build's (every operation is a lane-wise IEEE
    one, fused multiply-adds included). About a minute each to compile."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64") or "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("x86-64 with AVX2 only")
    ops = native.build_variant(f"cadence_layers_{march.replace('-', '_')}", march)
    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn(1, 3, 300, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = (torch.randn(1, 9, 4, 64, generator=gen) * 2).to(torch.bfloat16)
    lists = _lists([250, 250, 250, 17], [[250], [250, 251], [250, 252], [20, 21]])
    out = ops.listed_attention(q, k, v, *lists, 0.125)
    if native.module() is not None:  # the native build's vector kernel (not its AMX one)
        was = native.module().set_listed_attention_amx(False)
        assert torch.equal(out, native.module().listed_attention(q, k, v, *lists, 0.125))
        assert torch.equal(ops.listed_attention(q.float(), k.float(), v.float(), *lists, 0.125),
                           native.module().listed_attention(q.float(), k.float(), v.float(), *lists, 0.125))
        kh, vh = k.float().half(), v.float().half()  # a float16 cache under float32 queries
        assert torch.equal(ops.listed_attention(q.float(), kh, vh, *lists, 0.125),
                           native.module().listed_attention(q.float(), kh, vh, *lists, 0.125))
        x = torch.randn(1000, generator=gen) * 3e4
        assert torch.equal(ops.kv_half(x).view(torch.int16), native.module().kv_half(x).view(torch.int16))
        native.module().set_listed_attention_amx(was)
    for r, keys in enumerate([list(range(251)), list(range(252)), list(range(251)) + [252], list(range(17)) + [20, 21]]):
        assert (out[0, :, r].double() - _reference(q[0, :, r], k[0], v[0], keys)).abs().max() < 1e-2, r
    K, V = k.clone(), v.clone()
    K[:, :, 251], V[:, :, 251] = k[:, :, 252], v[:, :, 252]  # row 2's keys laid out as plain decoding's
    alone = ops.listed_attention(q[:, :, 2:3].contiguous(), K, V, *_lists([252], [[]]), 0.125)
    assert torch.equal(alone[:, :, 0], out[:, :, 2])
