"""``benchmarks/e2e/serve_load.py``'s bookkeeping (no server started): percentiles, the
row of one load level (errors, lost and truncated responses, outputs equal to the
sequential ones), mixed prompts, and the commands of the three servers."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"))

import serve_load as S  # noqa: E402


def res(text="ab", tokens=4, finish="length", error=None, ttft=0.1, itl=0.02, gaps=(0.02, 0.04)):
    return {"text": text, "tokens": tokens, "finish": finish, "error": error, "ttft": ttft, "itl": itl,
            "chunk_gaps": list(gaps), "e2e": 0.2, "usage_from": "server"}


def test_percentiles_are_nearest_rank():
    xs = list(range(1, 101))
    assert (S.pct(xs, 0.5), S.pct(xs, 0.95), S.pct(xs, 0.99)) == (50, 95, 99)
    assert S.pct([], 0.5) is None and S.pct([None, 3.0], 0.5) == 3.0
    assert S.quantiles([0.001, 0.002], 1e3, 1) == {"p50": 1.0, "p95": 2.0, "p99": 2.0}


def test_a_level_counts_errors_lost_truncated_and_identical_outputs():
    seq = [res("a"), res("b"), res("c"), res("d")]
    got = [res("a"), res("B"), res("c", tokens=2), res(error="APITimeoutError: timed out", tokens=0),
           res("e", finish=None)]
    row = S.summarize(got, wall=2.0, clients=8, max_tokens=4, reference=seq + [res("e")])
    assert (row["errors"], row["lost"], row["truncated"]) == (1, 1, 1)
    assert row["identical_to_sequential"] == 3  # a, c and e: equal texts (c and e are counted above)
    assert row["tokens"] == 4 + 4 + 2 + 0 + 4 and row["tok_s"] == 7.0
    assert row["error_samples"] == ["APITimeoutError: timed out"]
    base = S.summarize(seq, wall=1.0, clients=1, max_tokens=4, reference=None)
    assert base["identical_to_sequential"] == 4 and base["errors"] == base["lost"] == base["truncated"] == 0


def test_mixed_prompts_take_every_category_in_turn():
    ps = S.mixed_prompts(40)
    assert len(ps) == 40 and len(set(ps[:7])) == 7
    assert ps[0].startswith("Write a Python function")  # the first category's first prompt


def test_server_commands():
    args = SimpleNamespace(max_batch=8, clients=[1, 8, 32], requests=32, cadence_args=["--dtype", "float32"],
                           n_ctx=4096, threads=2)
    cad = S.server_command("cadence", 1234, args)
    assert cad[1:4] == ["-m", "cadence.cli", "serve"] and "--method" not in cad and cad[-2:] == ["--dtype", "float32"]
    assert cad[cad.index("--max-queue") + 1] == "32"
    van = S.server_command("cadence-vanilla", 1234, args)
    assert van[van.index("--method") + 1] == "vanilla"
    llama = S.server_command("llama.cpp", 1234, args)
    assert llama[1:3] == ["-m", "llama_cpp.server"] and llama[llama.index("--interrupt_requests") + 1] == "False"
    assert llama[llama.index("--model") + 1].endswith(".gguf")
