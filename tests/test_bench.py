"""End-to-end ``cadence bench`` on a tiny random model: reports, plots, resume, CLI, peers."""

import json
import sys
import types

import pytest

from cadence.bench.runner import BenchConfig, read_records, run_bench
from cadence.cli import main
from cadence.errors import CadenceError


@pytest.fixture(scope="module")
def tiny():
    from tiny import tiny_backbone

    bb = tiny_backbone("llama")
    bb.model.config.max_position_embeddings = 1024  # room for GSM8K / HumanEval prompts in bytes
    return bb


@pytest.fixture
def custom(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": p}) for i, p in
                              enumerate(["hello there", "write a poem", "what is 2+2?", "list three colors"])) + "\n")
    return path


def config(out, custom, **kw):
    base = dict(tasks=["gsm8k", "humaneval", "custom"],
                methods=["vanilla", "hydra", "medusa:tree-8", "hf-generate", "llama.cpp"],
                heads="random", limit=2, max_new_tokens=12, out=str(out), custom=str(custom), humaneval_timeout=3)
    base.update(kw)
    return BenchConfig(**base)


def test_bench_end_to_end_and_resume(tiny, tmp_path, custom, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # absent: skipped with a note
    out = tmp_path / "run"
    cfg = config(out, custom, tasks=["gsm8k", "custom"])
    results = run_bench(cfg, backbone=tiny, progress=False, log=lambda m: None)
    for name in ("results.json", "report.md", "records.jsonl", "speedup.png", "tau_hist.png",
                 "timeline-gsm8k.png", "timeline-custom.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    records = read_records(out / "records.jsonl")
    assert len(records) == 2 * 2 * 4  # tasks x prompts x methods (llama.cpp skipped)
    assert any("llama.cpp skipped" in n for n in results["notes"])
    summary = results["summary"]
    for task in ("gsm8k", "custom", "all"):
        assert set(summary[task]) == {"vanilla", "hydra", "medusa:tree-8", "hf-generate"}
        for m, s in summary[task].items():
            assert s["identical_rate"] == 1.0, (task, m)  # lossless at T=0, hf-generate agrees too
            assert s["tokens_per_s"] > 0 and s["speedup"] > 0
    assert summary["gsm8k"]["vanilla"]["speedup"] == pytest.approx(1.0)
    assert summary["gsm8k"]["vanilla"]["score"] is not None and summary["custom"]["hydra"]["score"] is None
    assert results["flags"] == []
    saved = json.loads((out / "results.json").read_text())
    assert saved["machine"]["cores"] and saved["machine"]["torch"] and "date" in saved
    md = (out / "report.md").read_text()
    assert "| Method | gsm8k | custom | Overall |" in md and "## gsm8k" in md and "speedup.png" in md
    hydra = next(r for r in records if r["method"] == "hydra")
    assert len(hydra["step_log"]["accepted"]) == len(hydra["step_log"]["entropy"]) > 0

    # resume: the same run measures nothing new
    results = run_bench(cfg, backbone=tiny, progress=False, log=lambda m: None)
    assert len(read_records(out / "records.jsonl")) == 16 and results["records"] == 16
    # an interrupted run: drop two records and tear the last line; only those are measured again
    lines = (out / "records.jsonl").read_text().splitlines(keepends=True)
    (out / "records.jsonl").write_text("".join(lines[:-3]) + lines[-3][:20])
    run_bench(cfg, backbone=tiny, progress=False, log=lambda m: None)
    after = read_records(out / "records.jsonl")
    assert len(after) == 16 and len({(r["task"], r["key"], r["method"], r["repeat"]) for r in after}) == 16
    # a second repeat adds exactly one more generation per (prompt, method)
    results = run_bench(config(out, custom, tasks=["gsm8k", "custom"], repeats=2), backbone=tiny,
                        progress=False, log=lambda m: None)
    assert len(read_records(out / "records.jsonl")) == 32 and results["summary"]["gsm8k"]["hydra"]["generations"] == 4
    # other settings in the same directory are refused
    with pytest.raises(CadenceError, match="other settings"):
        run_bench(config(out, custom, tasks=["gsm8k", "custom"], max_new_tokens=5), backbone=tiny,
                  progress=False, log=lambda m: None)


def test_bench_humaneval_and_sampling(tiny, tmp_path, custom):
    out = tmp_path / "he"
    cfg = config(out, custom, tasks=["humaneval"], methods=["vanilla", "mtp:chain-2", "hf-pld"], limit=1,
                 temperature=0.8, top_k=20, plots=False)
    results = run_bench(cfg, backbone=tiny, progress=False, log=lambda m: None)
    s = results["summary"]["humaneval"]
    assert s["vanilla"]["score"] == 0.0  # a random model does not pass HumanEval
    assert s["mtp:chain-2"]["identical_rate"] is None  # not defined when sampling
    assert s["hf-pld"]["tau"] is None
    assert not (out / "speedup.png").exists()


def test_bench_cli_with_model_dir_and_compare(tiny, tmp_path, custom, capsys):
    model_dir = tmp_path / "model"
    tiny.model.save_pretrained(model_dir)
    tiny.tokenizer.save_pretrained(model_dir)
    args = ["bench", "--model", str(model_dir), "--tasks", "custom", "--custom", str(custom),
            "--methods", "vanilla", "hydra:chain-2", "--heads", "random", "--limit", "2",
            "--max-new-tokens", "8", "--quiet", "--no-plots"]
    assert main(args + ["--out", str(tmp_path / "a")]) == 0
    assert main(args + ["--out", str(tmp_path / "b")]) == 0
    res = json.loads((tmp_path / "a" / "results.json").read_text())
    assert res["command"].startswith("cadence bench") and res["summary"]["custom"]["hydra:chain-2"]["generations"] == 2
    capsys.readouterr()
    assert main(["bench", "--compare", str(tmp_path / "a" / "results.json"), str(tmp_path / "b")]) == 0
    assert "| custom | hydra:chain-2 |" in capsys.readouterr().out
    # bad input is a clean error (exit 2), before any model is loaded
    assert main(["bench", "--tasks", "nope", "--out", str(tmp_path / "c")]) == 2
    assert main(["bench", "--methods", "nonesuch", "--out", str(tmp_path / "c")]) == 2
    assert main(["bench", "--tasks", "custom", "--custom", str(tmp_path / "none.jsonl")]) == 2
    assert main(["bench", "--methods", "hydra", "--heads-dir", str(tmp_path), "--out", str(tmp_path / "c")]) == 2
    assert "no hydra/ heads directory" in capsys.readouterr().err


def test_llama_cpp_peer_with_a_fake_module(tiny, tmp_path, monkeypatch):
    """The llama.cpp adapter's control flow (the real package is optional and not built here)."""
    from cadence.bench.peers import make_peer
    from cadence.decode.generation import GenerationConfig

    class FakeLlama:
        def __init__(self, model_path, n_threads, n_ctx, verbose):
            assert n_threads == 2 and model_path.endswith(".gguf")

        def token_eos(self):
            return 256

        def reset(self):
            pass

        def generate(self, tokens, **kw):
            assert kw["temp"] == 0.0
            yield from hi + [256, 300]

    hi = tiny.tokenizer.encode("hi", add_special_tokens=False)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(
        Llama=FakeLlama, __version__="9.9", llama_print_system_info=lambda: b"AVX2 = 1 |  AVX512 = 0 |"))
    import cadence.bench.peers as peers
    monkeypatch.setattr(peers, "llama_cpp_decodes", lambda gguf: (True, ""))  # no child process
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    peer = make_peer("llama.cpp", tiny, str(gguf))
    g = peer.generate([1, 2, 3], GenerationConfig(max_new_tokens=10))
    assert g.tokens == hi + [256] and g.text == "hi" and g.stats.new_tokens == 3
    assert peer.generate([1], GenerationConfig(max_new_tokens=1)).tokens == hi[:1]
    assert peer.build == "llama.cpp: llama-cpp-python 9.9, 2 threads; AVX2 = 1 | AVX512 = 0 |"  # in the report's notes
    with pytest.raises(CadenceError, match="GGUF"):
        make_peer("llama.cpp", tiny, str(tmp_path))


def test_a_llama_cpp_build_that_dies_in_a_test_decode_is_skipped_not_fatal(tiny, tmp_path, monkeypatch):
    """On the AMX Xeon (2026-12-01) a build with ggml's AMX kernels died with SIGILL at its first token and took
    the whole benchmark with it. The peer now decodes a few tokens in a child process first."""
    import cadence.bench.peers as peers

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    ok, why = peers.llama_cpp_decodes(gguf, code="import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    assert not ok and "SIGILL" in why and "build_llama_cpp.py" in why
    ok, why = peers.llama_cpp_decodes(gguf, code="import sys; sys.exit(3)")
    assert not ok and "exit 3" in why
    assert peers.llama_cpp_decodes(gguf, code="pass") == (True, "")
    ok, why = peers.llama_cpp_decodes(gguf, timeout=0.5, code="import time; time.sleep(5)")
    assert not ok and "took over" in why
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=None))
    monkeypatch.setattr(peers, "llama_cpp_decodes", lambda g: (False, "llama.cpp skipped: died (SIGILL)"))
    with pytest.raises(CadenceError, match="SIGILL"):
        peers.make_peer("llama.cpp", tiny, str(gguf))


