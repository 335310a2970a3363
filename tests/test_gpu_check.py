"""``benchmarks/gpu/gpu_check.py``: its CPU run (short lists, a tiny shape) end to end, its
chi-square p-values, and, where torch sees a CUDA device, its checks on the GPU (marked
``cuda``: skipped, with the reason, elsewhere)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import gpu_check  # noqa: E402

def test_cpu_run_writes_every_section(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_check.py"), "--device", "cpu",
                           "--samples", "80", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    s = result["sections"]
    assert s["greedy"]["ok"] and s["greedy"]["generations"] >= 18 and not s["greedy"]["failures"]
    assert set(s["greedy"]["schedulers"]) >= {"static", "dynamic", "entmtp", "clp"}
    assert s["sampling"]["ok"] and all(c["ok"] for c in s["sampling"]["cases"].values())
    assert 0.0 <= s["bf16"]["identical_rate"] <= 1.0
    tiny = s["curves"]["shapes"]["tiny"]
    assert tiny["curve"]["sizes"][0] == 1 and tiny["decode"]["tok_s"] > 0 and "host" in tiny
    assert Path(tiny["curve_file"]).is_file()
    assert set(s["bounds"]["predicted"]["tiny"]) == {"hydra", "mtp", "eagle-taps"}
    summary = (tmp_path / "summary.md").read_text()
    assert "| greedy | yes | True |" in summary and "*predicted*" in summary


def test_cuda_request_without_a_gpu_is_refused(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--device cpu" in proc.stderr


def test_chi2_pvalue_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    obs = torch.tensor([18.0, 25.0, 31.0, 26.0], dtype=torch.float64)
    exp = torch.tensor([25.0, 25.0, 25.0, 25.0], dtype=torch.float64)
    stat, p = gpu_check.chi2_pvalue(obs, exp)
    ref = scipy_stats.chisquare(obs.numpy(), exp.numpy())
    assert stat == pytest.approx(ref.statistic) and p == pytest.approx(ref.pvalue, rel=1e-9)


def test_gof_flags_a_sequence_outside_the_support():
    r = gpu_check.gof(torch.tensor([5.0, 1.0]), torch.tensor([1.0, 0.0]))
    assert r["p"] == 0.0 and "outside" in r["error"]


def test_cuda_marker_is_registered(pytestconfig):
    assert any(line.startswith("cuda:") for line in pytestconfig.getini("markers"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_identity_on_cuda(tmp_path):
    plan = gpu_check.Plan(greedy_tokens=16)
    r = gpu_check.greedy_section(torch.device("cuda"), plan, tmp_path)
    assert r["ok"], r["failures"][:5]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_is_lossless_on_cuda():
    plan = gpu_check.Plan(samples=500, sampling_cases=("plain", "hydra-chain-topk", "mixed-q-tree"))
    r = gpu_check.sampling_section(torch.device("cuda"), plan)
    assert r["ok"], r["cases"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_random_shape_backbone_on_cuda(tmp_path):
    from cadence.backbone.base import Backbone
    from cadence.fast import shapes

    path = gpu_check.shape_path("tiny", tmp_path)
    bb = shapes.random_backbone(path, "float32", seed=1, device="cuda")
    assert bb.device.type == "cuda" and bb.kernel == "aten"
    ids = torch.randint(0, 1000, (1, 10), device="cuda")
    ref = Backbone(shapes.random_model(shapes.load_config(path), torch.float32, seed=1, device="cuda"))
    torch.testing.assert_close(bb.forward(ids, bb.new_cache()).logits, ref.forward(ids).logits, rtol=1e-3, atol=1e-3)
    curve = gpu_check.timed_curve(bb, [1, 4, 8], 2, context=32)
    assert curve["sizes"] == [1, 4, 8] and all(s > 0 for s in curve["seconds"])
