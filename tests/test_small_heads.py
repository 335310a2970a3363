"""CLP and confidence heads (METHODS §5): labels and targets, training, and the three
schedulers: ``clp`` is lossless (greedy and sampling), ``clp-unverified`` and
``confidence`` are lossy and run only when selected."""

import itertools

import pytest
import torch
from tiny import tiny_backbone

from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.heads import new_heads, save_heads
from cadence.heads.small import CLP, ConfidenceHead, load_small, save_small
from cadence.methods import Method, MethodSpec, make_engine
from cadence.schedulers import registry
from cadence.schedulers.static import StaticScheduler
from cadence.schedulers.base import Plan
from cadence.schedulers.clp import ClpScheduler
from cadence.schedulers.confidence import ConfidenceScheduler
from cadence.trees.tree import chain, compile_tree
from cadence.training.small_heads import clp_labels, confidence_target, rollout

K = 3
PROMPT = "Write a poem about the sea."


# ---------------------------------------------------------------- labels and targets

def test_clp_labels_on_a_hand_made_rollout():
    # ids x_0..x_7, prompt x_0..x_1, so t0 = 1 (root x_2); K = 3 targets exist for t = 1, 2, 3
    ids = torch.tensor([9, 9, 1, 2, 3, 4, 5, 6])
    tops = torch.tensor([  # head k's top-1 at t = 1, 2, 3 (for x_{t+1+k})
        [2, 3, 0],  # depth 1: right (x_3), right (x_4), wrong (x_5 = 4)
        [3, 0, 5],  # depth 2: right (x_4), wrong (x_5 = 4), right (x_6)
        [4, 5, 6],  # depth 3: right everywhere
    ])
    assert clp_labels(tops, ids, 1).tolist() == [3, 1, 0]  # t=3: depth 1 wrong, deeper rights do not count
    # the docstring example
    assert clp_labels(torch.tensor([[2, 9], [3, 4]]), torch.tensor([5, 1, 2, 3, 4]), 0).tolist() == [2, 0]


def test_rollout_labels_equal_drafting_the_chain():
    """Teacher-forced labels (train view) == what drafting the top-1 chain step by step
    (the engine's view) gets right on the backbone's greedy continuation."""
    bb = tiny_backbone("llama", vocab=8, tokenizer=False, seed=3)
    heads = new_heads("hydra", bb, K, random=True, seed=1).eval()
    prompt = [1, 5, 2, 7, 3]
    cont = Engine(bb).generate(prompt, GenerationConfig(max_new_tokens=40)).tokens
    ids = torch.tensor(prompt + cont)
    r = rollout(bb, heads, ids, len(prompt), features=True)
    hidden = bb.forward(ids[None]).hidden[0]
    expect = []
    for i in range(len(r.labels)):
        t = len(prompt) - 1 + i
        state, tok, n = heads.init_state(hidden[t][None]), ids[t + 1][None], 0
        for k in range(1, K + 1):
            logits, state = heads.step(k, state, tok)
            tok = logits.argmax(-1)
            if int(tok) != int(ids[t + 1 + k]):
                break
            n += 1
        expect.append(n)
    assert r.labels.tolist() == expect
    assert len(set(expect)) >= 3  # the check sees several lengths (V = 8: random drafts are often right)
    # at T = 0 the confidence target is agreement, depth by depth
    assert torch.equal(r.target.cumprod(1).sum(1).long(), r.labels)


def test_confidence_target():
    torch.manual_seed(0)
    p, q = torch.randn(6, 10), torch.randn(6, 10)
    agree = (q.argmax(-1) == p.argmax(-1)).float()
    assert torch.equal(confidence_target(p, q, 0.0), agree)  # T = 0: 1/0 agreement
    q[:3] = p[:3] * 5  # same argmax on three rows
    assert confidence_target(p, q, 0.0)[:3].tolist() == [1.0] * 3
    # T > 0: E_{x~q} min(1, p(x)/q(x))
    pp, qq = torch.softmax(p / 0.7, -1), torch.softmax(q / 0.7, -1)
    expect = (qq * torch.clamp(pp / qq, max=1)).sum(-1)
    torch.testing.assert_close(confidence_target(p, q, 0.7), expect)
    # over a draft vocabulary: q lives on ids [1, 4, 7] only
    ids = torch.tensor([1, 4, 7])
    t0 = confidence_target(p, q[:, :3], 0.0, ids)
    assert torch.equal(t0, (ids[q[:, :3].argmax(-1)] == p.argmax(-1)).float())


# ---------------------------------------------------------------- schedulers

