"""Attention-bearing heads (eagle, mtp-attn): lossless in the engine, a correct per-request
KV cache, training in sequence mode, save / load and malformed checkpoints.

Tiny random backbones (``tiny.py``). "Random" heads accept (almost) nothing; "oracle" heads
run the real attention path (the cache, the tree entries) and then have their logits
replaced by the backbone's known greedy continuation, so every rank-0 draft is accepted.
"""

import json

import numpy as np
import pytest
import torch
from test_sampling_lossless import N_NEW, PROMPT, V, exact_joint, gof, sample_joint
from test_training_support import base_config, make_data, tiny_model_dir
from tiny import tiny_backbone

from cadence.backbone.load import load_backbone
from cadence.draft.context_copy import CopyConfig
from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.decode.request import drafter_states
from cadence.errors import CadenceError
from cadence.heads import load_heads, new_heads, save_heads
from cadence.heads.eagle import EagleHeads
from cadence.heads.eagle3 import Eagle3Heads
from cadence.heads.mtp_attn import MTPAttnHeads
from cadence.schedulers.static import StaticScheduler
from cadence.trees.tree import compile_tree, preset

# eagle2: a drafter of two decoder layers; eagle-taps: one that also reads the backbone's layer 1;
# eagle3: the EAGLE-3 drafter (fused taps, its own LM head; here over the whole vocabulary)
KINDS = ("eagle", "eagle2", "eagle-taps", "eagle3", "mtp-attn")


def make(kind, bb, k=3, **kw):
    """new_heads, with "eagle2" = eagle heads of two layers, "eagle-taps" = reading tap 1."""
    if kind == "eagle2":
        return new_heads("eagle", bb, k, num_layers=2, **kw)
    if kind == "eagle-taps":
        return new_heads("eagle", bb, k, taps=[1], **kw)
    return new_heads(kind, bb, k, **kw)


def states(bb, ids, heads):
    """What an engine commits for ``ids`` (1, T): backbone states, with the heads' taps appended."""
    taps = tuple(heads.cfg.taps)
    return drafter_states(bb.forward(ids, need_logits=False, **({"taps": taps} if taps else {})))


PROMPTS = ([5, 9, 11, 3, 7, 9, 11, 3], [40, 41, 42, 43, 40, 41], [7] * 12 + [100, 101, 7, 7])


@pytest.fixture(scope="module")
def backbones():
    return {arch: tiny_backbone(arch) for arch in ("llama", "qwen2")}


def engine_for(bb, heads, tree: str, copy: bool = False, depth: int = 3):
    drafter = HeadDrafter(heads, CopyConfig() if copy else None, copy_depth=depth)
    compiled = compile_tree(preset(tree, drafter.max_depth(GenerationConfig().sampling)), name=tree)
    return Engine(bb, drafter, lambda sampling: StaticScheduler(compiled))


_REFS: dict = {}


def reference(bb, prompt, n=48):
    """Plain greedy output (memoised per backbone, prompt and length)."""
    key = (id(bb), tuple(prompt), n)
    if key not in _REFS:
        _REFS[key] = Engine(bb).generate(prompt, GenerationConfig(max_new_tokens=n)).tokens
    return _REFS[key]


class _Oracle:
    """Mixin: after the real tree step, logits put the backbone's greedy continuation first."""

    def arm(self, reference: list[int], prompt_len: int, vocab: int):
        self.ref, self.plen, self.vocab_n = reference, prompt_len, vocab
        return self

    def begin_draft(self, cache, pending, seq):
        self._seq = list(seq)  # committed context + root
        self._path = {}
        return super().begin_draft(cache, pending, seq)

    def tree_step(self, k, prev, tokens, ctx, nodes, parents):
        out = super().tree_step(k, prev, tokens, ctx, nodes, parents)
        self._rows = []
        for node, p, tok in zip(nodes, parents, tokens.tolist()):
            path = [] if k == 1 else self._path[p] + [tok]
            self._path[node] = path
            idx = len(self._seq) + len(path) - self.plen  # reference index of the node's child
            right = self._seq[self.plen:] + path == self.ref[:idx]
            self._rows.append(self.ref[idx] if right and idx < len(self.ref) else None)
        return out

    def entry_features(self, cache, positions):
        """Deferred shadow drafts (eagle): entry j drafts x_{j+2}, reference index j + 2 - plen."""
        self._rows = [self.ref[j + 2 - self.plen] if 0 <= j + 2 - self.plen < len(self.ref) else None
                      for j in positions]
        return super().entry_features(cache, positions)

    def draft_logits(self, feats):
        logits = super().draft_logits(feats).clone()
        for i, want in enumerate(getattr(self, "_rows", [])):
            if want is not None:
                logits[i, want] = logits[i].max() + 10.0
        return logits


