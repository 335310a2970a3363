"""Context copy: the n-gram index, candidate merging, and decoding with copies (greedy
stays byte-identical to plain decoding; at T > 0 copies are point-mass proposals, whose
distribution tests are in test_sampling_lossless)."""

import pytest
import torch
from test_engine import K, N, bb, reference, spec_engine  # noqa: F401 (bb: fixture)

from cadence.draft.context_copy import CopyConfig, NgramIndex, merge_candidates
from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.generation import GenerationConfig
from cadence.heads import new_heads
from cadence.verify.sampling import SamplingParams
from cadence.trees.tree import compile_tree, preset


def test_index_worked_example():
    idx = NgramIndex(CopyConfig(max_n=3, min_n=2))
    idx.sync([5, 6, 7, 5, 6, 8])
    assert idx.lookup([5, 6]) == 8  # the later occurrence wins
    assert idx.lookup([6, 7]) == 5 and idx.lookup([5, 6, 7]) == 5 and idx.lookup([7, 5, 6]) == 8
    assert idx.lookup([9, 5, 6]) == 8  # no trigram: falls back to the bigram
    assert idx.lookup([6, 8]) is None and idx.lookup([6]) is None  # unseen; too short


def test_index_prefers_the_longest_match():
    idx = NgramIndex(CopyConfig(max_n=3, min_n=2))
    idx.sync([1, 2, 3, 9, 4, 2, 3, 7])
    assert idx.lookup([4, 2, 3]) == 7 and idx.lookup([1, 2, 3]) == 9 and idx.lookup([0, 2, 3]) == 7


def test_sync_extends_and_restarts():
    idx = NgramIndex()
    idx.sync([1, 2, 3])
    idx.sync([1, 2, 3, 1, 2])
    assert len(idx) == 5 and idx.lookup([1, 2]) == 3
    idx.sync([4, 5, 6])  # not an extension: a new request
    assert len(idx) == 3 and idx.lookup([1, 2]) is None and idx.lookup([4, 5]) == 6


def test_merge_candidates():
    assert merge_candidates(7, [3, 7, 9], 3) == [7, 3, 9]
    assert merge_candidates(None, [3, 7, 9], 2) == [3, 7]
    assert merge_candidates(7, [], 3) == [7]
    assert merge_candidates(4, [3, 7, 9], 2) == [4, 3]


def test_drafter_puts_the_copy_first_and_fills_levels_past_k(llama):
    heads = new_heads("hydra", llama, K, random=True, seed=1)
    context = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]
    root = 12  # ... 10 11 12 -> copies continue 13 10 11 12 13 ...
    tree = compile_tree(preset("chain", 6) + [(1,)])
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=6)
    hidden = torch.zeros(llama.hidden_size)
    d = drafter.draft(tree, root, hidden, context, SamplingParams(), None, drafter.new_index())
    chain_nodes = [i for i, p in enumerate(tree.paths, 1) if set(p) == {0}]
    assert [int(d.tokens[i]) for i in chain_nodes] == [13, 10, 11, 12, 13, 10]
    plain = HeadDrafter(heads).draft(compile_tree([(0,), (1,)]), root, hidden, context, SamplingParams(), None)
    assert int(d.tokens[tree.paths.index((1,)) + 1]) == int(plain.tokens[1])  # rank 1 = the head's top-1
    # no copy past K (context without repeats): those levels are dropped, not verified
    d2 = drafter.draft(tree, root, hidden, [1, 2, 3, 4], SamplingParams(), None, drafter.new_index())
    assert d2.tree is not None and d2.tree.max_depth == K and d2.tree.size == K + 2
    assert len(d2.tokens) == d2.tree.size and int(d2.tokens[0]) == root
    assert d.tree is None  # every node carried a candidate: the tree asked for
    with pytest.raises(ValueError, match="depth 6"):
        HeadDrafter(heads).draft(tree, root, hidden, context, SamplingParams(), None)


TREES = ["chain", "tree-8", "tree-16", "chain-6"]


@pytest.mark.parametrize("tree", TREES)
def test_copy_decoding_equals_greedy(bb, tree):
    ids, ref = reference(bb, n=64)
    heads = new_heads("mtp", bb, K, random=True, seed=2)
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=6)
    g = spec_engine(bb, drafter, compile_tree(preset(tree, 6), name=tree)).generate(
        ids, GenerationConfig(max_new_tokens=64))
    assert g.tokens == ref.tokens and g.text == ref.text


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def looping(request):
    """A tiny model whose attention output is zeroed: each token depends on the last one
    only, so greedy output falls into a cycle (llama: 148 148 ..., qwen2: 107 193 259 ...)."""
    from tiny import tiny_backbone

    bb = tiny_backbone(request.param)
    bb.name += "-looping"  # `reference` caches outputs by backbone name
    with torch.no_grad():
        for layer in bb.model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return bb


