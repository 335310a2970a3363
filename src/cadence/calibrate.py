"""Calibrate a tree for trained heads on this machine (Medusa's method + measured latency).

1. Acceptance: on held-out distilled sequences, teacher-forced, the rank of the true
   token under head k. ``a[k][i]`` = P(rank = i | heads 1..k-1 ranked their true token
   within the top R), i.e. the chance that a rank-i node is right when its parent path is.
2. Candidate trees: greedy growth (``trees.grow_tree``) for each node budget.
3. Latency: one full engine step (draft + tree forward + verify) per tree, measured here.
4. Choice: the tree with the highest expected tokens per second, expected tau / latency.

The chosen tree and the acceptance table are written into the heads' config.json
(``tree``, ``acceptance``), so ``--tree auto`` uses them; the whole table goes to
calibration.json beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from cadence import kv_cache
from cadence.atomic import atomic_write_json
from cadence.cliargs import add_fields, from_args
from cadence.drafter import HeadDrafter
from cadence.errors import CadenceError
from cadence.sampling import SamplingParams
from cadence.trees import attention_mask, compile_tree, expected_tau, grow_tree
from cadence.verify import VerifyContext, greedy


@dataclass
class CalibrateConfig:
    """Settings of `cadence calibrate`; CLI flags derive from these fields."""

    heads: str = ""  # heads directory to calibrate (config.json is updated in place)
    data: str = "data/distill-smollm2"  # distillation directory; its 'val' shards are used
    tokens: int = 20000  # reply tokens of held-out data to measure acceptance on
    ranks: int = 10  # candidates per head considered
    budgets: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])  # tree sizes (draft nodes) tried
    context: int = 256  # context length for latency timing
    reps: int = 9  # timed rounds over all trees, interleaved (median per tree)
    model: str = "smollm2"  # backbone
    dtype: str = "auto"  # backbone dtype
    device: str = "auto"  # backbone device


@torch.inference_mode()
def rank_table(backbone, heads, data_dir: str | Path, tokens: int, ranks: int) -> list[list[float]]:
    """a[k][i] from teacher-forced held-out sequences (see module docstring)."""
    from cadence.training.data import iter_sequences, load_manifest, read_shard

    manifest = load_manifest(Path(data_dir))
    if manifest is None:
        raise CadenceError(f"{data_dir} has no manifest.json")
    shards = [s for s in manifest["shards"] if s["split"] == "val"]
    if not shards:
        raise CadenceError(f"{data_dir} has no held-out ('val') shards yet")
    K = heads.K
    hist = torch.zeros(K, ranks + 1)  # last column: outside the top `ranks`
    cond = torch.zeros(K)  # positions whose earlier heads were all within the top `ranks`
    seen = 0
    bar = tqdm(total=tokens, desc="acceptance", unit="tok")
    for shard in shards:
        for ids, plen in iter_sequences(read_shard(Path(data_dir) / shard["file"])):
            if seen >= tokens:
                break
            ids = ids.to(backbone.device)
            T = len(ids)
            if T - plen < K + 2:
                continue
            hidden = backbone.forward(ids[None], kv_cache.new_cache(backbone), need_logits=False).hidden
            feats = heads.train_features(hidden, ids[None])
            ok = None
            for k in range(1, K + 1):
                f = feats[k - 1][0]  # (T-1-k, d) for t = 0..T-2-k
                t0 = max(plen - 1, 0)  # first position whose next token is a reply token
                f = f[t0:]
                target = ids[t0 + k + 1:]
                logits = heads.draft_logits(f)
                rank = _rank_of(logits, heads, target, ranks)
                n = len(rank)
                prev_ok = torch.ones(n, dtype=torch.bool) if ok is None else ok[:n]
                hist[k - 1] += torch.bincount(rank[prev_ok].clamp(max=ranks), minlength=ranks + 1)[:ranks + 1].cpu()
                cond[k - 1] += int(prev_ok.sum())
                ok = prev_ok & (rank < ranks)
            seen += T - plen
            bar.update(T - plen)
        if seen >= tokens:
            break
    bar.close()
    table = (hist[:, :ranks] / cond.clamp(min=1)[:, None]).tolist()
    return [[round(v, 5) for v in row] for row in table]


def _rank_of(logits: torch.Tensor, heads, target: torch.Tensor, ranks: int) -> torch.Tensor:
    """Rank of each target among the head's candidates (``ranks`` if not in the top)."""
    top = logits.topk(ranks, dim=-1).indices
    if heads.draft_vocab is not None:
        top = heads.draft_vocab[top]
    hit = top == target[:, None]
    found = hit.any(-1)
    return torch.where(found, hit.float().argmax(-1), torch.full_like(target, ranks))