class OracleEagle(_Oracle, EagleHeads):
    pass


class OracleEagle3(_Oracle, Eagle3Heads):
    pass


class OracleMTPAttn(_Oracle, MTPAttnHeads):
    pass


def oracle_heads(bb, kind, ref, plen):
    base = make(kind, bb, 3, random=True, seed=3)
    cls = OracleEagle3 if kind == "eagle3" else OracleEagle if kind.startswith("eagle") else OracleMTPAttn
    heads = cls(base.cfg)
    heads.load_state_dict(base.state_dict())
    return heads.bind(bb).arm(ref, plen, bb.vocab_size)


# ------------------------------------------------------------------ greedy: byte-identical

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_random_heads_greedy_identical(backbones, kind, arch):
    bb = backbones[arch]
    heads = make(kind, bb, 3, random=True, seed=1)
    for tree, copy in (("chain", False), ("tree-8", False), ("tree-16", True), ("chain", True)):
        eng = engine_for(bb, heads, tree, copy)
        for prompt in PROMPTS:
            out = eng.generate(prompt, GenerationConfig(max_new_tokens=48))
            assert out.tokens == reference(bb, prompt), (kind, arch, tree, copy, prompt)


@pytest.mark.parametrize("kind", KINDS)
def test_oracle_heads_accept_everything_and_stay_identical(backbones, kind):
    bb = backbones["llama"]
    for prompt in PROMPTS:
        ref = reference(bb, prompt)
        for tree in ("chain", "tree-8"):
            heads = oracle_heads(bb, kind, ref, len(prompt))
            out = engine_for(bb, heads, tree).generate(prompt, GenerationConfig(max_new_tokens=48))
            assert out.tokens == ref
            # every step accepts all K drafts (except where EOS or the budget ends it)
            assert out.stats.tau > 3.5, (kind, tree, out.stats.tau)


@pytest.mark.parametrize("kind", KINDS)
def test_interleaved_requests_keep_separate_states(backbones, kind):
    bb = backbones["llama"]
    eng = engine_for(bb, make(kind, bb, 3, random=True, seed=2), "tree-8")
    reqs = [eng.start(p, GenerationConfig(max_new_tokens=32)) for p in PROMPTS]
    while not all(r.done for r in reqs):
        for r in reqs:
            r.step()
    assert [r.tokens for r in reqs] == [reference(bb, p, 32) for p in PROMPTS]


# ------------------------------------------------------------------ sampling: distribution-identical

@pytest.mark.parametrize("kind", KINDS)
def test_sampling_distribution_identical(kind):
    bb = tiny_backbone("llama", vocab=V, tokenizer=False, seed=1)
    cfg = GenerationConfig(max_new_tokens=N_NEW, temperature=1.0)
    heads = make(kind, bb, 3, random=True, seed=5, ).eval()
    with torch.no_grad():  # gentler random heads: q overlaps p, so drafts are sometimes accepted
        for p in heads.parameters():
            p.mul_(0.3)
    eng = engine_for(bb, heads, "tree-8")
    counts, tau = sample_joint(eng, cfg, 700)
    joint = exact_joint(bb, cfg.sampling)
    gof(counts, joint, f"{kind} joint")
    gof(counts.sum((0, 2)), joint.sum((0, 2)), f"{kind} token 2")
    gof(counts.sum((0, 1)), joint.sum((0, 1)), f"{kind} token 3")
    assert tau > 1.0  # some drafts were accepted, so verification did something


# ------------------------------------------------------------------ the head cache

