"""The batched engine is lossless per row: every row's output equals the same request run
alone on ``Engine`` (greedy: token for token; sampling: the same draws with the same
seed), whatever the other rows do: prompt lengths, acceptance (heads that accept
everything, nothing, or some), trees, stop strings, EOS, budgets, join and abort times.
Also: the ragged forward equals per-row forwards, cache compaction and slot moves, and
the narrowing policy."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import BackboneDrafter, OracleDrafter, tiny_backbone

from cadence.batch.engine import BatchEngine
from cadence.batch.layout import pack
from cadence.trees.budget import MAX_NODES
from cadence.batch.narrow import BatchLatency, CappedScheduler, NarrowConfig, Narrowing, prune
from cadence.draft.context_copy import CopyConfig
from cadence.draft.grow import DynamicTree
from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.fast.model import FastBackbone
from cadence.heads import new_heads
from cadence.schedulers.static import StaticScheduler
from cadence.schedulers.dynamic import DynamicScheduler
from cadence.trees.tree import compile_tree

K = 3
PROMPTS = ["Write a poem about the sea.", "x", "The quick brown fox jumps over the lazy dog, twice over.",
           "Hi", "Count: one two three four five six seven"]
NONE = 10_000  # a rank no tree has: the drafter never proposes the right token


def fast(arch="llama", **kw) -> FastBackbone:
    return FastBackbone.from_backbone(tiny_backbone(arch, **kw))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def fbb(request):
    return fast(request.param)


@pytest.fixture(scope="module")
def fllama():
    return fast("llama")


class PromptOracle:
    """One ``OracleDrafter`` per prompt, picked by the prompt the context starts with, so
    rows of one batch can have different acceptance patterns (``right_rank`` per prompt)."""

    def __init__(self, cases: dict):
        self.cases = cases  # tuple(prompt ids) -> OracleDrafter
        self.num_heads = K

    def max_depth(self, sampling):
        return K

    def new_index(self):
        return None

    def draft(self, tree, root, hidden, context, sampling, generator, copies=None):
        for prompt, oracle in self.cases.items():
            if tuple(context[:len(prompt)]) == prompt:
                return oracle.draft(tree, root, hidden, context, sampling, generator, copies)
        raise AssertionError("unknown prompt")


def plain(bb, ids, cfg):
    return Engine(bb).generate(ids, cfg)


def run(be: BatchEngine, joins: dict[int, list], until_done=True, max_steps=10_000):
    """Drive ``be``; ``joins[s]`` = [(ids, cfg, scheduler)] added before step s. Returns
    {rid: tokens}, {rid: text}, {rid: final event} and the order rids were added in."""
    toks, text, last, order = {}, {}, {}, []
    s = 0
    while (s <= max(joins, default=0) or be.has_work()) and s < max_steps:
        for ids, cfg, sched in joins.get(s, []):
            rid = be.add(ids, cfg, sched)
            toks[rid], text[rid] = [], ""
            order.append(rid)
        for ev in be.step():
            toks[ev.rid] += ev.tokens
            text[ev.rid] += ev.text
            assert not ev.finished or ev.rid not in last
            if ev.finished:
                last[ev.rid] = ev
        s += 1
    return toks, text, last, order


def test_refuses_a_backbone_without_batched_forward(llama):
    with pytest.raises(CadenceError, match="SerialEngine"):
        BatchEngine(llama)
    with pytest.raises(CadenceError, match="max_batch"):
        BatchEngine(fast(), max_batch=0)


def test_forward_rows_equals_one_forward_per_row(fllama):
    """Three rows with different pasts and trees in one ragged forward give each row's
    logits of a forward on its own cache; compaction and slot moves keep rows intact."""
    bb = fllama
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 4, 13)]
    trees = [compile_tree([(0,)]), compile_tree([(0,), (1,), (0, 0), (1, 0), (1, 1)]), compile_tree([])]
    cache = bb.new_batch_cache(4, capacity=8)  # grows while prefilling
    singles = []
    for slot, p in enumerate(prompts):
        bb.forward_rows(torch.tensor([p]), cache, slot, [0], need_logits=False)
        c = bb.new_cache()
        bb.forward(torch.tensor([p]), c, need_logits=False)
        singles.append(c)
    toks = [torch.randint(0, 256, (t.size,), generator=gen) for t in trees]
    p = pack([len(x) for x in prompts], trees, toks, bb.device)
    out = bb.forward_rows(p.tokens, cache, 0, p.starts, p.positions, p.mask)
    for b, (tree, c) in enumerate(zip(trees, singles)):
        pos = (torch.tensor(tree.depths) + len(prompts[b]))[None]
        ref = bb.forward(toks[b][None], c, pos, tree.mask).logits[0]
        assert (out.logits[b, :tree.size] - ref).abs().max() < 1e-4
    assert not torch.isnan(out.logits).any()  # padding nodes too
    assert cache.lengths[:3] == [len(x) + 6 for x in prompts]  # padded to 6 nodes until compacted
    cache.compact(1, len(prompts[1]), [0, 2, 4])
    singles[1].compact(len(prompts[1]), [0, 2, 4])
    cache.compact(2, len(prompts[2]), [0])
    cache.move(2, 0)  # row 2 into slot 0 (row 0 gone)
    cache.move(1, 3)
    for slot, c in ((0, singles[2]), (3, singles[1])):
        n = cache.lengths[slot]
        assert n == c.length()
        assert (cache.k[:, slot, :, :n] - c.k[:, 0, :, :n]).abs().max() < 1e-4  # batched rounding
        assert (cache.v[:, slot, :, :n] - c.v[:, 0, :, :n]).abs().max() < 1e-4
    assert cache.lengths[1] == cache.lengths[2] == 0


def test_greedy_rows_equal_single_requests(fbb):
    """Five rows, max batch 3: different prompt lengths, budgets, trees and acceptance
    (all, nothing, rank-1 branches, random ranks); two rows join later, reusing slots."""
    bb = fbb
    ids = [bb.encode_prompt(p, chat=True) for p in PROMPTS]
    budgets = [30, 7, 25, 1, 18]
    cfgs = [GenerationConfig(max_new_tokens=n) for n in budgets]
    refs = [plain(bb, i, c) for i, c in zip(ids, cfgs)]
    rng = random.Random(3)
    ranks = [rng.choice([0, 0, 1, 2, NONE]) for _ in range(64)]
    right = [0, NONE, 1, 0, lambda i: ranks[i]]
    drafter = PromptOracle({tuple(i): OracleDrafter(r.tokens, len(i), K, bb.vocab_size, right_rank=w)
                            for i, r, w in zip(ids, refs, right)})
    trees = ["chain", "tree-8", compile_tree([(0,), (1,), (1, 0), (1, 1), (1, 1, 0), (1, 1, 1)], "rank1"),
             "tree-16", "tree-64"]
    scheds = []
    for t in trees:
        s = StaticScheduler(t) if not isinstance(t, str) else StaticScheduler.from_preset(t, K)
        scheds.append(lambda sampling, s=s: s)
    be = BatchEngine(bb, drafter, max_batch=3, narrow=NarrowConfig(mode="none"))
    joins = {0: [(ids[i], cfgs[i], scheds[i]) for i in (0, 1, 2)], 2: [(ids[3], cfgs[3], scheds[3])],
             5: [(ids[4], cfgs[4], scheds[4])]}
    toks, text, last, order = run(be, joins)
    for k, rid in enumerate(order):
        assert toks[rid] == refs[k].tokens, k
        assert text[rid] == refs[k].text
        ev = last[rid]
        assert ev.finish_reason == "length" and ev.stats.new_tokens == budgets[k]
        single = Engine(bb, drafter, scheds[k]).generate(ids[k], cfgs[k]).stats
        assert ev.stats.steps == single.steps and ev.stats.accepted_at_depth == single.accepted_at_depth
    taus = [last[rid].stats.tau for rid in order]
    assert taus[0] > 3 and taus[1] == 1.0  # accept-everything vs accept-nothing rows
    assert not be.has_work() and be.running == be.queued == 0 and be.cache.lengths == [0, 0, 0]


def test_random_heads_with_context_copy_equal_plain_greedy(fllama):
    bb = fllama
    heads = new_heads("hydra", bb, K, random=True, seed=2)
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=6)
    cfg = GenerationConfig(max_new_tokens=40)
    ids = [bb.encode_prompt(p, chat=False) for p in PROMPTS]
    be = BatchEngine(bb, drafter, StaticScheduler.from_preset("tree-16", 6), max_batch=4,
                     narrow=NarrowConfig(mode="none"))
    toks, _, last, order = run(be, {0: [(i, cfg, None) for i in ids]})
    for k, rid in enumerate(order):
        assert toks[rid] == plain(bb, ids[k], cfg).tokens, k
    assert sum(sum(last[r].stats.accepted_at_depth[:1]) for r in order) > 0  # copies were accepted


def test_stop_strings_eos_and_budgets(fllama):
    """Rows stop on a stop string, on EOS and on their budget in the same batch; each
    row's text and tokens equal the single request's, and finish reasons are right."""
    base = fllama
    ids = base.encode_prompt(PROMPTS[0], chat=True)
    free = plain(base, ids, GenerationConfig(max_new_tokens=40))
    eos_tok = free.tokens[12]
    bb = fast("llama", eos=eos_tok)
    stop = free.text[6:9]
    cases = [(ids, GenerationConfig(max_new_tokens=40, stop=(stop,))),
             (ids, GenerationConfig(max_new_tokens=40)),  # EOS
             (bb.encode_prompt(PROMPTS[2], chat=True), GenerationConfig(max_new_tokens=3)),
             (bb.encode_prompt(PROMPTS[4], chat=True), GenerationConfig(max_new_tokens=2))]
    refs = [plain(bb, i, c) for i, c in cases]
    assert refs[1].tokens[-1] == eos_tok and len(refs[1].tokens) < 40
    assert stop not in refs[0].text and len(refs[0].tokens) < 40
    drafter = PromptOracle({tuple(ids): OracleDrafter(refs[1].tokens, len(ids), K, bb.vocab_size)} | {
        tuple(i): OracleDrafter(r.tokens, len(i), K, bb.vocab_size) for (i, _), r in zip(cases[2:], refs[2:])})
    be = BatchEngine(bb, drafter, StaticScheduler.from_preset("tree-8", K), max_batch=4,
                     narrow=NarrowConfig(mode="none"))
    toks, text, last, order = run(be, {0: [(i, c, None) for i, c in cases]})
    for k, rid in enumerate(order):
        assert toks[rid] == refs[k].tokens, k
        assert text[rid] == refs[k].text, k
    assert [last[r].finish_reason for r in order] == ["stop", "stop", "length", "length"]


def test_abort_frees_the_slot_and_queue(fllama):
    bb = fllama
    ids = [bb.encode_prompt(p, chat=True) for p in PROMPTS[:3]]
    cfg = GenerationConfig(max_new_tokens=12)
    be = BatchEngine(bb, max_batch=1)
    a, b, c = (be.add(i, cfg) for i in ids)
    be.step()
    assert (be.running, be.queued) == (1, 2)
    be.abort(a)
    assert (be.running, be.queued) == (0, 2) and be.cache.lengths == [0]
    be.abort(c)  # queued
    be.abort(12345)  # unknown: ignored
    assert be.queued == 1
    got = []
    while be.has_work():
        for ev in be.step():
            assert ev.rid == b
            got += ev.tokens
    assert got == plain(bb, ids[1], cfg).tokens


def test_bad_requests_are_refused_at_add(fllama):
    be = BatchEngine(fllama, max_batch=2)
    with pytest.raises(CadenceError, match="empty prompt"):
        be.add([], GenerationConfig())
    with pytest.raises(CadenceError, match="positions"):
        be.add([1] * 500, GenerationConfig(max_new_tokens=100))
    assert not be.has_work()


@pytest.mark.parametrize("mix", [0.0, 0.5])
def test_sampled_rows_equal_single_requests_with_the_same_seed(mix):
    """T > 0: each row draws from its own generator in the single request's order, so a
    row's sample is the single request's sample (speculative sampling is lossless there,
    ``test_sampling_lossless``). mix 0: q = p (accepts all); 0.5: partial acceptance."""
    bb = fast("llama", vocab=16, tokenizer=False, seed=1)
    drafter = BackboneDrafter(bb, K, mix=mix)
    sched = StaticScheduler(compile_tree([(0,), (1,), (0, 0), (0, 0, 0)], "branch"))  # siblings + depth 3
    prompts = [[1, 5, 2, 7, 3], [4], [9, 9, 8, 1, 2, 3, 4, 5, 6, 7, 0]]
    cfgs = [GenerationConfig(max_new_tokens=12, temperature=t, top_p=p, seed=s)
            for t, p, s in ((0.8, 1.0, 1), (1.0, 0.9, 2), (0.6, 1.0, 3))]
    refs = [Engine(bb, drafter, sched).generate(p, c) for p, c in zip(prompts, cfgs)]
    be = BatchEngine(bb, drafter, sched, max_batch=2, narrow=NarrowConfig(mode="none"))
    toks, _, last, order = run(be, {0: [(p, c, None) for p, c in zip(prompts, cfgs)]})
    for k, rid in enumerate(order):
        assert toks[rid] == refs[k].tokens, k
        assert last[rid].stats.steps == refs[k].stats.steps
    if mix == 0.0:
        assert all(last[r].stats.tau > 2 for r in order)


def test_narrowing_caps_nodes_as_the_batch_grows(fllama):
    """A latency grid where extra nodes are free at batch 1 and cost their full share at
    batch 4: rows run their tree alone, and the root alone once 4 rows decode together.
    Output stays equal to plain greedy."""
    sizes = [1, 2, 4, 8, 16]
    grid = BatchLatency([1, 4], sizes, [[0.010] * 5, [0.040 * s for s in sizes]])
    narrowing = Narrowing(NarrowConfig(), grid)
    table = [[0.6, 0.2], [0.5, 0.2], [0.4, 0.2]]
    assert narrowing.cap(1, table, K) == MAX_NODES  # a lone row is not narrowed (min_batch 2)
    assert Narrowing(NarrowConfig(min_batch=1), grid).cap(1, table, K) == 15  # free nodes: all 2+4+8 the table fills
    assert narrowing.cap(4, table, K) == 1
    assert Narrowing(NarrowConfig(mode="root"), grid).cap(4, table, K) == 1
    assert Narrowing(NarrowConfig(mode="root", min_batch=5), grid).cap(4, table, K) > 1
    assert Narrowing(NarrowConfig(mode="none", max_nodes=3), grid).cap(4, table, K) == 3

    bb = fllama
    ids = [bb.encode_prompt(p, chat=True) for p in PROMPTS[:4]]
    cfg = GenerationConfig(max_new_tokens=10)
    refs = [plain(bb, i, cfg) for i in ids]
    drafter = PromptOracle({tuple(i): OracleDrafter(r.tokens, len(i), K, bb.vocab_size) for i, r in zip(ids, refs)})
    be = BatchEngine(bb, drafter, StaticScheduler.from_preset("tree-8", K), max_batch=4,
                     narrow=NarrowConfig(), latency=grid)
    toks, _, last, order = run(be, {0: [(i, cfg, None) for i in ids]})
    for k, rid in enumerate(order):
        assert toks[rid] == refs[k].tokens
        assert all(s.nodes == 1 for s in last[rid].stats.step_log)  # 4 rows: root only
    be = BatchEngine(bb, drafter, StaticScheduler.from_preset("tree-8", K), max_batch=4,
                     narrow=NarrowConfig(), latency=grid)
    toks, _, last, order = run(be, {0: [(ids[0], cfg, None)]})
    assert toks[order[0]] == refs[0].tokens
    assert max(s.nodes for s in last[order[0]].stats.step_log) > 1  # alone: its tree


def test_prune_keeps_the_likeliest_ancestor_closed_nodes():
    tree = compile_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], "t")
    small = prune(tree, 4)
    assert small.paths == ((0,), (0, 0), (0, 0, 0))
    assert prune(tree, 1).size == 1 and prune(tree, 99) is tree
    for size in range(1, tree.size + 1):
        kept = set(prune(tree, size).paths)
        assert all(p[:-1] in kept for p in kept if len(p) > 1)


def test_capped_scheduler_passes_through():
    inner = StaticScheduler.from_preset("tree-8", K)
    capped = CappedScheduler(inner)
    capped.cap = 3
    assert capped.choose(None).tree.size == 3
    capped.cap = 100
    assert capped.choose(None).tree is inner.plan.tree
    assert capped.plan is inner.plan  # the wrapped scheduler's attributes


def test_the_cap_binds_dynamic_trees_too(fllama):
    """A dynamic plan (the drafter grows the tree; its nominal tree is the root alone) gets
    its node budget lowered to the cap, or becomes the root alone at cap 1; in the batched
    engine with narrowing to the root, dynamic rows verify one node a step and still equal
    plain decoding. (Before, dynamic trees ignored the cap: narrowing did nothing for the
    default scheduler.)"""
    spec = DynamicTree(topk=3, max_nodes=16)
    capped = CappedScheduler(DynamicScheduler(spec))
    capped.cap = 5
    plan = capped.choose(None)
    assert plan.dynamic.max_nodes == 4 and spec.max_nodes == 16
    capped.cap = 1
    plan = capped.choose(None)
    assert plan.dynamic is None and plan.tree.size == 1
    capped.cap = 100
    assert capped.choose(None).dynamic.max_nodes == 16
    bb = fllama
    heads = new_heads("hydra", bb, K, random=True, seed=2)
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=6)
    cfg = GenerationConfig(max_new_tokens=20)
    ids = [bb.encode_prompt(p, chat=False) for p in PROMPTS[:3]]
    for mode, most in (("root", 1), ("none", 17)):
        be = BatchEngine(bb, drafter, lambda sampling: DynamicScheduler(spec), max_batch=3,
                         narrow=NarrowConfig(mode=mode, measured=False))
        toks, _, last, order = run(be, {0: [(i, cfg, None) for i in ids]})
        nodes = [info.nodes for r in order for info in last[r].stats.step_log[1:]]  # after each row's first step
        assert max(nodes) <= most and (mode == "root" or max(nodes) > 1)
        for k, rid in enumerate(order):
            assert toks[rid] == plain(bb, ids[k], cfg).tokens, k


def test_row_at_the_position_limit_beside_a_big_tree(fllama):
    """A row whose prompt + budget fill the model's 512 positions decodes next to a row
    verifying 65-node trees: its padding nodes land past the limit, in the cache's headroom."""
    bb = fllama
    long_ids = [40 + i % 50 for i in range(500)]
    short = bb.encode_prompt(PROMPTS[0], chat=True)
    cfgs = [GenerationConfig(max_new_tokens=12), GenerationConfig(max_new_tokens=30)]
    refs = [plain(bb, i, c) for i, c in zip((long_ids, short), cfgs)]
    drafter = PromptOracle({tuple(i): OracleDrafter(r.tokens, len(i), K, bb.vocab_size)
                            for i, r in zip((long_ids, short), refs)})
    sched = {0: lambda s: StaticScheduler.from_preset("chain-1", K), 1: lambda s: StaticScheduler.from_preset("tree-64", K)}
    be = BatchEngine(bb, drafter, max_batch=2, narrow=NarrowConfig(mode="none"))
    toks, _, last, order = run(be, {0: [(long_ids, cfgs[0], sched[0]), (short, cfgs[1], sched[1])]})
    assert [toks[r] for r in order] == [refs[0].tokens, refs[1].tokens]
    assert be.cache.capacity > bb.max_positions  # the padding went past the model's positions


