"""User-facing failures of the core are CadenceErrors with a clear message."""

import pytest
import torch
from tiny import OracleDrafter, save_tiny, tiny_backbone
from transformers import LlamaConfig, ViTConfig

from cadence.backbone.base import resolve_dtype
from cadence.backbone.load import load_backbone, resolve_model_dir
from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.heads import new_heads
from cadence.schedulers.static import StaticScheduler


def test_over_long_prompt(llama):
    limit = llama.max_positions
    assert limit == 512
    with pytest.raises(CadenceError, match="exceeds the model's 512 positions .at most 9 new tokens fit"):
        Engine(llama).generate([65] * 503, GenerationConfig(max_new_tokens=10))
    with pytest.raises(CadenceError, match="prompt of 300 tokens \\+ 213 new tokens"):
        list(Engine(llama).stream([65] * 300, GenerationConfig(max_new_tokens=213)))
    # the same check for a speculative engine, before any forward
    heads = new_heads("medusa", llama, 3, random=True)
    with pytest.raises(CadenceError, match="exceeds"):
        Engine(llama, HeadDrafter(heads)).generate([65] * 503, GenerationConfig(max_new_tokens=10))
    # exactly at the limit works, for plain and tree decoding (trees are cut to the positions left)
    for eng in (Engine(llama), Engine(llama, HeadDrafter(heads), StaticScheduler.from_preset("tree-16", 3))):
        out = eng.generate([65] * 502, GenerationConfig(max_new_tokens=10))
        assert len(out.tokens) == 10


def test_empty_prompt_and_bad_budget(llama):
    with pytest.raises(CadenceError, match="empty prompt"):
        Engine(llama).generate([], GenerationConfig())
    with pytest.raises(CadenceError, match="max_new_tokens must be an integer >= 1"):
        Engine(llama).generate([1, 2], GenerationConfig(max_new_tokens=0))
    for text in ("", "  \n"):
        with pytest.raises(CadenceError, match="empty prompt"):
            llama.encode_prompt(text, chat=True)
    bare = tiny_backbone("llama", vocab=16, tokenizer=False)
    with pytest.raises(CadenceError, match="no tokenizer"):
        bare.encode_prompt("hello", chat=False)


def test_encode_prompt_chat_and_plain(llama):
    plain = llama.encode_prompt("hi", chat=False)
    chat = llama.encode_prompt("hi", chat=True)
    assert len(plain) == 2 and llama.tokenizer.decode(plain) == "hi"
    assert chat == [258] + plain + [256, 259]  # <|user|>hi<eos><|assistant|>


def test_tree_deeper_than_heads_is_rejected(llama):
    with pytest.raises(CadenceError, match="5 levels deep; this drafter fills at most 3"):
        StaticScheduler.from_preset("chain-5", 3)
    with pytest.raises(CadenceError, match="unknown tree"):
        StaticScheduler.from_preset("forest", 3)


def test_resolve_dtype_and_model_dir(tmp_path):
    assert resolve_dtype("bf16", torch.device("cpu")) is torch.bfloat16
    assert resolve_dtype(None, torch.device("cpu")) is torch.float32
    with pytest.raises(CadenceError, match="unknown dtype 'int3'"):
        resolve_dtype("int3", torch.device("cpu"))
    with pytest.raises(CadenceError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CadenceError, match="unsupported model file"):
        resolve_model_dir(str(tmp_path / "weights.bin"))
    with pytest.raises(CadenceError, match="no config.json"):
        resolve_model_dir(str(tmp_path))


def _tiny_config():
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=50)


def test_load_backbone_bad_directories(tmp_path):
    vit = tmp_path / "vit"
    ViTConfig().save_pretrained(vit)
    with pytest.raises(CadenceError, match="not a causal LM"):
        load_backbone(str(vit), "float32", "cpu")
    bad = tmp_path / "badcfg"
    bad.mkdir()
    (bad / "config.json").write_text("{oops")
    with pytest.raises(CadenceError, match="cannot read model config"):
        load_backbone(str(bad), "float32", "cpu")
    no_weights = tmp_path / "noweights"
    _tiny_config().save_pretrained(no_weights)
    with pytest.raises(CadenceError, match="cannot load the model weights"):
        load_backbone(str(no_weights), "float32", "cpu")
    corrupt = tmp_path / "corrupt"
    _tiny_config().save_pretrained(corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CadenceError, match="cannot load the model weights"):
        load_backbone(str(corrupt), "float32", "cpu")


def test_load_backbone_round_trip(tmp_path):
    bb = save_tiny(tmp_path / "m", "qwen2")
    loaded = load_backbone(str(tmp_path / "m"), "float32", "cpu")
    assert loaded.name == "m" and loaded.vocab_size == bb.vocab_size
    ids = bb.encode_prompt("same weights?", chat=True)
    assert loaded.encode_prompt("same weights?", chat=True) == ids
    cfg = GenerationConfig(max_new_tokens=12)
    assert Engine(loaded).generate(ids, cfg).tokens == Engine(bb).generate(ids, cfg).tokens
    # frozen: no gradients anywhere
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_oracle_beyond_reference_is_harmless(llama):
    """Asking for more tokens than the drafter knows: drafts past the reference are rejected."""
    ids = llama.encode_prompt("Write a poem about the sea.", chat=True)
    ref = Engine(llama).generate(ids, GenerationConfig(max_new_tokens=20)).tokens
    eng = Engine(llama, OracleDrafter(ref[:10], len(ids), 3, llama.vocab_size),
                 StaticScheduler.from_preset("chain", 3))
    assert eng.generate(ids, GenerationConfig(max_new_tokens=20)).tokens == ref
