"""``cadence export``: eagle heads in vLLM's / SGLang's llama_eagle layout.

No vLLM / SGLang here: the exported tensors are loaded into a plain transformers
``LlamaDecoderLayer`` (input norm replaced by the identity, as both servers do for layer 0)
and an ``nn.Linear`` fc, and must reproduce the heads' own depth-1 features; importing the
directory back must give identical drafts.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import tiny_backbone
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from cadence.cli import main
from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.heads.export import export_heads, import_eagle
from cadence.heads import new_heads, save_heads
from cadence.schedulers.static import StaticScheduler
from cadence.trees.tree import compile_tree, preset


def assert_same_drafts(bb, heads, back):
    """Both sets of heads commit the same tokens with the same accepted lengths (tree of 8)."""
    tree = compile_tree(preset("tree-8", 3), name="t8")
    outs = [Engine(bb, HeadDrafter(h), lambda s: StaticScheduler(tree)).generate(
        [5, 9, 11, 3, 7, 9, 11, 3], GenerationConfig(max_new_tokens=32)) for h in (heads, back)]
    assert outs[0].tokens == outs[1].tokens
    assert [s.accepted for s in outs[0].stats.step_log] == [s.accepted for s in outs[1].stats.step_log]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    bb = tiny_backbone("llama")
    heads = new_heads("eagle", bb, 3, random=True, seed=7)
    save_heads(heads, root / "heads", dtype=torch.bfloat16)
    from cadence.heads import load_heads

    heads = load_heads(root / "heads", bb)  # the bf16-rounded weights, as shipped
    return {"root": root, "bb": bb, "heads": heads}


def test_vllm_layout_reproduces_features_in_transformers(setup):
    root, bb, heads = setup["root"], setup["bb"], setup["heads"]
    out = export_heads(root / "heads", "vllm-eagle", root / "vllm", bb.config.to_dict())
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["EagleLlamaForCausalLM"] and conf["num_hidden_layers"] == 1
    w = load_file(str(out / "model.safetensors"))
    H = bb.hidden_size
    assert w["fc.weight"].shape == (H, 2 * H)
    assert not any(k.startswith("layers.0.input_layernorm") or "embed" in k or "lm_head" in k for k in w)
    assert {k for k in w if k.startswith("layers.0.")} == {
        f"layers.0.{n}" for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight", "post_attention_layernorm.weight")}
    # a plain transformers layer built from the exported config, fed as vLLM feeds it
    keep = {k: v for k, v in conf.items() if k != "cadence"}
    cfg = LlamaConfig(**keep)
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, layer_idx=0).float()
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k[len("layers.0."):]: v.float() for k, v in w.items() if k.startswith("layers.0.")},
                          strict=False)
    fc = torch.nn.Linear(2 * H, H, bias=False)
    fc.weight.data = w["fc.weight"].float()
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 24))
    hidden = bb.forward(ids, need_logits=False).hidden
    T = ids.shape[1] - 1
    x = fc(torch.cat([bb.embed(ids[:, 1:]), hidden[:, :T]], dim=-1))
    pos = torch.arange(T)[None]
    cos_sin = LlamaRotaryEmbedding(cfg)(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        theirs = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        ours = heads.train_features(hidden, ids)[0]
    torch.testing.assert_close(theirs[:, :ours.shape[1]], ours, atol=2e-2, rtol=2e-2)  # bf16 export


def test_round_trip_gives_identical_drafts(setup):
    root, bb, heads = setup["root"], setup["bb"], setup["heads"]
    out = export_heads(root / "heads", "vllm-eagle", root / "rt")
    back = import_eagle(out, bb)
    assert_same_drafts(bb, heads, back)
    ids = torch.randint(0, 256, (1, 16))
    hidden = bb.forward(ids, need_logits=False).hidden
    with torch.no_grad():
        for a, b in zip(heads.train_features(hidden, ids), back.train_features(hidden, ids)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_sglang_layout_has_fc_bias_and_its_architecture(setup):
    root = setup["root"]
    out = export_heads(root / "heads", "sglang-eagle", root / "sgl")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    w = load_file(str(out / "model.safetensors"))
    assert torch.equal(w["fc.bias"], torch.zeros_like(w["fc.bias"]))


def test_other_kinds_and_bad_input_are_refused(setup, tmp_path, capsys):
    bb = setup["bb"]
    save_heads(new_heads("mtp-attn", bb, 2, random=True), tmp_path / "m")
    with pytest.raises(CadenceError, match="needs eagle heads"):
        export_heads(tmp_path / "m", "vllm-eagle", tmp_path / "o")
    with pytest.raises(CadenceError, match="not a heads directory"):
        export_heads(tmp_path / "nothing", "vllm-eagle", tmp_path / "o")
    rc = main(["export", "--heads", str(tmp_path / "m"), "--format", "vllm-eagle", "--out", str(tmp_path / "o"),
               "--model", ""])
    assert rc == 2 and "needs eagle heads" in capsys.readouterr().err


# ---------------------------------------------------------------- medusa (vLLM)

@pytest.fixture(scope="module")
def medusa(tmp_path_factory):
    from cadence.heads import load_heads

    root = tmp_path_factory.mktemp("medusa")
    bb = tiny_backbone("llama")
    heads = new_heads("medusa", bb, 3, random=True, seed=5)
    heads.set_draft_vocab(torch.arange(0, 200, 2))  # a draft vocabulary of 100 ids
    save_heads(heads, root / "heads", dtype=torch.bfloat16)
    return {"root": root, "bb": bb, "heads": load_heads(root / "heads", bb)}


def test_vllm_medusa_layout_reproduces_each_heads_top1(medusa):
    """vLLM's Medusa forward rebuilt from the exported tensors alone (ResidualBlock
    x + SiLU(W x + b), the shared LM head cut to token_map, logits scattered back into the
    full vocabulary with -inf elsewhere) picks each head's cadence draft."""
    root, bb, heads = medusa["root"], medusa["bb"], medusa["heads"]
    out = export_heads(root / "heads", "vllm-medusa", root / "vllm", lm_weight=bb.lm_head.weight)
    conf = json.loads((out / "config.json").read_text())
    assert conf["model_type"] == "medusa" and conf["num_heads"] == 3 and conf["num_hidden_layers"] == 1
    assert conf["truncated_vocab_size"] == 100 and conf["vocab_size"] == bb.vocab_size
    assert conf["medusa_fc_bias"] is True and conf["original_lm_head"] is True
    w = load_file(str(out / "model.safetensors"))
    H = bb.hidden_size
    assert set(w) == {f"blocks.{i}.layers.0.{p}" for i in range(3) for p in ("weight", "bias")} | {
        "lm_heads.0.weight", "token_map"}
    assert w["lm_heads.0.weight"].shape == (100, H) and w["token_map"].dtype == torch.int64
    torch.manual_seed(0)
    hidden = bb.forward(torch.randint(0, 256, (1, 12)), need_logits=False).hidden[0]  # (12, H)
    with torch.no_grad():
        for i in range(3):
            x = hidden + torch.nn.functional.silu(
                hidden @ w[f"blocks.{i}.layers.0.weight"].float().T + w[f"blocks.{i}.layers.0.bias"].float())
            cut = x @ w["lm_heads.0.weight"].float().T
            full = torch.full((hidden.shape[0], bb.vocab_size), float("-inf"))
            full[:, w["token_map"]] = cut
            logits, vocab_ids, _ = heads.draft_step(i + 1, heads.init_state(hidden), torch.zeros(12, dtype=torch.long))
            assert torch.equal(full.argmax(-1), vocab_ids[logits.argmax(-1)])


