"""Losses, AdaMTP boundaries/masks and held-out counts on hand-made cases."""

import math

import pytest
import torch
import torch.nn.functional as F

from cadence.errors import CadenceError
from cadence.training import losses as L

H_EXAMPLE = [2, 2, 2, 2, 2, 2, 9, 2, 2, 2]  # the worked example in adamtp_mask's docstring


def test_head_weights_and_parse():
    assert L.head_weights(3, 0.8) == pytest.approx([1.0, 0.8, 0.64])
    assert L.parse_loss("ce") == ("ce", False)
    assert L.parse_loss("ce+adamtp") == ("ce", True)
    assert L.parse_loss("kl+adamtp") == ("kl", True)
    with pytest.raises(CadenceError, match="unknown loss"):
        L.parse_loss("mse")


def test_entropy_boundaries_worked_example():
    b = L.entropy_boundaries(torch.tensor(H_EXAMPLE, dtype=torch.float32), window=16, c=2.0)
    assert b.nonzero().flatten().tolist() == [6]


def test_entropy_boundaries_window_and_c():
    # window 2: at s=3 the window is [1, 1] (sigma 0) and 1.5 > 1 -> boundary;
    # s=4 sees [1, 1.5]: mu 1.25, sigma 0.25; 1.7 < 1.25 + 2*0.25 = 1.75 -> none;
    # with c=1 the threshold is 1.5 and 1.7 is a boundary.
    h = torch.tensor([1.0, 1.0, 1.0, 1.5, 1.7, 0.0])
    assert L.entropy_boundaries(h, window=2, c=2.0).nonzero().flatten().tolist() == [3]
    assert L.entropy_boundaries(h, window=2, c=1.0).nonzero().flatten().tolist() == [3, 4]
    # the first min_history positions are never boundaries, whatever their value
    assert not L.entropy_boundaries(torch.tensor([0.0, 50.0, 0.0]), window=4, c=0.0)[:2].any()


def test_entropy_boundaries_batched_matches_rows():
    g = torch.Generator().manual_seed(0)
    h = torch.rand(3, 40, generator=g) * 3
    h[1, 20] = 30.0
    both = L.entropy_boundaries(h, 16, 2.0)
    for r in range(3):
        assert torch.equal(both[r], L.entropy_boundaries(h[r], 16, 2.0))
    assert bool(both[1, 20])


def test_entropy_boundaries_reference_loop():
    g = torch.Generator().manual_seed(1)
    h = torch.rand(60, generator=g) * 4
    h[[10, 33, 34]] += 8
    got = L.entropy_boundaries(h, window=5, c=1.5)
    for s in range(60):
        hist = h[max(0, s - 5):s].double()
        if len(hist) < 2:
            want = False
        else:
            want = bool(h[s] > hist.mean() + 1.5 * hist.std(unbiased=False) + 1e-6)
        assert bool(got[s]) == want, s


def test_adamtp_mask_worked_example():
    b = L.entropy_boundaries(torch.tensor(H_EXAMPLE, dtype=torch.float32))
    m1, m2, m3 = (L.adamtp_mask(b, k) for k in (1, 2, 3))
    assert m1.shape == (8,) and m2.shape == (7,) and m3.shape == (6,)
    assert m1.nonzero().flatten().tolist() == [5]
    assert m2.nonzero().flatten().tolist() == [4, 5]
    assert m3.nonzero().flatten().tolist() == [3, 4, 5]


def test_adamtp_mask_reference_loop():
    g = torch.Generator().manual_seed(2)
    b = torch.rand(2, 30, generator=g) < 0.15
    for k in (1, 2, 4):
        m = L.adamtp_mask(b, k)
        for r in range(2):
            for t in range(30 - 1 - k):
                # boundary token j = s + 1 inside (t+1, t+1+k]  <=>  s in {t+1..t+k}
                assert bool(m[r, t]) == bool(b[r, t + 1:t + k + 1].any())


