"""benchmarks/e2e/draft_cost.py: a method's drafting time is the sum of its drafter calls."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"))

import draft_cost  # noqa: E402


def _timer(seconds, calls):
    t = draft_cost._Timer(lambda: None)
    t.seconds, t.outer_seconds, t.calls = seconds, seconds, calls
    return t


def test_drafting_time_is_the_sum_of_the_calls_and_each_call_is_kept_apart():
    tot = {"draft_s": 0.0}
    for _ in range(2):  # two generations
        draft_cost.add_drafter_times(tot, {"draft": _timer(0.002, 1), "draft_dynamic": _timer(0.004, 2),
                                           "commit": _timer(0.001, 3)})
    assert abs(tot["draft_s"] - 0.014) < 1e-12
    assert tot["calls"] == {"draft": [0.004, 2], "draft_dynamic": [0.008, 4], "commit": [0.002, 6]}


def test_a_call_made_inside_another_counts_once_in_the_total():
    inner = draft_cost._Timer(lambda: None)
    outer = draft_cost._Timer(lambda: inner())
    outer()
    tot = {"draft_s": 0.0}
    draft_cost.add_drafter_times(tot, {"judge_shadows": outer, "shadow_heads": inner})
    assert inner.calls == outer.calls == 1 and inner.outer_seconds == 0.0
    assert tot["draft_s"] == outer.seconds  # not outer + inner
    assert tot["calls"]["shadow_heads"] == [inner.seconds, 1]


def test_the_ngram_drafter_is_timed_for_the_calls_it_has():
    from cadence.draft.copy_drafter import CopyDrafter

    drafter = CopyDrafter()
    timers = draft_cost.install_timers(drafter)
    assert "draft" in timers and "draft_dynamic" not in timers and "shadow_heads" not in timers
    assert set(timers) == {n for n in draft_cost.DRAFTER_CALLS if hasattr(CopyDrafter, n)}
    assert all(getattr(drafter, n) is t for n, t in timers.items())
    assert draft_cost.install_timers(None) == {}
