"""Shadow drafts: a root-alone step that also drafts the depth-1 top candidate, never
commits it, and reports whether the backbone's next token matched (``Plan.shadow``)."""

import pytest

from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.schedulers.base import Plan
from cadence.trees.tree import compile_tree
from tiny import OracleDrafter, tiny_backbone

ROOT = compile_tree([], name="root")


class ShadowEvery:
    """Root alone every step, always asking for a shadow draft; keeps what it observed."""

    def __init__(self):
        self.seen = []

    def choose(self, state):
        return Plan(ROOT, shadow=True)

    def observe(self, info):
        self.seen.append(info)


@pytest.fixture(scope="module")
def bb():
    return tiny_backbone("llama")


def run(bb, right_rank, temperature=0.0, n=16):
    ids = [5, 17, 33, 2, 9]
    cfg = GenerationConfig(max_new_tokens=n, temperature=temperature, seed=3)
    ref = Engine(bb).generate(ids, cfg)
    sched = ShadowEvery()
    drafter = OracleDrafter(ref.tokens, len(ids), 2, bb.vocab_size, right_rank=right_rank)
    out = Engine(bb, drafter, lambda sampling: sched).generate(ids, cfg)
    return ref, out, sched.seen


@pytest.mark.parametrize("right_rank, expect", [(0, True), (1, False)])
def test_shadow_reports_what_the_draft_would_have_scored_and_commits_nothing(bb, right_rank, expect):
    ref, out, seen = run(bb, right_rank)
    assert out.tokens == ref.tokens  # the shadow is never committed
    assert all(s.nodes == 1 and s.accepted == 0 for s in seen)  # only the root was verified
    # every step but the last one that drafts (its next token is past the reference's end)
    assert [s.shadows for s in seen[:-1]] == [(expect,)] * (len(seen) - 1)


def test_no_shadow_when_sampling(bb):
    ref, out, seen = run(bb, 0, temperature=0.8)
    assert out.tokens == ref.tokens  # same seed, nothing drawn for a shadow: the same stream
    assert all(s.shadows == () for s in seen)


def test_shadow_is_none_unless_asked(bb):
    ids = [5, 17, 33]
    ref = Engine(bb).generate(ids, GenerationConfig(max_new_tokens=8))
    assert all(s.shadows == () for s in ref.stats.step_log)


@pytest.mark.parametrize("copy", [False, True])
def test_the_cheap_shadow_is_the_token_a_one_draft_chain_carries(bb, copy):
    """HeadDrafter.shadow (the copy first, else head 1's argmax) == draft(chain of 1)."""
    import torch

    from cadence.draft.context_copy import CopyConfig
    from cadence.draft.head_drafter import HeadDrafter
    from cadence.decode.request import SHADOW_CHAIN
    from cadence.heads import new_heads
    from cadence.verify.sampling import SamplingParams

    drafter = HeadDrafter(new_heads("hydra", bb, 2, random=True, seed=4), CopyConfig() if copy else None)
    gen = torch.Generator().manual_seed(0)
    context = [1, 2, 3, 4, 9, 1, 2]  # root 3: "1 2 3" was followed by 4 -> a copy
    for root in (3, 5, 8, 11, 40):
        h = torch.randn(bb.hidden_size, generator=gen)
        full = drafter.draft(SHADOW_CHAIN, root, h, context, SamplingParams(), None, drafter.new_index())
        cheap = drafter.shadow(root, h, context, drafter.new_index())
        assert cheap == int(full.tokens[1])
        if copy and root == 3:
            assert cheap == 4


class ShadowBatched(ShadowEvery):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def choose(self, state):
        return Plan(ROOT, shadow=True, shadow_batch=self.batch)


class ReusedBuffers:
    """The backbone, but every forward's hidden states land in one reused buffer (as a
    fast backbone's preallocated outputs do): a state kept past its step must be copied."""

    def __init__(self, bb):
        self._bb, self._buf = bb, None

    def __getattr__(self, name):
        return getattr(self._bb, name)

    def forward(self, *args, **kwargs):
        import torch

        out = self._bb.forward(*args, **kwargs)
        if self._buf is None:
            self._buf = torch.empty(1, 64, out.hidden.shape[-1], dtype=out.hidden.dtype)
        n = out.hidden.shape[1]
        if n > self._buf.shape[1]:
            return out
        self._buf[:, :n].copy_(out.hidden)
        return type(out)(**{**vars(out), "hidden": self._buf[:, :n]})


