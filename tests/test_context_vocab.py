"""The context vocabulary: heads with a draft vocabulary also draft the request's own
tokens outside it (``cadence.draft.context_vocab``, ``HeadDrafter(context_vocab=N)``)."""

import pytest
import torch
from tiny import tiny_backbone

from cadence.draft.context_vocab import ContextVocab, ContextVocabs
from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.heads import new_heads
from cadence.verify.sampling import SamplingParams
from cadence.schedulers.static import StaticScheduler
from cadence.trees.tree import chain, compile_tree


def test_tracker_keeps_the_most_recent_outside_tokens():
    inside = [t in (1, 2) for t in range(10)]
    cv = ContextVocab(inside, limit=2)
    ctx = [1, 7, 2, 8, 7]
    cv.update(ctx)
    assert cv.ids().tolist() == [8, 7]  # 7 seen again last
    ctx.append(9)
    cv.update(ctx)
    assert cv.ids().tolist() == [7, 9] and cv.seen == 6
    assert ContextVocab(inside, 4).ids() is None


def test_trackers_follow_their_context_list_and_include_the_root():
    vocabs = ContextVocabs(torch.tensor([1, 2]), 10, limit=3)
    a, b = [1, 5], [2, 6, 6]
    assert vocabs.extra_ids(a, 1).tolist() == [5]
    assert vocabs.extra_ids(b, 9).tolist() == [6, 9]  # the root (not yet in the context) counts
    a.extend([7, 8])
    assert vocabs.extra_ids(a, 2).tolist() == [5, 7, 8]
    assert vocabs.extra_ids(a, 4).tolist() == [7, 8, 4]  # limit 3: the oldest gives way
    a.clear()  # a list that shrank starts over
    assert vocabs.extra_ids(a, 1) is None


def test_ids_stay_the_same_tensor_until_an_outside_token_comes():
    """The drafter keys its gathered LM-head rows on the ids tensor's identity: a context that
    grew by tokens inside the vocabulary, or the same root again, must hand out the same tensor,
    and a new outside token a new one (a stale tensor would score the wrong rows)."""
    vocabs = ContextVocabs(torch.tensor([1, 2]), 10, limit=3)
    ctx = [1, 5]
    first = vocabs.extra_ids(ctx, 1)
    ctx.extend([1, 2, 2])  # inside the vocabulary only
    assert vocabs.extra_ids(ctx, 2) is first
    with_root = vocabs.extra_ids(ctx, 9)
    assert with_root.tolist() == [5, 9] and vocabs.extra_ids(ctx, 9) is with_root
    assert vocabs.extra_ids(ctx, 8).tolist() == [5, 8]
    ctx.append(6)
    grown = vocabs.extra_ids(ctx, 1)
    assert grown is not first and grown.tolist() == [5, 6]


def test_drafter_rescores_the_context_tokens_when_they_change():
    """The drafter's kept LM-head rows follow the ids: after an outside token enters the
    context, its row is scored (a draft can propose it)."""
    bb = tiny_backbone()
    vocab = list(range(0, bb.vocab_size, 2))  # even ids only
    d = HeadDrafter(_heads(bb, vocab), context_vocab=4)
    ctx = [0, 2, 3]
    ids, rows = d._extra_rows(d.context_vocab.extra_ids(ctx, 2))
    assert ids.tolist() == [3] and torch.equal(rows, d.heads.lm_rows(torch.tensor([3])))
    ctx.append(5)
    ids, rows = d._extra_rows(d.context_vocab.extra_ids(ctx, 2))
    assert ids.tolist() == [3, 5] and torch.equal(rows, d.heads.lm_rows(torch.tensor([3, 5])))


def _heads(bb, vocab):
    return new_heads("hydra", bb, 3, random=True, seed=1).set_draft_vocab(torch.tensor(vocab))


def test_drafts_can_be_context_tokens_only_with_the_context_vocabulary():
    bb = tiny_backbone("llama")
    heads = _heads(bb, list(range(10)))
    real = heads.draft_logits
    heads.draft_logits = lambda feats: real(feats) - 1e4  # the draft vocabulary never wins
    tree = compile_tree(chain(3))
    context = [3, 50, 4, 60, 70]
    hidden = torch.randn(bb.hidden_size)
    for n, allowed in ((0, set(range(10))), (8, {50, 60, 70, 80})):
        d = HeadDrafter(heads, context_vocab=n).draft(tree, 80, hidden, context, SamplingParams(), None)
        drafted = set(d.tokens[1:].tolist())
        assert drafted and drafted <= allowed, (n, drafted)


@pytest.mark.parametrize("kind", ["hydra", "medusa", "eagle"])
def test_context_vocabulary_keeps_greedy_output_identical(kind):
    bb = tiny_backbone("llama")
    heads = new_heads(kind, bb, 3, random=True, seed=2).set_draft_vocab(torch.arange(0, 40))
    prompts = ([5, 90, 11, 3, 90, 9, 11, 3], [200, 41, 200, 43, 40, 41], [7] * 12 + [100, 101, 7, 7])
    for tree in ("chain", "tree-8"):
        eng = Engine(bb, HeadDrafter(heads, context_vocab=16), StaticScheduler.from_preset(tree, 3))
        for p in prompts:
            ref = Engine(bb).generate(p, GenerationConfig(max_new_tokens=40)).tokens
            assert eng.generate(p, GenerationConfig(max_new_tokens=40)).tokens == ref, (kind, tree, p)


