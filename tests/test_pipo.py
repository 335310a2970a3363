"""PIPO (LOSSY, opt-in) on tiny random backbones: grouping, the weight-sharing adapter and its
per-position gate, decoding modes, the directory format, and that nothing changes without it."""

from __future__ import annotations

import pytest
import torch

from cadence.errors import CadenceError
from cadence.pipo.config import PipoDecodeConfig, StudentConfig, TrainPipoConfig
from cadence.pipo.decode import PipoDecoder
from cadence.pipo.evaluate import agreement, reply_groups, reply_nll
from cadence.pipo.groups import PAIR, PLAIN, pack, pad_batch, prompt_groups, starts
from cadence.pipo.student import Student, load_student, save_student
from tiny import tiny_backbone


def _perturb(student: Student, seed: int = 1, scale: float = 0.3) -> Student:
    """Give the zero-initialised parts (LoRA B, the MLPs' output layers) random values, so the
    adapter, the compressor and the pair head all change what the backbone computes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in student.trainable():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return student


@pytest.fixture(scope="module")
def bb():
    return tiny_backbone("llama", seed=3)


@pytest.fixture(scope="module")
def student(bb):
    return _perturb(Student(bb)).eval()


# ---------------------------------------------------------------- groups


def test_prompt_groups_odd_and_even():
    assert prompt_groups(1) == [PLAIN]
    assert prompt_groups(4) == [PAIR, PAIR]
    assert prompt_groups(7) == [PAIR, PAIR, PAIR, PLAIN]  # an odd prompt's last token is a plain position
    assert starts([2, 2, 1, 2]) == [0, 2, 4, 5]
    assert reply_groups(5, "pairs") == [2, 2, 1] and reply_groups(3, "prompt") == [1, 1, 1]
    with pytest.raises(ValueError):
        prompt_groups(0)
    ids, sizes = pack([5, 6, 7], [2, 1])
    assert ids.tolist() == [[5, 6], [7, 0]] and sizes.tolist() == [2, 1]
    with pytest.raises(ValueError, match="cover"):
        pack([5, 6, 7], [2, 2])
    ids, sizes, mask, pos = pad_batch([pack([1, 2, 3], [2, 1]), pack([4], [1])], left=True)
    assert mask.tolist() == [[1, 1], [0, 1]] and pos.tolist() == [[0, 1], [0, 0]]


# ---------------------------------------------------------------- nothing changes without it


def test_backbone_is_untouched_and_plain_and_speculative_outputs_are_identical():
    from cadence.decode.generation import GenerationConfig
    from cadence.methods import Method, MethodSpec, make_engine

    bb = tiny_backbone("llama", seed=5)
    prompt = bb.encode_prompt("hello there", chat=True)
    cfg = GenerationConfig(max_new_tokens=24)
    specs = [MethodSpec(method=Method.VANILLA), MethodSpec(method=Method.HYDRA, heads="random", num_heads=3,
                                                              tree="chain")]
    before = [make_engine(bb, s).generate(prompt, cfg).tokens for s in specs]
    params = {n: p.detach().clone() for n, p in bb.named_parameters()}
    ids = {n: id(p) for n, p in bb.named_parameters()}
    modules = [type(m).__name__ for m in bb.modules()]
    st = _perturb(Student(bb), seed=2)
    # the adapter lives on a copy that shares every weight tensor with the backbone
    shared = {id(p) for p in st.adapted.parameters()}
    assert set(ids.values()) <= shared
    assert [type(m).__name__ for m in bb.modules()] == modules  # no LoRA layer in the backbone
    assert not any("lora" in n for n, _ in bb.named_parameters())
    PipoDecoder(st, "pairs", "confidence", 0.0).generate(prompt, 8)
    after = [make_engine(bb, s).generate(prompt, cfg).tokens for s in specs]
    assert after == before
    assert all(torch.equal(params[n], p) and id(p) == ids[n] for n, p in bb.named_parameters())


# ---------------------------------------------------------------- the gate and the cache


def test_gated_forward_with_a_cache_equals_one_full_forward(student):
    """Pair and plain positions mixed in one sequence: one forward over all of them equals
    position-by-position decoding with a cache (the gate follows each position)."""
    from transformers import DynamicCache

    toks = [3, 9, 27, 81, 14, 15, 92, 65, 35, 89, 79]
    sizes = [2, 2, 1, 2, 1, 1, 2]
    ids, sz = pack(toks, sizes)
    ids, sz = ids[None], sz[None]
    gate = (sz == PAIR).float()
    with torch.no_grad():
        full = student.run(student.latents(ids, sz), gate)
        cache = DynamicCache(config=student.base.config)
        steps = [student.run(student.latents(ids[:, g:g + 1], sz[:, g:g + 1]), gate[:, g:g + 1], cache)
                 for g in range(len(sizes))]
        # a gate of zero is the unmodified backbone itself; of one, the adapter everywhere
        plain = student.run(student.embed(ids[..., 0]), torch.zeros(1, len(sizes)))
        base = student.base.model(input_ids=ids[..., 0]).last_hidden_state
        adapted = student.run(student.embed(ids[..., 0]), None)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-4)
    assert torch.equal(plain, base)
    assert not torch.allclose(adapted, base, atol=1e-3)


def test_training_forward_reads_what_batched_rollouts_wrote(bb):
    """The rollout (left-padded, cached) and the training forward (right-padded, no cache) see
    the same hidden states: the losses are computed on the positions the student sampled from."""
    from cadence.pipo.train import rollout

    st = _perturb(Student(bb), seed=4)
    prompts = [[5, 6, 7, 8, 9], [40, 41], [70, 71, 72, 73, 74, 75, 76, 77]]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        out = rollout(st, prompts, [True, False, True], 7, 1.0, 0.7, g, set())
        for p, (reply, z) in zip(prompts, out):
            assert sum(z) == len(reply) <= 7
            sizes = prompt_groups(len(p)) + z
            ids, sz = pack(p + reply, sizes)
            alone = st.run(st.latents(ids[None], sz[None]), (sz[None] == PAIR).float())
            both = [pack(p + reply, sizes), pack([1, 2, 3], [2, 1])]
            ids2, sz2, mask, pos = pad_batch(both, left=False)
            batched = st.run(st.latents(ids2, sz2), ((sz2 == PAIR) & (mask == 1)).float(), None, pos, mask)
            torch.testing.assert_close(batched[0, :len(sizes)], alone[0], atol=1e-4, rtol=1e-3)



@pytest.mark.parametrize("pair_grad", [False, True])
def test_pair_head_loss_reaches_the_adapter_only_when_asked(bb, pair_grad):
    """By default the pair-out head's KL trains that head alone: its gradient must not move the
    adapter or the compressor (on SmolLM2-135M it made the compressed prompt worse)."""
    from cadence.pipo.train import student_losses, teacher_logprobs

    st = _perturb(Student(bb), seed=5).train()
    toks = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    seqs = [(toks, 4, prompt_groups(4) + [PAIR, PAIR, PAIR])]
    teacher = teacher_logprobs(st.base, [(toks, 4)], bf16=False)
    losses, _ = student_losses(st, seqs, teacher, False, torch.Generator().manual_seed(0), pair_grad)
    losses["kl_pair"].backward()
    moved = [p.grad is not None and bool(p.grad.abs().sum() > 0)
             for p in list(st.lora_parameters().values()) + list(st.compressor.parameters())]
    assert any(moved) == pair_grad
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in st.pair_head.parameters())

# ---------------------------------------------------------------- decoding modes


def test_modes_and_accept_rules(student, bb, monkeypatch):
    prompt = list(range(10, 27))  # odd: the last prompt token is a plain position
    eos = bb.eos_token_ids
    plain_after = PipoDecoder(student, "prompt").generate(prompt, 16, eos=eos)
    assert plain_after.prompt_positions == 9 and plain_after.pair_steps == 0
    # verify mode keeps only what the unmodified weights would choose: the prompt mode's output
    ver = PipoDecoder(student, "pairs", "verify").generate(prompt, 16, eos=eos)
    assert ver.tokens == plain_after.tokens
    assert ver.forwards <= plain_after.forwards
    # confidence threshold 0: every step commits a pair (one forward per two tokens)
    every = PipoDecoder(student, "pairs", "confidence", 0.0).generate(prompt, 16, eos=eos)
    assert every.pair_steps >= 7 and every.forwards <= 9
    # a confidence below the threshold: no pair is kept, the reply is decoded as in the prompt mode
    with monkeypatch.context() as m:
        m.setattr(student, "confidence_of", lambda *a: torch.tensor(0.4))
        never = PipoDecoder(student, "pairs", "confidence", 0.5).generate(prompt, 16, eos=eos)
        assert PipoDecoder(student, "pairs", "confidence", 0.4).generate(prompt, 16, eos=eos).pair_steps > 0
    assert never.pair_steps == 0 and never.tokens == plain_after.tokens
    s = every.summary()
    assert s["new_tokens"] == len(every.tokens) and s["tokens_per_forward"] > 1.5
    # sampling runs and is reproducible by seed
    a = PipoDecoder(student, "pairs", "verify").generate(prompt, 12, temperature=1.0, seed=3, eos=eos)
    b = PipoDecoder(student, "pairs", "verify").generate(prompt, 12, temperature=1.0, seed=3, eos=eos)
    assert a.tokens == b.tokens


def test_one_token_prompt_and_eos(bb):
    st = _perturb(Student(bb), seed=7)
    res = PipoDecoder(st, "pairs", "confidence", 0.0).generate([42], 6)
    assert res.prompt_positions == 1 and 1 <= len(res.tokens) <= 6
    first = res.tokens[0]
    stopped = PipoDecoder(st, "pairs", "confidence", 0.0).generate([42], 6, eos={first})
    assert stopped.tokens == [first]


def test_nll_and_agreement(student):
    items = [(list(range(5, 12)), list(range(30, 41))), (list(range(3, 9)), list(range(50, 55)))]
    for mode in ("plain", "prompt", "pairs"):
        r = reply_nll(student, items, mode)
        assert r["tokens"] == 16 and r["nll"] > 0
    assert agreement([1, 2, 3], [1, 2, 4, 5]) == {"identical": False, "prefix": 2, "prefix_share": 0.5}
    assert agreement([1, 2], [1, 2])["identical"]


# ---------------------------------------------------------------- directory and configs


def test_save_load_round_trip_and_wrong_backbone(tmp_path, student, bb):
    out = save_student(student, tmp_path / "p", {"training": {"step": 3}})
    loaded, meta = load_student(bb, str(out))
    assert meta["lossy"] is True and meta["training"]["step"] == 3
    for k, v in student.state().items():  # stored as bfloat16
        torch.testing.assert_close(loaded.state()[k], v.to(torch.bfloat16).float())
    prompt = list(range(10, 20))
    assert PipoDecoder(loaded, "prompt").generate(prompt, 6).tokens  # decodes
    other = tiny_backbone("llama", hidden=32)
    with pytest.raises(CadenceError, match="another backbone"):
        load_student(other, str(out))
    with pytest.raises(CadenceError, match="not a PIPO directory"):
        load_student(bb, str(tmp_path / "missing"))
    # a second save replaces the first in place
    save_student(student, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def test_config_errors():
    with pytest.raises(CadenceError, match="pipo-mode"):
        PipoDecodeConfig(pipo="x", pipo_mode="both")
    with pytest.raises(CadenceError, match="pipo-threshold"):
        PipoDecodeConfig(pipo="x", pipo_threshold=1.5)
    with pytest.raises(CadenceError, match="steps"):
        TrainPipoConfig(steps=0)
    with pytest.raises(CadenceError, match="temperature"):
        TrainPipoConfig(temperature=0.0)
    with pytest.raises(CadenceError, match="lora_rank"):
        StudentConfig(lora_rank=0)
    with pytest.raises(CadenceError, match="not linear layers"):
        Student(tiny_backbone("llama"), StudentConfig(lora_targets=("nope",)))
