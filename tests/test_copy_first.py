"""Copies first (``schedulers.copy_first``): a step whose root has a copy may verify the copy
chain alone, no head call, where that has been paying more tokens per second."""

from __future__ import annotations

from tiny import tiny_backbone

from cadence.costs.latency import LatencyCurve
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.draft.context_copy import CopyConfig
from cadence.draft.head_drafter import HeadDrafter
from cadence.heads import new_heads, save_heads
from cadence.heads.tables import DraftPolicy, save_policy
from cadence.methods import Method, MethodSpec, make_engine
from cadence.schedulers.base import StepInfo, StepState
from cadence.schedulers.copy_chain import CopyChainScheduler
from cadence.schedulers.copy_first import COPIES, HEADS, CopyFirst
from cadence.schedulers.static import StaticScheduler
from cadence.trees.tree import compile_tree

CURVE = LatencyCurve([1, 2, 4, 8], [0.010, 0.011, 0.012, 0.016])
HEADS_TREE = compile_tree([(0,), (1,), (0, 0)], name="heads-tree")


def state(copy):
    return StepState(hidden=None, root_logits=None, step=0, new_tokens=0, past=0, copy=copy)


def scheduler(**kw) -> CopyFirst:
    return CopyFirst(StaticScheduler(HEADS_TREE), CopyChainScheduler(CURVE, 6, name="copies"), CURVE, **kw)


def step(s: CopyFirst, copy, accepted: int, seconds: float, rows: int = 1):
    plan = s.choose(state(copy))
    s.observe(StepInfo(tree=plan.tree.name, nodes=plan.tree.size, accepted=accepted, seconds=seconds,
                       depth=plan.tree.max_depth, rows=rows))
    return plan


def test_no_copy_at_the_root_is_the_inner_schedulers_step():
    s = scheduler()
    plan = step(s, None, 1, 0.01)
    assert plan.tree is HEADS_TREE and not plan.copies_only
    assert s.runs == [0, 0] and s.copy_steps == 0


def test_the_docstring_example_each_arm_once_then_the_faster_exploring_the_other():
    s = scheduler(explore_every=8)
    first = step(s, 7, 1, 0.006)  # copies: 2 tokens in 6 ms
    assert first.copies_only and first.tree.name.startswith("copies-")
    second = step(s, 7, 1.4, 0.009)  # heads: 2.4 tokens in 9 ms
    assert not second.copies_only and second.tree is HEADS_TREE
    assert s.rate(COPIES) > s.rate(HEADS)
    arms = []
    for _ in range(12):
        plan = s.choose(state(7))
        arms.append(COPIES if plan.copies_only else HEADS)
        s.observe(StepInfo(tree=plan.tree.name, nodes=plan.tree.size, accepted=1, seconds=0.006 if plan.copies_only
                           else 0.009, depth=plan.tree.max_depth))
    # copy steps 3..14: the 8th runs the heads (exploration), every other one the copies
    assert arms == [COPIES] * 5 + [HEADS] + [COPIES] * 6


def test_heads_that_pay_more_keep_the_lead():
    s = scheduler(explore_every=4)
    for _ in range(20):
        plan = s.choose(state(7))
        # heads: 4 tokens in 9 ms; copies: 1 token in 8 ms
        s.observe(StepInfo(tree=plan.tree.name, nodes=plan.tree.size, accepted=0 if plan.copies_only else 3,
                           seconds=0.008 if plan.copies_only else 0.009, depth=plan.tree.max_depth))
    assert s.runs[HEADS] > 2 * s.runs[COPIES] and s.rate(HEADS) > s.rate(COPIES)


def test_a_batched_step_is_valued_by_the_verify_curve_not_its_shared_wall_time():
    s = scheduler(draft_s=0.001)
    step(s, 7, 1, 5.0, rows=4)  # copies arm, 5 s of a shared batch step: valued at CURVE(nodes)
    assert abs(s.seconds[COPIES] - CURVE(1 + s.chain.choose(None).tree.max_depth)) < 0.003
    assert s.seconds[COPIES] < 0.02


def test_the_chain_learns_only_from_copy_steps_and_the_inner_from_the_rest():
    s = scheduler()
    seen = []
    s.inner.observe = seen.append  # noqa: the static scheduler keeps no memory; record what it is told
    step(s, 7, 3, 0.006)  # copies
    hits = s.chain.hits
    step(s, 7, 1, 0.009)  # heads
    step(s, None, 0, 0.009)  # no copy
    assert [i.tree for i in seen] == ["heads-tree", "heads-tree"] and s.chain.hits == hits