def test_method_names_with_trees_and_nocopy():
    from cadence.bench.runner import parse_method

    cfg = BenchConfig(heads="random")
    e = parse_method("mtp:auto-8/nocopy", cfg)
    assert e.label == "mtp:auto-8/nocopy" and e.spec.tree == "auto-8" and e.spec.copy is False
    e = parse_method("Hydra", cfg)
    assert e.label == "hydra" and e.spec.tree == "auto" and e.spec.copy is True and e.spec.context_vocab > 0
    for text in ("eagle/nocopy/novocab", "eagle/novocab/nocopy"):
        e = parse_method(text, cfg)
        assert e.label == "eagle/nocopy/novocab" and e.spec.copy is False and e.spec.context_vocab == 0
    e = parse_method("eagle/novocab", cfg)
    assert e.label == "eagle/novocab" and e.spec.copy is True and e.spec.context_vocab == 0
    for bad, msg in [("hydra/fast", "options are /nocopy and /novocab"), ("vanilla/nocopy", "vanilla takes no"),
                     ("vanilla/novocab", "no heads"),
                     ("hf-pld/nocopy", "takes no tree, scheduler or option")]:
        with pytest.raises(CadenceError, match=msg):
            parse_method(bad, cfg)


def test_method_names_take_a_scheduler():
    from cadence.bench.runner import BenchConfig, parse_method
    from cadence.errors import CadenceError

    cfg = BenchConfig()
    e = parse_method("hydra:auto-8+entmtp/nocopy", cfg)
    assert (e.label, e.spec.tree, e.spec.scheduler, e.spec.copy, e.lossless) == (
        "hydra:auto-8+entmtp/nocopy", "auto-8", "entmtp", False, True)
    assert parse_method("mtp+adaptive-k", cfg).spec.scheduler == "adaptive-k"
    assert parse_method("hydra", cfg).spec.scheduler == "auto"
    for bad in ("hydra+bogus", "vanilla+entmtp", "hf-pld+entmtp"):
        with pytest.raises(CadenceError):
            parse_method(bad, cfg)


