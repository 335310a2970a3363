"""Draft heads: training view == drafting view, fresh-head behaviour, save/load and its errors."""

import json

import pytest
import torch
from tiny import tiny_backbone

from cadence.draft.head_drafter import HeadDrafter
from cadence.errors import CadenceError
from cadence.heads import HeadConfig, load_heads, new_heads, save_heads
from cadence.verify.sampling import SamplingParams
from cadence.trees.tree import compile_tree, preset

KINDS = ("medusa", "hydra", "mtp")
K = 3


def backbone_states(bb, ids):
    with torch.inference_mode():
        return bb.forward(ids).hidden


@pytest.mark.parametrize("kind", KINDS)
def test_train_logits_equal_step_along_the_same_path(llama, kind):
    """Head k at position t, teacher-forced, == stepping heads 1..k from h_t along x_{t+1}..x_{t+k}."""
    heads = new_heads(kind, llama, K, random=True, seed=4)
    g = torch.Generator().manual_seed(0)
    B, T = 2, 12
    ids = torch.randint(0, llama.vocab_size, (B, T), generator=g)
    hidden = backbone_states(llama, ids)
    with torch.no_grad():
        train = heads.train_logits(hidden, ids)
        assert len(train) == K
        for k in range(1, K + 1):
            assert train[k - 1].shape == (B, T - 1 - k, llama.vocab_size)
        n = T - 1 - K  # positions valid for every head
        for b in range(B):
            state = heads.init_state(hidden[b, :n])  # batch over positions t = 0..n-1
            for k in range(1, K + 1):
                token = ids[b, k:k + n]  # x_{t+k}: the token at depth k-1 on the path
                logits, state = heads.step(k, state, token)
                torch.testing.assert_close(logits, train[k - 1][b, :n], atol=2e-4, rtol=2e-4)
        # the last positions of shallower heads as well (t up to T-2-k)
        for k in range(1, K + 1):
            t = T - 2 - k
            state = heads.init_state(hidden[:, t])
            for j in range(1, k + 1):
                logits, state = heads.step(j, state, ids[:, t + j])
            torch.testing.assert_close(logits, train[k - 1][:, t], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_fresh_heads_predict_what_the_backbone_predicts(llama, kind):
    """Untrained medusa / hydra heads are the identity on h_t: every head gives the backbone's logits."""
    heads = new_heads(kind, llama, K)
    ids = torch.randint(0, llama.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    hidden = backbone_states(llama, ids)
    base = llama.logits(hidden)
    with torch.no_grad():
        for k, lg in enumerate(heads.train_logits(hidden, ids), 1):
            torch.testing.assert_close(lg, base[:, :10 - 1 - k], atol=1e-5, rtol=1e-5)


def test_medusa_ignores_the_path_and_sequential_heads_do_not(llama):
    hidden = torch.randn(1, llama.hidden_size, generator=torch.Generator().manual_seed(2))
    for kind in KINDS:
        heads = new_heads(kind, llama, K, random=True)
        with torch.no_grad():
            s = heads.init_state(hidden)
            _, s1a = heads.step(1, s, torch.tensor([5]))
            _, s1b = heads.step(1, s, torch.tensor([9]))
            la, _ = heads.step(2, s1a, torch.tensor([7]))
            lb, _ = heads.step(2, s1b, torch.tensor([7]))
        assert torch.equal(la, lb) == (kind == "medusa"), kind


def test_new_heads_errors(llama):
    with pytest.raises(CadenceError, match="at least one head"):
        new_heads("hydra", llama, 0)
    with pytest.raises(CadenceError, match="unknown head type"):
        new_heads("bogus", llama, 2)


def drafts(heads, bb, tree_name="tree-16"):
    tree = compile_tree(preset(tree_name, heads.K))
    hidden = torch.randn(bb.hidden_size, generator=torch.Generator().manual_seed(3))
    d = HeadDrafter(heads)
    greedy = d.draft(tree, 11, hidden, [1, 2], SamplingParams(), None)
    sampled = d.draft(tree, 11, hidden, [1, 2], SamplingParams(temperature=0.8, top_p=0.9),
                      torch.Generator().manual_seed(5))
    return greedy, sampled


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(llama, tmp_path, kind):
    heads = new_heads(kind, llama, K, random=True, seed=7)
    save_heads(heads, tmp_path / "h")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["config.json", "heads.safetensors"]
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["kind"] == kind and cfg["num_heads"] == K and cfg["backbone"] == llama.name
    loaded = load_heads(tmp_path / "h", llama)
    assert type(loaded) is type(heads) and loaded.cfg == heads.cfg and not loaded.training
    a, b = heads.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the frozen backbone embedding / LM head are shared, never saved
    assert not any("lm_head" in k or "embed" in k for k in a)
    assert not any(llama.vocab_size in v.shape for v in a.values())
    (g1, s1), (g2, s2) = drafts(heads, llama), drafts(loaded, llama)
    assert torch.equal(g1.tokens, g2.tokens)
    assert torch.equal(s1.tokens, s2.tokens) and torch.equal(s1.q, s2.q)


def test_save_bf16_loads_close(llama, tmp_path):
    heads = new_heads("mtp", llama, K, random=True, seed=8)
    save_heads(heads, tmp_path, dtype=torch.bfloat16, extra_config={"note": "bf16"})
    assert json.loads((tmp_path / "config.json").read_text())["note"] == "bf16"
    loaded = load_heads(tmp_path, llama)
    for k, v in heads.state_dict().items():
        w = loaded.state_dict()[k]
        assert w.dtype == torch.float32
        torch.testing.assert_close(w, v.to(torch.bfloat16).float())


def test_load_for_another_backbone_fails(llama, qwen2, tmp_path):
    save_heads(new_heads("hydra", llama, K), tmp_path)
    with pytest.raises(CadenceError, match="trained for 'tiny-llama', not 'tiny-qwen2'"):
        load_heads(tmp_path, qwen2)
    narrow = tiny_backbone("llama", hidden=32)
    with pytest.raises(CadenceError, match=r"made for tiny-llama \(hidden 64.*has hidden 32"):
        load_heads(tmp_path, narrow)
    small_vocab = tiny_backbone("llama", vocab=100, tokenizer=False)
    with pytest.raises(CadenceError, match="vocab 100"):
        load_heads(tmp_path, small_vocab)


def test_load_missing_files(llama, tmp_path):
    with pytest.raises(CadenceError, match="not a heads directory"):
        load_heads(tmp_path / "nowhere", llama)
    save_heads(new_heads("medusa", llama, 2), tmp_path)
    (tmp_path / "heads.safetensors").unlink()
    with pytest.raises(CadenceError, match="not a heads directory"):
        load_heads(tmp_path, llama)


def _good_config(llama, **over):
    cfg = HeadConfig(kind="medusa", num_heads=2, hidden_size=llama.hidden_size, vocab_size=llama.vocab_size,
                     backbone=llama.name).to_dict()
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("config_text", [
    "{not json",
    "",
    "[1, 2, 3]",
    "42",
    '{"kind": "medusa"}',  # missing fields
    "KIND_UNKNOWN",
    "NUM_HEADS_STRING",
    "NUM_HEADS_NEGATIVE",
    "NUM_HEADS_MISMATCH",
])
def test_malformed_config_is_a_cadence_error(llama, tmp_path, config_text):
    save_heads(new_heads("medusa", llama, 2), tmp_path)
    special = {"KIND_UNKNOWN": _good_config(llama, kind="bogus"),
               "NUM_HEADS_STRING": _good_config(llama, num_heads="two"),
               "NUM_HEADS_NEGATIVE": _good_config(llama, num_heads=-1),
               "NUM_HEADS_MISMATCH": _good_config(llama, num_heads=3)}
    text = json.dumps(special[config_text]) if config_text in special else config_text
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CadenceError) as exc:
        load_heads(tmp_path, llama)
    assert str(tmp_path) in str(exc.value) or "head type" in str(exc.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "other-kind"])
