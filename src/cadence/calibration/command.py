"""Calibrate a tree for trained heads on this machine (Medusa's method + measured latency).

1. Acceptance (``acceptance``): on held-out distilled sequences, teacher-forced, the rank of the true
   token under head k. ``a[k][i]`` = P(rank = i | heads 1..k-1 ranked their true token
   within the top R), i.e. the chance that a rank-i node is right when its parent path is.
2. Candidate trees: greedy growth (``trees.grow_tree``) for each node budget.
3. Latency: one full engine step (draft + tree forward + verify) per tree, measured here.
4. Choice: the tree with the highest expected tokens per second, expected tau / latency.

Steps 1-4 run twice: for the heads alone, and for the heads with context copy
(``cadence.draft.context_copy``: the copy ranked first, copies alone past depth K). The chosen trees
and acceptance tables are written into the heads' draft_config.json (``tree``/``acceptance``,
``copy_tree``/``copy_acceptance``; ``cadence.heads.tables``, apart from the weights' config.json), so
``--tree auto`` uses them; the whole table goes to calibration.json beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from cadence.backbone.load import load_backbone
from cadence.calibration.acceptance import rank_tables
from cadence.calibration.entropy_profiles import measure_profiles, plot_frontiers
from cadence.cliargs import add_fields, from_args
from cadence.costs.latency import latency_curve
from cadence.costs.tree_choice import draft_seconds
from cadence.draft.context_copy import CopyConfig
from cadence.draft.head_drafter import HeadDrafter
from cadence.errors import CadenceError
from cadence.heads.io import decode_dtype, load_heads
from cadence.heads.profiles import save_profiles
from cadence.heads.tables import DraftPolicy, save_policy
from cadence.system.atomic import atomic_write_json
from cadence.trees.tree import compile_tree, expected_tau, grow_tree
from cadence.verify.rules import VerifyContext, greedy
from cadence.verify.sampling import SamplingParams
from cadence.verify.scorer import score


@dataclass
class CalibrateConfig:
    """Settings of `cadence calibrate`; CLI flags derive from these fields."""

    heads: str = field(default="", metadata={
        "help": "heads directory to calibrate (config.json is updated in place)"})
    data: str = field(default="data/distill-smollm2", metadata={
        "help": "distillation directory; its 'val' shards are used"})
    tokens: int = field(default=20000, metadata={
        "help": "reply tokens of held-out data to measure acceptance on"})
    ranks: int = field(default=10, metadata={"help": "candidates per head considered"})
    budgets: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64], metadata={
        "help": "tree sizes (draft nodes) tried"})
    context: int = field(default=256, metadata={"help": "context length for latency timing"})
    reps: int = field(default=9, metadata={
        "help": "timed rounds over all trees, interleaved (median per tree)"})
    copy: bool = field(default=True, metadata={
        "help": "also calibrate a tree for drafting with context copy (stored as copy_tree)"})
    copy_depth: int = field(default=8, metadata={
        "help": "deepest tree level considered when copying (levels past K are copies only)"})
    context_vocab: int = field(default=256, metadata={
        "help": "calibrate drafting with the context vocabulary (MethodSpec.context_vocab; 0 = without)"})
    heads_dtype: str = field(default="auto", metadata={
        "help": "dtype the heads draft in while measured (MethodSpec.heads_dtype; auto: the backbone's bfloat16, else float32)"})
    draft_weights: str = field(default="auto", metadata={
        "help": "how the drafting kernels hold the weights while measured (MethodSpec.draft_weights): auto, "
                "dense, q8_0, q4_1 or q4_0"})
    split: str = field(default="val", metadata={
        "help": "store split measured (val: held out from training; train: when no val shards exist yet)"})
    profiles: bool = field(default=True, metadata={
        "help": "also measure acceptance profiles per task and entropy bin (EntMTP) into profiles.json"})
    tasks: list[str] = field(default_factory=lambda: ["general", "humaneval", "gsm8k", "sharegpt", "writing"],
                             metadata={"help": "profiles to measure: general and/or humaneval, gsm8k, sharegpt, "
                                               "writing (by the store's prompt source)"})
    bins: int = field(default=5, metadata={"help": "entropy bins per profile (quantiles)"})
    profile_tokens: int = field(default=12000, metadata={"help": "reply tokens per profile"})
    model: str = field(default="smollm2", metadata={"help": "backbone"})
    dtype: str = field(default="auto", metadata={"help": "backbone dtype"})
    device: str = field(default="auto", metadata={"help": "backbone device"})


def _step_times(backbone, drafter, tree, context: int, reps: int) -> list[float]:
    """Seconds of one engine step on ``tree`` after ``context`` tokens. The context repeats
    a 16-token pattern, so context copies always exist and every node of a copy tree is
    drafted and verified (the cost of the whole tree, never of a pruned one)."""
    gen = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, backbone.vocab_size, (16,), generator=gen)
    ctx = pattern.repeat(context // 16 + 2)[:context + 1].to(backbone.device)[None]
    root, ctx = int(ctx[0, -1]), ctx[:, :-1]
    times = []
    for _ in range(reps):
        cache = backbone.new_cache()
        out = backbone.forward(ctx, cache, need_logits=False)
        hidden = out.hidden[0, -1]
        t = time.perf_counter()
        if tree.size > 1:
            draft = drafter.draft(tree, root, hidden, ctx[0].tolist(), SamplingParams(), None, drafter.new_index())
            tokens, tree = draft.tokens, draft.tree or tree
        else:
            tokens = torch.tensor([root], device=backbone.device)
        logits = score(backbone, cache, context, tree, tokens).logits[0]
        greedy(tree, tokens, logits, VerifyContext())
        times.append(time.perf_counter() - t)
    return times


@torch.inference_mode()
def interleaved_latency(backbone, heads, trees: list, context: int, rounds: int,
                        drafters: list | None = None) -> list[float]:
    """Median step seconds per tree, measured in ``rounds`` interleaved passes over all trees
    (one warm-up pass first), so that a slow spell of a noisy machine hits every tree alike.
    ``drafters[i]`` drafts tree i (default: the heads alone)."""
    drafters = drafters or [HeadDrafter(heads)] * len(trees)
    samples: list[list[float]] = [[] for _ in trees]
    for r in tqdm(range(rounds + 1), desc="latency", unit="round"):
        for i, tree in enumerate(trees):
            t = _step_times(backbone, drafters[i], tree, context, 1)[0]
            if r:
                samples[i].append(t)
    return [statistics.median(s) for s in samples]


def calibrate(cfg: CalibrateConfig, backbone=None) -> dict:
    """Measure, choose and store the best tree for the heads alone and (``cfg.copy``) for
    the heads with context copy; see the module docstring."""
    if not cfg.heads:
        raise CadenceError("--heads DIR is required")
    backbone = backbone or load_backbone(cfg.model, cfg.dtype, cfg.device)
    heads = load_heads(cfg.heads, backbone, dtype=decode_dtype(backbone, cfg.heads_dtype))
    heads.set_draft_format(cfg.draft_weights)
    copy = CopyConfig() if cfg.copy else None
    if cfg.context_vocab < 0:
        raise CadenceError(f"--context-vocab must be >= 0, got {cfg.context_vocab}")
    acc, copy_acc = rank_tables(backbone, heads, cfg.data, cfg.tokens, cfg.ranks, copy, cfg.copy_depth, cfg.split,
                                context_vocab=cfg.context_vocab > 0)
    variants = [("heads", acc, HeadDrafter(heads, context_vocab=cfg.context_vocab))]
    if copy_acc is not None:
        variants.append(("copy", copy_acc, HeadDrafter(heads, copy, cfg.copy_depth, cfg.context_vocab)))
    candidates = [("heads", [], variants[0][2])] + [
        (name, grow_tree(table, b), drafter) for name, table, drafter in variants for b in cfg.budgets]
    trees = [compile_tree(p, name=f"calibrated-{name}-{len(p)}") for name, p, _ in candidates]
    lats = interleaved_latency(backbone, heads, trees, cfg.context, cfg.reps, [d for _, _, d in candidates])
    base = lats[0]
    rows = []
    best = {name: (1.0 / base, []) for name, _, _ in variants}  # plain decoding is always a candidate
    for (name, paths, _), lat in zip(candidates, lats):
        table = copy_acc if name == "copy" else acc
        tau = expected_tau(paths, table)
        rows.append({"drafter": name, "budget": len(paths), "depth": max(map(len, paths), default=0),
                     "expected_tau": tau, "latency_ms": lat * 1e3, "expected_tok_s": tau / lat,
                     "paths": [list(p) for p in paths]})
        for key in ([name] if paths else list(best)):
            if tau / lat > best[key][0]:
                best[key] = (tau / lat, paths)
    report = {"acceptance": acc, "copy_acceptance": copy_acc, "trees": rows, "context": cfg.context,
              "chosen": {name: {"budget": len(p), "expected_speedup": v * base, "paths": [list(x) for x in p]}
                         for name, (v, p) in best.items()}}
    heads_dir = Path(cfg.heads)
    policy = DraftPolicy(tree=[list(p) for p in best["heads"][1]], acceptance=acc)
    if "copy" in best:
        policy.copy_tree, policy.copy_acceptance = [list(p) for p in best["copy"][1]], copy_acc
    save_policy(heads_dir, policy)
    atomic_write_json(heads_dir / "calibration.json", report)
    if cfg.profiles:
        report["profiles"] = _profiles(cfg, backbone, heads, copy)
    return report


def _profiles(cfg: CalibrateConfig, backbone, heads, copy) -> str:
    """Acceptance per task and entropy bin -> profiles.json, and a frontier plot per profile."""
    profiles = measure_profiles(backbone, heads, cfg.data, cfg.tasks, cfg.bins, cfg.profile_tokens, cfg.ranks,
                                copy, cfg.copy_depth, cfg.split, context_vocab=cfg.context_vocab > 0)
    path = save_profiles(cfg.heads, profiles, {"data": str(cfg.data), "split": cfg.split,
                                               "tokens_per_profile": cfg.profile_tokens,
                                               "context_vocab": cfg.context_vocab})
    latency = latency_curve(backbone)
    draft_s = draft_seconds(HeadDrafter(heads, context_vocab=cfg.context_vocab), backbone.hidden_size,
                            backbone.device, backbone.dtype)
    for task, prof in profiles.items():
        try:
            plot_frontiers(prof, latency, draft_s, heads.K, copy is not None, path.parent / f"frontier-{task}.png")
        except ImportError:  # matplotlib is in the bench extra; the profiles are what matters
            break
    return str(path)


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="measure head acceptance and tree latency; store the best tree")
    add_fields(p, CalibrateConfig)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    report = calibrate(from_args(CalibrateConfig, args))
    print("| drafter | draft nodes | depth | expected tau | step ms | expected tok/s |\n|---|---|---|---|---|---|")
    for r in report["trees"]:
        print(f"| {r['drafter']} | {r['budget']} | {r['depth']} | {r['expected_tau']:.3f} | "
              f"{r['latency_ms']:.1f} | {r['expected_tok_s']:.2f} |")
    for name, c in report["chosen"].items():
        print(f"chosen ({name}): {c['budget']} draft nodes, expected speedup {c['expected_speedup']:.2f}x "
              "over plain decoding (from measured latency and acceptance)")
    return 0
