"""SerialEngine (cadence.batch.serial): many requests on one Engine, round-robin; every
request's output equals its single-request output, whatever joins or leaves when."""

from __future__ import annotations

import pytest
from tiny import OracleDrafter

from cadence.batch.serial import SerialEngine
from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.heads import new_heads
from cadence.schedulers.static import StaticScheduler
from cadence.trees.tree import compile_tree

K = 3
PROMPTS = ("Write a poem about the sea.", "Count to ten.", "abc abc abc abc", "x")


def run_all(multi: SerialEngine, joins: dict[int, list] | None = None, max_steps: int = 10_000):
    """Step until idle; ``joins``: step index -> [(prompt_ids, cfg)] added before that step.
    Returns rid -> events."""
    events: dict[int, list] = {}
    joins = dict(joins or {})
    for step in range(max_steps):
        for ids, cfg in joins.pop(step, []):
            events[multi.add(ids, cfg)] = []
        if not multi.has_work() and not joins:
            return events
        for ev in multi.step():
            events[ev.rid].append(ev)
    raise AssertionError("did not finish")


def test_joins_and_leaves_equal_single_requests(llama):
    heads = new_heads("hydra", llama, K, random=True, seed=1)
    eng = Engine(llama, HeadDrafter(heads), StaticScheduler.from_preset("tree-4", K))
    reqs = [(llama.encode_prompt(p, chat=i % 2 == 0), GenerationConfig(max_new_tokens=n, **kw))
            for i, (p, n, kw) in enumerate(zip(PROMPTS, (14, 6, 12, 8),
                                              ({}, {}, {"temperature": 0.9, "seed": 3}, {})))]
    alone = [eng.generate(ids, cfg) for ids, cfg in reqs]
    multi = SerialEngine(eng, max_batch=2)
    events = run_all(multi, {0: reqs[:3], 3: reqs[3:]})  # the 4th joins late; the 3rd waits for a slot
    assert multi.running == 0 and multi.queued == 0 and not multi.has_work()
    for (rid, evs), ref in zip(sorted(events.items()), alone):
        assert [t for e in evs for t in e.tokens] == ref.tokens
        assert "".join(e.text for e in evs) == ref.text
        assert [e.finished for e in evs] == [False] * (len(evs) - 1) + [True]
        assert evs[-1].finish_reason == "length" and evs[-1].stats.new_tokens == len(ref.tokens)


def test_at_most_max_batch_run(llama):
    eng = Engine(llama)
    multi = SerialEngine(eng, max_batch=2)
    ids = llama.encode_prompt("hello", chat=False)
    for _ in range(3):
        multi.add(ids, GenerationConfig(max_new_tokens=5))
    assert (multi.running, multi.queued) == (0, 3)
    evs = multi.step()
    assert (multi.running, multi.queued) == (2, 1) and len(evs) == 2


def test_stop_string_and_eos_finish_with_stop(llama):
    eng = Engine(llama)
    ids = llama.encode_prompt(PROMPTS[0], chat=True)
    full = eng.generate(ids, GenerationConfig(max_new_tokens=30)).text
    stop = full[8:11]
    cfg = GenerationConfig(max_new_tokens=30, stop=(stop,))
    ref = eng.generate(ids, cfg)
    evs = run_all(SerialEngine(eng), {0: [(ids, cfg)]})[1]
    assert "".join(e.text for e in evs) == ref.text == full[:full.index(stop)]
    assert evs[-1].finish_reason == "stop"


def test_abort_frees_the_slot_now(llama):
    multi = SerialEngine(Engine(llama), max_batch=1)
    ids = llama.encode_prompt("hello", chat=False)
    a = multi.add(ids, GenerationConfig(max_new_tokens=50))
    b = multi.add(ids, GenerationConfig(max_new_tokens=3))
    multi.step()
    assert (multi.running, multi.queued) == (1, 1)
    multi.abort(a)
    multi.abort(12345)  # unknown ids are ignored
    assert (multi.running, multi.queued) == (0, 1)
    evs = _drain(multi)
    assert {e.rid for e in evs} == {b} and evs[-1].finished  # b ran to its end; nothing more from a
    assert not multi.has_work()
    multi.abort(b)  # finished: ignored


def test_bad_requests_are_refused_at_add(llama):
    multi = SerialEngine(Engine(llama))
    with pytest.raises(CadenceError, match="empty prompt"):
        multi.add([], GenerationConfig())
    with pytest.raises(CadenceError, match="positions"):
        multi.add([1] * 500, GenerationConfig(max_new_tokens=100))
    with pytest.raises(CadenceError, match="drafter"):
        multi.add([1, 2], GenerationConfig(), scheduler=lambda s: StaticScheduler.from_preset("chain", 2))
    assert not multi.has_work()
    with pytest.raises(CadenceError, match="max_batch"):
        SerialEngine(Engine(llama), max_batch=0)


def test_speculation_counters_and_scheduler_override(llama):
    """An oracle accepts every draft: events report drafted / accepted per step, matching the
    request's statistics; a per-request scheduler (the root alone) drafts nothing."""
    ids = llama.encode_prompt(PROMPTS[0], chat=True)
    ref = Engine(llama).generate(ids, GenerationConfig(max_new_tokens=24))
    eng = Engine(llama, OracleDrafter(ref.tokens, len(ids), K, llama.vocab_size),
                 StaticScheduler.from_preset("chain", K))
    multi = SerialEngine(eng)
    root_only = StaticScheduler(compile_tree([], name="root"))
    events = run_all(multi, {0: [(ids, GenerationConfig(max_new_tokens=24))]})
    evs = events[1]
    assert [t for e in evs for t in e.tokens] == ref.tokens
    stats = evs[-1].stats
    assert sum(e.accepted for e in evs) == sum(s.accepted for s in stats.step_log) > 0
    assert sum(e.drafted for e in evs) == sum(s.nodes - 1 for s in stats.step_log)
    depth = [sum(len(e.accepted_at) > d for e in evs) for d in range(K)]
    assert depth == stats.accepted_at_depth
    rid = multi.add(ids, GenerationConfig(max_new_tokens=24), scheduler=lambda s: root_only)
    evs = [e for e in _drain(multi) if e.rid == rid]
    assert [t for e in evs for t in e.tokens] == ref.tokens
    assert all(e.drafted == 0 and e.accepted == 0 for e in evs)


def _drain(multi):
    out = []
    while multi.has_work():
        out.extend(multi.step())
    return out


def test_a_failing_request_ends_alone(llama, monkeypatch):
    multi = SerialEngine(Engine(llama))
    ids = llama.encode_prompt("hello", chat=False)
    bad = multi.add(ids, GenerationConfig(max_new_tokens=10))
    good = multi.add(ids, GenerationConfig(max_new_tokens=10))
    multi.step()
    req = multi._running[bad]
    monkeypatch.setattr(req, "step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    evs = multi.step()
    failed = [e for e in evs if e.rid == bad]
    assert failed[0].finished and failed[0].finish_reason == "error" and "boom" in failed[0].error
    rest = _drain(multi)
    assert rest[-1].rid == good and rest[-1].finished and rest[-1].finish_reason == "length"