def _step_times(backbone, drafter, tree, context: int, reps: int) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, backbone.vocab_size, (1, context), generator=gen).to(backbone.device)
    times = []
    for _ in range(reps):
        cache = kv_cache.new_cache(backbone)
        out = backbone.forward(ctx, cache, need_logits=False)
        hidden, root = out.hidden[0, -1], int(ctx[0, -1])
        t = time.perf_counter()
        if tree.size > 1:
            tokens = drafter.draft(tree, root, hidden, [], SamplingParams(), None).tokens
        else:
            tokens = torch.tensor([root], device=backbone.device)
        mask = None if tree.is_chain else attention_mask(tree, context, backbone.dtype, backbone.device)
        pos = None if tree.is_chain else (torch.tensor(tree.depths, device=backbone.device) + context)[None]
        logits = backbone.forward(tokens[None], cache, pos, mask).logits[0]
        greedy(tree, tokens, logits, VerifyContext())
        times.append(time.perf_counter() - t)
    return times


@torch.inference_mode()
def interleaved_latency(backbone, heads, trees: list, context: int, rounds: int) -> list[float]:
    """Median step seconds per tree, measured in ``rounds`` interleaved passes over all trees
    (one warm-up pass first), so that a slow spell of a noisy machine hits every tree alike."""
    drafter = HeadDrafter(heads)
    samples: list[list[float]] = [[] for _ in trees]
    for r in tqdm(range(rounds + 1), desc="latency", unit="round"):
        for i, tree in enumerate(trees):
            t = _step_times(backbone, drafter, tree, context, 1)[0]
            if r:
                samples[i].append(t)
    return [statistics.median(s) for s in samples]


def calibrate(cfg: CalibrateConfig, backbone=None) -> dict:
    from cadence.backbone import load_backbone
    from cadence.heads import load_heads

    if not cfg.heads:
        raise CadenceError("--heads DIR is required")
    backbone = backbone or load_backbone(cfg.model, cfg.dtype, cfg.device)
    heads = load_heads(cfg.heads, backbone)
    acc = rank_table(backbone, heads, cfg.data, cfg.tokens, cfg.ranks)
    candidates = [[]] + [grow_tree(acc, b) for b in cfg.budgets]
    trees = [compile_tree(p, name=f"calibrated-{len(p)}") for p in candidates]
    lats = interleaved_latency(backbone, heads, trees, cfg.context, cfg.reps)
    base = lats[0]
    rows, best = [], (0.0, [])
    for paths, lat in zip(candidates, lats):
        tau = expected_tau(paths, acc)
        rows.append({"budget": len(paths), "expected_tau": tau, "latency_ms": lat * 1e3,
                     "expected_tok_s": tau / lat, "paths": [list(p) for p in paths]})
        if tau / lat > best[0]:
            best = (tau / lat, paths)
    report = {"acceptance": acc, "trees": rows, "chosen_budget": len(best[1]),
              "expected_speedup": best[0] * base, "context": cfg.context}
    heads_dir = Path(cfg.heads)
    conf = json.loads((heads_dir / "config.json").read_text())
    conf.update(tree=[list(p) for p in best[1]], acceptance=acc)
    atomic_write_json(heads_dir / "config.json", conf)
    atomic_write_json(heads_dir / "calibration.json", report)
    return report


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="measure head acceptance and tree latency; store the best tree")
    add_fields(p, CalibrateConfig)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    report = calibrate(from_args(CalibrateConfig, args))
    print("| draft nodes | expected tau | step ms | expected tok/s |\n|---|---|---|---|")
    for r in report["trees"]:
        print(f"| {r['budget']} | {r['expected_tau']:.3f} | {r['latency_ms']:.1f} | {r['expected_tok_s']:.2f} |")
    print(f"chosen: {report['chosen_budget']} draft nodes, expected speedup {report['expected_speedup']:.2f}x "
          "over plain decoding (from measured latency and acceptance)")
    return 0