def _clp(bb, bias=None, seed=0, scale=3.0):
    clp = CLP(bb.hidden_size, K)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        clp.linear.weight.copy_(torch.randn(K + 1, bb.hidden_size, generator=g) * scale / bb.hidden_size ** 0.5)
        clp.linear.bias.zero_()
        if bias is not None:
            clp.linear.bias[bias] = 1e3  # always predicts length ``bias``
    return clp.eval()


def _conf(bb, sign):
    head = ConfidenceHead(bb.hidden_size, K, 8)
    with torch.no_grad():
        head.mlp[2].bias.fill_(40.0 * sign)  # sign +1: always confident, -1: never
    return head.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    bb = tiny_backbone("llama")
    root = tmp_path_factory.mktemp("small")
    hdir = save_heads(new_heads("hydra", bb, K, random=True, seed=2), root / "heads")
    info = {"data": "test"}
    save_small(_clp(bb), root / "varied", "clp", info)
    save_small(_clp(bb, bias=K), root / "full", "clp", info)
    save_small(_conf(bb, +1), root / "sure", "confidence", info)
    save_small(_conf(bb, -1), root / "unsure", "confidence", info)
    ids = bb.encode_prompt(PROMPT, chat=True)
    ref = Engine(bb).generate(ids, GenerationConfig(max_new_tokens=40)).tokens
    return bb, root, hdir, ids, ref


def _engine(setup, scheduler, copy=True, **kw):
    bb, root, hdir = setup[:3]
    spec = MethodSpec(method=Method.HYDRA, heads=str(hdir), tree="chain", scheduler=scheduler, copy=copy, options=kw)
    return make_engine(bb, spec)


def test_registry_marks_the_unverified_modes_lossy():
    assert not registry.entry("clp").lossy
    for name in ("clp-unverified", "confidence"):
        assert registry.entry(name).lossy and "LOSSY" in registry.entry(name).help


@pytest.mark.parametrize("copy", [True, False])
def test_clp_verified_is_byte_identical_to_greedy(setup, copy):
    bb, root, hdir, ids, ref = setup
    eng = _engine(setup, "clp", copy=copy, clp=str(root / "varied" / "clp.safetensors"))
    assert not eng.allow_unverified
    g = eng.generate(ids, GenerationConfig(max_new_tokens=40))
    assert g.tokens == ref and g.stats.unverified_steps == 0
    planned = {s.planned for s in g.stats.step_log}
    assert len(planned) >= 2, planned  # the predictor really varies the chain length


def test_clp_verified_sampling_is_lossless():
    from test_sampling_lossless import PROMPT as P, V, check_lossless

    bb = tiny_backbone("llama", vocab=V, tokenizer=False, seed=1)
    heads = new_heads("hydra", bb, K, random=True, seed=2)
    clp = _clp(bb, seed=4, scale=8.0)
    lengths = []

    def factory(sampling):
        s = ClpScheduler(clp, K)
        lengths.append(s.lengths)
        return s

    tau = check_lossless(Engine(bb, HeadDrafter(heads), factory), bb, GenerationConfig(temperature=1.0), n=500)
    seen = {n for ls in lengths for n in ls}
    assert len(seen) >= 2, seen  # several draft lengths, root-only steps included or not
    assert tau > 1.0


def test_unverified_modes_never_run_without_being_selected(setup):
    bb, root, hdir, ids, ref = setup
    full = str(root / "full" / "clp.safetensors")
    # a lossless scheduler: no opt-in, so an unverified plan would be refused
    eng = _engine(setup, "clp", clp=full)
    assert not eng.allow_unverified
    g = eng.generate(ids, GenerationConfig(max_new_tokens=40))
    assert g.tokens == ref and g.stats.unverified_steps == 0
    # the unverified CLP scheduler on a non-opted-in engine is refused, not run
    heads = eng.drafter.heads
    plain = Engine(bb, HeadDrafter(heads), lambda s: ClpScheduler(_clp(bb, bias=K), K, verify=False))
    with pytest.raises(CadenceError, match="unverified"):
        plain.generate(ids, GenerationConfig(max_new_tokens=8))
    # selected: it runs, and commits the chain unverified
    eng = _engine(setup, "clp-unverified", clp=full)
    assert eng.allow_unverified
    g = eng.generate(ids, GenerationConfig(max_new_tokens=40))
    assert g.stats.unverified_steps > 0 and g.stats.tau > 3.0
    assert g.tokens != ref  # random heads: committing unchecked drafts changes the text


