"""Whole-step measurement in the batched engine: per batch size it runs the faster of
speculating and the root alone, probes the other now and then, and never changes output."""

from __future__ import annotations

from test_batch_engine import K, fast, plain, run
from tiny import OracleDrafter

from cadence.batch.engine import BatchEngine
from cadence.batch.narrow import BatchLatency, NarrowConfig
from cadence.batch.step_rates import ROOT, SPECULATE, StepRates
from cadence.decode.generation import GenerationConfig
from cadence.schedulers.static import StaticScheduler


def drive(rates: StepRates, batch: int, speeds: dict, steps: int) -> list[str]:
    """Run ``steps`` steps where each mode commits ``speeds[mode]`` tokens per second."""
    modes = []
    for _ in range(steps):
        m = rates.mode(batch)
        modes.append(m)
        rates.record(batch, m, speeds[m], 1.0)
    return modes


def test_the_faster_mode_runs_and_the_other_is_probed_now_and_then():
    rates = StepRates(explore_every=10, probe=2)
    modes = drive(rates, 8, {SPECULATE: 230, ROOT: 290}, 40)
    assert modes[:4] == [SPECULATE, SPECULATE, ROOT, ROOT]  # both measured first
    later = modes[4:]
    assert later.count(ROOT) > 3 * later.count(SPECULATE) > 0  # mostly the faster, probes of the other
    assert rates.rates()[8][ROOT] == 290 and rates.rates()[8][SPECULATE] == 230
    rates = StepRates(explore_every=10, probe=2)
    assert drive(rates, 2, {SPECULATE: 200, ROOT: 100}, 40)[4:].count(SPECULATE) >= 30
    assert 8 not in rates.rates()  # batch sizes are kept apart


def test_a_change_in_speed_is_followed():
    rates = StepRates(explore_every=5, probe=2, alpha=0.5)
    drive(rates, 4, {SPECULATE: 300, ROOT: 100}, 20)
    assert rates.mode(4) == SPECULATE or rates.rates()[4][SPECULATE] > rates.rates()[4][ROOT]
    modes = drive(rates, 4, {SPECULATE: 50, ROOT: 100}, 40)  # speculation got slow (other prompts)
    assert modes[-21:].count(ROOT) >= 14  # 5 of each 7 steps, the other 2 probe speculation


def _engine(bb, ids, refs, **narrow):
    drafter = OracleDrafter(refs[0].tokens, len(ids[0]), K, bb.vocab_size)
    grid = BatchLatency([1, 2, 4], [1, 2, 4, 8], [[0.01] * 4, [0.01] * 4, [0.01] * 4])  # speculation looks free
    return BatchEngine(bb, drafter, StaticScheduler.from_preset("tree-8", K), max_batch=4,
                       narrow=NarrowConfig(**narrow), latency=grid)


def test_the_engine_runs_the_root_alone_where_that_measured_faster_and_output_is_unchanged():
    """Three copies of one prompt (the oracle knows its continuation): with measured steps
    saying the root alone is faster at 3 rows, those steps verify one node per row; tokens
    equal plain decoding either way."""
    bb = fast("llama")
    ids = [bb.encode_prompt("Write a poem about the sea.", chat=True)] * 3
    cfg = GenerationConfig(max_new_tokens=24)
    refs = [plain(bb, i, cfg) for i in ids]
    be = _engine(bb, ids, refs)
    assert be.step_rates is not None
    for _ in range(3):  # as if 3-row steps had measured: root 3x faster
        be.step_rates.record(3, SPECULATE, 10, 1.0)
        be.step_rates.record(3, ROOT, 30, 1.0)
    be.step_rates.explore_every = 10_000
    toks, _, last, order = run(be, {0: [(i, cfg, None) for i in ids]})
    for k, rid in enumerate(order):
        assert toks[rid] == refs[k].tokens
        st = last[rid].stats
        assert st.steps >= 23 and st.tau <= 1.05  # one node per step (the first step is a lone row's)
    free = _engine(bb, ids, refs, measured=False)
    assert free.step_rates is None
    toks, _, last, order = run(free, {0: [(i, cfg, None) for i in ids]})
    assert all(toks[r] == refs[0].tokens for r in order) and last[order[0]].stats.tau > 2


def test_the_engine_records_whole_steps_per_batch_size():
    bb = fast("llama")
    ids = [bb.encode_prompt(p, chat=True) for p in ("Hi", "Count: one two three")]
    cfg = GenerationConfig(max_new_tokens=12)
    refs = [plain(bb, i, cfg) for i in ids]
    be = _engine(bb, ids[:1], refs[:1])
    run(be, {0: [(i, cfg, None) for i in ids]})
    seen = be.step_rates.rates()
    assert 2 in seen and seen[2].get(SPECULATE, 0) > 0 and 1 not in seen  # one row: never narrowed