@pytest.mark.parametrize("kind", ["hydra", "eagle", "eagle3"])
@pytest.mark.parametrize("copy", [False, True])
def test_batched_shadows_give_the_verdicts_one_at_a_time_would_give(bb, copy, kind):
    """Plan.shadow_batch = 4: head-drafted shadows are judged four at a time in one head
    call (eagle: one LM-head call over its cache's features of the roots' entries), in
    order, with the same verdicts as judging each at once (also when the backbone reuses
    its output buffers); context copies are judged at once; nothing is committed differently."""
    from cadence.draft.context_copy import CopyConfig
    from cadence.draft.head_drafter import HeadDrafter
    from cadence.heads import new_heads

    ids = [5, 17, 33, 2, 9, 5, 17, 33]  # a repeat: the copy guesses some steps
    cfg = GenerationConfig(max_new_tokens=24)
    ref = Engine(bb).generate(ids, cfg)
    seen = {}
    for batch in (1, 4):
        heads = new_heads(kind, bb, 2, random=True, seed=1)
        drafter = HeadDrafter(heads, CopyConfig() if copy else None)
        assert drafter.batches_shadows
        sched = ShadowBatched(batch)
        out = Engine(ReusedBuffers(bb), drafter, lambda sampling: sched).generate(ids, cfg)
        assert out.tokens == ref.tokens
        seen[batch] = sched.seen
    one = [v for s in seen[1] for v in s.shadows]
    batched = [v for s in seen[4] for v in s.shadows]
    assert len(batched) >= len(one) - 3  # at most three still waiting at the end
    assert batched == one[:len(batched)]
    sizes = [len(s.shadows) for s in seen[4] if s.shadows]
    assert max(sizes) >= 4 if not copy else max(sizes) >= 1
    assert any(v is False for v in one) or any(one)  # shadows ran at all


def test_a_pending_shadow_keeps_its_own_state_when_the_backbone_reuses_buffers(bb):
    """Deferred (h, root) pairs hold the state each step really had, not whatever a later
    forward wrote into a reused output buffer."""
    import torch

    from cadence.draft.head_drafter import HeadDrafter
    from cadence.heads import new_heads

    ids = [5, 17, 33, 2]
    drafter = HeadDrafter(new_heads("hydra", bb, 2, random=True, seed=1), None)
    sched = ShadowBatched(64)  # never full: every shadow stays pending
    req = Engine(ReusedBuffers(bb), drafter, lambda sampling: sched).start(ids, GenerationConfig(max_new_tokens=6))
    for _ in req:
        pass
    rows = req.shadow_rows
    assert len(rows) >= 3
    seq = ids + req.tokens
    full = bb.forward(torch.tensor([seq]), bb.new_cache()).hidden[0]  # (len, d)
    for i, (h, root, truth) in enumerate(rows):  # step i: root = reply token i
        at = len(ids) - 1 + i  # the position whose state produced it
        assert (root, truth) == (seq[at + 1], seq[at + 2])
        assert torch.allclose(h, full[at], atol=1e-4)


@pytest.mark.parametrize("batch", [1, 4])
def test_eagle_shadows_of_heads_that_know_the_continuation_all_hit(bb, batch):
    """Heads that put the backbone's next token first: every shadow, judged at once or four
    at a time from the features of the roots' cache entries, would have been accepted (a
    deferred shadow judged at the wrong entry would miss)."""
    from test_attention_heads import oracle_heads

    from cadence.draft.head_drafter import HeadDrafter

    ids = [5, 17, 33, 2, 9]
    cfg = GenerationConfig(max_new_tokens=24)
    ref = Engine(bb).generate(ids, cfg).tokens
    sched = ShadowBatched(batch)
    drafter = HeadDrafter(oracle_heads(bb, "eagle", ref, len(ids)))
    out = Engine(bb, drafter, lambda sampling: sched).generate(ids, cfg)
    assert out.tokens == ref
    verdicts = [v for s in sched.seen for v in s.shadows]
    assert len(verdicts) >= len(ref) - 5 and all(verdicts[:-1])  # the last guess is past the reference
