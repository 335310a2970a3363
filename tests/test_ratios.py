"""benchmarks/e2e/ratios.py recomputes a run's speedups from its records, with prompts left out."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"))

import ratios  # noqa: E402


def _rec(task, key, method, tokens, wall):
    return {"task": task, "key": key, "method": method, "repeat": 0, "tokens": [1] * tokens,
            "new_tokens": tokens, "wall_s": wall, "steps": tokens}


RECORDS = [
    _rec("a", "p1", "vanilla", 100, 2.0), _rec("a", "p1", "fast", 100, 1.0),
    _rec("a", "p2", "vanilla", 100, 2.0), _rec("a", "p2", "fast", 100, 3.0),  # disturbed
    _rec("b", "p1", "vanilla", 100, 2.0), _rec("b", "p1", "fast", 100, 1.0),
]


def test_pooled_speedup_and_drop_leaves_the_prompt_out_for_every_method(tmp_path, capsys):
    # pooled: vanilla 300 tok / 6 s = 50; fast 300 / 5 s = 60 -> 1.2x; without a:p2 -> 200/2 over 200/4 = 2x
    (tmp_path / "records.jsonl.gz").write_bytes(gzip.compress("\n".join(map(json.dumps, RECORDS)).encode()))
    assert ratios.speedups(ratios.read_records(tmp_path))["fast"] == pytest.approx(1.2)
    assert ratios.main([str(tmp_path), "--drop", "a:p2", "--ratio", "fast", "vanilla"]) == 0
    out = capsys.readouterr().out
    assert "2.000x" in out and "fast / vanilla = 2.000" in out
    # the same key under another task is kept: dropping b:p1 leaves a:p1 and a:p2 (1.0x)
    assert ratios.speedups(RECORDS, {("b", "p1")})["fast"] == pytest.approx(1.0)


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "records.jsonl").write_text("\n".join(map(json.dumps, RECORDS)))
    for argv in ([str(tmp_path), "--drop", "p2"], [str(tmp_path), "--drop", "a:nope"],
                 [str(tmp_path), "--ratio", "fast", "slow"]):
        with pytest.raises(SystemExit) as e:
            ratios.main(argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit, match="no records"):
        ratios.main([str(tmp_path / "empty")])


def test_step_stats_pool_every_step_of_a_method(capsys):
    recs = [dict(_rec("a", "p1", "fast", 3, 1.0), step_log={"nodes": [1, 3], "seconds": [0.02, 0.03]}),
            dict(_rec("a", "p2", "fast", 3, 1.0), step_log={"nodes": [5], "seconds": [0.04]}),
            _rec("a", "p1", "vanilla", 3, 1.0)]  # no step log: left out
    nodes, alone, ms = ratios.step_stats(recs)["fast"]
    assert (nodes, ms) == (pytest.approx(3.0), pytest.approx(30.0)) and alone == pytest.approx(1 / 3)
    assert "vanilla" not in ratios.step_stats(recs)
