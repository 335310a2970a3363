"""Benchmark pieces that need no model: metrics, answer extraction, HumanEval executor, reports."""

import time

import pytest

from cadence.bench import metrics as M
from cadence.bench import report
from cadence.bench.execute import run_python
from cadence.bench.runner import BenchConfig, MethodEntry, parse_method
from cadence.bench.tasks import (BenchItem, extract_code, extract_final_number, humaneval_items,
                                 humaneval_program, is_creative_writing, normalize_number, score_gsm8k,
                                 score_humaneval, seeded_subset)
from cadence.errors import CadenceError


def rec(key, method="m", tokens=(1, 2, 3), new=None, wall=1.0, steps=None, repeat=0, acc=(), log=None, score=None):
    new = len(tokens) if new is None else new
    return {"task": "t", "key": key, "method": method, "repeat": repeat, "tokens": list(tokens),
            "new_tokens": new, "wall_s": wall, "steps": steps, "accepted_at_depth": list(acc),
            "step_log": log, "score": score}


# ---------------------------------------------------------------- metrics

def test_repetition_ratio():
    assert M.repetition_ratio([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 - 4 / 5)
    assert M.repetition_ratio([1, 2, 3, 4, 5]) == 0.0
    assert M.repetition_ratio([7] * 10) == pytest.approx(1 - 1 / 7)
    assert M.repetition_ratio([1, 2, 3]) is None
    assert M.mean_repetition([rec("a", tokens=[1, 2]), rec("b", tokens=[5] * 6)]) == pytest.approx(2 / 3)


def test_tokens_per_s_is_pooled_not_mean_of_rates():
    recs = [rec("a", new=10, wall=1.0), rec("b", new=30, wall=3.0), rec("c", new=60, wall=1.0)]
    assert M.tokens_per_s(recs) == pytest.approx(100 / 5)
    assert M.tokens_per_s([rec("a", wall=0.0)]) is None


def test_speedup_and_identical_use_shared_prompts_only():
    base = [rec("a", "vanilla", tokens=[1, 2], new=10, wall=2.0), rec("b", "vanilla", tokens=[3], new=10, wall=2.0),
            rec("c", "vanilla", new=10, wall=100.0)]
    mine = [rec("a", "hydra", tokens=[1, 2], new=10, wall=1.0), rec("b", "hydra", tokens=[4], new=10, wall=1.0),
            rec("z", "hydra", new=10, wall=100.0)]  # z has no baseline; c has no hydra run
    assert M.speedup(mine, base) == pytest.approx(2.0)
    assert M.identical_rate(mine, base) == pytest.approx(0.5)
    assert M.speedup([rec("q")], base) is None
    assert M.identical_rate([rec("q")], base) is None
    # repeats pair with the same repeat
    assert M.identical_rate([rec("a", tokens=[1, 2], repeat=1)], base) is None


def test_tau_histogram_and_acceptance_by_depth():
    log1 = {"accepted": [0, 2, 1, 2], "nodes": [4] * 4, "entropy": [1.0] * 4, "seconds": [0.1] * 4,
            "depth": [3] * 4, "tree": ["chain"] * 4}
    log2 = {"accepted": [0, 0], "nodes": [4, 4], "entropy": [2.0, 2.0], "seconds": [0.1, 0.1],
            "depth": [3, 3], "tree": ["chain"] * 2}
    r1 = rec("a", new=9, steps=4, acc=[3, 2], log=log1)
    r2 = rec("b", new=2, steps=2, acc=[], log=log2)
    assert M.tau([r1, r2]) == pytest.approx(11 / 6)
    assert M.tau([rec("c")]) is None  # no step count (e.g. a peer)
    assert M.tau_histogram([r1, r2]) == {1: 3, 2: 1, 3: 2}
    assert M.acceptance_by_depth([r1, r2]) == pytest.approx([3 / 6, 2 / 6, 0.0])
    assert M.acceptance_by_depth([rec("c")]) == []
    assert M.acceptance_by_depth([rec("d", steps=2, log=log2)]) == [0.0, 0.0, 0.0]  # tree depth 3, none taken


def test_summarize_cell():
    base = [rec("a", "vanilla", new=10, wall=2.0, steps=10, score=1.0)]
    mine = [rec("a", "hydra", new=10, wall=1.0, steps=5, acc=[5, 0], score=0.0, tokens=[9, 9])]
    s = M.summarize(mine, base)
    assert s["speedup"] == pytest.approx(2.0) and s["tau"] == pytest.approx(2.0)
    assert s["identical_rate"] == 0.0 and s["score"] == 0.0 and s["generations"] == 1
    assert M.summarize(mine, base, compare_outputs=False)["identical_rate"] is None
    assert M.summarize(mine, None)["speedup"] is None


def test_slow_generations_are_noted_by_their_mean_step():
    """One hydra generation at 2.5x its method's usual step time (another process
    on the CPU) went unnoticed into the report; the report now names such generations."""
    def gen(key, method, secs):
        return rec(key, method, steps=len(secs), log={"seconds": secs, "accepted": [0] * len(secs)})

    usual = [gen(f"p{i}", "hydra", [0.020 + 0.001 * i] * 10) for i in range(9)]
    spiky = gen("bad", "hydra", [0.020] * 8 + [0.25, 0.25])  # median step 20 ms, mean 66 ms
    mild = gen("ok", "hydra", [0.032] * 10)  # 1.3x: the spread prompts give
    short = gen("short", "hydra", [0.5] * 3)  # too few steps to judge
    vanilla = [gen(f"p{i}", "vanilla", [0.016] * 10) for i in range(3)] + [rec("peer", "llama.cpp")]
    slow = M.slow_generations(usual + [spiky, mild, short] + vanilla)
    assert [(g["method"], g["key"]) for g in slow] == [("hydra", "bad")]
    # typical = median of 11 means (0.020 .. 0.028, 0.032, 0.066) = 0.025 -> 0.066 / 0.025
    assert slow[0]["ratio"] == pytest.approx(0.066 / 0.025, rel=1e-6)
    notes = report.timing_notes(usual + [spiky])
    assert len(notes) == 1 and "hydra on t:bad" in notes[0] and "--drop t:bad" in notes[0]
    assert report.timing_notes(usual + vanilla) == []


# ---------------------------------------------------------------- GSM8K

@pytest.mark.parametrize("reply,want", [
    ("16 - 3 - 4 = 9 eggs; 9 * 2 = 18.\nThe answer is 18.", "18"),
    ("So she pays $1,234.50 in total. #### 1,234.50", "1234.5"),
    ("The answer is: **42**", "42"),
    ("First 3 apples, then 5 more: 8", "8"),
    ("The answer is 7. Check: 7 + 3 = 10", "7"),
    ("the final answer is \\boxed{-12}", "-12"),
    ("It costs $18.00.", "18"),
    ("I do not know.", None),
])
def test_gsm8k_extraction(reply, want):
    assert extract_final_number(reply) == want


def test_gsm8k_scoring_and_normalize():
    item = BenchItem("gsm8k", "k", "q", reference="18")
    assert score_gsm8k(item, "The answer is 18.00").value == 1.0
    assert score_gsm8k(item, "The answer is 17").value == 0.0
    assert score_gsm8k(item, "no number").value == 0.0
    assert normalize_number("1,000") == "1000" and normalize_number("abc") is None


# ---------------------------------------------------------------- HumanEval

def test_executor_pass_fail_timeout_and_isolation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ok = run_python("open('side_effect.txt', 'w').write('x')\nassert 1 + 1 == 2\n", timeout=5)
    assert ok.passed and ok.status == "passed"
    assert not (tmp_path / "side_effect.txt").exists()  # written inside the temp dir, now gone
    bad = run_python("assert 1 + 1 == 3\n", timeout=5)
    assert not bad.passed and bad.status == "failed" and "AssertionError" in bad.output
    t0 = time.monotonic()
    loop = run_python("while True:\n    pass\n", timeout=2)
    assert loop.status == "timeout" and not loop.passed
    assert time.monotonic() - t0 < 6


def test_extract_code():
    reply = "Sure:\n```python\ndef f(x):\n    return x\n```\nDone."
    assert extract_code(reply) == "def f(x):\n    return x"
    assert extract_code("```py\ndef g():\n    pass\n```\n```python\ndef f():\n    return 1\n```", "f") == \
        "def f():\n    return 1"
    assert extract_code("```python\ndef f():\n    return 2") == "def f():\n    return 2"  # cut by the token limit
    assert extract_code("    return x + 1\n") == "    return x + 1"


@pytest.fixture(scope="module")
def problem():
    return next(it for it in humaneval_items() if it.key == "HumanEval/0")


def test_humaneval_correct_and_wrong(problem):
    full = problem.meta["prompt"] + problem.reference
    assert score_humaneval(problem, f"Here it is:\n```python\n{full}\n```\n").value == 1.0
    assert score_humaneval(problem, problem.reference).value == 1.0  # a bare body
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    res = score_humaneval(problem, wrong)
    assert res.value == 0.0 and res.detail.startswith("failed")
    # example calls and a __main__ block in the reply are dropped before scoring
    noisy = f"```python\n{full}\nprint(has_close_elements([1.0], 0.5))\nif __name__ == '__main__':\n    exit(3)\n```"
    assert "exit(3)" not in humaneval_program(problem.meta, noisy)
    assert score_humaneval(problem, noisy).value == 1.0


def test_humaneval_infinite_loop_times_out(problem):
    loop = "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```"
    t0 = time.monotonic()
    res = score_humaneval(problem, loop, timeout=2)
    assert res.value == 0.0 and res.detail.startswith("timeout")
    assert time.monotonic() - t0 < 6


# ---------------------------------------------------------------- tasks, methods

def test_writing_filter():
    assert is_creative_writing("Write a poem about the sea")
    assert is_creative_writing("can you help me write a cover letter for a dream job")
    assert is_creative_writing("Compose a short story in which a cat learns to fly.")
    assert not is_creative_writing("Write a python function that sorts a list")
    assert not is_creative_writing("What is the capital of France?")
    assert not is_creative_writing("Write a SQL query for the story table")


def test_seeded_subset_is_stable_and_extends():
    items = [BenchItem("t", f"k{i}", "p") for i in range(50)]
    a = seeded_subset(items, 5, seed=0)
    assert [x.key for x in a] == [x.key for x in seeded_subset(list(reversed(items)), 5, seed=0)]
    assert [x.key for x in seeded_subset(items, 10, seed=0)][:5] == [x.key for x in a]
    assert [x.key for x in seeded_subset(items, 5, seed=1)] != [x.key for x in a]
    skip = a[0].key
    b = seeded_subset(items, 5, seed=0, fits=lambda it: it.key != skip)
    assert skip not in [x.key for x in b] and len(b) == 5


def test_parse_method():
    cfg = BenchConfig(heads="random")
    assert parse_method("hydra:tree-16", cfg).spec.tree == "tree-16"
    assert parse_method("vanilla", cfg).kind == "engine"
    assert parse_method("llama-cpp", cfg).label == "llama.cpp"
    assert parse_method("hf-pld", cfg).kind == "peer"
    for bad in ("nonesuch", "vanilla:chain", "hf-generate:tree-8"):
        with pytest.raises(CadenceError):
            parse_method(bad, cfg)
    with pytest.raises(CadenceError):
        parse_method("hydra", BenchConfig(heads_dir="/nonexistent"))


# ---------------------------------------------------------------- reports

def test_lossless_flag_and_compare(tmp_path):
    summary = {"gsm8k": {"vanilla": {"identical_rate": 1.0}, "hydra": {"identical_rate": 0.5},
                         "hf-generate": {"identical_rate": 0.0}}}
    methods = [MethodEntry("vanilla", "engine"), MethodEntry("hydra", "engine"), MethodEntry("hf-generate", "peer")]
    flags = report.flags_for(summary, methods, {"temperature": 0.0, "rule": "auto"})
    assert len(flags) == 1 and flags[0].startswith("hydra on gsm8k")
    assert report.flags_for(summary, methods, {"temperature": 0.0, "rule": "typical"}) == []
    assert report.flags_for(summary, methods, {"temperature": 0.7, "rule": "auto"}) == []
    a = {"date": "d1", "model": "m", "config": {}, "summary": {"gsm8k": {"hydra": {"tokens_per_s": 10.0, "tau": 2.0}}}}
    b = {"date": "d2", "model": "m", "config": {}, "summary": {"gsm8k": {"hydra": {"tokens_per_s": 15.0, "tau": 2.5}}}}
    text = report.compare(a, b)
    assert "| gsm8k | hydra | 10.0 | 15.0 | +50.0% |" in text
    with pytest.raises(CadenceError):
        report.load_results(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(CadenceError):
        report.load_results(tmp_path / "x.json")