def test_corrupt_weights_are_a_cadence_error(llama, tmp_path, damage):
    save_heads(new_heads("hydra", llama, 2, random=True), tmp_path)
    w = tmp_path / "heads.safetensors"
    if damage == "garbage":
        w.write_bytes(b"\x00\x01not a safetensors file" * 10)
    elif damage == "truncated":
        w.write_bytes(w.read_bytes()[:len(w.read_bytes()) // 2])
    elif damage == "empty":
        w.write_bytes(b"")
    else:  # weights of medusa heads under a hydra config
        save_heads(new_heads("medusa", llama, 2), tmp_path / "m")
        w.write_bytes((tmp_path / "m" / "heads.safetensors").read_bytes())
    with pytest.raises(CadenceError, match="corrupt or does not match"):
        load_heads(tmp_path, llama)


# --- draft vocabulary (heads draft among a subset of ids; verification keeps the full vocabulary)

SUBSET = torch.tensor([3, 17, 42, 65, 66, 99, 120, 200, 256, 259])


@pytest.mark.parametrize("kind", KINDS)
def test_draft_step_is_step_restricted_to_the_subset(llama, kind):
    heads = new_heads(kind, llama, K, random=True, seed=9)
    hidden = torch.randn(4, llama.hidden_size, generator=torch.Generator().manual_seed(1))
    tok = torch.tensor([5, 6, 7, 8])
    with torch.no_grad():
        full, s_full = heads.step(1, heads.init_state(hidden), tok)
        lg, ids, s_none = heads.draft_step(1, heads.init_state(hidden), tok)
        assert ids is None and torch.equal(lg, full)
        heads.set_draft_vocab(SUBSET)
        lg, ids, s_sub = heads.draft_step(1, heads.init_state(hidden), tok)
    assert torch.equal(ids, SUBSET) and lg.shape == (4, len(SUBSET))
    torch.testing.assert_close(lg, full[:, SUBSET], atol=1e-5, rtol=1e-5)
    assert torch.equal(s_sub, s_full)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=5)])
