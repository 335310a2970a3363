"""EAGLE-2's dynamic tree (``draft.grow``, ``--scheduler dynamic``): the worked examples,
lossless greedy decoding with random and oracle heads of every kind (with and without
context copy), the latency-cut size, and point-mass trees at T > 0 (``--dyn-sampled``)."""

import math

import pytest
import torch
from test_attention_heads import PROMPTS, make, oracle_heads, reference
from tiny import tiny_backbone

from cadence.draft.context_copy import CopyConfig
from cadence.draft.head_drafter import HeadDrafter
from cadence.draft.grow import DynamicTree, _Cand, best_size, draft_dynamic, select, to_draft
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.heads import new_heads
from cadence.methods import Method, MethodSpec, make_engine
from cadence.schedulers.dynamic import DynamicScheduler
from cadence.schedulers.static import StaticScheduler
from cadence.trees.tree import chain, compile_tree


@pytest.fixture(scope="module")
def backbones():
    return {arch: tiny_backbone(arch) for arch in ("llama", "qwen2")}


def _c(id, parent, token, p, depth=1):
    return _Cand(id, parent, token, depth, math.log(p))


def test_select_keeps_ancestors_and_the_best_values():
    a, b = _c(1, 0, 7, .9), _c(2, 0, 8, .5)
    c, d = _c(3, 1, 9, .6, 2), _c(4, 2, 10, .55, 2)
    assert [x.id for x in select([a, b, c, d], 3)] == [1, 3, 2]
    orphan = _c(5, 99, 11, .99, 2)  # its parent was never drafted: never taken
    assert 5 not in [x.id for x in select([a, orphan, b], 3)]


def test_best_size_weighs_acceptance_against_latency():
    step = lambda n: 0.010 if n <= 3 else 0.030  # noqa: E731
    assert best_size([.9, .8, .1], step, 0.0, 16) == 2
    assert best_size([.9, .8, .1], None, 0.0, 2) == 2  # no curve: the cap
    assert best_size([.01], lambda n: 0.010 * n, 0.0, 16) == 0  # a poor draft is not worth a node


def test_to_draft_orders_tokens_as_the_compiled_tree():
    a, b, c = _c(1, 0, 7, .9), _c(2, 0, 8, .5), _c(3, 1, 9, .6, 2)
    d = to_draft(5, select([a, b, c], 3), "cpu")
    assert list(d.tree.paths) == [(0,), (1,), (0, 0)]
    assert d.tokens.tolist() == [5, 7, 8, 9]
    assert d.tree.parents[3] == 1


def dyn_engine(bb, heads, copy=False, **kw):
    drafter = HeadDrafter(heads, CopyConfig() if copy else None, copy_depth=6 if copy else 0)
    spec = DynamicTree(**kw)
    static = compile_tree(chain(heads.K), name="chain")
    return Engine(bb, drafter, lambda s: DynamicScheduler(spec) if s.greedy else StaticScheduler(static))


KINDS = ("eagle", "eagle2", "eagle-taps", "eagle3", "mtp-attn", "hydra", "medusa", "mtp")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_random_heads_dynamic_greedy_identical(backbones, kind, arch):
    bb = backbones[arch]
    heads = make(kind, bb, 3, random=True, seed=1)
    for copy in (False, True):
        eng = dyn_engine(bb, heads, copy, topk=3, max_nodes=10)
        for prompt in PROMPTS:
            out = eng.generate(prompt, GenerationConfig(max_new_tokens=48))
            assert out.tokens == reference(bb, prompt), (kind, arch, copy, prompt)
            assert all(s.tree.startswith("dynamic-") for s in out.stats.step_log)


@pytest.mark.parametrize("kind", ("eagle", "eagle2", "eagle-taps", "eagle3", "mtp-attn"))
def test_oracle_heads_fill_the_dynamic_tree_with_the_right_path(backbones, kind):
    bb = backbones["llama"]
    for prompt in PROMPTS:
        ref = reference(bb, prompt)
        heads = oracle_heads(bb, kind, ref, len(prompt))
        out = dyn_engine(bb, heads, topk=4, max_nodes=8).generate(prompt, GenerationConfig(max_new_tokens=48))
        assert out.tokens == ref
        assert out.stats.tau > 3.5, (kind, out.stats.tau)  # the top path (value ~1) is always drafted


def test_copies_extend_the_tree_past_the_heads(backbones):
    """Random heads draft near-uniform guesses, so the context copy (valued at copy_conf per
    level) carries the tree: after context 1..10, 1, 2, 3 and root 4, the copy chain 5..10
    is drafted to depth 6, past the heads' K = 3."""
    bb = backbones["llama"]
    heads = make("eagle", bb, 3, random=True, seed=1)
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=6)
    ctx = list(range(1, 11)) + [1, 2, 3]
    state = drafter.new_state()
    drafter.commit(state, torch.zeros(len(ctx), bb.hidden_size), ctx)
    d = draft_dynamic(drafter, DynamicTree(topk=2, max_nodes=8, copy_conf=0.9, copy_run_conf=0.9), 4, torch.zeros(bb.hidden_size),
                      ctx, 6, drafter.new_index(), state)
    tree, toks = d.tree, d.tokens.tolist()
    deepest = max(range(tree.size), key=lambda i: tree.depths[i])
    path = []
    while deepest > 0:
        path.append(toks[deepest])
        deepest = tree.parents[deepest]
    assert path[::-1] == [5, 6, 7, 8, 9, 10]


