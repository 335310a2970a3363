"""The EAGLE-3 drafter (``--method eagle3``): its own draft vocabulary (d2t / t2d), lossless
decoding with that vocabulary, training-time test through the trainer, and ``cadence export
--format vllm|sglang``, whose layout is checked by a small reimplementation of the servers'
EAGLE-3 forward that reads nothing but the exported tensors (and the target's embedding).

Lossless greedy / sampled decoding, the cache and save / load of eagle3 over the whole vocabulary
run with the other attention heads (test_attention_heads, test_dynamic_tree: kind "eagle3")."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_attention_heads import PROMPTS, engine_for, reference
from tiny import tiny_backbone

from cadence.cli import main
from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.generation import GenerationConfig
from cadence.decode.request import drafter_states
from cadence.errors import CadenceError
from cadence.heads.export import export_heads
from cadence.heads import load_heads, new_heads, save_heads
from cadence.heads.eagle3 import default_taps
from cadence.trees.tree import chain, compile_tree

TAPS = [1, 2, 3]  # low / mid / high of a 4-layer tiny backbone
VOCAB = torch.tensor(sorted(set(range(0, 260, 2)) | {256, 257, 99}))  # a draft vocabulary, EOS (256) in


@pytest.fixture(scope="module")
def bb():
    return tiny_backbone("llama", layers=4)


def bf16_heads(bb, seed=7, vocab=VOCAB):
    """Random eagle3 heads over ``vocab`` whose weights are bf16 numbers (export loses nothing)."""
    heads = new_heads("eagle3", bb, 3, random=True, seed=seed, taps=TAPS)
    heads.set_draft_vocab(vocab)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return heads.eval()


def test_default_taps_are_low_mid_high():
    assert default_taps(30) == [2, 15, 27] and default_taps(4) == [1, 2] and default_taps(2) == [1]


def test_draft_vocabulary_resizes_the_head_and_drafts_inside_it(bb, tmp_path):
    heads = new_heads("eagle3", bb, 3, taps=TAPS)  # fresh: starts from the backbone's LM head rows
    assert heads.lm_head.out_features == bb.vocab_size and heads.cfg.draft_vocab_size == 0
    heads.set_draft_vocab(VOCAB)
    assert heads.lm_head.out_features == len(VOCAB) == heads.cfg.draft_vocab_size
    torch.testing.assert_close(heads.lm_head.weight, bb.lm_head.weight[VOCAB])
    with pytest.raises(CadenceError, match="increasing"):
        heads.set_draft_vocab(VOCAB.flip(0))
    back = load_heads(save_heads(heads, tmp_path), bb)
    assert back.cfg.draft_vocab_size == len(VOCAB) and torch.equal(back.draft_vocab, VOCAB)
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == len(VOCAB)
    drafter = HeadDrafter(back, context_vocab=256)
    assert drafter.context_vocab is None  # its logits are its own head's: no context columns
    tree = compile_tree(chain(3), name="c3")
    state = drafter.new_state()
    ids = torch.tensor([PROMPTS[0]])
    fwd = bb.forward(ids, need_logits=False, taps=tuple(TAPS))
    drafter.commit(state, drafter_states(fwd)[0], PROMPTS[0])
    d = drafter.draft(tree, 7, fwd.hidden[0, -1], PROMPTS[0], GenerationConfig().sampling, None, state=state)
    assert set(d.tokens[1:].tolist()) <= set(VOCAB.tolist())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_a_draft_vocabulary_is_identical(arch):
    bb = tiny_backbone(arch, layers=4)
    heads = bf16_heads(bb)
    for tree, copy in (("chain", False), ("tree-8", False), ("tree-16", True)):
        eng = engine_for(bb, heads, tree, copy)
        for prompt in PROMPTS:
            assert eng.generate(prompt, GenerationConfig(max_new_tokens=40)).tokens == reference(bb, prompt, 40)


# ------------------------------------------------------------------ export: the layout's forward


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """x (N, heads, D) rotated (rotate-half) at positions pos (N,)."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = pos[:, None].float() * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


