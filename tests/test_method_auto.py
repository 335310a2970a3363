"""``--method auto`` and ``--datastore auto``: what they settle to per backbone (``methods.resolve_method``),
and ``cadence generate`` with no method named, on a tiny saved model."""

import json
from types import SimpleNamespace

import pytest
import torch
from tiny import save_tiny

from cadence.backbone.load import load_backbone
from cadence.cli import main
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.heads import new_heads, save_heads
from cadence.heads import shipped
from cadence.methods import Method, MethodSpec, make_engine, resolve_method

SMOL = "SmolLM2-135M-Instruct"  # the one backbone with shipped heads


def backbone(name=SMOL, quant="none", dtype=torch.float32):
    return SimpleNamespace(name=name, quant=quant, dtype=dtype)


@pytest.fixture
def store_root(tmp_path, monkeypatch):
    """A checkout whose data/selfdistill holds a store for SmolLM2 (a manifest is what is looked for)."""
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "manifest.json").write_text("{}")
    monkeypatch.setattr(shipped, "CHECKOUT_STORES", tmp_path)
    return tmp_path


@pytest.mark.parametrize("quant", ["gguf", "q8_0", "q4_1", "q4_0"])
def test_gguf_blocks_take_ngram_and_the_models_store(store_root, quant):
    spec, why = resolve_method(backbone(quant=quant), MethodSpec())
    assert spec.method is Method.NGRAM and spec.datastore == str(store_root / "smollm2")
    assert f"--method auto: ngram ({quant} blocks" in why and "--datastore auto:" in why


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_dense_float32_takes_hydra(store_root, quant):
    spec, why = resolve_method(backbone(quant=quant), MethodSpec())
    assert spec.method is Method.HYDRA and spec.heads == "default" and "(dense float32)" in why
    assert spec.datastore == str(store_root / "smollm2")  # heads methods take copies from the store too


def test_dense_bfloat16_takes_the_shipped_eagle_taps(store_root):
    spec, why = resolve_method(backbone(dtype=torch.bfloat16), MethodSpec())
    assert (spec.method, spec.heads) == (Method.EAGLE, "eagle-taps") and "--method auto: eagle@eagle-taps" in why
    assert spec.datastore == str(store_root / "smollm2")


def test_a_model_without_shipped_heads_or_store_takes_ngram_alone(store_root):
    spec, why = resolve_method(backbone(name="other-model"), MethodSpec())
    assert spec.method is Method.NGRAM and spec.datastore == "none"
    assert "no heads ship for other-model" in why and "--datastore" not in why


def test_a_wheel_without_the_checkouts_data_has_no_store(tmp_path, monkeypatch):
    monkeypatch.setattr(shipped, "CHECKOUT_STORES", tmp_path / "absent")
    spec, _ = resolve_method(backbone(quant="gguf"), MethodSpec())
    assert spec.method is Method.NGRAM and spec.datastore == "none"


@pytest.mark.parametrize("text", ["auto:tree-16", "auto+entmtp", "auto/nocopy", "auto:auto-8", "auto,heads=random"])
def test_settings_only_heads_follow_take_heads(store_root, text):
    spec, why = resolve_method(backbone(quant="gguf"), MethodSpec.parse(text))
    assert spec.method is Method.HYDRA and "the settings ask for heads" in why
    if text.endswith("/nocopy"):
        assert spec.datastore == "none"  # no copies: nothing for a store to supply


@pytest.mark.parametrize("text", ["auto:chain", "auto:chain-4"])
def test_copy_chains_keep_ngram(store_root, text):
    assert resolve_method(backbone(quant="gguf"), MethodSpec.parse(text))[0].method is Method.NGRAM


def test_named_methods_and_stores_are_kept(store_root, tmp_path):
    spec, why = resolve_method(backbone(quant="gguf"), MethodSpec.parse("eagle,datastore=none"))
    assert (spec.method, spec.datastore, why) == (Method.EAGLE, "none", "")
    spec, why = resolve_method(backbone(quant="gguf"), MethodSpec.parse(f"mtp,datastore={tmp_path}"))
    assert (spec.method, spec.datastore, why) == (Method.MTP, str(tmp_path), "")
    vanilla, _ = resolve_method(backbone(quant="gguf"), MethodSpec.parse("vanilla"))
    assert vanilla.datastore == "none"


def test_heads_directory_names_the_method(tmp_path):
    tiny = SimpleNamespace(name="tiny", hidden_size=64, vocab_size=260)
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"kind": "mtp"}))
    spec, why = resolve_method(tiny, MethodSpec(heads=str(heads)))
    assert spec.method is Method.MTP and f"the kind of --heads {heads}" in why
    with pytest.raises(CadenceError, match="no heads config.json"):
        resolve_method(tiny, MethodSpec(heads=str(tmp_path / "missing")))
    (heads / "config.json").write_text(json.dumps({"kind": "clp"}))
    with pytest.raises(CadenceError, match="not a decoding method"):
        resolve_method(tiny, MethodSpec(heads=str(heads)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models") / "tiny-model"
    save_tiny(d, "llama")
    return d


def test_make_engine_keeps_what_auto_settled(model_dir):
    bb = load_backbone(str(model_dir), "float32", "cpu")
    engine = make_engine(bb, MethodSpec())
    assert engine.spec.method is Method.NGRAM and engine.spec.datastore == "none"
    assert engine.auto_reason == "--method auto: ngram (no heads ship for tiny-model)"
    ids = bb.encode_prompt("Repeat: one two three, one two three, one two", chat=True)
    cfg = GenerationConfig(max_new_tokens=24)
    assert engine.generate(ids, cfg).tokens == Engine(bb).generate(ids, cfg).tokens


def test_generate_without_a_method(capsys, model_dir, tmp_path):
    rc = main(["generate", "--model", str(model_dir), "--prompt", "Say hi.", "--max-new-tokens", "8", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rec = json.loads(out.out)
    assert rec["method"] == "ngram" and rec["heads"] is None and rec["scheduler"] == "copy-chain"
    assert rec["auto"] == "--method auto: ngram (no heads ship for tiny-model)" and rec["lossless"] is True
    bb = load_backbone(str(model_dir), "float32", "cpu")
    save_heads(new_heads("medusa", bb, 2, random=True), tmp_path / "heads")
    rc = main(["generate", "--model", str(model_dir), "--prompt", "Say hi.", "--max-new-tokens", "8",
               "--heads", str(tmp_path / "heads"), "--tree", "chain"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    heads = tmp_path / "heads"
    assert f"cadence: --method auto: medusa@{heads} (the kind of --heads {heads})" in out.err
