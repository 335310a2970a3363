"""Settings of a head-training run: ``TrainConfig`` (CLI flags derive from its fields), their
checks (``validate``), the fingerprint a checkpoint must match to be resumed, and the heads
an ``--init-from`` run starts from (``init_heads``: loaded, checked, grown to ``--num-layers``).

Does not know: the training loop (``trainer``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from cadence.errors import CadenceError
from cadence.heads.io import KINDS, load_heads
from cadence.heads.tables import DraftPolicy
from cadence.training import losses as L


@dataclass
class TrainConfig:
    """Settings of one head-training run; CLI flags derive from these fields."""

    data: str = field(default="data/selfdistill/smollm2", metadata={
        "help": "distilled data directory (manifest.json + shards); only shards in its manifest are read. "
                "Default: the self-distilled store, which beat reference replies (docs/ablations.md)"})
    out: str = field(default="runs/train", metadata={
        "help": "output directory: checkpoint.pt, train_log.jsonl, summary.json, heads/"})
    kind: str = field(default="hydra", metadata={"help": "head type: medusa | hydra | mtp | eagle | eagle3 | mtp-attn"})
    num_heads: int = field(default=3, metadata={
        "help": "K, heads drafting tokens 2..K+1 after the backbone's own"})
    num_layers: int = field(default=1, metadata={
        "help": "eagle: decoder layers in the drafter; with --init-from a drafter of fewer layers, the "
                "added ones start as the identity (training continues from what it drafts)"})
    taps: tuple[int, ...] = field(default=(), metadata={
        "help": "eagle: backbone decoder layers (1-based) the drafter also reads at level 1, EAGLE-3-style "
                "feature fusion, e.g. --taps 3 15; with --init-from a drafter without taps, their inputs "
                "start at zero weight. Cached with the hidden states; such eagle drafters are not exportable. eagle3: "
                "the low / mid / high layers its fc fuses (default 2, L/2, L-3 of L layers)"})
    loss: str = field(default="ce", metadata={"help": "ce | kl | ce+adamtp | kl+adamtp"})
    target: str = field(default="token", metadata={
        "help": "ce target: token (the data token) | backbone (backbone argmax at that position)"})
    teacher: str = field(default="full", metadata={
        "help": "kl teacher: full (backbone LM head on its hidden "
                "state) | topk (logits stored in the shards)"})
    loss_lambda: float = field(default=0.8, metadata={"help": "head k's loss is weighted loss_lambda^(k-1)"})
    adamtp_window: int = field(default=16, metadata={
        "help": "AdaMTP: trailing window of entropies for the running mean / std"})
    adamtp_c: float = field(default=2.0, metadata={"help": "AdaMTP: boundary where entropy > mean + c * std"})
    steps: int = field(default=1000, metadata={"help": "optimizer steps in total"})
    batch_size: int = field(default=4, metadata={"help": "packed rows per micro-batch and process"})
    max_len: int = field(default=512, metadata={
        "help": "tokens per packed row; longer sequences are truncated"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (AdamW)"})
    min_lr_ratio: float = field(default=0.0, metadata={"help": "cosine decay ends at lr * min_lr_ratio"})
    warmup_steps: int = field(default=50, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    grad_clip: float = field(default=1.0, metadata={"help": "max gradient norm (0 = off)"})
    bf16: bool = field(default=False, metadata={"help": "bf16 autocast for heads and loss (mixed precision)"})
    feature_loss: float = field(default=0.0, metadata={
        "help": "eagle: weight of the feature regression (smooth L1 of depth-k features to the backbone's "
                "hidden state at t+k, EAGLE's second loss); 0 = token cross-entropy only"})
    loss_chunk: int = field(default=1024, metadata={
        "help": "positions per LM-head chunk in the loss (bounds logits memory)"})
    eval_every: int = field(default=200, metadata={
        "help": "evaluate on the held-out 'val' shards every N steps (0 = only at the end)"})
    eval_rows: int = field(default=0, metadata={"help": "held-out packed rows per evaluation (0 = all)"})
    save_every: int = field(default=100, metadata={
        "help": "write checkpoint.pt every N steps (and at the end)"})
    log_every: int = field(default=10, metadata={"help": "write a train_log.jsonl record every N steps"})
    stop_after: int = field(default=0, metadata={
        "help": "stop (with a checkpoint) after this many steps in this invocation; 0 = run to the end"})
    resume: bool = field(default=True, metadata={
        "help": "resume from out/checkpoint.pt when it exists (--no-resume refuses to touch it)"})
    cache_hidden: str = field(default="", metadata={
        "help": "hidden-state cache directory: built (or extended) once, then no backbone forward"})
    cache_dtype: str = field(default="bfloat16", metadata={
        "help": "dtype of cached hidden states: bfloat16 | float16 | float32"})
    cache_only: bool = field(default=False, metadata={
        "help": "build or extend --cache-hidden and exit without training"})
    draft_vocab: int = field(default=0, metadata={
        "help": "train (ce) and draft over the N most frequent "
                "reply tokens of the data; 0 = full vocabulary"})
    context_vocab: bool = field(default=True, metadata={"help": "ce with a draft vocabulary: train targets "
                                "outside it that appeared earlier in the sequence (decoding's --context-vocab)"})
    draft_vocab_from: str = field(default="", metadata={
        "help": "data directory whose training shards pick the draft vocabulary (default: --data); "
                "lets runs on different data share one vocabulary"})
    init_from: str = field(default="", metadata={
        "help": "heads directory to start from (same --kind and --num-heads; its draft vocabulary is kept): "
                "continue shipped heads on a grown store instead of starting over"})
    eval_target: str = field(default="auto", metadata={
        "help": "held-out target: auto (the ce target) | token (the data token) | backbone (backbone argmax)"})
    seed: int = field(default=0, metadata={"help": "data order and head initialisation"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    model: str = field(default="smollm2", metadata={"help": "backbone (frozen)"})
    dtype: str = field(default="auto", metadata={"help": "backbone dtype"})
    device: str = field(default="auto", metadata={
        "help": "auto | cpu (under accelerate launch, the process's device)"})


# Fields that may change between a run and its resumption.
_RESUMABLE = ("out", "eval_every", "eval_rows", "save_every", "log_every", "stop_after", "resume",
              "progress", "device", "cache_hidden", "cache_only", "eval_target")


def fingerprint(cfg: TrainConfig, world_size: int) -> dict:
    d = asdict(cfg)
    for k in _RESUMABLE:
        d.pop(k)
    # fields added later are left out when unset, so older checkpoints resume (--no-context-vocab)
    d = {k: v for k, v in d.items() if v or k not in ("draft_vocab_from", "init_from", "context_vocab", "taps")}
    if "taps" in d:
        d["taps"] = list(d["taps"])
    if d.get("num_layers") == 1:  # added later too: the default stays out
        d.pop("num_layers")
    d["uses_cache"] = bool(cfg.cache_hidden)
    d["world_size"] = world_size
    d["data"] = str(Path(cfg.data).resolve())
    return d


def validate(cfg: TrainConfig) -> None:
    if cfg.kind not in KINDS:
        raise CadenceError(f"unknown head type {cfg.kind!r}; choose one of {', '.join(KINDS)}")
    L.parse_loss(cfg.loss)
    if cfg.target not in L.TARGETS:
        raise CadenceError(f"unknown target {cfg.target!r}; choose one of {', '.join(L.TARGETS)}")
    if cfg.eval_target not in ("auto",) + L.TARGETS:
        raise CadenceError(f"unknown eval target {cfg.eval_target!r}; choose auto, {', '.join(L.TARGETS)}")
    if cfg.teacher not in L.TEACHERS:
        raise CadenceError(f"unknown KL teacher {cfg.teacher!r}; choose one of {', '.join(L.TEACHERS)}")
    for name in ("num_heads", "steps", "batch_size", "grad_accum", "loss_chunk", "adamtp_window",
                 "save_every", "log_every"):
        if getattr(cfg, name) < 1:
            raise CadenceError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("eval_every", "eval_rows", "stop_after", "warmup_steps"):
        if getattr(cfg, name) < 0:
            raise CadenceError(f"--{name.replace('_', '-')} must not be negative")
    if cfg.num_layers < 1 or (cfg.num_layers > 1 and cfg.kind != "eagle"):
        raise CadenceError("--num-layers must be at least 1, and more than 1 only for eagle heads")
    if cfg.taps and cfg.kind not in ("eagle", "eagle3"):
        raise CadenceError("--taps is for eagle heads only (eagle, eagle3)")
    if cfg.kind == "eagle3" and L.parse_loss(cfg.loss)[0] != "ce":
        raise CadenceError("eagle3 trains its own LM head with --loss ce (or ce+adamtp): a kl teacher through "
                           "the backbone's LM head does not fit a drafter with its own head")
    if list(cfg.taps) != sorted(set(cfg.taps)) or any(j < 1 for j in cfg.taps):
        raise CadenceError(f"--taps {list(cfg.taps)} must be increasing decoder layers (1-based)")
    if cfg.max_len < cfg.num_heads + 3:
        raise CadenceError("--max-len is too short for this many heads")
    if cfg.lr <= 0:
        raise CadenceError("--lr must be positive")
    if cfg.draft_vocab and L.parse_loss(cfg.loss)[0] == "kl" and cfg.teacher != "full":
        raise CadenceError("--draft-vocab works with the ce loss and with kl --teacher full "
                           "(the teacher renormalised over the draft vocabulary)")
    if cfg.cache_only and not cfg.cache_hidden:
        raise CadenceError("--cache-only needs --cache-hidden DIR")
    if cfg.init_from and (cfg.draft_vocab or cfg.draft_vocab_from):
        raise CadenceError("--init-from keeps the draft vocabulary of its heads: drop --draft-vocab / "
                           "--draft-vocab-from")


def init_heads(cfg: TrainConfig, backbone):
    """The heads saved in ``cfg.init_from`` (weights and draft vocabulary; not their calibration,
    which the new weights make stale), checked to be the kind and count this run trains."""
    heads = load_heads(cfg.init_from, backbone)
    if (heads.cfg.kind, heads.cfg.num_heads) != (cfg.kind, cfg.num_heads):
        raise CadenceError(f"--init-from {cfg.init_from} holds {heads.cfg.num_heads} {heads.cfg.kind} heads; "
                           f"this run trains {cfg.num_heads} {cfg.kind} heads")
    have = heads.cfg.num_layers
    if cfg.num_layers < have:
        raise CadenceError(f"--init-from {cfg.init_from} has {have} layers; --num-layers {cfg.num_layers} "
                           "would drop some (layers can be added, not removed)")
    if cfg.num_layers > have:
        heads.add_layers(cfg.num_layers - have)
    if list(cfg.taps) != list(heads.cfg.taps):
        if heads.cfg.taps:
            raise CadenceError(f"--init-from {cfg.init_from} reads taps {heads.cfg.taps}; --taps "
                               f"{list(cfg.taps)} differs (taps can be added to a drafter without them, not changed)")
        heads.add_taps(list(cfg.taps))
    heads.policy = DraftPolicy()
    return heads
