"""Row-consistent bf16 forwards (``cadence.fast.consistent``)."""

import pytest
import torch
import torch.nn.functional as F

from cadence.fast import consistent, native
from cadence.system.machine import onednn_available
from cadence.fast.kernels import Linear

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="oneDNN kernels only")


def test_key_length_rounds_up_to_whole_blocks_within_the_capacity():
    assert consistent.key_length(200, 1024) == 256
    assert consistent.key_length(256, 1024) == 256
    assert consistent.key_length(1000, 1000) == 1000


@needs_onednn
def test_a_padded_gemm_gives_a_row_the_bits_it_gets_in_any_batch():
    """On the Zen 5 EPYC, 6 of these 64 rows came out differently alone (M = 1) than in the
    batch with min_rows = 1; padded to 2 rows, none does (at any M)."""
    torch.manual_seed(0)
    w = (torch.randn(576, 1536) * 0.03).to(torch.bfloat16)
    x = (torch.randn(64, 1536) * 2).to(torch.bfloat16)
    lin = Linear(w, None, "onednn")
    lin.min_rows, lin.max_rows = consistent.MIN_ROWS, consistent.MAX_ROWS
    full = lin(x)
    for i in range(64):
        assert torch.equal(lin(x[i:i + 1])[0], full[i])
    assert torch.equal(lin(x[5:13]), full[5:13])


@needs_onednn
def test_a_gemm_of_more_than_max_rows_gives_each_row_its_small_batch_bits():
    """On the AMX Xeon (2026-12-01) oneDNN took another bf16 kernel from M = 33 rows on:
    every row of a 33- to 64-row call differed from the same row in a call of 2-32 rows.
    Calls are split into blocks of at most MAX_ROWS rows (2-D and 3-D inputs alike)."""
    torch.manual_seed(0)
    w = (torch.randn(960, 576) * 0.03).to(torch.bfloat16)
    x = (torch.randn(100, 576) * 2).to(torch.bfloat16)
    lin = Linear(w, None, "onednn")
    lin.min_rows, lin.max_rows = consistent.MIN_ROWS, consistent.MAX_ROWS
    alone = torch.cat([lin(x[i:i + 1]) for i in range(100)])
    for m in (33, 64, 65, 100):
        assert torch.equal(lin(x[:m]), alone[:m]), m
    assert torch.equal(lin(x[None, :40])[0], alone[:40])


@needs_onednn
def test_only_steady_forwards_run_their_gemms_in_blocks(monkeypatch):
    """A prefill (the same in plain and speculative decoding) runs each GEMM once, whatever its
    rows; decode and verify forwards in blocks of MAX_ROWS (a 40-node verify: 2 calls each).
    The Python loop's calls (``tests/test_native.py`` holds the C++ loop to its bits)."""
    monkeypatch.setenv("CADENCE_NATIVE", "0")
    import cadence.fast.kernels as kernels
    from cadence.fast.model import FastBackbone
    from tiny import tiny_backbone

    plain = tiny_backbone("llama", hidden=768, layers=4)
    plain.model.to(torch.bfloat16)
    bb = FastBackbone.from_backbone(plain)
    calls = []
    real = kernels._ONEDNN
    monkeypatch.setattr(kernels, "_ONEDNN", lambda *a: calls.append(a[0].shape) or real(*a))
    cache = bb.new_cache()
    bb.forward(torch.randint(0, bb.vocab_size, (1, 100)), cache)
    assert len(calls) == 4 * 4 + 1 and bb._head.max_rows == 0
    calls.clear()
    bb.forward(torch.randint(0, bb.vocab_size, (1, 40)), cache)  # a chain of 40 after the prompt
    assert len(calls) == 2 * (4 * 4 + 1) and max(c[-2] if len(c) > 2 else c[0] for c in calls) == consistent.MAX_ROWS


def test_attend_pads_queries_and_returns_only_the_real_rows():
    torch.manual_seed(0)
    q = torch.randn(1, 6, 2, 16)
    k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    mask = torch.zeros(2, 64, dtype=torch.bool)
    mask[:, :40] = True
    out = consistent.attend(q, k, v, mask, gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :40], v[:, :, :40], enable_gqa=True)
    assert out.shape == (1, 6, 2, 16)
    assert torch.allclose(out, ref, atol=1e-6)