class OracleChainDrafter(HeadDrafter):
    """On a chain, ranks the reference continuation first among the candidates the drafter
    has (draft vocabulary plus, when on, the context vocabulary)."""

    def arm(self, ref, plen):
        self.ref, self.plen = ref, plen
        return self

    def draft(self, tree, root, hidden, context, *args, **kwargs):
        self._next, self._depth = self.ref[len(context) - self.plen + 1:], 0
        return super().draft(tree, root, hidden, context, *args, **kwargs)

    def logits(self, feats, extra):
        logits, ids = super().logits(feats, extra)
        if self._depth < len(self._next):
            hit = (ids == self._next[self._depth]).nonzero()
            if hit.numel():
                logits[:, hit[0, 0]] = logits.max() + 10.0
        self._depth += 1
        return logits, ids


def test_oov_tokens_are_accepted_only_with_the_context_vocabulary():
    """Oracle drafts whose draft vocabulary misses most of the output: only the context
    vocabulary lets them propose (and get accepted) tokens seen earlier in the request."""
    bb = tiny_backbone("llama")
    prompt = [5, 90, 11, 3, 90, 9, 11, 3] * 2
    ref = Engine(bb).generate(prompt, GenerationConfig(max_new_tokens=48)).tokens
    seen, recurring = set(prompt), 0
    for t in ref:
        recurring += t >= 10 and t in seen
        seen.add(t)
    assert recurring >= 5  # the output repeats tokens outside the draft vocabulary
    taus = {}
    for n in (0, 64):
        drafter = OracleChainDrafter(_heads(bb, list(range(10))), context_vocab=n).arm(ref, len(prompt))
        eng = Engine(bb, drafter, StaticScheduler.from_preset("chain", 3))
        out = eng.generate(prompt, GenerationConfig(max_new_tokens=48))
        assert out.tokens == ref
        taus[n] = out.stats.tau
    assert taus[64] > taus[0] + 0.2, taus  # measured 1.02 -> 1.30


def test_calibration_scores_a_context_token_from_the_position_after_it_appears():
    from cadence.calibration.acceptance import _context_logits

    bb = tiny_backbone("llama")
    heads = _heads(bb, list(range(10)))
    ids = torch.tensor([5, 90, 7, 90, 11, 3, 2])  # 90 first at 1, 11 first at 4 (both outside)
    feats = torch.randn(5, bb.hidden_size)  # positions t = 1..5
    logits, uniq = _context_logits(heads, feats, ids, t0=1)
    assert uniq.tolist() == [11, 90]
    w = bb.lm_head.weight[uniq]
    finite = torch.isfinite(logits)
    # 90 visible from t = 0 on (x[0..t+1] holds it); 11 from t = 3 on
    assert finite[:, 1].all() and finite[:, 0].tolist() == [False, False, True, True, True]
    assert torch.allclose(logits[finite], (feats @ w.T)[finite], atol=1e-5)
    assert _context_logits(heads, feats, torch.tensor([1, 2, 3]), t0=0) is None


def test_entropy_profiles_rank_context_tokens_when_asked(tmp_path):
    """EntMTP's profiles measure what the drafter drafts: with the context vocabulary their
    pooled table is ``rank_tables``' with it, and it accepts more than without it when the
    draft vocabulary itself never wins."""
    from cadence.backbone.load import load_backbone
    from cadence.calibration.acceptance import rank_tables
    from cadence.calibration.entropy_profiles import measure_profiles
    from test_training_support import make_data, tiny_model_dir

    def recurring(rng, plen, rlen):  # replies cycle through their prompt's tokens, all outside 0..9
        prompt = [rng.randrange(10, 250) for _ in range(plen)]
        return prompt + [prompt[i % plen] for i in range(rlen)]

    bb = load_backbone(str(tiny_model_dir(tmp_path)), device="cpu")
    data = make_data(tmp_path / "data", n_train=4, n_val=8, sequence=recurring)
    heads = _heads(bb, list(range(10)))
    real = heads.draft_logits
    heads.draft_logits = lambda feats: real(feats) - 1e4  # only context tokens can rank first
    top1 = {}
    for cv in (False, True):
        prof = measure_profiles(bb, heads, data, ["general"], bins=1, tokens=10_000, ranks=4, copy=None,
                                context_vocab=cv)["general"]
        want = rank_tables(bb, heads, data, tokens=10_000, ranks=4, context_vocab=cv)[0]
        assert prof.counts[0] > 0
        assert torch.allclose(torch.tensor(prof.tables[0]), torch.tensor(want), atol=1e-6)
        top1[cv] = sum(row[0] for row in prof.tables[0])
    assert top1[False] == 0 and top1[True] > 0, top1
