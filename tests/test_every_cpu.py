"""benchmarks/e2e/every_cpu.py: the environment of each forced path and the every-CPU table."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"))

import every_cpu  # noqa: E402


def _bench(out: Path, path: str, tps: dict, identical: dict, curve_t8=None):
    summary = {m: {"tokens_per_s": t, "identical_rate": identical.get(m, 1.0)} for m, t in tps.items()}
    (out / path).mkdir(parents=True)
    (out / path / "results.json").write_text(json.dumps({"summary": {"custom": summary}}))
    if curve_t8 is not None:
        rel = {"1": 1.0, "4": 1.1, "8": curve_t8}
        (out / f"{path}-curve.json").write_text(json.dumps(
            {"by_dtype": {"float32": {"curve": {"fast": {"relative": rel}}}}}))


def test_table_picks_the_best_lossless_method_and_divides_by_llama_cpp(tmp_path):
    _bench(tmp_path, "native", {"vanilla": 200.0, "hydra": 240.0, "mtp": 230.0, "llama.cpp": 100.0},
           {"hydra": 1.0, "mtp": 0.96}, curve_t8=1.7)
    _bench(tmp_path, "avx2", {"vanilla": 150.0, "hydra": 160.0}, {})  # no peer, no curve
    rows = every_cpu.summarize(tmp_path, ["native", "avx512", "avx2"])  # avx512 never ran: left out
    assert [r["path"] for r in rows] == ["native", "avx2"]
    native, avx2 = rows
    assert native["best"] == "hydra" and native["best_vs_llama"] == pytest.approx(2.4)
    assert native["plain_vs_llama"] == pytest.approx(2.0) and native["t8_t1"] == pytest.approx(1.7)
    assert native["identical"] == pytest.approx(0.96)  # the worst method's share
    assert avx2["llama_tps"] is None and avx2["best_vs_llama"] is None
    text = every_cpu.table(rows)
    assert "| native | 200.0 | hydra | 240.0 | 100.0 | 2.00x | 2.40x | 96% | 1.70 |" in text
    assert "| avx2 | 150.0 | hydra | 160.0 | - | -x | -x | 100% | - |" in text


def test_forced_paths_set_their_variables_and_find_their_llama_cpp(tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_ISA", "avx2")
    env, note = every_cpu.path_env("native", tmp_path)
    assert "CADENCE_ISA" not in env and note == "llama.cpp as installed"
    env, note = every_cpu.path_env("avx2", tmp_path)
    assert env["CADENCE_ISA"] == "avx2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert "left out" in note
    (tmp_path / "llama-avx512").mkdir()
    env, note = every_cpu.path_env("avx512", tmp_path)
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE" and "MKL_ENABLE_INSTRUCTIONS" not in env
    assert env["PYTHONPATH"].split(":")[0] == str((tmp_path / "llama-avx512").resolve()) and "left out" not in note


def test_summarize_without_runs_is_an_error(tmp_path, capsys):
    assert every_cpu.main(["--summarize", str(tmp_path)]) == 1
    assert "no finished bench" in capsys.readouterr().err