def _teacher(heads, bb, ids):
    with torch.no_grad():
        if heads.cfg.taps:
            fwd = bb.forward(ids, need_logits=False, taps=tuple(heads.cfg.taps))
            return heads.train_features(fwd.hidden, ids, taps=fwd.taps)
        return heads.train_features(bb.forward(ids, need_logits=False).hidden, ids)


@pytest.mark.parametrize("kind", KINDS)
def test_drafting_equals_teacher_forcing_after_uneven_commits(backbones, kind):
    """Drafting the true path with a cache grown in uneven commits (prefill, then accepted
    paths of several lengths) gives, at every depth, the training features of that position:
    the cache holds exactly the committed entries and the tree masks match training."""
    bb = backbones["llama"]
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 40))
    heads = make(kind, bb, 3, random=True, seed=1).eval()
    hidden = states(bb, ids, heads)[0]  # (T, d), or (T, d * 2) with a tap
    ref = _teacher(heads, bb, ids)
    drafter = HeadDrafter(heads)
    state = drafter.new_state()
    drafter.commit(state, hidden[:6], ids[0, :6].tolist())
    done = 6
    for t in (7, 8, 12, 13, 20, 31):  # commits of 2, 1, 4, 1, 7, 11 tokens
        drafter.commit(state, hidden[done:t + 1], ids[0, done:t + 1].tolist())
        done = t + 1
        with torch.inference_mode():
            h = hidden[t, :bb.hidden_size]
            ctx = drafter.begin(state, h, ids[0, :t + 1].tolist(), int(ids[0, t + 1]))
            prev = heads.init_state(h[None])
            for k in range(1, 4):
                s = heads.tree_step(k, prev, ids[0, t + k:t + k + 1], ctx, [k - 1], [k - 2])
                f = heads.tree_logits_features(k, s)
                torch.testing.assert_close(f[0], ref[k - 1][0, t], atol=1e-4, rtol=1e-4)
                prev = s


@pytest.mark.parametrize("kind", KINDS)
def test_cache_after_engine_run_equals_cache_from_scratch(backbones, kind):
    """After a request ran (drafts accepted and rejected, caches compacted), drafting a tree
    from its state equals drafting from a fresh state given the same committed context."""
    bb = backbones["llama"]
    prompt = PROMPTS[0]
    ref = reference(bb, prompt)
    heads = oracle_heads(bb, kind, ref, len(prompt))
    heads.ref = ref[:20] + [(x + 1) % 256 for x in ref[20:]]  # right for a while, then wrong
    eng = engine_for(bb, heads, "tree-8")
    req = eng.start(prompt, GenerationConfig(max_new_tokens=48))
    while len(req.tokens) < 30:  # stop mid-request: the state must serve the next draft
        req.step()
    assert req.tokens == ref[:len(req.tokens)] and not req.done
    assert req.stats.accepted_at_depth[0] > 0 and min(s.accepted for s in req.stats.step_log) < 3
    plain = make(kind, bb, 3, random=True, seed=3)  # the same weights, no oracle
    drafter = HeadDrafter(plain)
    tree = compile_tree(preset("tree-16", 3), name="t16")
    context = list(req.context)
    hidden = states(bb, torch.tensor([context]), plain)[0]
    fresh = drafter.new_state()
    drafter.commit(fresh, hidden, context)
    old = req.draft_state
    assert old.committed == len(context)
    args = (tree, req.root, req.hidden, context, GenerationConfig().sampling, None)
    a = drafter.draft(*args, state=old)
    b = drafter.draft(*args, state=fresh)
    assert torch.equal(a.tokens, b.tokens)
    for a, b in zip(old.cache.kv, fresh.cache.kv):  # every block's (eagle: layer's; mtp-attn: module's) cache
        assert a.end == b.end
        torch.testing.assert_close(a.k, b.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.v, b.v, atol=1e-4, rtol=1e-4)


def test_state_out_of_step_is_a_clear_error(backbones):
    bb = backbones["llama"]
    drafter = HeadDrafter(new_heads("eagle", bb, 3, random=True))
    state = drafter.new_state()
    drafter.commit(state, torch.zeros(3, bb.hidden_size), [1, 2, 3])
    tree = compile_tree(preset("chain", 3), name="chain")
    with pytest.raises(ValueError, match="commit"):
        drafter.draft(tree, 5, torch.zeros(bb.hidden_size), [1, 2, 3, 4], GenerationConfig().sampling, None,
                      state=state)