def test_vllm_medusa_round_trip_gives_identical_drafts(medusa):
    from cadence.heads.export import import_medusa

    root, bb, heads = medusa["root"], medusa["bb"], medusa["heads"]
    out = export_heads(root / "heads", "vllm-medusa", root / "rt", lm_weight=bb.lm_head.weight)
    back = import_medusa(out, bb)
    assert_same_drafts(bb, heads, back)
    assert torch.equal(back.draft_vocab, heads.draft_vocab)


def test_vllm_medusa_refuses_wrong_kind_missing_or_foreign_lm_head(medusa, tmp_path):
    from cadence.heads.export import import_medusa

    root, bb = medusa["root"], medusa["bb"]
    with pytest.raises(CadenceError, match="pass the backbone"):
        export_heads(root / "heads", "vllm-medusa", tmp_path / "o")
    with pytest.raises(CadenceError, match="wrong --model"):
        export_heads(root / "heads", "vllm-medusa", tmp_path / "o", lm_weight=torch.zeros(7, bb.hidden_size))
    save_heads(new_heads("hydra", bb, 2, random=True), tmp_path / "h")
    with pytest.raises(CadenceError, match="needs medusa heads"):
        export_heads(tmp_path / "h", "vllm-medusa", tmp_path / "o", lm_weight=bb.lm_head.weight)
    out = export_heads(root / "heads", "vllm-medusa", tmp_path / "m", lm_weight=bb.lm_head.weight)
    other = tiny_backbone("llama", seed=3)
    with pytest.raises(CadenceError, match="another backbone"):
        import_medusa(out, other)