def _row():
    # two packed sequences and padding: seq 0 = positions 0..5 (prompt 0..2), seq 1 = 6..9 (prompt 6)
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 0, 0]])
    seg = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1, -1]])
    reply = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    return ids, seg, reply


def test_valid_and_decode_masks_by_hand():
    ids, seg, reply = _row()
    v1 = L.valid_mask(seg, reply, 1)[0].nonzero().flatten().tolist()
    # head 1 at t targets t+2: reply targets 3,4,5 (t=1..3); t=4,5 would cross into seq 1; 8,9 (t=6,7)
    assert v1 == [1, 2, 3, 6, 7]
    v2 = L.valid_mask(seg, reply, 2)[0].nonzero().flatten().tolist()
    assert v2 == [0, 1, 2, 6]
    d1 = L.decode_mask(seg, reply, 1)[0].nonzero().flatten().tolist()
    # decoding positions: x_{t+1} in the reply, t+2 in the same sequence
    assert d1 == [2, 3, 6, 7]
    b = L.Batch(ids=ids, seg=seg, reply=reply, argmax=ids + 100)
    assert L.head_targets(b, 2, "token")[0, 0].item() == 13
    assert L.head_targets(b, 2, "backbone")[0, 0].item() == 112  # argmax at t+k = 2
    with pytest.raises(CadenceError):
        L.head_targets(L.Batch(ids=ids, seg=seg, reply=reply), 1, "backbone")


def test_chunked_ce_matches_full_and_gradients():
    g = torch.Generator().manual_seed(0)
    lm = torch.nn.Linear(8, 50)
    f1 = torch.randn(13, 8, generator=g, requires_grad=True)
    f2 = f1.detach().clone().requires_grad_(True)
    tgt = torch.randint(0, 50, (13,), generator=g)
    a = L.chunked_ce(lm, f1, tgt, chunk=4)
    b = F.cross_entropy(lm(f2), tgt, reduction="sum")
    assert torch.allclose(a, b, atol=1e-5)
    a.backward()
    b.backward()
    assert torch.allclose(f1.grad, f2.grad, atol=1e-6)


def test_kl_full_and_topk():
    g = torch.Generator().manual_seed(0)
    lm = torch.nn.Linear(6, 20)
    f = torch.randn(7, 6, generator=g)
    th = torch.randn(7, 6, generator=g)
    with torch.no_grad():
        logp = torch.log_softmax(lm(th), -1)
        logq = torch.log_softmax(lm(f), -1)
        want = (logp.exp() * (logp - logq)).sum()
        assert torch.allclose(L.chunked_kl(lm, f, th, chunk=3), want, atol=1e-5)
        assert L.chunked_kl(lm, th, th, chunk=3).abs() < 1e-5
        ids = torch.stack([torch.randperm(20, generator=g)[:4] for _ in range(7)])
        tl = torch.randn(7, 4, generator=g)
        p = torch.softmax(tl, -1)
        want_k = (p * (p.log() - logq.gather(1, ids))).sum()
        assert torch.allclose(L.chunked_kl_topk(lm, f, ids, tl, chunk=2), want_k, atol=1e-5)


def _brute_loss(lm, feats, batch, lam, adamtp, target):
    """Reference: explicit loops over (k, b, t)."""
    total, means = 0.0, []
    B, T = batch.ids.shape
    for k, f in enumerate(feats, start=1):
        vals = []
        for b in range(B):
            for t in range(T - 1 - k):
                if batch.seg[b, t] < 0 or batch.seg[b, t] != batch.seg[b, t + 1 + k]:
                    continue
                if not batch.reply[b, t + 1 + k]:
                    continue
                if adamtp and batch.boundary[b, t + 1:t + k + 1].any():
                    continue
                y = batch.ids[b, t + 1 + k] if target == "token" else batch.argmax[b, t + k]
                vals.append(F.cross_entropy(lm(f[b, t])[None], y[None]).item())
        m = sum(vals) / len(vals)
        means.append(m)
        total += lam ** (k - 1) * m
    return total, means


