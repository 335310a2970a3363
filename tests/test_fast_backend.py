"""Backend selection, weight sharing and the static cache of the fast path."""

from __future__ import annotations

import pytest
import torch
from test_fast_model import close, pair
from tiny import save_tiny, tiny_backbone
from transformers import LlamaConfig

from cadence.backbone.base import Backbone
from cadence.backbone.load import load_backbone
from cadence.errors import CadenceError
from cadence.backbone.load import make_fast
from cadence.fast.arch import unsupported_reason
from cadence.fast.cache import StaticKVCache
from cadence.fast.model import FastBackbone


def test_load_backbone_backends(tmp_path):
    save_tiny(tmp_path / "m", "llama")
    assert isinstance(load_backbone(str(tmp_path / "m"), backend="fast"), FastBackbone)
    assert isinstance(load_backbone(str(tmp_path / "m"), backend="auto"), FastBackbone)
    plain = load_backbone(str(tmp_path / "m"), backend="transformers")
    assert type(plain) is Backbone
    with pytest.raises(CadenceError, match="backend"):
        load_backbone(str(tmp_path / "m"), backend="turbo")


def test_unsupported_model_fast_raises_auto_falls_back():
    bb = tiny_backbone("llama")
    bb.model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert "dynamic" in unsupported_reason(bb.model.config)
    with pytest.raises(CadenceError, match="fast backend does not support.*dynamic"):
        make_fast(bb, "fast")
    assert make_fast(bb, "auto") is bb
    assert make_fast(bb, "transformers") is bb
    other = LlamaConfig()
    other.model_type = "gpt2"
    assert "gpt2" in unsupported_reason(other)


def test_dense_kernel_shares_weights_with_transformers():
    ref, fast = pair("llama", kernel="aten")
    layer = fast._layers[0]
    at = fast.model.model.layers[0].self_attn
    base = layer.qkv.dense.untyped_storage().data_ptr()
    for proj in (at.q_proj, at.k_proj, at.v_proj):  # views into the fused matrix, no copy
        assert proj.weight.untyped_storage().data_ptr() == base
    ids = torch.randint(0, 256, (2, 5))
    close(ref.model(ids).logits, fast.model(ids).logits)  # transformers' own forward still works


def test_packed_kernel_releases_dense_weights_and_rebuilds_on_demand():
    ref, fast = pair("qwen2", kernel="onednn")
    if fast.kernel != "onednn":
        pytest.skip("oneDNN not available in this torch build")
    q = fast.model.model.layers[1].self_attn.q_proj
    assert q.weight.numel() == 0  # one resident copy: the packed one
    assert fast.resident_bytes()["dense_layer_copy"] == 0
    # the LM head is packed too (a copy: twice as fast to read cold), the dense one kept for the heads
    assert fast._head.kind == "onednn" and fast.resident_bytes()["packed_head_copy"] > 0
    assert fast.lm_head.weight.numel() == fast.vocab_size * fast.spec.hidden
    ids = torch.randint(0, 256, (2, 5))
    close(ref.model(ids).logits, fast.model(ids).logits)  # the hook rebuilt them
    assert q.weight.shape == ref.model.model.layers[1].self_attn.q_proj.weight.shape
    close(ref.forward(ids).logits, fast.forward(ids).logits)  # fast path unaffected


def test_static_cache_compaction_is_an_index_copy():
    c = StaticKVCache(layers=2, kv_heads=1, head_dim=2, max_positions=64, dtype=torch.float32,
                      device=torch.device("cpu"), capacity=16)
    vals = torch.arange(9.0)
    c.k[:, :, :, :9] = vals[None, None, None, :, None]
    c.v[:, :, :, :9] = -vals[None, None, None, :, None]
    c.advance(9)
    k_before = c.k
    c.compact(5, [0, 2])  # the worked example in cadence.backbone.kv_cache: entries 0..4, 5, 7
    assert c.length() == 7
    assert c.k[1, 0, 0, :7, 0].tolist() == [0, 1, 2, 3, 4, 5, 7]
    assert c.v[0, 0, 0, :7, 1].tolist() == [0, -1, -2, -3, -4, -5, -7]
    assert c.k is k_before  # in place, no reallocation
    c.compact(5, [0])  # a prefix: only the length changes
    assert c.length() == 6
    with pytest.raises(CadenceError):
        c.compact(5, [0, 1, 2])
    c.advance(60)
    with pytest.raises(CadenceError, match="positions"):
        c.reserve(10)