class LayoutForward:
    """The EAGLE-3 draft model as vLLM's / SGLang's llama_eagle3 compute it, from the exported
    directory alone: fc over the taps, the 2d-input layer with its KV cache, norm, lm_head, d2t."""

    def __init__(self, directory, embedding):
        self.w = {k: v.float() for k, v in load_file(str(directory / "model.safetensors")).items()
                  if k not in ("d2t", "t2d")}
        raw = load_file(str(directory / "model.safetensors"))
        self.d2t, self.t2d = raw["d2t"], raw["t2d"]
        self.c = json.loads((directory / "config.json").read_text())
        self.E = embedding
        self.keys, self.values = [], []

    def step(self, tokens, hidden, pos):
        """tokens (N,), hidden (N, H) fused or fed-back features at positions pos (N,), causal
        over the cache and among themselves -> (logits over the target vocabulary (N, V), pre-norm (N, H))."""
        c, w, eps = self.c, self.w, self.c["rms_norm_eps"]
        H, nh, kvh, D = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        p = "midlayer."
        residual = hidden
        x = torch.cat([_rms(self.E[tokens], w[p + "input_layernorm.weight"], eps),
                       _rms(hidden, w[p + "hidden_norm.weight"], eps)], -1)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(-1, nh, D)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(-1, kvh, D)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(-1, kvh, D)
        q, k = _rope(q, pos, c["rope_theta"]), _rope(k, pos, c["rope_theta"])
        self.keys.append(k), self.values.append(v)
        K, V = torch.cat(self.keys), torch.cat(self.values)
        n_old = K.shape[0] - len(tokens)
        mask = torch.ones(len(tokens), K.shape[0], dtype=torch.bool).tril(n_old)
        att = F.scaled_dot_product_attention(q.transpose(0, 1), K.repeat_interleave(nh // kvh, 1).transpose(0, 1),
                                             V.repeat_interleave(nh // kvh, 1).transpose(0, 1), attn_mask=mask)
        h = att.transpose(0, 1).reshape(len(tokens), nh * D) @ w[p + "self_attn.o_proj.weight"].T + residual
        y = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        pre = (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)
               ) @ w[p + "mlp.down_proj.weight"].T + h
        draft = _rms(pre, w["norm.weight"], eps) @ w["lm_head.weight"].T  # (N, V')
        full = draft.new_full((len(tokens), c["vocab_size"]), float("-inf"))
        full[:, torch.arange(self.d2t.numel()) + self.d2t] = draft
        return full, pre


@pytest.fixture(scope="module")
def exported(bb, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-export")
    heads = bf16_heads(bb)
    save_heads(heads, root / "heads", dtype=torch.bfloat16)
    heads = load_heads(root / "heads", bb)
    vllm = export_heads(root / "heads", "vllm", root / "vllm", bb.config.to_dict())
    sglang = export_heads(root / "heads", "sglang", root / "sglang", bb.config.to_dict(), method="eagle3")
    return {"root": root, "heads": heads, "vllm": vllm, "sglang": sglang}


def test_exported_tensors_and_configs_are_the_eagle3_layout(bb, exported):
    w = load_file(str(exported["vllm"] / "model.safetensors"))
    H, V, Vd = bb.hidden_size, bb.vocab_size, len(VOCAB)
    layer = {f"midlayer.{n}.weight" for n in (
        "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
        "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert set(w) == layer | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert w["fc.weight"].shape == (H, 3 * H) and w["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert w["lm_head.weight"].shape == (Vd, H) and w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert torch.equal(w["d2t"] + torch.arange(Vd), VOCAB) and w["t2d"].sum() == Vd and w["t2d"][VOCAB].all()
    assert w["fc.weight"].dtype == torch.bfloat16
    cv = json.loads((exported["vllm"] / "config.json").read_text())
    cs = json.loads((exported["sglang"] / "config.json").read_text())
    assert cv["architectures"] == ["Eagle3LlamaForCausalLM"] and cs["architectures"] == ["LlamaForCausalLMEagle3"]
    for c in (cv, cs):
        assert (c["num_hidden_layers"], c["draft_vocab_size"], c["target_hidden_size"], c["vocab_size"]) == (1, Vd, H, V)
        assert c["tie_word_embeddings"] is False
    assert cv["eagle_aux_hidden_state_layer_ids"] == TAPS and cv["norm_before_residual"] is False
    assert cs["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [j - 1 for j in TAPS]  # SGLang adds 1
    assert "eagle_aux_hidden_state_layer_ids" not in cs
    sw = load_file(str(exported["sglang"] / "model.safetensors"))
    assert set(sw) == set(w) and all(torch.equal(sw[k], w[k]) for k in w)


@pytest.mark.parametrize("server", ["vllm", "sglang"])
def test_layout_forward_from_the_exported_tensors_matches_cadence(bb, exported, server):
    """Teacher-forced logits at every position (fused taps), then a 3-token chain drafted
    autoregressively on the fed-back pre-norm features: the same as cadence's drafts."""
    heads = exported["heads"]
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(5))
    fwd = bb.forward(ids, need_logits=False, taps=tuple(TAPS))
    T = ids.shape[1]
    model = LayoutForward(exported[server], bb.embed.weight.detach().float())
    fc = model.w["fc.weight"]
    fused = fwd.taps[0, :T - 1].flatten(-2) @ fc.T  # entries j = 0..T-2: (x_{j+1}, taps_j)
    logits, pre = model.step(ids[0, 1:], fused, torch.arange(T - 1))
    with torch.no_grad():
        mine = heads.lm_logits(heads.train_features(fwd.hidden, ids, taps=fwd.taps)[0][0])  # (T-2, V)
    torch.testing.assert_close(logits[:T - 2], mine, atol=2e-4, rtol=2e-4)
    chain_tokens, feat = [], pre[-1:]
    tok = int(logits[-1].argmax())
    for k in range(3):
        chain_tokens.append(tok)
        if k == 2:
            break
        lg, feat = model.step(torch.tensor([tok]), feat, torch.tensor([T - 1 + k]))
        tok = int(lg[0].argmax())
    drafter = HeadDrafter(heads)
    state = drafter.new_state()
    context = ids[0, :T - 1].tolist()
    drafter.commit(state, drafter_states(fwd)[0, :T - 1], context)
    d = drafter.draft(compile_tree(chain(3), name="c3"), int(ids[0, T - 1]), fwd.hidden[0, T - 2], context,
                      GenerationConfig().sampling, None, state=state)
    assert d.tokens[1:].tolist() == chain_tokens


def test_export_refuses_what_the_layout_cannot_hold(bb, exported, tmp_path, capsys):
    two = tiny_backbone("llama")  # 2 layers: one tap only
    save_heads(new_heads("eagle3", two, 3, random=True), tmp_path / "one-tap")
    with pytest.raises(CadenceError, match="exactly three"):
        export_heads(tmp_path / "one-tap", "vllm", tmp_path / "o")
    rc = main(["export", "--heads", str(tmp_path / "one-tap"), "--method", "eagle3", "--format", "sglang",
               "--out", str(tmp_path / "o"), "--model", ""])
    assert rc != 0 and "exactly three" in capsys.readouterr().err
    heads_dir = exported["root"] / "heads"
    with pytest.raises(CadenceError, match="not layers 1..2"):  # a 3-layer backbone cannot give tap 3
        export_heads(heads_dir, "vllm", tmp_path / "o", tiny_backbone("llama", layers=3).config.to_dict())
    with pytest.raises(CadenceError, match="needs eagle heads"):
        export_heads(heads_dir, "vllm-eagle", tmp_path / "o")
    with pytest.raises(CadenceError, match="holds eagle3 heads"):
        export_heads(heads_dir, "vllm", tmp_path / "o", method="eagle")
    save_heads(new_heads("eagle", bb, 3, random=True), tmp_path / "e1")
    with pytest.raises(CadenceError, match="needs eagle3 heads"):
        export_heads(tmp_path / "e1", "sglang-eagle3", tmp_path / "o")
    broken = tmp_path / "no-hidden-norm"
    save_heads(exported["heads"], broken)
    state = load_file(str(broken / "heads.safetensors"))
    from safetensors.torch import save_file
    save_file({k: v for k, v in state.items() if "hidden_norm" not in k}, str(broken / "heads.safetensors"))
    with pytest.raises(CadenceError, match="does not match"):
        export_heads(broken, "vllm", tmp_path / "o")


def test_cli_exports_eagle3_for_both_servers(exported, tmp_path, capsys):
    rc = main(["export", "--heads", str(exported["root"] / "heads"), "--method", "eagle3", "--format", "vllm",
               "--out", str(tmp_path / "v"), "--model", ""])
    assert rc == 0 and '"method": "eagle3"' in capsys.readouterr().out
    rc = main(["export", "--heads", str(exported["root"] / "heads"), "--format", "sglang", "--out",
               str(tmp_path / "s"), "--model", ""])
    assert rc == 0 and "--speculative-algorithm EAGLE3" in capsys.readouterr().out
    assert json.loads((tmp_path / "s" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


# ------------------------------------------------------------------ training


def test_trainer_defaults_the_taps_trains_its_own_head_and_refuses_kl(tmp_path):
    from test_training_support import base_config, make_data, tiny_model_dir

    from cadence.backbone.load import load_backbone
    from cadence.training.trainer import train

    model = tiny_model_dir(tmp_path)
    data = make_data(tmp_path / "data")
    bb = load_backbone(str(model))
    kw = dict(kind="eagle3", num_heads=4, draft_vocab=100, steps=6, eval_every=3, save_every=2)
    run = train(base_config(data, tmp_path / "out", model, **kw), backbone=bb)
    heads = load_heads(tmp_path / "out" / "heads", bb)
    assert heads.cfg.taps == default_taps(2) and heads.cfg.draft_vocab_size == 100 == heads.lm_head.out_features
    assert len(run.summary["heldout"]["top1"]) == 4  # one accuracy per training-time-test step
    start = new_heads("eagle3", bb, 4, taps=heads.cfg.taps)
    start.set_draft_vocab(heads.draft_vocab)
    assert not torch.equal(start.lm_head.weight, heads.lm_head.weight)  # its own head was trained
    with pytest.raises(CadenceError, match="eagle3 trains its own LM head"):
        train(base_config(data, tmp_path / "kl", model, **{**kw, "loss": "kl"}), backbone=bb)
