"""The context copy as a drafter of its own (``--method ngram``): what it drafts, that it is
lossless, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from cadence.draft.copy_drafter import CopyDrafter
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.methods import Method, MethodSpec, make_engine
from cadence.verify.sampling import SamplingParams
from cadence.trees.tree import chain, compile_tree


def test_copies_fill_the_chain_as_far_as_they_exist():
    d = CopyDrafter(depth=4)
    context = [1, 5, 6, 7, 8, 9, 2, 5, 6]  # after 5 6 came 7 8 9, then 2
    out = d.draft(compile_tree(chain(4)), 7, torch.zeros(4), context, SamplingParams(), None, d.new_index())
    assert out.tokens.tolist() == [7, 8, 9, 2, 5] and out.q is None and out.tree is None
    short = d.draft(compile_tree(chain(4)), 4, torch.zeros(4), context, SamplingParams(), None, d.new_index())
    assert short.tokens.tolist() == [4] and short.tree.size == 1  # no copy after ... 6 4: the root alone


def test_only_the_first_rank_gets_a_copy_at_any_temperature():
    d = CopyDrafter(depth=2)
    tree = compile_tree([(0,), (1,), (0, 0)])
    out = d.draft(tree, 6, torch.zeros(4), [5, 6, 7, 3, 5], SamplingParams(), None, None)
    assert out.tokens.tolist() == [6, 7, 3] and out.tree.size == 3  # the rank-1 sibling is dropped
    assert d.max_depth(SamplingParams(temperature=0.7)) == d.max_depth(SamplingParams()) == 2
    sampled = d.draft(tree, 6, torch.zeros(4), [5, 6, 7, 3, 5], SamplingParams(0.7), None, None)
    assert sampled.tokens.tolist() == [6, 7, 3] and sampled.q is None  # point masses: no q


def test_ngram_is_lossless_and_accepts_copies():
    """A 16-token random model repeats n-grams by chance, so some copies are right."""
    from tiny import tiny_backbone

    bb = tiny_backbone("llama", vocab=16, tokenizer=False)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5]
    cfg = GenerationConfig(max_new_tokens=96)
    plain = Engine(bb).generate(prompt, cfg)
    ngram = make_engine(bb, MethodSpec(method=Method.NGRAM)).generate(prompt, cfg)
    assert ngram.tokens == plain.tokens
    assert ngram.stats.steps < len(plain.tokens)  # copies were accepted
    sampled = make_engine(bb, MethodSpec(method=Method.NGRAM)).generate(
        prompt, GenerationConfig(max_new_tokens=12, temperature=0.8, seed=3))
    assert len(sampled.tokens) == 12  # T > 0: copies verified as point masses (test_sampling_lossless)


@pytest.mark.parametrize("spec, match", [
    (MethodSpec(method=Method.NGRAM, scheduler="adaptive"), "needs heads"),
    (MethodSpec(method=Method.NGRAM, copy=False), "nothing to draft"),
    (MethodSpec(method=Method.NGRAM, tree="tree-8"), "drafts chains"),
    (MethodSpec(method=Method.NGRAM, tree="chain-0"), "drafts chains"),
])
def test_ngram_refuses_settings_it_cannot_honour(llama, spec, match):
    with pytest.raises(CadenceError, match=match):
        make_engine(llama, spec)


def test_bench_knows_ngram():
    from cadence.bench.runner import BenchConfig, parse_method

    cfg = BenchConfig(tasks=["writing"], methods=["ngram"])
    assert parse_method("ngram", cfg).spec.method is Method.NGRAM
    assert parse_method("ngram:chain-4", cfg).label == "ngram:chain-4"
    with pytest.raises(CadenceError, match="nothing to draft"):
        parse_method("ngram/nocopy", cfg)
