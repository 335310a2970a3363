"""Probe: does an EAGLE drafter predict better from several backbone layers than from the top one?

EAGLE-1 (cadence's ``eagle``) feeds the drafter fc([E(x_{t+1}) ; h_t]) with h_t the backbone's
final (normed) state; EAGLE-3 fuses low / mid / high layer states instead. This trains the
depth-1 drafter (one decoder block, the shared LM head over a draft vocabulary, target: the
backbone's argmax at t+1) from scratch on the same data for the same steps with different
inputs, and reports held-out top-1 / top-5 on the store's val split (reply positions only):

    top     fc([E ; h_top])                                   (EAGLE-1, what ships)
    fused   fc([E ; h_top ; rms(h_low) ; rms(h_mid) ; rms(h_high)])
    eagle3  fc([E ; rms(h_low) ; rms(h_mid) ; rms(h_high)])   (no top state)

Layers low/mid/high are EAGLE-3's choice: 2, L/2, L-3 (L decoder layers). A small, same-budget
comparison: it says whether fused features are worth building, not what a full run reaches.

    python benchmarks/analysis/eagle_fusion_probe.py --train-tokens 250000 --epochs 2 --out runs/eagle-fusion-probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.heads.attn_block import Block, segment_causal, shape_from_config
from cadence.heads.base import HeadConfig
from cadence.heads.io import attention_shape
from cadence.training.batches import Corpus
from cadence.training.losses import lr_lambda

VARIANTS = ("top", "fused", "eagle3")


def take(corpus: Corpus, budget: int, max_len: int) -> list[tuple[torch.Tensor, int]]:
    """(ids, prompt_len) of the corpus's first sequences up to ``budget`` tokens (each cut at max_len)."""
    out, n = [], 0
    for ref in corpus.seqs:
        ids = corpus.seq_tokens(ref)[:max_len].long()
        if ids.numel() - ref.plen < 4:
            continue
        out.append((ids, ref.plen))
        n += ids.numel()
        if n >= budget:
            break
    return out


@torch.no_grad()
def features(bb, seqs, layers: list[int]):
    """Per sequence: dict(top (T, d), low/mid/high (T, d) raw layer outputs, argmax (T,))."""
    out, t0, done = [], time.time(), 0
    model = bb.model
    for ids, plen in seqs:
        o = model(ids[None], output_hidden_states=True)
        hs = o.hidden_states  # embeddings, layer 1 .. layer L (last one normed)
        out.append({"top": hs[-1][0].to(torch.bfloat16), "argmax": o.logits[0].argmax(-1),
                    **{name: hs[i][0].to(torch.bfloat16) for name, i in zip(("low", "mid", "high"), layers)},
                    "ids": ids, "plen": plen})
        done += ids.numel()
    print(f"features: {done} tokens in {time.time() - t0:.0f} s", flush=True)
    return out


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def inputs(variant: str, s: dict) -> torch.Tensor:
    """(T, n*d) drafter features of variant for one sequence."""
    parts = {"top": [s["top"]],
             "fused": [s["top"], rms(s["low"].float()), rms(s["mid"].float()), rms(s["high"].float())],
             "eagle3": [rms(s["low"].float()), rms(s["mid"].float()), rms(s["high"].float())]}[variant]
    return torch.cat([p.float() for p in parts], -1)


class Drafter(nn.Module):
    """Depth-1 EAGLE drafter: fc([E(x_{j+1}) ; feats_j]) -> Block -> frozen LM head rows."""

    def __init__(self, cfg: HeadConfig, n_feats: int, embed: nn.Embedding, head_w: torch.Tensor):
        super().__init__()
        d = cfg.hidden_size
        self.fc = nn.Linear(d + n_feats * d, d, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, d:2 * d] = torch.eye(d)  # start as "pass the first feature through"
        self.block = Block(shape_from_config(cfg), input_norm=False)
        self.embed, self.head_w = embed, head_w

    def forward(self, ids: torch.Tensor, feats: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        """ids (B, T), feats (B, T, n*d), seg (B, T) -> logits (B, T-1, V') for x_{j+2} at j."""
        B, T = ids.shape
        x = self.fc(torch.cat([self.embed(ids[:, 1:]).float(), feats[:, :T - 1]], -1))
        pos = torch.arange(T - 1).expand(B, T - 1)
        f, _, _ = self.block.forward_masked(x, pos, segment_causal(seg[:, :T - 1]))
        return f @ self.head_w.T


def batches(data, variant, vmap, bs, shuffle, seed=0):
    """Rows of ``bs`` sequences (padded), with targets (backbone argmax at j+1 mapped into the
    draft vocabulary, -100 outside it or off reply positions)."""
    order = list(range(len(data)))
    if shuffle:
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(data), generator=g).tolist()
    for i in range(0, len(order), bs):
        group = [data[j] for j in order[i:i + bs]]
        T = max(s["ids"].numel() for s in group)
        ids = torch.zeros(len(group), T, dtype=torch.long)
        seg = torch.full((len(group), T), -1, dtype=torch.long)
        tgt = torch.full((len(group), T - 1), -100, dtype=torch.long)
        feats = torch.zeros(len(group), T, inputs(variant, group[0]).shape[-1])
        for b, s in enumerate(group):
            n, p = s["ids"].numel(), s["plen"]
            ids[b, :n], seg[b, :n] = s["ids"], 0
            feats[b, :n] = inputs(variant, s)
            # position j predicts x_{j+2} = backbone argmax at j+1; decode positions: x_{j+1} in the reply
            j = torch.arange(max(p - 1, 0), n - 2)
            if j.numel():
                t = vmap[s["argmax"][j + 1]]
                tgt[b, j] = torch.where(t >= 0, t, torch.full_like(t, -100))
        yield ids, feats, seg, tgt


