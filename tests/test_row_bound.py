"""benchmarks/kernels/row_bound.py: the least T(n)/T(1) from measured instruction rates."""

import json
import platform
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "kernels"))

import row_bound  # noqa: E402


def _curve(tmp_path, ms: dict) -> Path:
    p = tmp_path / "curve.json"
    p.write_text(json.dumps({"by_dtype": {"float32": {"curve": {"fast": {"ms": {str(k): v for k, v in ms.items()}}}}}}))
    return p


def test_the_worked_example_of_the_bound(tmp_path):
    rate = {"kernels": {"maddubs_zmm": {"gmac_s": 300.0}, "q4_block_zmm": {"gmac_s": 150.0}}}
    out = row_bound.bound_rows(135_000_000, 8, rate, {"avx512": _curve(tmp_path, {1: 7.0, 8: 10.5})})
    (r,) = out
    assert r["least_extra_ms"] == 3.15 and r["least_ratio"] == 1.45
    assert r["least_ratio_block"] == 1.9  # half the rate: twice the time, 1 + 6.3 / 7.0
    assert r["measured_ratio"] == 1.5 and r["needed_gmac_s_for_1.3"] == 450.0


def test_a_path_whose_instruction_was_not_timed_is_left_out(tmp_path):
    rate = {"kernels": {"maddubs_ymm": {"gmac_s": 100.0}}}
    out = row_bound.bound_rows(10, 8, rate, {"native": _curve(tmp_path, {1: 1.0, 8: 2.0})})
    assert out == []


def test_the_block_mix_has_the_products_and_sums_of_one_q4_1_block():
    body = row_bound.q4_block("zmm", 13)
    ops = [ln.split()[0] for ln in body]
    assert ops.count("vpmaddubsw") == 8 and ops.count("vpaddw") == 7 and ops.count("vpmaddwd") == 1
    assert ops.count("vfmadd231ps") == 2 and body[-1].endswith("%%zmm13")
    assert row_bound.MACS_PER_ITER["q4_block_zmm"] == 3 * 8 * 64  # three blocks of 8 x 64 multiply-adds


def test_bad_curves_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="PATH=FILE"):
        row_bound.parse_curves(["avx9=x.json"])
    with pytest.raises(SystemExit, match="no file"):
        row_bound.parse_curves([f"avx2={tmp_path / 'none.json'}"])


@pytest.mark.skipif(platform.machine() != "x86_64" or "avx2" not in row_bound.cpu_flags(), reason="x86-64 AVX2")
def test_the_timed_kernels_build_and_run(tmp_path):
    so = row_bound.build(tmp_path)
    r = row_bound.rates(so, ["maddubs_ymm", "q4_block_ymm"], 1, 0.02)
    assert 0.3 < r["clock_ghz"] < 8  # a plausible clock: the imul chain was not folded away
    k = r["kernels"]
    assert 0 < k["q4_block_ymm"]["gmac_s"] < k["maddubs_ymm"]["gmac_s"]  # the block mix does more than multiply