@pytest.mark.parametrize("tree", TREES)
def test_copies_are_accepted_and_output_is_unchanged(looping, tree):
    ids, ref = reference(looping, n=64)
    heads = new_heads("hydra", looping, K, random=True, seed=2)
    tree_c = compile_tree(preset(tree, 6), name=tree)
    g = spec_engine(looping, HeadDrafter(heads, CopyConfig(), copy_depth=6), tree_c).generate(
        ids, GenerationConfig(max_new_tokens=64))
    plain = spec_engine(looping, HeadDrafter(heads), compile_tree(preset(tree, K) if tree != "chain-6" else preset(
        "chain", K))).generate(ids, GenerationConfig(max_new_tokens=64))
    assert g.tokens == ref.tokens == plain.tokens
    assert plain.stats.tau < 1.5  # random heads alone: (almost) nothing accepted
    # once the cycle is in the context every copy is right: tau approaches depth + 1
    assert g.stats.tau > 0.6 * (tree_c.max_depth + 1), (g.stats.tau, tree_c.max_depth)


def test_sampled_drafts_put_the_copy_first_as_a_point_mass(llama):
    """T > 0: the copy is rank 0 and in ``Draft.fixed``; the heads' draws beside it come from q
    without the copy's token (q's row records that); levels past K hold copies alone."""
    heads = new_heads("hydra", llama, K, random=True, seed=1)
    context = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]
    root = 12  # ... 10 11 12 -> copies continue 13 10 11 12 13 ...
    tree = compile_tree(preset("chain", 6) + [(1,), (2,)])
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=6)
    assert drafter.max_depth(SamplingParams(0.7)) == 6
    g = torch.Generator().manual_seed(0)
    d = drafter.draft(tree, root, torch.zeros(llama.hidden_size), context, SamplingParams(1.0), g,
                      drafter.new_index())
    chain_nodes = [i for i, p in enumerate(tree.paths, 1) if set(p) == {0}]
    assert [int(d.tokens[i]) for i in chain_nodes] == [13, 10, 11, 12, 13, 10]
    assert d.fixed == frozenset(chain_nodes)  # every copy, and nothing the heads drew
    siblings = [tree.paths.index((r,)) + 1 for r in (1, 2)]
    assert all(int(d.tokens[i]) != 13 for i in siblings)
    assert float(d.q[0, 13]) == 0.0 and abs(float(d.q[0].sum()) - 1.0) < 1e-5
    # without a copy the heads draw from their whole q and nothing is fixed
    d2 = HeadDrafter(heads).draft(compile_tree([(0,), (1,)]), root, torch.zeros(llama.hidden_size), context,
                                  SamplingParams(1.0), g)
    assert d2.fixed == frozenset() and float(d2.q[0, 13]) > 0.0


def test_sampled_copies_are_accepted_on_a_looping_model(looping):
    """T > 0 on a model that cycles: copies are right while the sample stays in the cycle (the
    cycle is in the context), so tau rises above what random heads reach alone."""
    ids, _ = reference(looping, n=64)
    heads = new_heads("hydra", looping, K, random=True, seed=2)
    cfg = GenerationConfig(max_new_tokens=64, temperature=0.02, seed=5)  # near-greedy: stays in the cycle
    tree = compile_tree(preset("chain", 6), name="chain-6")
    g = spec_engine(looping, HeadDrafter(heads, CopyConfig(), copy_depth=6), tree).generate(ids, cfg)
    plain = spec_engine(looping, HeadDrafter(heads), compile_tree(preset("chain", K))).generate(ids, cfg)
    assert len(g.tokens) == len(plain.tokens) == 64
    assert plain.stats.tau < 1.5 and g.stats.tau > 1.5, (plain.stats.tau, g.stats.tau)
    assert g.stats.accepted_at_depth[K] > 0  # past the heads' K only copies exist


def test_a_node_without_a_candidate_takes_its_subtree_along(llama, monkeypatch):
    """At T > 0 a node whose copy held all of q gets no draws besides it, so its rank-1 sibling
    goes unfilled. Its children must go too, not be drafted from a parent state that was
    never computed (a KeyError on the AMX Xeon's branching trees, 2026-12-03)."""
    heads = new_heads("hydra", llama, K, random=True, seed=1)
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=K)
    real = drafter._candidates

    def one_for_the_root(logits, vocab_ids, nodes, widths, *args):
        cands, q = real(logits, vocab_ids, nodes, widths, *args)
        return [c[:1] if node == 0 else c for c, node in zip(cands, nodes)], q

    monkeypatch.setattr(drafter, "_candidates", one_for_the_root)
    tree = compile_tree([(0,), (1,), (1, 0), (1, 0, 0)])
    d = drafter.draft(tree, 7, torch.zeros(llama.hidden_size), [1, 2, 3, 4], SamplingParams(temperature=1.0),
                      torch.Generator().manual_seed(0), drafter.new_index())
    assert d.tree is not None and list(d.tree.paths) == [(0,)] and len(d.tokens) == 2