@pytest.mark.parametrize("loss,target", [("ce", "token"), ("ce+adamtp", "token"), ("ce", "backbone")])
def test_head_losses_against_loops(loss, target):
    g = torch.Generator().manual_seed(3)
    ids, seg, reply = _row()
    ids = torch.cat([ids, ids.flip(-1)])
    seg, reply = torch.cat([seg, seg]), torch.cat([reply, reply])
    K, d, V = 2, 5, 30
    lm = torch.nn.Linear(d, V)
    boundary = torch.zeros_like(reply)
    boundary[0, 3] = True
    boundary[1, 7] = True
    batch = L.Batch(ids=ids % V, seg=seg, reply=reply, argmax=torch.randint(0, V, ids.shape, generator=g),
                    boundary=boundary)
    T = ids.shape[1]
    feats = [torch.randn(2, T - 1 - k, d, generator=g) for k in range(1, K + 1)]
    spec = L.LossSpec(loss=loss, target=target, lam=0.8, chunk=3)
    total, means, counts = L.head_losses(lm, feats, batch, spec)
    want_total, want_means = _brute_loss(lm, feats, batch, 0.8, loss.endswith("adamtp"), target)
    assert total.item() == pytest.approx(want_total, rel=1e-5)
    assert means == pytest.approx(want_means, rel=1e-5)


def test_head_losses_kl_teacher_from_hidden():
    ids, seg, reply = _row()
    d, V = 4, 16
    g = torch.Generator().manual_seed(4)
    lm = torch.nn.Linear(d, V)
    hidden = torch.randn(1, ids.shape[1], d, generator=g)
    T = ids.shape[1]
    # head k's features equal to the hidden state at t+k -> KL 0
    feats = [hidden[:, k:T - 1] for k in (1, 2)]
    batch = L.Batch(ids=ids % V, seg=seg, reply=reply, hidden=hidden)
    total, means, _ = L.head_losses(lm, feats, batch, L.LossSpec(loss="kl"))
    assert abs(total.item()) < 1e-5


def test_head_losses_no_valid_position_keeps_graph():
    ids = torch.tensor([[1, 2, 3, 4]])
    seg = torch.zeros_like(ids)
    reply = torch.zeros_like(ids, dtype=torch.bool)  # all prompt: nothing to learn
    f = torch.randn(1, 2, 3, requires_grad=True)
    total, means, counts = L.head_losses(torch.nn.Linear(3, 5), [f], L.Batch(ids=ids, seg=seg, reply=reply),
                                         L.LossSpec())
    assert counts == [0] and math.isnan(means[0])
    total.backward()
    assert f.grad is not None and not f.grad.any()


def test_chain_counts_conditional_acceptance():
    # lm = identity: features are logits. One sequence, prompt = 2 tokens, reply = 6.
    V = 10
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    seg = torch.zeros_like(ids)
    reply = ids >= 2
    T = ids.shape[1]
    K = 2
    right = {1: [None, True, False, True, True, None], 2: [None, True, True, False, None]}
    feats = []
    for k in (1, 2):
        f = torch.zeros(1, T - 1 - k, V)
        for t in range(T - 1 - k):
            y = int(ids[0, t + 1 + k])
            ok = right[k][t] if t < len(right[k]) else None
            f[0, t, y if ok in (True, None) else (y + 1) % V] = 5.0
            if ok is False:
                f[0, t, y] = 4.0  # second best: a top-5 hit
        feats.append(f)
    batch = L.Batch(ids=ids, seg=seg, reply=reply)
    c = L.chain_counts(lambda x: x, feats, batch, "token")
    # decode positions: x_{t+1} in the reply -> t >= 1; head 1: t = 1..5, head 2: t = 1..4
    assert c["n"].tolist() == [5, 4]
    assert c["top1"].tolist() == [4, 3]  # head 1 wrong at t=2; head 2 wrong at t=3
    assert c["top5"].tolist() == [5, 4]
    # chain 2 = heads 1 and 2 both right, over head 2's positions t=1..4: t=1 and t=4
    # (t=2: head 1 wrong; t=3: head 2 wrong)
    assert c["chain"].tolist() == [4, 2]
    s = L.summarize_counts(c)
    assert s["tau"] == pytest.approx(1 + 4 / 5 + 2 / 4)
    assert s["tau_independent"] == pytest.approx(1 + 0.8 + 0.8 * 0.75)
    assert s["top5"] == [1.0, 1.0]


