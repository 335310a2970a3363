"""Calibrate a tree for trained heads on this machine (Medusa's method + measured latency).

1. Acceptance: on held-out distilled sequences, teacher-forced, the rank of the true
   token under head k. ``a[k][i]`` = P(rank = i | heads 1..k-1 ranked their true token
   within the top R), i.e. the chance that a rank-i node is right when its parent path is.
2. Candidate trees: greedy growth (``trees.grow_tree``) for each node budget.
3. Latency: one full engine step (draft + tree forward + verify) per tree, measured here.
4. Choice: the tree with the highest expected tokens per second, expected tau / latency.

Steps 1-4 run twice: for the heads alone, and for the heads with context copy
(``context_copy``: the copy ranked first, copies alone past depth K). The chosen trees
and acceptance tables are written into the heads' draft_config.json (``tree``/``acceptance``,
``copy_tree``/``copy_acceptance``; ``heads.policy``, apart from the weights' config.json), so
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

from cadence.atomic import atomic_write_json
from cadence.cliargs import add_fields, from_args
from cadence.context_copy import CopyConfig, NgramIndex, merge_candidates
from cadence.drafter import HeadDrafter
from cadence.errors import CadenceError
from cadence.heads.base import teacher_features
from cadence.heads.policy import DraftPolicy, save_policy
from cadence.sampling import SamplingParams, entropy
from cadence.scorer import score
from cadence.trees import compile_tree, expected_tau, grow_tree
from cadence.verify import VerifyContext, greedy


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


def _val_sequences(data_dir: str | Path, split: str = "val"):
    from cadence.training.data import iter_sequences, load_manifest, read_shard

    manifest = load_manifest(Path(data_dir))
    if manifest is None:
        raise CadenceError(f"{data_dir} has no manifest.json")
    shards = [s for s in manifest["shards"] if s["split"] == split]
    if not shards:
        raise CadenceError(f"{data_dir} has no {split!r} shards yet" + (" (--split train measures on the "
                           "training split)" if split == "val" else ""))
    for shard in shards:
        yield from iter_sequences(read_shard(Path(data_dir) / shard["file"]))


class _RankHistogram:
    """Counts of the true token's candidate rank per depth, among positions whose path
    so far was covered (every earlier depth ranked its true token within ``ranks``)."""

    def __init__(self, depth: int, ranks: int):
        self.ranks = ranks
        self.hist = torch.zeros(depth, ranks + 1)  # last column: outside the top `ranks`
        self.cond = torch.zeros(depth)

    def add(self, rank_by_depth: list[torch.Tensor], keep: torch.Tensor | None = None) -> None:
        """rank_by_depth[k]: (n_k,) ranks at depth k+1 for positions t0.. (n_k shrinks with k);
        keep: (n_0,) bool, the positions to count (all when None)."""
        ok = keep
        for k, rank in enumerate(rank_by_depth):
            n = len(rank)
            prev_ok = torch.ones(n, dtype=torch.bool) if ok is None else ok[:n]
            self.hist[k] += torch.bincount(rank[prev_ok].clamp(max=self.ranks),
                                           minlength=self.ranks + 1)[:self.ranks + 1].cpu()
            self.cond[k] += int(prev_ok.sum())
            ok = prev_ok & (rank < self.ranks)

    def table(self) -> list[list[float]]:
        table = (self.hist[:, :self.ranks] / self.cond.clamp(min=1)[:, None]).tolist()
        return [[round(v, 5) for v in row] for row in table]


@dataclass
class SequenceRanks:
    """Teacher-forced ranks of the true token on one sequence, from position t0 on."""

    plain: list[torch.Tensor]  # plain[k]: (n_k,) rank under head k+1 alone (``ranks`` = absent)
    copied: list[torch.Tensor] | None  # the same with the context copy ranked first, depths 1..copy depth
    entropy: torch.Tensor | None  # (n_0,) backbone entropy (nats) at each root, when asked for


@torch.inference_mode()
def _context_logits(heads, feats: torch.Tensor, ids: torch.Tensor, t0: int
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The context vocabulary's columns for teacher-forced positions t = t0.. (as
    ``HeadDrafter`` scores them): logits (n, U) over the sequence's tokens outside the draft
    vocabulary, -inf where the token has not appeared in x[0..t+1] yet, and their ids (U,).
    (The drafter keeps the 256 most recent; a calibration sequence rarely has more.)
    Example: x = [5, 900, 7, 900], 900 outside, t0 = 0: 900 is visible from t = 0 on."""
    inside = torch.zeros(heads.cfg.vocab_size, dtype=torch.bool, device=ids.device)
    inside[heads.draft_vocab.to(ids.device)] = True
    outside = ~inside[ids]
    if not bool(outside.any()):
        return None
    uniq, inv = torch.unique(ids[outside], return_inverse=True)
    pos = torch.nonzero(outside).flatten()
    first = torch.full((uniq.numel(),), len(ids), dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, inv, pos, "amin")  # first position of each outside token
    w = heads.lm_rows(uniq)
    logits = (feats.to(w.dtype) @ w.T).float()  # (n, U)
    t = torch.arange(t0, t0 + feats.shape[0], device=ids.device)
    return logits.masked_fill(first[None, :] > t[:, None] + 1, float("-inf")), uniq


