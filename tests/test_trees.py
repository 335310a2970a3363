"""Trees: presets, greedy growth, compiling (hand-worked examples), attention masks."""

import pytest
import torch

from cadence.backbone.base import _additive_mask

from cadence.errors import CadenceError
from cadence.trees.tree import (chain, compile_tree, expected_tau, grow_tree, preset, preset_names,
                           prior_acceptance)

T, F = True, False


def test_compile_docstring_example():
    t = compile_tree([(0,), (1,), (0, 0)])
    assert t.paths == ((0,), (1,), (0, 0))
    assert t.parents == (-1, 0, 0, 1)
    assert t.depths == (0, 1, 1, 2)
    assert t.ranks == (0, 0, 1, 0)
    assert t.children == ((1, 2), (3,), (), ())
    assert t.size == 4 and t.max_depth == 2 and not t.is_chain
    assert t.mask.tolist() == [[T, F, F, F],
                               [T, T, F, F],
                               [T, F, T, F],
                               [T, T, F, T]]
    assert t.leaf_paths.tolist() == [[0, 2, -1], [0, 1, 3]]
    assert [t.width(i) for i in range(4)] == [2, 1, 0, 0]


def test_compile_orders_nodes_regardless_of_input_order():
    a = compile_tree([(0, 0), (1,), (0,)])
    b = compile_tree([(0,), (1,), (0, 0)])
    assert a.paths == b.paths and a.parents == b.parents and torch.equal(a.mask, b.mask)


def test_compile_bigger_hand_example():
    # root -> (0,) -> (0,0) -> (0,0,0); root -> (0,) -> (0,2); root -> (1,) -> (1,0)
    t = compile_tree([(0,), (1,), (0, 0), (0, 2), (1, 0), (0, 0, 0)], name="hand")
    assert t.name == "hand"
    # node order: (0,) (1,) (0,0) (0,2) (1,0) (0,0,0)
    assert t.paths == ((0,), (1,), (0, 0), (0, 2), (1, 0), (0, 0, 0))
    assert t.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert t.depths == (0, 1, 1, 2, 2, 2, 3)
    assert t.ranks == (0, 0, 1, 0, 2, 0, 0)
    assert t.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    assert t.width(1) == 3  # (0,2) needs three candidates from head 2
    # mask = ancestor-or-self, checked against parents
    for i in range(t.size):
        anc, j = set(), i
        while j >= 0:
            anc.add(j)
            j = t.parents[j]
        assert t.mask[i].tolist() == [j in anc for j in range(t.size)]
    assert t.leaf_paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]


def test_chain_and_root():
    assert chain(3) == [(0,), (0, 0), (0, 0, 0)]
    c = compile_tree(chain(3))
    assert c.is_chain and c.parents == (-1, 0, 1, 2) and c.depths == (0, 1, 2, 3)
    assert torch.equal(c.mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert c.leaf_paths.tolist() == [[0, 1, 2, 3]]
    r = compile_tree([])
    assert r.size == 1 and r.max_depth == 0 and r.is_chain and r.leaf_paths.tolist() == [[0]]


@pytest.mark.parametrize("paths, msg", [
    ([(0,), (0,)], "duplicate"),
    ([(0,), (1, 0)], "no parent"),
    ([(0, 0)], "no parent"),
    ([()], "bad tree path"),
    ([(0,), (-1,)], "bad tree path"),
])
def test_compile_validation(paths, msg):
    with pytest.raises(CadenceError, match=msg):
        compile_tree(paths)


def test_grow_tree_docstring_example():
    acc = [[0.6, 0.3], [0.5, 0.2]]
    assert grow_tree(acc, 1) == [(0,)]
    # (0,0) and (1,) both have value .30; the earlier-pushed (the sibling (1,)) is taken first
    assert grow_tree(acc, 2) == [(0,), (1,)]
    assert grow_tree(acc, 3) == [(0,), (1,), (0, 0)]  # sorted by (depth, ranks)
    assert expected_tau(grow_tree(acc, 3), acc) == pytest.approx(1 + .6 + .3 + .3)
    # the budget larger than the tree space gives every node once
    assert grow_tree(acc, 100) == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
    assert grow_tree([], 5) == []


def test_grow_tree_is_greedy_optimal_prefix():
    acc = prior_acceptance(3)
    prev = 1.0
    for budget in (1, 2, 4, 8, 16):
        paths = grow_tree(acc, budget)
        assert len(paths) == budget
        compile_tree(paths)  # every grown tree is valid (parents present)
        tau = expected_tau(paths, acc)
        assert tau > prev
        prev = tau


def test_presets():
    K = 3
    names = preset_names(K)
    assert names[:2] == ["root", "chain"] and "chain-3" in names and "tree-64" in names
    for name in names:
        t = compile_tree(preset(name, K), name=name)
        assert t.max_depth <= K
        if name.startswith("tree-"):
            assert t.size == int(name[5:]) + 1 and not t.is_chain
    assert preset("root", K) == []
    assert preset("chain", K) == chain(K)
    assert preset("chain-2", K) == chain(2)
    with pytest.raises(CadenceError, match="4 levels deep; this drafter fills at most 3"):
        preset("chain-4", K)
    with pytest.raises(CadenceError, match="unknown tree"):
        preset("tree-5", K)
    with pytest.raises(CadenceError, match="unknown tree"):
        preset("bush", K)


def test_attention_mask():
    t = compile_tree([(0,), (1,), (0, 0)])
    m = _additive_mask(t.mask, past=2, dtype=torch.float32, device="cpu")
    assert m.shape == (1, 1, 4, 6) and m.dtype == torch.float32
    neg = torch.finfo(torch.float32).min
    assert torch.all(m[0, 0, :, :2] == 0)  # the prefix is visible to every node
    expected = torch.where(t.mask, 0.0, neg)
    assert torch.equal(m[0, 0, :, 2:], expected)
    m16 = _additive_mask(t.mask, past=0, dtype=torch.bfloat16, device="cpu")
    assert m16.shape == (1, 1, 4, 4) and m16.dtype == torch.bfloat16
    assert float(m16.min()) == float(torch.finfo(torch.bfloat16).min)