def test_lr_schedule():
    assert L.lr_lambda(0, 10, 100) == pytest.approx(0.1)
    assert L.lr_lambda(9, 10, 100) == pytest.approx(1.0)
    assert L.lr_lambda(10, 10, 100) == pytest.approx(1.0)
    assert L.lr_lambda(55, 10, 100) == pytest.approx(0.5)
    assert L.lr_lambda(100, 10, 100) == pytest.approx(0.0)
    assert L.lr_lambda(100, 10, 100, min_ratio=0.1) == pytest.approx(0.1)


@pytest.mark.parametrize("mode", ["ce", "kl", "topk"])
def test_fused_loss_matches_checkpointed(mode):
    g = torch.Generator().manual_seed(5)
    lm = torch.nn.Linear(8, 40)
    lm.requires_grad_(False)
    f1 = torch.randn(11, 8, generator=g, requires_grad=True)
    f2 = f1.detach().clone().requires_grad_(True)
    if mode == "ce":
        aux = (torch.randint(0, 40, (11,), generator=g),)
        ref = L.chunked_ce(lm, f2, *aux, chunk=4)
    elif mode == "kl":
        aux = (torch.randn(11, 8, generator=g),)
        ref = L.chunked_kl(lm, f2, *aux, chunk=4)
    else:
        aux = (torch.stack([torch.randperm(40, generator=g)[:5] for _ in range(11)]), torch.randn(11, 5, generator=g))
        ref = L.chunked_kl_topk(lm, f2, *aux, chunk=4)
    got = L.fused_loss(lm, f1, mode, *aux, chunk=3)
    assert torch.allclose(got, ref, atol=1e-4)
    (2 * got).backward()
    (2 * ref).backward()
    assert torch.allclose(f1.grad, f2.grad, atol=1e-5)


