"""Chunked prefill in the batched engine: a long prompt enters a few tokens per step while
other rows decode, every row's output still equals the request run alone, no step spends
more than ``prefill_chunk`` prompt tokens while rows are running, and a request whose
prompt is going in can be aborted, cut or fail alone."""

from __future__ import annotations

import pytest
import torch
from test_batch_engine import NONE, K, PromptOracle, fast, plain, run
from tiny import OracleDrafter

from cadence.batch import prefill as prefill_mod
from cadence.batch.engine import BatchEngine
from cadence.batch.narrow import NarrowConfig
from cadence.batch.prefill import causal_mask
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.schedulers.static import StaticScheduler


@pytest.fixture(scope="module")
def bb():
    return fast("llama")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(bb, ids, refs, chunk, max_batch=3, right=None):
    right = right or [0] * len(ids)  # per prompt: the rank its drafts put the right token at
    drafter = PromptOracle({tuple(i): OracleDrafter(r.tokens, len(i), K, bb.vocab_size, right_rank=w)
                        for i, r, w in zip(ids, refs, right)})
    return BatchEngine(bb, drafter, StaticScheduler.from_preset("tree-8", K), max_batch=max_batch,
                       narrow=NarrowConfig(mode="none"), prefill_chunk=chunk)


def spy_chunks(monkeypatch):
    """Record the prompt tokens each ``Prefill.advance`` call writes."""
    written = []
    real = prefill_mod.Prefill.advance

    def advance(self, *args, **kwargs):
        n = real(self, *args, **kwargs)
        written.append((self.req, n))
        return n

    monkeypatch.setattr(prefill_mod.Prefill, "advance", advance)
    return written