@needs_onednn
@pytest.mark.parametrize("kernel", ["onednn", "amx"])
def test_bf16_tree_and_one_token_forwards_agree_on_the_root(kernel):
    from cadence.fast.kernels import ROW_FREE, amx_available
    from cadence.fast.model import FastBackbone
    from cadence.verify.scorer import score
    from cadence.trees.tree import compile_tree, grow_tree, prior_acceptance
    from tiny import tiny_backbone

    if kernel == "amx" and not amx_available():
        pytest.skip("AMX products need a CPU with AMX and the native extension")
    plain = tiny_backbone("llama", hidden=768, layers=4)  # down projection K = 1536, as SmolLM2's
    plain.model.to(torch.bfloat16)
    bb = FastBackbone.from_backbone(plain, kernel=kernel)
    assert bb.kernel == kernel
    assert bb.consistent == consistent.wanted(bb.kernel, bb.dtype)
    assert bb.chains_only == (bb.consistent and not bb.listed)
    assert (bb._head in bb._blockable) == (bb.consistent and kernel not in ROW_FREE)
    gen = torch.Generator().manual_seed(0)
    for past in (10, 70, 130, 200, 260, 330, 390):  # no tree below reaches into the next 64-key block
        cache = bb.new_cache()
        bb.forward(torch.randint(0, bb.vocab_size, (1, past), generator=gen), cache, need_logits=False)
        root = torch.randint(0, bb.vocab_size, (1,), generator=gen)
        one = score(bb, cache, past, compile_tree([], name="r"), root).logits[0, 0]
        cache.compact(past, [])
        for n in (2, 5):
            tree = compile_tree(grow_tree(prior_acceptance(4, ranks=n), n - 1), name="t")
            toks = torch.cat([root, torch.randint(0, bb.vocab_size, (tree.size - 1,), generator=gen)])
            assert torch.equal(score(bb, cache, past, tree, toks).logits[0, 0], one)
            cache.compact(past, [])


def test_keys_are_sized_from_each_rows_position_not_its_forward():
    """A query attends over a key count set by its own position (room for a tree of up to
    KEY_ROOM nodes before it), so a tree node gets the count its one-token forward gets.
    Rounding past + n per forward gave 192 keys to a root at 186 alone and 256 in a tree of
    8: the root's bf16 logits differed by 0.156 on SmolLM2."""
    assert consistent.keys_for(186, 4096) == 256
    assert consistent.keys_for(191, 4096) == 256 and consistent.keys_for(192, 4096) == 320
    for p in (10, 62, 63, 186, 191, 1000):
        assert consistent.keys_for(p, 4096) >= p + 1 + consistent.KEY_ROOM
    assert consistent.keys_for(1000, 1010) == 1010  # never past the limit
    assert consistent.row_groups([190, 191, 191, 192], 4096) == [([0, 1, 2], 256), ([3], 320)]
    assert consistent.row_groups([186] * 3, 4096) == [([0, 1, 2], 256)]


def test_grouped_attention_equals_each_group_alone():
    torch.manual_seed(0)
    q = torch.randn(1, 6, 5, 16)
    k, v = torch.randn(1, 2, 128, 16), torch.randn(1, 2, 128, 16)
    mask = torch.rand(5, 128) > 0.3
    mask[:, 0] = True
    groups = [([0, 2], 64), ([1, 3, 4], 128)]
    out = consistent.attend_groups(q, k, v, mask, True, groups)
    for rows, keys in groups:
        alone = consistent.attend(q[:, :, rows], k[:, :, :keys], v[:, :, :keys], mask[rows, :keys], True)
        assert torch.equal(out[:, :, rows], alone)


def _ancestors(tree) -> list[list[int]]:
    return [row.nonzero().flatten().tolist() for row in tree.mask]


def test_tree_paths_attend_every_node_once_at_its_depths_slot():
    from cadence.trees.tree import compile_tree, grow_tree, prior_acceptance

    assert consistent.tree_paths([[0], [0, 1], [0, 2], [0, 1, 3]]) == [([0, 2], [0, 2]), ([0, 1, 3], [1, 3])]
    tree = compile_tree(grow_tree(prior_acceptance(4, ranks=4), 15), name="t16")
    anc = _ancestors(tree)
    parts = consistent.tree_paths(anc)
    rows = [r for _, rs in parts for r in rs]
    assert sorted(rows) == list(range(tree.size))  # each node exactly once
    for path, rs in parts:
        for r in rs:
            assert path[len(anc[r]) - 1] == r and path[:len(anc[r])] == anc[r]