def calibrated(tmp_path, bb):
    heads = new_heads("hydra", bb, 3, random=True, seed=1)
    made = save_heads(heads, tmp_path / "made")
    save_policy(made, DraftPolicy(tree=[[0], [0, 0]], acceptance=[[0.6, 0.1], [0.5, 0.1], [0.4, 0.1]],
                                  copy_acceptance=[[0.7, 0.1]] * 6))
    return str(made)


def test_an_engine_runs_copy_chains_and_stays_identical_to_plain_decoding(tmp_path):
    bb = tiny_backbone("llama", vocab=16, tokenizer=False)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    cfg = GenerationConfig(max_new_tokens=48)
    plain = Engine(bb).generate(prompt, cfg)
    made = calibrated(tmp_path, bb)
    on = make_engine(bb, MethodSpec(method=Method.HYDRA, heads=made), latency=CURVE).generate(prompt, cfg)
    off = make_engine(bb, MethodSpec.parse(f"hydra@{made},copy_first=0"), latency=CURVE).generate(prompt, cfg)
    assert on.tokens == off.tokens == plain.tokens
    assert any(s.tree.startswith("copies-") for s in on.stats.step_log)
    assert not any(s.tree.startswith("copies-") for s in off.stats.step_log)
    no_copy = make_engine(bb, MethodSpec(method=Method.HYDRA, heads=made, copy=False), latency=CURVE)
    assert not isinstance(no_copy.new_scheduler(cfg.sampling), CopyFirst)  # nothing to copy: not wrapped


def test_copies_only_plans_at_t_above_zero_run_and_keep_to_the_budget():
    bb = tiny_backbone("llama", vocab=16, tokenizer=False)
    heads = new_heads("hydra", bb, 3, random=True, seed=2)
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=6)
    eng = Engine(bb, drafter, lambda sampling: scheduler())
    out = eng.generate([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], GenerationConfig(max_new_tokens=20, temperature=0.8, seed=3))
    assert len(out.tokens) == 20


def test_step_kinds_splits_a_runs_steps_by_kind(tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "analysis"))
    import step_kinds

    log = {"tree": ["copies-3~2", "auto-2+copy", "root", "ngram-2"], "nodes": [3, 3, 1, 3],
           "accepted": [2, 1, 0, 0], "seconds": [0.006, 0.008, 0.005, 0.006]}
    rows = [{"method": "hydra", "step_log": log}, {"method": "llama.cpp", "step_log": None}]
    out = step_kinds.summarize(rows)
    assert list(out) == ["hydra"]  # no step log: left out
    assert out["hydra"]["copies"] == {"steps": 2, "tokens_per_step": 2.0, "ms_per_step": 6.0, "tokens_per_ms": 0.3333}
    assert out["hydra"]["heads"]["tokens_per_step"] == 2.0 and out["hydra"]["root"]["steps"] == 1
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert step_kinds.main([str(path)]) == 0
    assert step_kinds.main([str(path), "--repeat", "0", "--json"]) == 0
    timed = [{"method": "vanilla", "repeat": 0, "new_tokens": 10, "wall_s": 0.1},
             {"method": "ngram", "repeat": 0, "new_tokens": 10, "wall_s": 0.05},
             {"method": "ngram", "repeat": 1, "new_tokens": 10, "wall_s": 0.02}]
    assert step_kinds.speeds(timed) == {"vanilla": 100.0, "ngram": round(20 / 0.07, 2)}
    assert step_kinds.speeds([r for r in timed if r["repeat"] == 1]) == {"ngram": 500.0}
    assert step_kinds.main([str(tmp_path / "missing.jsonl")]) == 2
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert step_kinds.main([str(tmp_path / "bad.jsonl")]) == 2


def test_a_servers_per_request_schedulers_get_copies_first_as_its_own_do(tmp_path):
    """``cadence.scheduler`` / ``cadence.method`` per request build factories like ``make_engine``:
    with copies first unless the request's method turns it off."""
    from cadence.server.options import Schedulers
    from cadence.verify.sampling import SamplingParams

    bb = tiny_backbone("llama", vocab=16, tokenizer=False)
    spec = MethodSpec(method=Method.HYDRA, heads=calibrated(tmp_path, bb))
    engine = make_engine(bb, spec, latency=CURVE)
    assert isinstance(engine.new_scheduler(SamplingParams()), CopyFirst)
    from cadence.server.protocol import CadenceOptions

    per_request = Schedulers(engine, spec)
    on = per_request.factory(CadenceOptions(scheduler="adaptive"))
    off = per_request.factory(CadenceOptions(method=f"hydra@{spec.heads},copy_first=0", scheduler="adaptive"))
    assert isinstance(on(SamplingParams()), CopyFirst) and not isinstance(off(SamplingParams()), CopyFirst)
