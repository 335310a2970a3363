"""The ngram method's chain depth: as deep as this request's copy acceptance and this machine's
verify curve pay (``schedulers.copy_chain``)."""

from __future__ import annotations

import pytest

from cadence.costs.latency import LatencyCurve
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.methods import Method, MethodSpec, make_engine
from cadence.schedulers.base import StepInfo
from cadence.schedulers.copy_chain import CopyChainScheduler, best_depth

STEEP = LatencyCurve([1, 2, 3, 4, 5, 6, 7], [1.0, 1.09, 1.12, 1.10, 1.30, 1.50, 1.71])
FLAT = LatencyCurve([1, 64], [1.0, 1.2])
MONOTONE = LatencyCurve([1, 2, 3, 4, 8], [1.0, 1.1, 1.2, 1.3, 1.7])


def test_the_docstring_examples():
    assert best_depth(0.6, STEEP, 6) == 3
    assert best_depth(0.9, STEEP, 6) == 4
    assert best_depth(0.6, FLAT, 8) == 8  # flat verify: the deepest chain
    assert best_depth(0.05, STEEP, 6) == 1  # at least one copy (a step without one is the root anyway)
    assert best_depth(0.99, STEEP, 2) == 2


def test_the_rate_follows_the_request():
    s = CopyChainScheduler(MONOTONE, 6)
    assert s.rate == 0.5 and s.choose(None).tree.size == 1 + best_depth(0.5, MONOTONE, 6) == 3
    for _ in range(40):  # every chain of 3 accepted whole
        s.observe(StepInfo(tree="ngram-3", nodes=4, accepted=3, seconds=0.0, depth=3))
    assert s.rate > 0.9 and s.choose(None).tree.size == 7  # 6 copies pay at 0.9
    for _ in range(60):  # then the first copy is refused every time
        s.observe(StepInfo(tree="ngram-4", nodes=5, accepted=0, seconds=0.0, depth=4))
    assert s.rate < 0.15 and s.choose(None).tree.size == 2
    before = (s.hits, s.trials)
    s.observe(StepInfo(tree="root", nodes=1, accepted=0, seconds=0.0, depth=0))  # no copy: nothing learnt
    assert (s.hits, s.trials) == before
    with pytest.raises(ValueError):
        CopyChainScheduler(STEEP, 0)


def test_auto_chains_are_lossless_and_shorter_where_verify_is_steep():
    from tiny import tiny_backbone

    bb = tiny_backbone("llama", vocab=16, tokenizer=False)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5]
    cfg = GenerationConfig(max_new_tokens=64)
    plain = Engine(bb).generate(prompt, cfg)
    steep = LatencyCurve([1, 2, 3, 9], [1.0, 1.05, 3.0, 9.0])  # more than 1 copy never pays
    spec = MethodSpec(method=Method.NGRAM)
    short = make_engine(bb, spec, latency=steep).generate(prompt, cfg)
    deep = make_engine(bb, spec, latency=FLAT).generate(prompt, cfg)
    fixed = make_engine(bb, MethodSpec(method=Method.NGRAM, tree="chain")).generate(prompt, cfg)
    assert short.tokens == deep.tokens == fixed.tokens == plain.tokens
    assert max(s.nodes for s in short.stats.step_log) == 2 < max(s.nodes for s in deep.stats.step_log)