def test_drafter_without_state_still_drafts(backbones):
    """Old callers (no state argument) get drafts from h_t and the path alone."""
    bb = backbones["llama"]
    drafter = HeadDrafter(new_heads("mtp-attn", bb, 3, random=True))
    tree = compile_tree(preset("tree-8", 3), name="t8")
    d = drafter.draft(tree, 5, torch.randn(bb.hidden_size), [1, 2, 3], GenerationConfig().sampling, None)
    assert d.tokens.shape == (tree.size,)


# ------------------------------------------------------------------ save / load, malformed

@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(backbones, kind, tmp_path):
    bb = backbones["llama"]
    heads = make(kind, bb, 3, random=True, seed=4)
    heads.set_draft_vocab(torch.arange(0, 200))
    save_heads(heads, tmp_path)
    back = load_heads(tmp_path, bb)
    assert back.cfg == heads.cfg and isinstance(back, type(heads))
    for prompt in PROMPTS:
        for tree in ("chain", "tree-8"):
            a = engine_for(bb, heads, tree).generate(prompt, GenerationConfig(max_new_tokens=24))
            b = engine_for(bb, back, tree).generate(prompt, GenerationConfig(max_new_tokens=24))
            assert a.tokens == b.tokens and a.stats.accepted_at_depth == b.stats.accepted_at_depth


@pytest.mark.parametrize("kind", KINDS)
def test_malformed_checkpoints_are_clear_errors(backbones, kind, tmp_path):
    bb = backbones["llama"]
    save_heads(make(kind, bb, 2, random=True), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    bad = dict(cfg, num_attention_heads=0)  # no attention shape
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CadenceError, match="attention shape"):
        load_heads(tmp_path, bb)
    bad = dict(cfg, head_dim=cfg["head_dim"] * 2)  # weights no longer fit the config
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CadenceError, match="corrupt or does not match"):
        load_heads(tmp_path, bb)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "heads.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CadenceError):
        load_heads(tmp_path, bb)


def test_attention_heads_refuse_per_position_stepping(backbones):
    bb = backbones["llama"]
    heads = new_heads("eagle", bb, 3, random=True)
    with pytest.raises(CadenceError, match="MLP heads only"):
        heads.step_features(1, torch.zeros(1, bb.hidden_size), torch.zeros(1, dtype=torch.long))


# ------------------------------------------------------------------ training (sequence mode)

@pytest.fixture(scope="module")
def train_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("attn-train")
    model = tiny_model_dir(root)
    return {"root": root, "model": model, "data": make_data(root / "data"), "backbone": load_backbone(str(model))}