# ------------------------------------------------------------------ row isolation


def _poisoned(n: int) -> GenerationConfig:
    """Settings that pass ``GenerationConfig``'s checks and then turn bad (a drift of inf,
    which JSON's 1e999 once carried past them): the row fails at its first verification."""
    cfg = GenerationConfig(max_new_tokens=n)
    cfg.drift = float("inf")
    return cfg


class _Broken:
    """A scheduler with a bug (not the request's fault): every plan raises."""

    def choose(self, state):
        raise RuntimeError("scheduler bug")

    def observe(self, info):
        pass


def _isolation_case(bb):
    ids = [bb.encode_prompt(p, chat=True) for p in PROMPTS]
    cfg = GenerationConfig(max_new_tokens=16)
    refs = [plain(bb, i, cfg).tokens for i in ids]
    drafter = HeadDrafter(new_heads("hydra", bb, K, random=True, seed=2), CopyConfig())
    be = BatchEngine(bb, drafter, StaticScheduler.from_preset("tree-8", K), max_batch=4,
                     narrow=NarrowConfig(mode="none"))
    return ids, cfg, refs, be


def test_a_failing_row_ends_alone_and_the_others_equal_single_requests(fllama):
    """Among five rows, one whose settings turn bad (400) and one whose scheduler raises
    (500) end alone with an error event; the three others, in the same steps, produce
    their single-request tokens, and the engine ends empty."""
    ids, cfg, refs, be = _isolation_case(fllama)
    joins = {0: [(ids[0], cfg, None), (ids[1], _poisoned(16), None), (ids[2], cfg, None)],
             2: [(ids[3], cfg, lambda sampling: _Broken()), (ids[4], cfg, None)]}
    toks, _, last, order = run(be, joins)
    bad, broken = order[1], order[3]
    assert last[bad].finish_reason == "error" and last[bad].error_status == 400
    assert "drift" in last[bad].error
    assert last[broken].finish_reason == "error" and last[broken].error_status == 500
    assert "scheduler bug" in last[broken].error
    for k in (0, 2, 4):
        assert toks[order[k]] == refs[k], k
        assert last[order[k]].finish_reason == "length"
    assert not be.has_work() and be.cache.lengths == [0] * 4