def test_latency_cuts_the_tree(backbones):
    bb = backbones["llama"]
    heads = make("eagle", bb, 3, random=True, seed=1)
    drafter = HeadDrafter(heads)
    hidden = torch.zeros(bb.hidden_size)
    ctx = [1, 2, 3]
    state = drafter.new_state()
    drafter.commit(state, torch.zeros(3, bb.hidden_size), ctx)
    flat = draft_dynamic(drafter, DynamicTree(topk=4, max_nodes=12), 4, hidden, ctx, 3, state=state)
    assert flat.tree.size == 13 and flat.tree.max_depth <= 3
    state = drafter.new_state()
    drafter.commit(state, torch.zeros(3, bb.hidden_size), ctx)
    steep = draft_dynamic(drafter, DynamicTree(topk=4, max_nodes=12, latency=lambda n: 0.01 * n ** 2),
                          4, hidden, ctx, 3, state=state)
    assert steep.tree.size < 4  # random heads' drafts are worth little against a steep curve


def test_sampling_grows_dynamic_trees_of_point_masses(backbones):
    """At T > 0 the tree is grown from the drafter's tempered distribution and drafted for
    point-mass verification (no q); lossless: tests/test_sampling_lossless.py."""
    from cadence.verify.sampling import SamplingParams

    bb = backbones["llama"]
    heads = new_heads("hydra", bb, 3, random=True, seed=1)
    drafter = HeadDrafter(heads)
    d = draft_dynamic(drafter, DynamicTree(topk=3, max_nodes=8), 4, torch.zeros(bb.hidden_size), [1, 2, 3], 3,
                      sampling=SamplingParams(temperature=1.0, top_k=2))
    assert d.q is None and d.tree.size == 9 and d.tree.max_depth <= 3
    assert max(len(c) for c in d.tree.children) <= 2  # top-k 2: no third child anywhere
    eng = Engine(bb, drafter, lambda s: DynamicScheduler(DynamicTree(topk=3, max_nodes=8)))
    out = eng.generate(PROMPTS[0], GenerationConfig(max_new_tokens=16, temperature=1.0, seed=3))
    assert len(out.tokens) == 16 and all(s.tree.startswith("dynamic-") for s in out.stats.step_log)


def test_method_spec_builds_it_and_checks_settings(backbones):
    bb = backbones["llama"]
    spec = MethodSpec.parse("eagle+dynamic@random,max_nodes=6")
    assert spec == MethodSpec(method=Method.EAGLE, heads="random", scheduler="dynamic", options={"max_nodes": 6})
    assert MethodSpec.parse(spec.format()) == spec
    eng = make_engine(bb, spec)
    out = eng.generate(PROMPTS[1], GenerationConfig(max_new_tokens=24))
    assert out.tokens == reference(bb, PROMPTS[1], 24)
    assert all(s.nodes <= 7 for s in out.stats.step_log)
    for bad in (dict(dyn_topk=0), dict(max_nodes=0), dict(max_nodes=128), dict(copy_conf=0.0), dict(copy_conf=1.5),
                dict(copy_run_conf=-1.0)):
        with pytest.raises(CadenceError):
            make_engine(bb, MethodSpec(method=Method.EAGLE, heads="random", scheduler="dynamic", options=bad))


def gated_factory(bb, heads, latency, **spec):
    """The ``dynamic`` scheduler's factory for calibrated heads (a made-up table and curve)."""
    from cadence.heads.tables import DraftPolicy
    from cadence.methods import scheduler_context
    from cadence.schedulers.registry import entry
    from cadence.costs.tree_choice import TreePolicy

    heads.policy = DraftPolicy(acceptance=[[0.8, 0.1]] * 3, copy_acceptance=[[0.8, 0.1]] * 6)
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=6)
    policy = TreePolicy("auto", heads, drafter, latency=latency, draft_s=0.0001)
    ctx = scheduler_context(bb, heads, drafter, policy, MethodSpec(method=Method.EAGLE, scheduler="dynamic", options=spec),
                            "dynamic")
    return drafter, entry("dynamic").build(ctx)