@pytest.mark.parametrize("kind", KINDS)
def test_training_learns_and_resumes(train_env, kind):
    from cadence.training.trainer import train

    env = train_env
    kw = dict(kind=kind.rstrip("2").removesuffix("-taps"), steps=12, eval_every=6, save_every=4,
              feature_loss=0.5 if kind.startswith("eagle") else 0.0, num_layers=2 if kind == "eagle2" else 1,
              taps=(1,) if kind in ("eagle-taps", "eagle3") else (), draft_vocab=200 if kind == "eagle3" else 0)
    full = train(base_config(env["data"], env["root"] / f"{kind}-full", env["model"], **kw), backbone=env["backbone"])
    assert full.status == "finished"
    first = full.summary["heldout"]["top1"]
    out = env["root"] / f"{kind}-resumed"
    part = train(base_config(env["data"], out, env["model"], stop_after=5, **kw), backbone=env["backbone"])
    assert part.status == "stopped"
    rest = train(base_config(env["data"], out, env["model"], **kw), backbone=env["backbone"])
    assert all(torch.equal(a, b) for a, b in zip(full.heads.state_dict().values(), rest.heads.state_dict().values()))
    loaded = load_heads(env["root"] / f"{kind}-full" / "heads", env["backbone"])
    assert loaded.cfg.kind == kw["kind"] and len(first) == 3 and loaded.cfg.taps == list(kw["taps"])
    if kind.startswith("eagle"):
        assert len(loaded.layers) == loaded.cfg.num_layers == kw["num_layers"]
    log = [json.loads(x) for x in (env["root"] / f"{kind}-full" / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if r["kind"] == "train"]
    assert losses[-1] < losses[0]  # it learns


def test_segments_whole_keeps_the_prompt(train_env):
    from cadence.training.batches import Corpus, segments
    from cadence.training.data import load_manifest

    data = train_env["data"]
    files = [s["file"] for s in load_manifest(data)["shards"] if s.get("split", "train") == "train"]
    corpus = Corpus(data, files)
    cut = segments(corpus, 3, 512)
    whole = segments(corpus, 3, 512, whole=True)
    assert all(s.start == 0 for s in whole)
    assert any(c.start > 0 for c in cut) and sum(s.length for s in whole) > sum(s.length for s in cut)


def test_feature_regression_is_zero_for_perfect_features():
    from cadence.training.losses import Batch, feature_regression

    torch.manual_seed(0)
    B, T, d = 2, 10, 4
    hidden = torch.randn(B, T, d)
    seg = torch.zeros(B, T, dtype=torch.long)
    batch = Batch(ids=torch.zeros(B, T, dtype=torch.long), seg=seg, reply=torch.ones(B, T, dtype=torch.bool),
                  hidden=hidden)
    perfect = [hidden[:, k:T - 1] for k in (1, 2)]
    assert float(feature_regression(perfect, batch)) == 0.0
    assert float(feature_regression([f + 1 for f in perfect], batch)) > 0.5
    np.testing.assert_allclose(float(feature_regression([perfect[0] + 1], batch)), 0.5, rtol=1e-6)


def test_trainer_bounds_the_c_heap(train_env, monkeypatch):
    """The 16 GiB mtp run: glibc's growing mmap threshold let the heap fragment every step.
    train() must fix the threshold before the first step (cadence.training.heap)."""
    import cadence.training.heap as heap
    from cadence.training.trainer import train

    calls = []
    monkeypatch.setattr(heap, "bound_heap", lambda *a, **k: calls.append(1) or True)
    env = train_env
    train(base_config(env["data"], env["root"] / "heap", env["model"], kind="mtp", steps=1), backbone=env["backbone"])
    assert calls, "train() did not bound the C heap"
    import sys
    if sys.platform.startswith("linux"):
        import ctypes
        assert ctypes.CDLL("libc.so.6").mallopt(heap.M_MMAP_THRESHOLD, 1 << 20) == 1  # glibc takes it


@pytest.mark.parametrize("kind", KINDS)
def test_narrow_mlp_keeps_the_strongest_units_and_round_trips(backbones, kind, tmp_path):
    from cadence.heads.attn_block import Block, narrow_mlp

    bb = backbones["llama"]
    heads = make(kind, bb, 3, random=True, seed=5)
    blocks = [m for m in heads.modules() if isinstance(m, Block)]
    x = torch.randn(2, 6, blocks[0].self_attn.q_proj.in_features)  # eagle3's layer reads [E ; g]: 2d
    pos = torch.arange(6).expand(2, 6)
    mask = torch.ones(2, 6, 6, dtype=torch.bool).tril()
    before = blocks[0].forward_masked(x, pos, mask)[0]
    full = heads.cfg.intermediate_size
    assert narrow_mlp(blocks[0], full).tolist() == list(range(full))  # full width: a no-op
    assert torch.equal(blocks[0].forward_masked(x, pos, mask)[0], before)
    with torch.no_grad():  # make unit 0 the weakest: it must be the one dropped
        for b in blocks:
            b.mlp.down_proj.weight[:, 0] = 0.0
    zeroed = blocks[0].forward_masked(x, pos, mask)[0]
    for b in blocks:
        kept = narrow_mlp(b, full - 1)
        assert 0 not in kept.tolist() and b.shape.inter == full - 1 and b.mlp.down_proj.in_features == full - 1
    assert torch.allclose(blocks[0].forward_masked(x, pos, mask)[0], zeroed, atol=1e-6)  # unit 0 gave nothing
    heads.cfg.intermediate_size = full - 1
    save_heads(heads, tmp_path)
    back = load_heads(tmp_path, bb)
    assert back.cfg.intermediate_size == full - 1
    for a, b in zip(heads.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError):
        narrow_mlp(blocks[0], 0)


def _block_and_cache(dtype, input_norm=True, seed=0):
    """A random block, 6 committed entries of a sequence (x (9, 64) at positions 0..8) and the
    whole-row training view's outputs and keys/values for all 9 (causal)."""
    from cadence.heads.attn_block import KV, Block, BlockShape

    torch.manual_seed(seed)
    shape = BlockShape(64, 4, 2, 16, 96, 1e-5, 10000.0)
    block = Block(shape, input_norm=input_norm).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, 9, 64).to(dtype)
    with torch.no_grad():
        out, k, v = block.forward_masked(x, torch.arange(9)[None], torch.ones(1, 9, 9, dtype=torch.bool).tril())
    kv = KV(shape, 0, torch.device("cpu"), dtype, capacity=4)
    kv.append(k[0, :6], v[0, :6])
    return block, kv, x[0], out[0], k[0], v[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafting_kernels_match_the_modules_and_follow_weight_changes(dtype):
    """draft_forward without autograd runs fused, prepacked projections (``attn_block.packed``):
    same outputs as the modules within rounding, and rebuilt after an in-place weight update
    (a stale packed copy would keep drafting with the old weights)."""
    from cadence.heads.attn_block import packed

    block, kv, x, _, _, _ = _block_and_cache(dtype)
    pos, mask = torch.arange(6, 9), torch.ones(3, 9, dtype=torch.bool).tril(6)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for _ in range(2):
        with torch.enable_grad():
            want = block.draft_forward(x[6:], pos, kv, 6, mask).detach()
        with torch.no_grad():
            got = block.draft_forward(x[6:], pos, kv, 6, mask)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        with torch.no_grad():  # what an optimizer step does: the packed copy must not survive it
            block.mlp.down_proj.weight.mul_(-3.0)
    kern = packed(block, {"o": [block.self_attn.o_proj]})
    if kern is not None:  # CPU with oneDNN: one rebuild per change, none without one
        assert packed(block, {"o": [block.self_attn.o_proj]}) is kern


@pytest.mark.parametrize("input_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_forward_matches_the_training_view_and_its_cpp_twin_the_python_bits(dtype, input_norm, monkeypatch):
    """``Block.draft_forward`` (new entries written into the cache's scratch rows, one SDPA
    call over the buffer) gives the whole-row training view's outputs and keys for the last
    entries of a sequence, also after the buffer grew under scratch rows, and its C++ form
    (``fast/native/draft_block.cpp``, where built) the Python form's bits in bf16 (the same ATen
    calls) and its values within float rounding in fp32 (the fused kernels)."""
    from cadence.fast import native
    from cadence.heads import attn_block

    block, kv, x, out, k, v = _block_and_cache(dtype, input_norm, seed=1)
    tol = dict(rtol=3e-2, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)

    def level():  # entries 6, 7 drafted before as scratch; entry 8 sees all, as in a chain
        kv.reserve_rows(8)
        kv.kbuf[6:8], kv.vbuf[6:8] = k[6:8], v[6:8]
        with torch.no_grad():
            return block.draft_forward(x[8:], torch.tensor([8]), kv, 8, None), kv.kbuf[8:9].clone()

    got, keys = level()  # capacity 4 -> 16: the scratch rows survive the growth
    assert kv.kbuf.shape[0] >= 9 and kv.n == 6
    torch.testing.assert_close(got.float(), out[8:].float(), **tol)
    torch.testing.assert_close(keys.float(), k[8:].float(), **tol)
    if native.module() is not None:
        assert attn_block._native_block(block, block.decode_kernels()) is not None
        monkeypatch.setattr(attn_block, "_native_block", lambda *a: None)
        want, want_keys = level()
        if dtype == torch.bfloat16:
            assert torch.equal(got, want) and torch.equal(keys, want_keys)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(keys, want_keys, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # three committed entries at once, causal among themselves
        chain = block.draft_forward(x[6:], torch.arange(6, 9), kv, 6, torch.ones(3, 9, dtype=torch.bool).tril(6))
    torch.testing.assert_close(chain.float(), out[6:].float(), **tol)


def test_kv_advance_commits_only_rows_a_draft_wrote():
    from cadence.heads.attn_block import KV, BlockShape

    kv = KV(BlockShape(64, 4, 2, 16, 96, 1e-5, 10000.0), 3, torch.device("cpu"), torch.float32, capacity=2)
    kv.append(torch.ones(2, 2, 16), torch.ones(2, 2, 16))
    assert (kv.n, kv.end, kv.k.shape[0]) == (2, 5, 2)
    with pytest.raises(ValueError):
        kv.advance(1)  # no room was reserved, so nothing was written there
    kv.reserve_rows(3)
    kv.advance(1)
    assert (kv.n, kv.end) == (3, 6)


def test_heads_draft_in_the_backbones_bfloat16_unless_told_otherwise():
    """``MethodSpec.heads_dtype`` auto: heads on a bf16 backbone draft in bf16 (half the bytes
    read per draft), float32 elsewhere; the output stays plain decoding's either way."""
    from types import SimpleNamespace

    from cadence.fast.model import FastBackbone
    from cadence.heads.io import decode_dtype
    from cadence.methods import Method, MethodSpec, make_engine

    assert decode_dtype(SimpleNamespace(dtype=torch.bfloat16)) == torch.bfloat16
    assert decode_dtype(SimpleNamespace(dtype=torch.float32)) == torch.float32
    assert decode_dtype(SimpleNamespace(dtype=torch.bfloat16), "float32") == torch.float32
    with pytest.raises(CadenceError, match="heads dtype"):
        decode_dtype(SimpleNamespace(dtype=torch.float32), "fp8")
    plain = tiny_backbone("llama", hidden=128)
    plain.model.to(torch.bfloat16)
    bb = FastBackbone.from_backbone(plain)
    cfg = GenerationConfig(max_new_tokens=24)
    ref = Engine(bb).generate(PROMPTS[0], cfg).tokens
    for choice, want in (("auto", torch.bfloat16), ("float32", torch.float32)):
        spec = MethodSpec(method=Method.EAGLE, heads="random", tree="tree-8", scheduler="static", copy=False,
                          heads_dtype=choice)
        engine = make_engine(bb, spec)
        assert next(engine.drafter.heads.parameters()).dtype == want
        assert engine.generate(PROMPTS[0], cfg).tokens == ref


def test_added_layers_start_as_the_identity_and_then_train(backbones):
    """A one-layer drafter grown by ``add_layers`` drafts exactly what it drafted (features
    and engine output), and its new layer gets gradients (it is not dead weight)."""
    bb = backbones["llama"]
    heads = new_heads("eagle", bb, 3, random=True, seed=6)
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (1, 24))
    before = _teacher(heads, bb, ids)
    ref = [engine_for(bb, heads, "tree-8").generate(p, GenerationConfig(max_new_tokens=24)) for p in PROMPTS]
    heads.add_layers(1)
    assert heads.cfg.num_layers == len(heads.layers) == 2 and heads.layers[1].input_layernorm is not None
    for a, b in zip(before, _teacher(heads, bb, ids)):
        assert torch.equal(a, b)
    for p, r in zip(PROMPTS, ref):
        out = engine_for(bb, heads, "tree-8").generate(p, GenerationConfig(max_new_tokens=24))
        assert out.tokens == r.tokens and out.stats.accepted_at_depth == r.stats.accepted_at_depth
    hidden = bb.forward(ids, need_logits=False).hidden
    sum(f.square().sum() for f in heads.train_features(hidden, ids)).backward()
    assert heads.layers[1].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert heads.layers[1].mlp.down_proj.weight.grad.abs().sum() > 0


def test_num_layers_is_checked(train_env, tmp_path):
    from cadence.training.trainer import train

    env = train_env
    with pytest.raises(CadenceError, match="only for eagle"):
        train(base_config(env["data"], tmp_path / "a", env["model"], kind="mtp-attn", num_layers=2),
              backbone=env["backbone"])
    save_heads(new_heads("eagle", env["backbone"], 3, random=True, num_layers=2), tmp_path / "two")
    with pytest.raises(CadenceError, match="layers can be added, not removed"):
        train(base_config(env["data"], tmp_path / "b", env["model"], kind="eagle", init_from=str(tmp_path / "two")),
              backbone=env["backbone"])