def test_confidence_commits_only_confident_chains(setup):
    bb, root, hdir, ids, ref = setup
    cfg = GenerationConfig(max_new_tokens=40)
    # never confident: every step is a normal verified step, output = greedy
    eng = _engine(setup, "confidence", confidence=str(root / "unsure"))
    assert eng.allow_unverified
    g = eng.generate(ids, cfg)
    assert g.tokens == ref and g.stats.unverified_steps == 0
    # always confident: every step commits the heads' own top-1 chain unverified (pinned on the
    # drafter, so a context copy never replaces a judged draft) = an unverified K-chain without copy
    eng = _engine(setup, "confidence", confidence=str(root / "sure"))
    g = eng.generate(ids, cfg)
    assert g.stats.unverified_steps >= g.stats.steps - 1  # (a last step may commit the root alone)
    heads = eng.drafter.heads
    unchecked = StaticScheduler(compile_tree(chain(K)))
    unchecked.plan = Plan(unchecked.plan.tree, verify=False)
    raw = Engine(bb, HeadDrafter(heads), unchecked)
    raw.allow_unverified = True
    assert g.tokens == raw.generate(ids, cfg).tokens


def test_confidence_prefix_mode_and_threshold(setup):
    bb = setup[0]
    heads = new_heads("hydra", bb, K, random=True, seed=2)
    fallback = Plan(compile_tree(chain(2), name="fallback"))

    class Fixed:
        K = 3

        def __init__(self, c):
            self.c = torch.tensor(c)

        def confidence(self, h, g, logq):
            return self.c

    from cadence.schedulers.base import StepState
    state = StepState(hidden=torch.randn(bb.hidden_size), root_logits=torch.randn(bb.vocab_size), step=0,
                      new_tokens=0, past=5)
    for c, mode, want in [([0.99, 0.99, 0.5], "prefix", ("conf-2", False)),
                          ([0.99, 0.99, 0.5], "all", ("fallback", True)),
                          ([0.99, 0.99, 0.99], "all", ("conf-3", False)),
                          ([0.9, 0.99, 0.99], "prefix", ("fallback", True))]:
        s = ConfidenceScheduler(heads, Fixed(c), fallback, None, threshold=0.95, mode=mode)
        plan = s.choose(state)
        assert (plan.tree.name, plan.verify) == want, (c, mode)


def test_small_head_files_round_trip_and_mismatch(tmp_path):
    bb = tiny_backbone("llama")
    clp = _clp(bb, seed=1)
    save_small(clp, tmp_path, "clp", {"data": "x"})
    heads = new_heads("hydra", bb, K, random=True)
    back = load_small(tmp_path, "clp", heads)
    h = torch.randn(5, bb.hidden_size)
    torch.testing.assert_close(back(h), clp(h))
    assert back.num_params() == bb.hidden_size * (K + 1) + K + 1
    with pytest.raises(CadenceError, match="K=3"):
        load_small(tmp_path, "clp", new_heads("hydra", bb, 2, random=True))
    with pytest.raises(CadenceError, match="train-confidence"):
        load_small(tmp_path, "confidence", heads)


def test_train_clp_and_confidence_end_to_end(tmp_path):
    from test_training_support import make_data, tiny_model_dir

    from cadence.backbone.load import load_backbone
    from cadence.training.small_heads import ClpConfig, ConfidenceConfig, run

    model = tiny_model_dir(tmp_path)
    data = make_data(tmp_path / "data", n_train=20, n_val=4)
    bb = load_backbone(str(model), device="cpu")
    hdir = save_heads(new_heads("hydra", bb, K, random=True), tmp_path / "heads")
    common = dict(heads=str(hdir), data=str(data), model=str(model), device="cpu", tokens=300, val_tokens=100)
    s = run(ClpConfig(steps=30, **common), "clp")
    assert s["params"] == bb.hidden_size * (K + 1) + K + 1
    assert abs(sum(s["label_distribution_train"]) - 1) < 1e-3 and 0 <= s["heldout_accuracy"] <= 1
    assert s["held_out"] == "the store's val split"
    s = run(ConfidenceConfig(steps=30, **common), "confidence")
    assert len(s["heldout_accept_rate_by_depth"]) == K
    # the files beside the heads are what the schedulers load by default
    for sched in ("clp", "clp-unverified", "confidence"):
        eng = make_engine(bb, MethodSpec(method=Method.HYDRA, heads=str(hdir), tree="chain", scheduler=sched))
        eng.generate(bb.encode_prompt("hi", chat=True), GenerationConfig(max_new_tokens=6))


def test_cli_registers_the_training_commands():
    from cadence.cli import build_parser

    p = build_parser()
    for cmd in ("train-clp", "train-confidence"):
        args = p.parse_args([cmd, "--heads", "x"])
        assert args.heads == "x" and callable(args.func)