def test_a_forward_that_fails_on_one_row_is_rerun_row_by_row(fllama, monkeypatch):
    """The batched verify forward raises whenever it covers one row's slot (a fault of
    the engine's, 500): that row ends alone, the others go on with their own tokens."""
    ids, cfg, refs, be = _isolation_case(fllama)
    real = fllama.forward_rows
    victim = 2  # the third request added (ids count from 0)

    def forward_rows(input_ids, cache, first, starts, *args, **kwargs):
        slot = next((r.slot for r in be.rows if r.rid == victim), None)
        if any(starts) and slot is not None and first <= slot < first + input_ids.shape[0]:
            raise RuntimeError("kernel fault")
        return real(input_ids, cache, first, starts, *args, **kwargs)

    monkeypatch.setattr(fllama, "forward_rows", forward_rows)
    toks, _, last, order = run(be, {0: [(i, cfg, None) for i in ids[:4]]})
    assert order[2] == victim
    assert last[victim].finish_reason == "error" and last[victim].error_status == 500
    assert "kernel fault" in last[victim].error and toks[victim] == []
    for k in (0, 1, 3):
        assert toks[order[k]] == refs[k], k
    assert not be.has_work()


def test_cut_ends_a_request_as_its_budget_would(fllama):
    """``cut`` (a deadline): the request leaves at once with finish_reason "length" and the
    text held back so far; its tokens so far are a prefix of the single request's."""
    bb = fllama
    ids = bb.encode_prompt(PROMPTS[0], chat=True)
    cfg = GenerationConfig(max_new_tokens=30)
    ref = plain(bb, ids, cfg)
    be = BatchEngine(bb, max_batch=2)
    a, b = be.add(ids, cfg), be.add(ids, cfg)
    got, text = [], ""
    for _ in range(5):
        for ev in be.step():
            if ev.rid == a:
                got += ev.tokens
                text += ev.text
    ev = be.cut(a)
    assert ev.finished and ev.finish_reason == "length" and ev.tokens == []
    assert got == ref.tokens[:len(got)] and ref.text.startswith(text + ev.text)
    assert be.running == 1 and be.cut(a) is None
    assert be.cut(b).finish_reason == "length" and not be.has_work()