def test_only_chains_are_laid_out_as_plain_decoding():
    from cadence.trees.tree import compile_tree

    assert consistent.is_laid_out(_ancestors(compile_tree([(0,), (0, 0), (0, 0, 0)], name="c")))
    assert consistent.is_laid_out([[0]])
    assert not consistent.is_laid_out(_ancestors(compile_tree([(0,), (1,)], name="b")))


def test_path_attention_equals_masked_tree_attention_and_restores_node_order():
    """Any CPU, fp32: same values (to rounding) as one masked call over the tree's own slots."""
    from cadence.trees.tree import compile_tree, grow_tree, prior_acceptance

    torch.manual_seed(0)
    tree = compile_tree(grow_tree(prior_acceptance(4, ranks=3), 8), name="t9")
    anc, n, past, cap = _ancestors(tree), tree.size, 70, 256
    k_cache, v_cache = torch.randn(1, 1, 2, cap, 16), torch.randn(1, 1, 2, cap, 16)
    q, k, v = torch.randn(1, 6, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    mask = torch.zeros(n, past + n, dtype=torch.bool)
    mask[:, :past], mask[:, past:] = True, tree.mask
    ref_k = torch.cat([k_cache[0, :, :, :past], k], dim=2)
    ref_v = torch.cat([v_cache[0, :, :, :past], v], dim=2)
    ref = torch.nn.functional.scaled_dot_product_attention(q, ref_k, ref_v, attn_mask=mask, enable_gqa=True)
    out = consistent.PathAttention(k_cache, v_cache, past, anc, cap)(0, q, k, v, True)
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.equal(k_cache[0, :, :, past:past + n], k) and torch.equal(v_cache[0, :, :, past:past + n], v)


@needs_onednn
@pytest.mark.parametrize("listed", ["1", "0"])  # listed_attention (one call), or PathAttention (per path)
def test_bf16_branching_tree_nodes_get_plain_decodings_bits(listed, monkeypatch):
    """Every node of a branching tree gets the logits a one-token forward gives it after its
    path was committed token by token; then decoding on from the compacted cache does too.
    With PyTorch's attention over the tree's own layout (ancestors at scattered slots) SmolLM2
    differed in 19 of 140 branch nodes, by up to 0.59 (``benchmarks/kernels/consistency.py --tree``)."""
    monkeypatch.setenv("CADENCE_LISTED", listed)
    from cadence.fast.model import FastBackbone
    from cadence.verify.scorer import score
    from cadence.trees.tree import compile_tree, grow_tree, prior_acceptance
    from tiny import tiny_backbone

    plain = tiny_backbone("llama", hidden=768, layers=4)
    plain.model.to(torch.bfloat16)
    bb = FastBackbone.from_backbone(plain)
    assert bb.listed == (listed == "1" and native.module() is not None)
    root = compile_tree([], name="r")
    tree = compile_tree(grow_tree(prior_acceptance(4, ranks=4), 8), name="t9")
    gen = torch.Generator().manual_seed(1)
    for past in (61, 125, 190, 300):
        prompt = torch.randint(0, bb.vocab_size, (1, past), generator=gen)
        toks = torch.randint(0, bb.vocab_size, (tree.size,), generator=gen)
        nxt = torch.randint(0, bb.vocab_size, (1,), generator=gen)
        cache = bb.new_cache()
        bb.forward(prompt, cache, need_logits=False)
        multi = score(bb, cache, past, tree, toks).logits[0]
        leaf = tree.size - 1
        path = _ancestors(tree)[leaf]
        cache.compact(past, path)
        after = score(bb, cache, past + len(path), root, nxt).logits[0, 0]
        for end in range(tree.size):
            cache = bb.new_cache()
            bb.forward(prompt, cache, need_logits=False)
            for i, node in enumerate(_ancestors(tree)[end]):
                one = score(bb, cache, past + i, root, toks[node:node + 1]).logits[0, 0]
            assert torch.equal(multi[end], one), (past, end)
            if end == leaf:
                assert torch.equal(score(bb, cache, past + len(path), root, nxt).logits[0, 0], after)


@needs_onednn
def test_bf16_path_attention_gives_each_node_the_bits_of_its_chain_layout():
    """Each node's attention equals that of the node alone with its path in the slots right
    after the context (plain decoding's layout). Attending in the tree's own layout
    (ancestors at scattered slots, gaps masked) gave 7 of these 3,600 rows other bits."""
    from cadence.trees.tree import compile_tree, grow_tree, prior_acceptance

    tree = compile_tree(grow_tree(prior_acceptance(4, ranks=4), 8), name="t9")
    anc, n, cap, bf = _ancestors(tree), tree.size, 1024, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    differ = 0
    for _ in range(400):
        past = int(torch.randint(50, 400, (1,), generator=gen))
        kc, vc = (torch.randn(1, 1, 3, cap, 64, generator=gen).to(bf) for _ in range(2))
        q = (torch.randn(1, 9, n, 64, generator=gen) * 3).to(bf)
        k, v = (torch.randn(1, 3, n, 64, generator=gen).to(bf) for _ in range(2))
        out = consistent.PathAttention(kc.clone(), vc.clone(), past, anc, cap)(0, q, k, v, True)
        for r in range(n):
            K, V = kc[0].clone(), vc[0].clone()
            K[:, :, past:past + len(anc[r])], V[:, :, past:past + len(anc[r])] = k[:, :, anc[r]], v[:, :, anc[r]]
            keys = consistent.keys_for(past + len(anc[r]) - 1, cap)
            m = torch.zeros(1, keys, dtype=torch.bool)
            m[:, :past + len(anc[r])] = True
            alone = consistent.attend(q[:, :, r:r + 1], K[:, :, :keys], V[:, :, :keys], m, True)
            differ += not torch.equal(out[:, :, r], alone[:, :, 0])
    assert differ == 0, f"{differ} rows differ"


@needs_onednn
def test_bf16_batched_rows_get_the_bits_of_each_request_alone():
    """The batch engine's forward (``forward_rows``: ragged rows, padded trees) gives each
    real node the logits of its request's own tree forward (itself equal to plain decoding)."""
    from cadence.batch.layout import pack
    from cadence.fast.model import FastBackbone
    from cadence.verify.scorer import score
    from cadence.trees.tree import compile_tree, grow_tree, prior_acceptance
    from tiny import tiny_backbone

    plain = tiny_backbone("llama", hidden=768, layers=4)
    plain.model.to(torch.bfloat16)
    bb = FastBackbone.from_backbone(plain)
    gen = torch.Generator().manual_seed(2)
    trees = [compile_tree([(0,), (0, 0)], name="c3"), compile_tree(grow_tree(prior_acceptance(4, ranks=3), 6), name="t7"),
             compile_tree([], name="r")]
    for pasts in ([61, 130, 90], [200, 62, 127]):
        prompts = [torch.randint(0, bb.vocab_size, (1, p), generator=gen) for p in pasts]
        toks = [torch.randint(0, bb.vocab_size, (t.size,), generator=gen) for t in trees]
        cache = bb.new_batch_cache(len(trees))
        for slot, prompt in enumerate(prompts):
            bb.forward_rows(prompt, cache, slot, [0], need_logits=False)
        p = pack(pasts, trees, toks, bb.device)
        batched = bb.forward_rows(p.tokens, cache, 0, p.starts, p.positions, p.mask).logits
        for r, (prompt, tree) in enumerate(zip(prompts, trees)):
            alone = bb.new_cache()
            bb.forward(prompt, alone, need_logits=False)
            want = score(bb, alone, pasts[r], tree, toks[r]).logits[0]
            assert torch.equal(batched[r, :tree.size], want), (pasts, r)


@needs_onednn
@pytest.mark.parametrize("listed", ["1", "0"])
@pytest.mark.parametrize("right_rank", [0, 1, 10_000])  # first paths, sibling paths, nothing accepted
def test_bf16_speculation_is_byte_identical_to_bf16_plain_decoding(right_rank, listed, monkeypatch):
    """End to end in bf16: a branching static tree (and the batched engine) gives plain
    bf16 decoding's tokens, with drafts accepted on first paths, on sibling paths only, or
    never."""
    from cadence.fast.model import FastBackbone
    from tiny import tiny_backbone

    monkeypatch.setenv("CADENCE_LISTED", listed)
    plain = tiny_backbone("llama", hidden=768, layers=4)
    plain.model.to(torch.bfloat16)
    _speculation_matches_plain_decoding(FastBackbone.from_backbone(plain), right_rank)


@needs_onednn
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_bf16_speculation_over_weight_only_quantized_projections_is_byte_identical(quant):
    """Over int8/int4 projections a forward of fewer than 4 rows is not padded up front
    (their rows do not depend on the row count; attention and the bf16 head pad
    themselves): speculation must still give plain decoding's tokens of that model."""
    from cadence.fast.model import FastBackbone
    from tiny import tiny_backbone

    plain = tiny_backbone("llama", hidden=768, layers=4)
    plain.model.to(torch.bfloat16)
    bb = FastBackbone.from_backbone(plain, quant=quant)
    assert bb.consistent and not bb.pad_up_front
    assert all(layer.qkv.kind == quant and layer.qkv.min_rows == 1 and not layer.qkv.max_rows for layer in bb._layers)
    _speculation_matches_plain_decoding(bb, 0)


def _speculation_matches_plain_decoding(bb, right_rank: int) -> None:
    """Plain decoding's tokens from a branching tree and from a chain, serial and batched."""
    from cadence.decode.engine import Engine
    from cadence.decode.generation import GenerationConfig
    from cadence.schedulers.static import StaticScheduler

    cfg = GenerationConfig(max_new_tokens=40)
    prompts = [bb.encode_prompt(p, chat=True) for p in ("Write a poem about the sea. " * 5, "Count to ten")]
    refs = [Engine(bb).generate(ids, cfg).tokens for ids in prompts]
    for name, branching in (("tree-8", True), ("chain-3", False)):
        tree = StaticScheduler.from_preset(name, 3)
        _each_prompt(bb, prompts, refs, tree, right_rank if branching or right_rank != 1 else None, cfg)


def _each_prompt(bb, prompts, refs, tree, right_rank, cfg) -> None:
    """right_rank None: the right token sits at rank 1, which a chain does not draft."""
    from tiny import OracleDrafter

    from cadence.batch.engine import BatchEngine
    from cadence.batch.narrow import NarrowConfig
    from cadence.decode.engine import Engine

    for ids, ref in zip(prompts, refs):
        drafter = OracleDrafter(ref, len(ids), 3, bb.vocab_size, right_rank=1 if right_rank is None else right_rank)
        out = Engine(bb, drafter, tree).generate(ids, cfg)
        assert out.tokens == ref
        if right_rank in (0, 1):
            assert out.stats.steps < len(ref)  # drafts were accepted
        be = BatchEngine(bb, drafter, tree, max_batch=2, narrow=NarrowConfig(mode="none"))
        rid, toks = be.add(ids, cfg), []
        while be.has_work():
            toks += [t for ev in be.step() if ev.rid == rid for t in ev.tokens]
        assert toks == ref


def test_pad_rows_repeats_the_last_row_and_hides_the_extra_ones():
    ids, pos = torch.tensor([[7, 8]]), torch.tensor([[30, 31]])
    pids, ppos, mask = consistent.pad_rows(ids, pos, None)
    assert pids.tolist() == [[7, 8, 8, 8]] and ppos.tolist() == [[30, 31, 31, 31]]
    assert mask.tolist() == [[True, False, False, False], [True, True, False, False],
                             [True, True, False, False], [True, True, False, False]]
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    _, _, mask = consistent.pad_rows(torch.tensor([[1, 2, 3]]), torch.tensor([[5, 6, 6]]), tree)
    assert mask[3].tolist() == [True, False, True, False]  # the extra row sees what row 2 sees


@pytest.mark.parametrize("b,n,L,four_d", [(1, 4, 256, False), (1, 9, 320, False), (2, 4, 128, True),
                                           (1, 33, 256, False), (1, 21, 200, False)])
def test_grouped_sdpa_same_bits_as_enable_gqa(b, n, L, four_d):
    """Folding the query heads that share a key/value head into the query rows must give
    enable_gqa's bits in bf16 (the row-consistent path relies on them) and its values in fp32.
    Key counts are whole 64-key blocks, as the row-consistent path pads them, or few queries:
    on the AMX Xeon (2026-12-01) 200 keys with 22 or more queries took other bits, in some
    rows, than 200 keys with 4 (folded or not); at multiples of 64 keys none did (252 cases)."""
    from cadence.fast.consistent import grouped_sdpa
    g = torch.Generator().manual_seed(n * L + b)
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(b, 9, n, 64, generator=g).to(dtype)
        k = torch.randn(b, 3, L, 64, generator=g).to(dtype)
        v = torch.randn(b, 3, L, 64, generator=g).to(dtype)
        mask = torch.rand(n, L, generator=g) < 0.7
        mask[:, 0] = True  # no empty row
        if four_d:
            mask = mask[None, None].expand(b, 1, n, L).clone()
            mask[-1, 0, :, 1:] = False  # rows differ between batch rows
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        got = grouped_sdpa(q, k, v, mask)
        assert got.shape == want.shape
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_linear_takes_a_3d_input_as_is_with_the_bits_of_the_2d_call():
    """The direct call (no reshape/pad/slice) for inputs with enough rows gives what the
    padded 2-D path gives, and a 1-row input still goes through the padding."""
    torch.manual_seed(1)
    w = (torch.randn(960, 576) * 0.03).to(torch.bfloat16)
    x = torch.randn(1, 4, 576).to(torch.bfloat16)
    lin = Linear(w, None, "onednn")
    lin.min_rows = consistent.MIN_ROWS
    got = lin(x)
    assert got.shape == (1, 4, 960)
    assert torch.equal(got[0], lin(x[0]))
    for i in range(4):
        assert torch.equal(lin(x[:, i:i + 1])[0, 0], got[0, i])


@needs_onednn
def test_a_forward_folds_its_attention_masks_once_not_per_layer(monkeypatch):
    """Every layer attends with the same masks: a one-token bf16 forward and a chain verify
    fold each (repeat + additive conversion) at the first layer only, and the outputs keep
    the bits of a forward that folds per layer. The Python loop (the C++ one folds in Python
    once per forward: ``FastBackbone._native_forward``)."""
    monkeypatch.setenv("CADENCE_NATIVE", "0")
    from cadence.fast.model import FastBackbone
    from tiny import tiny_backbone

    plain = tiny_backbone("llama", layers=4)
    plain.model.to(torch.bfloat16)
    bb = FastBackbone.from_backbone(plain)
    assert bb.consistent and bb.spec.heads != bb.spec.kv_heads
    calls = []
    real = consistent.fold_mask
    monkeypatch.setattr(consistent, "fold_mask", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(1)
    cache = bb.new_cache()
    bb.forward(torch.randint(0, bb.vocab_size, (1, 30), generator=gen), cache, need_logits=False)
    outs = {}
    for memo in (True, False):
        if not memo:  # a fresh memo per call: what folding per layer gives
            monkeypatch.setattr(consistent.Folded, "__contains__", lambda self, key: False)
            monkeypatch.setattr(consistent.Folded, "get", lambda self, key, mask: consistent.fold_mask(mask, self.g, self.dtype))
        calls.clear()
        for n in (1, 3):
            outs[memo, n] = bb.forward(torch.randint(0, bb.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)),
                                       cache).logits
            cache.compact(30, [])
        folds = len(calls)
        if memo:
            assert folds == 2, folds  # one per forward
        else:
            assert folds == 2 * len(bb._layers)
    for n in (1, 3):
        assert torch.equal(outs[True, n], outs[False, n])


def test_chain_lists_are_the_key_lists_of_a_causal_mask():
    """The chain shortcut gives exactly ``key_lists`` of the lower-triangular mask (dtype,
    shape, padding included), and a caller writing to one result leaves the next intact."""
    for n, starts in ((1, [0]), (1, [57]), (3, [100]), (5, [0, 9]), (8, [3, 3, 40])):
        tril = torch.ones(n, n, dtype=torch.bool).tril_().expand(len(starts), n, n)
        want = consistent.key_lists(tril, starts)
        got = consistent.chain_lists(n, starts)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype == torch.int32 and torch.equal(g, w) and g.is_contiguous()
        for t in got:
            t.fill_(-1)
        assert all(torch.equal(g, w) for g, w in zip(consistent.chain_lists(n, starts), want))