def test_causal_mask_worked_example():
    assert causal_mask(2, 2)[0, 0].int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert causal_mask(0, 3)[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_a_prompt_in_chunks_fills_the_cache_as_one_forward_does(bb, chunk):
    """The same 37-token prompt prefilled whole (slot 0) and in chunks (slot 1): equal
    keys and values and last state (float rounding), and the request's root token agrees."""
    ids = prompt(37, 1)
    cache = bb.new_batch_cache(2, capacity=8)
    whole = bb.forward_rows(torch.tensor([ids]), cache, 0, [0], need_logits=False)
    from cadence.decode.engine import Engine
    req = Engine(bb).start(ids, GenerationConfig(max_new_tokens=4))
    req.cache = cache.row(1)
    p = prefill_mod.Prefill(req, 1)
    while p.remaining:
        p.advance(bb, cache, chunk)
    p.finish()
    n = len(ids)
    assert cache.lengths[:2] == [n, n]
    assert (cache.k[:, 0, :, :n] - cache.k[:, 1, :, :n]).abs().max() < 1e-4
    assert (cache.v[:, 0, :, :n] - cache.v[:, 1, :, :n]).abs().max() < 1e-4
    assert (req.hidden - whole.hidden[0, -1]).abs().max() < 1e-4
    assert req.root == int(bb.logits(whole.hidden[0, -1]).argmax())


@pytest.mark.parametrize("chunk", [3, 16])
def test_long_prompts_join_running_rows_in_chunks_and_every_row_equals_its_single_request(bb, monkeypatch, chunk):
    """Two short rows decode while two long prompts (90 and 61 tokens) arrive: the long
    ones enter ``chunk`` tokens per step, one after the other; a short row finishing
    while a prompt is going in moves it down a slot; all four outputs equal plain decoding."""
    written = spy_chunks(monkeypatch)
    moves = []
    ids = [prompt(6, 2), prompt(8, 3), prompt(90, 4), prompt(61, 5)]
    cfgs = [GenerationConfig(max_new_tokens=n) for n in (3, 80, 12, 9)]
    refs = [plain(bb, i, c) for i, c in zip(ids, cfgs)]
    be = engine(bb, ids, refs, chunk, max_batch=4, right=[0, NONE, 0, 1])  # row 1: one token a step
    real_move = be.cache.move
    monkeypatch.setattr(be.cache, "move", lambda s, d: (moves.append((s, d)), real_move(s, d)))
    joins = {0: [(ids[0], cfgs[0], None), (ids[1], cfgs[1], None)], 1: [(ids[2], cfgs[2], None), (ids[3], cfgs[3], None)]}
    toks, _, last, order = run(be, joins)
    for k, rid in enumerate(order):
        assert toks[rid] == refs[k].tokens, k
        assert last[rid].finish_reason == "length"
    long_chunks = [n for req, n in written if len(req.prompt_ids) > 50]
    assert max(long_chunks) <= chunk and sum(long_chunks) == 90 + 61
    assert len(long_chunks) >= (90 + 61) // chunk
    assert moves, "a row left while a prompt was going in: the prompt's slot moved down"
    assert not be.has_work() and be.cache.lengths == [0] * 4


def test_no_step_spends_more_than_the_chunk_while_rows_run(bb, monkeypatch):
    """Per step, the prompt tokens written while some row was running never exceed the
    chunk (several short prompts may share one step's budget); with no row running the
    whole prompt goes in at once."""
    chunk = 10
    ids = [prompt(5, 6), prompt(33, 7), prompt(4, 8), prompt(4, 9)]
    cfgs = [GenerationConfig(max_new_tokens=30)] + [GenerationConfig(max_new_tokens=5)] * 3
    refs = [plain(bb, i, c) for i, c in zip(ids, cfgs)]
    be = engine(bb, ids, refs, chunk, max_batch=4)
    per_step: list[int] = []
    real = prefill_mod.Prefill.advance

    def advance(self, *args, **kwargs):
        n = real(self, *args, **kwargs)
        per_step[-1] += n
        return n

    monkeypatch.setattr(prefill_mod.Prefill, "advance", advance)
    rids = [be.add(ids[0], cfgs[0])]
    per_step.append(0)
    be.step()
    assert per_step == [5]  # nothing was running: the whole prompt
    rids += [be.add(i, c) for i, c in zip(ids[1:], cfgs[1:])]
    out = {r: [] for r in rids}
    while be.has_work():
        per_step.append(0)
        for ev in be.step():
            out[ev.rid] += ev.tokens
    assert max(per_step[1:]) <= chunk
    assert sum(per_step) == sum(map(len, ids))
    for rid, ref in zip(rids[1:], refs[1:]):
        assert out[rid] == ref.tokens


def test_a_request_whose_prompt_is_going_in_can_be_aborted_cut_or_fail_alone(bb, monkeypatch):
    ids = [prompt(6, 10), prompt(70, 11), prompt(50, 12)]
    cfg = GenerationConfig(max_new_tokens=20)
    refs = [plain(bb, i, cfg) for i in ids]
    be = engine(bb, ids, refs, 8)
    got: dict[int, list[int]] = {}
    finals = {}

    def step():
        for e in be.step():
            got.setdefault(e.rid, []).extend(e.tokens)
            if e.finished:
                finals[e.rid] = e

    a = be.add(ids[0], cfg)
    step()
    b = be.add(ids[1], cfg)
    step()
    assert be.filling is not None and be.filling.rid == b and (be.running, be.queued) == (1, 1)
    be.abort(b)
    assert be.filling is None and be.queued == 0 and be.cache.lengths[1] == 0
    c = be.add(ids[2], cfg)
    step()
    ev = be.cut(c)
    assert ev.finished and ev.finish_reason == "length" and ev.tokens == []
    assert be.filling is None and be.cut(c) is None

    real = bb.forward_rows

    def forward_rows(input_ids, cache, first, starts, *args, **kwargs):
        if input_ids.shape[0] == 1 and starts[0] >= 8 and first == len(be.rows):  # a later chunk of a prompt
            raise RuntimeError("kernel fault")
        return real(input_ids, cache, first, starts, *args, **kwargs)

    monkeypatch.setattr(bb, "forward_rows", forward_rows)
    d = be.add(ids[1], cfg)
    while be.has_work():
        step()
    assert finals[d].finish_reason == "error" and finals[d].error_status == 500 and got.get(d, []) == []
    assert "kernel fault" in finals[d].error
    assert finals[a].finish_reason == "length" and got[a] == refs[0].tokens  # unharmed throughout
    assert b not in finals and c not in finals
    assert be.cache.lengths == [0] * 3


def test_prefill_chunk_must_be_a_non_negative_integer(bb):
    with pytest.raises(CadenceError, match="prefill_chunk"):
        BatchEngine(bb, prefill_chunk=-1)
    with pytest.raises(CadenceError, match="prefill_chunk"):
        BatchEngine(bb, prefill_chunk=2.5)