def test_method_names_take_a_heads_directory(tmp_path):
    """'kind@DIR': two head sets of one kind side by side in one run."""
    from cadence.bench.runner import parse_method, parse_methods

    heads = tmp_path / "new heads"
    heads.mkdir()
    (heads / "config.json").write_text("{}")
    cfg = BenchConfig(heads="default", methods=["eagle", f"eagle@{heads}", f"eagle:chain+static@{heads}/nocopy"])
    shipped, mine, nocopy = parse_methods(cfg)
    assert shipped.spec.heads == "default" and mine.spec.heads == str(heads)
    assert mine.label == f"eagle@{heads}" and mine.spec.copy is True
    assert (nocopy.spec.heads, nocopy.spec.tree, nocopy.spec.scheduler, nocopy.spec.copy) == (
        str(heads), "chain", "static", False)
    for bad, msg in [("eagle@", "names no heads"), (f"eagle@{tmp_path}/none", "not a heads directory"),
                     (f"vanilla@{heads}", "has no heads"), (f"llama.cpp@{heads}", "has no heads"),
                     ("hydra/fast", "options are /nocopy and /novocab")]:
        with pytest.raises(CadenceError, match=msg):
            parse_method(bad, BenchConfig())


def test_method_names_take_a_shipped_set_by_name():
    """'eagle@eagle-taps' runs a set shipped beside the default one without its path."""
    from cadence.bench.runner import parse_method

    entry = parse_method("eagle@eagle-taps/nocopy", BenchConfig())
    assert (entry.spec.heads, entry.spec.copy, entry.label) == ("eagle-taps", False, "eagle@eagle-taps/nocopy")
    with pytest.raises(CadenceError, match="nor a shipped set"):
        parse_method("eagle@eagle-taps9", BenchConfig())


def test_bench_offers_every_decoding_flag_of_generate():
    """`cadence bench` derives its decoding flags from the dataclasses `generate` uses (the
    loader's flags, MethodSpec, every scheduler's options, GenerationConfig): each flag of
    `cadence generate --help` but the prompt and output ones is in `cadence bench --help`."""
    import argparse

    from cadence.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    flags = {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.items()}
    own = {"--prompt", "--prompt-file", "--chat", "--no-chat", "--json", "--compare", "-h", "--help"}
    own |= {f for f in flags["generate"] if f.startswith("--pipo")}  # PIPO's own decoder (docs/pipo.md), not bench's
    assert flags["generate"] - own - flags["bench"] == set()
    assert {"--backend", "--max-nodes", "--rule", "--drift", "--dyn-topk"} <= flags["bench"]


def test_bench_method_names_are_method_specs(tmp_path):
    """A bench method name is read by MethodSpec.parse over the run's flags."""
    from cadence.bench.runner import BenchConfig, parse_method
    from cadence.methods import MethodSpec

    cfg = BenchConfig(heads="random", settings={"max_nodes": 8, "copy_depth": 4}, out=str(tmp_path))
    e = parse_method("eagle+dynamic,dyn_topk=2", cfg)
    assert e.spec == MethodSpec.parse("eagle+dynamic@random,max_nodes=8,copy_depth=4,dyn_topk=2")
    assert e.spec.scheduler_options("dynamic").max_nodes == 8
    with pytest.raises(CadenceError, match="unknown method setting"):
        parse_method("hydra,nodes=3", cfg)