def test_copies_first_rows_equal_plain_greedy_and_a_cap_keeps_them_copies():
    """Rows whose schedulers run copy chains alone (``schedulers.copy_first``) in one batch:
    each row still equals plain decoding; a capped copies-only plan stays copies-only."""
    from cadence.costs.latency import LatencyCurve
    from cadence.schedulers.base import StepState
    from cadence.schedulers.copy_chain import CopyChainScheduler
    from cadence.schedulers.copy_first import CopyFirst

    bb = fast("llama", vocab=16, tokenizer=False)  # a small vocabulary: random weights soon repeat themselves
    curve = LatencyCurve([1, 2, 4, 8], [0.010, 0.011, 0.012, 0.016])
    drafter = HeadDrafter(new_heads("hydra", bb, K, random=True, seed=3), CopyConfig(), copy_depth=6)
    tree = StaticScheduler.from_preset("tree-8", K).plan.tree
    factory = lambda sampling: CopyFirst(StaticScheduler(tree), CopyChainScheduler(curve, 6, name="copies"),  # noqa: E731
                                         curve)
    cfg = GenerationConfig(max_new_tokens=40)
    ids = [[1, 2, 3, 4, 5, 6] * 2 + [1, 2, 3], [5, 6, 7, 8] * 4, [9, 10, 11] * 5 + [9], [3, 1, 4, 1, 5, 9, 2, 6],
           [1, 2] * 8]
    be = BatchEngine(bb, drafter, factory, max_batch=4, narrow=NarrowConfig(mode="none"))
    toks, _, last, order = run(be, {0: [(i, cfg, None) for i in ids]})
    for k, rid in enumerate(order):
        assert toks[rid] == plain(bb, ids[k], cfg).tokens, k
    trees = [s.tree for r in order for s in last[r].stats.step_log]
    assert any(t.startswith("copies-") for t in trees)
    capped = CappedScheduler(factory(None))
    capped.cap = 2
    assert capped.wants_copy
    capped.inner.runs[0] = capped.inner.runs[1] = 1  # both arms seen: copies lead (no rates yet: ties go to copies)
    plan = capped.choose(StepState(hidden=None, root_logits=None, step=0, new_tokens=0, past=0, copy=5))
    assert plan.copies_only and plan.tree.size <= 2