def test_format_names_of_the_issue_are_aliases(medusa, tmp_path):
    """``--format eagle|medusa`` are vLLM's layouts."""
    root, bb = medusa["root"], medusa["bb"]
    a = export_heads(root / "heads", "medusa", tmp_path / "a", lm_weight=bb.lm_head.weight)
    b = export_heads(root / "heads", "vllm-medusa", tmp_path / "b", lm_weight=bb.lm_head.weight)
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    with pytest.raises(CadenceError, match="unknown export format"):
        export_heads(root / "heads", "onnx", tmp_path / "c")


def test_two_layer_drafter_exports_as_a_stack_of_llama_layers(setup, tmp_path):
    """num_layers 2: config says 2, layer 1 keeps its input norm, and two transformers layers
    (the first without input norm, as vLLM / SGLang build them) reproduce the features; the
    directory imports back to identical drafts."""
    bb = setup["bb"]
    save_heads(new_heads("eagle", bb, 3, random=True, seed=8, num_layers=2), tmp_path / "h")
    from cadence.heads import load_heads

    heads = load_heads(tmp_path / "h", bb)
    out = export_heads(tmp_path / "h", "vllm-eagle", tmp_path / "v", bb.config.to_dict())
    conf = json.loads((out / "config.json").read_text())
    assert conf["num_hidden_layers"] == 2
    w = load_file(str(out / "model.safetensors"))
    assert "layers.1.input_layernorm.weight" in w and "layers.0.input_layernorm.weight" not in w
    cfg = LlamaConfig(**{k: v for k, v in conf.items() if k != "cadence"})
    cfg._attn_implementation = "eager"
    layers = []
    for i in range(2):
        layer = LlamaDecoderLayer(cfg, layer_idx=i).float()
        if i == 0:
            layer.input_layernorm = torch.nn.Identity()
        pre = f"layers.{i}."
        layer.load_state_dict({k[len(pre):]: v.float() for k, v in w.items() if k.startswith(pre)}, strict=False)
        layers.append(layer)
    H = bb.hidden_size
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, 20))
    hidden = bb.forward(ids, need_logits=False).hidden
    T = ids.shape[1] - 1
    x = torch.cat([bb.embed(ids[:, 1:]), hidden[:, :T]], dim=-1) @ w["fc.weight"].float().T
    pos = torch.arange(T)[None]
    cos_sin = LlamaRotaryEmbedding(cfg)(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        for layer in layers:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            x = x[0] if isinstance(x, tuple) else x
        ours = heads.train_features(hidden, ids)[0]
    assert H == ours.shape[-1]
    torch.testing.assert_close(x[:, :ours.shape[1]], ours, atol=2e-2, rtol=2e-2)
    back = import_eagle(out, bb)
    assert back.cfg.num_layers == 2
    assert_same_drafts(bb, heads, back)