def test_calibrated_heads_gate_speculation_through_adaptive(backbones):
    """Random heads miss every draft: the adaptive gate soon runs the root alone (with shadow
    drafts), and every step that speculates drafts a dynamic tree. Output unchanged."""
    from cadence.costs.latency import LatencyCurve
    from cadence.verify.sampling import SamplingParams
    from cadence.schedulers.adaptive import AdaptiveScheduler
    from cadence.schedulers.dynamic import GatedDynamic

    bb = backbones["llama"]
    heads = make("eagle", bb, 3, random=True, seed=1)
    dear = LatencyCurve(sizes=[1, 2, 4, 8, 16], seconds=[0.010, 0.0125, 0.013, 0.014, 0.017])
    drafter, factory = gated_factory(bb, heads, dear)
    assert isinstance(factory(SamplingParams()), GatedDynamic)
    assert isinstance(factory(SamplingParams(temperature=1.0)), AdaptiveScheduler)  # T > 0: adaptive's trees
    _, sampled = gated_factory(bb, heads, dear, dyn_sampled=True)
    assert isinstance(sampled(SamplingParams(temperature=1.0)), GatedDynamic)  # point masses at T > 0
    out = Engine(bb, drafter, factory).generate(PROMPTS[0], GenerationConfig(max_new_tokens=48))
    assert out.tokens == reference(bb, PROMPTS[0])
    trees = [s.tree for s in out.stats.step_log]
    assert trees.count("root") > len(trees) // 2  # drafts that miss stop being paid for
    assert all(t == "root" or t.startswith("dynamic-") for t in trees)
    assert {s.planned for s in out.stats.step_log} <= {"root", "dynamic"}


def test_gated_oracle_heads_speculate_with_dynamic_trees(backbones):
    from cadence.costs.latency import LatencyCurve

    bb = backbones["llama"]
    prompt = PROMPTS[1]
    ref = reference(bb, prompt)
    heads = oracle_heads(bb, "eagle", ref, len(prompt))
    flat = LatencyCurve(sizes=[1, 64], seconds=[0.010, 0.011])
    drafter, factory = gated_factory(bb, heads, flat)
    out = Engine(bb, drafter, factory).generate(prompt, GenerationConfig(max_new_tokens=48))
    assert out.tokens == ref
    assert out.stats.tau > 3.0
    assert sum(s.tree.startswith("dynamic-") for s in out.stats.step_log) >= len(out.stats.step_log) - 2


def test_copy_trust_follows_the_request():
    from cadence.schedulers.dynamic import CopyTrust

    t = CopyTrust(DynamicTree(copy_conf=0.4, copy_run_conf=0.7), prior=4.0)
    t.observe([(False, False)] * 6)
    assert t.spec().copy_conf == pytest.approx(1.6 / 10)
    assert t.spec().copy_run_conf == pytest.approx(0.7)
    t.observe([(True, True)] * 6)
    assert t.spec().copy_run_conf == pytest.approx((2.8 + 6) / 10)


def test_copy_outcomes_come_back_from_the_engine(backbones):
    """The engine reports, per step, each flagged copy node whose parent was accepted and
    whether it was accepted itself; the scheduler's trust counts them."""
    from cadence.decode.request import copy_outcomes
    from cadence.schedulers.dynamic import DynamicScheduler

    tree = compile_tree([(0,), (0, 0)], name="c")
    assert copy_outcomes(tree, [0, 1], {2: False}) == ((False, False),)
    assert copy_outcomes(tree, [0], {2: False}) == ()
    assert copy_outcomes(tree, [0, 1, 2], {1: False, 2: True}) == ((False, True), (True, True))

    class AllCopies(HeadDrafter):  # flags every drafted node as a first copy
        def draft_dynamic(self, *a, **kw):
            d = super().draft_dynamic(*a, **kw)
            d.copy_nodes = {i: False for i in range(1, d.tree.size)}
            return d

    bb = backbones["llama"]
    prompt = PROMPTS[1]
    ref = reference(bb, prompt, 32)
    heads = oracle_heads(bb, "eagle", reference(bb, prompt), len(prompt))
    sched = DynamicScheduler(DynamicTree(topk=2, max_nodes=4))
    out = Engine(bb, AllCopies(heads), lambda s: sched).generate(prompt, GenerationConfig(max_new_tokens=32))
    assert out.tokens == ref
    judged = [c for s in out.stats.step_log for c in s.copies]
    assert sum(ok for _, ok in judged) >= len(out.stats.step_log) - 1  # the oracle's path is accepted
    assert any(not ok for _, ok in judged)  # its siblings are judged and rejected
    assert sched.trust.n[0] == 4.0 + len(judged)


def test_eagle_drafts_past_k_with_dyn_depth_other_heads_stop_at_k(backbones):
    bb = backbones["llama"]
    prompt = PROMPTS[0]
    ref = reference(bb, prompt)
    heads = oracle_heads(bb, "eagle", ref, len(prompt))
    out = dyn_engine(bb, heads, topk=2, max_nodes=8, depth=5).generate(prompt, GenerationConfig(max_new_tokens=48))
    assert out.tokens == ref
    assert max(s.depth for s in out.stats.step_log) == 5 and out.stats.tau > 4.5
    hydra = new_heads("hydra", bb, 3, random=True, seed=1)
    out = dyn_engine(bb, hydra, topk=2, max_nodes=8, depth=5).generate(prompt, GenerationConfig(max_new_tokens=24))
    assert out.tokens == reference(bb, prompt, 24)
    assert max(s.depth for s in out.stats.step_log) <= 3