def evaluate(model, data, variant, vmap, bs=8):
    n = top1 = top5 = 0
    model.eval()
    with torch.no_grad():
        for ids, feats, seg, tgt in batches(data, variant, vmap, bs, shuffle=False):
            logits = model(ids, feats, seg)
            # positions with a reply target; targets outside the draft vocabulary count as misses
            m = tgt != -100
            top = logits[m].topk(5, -1).indices
            top1 += int((top[:, 0] == tgt[m]).sum())
            top5 += int((top == tgt[m][:, None]).any(-1).sum())
            n += int(m.sum())
    model.train()
    return {"top1": top1 / max(n, 1), "top5": top5 / max(n, 1), "positions": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="data/selfdistill/smollm2")
    ap.add_argument("--train-tokens", type=int, default=250_000)
    ap.add_argument("--val-tokens", type=int, default=30_000)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    bb = common.backbone(dtype="bfloat16")
    L = bb.config.num_hidden_layers
    layers = [2, L // 2, L - 3]  # hidden_states[i] = output of layer i (1-based)
    man = json.loads((Path(args.data) / "manifest.json").read_text())
    files = {sp: [s["file"] for s in man["shards"] if s["split"] == sp] for sp in ("train", "val")}
    train = features(bb, take(Corpus(args.data, files["train"]), args.train_tokens, args.max_len), layers)
    val = features(bb, take(Corpus(args.data, files["val"]), args.val_tokens, args.max_len), layers)
    # draft vocabulary: the most frequent backbone targets of the training part
    counts = torch.bincount(torch.cat([s["argmax"] for s in train]), minlength=bb.vocab_size)
    vocab = counts.topk(args.draft_vocab).indices
    vmap = torch.full((bb.vocab_size,), -1, dtype=torch.long)
    vmap[vocab] = torch.arange(vocab.numel())
    head_w = bb.lm_head.weight.detach().float()[vocab]
    embed = nn.Embedding.from_pretrained(bb.embed.weight.detach().float(), freeze=True)
    cfg = HeadConfig(kind="eagle", num_heads=1, hidden_size=bb.hidden_size, vocab_size=bb.vocab_size,
                     backbone=bb.name, **attention_shape(bb))
    results = {"machine": common.machine(), "layers": layers, "args": vars(args), "variants": {}}
    for variant in args.variants:
        torch.manual_seed(0)
        n_feats = {"top": 1, "fused": 4, "eagle3": 3}[variant]
        model = Drafter(cfg, n_feats, embed, head_w)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        steps = args.epochs * math.ceil(len(train) / args.batch_size)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s, n=steps: lr_lambda(s, 20, n))
        t0, step = time.time(), 0
        for epoch in range(args.epochs):
            for ids, feats, seg, tgt in batches(train, variant, vmap, args.batch_size, True, seed=epoch):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(ids, feats, seg)
                loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), ignore_index=-100)
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                step += 1
                if step % 50 == 0:
                    print(f"{variant} step {step}/{steps} loss {loss.item():.3f} {time.time() - t0:.0f} s", flush=True)
        ev = evaluate(model, val, variant, vmap)
        ev["train_seconds"] = round(time.time() - t0, 1)
        ev["steps"] = step
        results["variants"][variant] = ev
        print(variant, ev, flush=True)
    print(json.dumps(results["variants"], indent=1))
    if args.out:
        common.write_json(args.out, results)


if __name__ == "__main__":
    main()
