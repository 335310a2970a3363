"""Random-weight backbones in real models' shapes (``cadence.fast.shapes``): the kept
configs, the meta-device build, the memory check, and ``benchmarks/kernels/shapes.py --json`` on a
tiny shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cadence.backbone.base import Backbone
from cadence.errors import CadenceError
from cadence.fast import shapes

ROOT = Path(__file__).resolve().parents[1]
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1100,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "eos_token_id": 2,
        "rope_theta": 10000.0, "hidden_act": "silu"}


def tiny_config(tmp_path, **over) -> Path:
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**TINY, **over}))
    return path


def test_kept_shapes_are_supported_and_sized():
    from cadence.fast.arch import check

    names = shapes.shape_names()
    assert {"llama-3.2-1b", "qwen2.5-1.5b", "llama-3.1-8b"} <= set(names)
    counts = {n: shapes.parameter_count(shapes.load_config(n)) for n in names}
    assert counts["llama-3.2-1b"] == 1_235_814_400  # the published 1.24B, tied head
    assert counts["qwen2.5-1.5b"] == 1_543_714_304  # 1.54B
    assert counts["llama-3.1-8b"] == 8_030_261_248  # 8.03B
    for n in names:
        check(shapes.load_config(n))  # the fast path runs every kept shape
    assert (shapes.SHAPES_DIR / "README.md").is_file()


def test_parameter_count_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    for over in ({}, {"tie_word_embeddings": False}, {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}):
        cfg = shapes.load_config(tiny_config(tmp_path, **over))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        assert shapes.parameter_count(cfg) == sum(p.numel() for p in model.parameters())


def test_random_backbone_is_seeded_tied_and_computes_what_transformers_does(tmp_path):
    path = tiny_config(tmp_path)
    a = shapes.random_backbone(path, "float32", seed=3)
    b = shapes.random_backbone(path, "float32", seed=3)
    c = shapes.random_backbone(path, "float32", seed=4)
    assert a.name == "shape:tiny" and a.eos_token_ids == set()
    assert a.lm_head.weight.data_ptr() == a.embed.weight.data_ptr()  # tied as configured
    ids = torch.randint(0, 1100, (1, 12), generator=torch.Generator().manual_seed(0))
    la = a.forward(ids, a.new_cache()).logits
    assert torch.equal(la, b.forward(ids, b.new_cache()).logits)
    assert not torch.equal(la, c.forward(ids, c.new_cache()).logits)
    assert torch.isfinite(la).all() and la.std() > 0
    ref = Backbone(shapes.random_model(shapes.load_config(path), torch.float32, seed=3))
    torch.testing.assert_close(la, ref.forward(ids).logits, rtol=1e-4, atol=1e-4)
    norms = [p for n, p in ref.model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)


def test_memory_check_refuses_before_allocating(tmp_path, monkeypatch):
    monkeypatch.setattr(shapes, "mem_available", lambda: 1 << 20)  # 1 MiB free
    with pytest.raises(CadenceError, match="needs about .* GiB .* available"):
        shapes.random_backbone("llama-3.1-8b", "float32")
    plan = shapes.memory_plan(shapes.load_config("llama-3.1-8b"), torch.bfloat16)
    assert 16e9 < plan.weights < 16.2e9 and not plan.fits


def test_unknown_shape_is_a_clear_error():
    with pytest.raises(CadenceError, match="unknown shape"):
        shapes.config_path("no-such-shape")
    assert shapes.is_shape_spec("shape:llama-3.2-1b") and not shapes.is_shape_spec("smollm2")


def test_load_backbone_never_falls_back_to_a_shape():
    from cadence.backbone.load import load_backbone

    with pytest.raises(CadenceError, match="does not exist"):
        load_backbone("llama-3.2-1b")  # a shape's name is not a model


def test_shapes_script_json_on_a_tiny_shape(tmp_path):
    out = tmp_path / "tiny.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels" / "shapes.py"), "--shape", str(tiny_config(tmp_path)),
                           "--quick", "--dtypes", "float32", "--decode-tokens", "4", "--reps", "1", "--no-llama-cpp", "--no-predict",
                           "--json", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    entry = result["by_dtype"]["float32"]
    assert entry["load_s"] > 0 and entry["rss_bytes"] > 0 and entry["decode"]["decode_tok_s"] > 0
    curve = entry["curve"]
    assert curve["sizes"][0] == 1 and len(curve["sizes"]) == len(curve["seconds"])
    assert result["llama_cpp"]["status"].startswith("skipped")
    assert json.loads(proc.stdout)["shape"]["name"] == "tiny"


def _curve_file(tmp_path, name: str, per_node: float, draft_s: float = 0.002) -> Path:
    sizes = list(range(1, 65))
    seconds = [0.1 * (1 + per_node * (n - 1)) for n in sizes]
    entry = {"curve": {"sizes": sizes, "seconds": seconds, "context": 200}, "chains_only": False,
             "draft_s": {"hydra": draft_s, "mtp": draft_s, "eagle": draft_s}}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"by_dtype": {"bfloat16": entry}}))
    return path


def test_predictions_from_a_curve_file_need_no_backbone(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "benchmarks" / "analysis"))
    import entmtp_bound

    flat = entmtp_bound.curve_predictions(_curve_file(tmp_path, "flat", 0.002), "bfloat16")
    steep = entmtp_bound.curve_predictions(_curve_file(tmp_path, "steep", 0.2), "bfloat16")
    assert set(flat) == {"hydra", "mtp", "eagle-taps"}
    for method in flat:
        f, s = flat[method]["general+copy"], steep[method]["general+copy"]
        assert f["static_speedup"] > s["static_speedup"] >= 1.0  # cheap verification: bigger trees pay more
        assert f["static_nodes"] > s["static_nodes"]
        assert all(r["bound"] >= 1.0 for r in flat[method].values())
    latency, drafts, chains_only, dtype = entmtp_bound.curve_from_file(_curve_file(tmp_path, "x", 0.05))
    assert dtype == "bfloat16" and latency(1) == pytest.approx(0.1) and drafts["hydra"] == 0.002 and not chains_only