def test_fused_loss_bf16_autocast_close():
    g = torch.Generator().manual_seed(6)
    lm = torch.nn.Linear(16, 64, bias=False)
    f = torch.randn(20, 16, generator=g, requires_grad=True)
    tgt = torch.randint(0, 64, (20,), generator=g)
    ref = L.chunked_ce(lm, f, tgt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = L.fused_loss(lm, f, "ce", tgt, chunk=7)
    assert got.item() == pytest.approx(ref.item(), rel=2e-2)


def test_head_losses_fused_equals_callable():
    g = torch.Generator().manual_seed(7)
    ids, seg, reply = _row()
    lm = torch.nn.Linear(5, 30)
    lm.requires_grad_(False)
    batch = L.Batch(ids=ids % 30, seg=seg, reply=reply)
    feats = [torch.randn(1, ids.shape[1] - 1 - k, 5, generator=g) for k in (1, 2)]
    a = L.head_losses(lm, feats, batch, L.LossSpec())[0]
    b = L.head_losses(lambda x: lm(x), feats, batch, L.LossSpec())[0]
    assert a.item() == pytest.approx(b.item(), rel=1e-5)


# ------------------------------------------------------------------ the context vocabulary

def test_context_seen_resets_per_packed_sequence():
    vmap = torch.full((100,), -1)
    vmap[[5, 7]] = torch.tensor([0, 1])
    ids = torch.tensor([[5, 90, 7, 90, 7]])
    seg = torch.tensor([[0, 0, 0, 1, -1]])
    uniq, seen = L.context_seen(ids, seg, vmap)
    assert uniq.tolist() == [90]
    assert seen[0, :, 0].tolist() == [False, True, True, True, False]  # padding sees nothing
    ids2 = torch.tensor([[7, 90, 7, 5]])
    _, seen2 = L.context_seen(ids2, torch.tensor([[0, 0, 1, 1]]), vmap)
    assert seen2[0, :, 0].tolist() == [False, True, False, False]  # the second sequence has no 90
    assert L.context_seen(torch.tensor([[5, 7]]), torch.zeros(1, 2, dtype=torch.long), vmap) is None


def test_fused_ce_with_context_columns_matches_reference():
    g = torch.Generator().manual_seed(8)
    lm = torch.nn.Linear(8, 12, bias=False)
    lm.requires_grad_(False)
    rows = torch.randn(4, 8, generator=g)  # four context tokens
    vis = torch.rand(9, 4, generator=g) > 0.4
    vis[:, 0] = True
    tgt = torch.randint(0, 12, (9,), generator=g)
    tgt[:3] = 12  # three rows aim at context column 0 (always visible)
    f1 = torch.randn(9, 8, generator=g, requires_grad=True)
    f2 = f1.detach().clone().requires_grad_(True)
    z = torch.cat([lm(f2), (f2 @ rows.T).masked_fill(~vis, float("-inf"))], -1)
    ref = F.cross_entropy(z, tgt, reduction="sum")
    got = L.fused_loss(lm, f1, "ce", tgt, rows, vis, chunk=4)
    assert torch.allclose(got, ref, atol=1e-4)
    got.backward()
    ref.backward()
    assert torch.allclose(f1.grad, f2.grad, atol=1e-5)


def test_head_losses_train_visible_context_tokens_instead_of_skipping_them():
    """Row [3, 90, 4, 90, 91]: head 1 at t = 2 aims at 90 (seen at 1: kept with the context
    vocabulary), at t = 3 at 91 (never seen: skipped either way)."""
    V = 100
    vmap = torch.full((V,), -1)
    vmap[:10] = torch.arange(10)
    lm = torch.nn.Linear(6, 10, bias=False)
    lm.requires_grad_(False)
    full = torch.randn(V, 6)
    ids = torch.tensor([[3, 90, 4, 90, 91]])
    batch = L.Batch(ids=ids, seg=torch.zeros_like(ids), reply=torch.ones_like(ids, dtype=torch.bool))
    feats = [torch.randn(1, 3, 6, requires_grad=True)]
    plain = L.head_losses(lm, feats, batch, L.LossSpec(vocab_map=vmap))
    ctx = L.head_losses(lm, feats, batch, L.LossSpec(vocab_map=vmap, context_vocab=True, lm_rows=full))
    # t = 0 -> x2 = 4 (inside), t = 1 -> x3 = 90 (seen at 1), t = 2 -> x4 = 91 (unseen)
    f = feats[0][0].detach()
    inside = F.cross_entropy(lm(f[:1]), torch.tensor([4]), reduction="sum")
    assert plain[1][0] == pytest.approx(float(inside), rel=1e-5)  # only the inside target
    # with the context vocabulary both t = 0 and t = 1 also score 90 (visible from position 1 on)
    extra = (f[:2] @ full[[90, 91]].T).masked_fill(torch.tensor([[False, True]]), float("-inf"))  # 91 unseen
    z = torch.cat([lm(f[:2]), extra], -1)
    both = F.cross_entropy(z, torch.tensor([4, 10]), reduction="mean")
    assert ctx[1][0] == pytest.approx(float(both), rel=1e-5)