def test_the_default_method_with_a_datastore_batches_rows_equal_to_plain_greedy(fllama, tmp_path, monkeypatch):
    """``--method auto`` on a model without heads is ngram; with ``--datastore`` a store of the
    model's own replies: batched (as ``cadence serve`` runs it), every row equals plain greedy
    decoding and the store's copies are accepted."""
    from cadence.costs.latency import LatencyCurve
    from cadence.methods import Method, MethodSpec, make_engine
    from cadence.training.store import encode_shard, new_manifest, write_manifest, write_store_shard

    monkeypatch.setenv("CADENCE_CACHE", str(tmp_path / "cache"))
    bb = fllama
    cfg = GenerationConfig(max_new_tokens=24)
    ids = [bb.encode_prompt(p, chat=False) for p in PROMPTS]
    refs = [plain(bb, i, cfg).tokens for i in ids]
    store = tmp_path / "store"  # one train shard: each reply twice (an entry needs 2), after a 1-token prompt
    store.mkdir()
    seqs = [[1, *r] for r in refs for _ in range(2)]
    write_store_shard(store / "shard-00000.npz", encode_shard(seqs, [1] * len(seqs), {}, bb.vocab_size))
    manifest = new_manifest("tiny", bb.vocab_size)
    manifest["shards"] = [{"file": "shard-00000.npz", "split": "train", "sequences": len(seqs)}]
    write_manifest(store, manifest)
    flat = LatencyCurve(sizes=[1, 64], seconds=[0.010, 0.011])  # a measured curve would cost seconds here
    engine = make_engine(bb, MethodSpec(datastore=str(store)), latency=flat)
    assert engine.spec.method is Method.NGRAM and engine.drafter.datastore is not None
    be = BatchEngine.from_engine(engine, max_batch=4, narrow=NarrowConfig(mode="none"))
    toks, _, last, order = run(be, {0: [(i, cfg, None) for i in ids]})
    assert [toks[rid] for rid in order] == refs
    assert sum(last[r].stats.tau for r in order) / len(order) > 1.5  # the store holds every reply
