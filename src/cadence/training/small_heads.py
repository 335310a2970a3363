"""``cadence train-clp`` and ``cadence train-confidence``: the small heads of the CLP and
confidence schedulers (``cadence.heads.small``), trained after the draft heads from
teacher-forced rollouts of those heads on self-distilled data (METHODS §5-6).

Rollout of one distilled sequence x_0..x_{T-1} (prompt of P tokens, reply = the
backbone's greedy output): one backbone forward gives h_t; the heads, teacher-forced,
give at each reply position t (t >= P-1, so the root x_{t+1} is a reply token) head k's
feature g_k(t) and top-1 draft d_k(t) for x_{t+1+k}, k = 1..K. Under teacher forcing
head k sees the true x_{t+1..t+k}, which equals the drafted chain exactly when drafts
1..k-1 were right, the only case in which draft k matters.

* CLP label at t: the longest prefix of heads 1..K whose top-1 equals the continuation,
  ``L(t) = max{l : d_k(t) = x_{t+1+k} for all k <= l}`` (``clp_labels``).
* Confidence target of draft k at t: ``min(1, p_B(x)/q(x))`` for the drafted token x,
  i.e. 1/0 agreement at T = 0; at T > 0 its expectation over x ~ q, ``sum_x min(p_B, q)``
  (``confidence_target``; lower variance than one draw, same mean).

Data: the store's train split for training; its val split for the held-out numbers
(while the store has no val shards yet, every 10th train sequence is held out instead,
and the output says so).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from cadence.backbone.load import load_backbone
from cadence.cliargs import add_fields, from_args
from cadence.errors import CadenceError
from cadence.heads import load_heads
from cadence.heads.base import teacher_features
from cadence.heads.io import KINDS
from cadence.heads.shipped import shipped_heads_dir
from cadence.heads.small import CLP, CLP_FILE, CONF_FILE, ConfidenceHead, save_small
from cadence.training.data import iter_sequences, load_manifest, read_shard

HOLDOUT_EVERY = 10  # fallback held-out split: every 10th train sequence, while there are no val shards


@dataclass
class SmallHeadConfig:
    """Settings shared by `cadence train-clp` and `cadence train-confidence`."""

    heads: str = field(default="", metadata={
        "help": "draft heads directory (or hydra | mtp | medusa: the heads shipped for --model); "
                "the small head is saved there unless --out is given"})
    data: str = field(default="data/selfdistill/smollm2", metadata={
        "help": "self-distillation store: train split to train on, val split to report on"})
    tokens: int = field(default=30000, metadata={"help": "training positions (reply tokens) to roll out"})
    val_tokens: int = field(default=6000, metadata={"help": "held-out positions to report on"})
    steps: int = field(default=400, metadata={"help": "optimizer steps"})
    lr: float = field(default=1e-2, metadata={"help": "Adam learning rate"})
    batch_size: int = field(default=4096, metadata={"help": "positions per step"})
    weight_decay: float = field(default=1e-4, metadata={"help": "AdamW weight decay"})
    seed: int = field(default=0, metadata={"help": "RNG seed (batches, initialisation)"})
    out: str = field(default="", metadata={"help": "directory to write into (default: the heads directory)"})
    model: str = field(default="smollm2", metadata={"help": "backbone"})
    dtype: str = field(default="auto", metadata={"help": "backbone dtype"})
    device: str = field(default="auto", metadata={"help": "backbone device"})


@dataclass
class ClpConfig(SmallHeadConfig):
    """Settings of `cadence train-clp`; CLI flags derive from these fields."""


@dataclass
class ConfidenceConfig(SmallHeadConfig):
    """Settings of `cadence train-confidence`; CLI flags derive from these fields."""

    tokens: int = field(default=40000, metadata={
        "help": "training positions (reply tokens) to roll out (fewer overfit: 15000 gave a worse Brier score "
                "than a constant on the shipped hydra heads)"})
    val_tokens: int = field(default=6000, metadata={"help": "held-out positions to report on"})
    steps: int = field(default=1500, metadata={"help": "optimizer steps"})
    lr: float = field(default=1e-3, metadata={"help": "Adam learning rate"})
    batch_size: int = field(default=2048, metadata={"help": "(position, depth) rows per step"})
    width: int = field(default=32, metadata={"help": "hidden width of the MLP"})
    temperature: float = field(default=0.0, metadata={
        "help": "sampling temperature of the targets: 0 = 1/0 agreement, > 0 = E_q[min(1, p/q)]"})
    threshold: float = field(default=0.95, metadata={
        "help": "confidence threshold to report precision / coverage at (the scheduler's --threshold)"})


# ---------------------------------------------------------------- labels and targets (pure)

def clp_labels(tops: torch.Tensor, ids: torch.Tensor, t0: int) -> torch.Tensor:
    """CLP labels for positions t0..t0+n-1.

    tops: (K, n) head k's top-1 draft at position t0+i for x_{t0+i+1+k}; ids: (T,) the
    sequence (the backbone's greedy continuation). Label = longest prefix of depths
    whose drafts are right. Example: ids = [5, 1, 2, 3, 4], t0 = 0, K = 2, n = 2:
    position 0 (root 1) needs 2, 3; position 1 (root 2) needs 3, 4; tops [[2, 9], [3, 4]]
    -> labels [2, 0] (position 1's depth 1 is wrong, so depth 2 does not count).
    """
    K, n = tops.shape
    targets = torch.stack([ids[t0 + 1 + k:t0 + 1 + k + n] for k in range(1, K + 1)])
    match = (tops == targets).long()
    return match.cumprod(0).sum(0)


def confidence_target(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float,
                      vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """P(draft accepted) per row: ``min(1, p(x)/q(x))`` of the drafted x.

    p_logits (n, V): the backbone at the draft's position; q_logits (n, V'): the head,
    over ``vocab_ids`` (V' ids; None = all V). At T = 0 both are point masses at their
    argmax, the draft is q's argmax, and the target is 1 if it is p's argmax else 0.
    At T > 0 the draft x ~ q, and the target is its expectation sum_x min(p(x), q(x)).
    """
    if temperature <= 0:
        draft = q_logits.argmax(-1)
        if vocab_ids is not None:
            draft = vocab_ids[draft]
        return (draft == p_logits.argmax(-1)).float()
    p = torch.softmax(p_logits.float() / temperature, -1)
    if vocab_ids is not None:
        p = p[:, vocab_ids]
    q = torch.softmax(q_logits.float() / temperature, -1)
    return torch.minimum(p, q).sum(-1).clamp(max=1.0)


# ---------------------------------------------------------------- rollouts

@dataclass
class Rollouts:
    h: torch.Tensor  # (n, d) backbone state that produced the root
    labels: torch.Tensor  # (n,) CLP labels 0..K
    g: torch.Tensor | None = None  # (n, K, d) head features (confidence only)
    logq: torch.Tensor | None = None  # (n, K) log q of each head's top-1 draft
    target: torch.Tensor | None = None  # (n, K) confidence targets
    sequences: int = 0

    @staticmethod
    def cat(parts: list["Rollouts"]) -> "Rollouts":
        if not parts:
            raise CadenceError("no usable sequences (each needs more than K+1 reply tokens)")
        cat = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        return Rollouts(cat("h"), cat("labels"), cat("g"), cat("logq"), cat("target"),
                        sum(p.sequences for p in parts))


@torch.inference_mode()
def rollout(backbone, heads, ids: torch.Tensor, plen: int, features: bool = False,
            temperature: float = 0.0) -> Rollouts | None:
    """Teacher-forced rollout of one sequence (module docstring); None if too short."""
    K = heads.K
    ids = ids.to(backbone.device)
    T = len(ids)
    t0 = max(plen - 1, 0)
    n = T - 1 - K - t0  # positions whose K targets all exist
    if n <= 0:
        return None
    out, feats = teacher_features(heads, backbone, ids[None])
    hidden = out.hidden
    vocab = heads.draft_vocab
    tops, logq, target, g = [], [], [], []
    for k in range(1, K + 1):
        f = feats[k - 1][0][t0:t0 + n]
        lg = heads.draft_logits(f)
        top = lg.argmax(-1)
        tops.append(vocab[top] if vocab is not None else top)
        if features:
            logq.append(torch.log_softmax(lg, -1).gather(-1, top[:, None])[:, 0])
            g.append(f.float())
            if temperature > 0:  # backbone at position t+k predicts x_{t+1+k}
                p_logits = backbone.logits(hidden[0, t0 + k:t0 + k + n])
                target.append(confidence_target(p_logits, lg, temperature, vocab))
    tops = torch.stack(tops)
    labels = clp_labels(tops, ids, t0)
    r = Rollouts(h=hidden[0, t0:t0 + n].float().cpu(), labels=labels.cpu(), sequences=1)
    if features:
        if temperature <= 0:
            targets = torch.stack([ids[t0 + 1 + k:t0 + 1 + k + n] for k in range(1, K + 1)])
            target = list((tops == targets).float())
        r.g = torch.stack(g, 1).cpu()
        r.logq = torch.stack(logq, 1).cpu()
        r.target = torch.stack(target, 1).cpu()
    return r


def split_sequences(data_dir: str | Path) -> tuple[list, list, str]:
    """(train, held-out) lists of (ids, prompt_len) iterators' sources, and how held-out
    was chosen."""
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    if manifest is None:
        raise CadenceError(f"{data_dir} has no manifest.json (make one with `cadence distill`)")
    shards = manifest["shards"]
    train_files = [data_dir / s["file"] for s in shards if s["split"] == "train"]
    val_files = [data_dir / s["file"] for s in shards if s["split"] == "val"]
    if not train_files:
        raise CadenceError(f"{data_dir} has no training shards")

    def seqs(files):
        for f in files:
            yield from iter_sequences(read_shard(f))

    if val_files:
        return seqs(train_files), seqs(val_files), "the store's val split"

    def every(files, keep):
        for i, item in enumerate(seqs(files)):
            if (i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1) == keep:
                yield item
    return (every(train_files, False), every(train_files, True),
            f"every {HOLDOUT_EVERY}th train sequence (the store has no val shards yet)")


def collect(backbone, heads, sequences, budget: int, desc: str, features: bool = False,
            temperature: float = 0.0) -> Rollouts:
    parts, seen = [], 0
    bar = tqdm(total=budget, desc=desc, unit="pos", file=sys.stderr)
    for ids, plen in sequences:
        if seen >= budget:
            break
        r = rollout(backbone, heads, ids, plen, features, temperature)
        if r is None:
            continue
        parts.append(r)
        seen += len(r.labels)
        bar.update(len(r.labels))
    bar.close()
    return Rollouts.cat(parts)


# ---------------------------------------------------------------- training

def _distribution(labels: torch.Tensor, K: int) -> list[float]:
    counts = torch.bincount(labels.long(), minlength=K + 1).float()
    return [round(float(c), 4) for c in counts / counts.sum().clamp(min=1)]


def train_clp_on(train: Rollouts, val: Rollouts, K: int, cfg: SmallHeadConfig):
    """Fit Linear(d -> K+1) with cross-entropy; returns (CLP on raw h, metrics)."""
    torch.manual_seed(cfg.seed)
    d = train.h.shape[1]
    mean, std = train.h.mean(0), train.h.std(0).clamp(min=1e-4)
    x, y = (train.h - mean) / std, train.labels.long()
    clp = CLP(d, K)
    opt = torch.optim.AdamW(clp.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    bar = tqdm(range(cfg.steps), desc="train-clp", unit="step", file=sys.stderr)
    for _ in bar:
        idx = torch.randint(0, len(y), (min(cfg.batch_size, len(y)),), generator=gen)
        loss = torch.nn.functional.cross_entropy(clp(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
    clp.fold_normalisation(mean, std)
    clp.eval()
    return clp, clp_metrics(clp, train, val, K)


@torch.no_grad()
def clp_metrics(clp, train: Rollouts, val: Rollouts, K: int) -> dict:
    pred = clp(val.h).argmax(-1)
    y = val.labels.long()
    majority = int(torch.bincount(train.labels.long(), minlength=K + 1).argmax())
    return {
        "heldout_accuracy": round(float((pred == y).float().mean()), 4),
        "majority_class_accuracy": round(float((y == majority).float().mean()), 4),
        "train_accuracy": round(float((clp(train.h).argmax(-1) == train.labels).float().mean()), 4),
        "label_distribution_train": _distribution(train.labels, K),
        "label_distribution_heldout": _distribution(val.labels, K),
        "predicted_distribution_heldout": _distribution(pred, K),
        # over-prediction commits wrong tokens in the unverified mode
        "heldout_over_predicted": round(float((pred > y).float().mean()), 4),
        "heldout_mean_label": round(float(y.float().mean()), 4),
        "heldout_mean_predicted": round(float(pred.float().mean()), 4),
        # tokens per step of the unverified mode if every predicted draft were committed:
        # 1 + pred; of those, correct up to min(pred, label)
        "heldout_correct_tokens_committed": round(float(torch.minimum(pred, y).float().mean()), 4),
    }


def train_confidence_on(train: Rollouts, val: Rollouts, K: int, cfg: ConfidenceConfig):
    """Fit the confidence MLP with binary cross-entropy on soft targets."""
    torch.manual_seed(cfg.seed)
    d = train.h.shape[1]
    head = ConfidenceHead(d, K, cfg.width)
    x, t = _conf_rows(train, K), train.target.reshape(-1)
    head.mean.copy_(x.mean(0))
    head.std.copy_(x.std(0).clamp(min=1e-4))
    opt = torch.optim.AdamW(head.mlp.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    bar = tqdm(range(cfg.steps), desc="train-confidence", unit="step", file=sys.stderr)
    for _ in bar:
        idx = torch.randint(0, len(t), (min(cfg.batch_size, len(t)),), generator=gen)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head.logits(x[idx]), t[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
    head.eval()
    return head, confidence_metrics(head, val, K, cfg.threshold)


def _conf_rows(r: Rollouts, K: int) -> torch.Tensor:
    n = len(r.labels)
    k = torch.arange(1, K + 1).repeat(n)
    h = r.h.repeat_interleave(K, 0)
    return ConfidenceHead.inputs(h, r.g.reshape(n * K, -1), k, r.logq.reshape(-1), K)


@torch.no_grad()
def confidence_metrics(head, val: Rollouts, K: int, threshold: float) -> dict:
    n = len(val.labels)
    c = torch.sigmoid(head.logits(_conf_rows(val, K))).reshape(n, K)
    t = val.target
    hard = (t > 0.5).float()
    cum = c.cumprod(1)
    passed = cum >= threshold  # the scheduler's rule: cumulative confidence of drafts 1..k
    right = hard.cumprod(1).bool()  # drafts 1..k all accepted
    out = {
        "heldout_rows": n * K,
        "heldout_accept_rate_by_depth": [round(float(v), 4) for v in t.mean(0)],
        "heldout_brier": round(float(((c - t) ** 2).mean()), 4),
        "heldout_brier_constant": round(float(((t.mean(0) - t) ** 2).mean()), 4),
        "heldout_accuracy_at_0.5": round(float(((c > 0.5).float() == hard).float().mean()), 4),
        "heldout_auc": round(_auc(c.reshape(-1), hard.reshape(-1)), 4),
        "threshold": threshold,
        # share of chain drafts (depth k) whose cumulative confidence passes, and how many of those are right
        "heldout_coverage_by_depth": [round(float(v), 4) for v in passed.float().mean(0)],
        "heldout_precision_by_depth": [round(float(right[:, k][passed[:, k]].float().mean()), 4)
                                       if passed[:, k].any() else None for k in range(K)],
    }
    return out


def _auc(score: torch.Tensor, y: torch.Tensor) -> float:
    pos, neg = score[y > 0.5], score[y <= 0.5]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    ranks = torch.argsort(torch.argsort(torch.cat([pos, neg]))).float() + 1
    return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


# ---------------------------------------------------------------- commands

def _load(cfg: SmallHeadConfig):
    if not cfg.heads:
        raise CadenceError("--heads DIR is required (a directory made by `cadence train`, or hydra | mtp | medusa)")
    backbone = load_backbone(cfg.model, cfg.dtype, cfg.device)
    path = Path(cfg.heads)
    if not path.is_dir() and cfg.heads in KINDS:
        path = shipped_heads_dir(backbone, cfg.heads)
        if path is None:
            raise CadenceError(f"no {cfg.heads} heads are shipped for {backbone.name}")
    heads = load_heads(path, backbone)
    return backbone, heads, path


def run(cfg: SmallHeadConfig, kind: str) -> dict:
    """Train a CLP (``kind="clp"``) or confidence head; save it; return the summary."""
    t_start = time.perf_counter()
    backbone, heads, heads_dir = _load(cfg)
    features = kind == CONF_FILE
    temperature = getattr(cfg, "temperature", 0.0)
    train_seqs, val_seqs, held_out = split_sequences(cfg.data)
    train = collect(backbone, heads, train_seqs, cfg.tokens, "rollouts (train)", features, temperature)
    val = collect(backbone, heads, val_seqs, cfg.val_tokens, "rollouts (held-out)", features, temperature)
    if kind == CLP_FILE:
        module, metrics = train_clp_on(train, val, heads.K, cfg)
    else:
        module, metrics = train_confidence_on(train, val, heads.K, cfg)
    info = {"heads": str(heads_dir), "heads_kind": heads.cfg.kind, "backbone": backbone.name,
            "data": str(cfg.data), "train_positions": len(train.labels), "train_sequences": train.sequences,
            "heldout_positions": len(val.labels), "heldout_sequences": val.sequences, "held_out": held_out,
            "settings": {k: v for k, v in asdict(cfg).items() if k not in ("heads", "data", "out")},
            **metrics, "seconds": round(time.perf_counter() - t_start, 1)}
    out = Path(cfg.out) if cfg.out else Path(heads_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = save_small(module, out, kind, info)
    return {"path": str(path), "params": module.num_params(), **info}


def register(sub) -> None:
    p = sub.add_parser("train-clp", help="train the collocation-length predictor of --scheduler clp / clp-unverified",
                       description="Linear(d_model -> K+1) on the backbone state, labelled with how many of the "
                                   "heads' top-1 drafts are right (teacher-forced rollouts on distilled data). "
                                   "Writes clp.safetensors + clp.json beside the heads.")
    add_fields(p, ClpConfig)
    p.set_defaults(func=lambda args: _run_command(args, ClpConfig, "clp"))
    p = sub.add_parser("train-confidence", help="train the confidence head of --scheduler confidence (lossy)",
                       description="A small MLP on [h_t ; head feature g_k ; depth ; log q] predicting "
                                   "P(draft k accepted), target min(1, p_B/q) (agreement at T=0). Writes "
                                   "confidence.safetensors + confidence.json beside the heads.")
    add_fields(p, ConfidenceConfig)
    p.set_defaults(func=lambda args: _run_command(args, ConfidenceConfig, "confidence"))


def _run_command(args, cls, kind: str) -> int:
    cfg = from_args(cls, args)
    summary = run(cfg, kind)
    _report(summary, kind)
    print(json.dumps(summary))
    return 0


def _report(s: dict, kind: str) -> None:
    lines = [f"{kind}: {s['params']} parameters -> {s['path']}",
             f"  data: {s['train_positions']} train positions ({s['train_sequences']} sequences), "
             f"{s['heldout_positions']} held-out ({s['heldout_sequences']} sequences; {s['held_out']})"]
    if kind == "clp":
        lines += [f"  label distribution (L = 0..K) train {s['label_distribution_train']}, "
                  f"held-out {s['label_distribution_heldout']}",
                  f"  held-out accuracy {s['heldout_accuracy']:.3f} (majority class {s['majority_class_accuracy']:.3f}), "
                  f"predicted {s['predicted_distribution_heldout']}, over-predicted {s['heldout_over_predicted']:.3f}"]
    else:
        lines += [f"  acceptance by depth {s['heldout_accept_rate_by_depth']}; held-out AUC {s['heldout_auc']:.3f}, "
                  f"Brier {s['heldout_brier']:.4f} (constant {s['heldout_brier_constant']:.4f})",
                  f"  at threshold {s['threshold']}: coverage by depth {s['heldout_coverage_by_depth']}, "
                  f"precision {s['heldout_precision_by_depth']}"]
    print("\n".join(lines), file=sys.stderr)
    if math.isnan(s.get("heldout_auc", 0.0)):
        print("  (AUC undefined: the held-out targets are all one class)", file=sys.stderr)