def test_drafts_stay_in_the_draft_vocabulary(llama, sampling):
    heads = new_heads("hydra", llama, K, random=True, seed=10).set_draft_vocab(SUBSET)
    tree = compile_tree(preset("tree-32", K))
    hidden = torch.randn(llama.hidden_size, generator=torch.Generator().manual_seed(2))
    d = HeadDrafter(heads).draft(tree, 11, hidden, [1, 2], sampling, torch.Generator().manual_seed(3))
    assert set(d.tokens[1:].tolist()) <= set(SUBSET.tolist())
    if not sampling.greedy:
        assert d.q.shape == (tree.size, llama.vocab_size)
        outside = torch.ones(llama.vocab_size, dtype=torch.bool)
        outside[SUBSET] = False
        parents = [i for i in range(tree.size) if tree.children[i]]
        assert torch.all(d.q[parents][:, outside] == 0)
        torch.testing.assert_close(d.q[parents].sum(-1), torch.ones(len(parents)))


def test_draft_vocab_survives_save_and_load(llama, tmp_path):
    heads = new_heads("mtp", llama, K, random=True, seed=11).set_draft_vocab(SUBSET)
    save_heads(heads, tmp_path, dtype=torch.bfloat16)
    loaded = load_heads(tmp_path, llama)
    assert torch.equal(loaded.draft_vocab, SUBSET) and loaded.draft_vocab.dtype == torch.long
    plain = load_heads(tmp_path, llama, dtype=torch.float32)
    assert torch.equal(plain.draft_vocab, SUBSET)
    (g1, s1), (g2, s2) = drafts(loaded, llama, "tree-8"), drafts(plain, llama, "tree-8")
    assert torch.equal(g1.tokens, g2.tokens) and torch.equal(s1.tokens, s2.tokens)
    assert set(g1.tokens[1:].tolist()) <= set(SUBSET.tolist())


def test_draft_logits_kernel_matches_the_matmul(llama):
    """Decoding uses a prepacked kernel for the draft vocabulary; training the plain
    matmul: both give the same logits."""
    from cadence.heads import new_heads
    heads = new_heads("hydra", llama, num_heads=2)
    heads.set_draft_vocab(torch.arange(0, llama.config.vocab_size, 3))
    heads.bind(llama)
    feats = torch.randn(3, llama.config.hidden_size)
    with torch.no_grad():
        fast = heads.draft_logits(feats)
    with torch.enable_grad():
        plain = heads.draft_logits(feats)
    assert fast.shape == plain.shape == (3, len(heads.draft_vocab))
    torch.testing.assert_close(fast, plain.detach(), rtol=1e-4, atol=1e-4)


def test_param_dtype_and_device_follow_conversions_and_replaced_parameters(llama):
    """``_param_dtype`` / ``_device`` remember where the first parameter lives, not what it
    was: ``.to()`` and a parameter replaced outright (``load_state_dict(assign=True)``) show."""
    heads = new_heads("hydra", llama, num_heads=2)
    assert heads._param_dtype() == torch.float32 and heads._device().type == "cpu"
    heads.to(torch.bfloat16)
    assert heads._param_dtype() == torch.bfloat16
    state = {k: v.to(torch.float64) for k, v in heads.state_dict().items()}
    heads.load_state_dict(state, assign=True)
    assert heads._param_dtype() == torch.float64
    assert heads.init_state(torch.zeros(1, llama.config.hidden_size)).dtype == torch.float64
    old = heads.proj[0]  # the submodule holding the first parameter, replaced outright (float32)
    heads.proj[0] = torch.nn.Linear(old.in_features, old.out_features)
    assert heads._param_dtype() == next(heads.parameters()).dtype == torch.float32
    heads.to(torch.float16)
    assert heads._param_dtype() == torch.float16