def sequence_ranks(backbone, heads, ids: torch.Tensor, plen: int, ranks: int, copy: CopyConfig | None = None,
                   depth: int = 0, want_entropy: bool = False, context_vocab: bool = False) -> SequenceRanks | None:
    """Ranks for one distilled sequence (None when its reply is too short). Position t's
    root is x[t+1] (the backbone's token), head k drafts x[t+1+k]; t0 = plen - 1. With
    ``context_vocab`` the candidates include the context's tokens outside the draft vocabulary."""
    K = heads.K
    ids = ids.to(backbone.device)
    T = len(ids)
    if T - plen < K + 2:
        return None
    out, feats = teacher_features(heads, backbone, ids[None])
    hidden = out.hidden
    t0 = max(plen - 1, 0)  # first position whose next token is a reply token
    tops = []  # tops[k-1]: (T-1-k-t0, ranks) head k's candidate ids at t = t0..
    for k in range(1, K + 1):
        f = feats[k - 1][0][t0:]
        logits, vocab_ids = heads.draft_logits(f), heads.draft_vocab
        extra = (_context_logits(heads, f, ids, t0) if context_vocab and vocab_ids is not None
                 and not getattr(heads, "own_lm_head", False) else None)
        if extra is not None:
            logits, vocab_ids = torch.cat([logits, extra[0]], -1), torch.cat([vocab_ids, extra[1]])
        top = logits.topk(ranks, dim=-1).indices
        tops.append(vocab_ids[top] if vocab_ids is not None else top)
    plain = [_rank_in(top, ids[t0 + k + 1:], ranks) for k, top in enumerate(tops, 1)]
    copied = None
    if copy is not None:
        copied = _copy_ranks(ids.tolist(), t0, [t.tolist() for t in tops], copy, max(depth, K), ranks)
    ent = None
    if want_entropy:
        ent = torch.cat([entropy(backbone.logits(h)) for h in hidden[0, t0:T - 2].split(256)]).cpu()
    return SequenceRanks(plain, copied, ent)


def rank_tables(backbone, heads, data_dir: str | Path, tokens: int, ranks: int,
                copy: CopyConfig | None = None, copy_depth: int = 0, split: str = "val",
                context_vocab: bool = False) -> tuple[list[list[float]], list[list[float]] | None]:
    """a[k][i] from teacher-forced held-out sequences (see module docstring): for the heads
    alone, and (``copy`` set) with the context copy ranked first, down to ``copy_depth``."""
    K = heads.K
    depth = max(copy_depth, K)
    plain, copied = _RankHistogram(K, ranks), _RankHistogram(depth, ranks) if copy else None
    seen = 0
    bar = tqdm(total=tokens, desc="acceptance", unit="tok")
    for ids, plen in _val_sequences(data_dir, split):
        if seen >= tokens:
            break
        r = sequence_ranks(backbone, heads, ids, plen, ranks, copy, depth, context_vocab=context_vocab)
        if r is None:
            continue
        plain.add(r.plain)
        if copied is not None:
            copied.add(r.copied)
        seen += len(ids) - plen
        bar.update(len(ids) - plen)
    bar.close()
    return plain.table(), copied.table() if copied is not None else None


def rank_table(backbone, heads, data_dir: str | Path, tokens: int, ranks: int) -> list[list[float]]:
    """The heads-alone table of ``rank_tables``."""
    return rank_tables(backbone, heads, data_dir, tokens, ranks)[0]


def _rank_in(top: torch.Tensor, target: torch.Tensor, ranks: int) -> torch.Tensor:
    """Rank of each target among its row of candidates (``ranks`` if absent).
    top: (n', ranks) candidate ids; target: (n,) with n <= n'."""
    top = top[:len(target)]
    hit = top == target[:, None]
    return torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(target, ranks))


def _copy_ranks(x: list[int], t0: int, tops: list[list[list[int]]], copy: CopyConfig,
                depth: int, ranks: int) -> list[torch.Tensor]:
    """Ranks of the true token when the context copy leads each candidate list.

    At position t the committed tokens are x[0..t] and the root is x[t+1] (both indexed);
    depth k's path is x[t+2..t+k] (teacher forcing) and its target is x[t+k+1]. Example:
    x = [1, 2, 3, 1, 2, ?], t = 3: root x[4] = 2, the tail (1, 2) was followed by 3, so
    depth 1's copy is 3. Depths past K have the copy as their only candidate.
    """
    index = NgramIndex(copy)
    index.extend(x[:t0 + 1])
    T = len(x)
    out: list[list[int]] = [[] for _ in range(depth)]
    for t in range(t0, T - 2):
        index.extend(x[t + 1:t + 2])
        for k in range(1, depth + 1):
            if t + k + 1 >= T:
                break
            tail = x[max(0, t + k + 1 - copy.max_n):t + k + 1]
            heads_ranked = tops[k - 1][t - t0] if k <= len(tops) else []
            cand = merge_candidates(index.lookup(tail), heads_ranked, ranks)
            target = x[t + k + 1]
            out[k - 1].append(cand.index(target) if target in cand else ranks)
    return [torch.tensor(r, dtype=torch.long) for r in out if r]


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
    from cadence.backbone import load_backbone
    from cadence.heads import load_heads
    from cadence.heads.io import decode_dtype

    if not cfg.heads:
        raise CadenceError("--heads DIR is required")
    backbone = backbone or load_backbone(cfg.model, cfg.dtype, cfg.device)
    heads = load_heads(cfg.heads, backbone, dtype=decode_dtype(backbone, cfg.heads_dtype))
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
    from cadence.latency import load_or_measure
    from cadence.profiles import measure_profiles, plot_frontiers, save_profiles
    from cadence.tree_policy import draft_seconds

    profiles = measure_profiles(backbone, heads, cfg.data, cfg.tasks, cfg.bins, cfg.profile_tokens, cfg.ranks,
                                copy, cfg.copy_depth, cfg.split, context_vocab=cfg.context_vocab > 0)
    path = save_profiles(cfg.heads, profiles, {"data": str(cfg.data), "split": cfg.split,
                                               "tokens_per_profile": cfg.profile_tokens,
                                               "context_vocab": cfg.context_vocab})
    latency = load_or_measure(backbone)
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
