"""Train draft heads on a frozen backbone from self-distilled shards.

Knows: the training loop (AdamW, linear warm-up + cosine decay, gradient accumulation,
optional bf16 autocast), ``accelerate`` for DDP/DeepSpeed/FSDP launches, periodic held-out
evaluation, atomic checkpoints and exact resuming, the training log, and the final
``save_heads``. Losses live in ``losses``, rows and features in ``batches``, the hidden
state cache in ``hidden_cache``, the checkpoint format, RNG state and log file in ``run_files``.

Only the heads are trained and only they are handed to ``accelerator.prepare``; the
backbone (and its embedding / LM head, which the heads share) stays frozen and unwrapped.

Output directory::

    checkpoint.pt      heads, optimizer, scheduler, step, RNG, config (one file, atomic)
    train_log.jsonl    one JSON record per log step ("kind": "train") and evaluation ("eval")
    summary.json       throughput, peak memory, final held-out accuracy
    heads/             the trained heads (save_heads), written when training finishes
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, set_seed
from torch import nn
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm

from cadence.backbone.load import load_backbone
from cadence.errors import CadenceError
from cadence.heads.eagle3 import default_taps
from cadence.heads.io import ATTENTION_KINDS, head_class, new_heads, save_heads
from cadence.system.atomic import atomic_write, atomic_write_json
from cadence.training import heap, hidden_cache, losses as L
from cadence.training.batches import collate, Corpus, pack, RowDataset, segments, to_batch
from cadence.training.data import load_manifest
from cadence.training.draft_vocab import choose_draft_vocab, coverage, vocab_map
from cadence.training.run_files import (
    CHECKPOINT, CKPT_FORMAT, diff, load_checkpoint, LOG, Log, peak_memory_mib, rng_state, set_rng_state,
    trim_log, Window,
)
from cadence.training.train_config import fingerprint, init_heads, TrainConfig, validate  # noqa: F401 (TrainConfig: re-exported)


class _Trainable(nn.Module):
    """What accelerate wraps: the heads, with forward = teacher-forced features."""

    def __init__(self, heads):
        super().__init__()
        self.heads = heads

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, seg: torch.Tensor | None = None,
                taps: torch.Tensor | None = None) -> list[torch.Tensor]:
        if taps is not None:  # heads that read the backbone's tapped layers (eagle)
            return self.heads.train_features(hidden, ids, seg, taps=taps)
        if getattr(self.heads, "attends", False):  # attention stays inside each packed sequence
            return self.heads.train_features(hidden, ids, seg)
        return self.heads.train_features(hidden, ids)


@dataclass
class TrainResult:
    status: str  # "finished" | "stopped"
    step: int
    summary: dict
    heads: object  # the trained (unwrapped) heads


def _shard_lists(manifest: dict) -> dict[str, list[str]]:
    return {split: [s["file"] for s in manifest["shards"] if s.get("split", "train") == split]
            for split in ("train", "val")}


def train(cfg: TrainConfig, backbone=None, accelerator=None) -> TrainResult:
    """Train (or resume training) heads as ``cfg`` says; see the module docstring."""
    heap.bound_heap()  # the C heap otherwise grows every step (see cadence.training.heap)
    validate(cfg)
    run = _Run(cfg, backbone, accelerator)
    if run.cached_only:
        return TrainResult("cached", 0, {"cache": str(cfg.cache_hidden), "shards": len(run.files)}, None)
    status = run.loop()
    return run.finish(status)


def _make_accelerator(cfg: TrainConfig):
    if AcceleratorState._shared_state and PartialState().num_processes == 1:
        # a second run in one process (tests, notebooks) may use another mixed precision
        AcceleratorState._reset_state()
    return Accelerator(cpu=cfg.device == "cpu", mixed_precision="bf16" if cfg.bf16 else "no",
                       gradient_accumulation_steps=cfg.grad_accum)


def _eval_target(cfg: TrainConfig, need_argmax: bool) -> str:
    """The held-out target: ``cfg.eval_target``, or (auto) the ce target when it is the argmax."""
    if cfg.eval_target != "auto":
        return cfg.eval_target
    return "backbone" if need_argmax else "token"


class _Run:
    """One training run, split into setup / data / step / eval / checkpoint / finish.

    ``train`` calls them in that order; the attributes are the state the old single
    function kept in local variables (step, tokens_done, train_seconds, ...).
    """

    def __init__(self, cfg: TrainConfig, backbone=None, accelerator=None):
        self.cfg = cfg
        self.accelerator = accelerator if accelerator is not None else _make_accelerator(cfg)
        self.main = self.accelerator.is_main_process
        self.world = self.accelerator.num_processes
        self.out = Path(cfg.out)
        self.data_dir = Path(cfg.data)
        self._resume_point()
        self._setup_backbone(backbone)
        self._load_data()
        if self.cached_only:
            return
        self._setup_model()
        self._setup_rows()
        self._setup_loss()
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            trim_log(self.out / LOG, self.step)
        self.log = Log(self.out / LOG, self.main)

    # ------------------------------------------------------------ setup

    def _resume_point(self) -> None:
        """The checkpoint to resume from (checked against the settings) and the shard lists."""
        cfg = self.cfg
        manifest = load_manifest(self.data_dir)
        if manifest is None:
            raise CadenceError(f"{self.data_dir} has no manifest.json "
                               f"(make one with `cadence distill --out {self.data_dir}`)")
        self.ckpt_path = self.out / CHECKPOINT
        self.ckpt = None
        self.fp = fingerprint(cfg, self.world)
        if self.ckpt_path.exists() and not cfg.cache_only:
            if not cfg.resume:
                raise CadenceError(f"{self.out} already holds a checkpoint; pass --resume or use a new --out")
            self.ckpt = load_checkpoint(self.ckpt_path)
            if self.ckpt["config"] != self.fp:
                raise CadenceError(f"{self.ckpt_path} was written with other settings "
                                   f"{diff(self.ckpt['config'], self.fp)}; "
                                   "resume with the same settings or use a new --out")
            self.shards = self.ckpt["shards"]  # the data set as it was when training started
        else:
            self.shards = _shard_lists(manifest)
        if not self.shards["train"]:
            raise CadenceError(f"{self.data_dir} has no training shards yet")

    def _setup_backbone(self, backbone) -> None:
        cfg = self.cfg
        set_seed(cfg.seed)
        if backbone is None:
            backbone = load_backbone(cfg.model, cfg.dtype, str(self.accelerator.device))
        backbone.requires_grad_(False)
        self.backbone = backbone
        if cfg.kind == "eagle3" and not cfg.taps:  # its fc fuses low / mid / high layers by default

            self.cfg = cfg = replace(cfg, taps=tuple(default_taps(int(backbone.config.num_hidden_layers))))
        base_loss, adamtp = L.parse_loss(cfg.loss)
        self.need_argmax = (base_loss == "ce" and cfg.target == "backbone") or cfg.eval_target == "backbone"
        self.eval_target = _eval_target(cfg, base_loss == "ce" and cfg.target == "backbone")
        self.boundary = (cfg.adamtp_window, cfg.adamtp_c) if adamtp else None
        self.use_topk = base_loss == "kl" and cfg.teacher == "topk"

    def _load_data(self) -> None:
        """Corpora of both splits and (``--cache-hidden``) the hidden-state cache."""
        cfg, shards = self.cfg, self.shards
        self.train_corpus = Corpus(self.data_dir, shards["train"], self.backbone.vocab_size)
        self.val_corpus = Corpus(self.data_dir, shards["val"], self.backbone.vocab_size)
        if self.use_topk and not (self.train_corpus.has_topk
                                  and (not self.val_corpus.seqs or self.val_corpus.has_topk)):
            raise CadenceError(f"teacher 'topk' needs shards with top-k logits; {self.data_dir} was distilled "
                               "without --topk-logits (use --teacher full)")
        self.cache, self.cached_only = None, False
        self.files = shards["train"] + shards["val"]
        if cfg.cache_hidden:
            if self.main:
                with heap.heap_threshold():  # the build's blocks come from the heap and are reused
                    hidden_cache.build_cache(cfg.cache_hidden, self.backbone, self.data_dir, self.files, dtype=cfg.cache_dtype,
                                progress=cfg.progress, taps=tuple(cfg.taps))
            self.accelerator.wait_for_everyone()
            self.cache = hidden_cache.open_cache(cfg.cache_hidden, self.backbone, self.data_dir, self.files, tuple(cfg.taps))
            self.cached_only = cfg.cache_only

    def _setup_model(self) -> None:
        """Heads, draft vocabulary, optimizer, LR schedule; state from the checkpoint."""
        cfg, accelerator = self.cfg, self.accelerator
        heads = init_heads(cfg, self.backbone) if cfg.init_from else new_heads(
            cfg.kind, self.backbone, cfg.num_heads, num_layers=cfg.num_layers, taps=list(cfg.taps))
        self.vocab_map = None
        if cfg.init_from and heads.draft_vocab is not None:
            self.vocab_map = vocab_map(heads.draft_vocab, self.backbone.vocab_size)
            heads.draft_vocab_coverage = coverage(heads.draft_vocab, self.data_dir, self.shards["train"],
                                                  self.backbone.vocab_size)
        elif cfg.draft_vocab:
            vocab_dir, files = self.data_dir, self.shards["train"]
            if cfg.draft_vocab_from:
                vocab_dir = Path(cfg.draft_vocab_from)
                vm = load_manifest(vocab_dir)
                if vm is None:
                    raise CadenceError(f"--draft-vocab-from {vocab_dir} has no manifest.json")
                files = _shard_lists(vm)["train"]
            self.vocab_map = choose_draft_vocab(cfg.draft_vocab, heads, self.backbone, vocab_dir, files)
        heads.train()
        model = _Trainable(heads)
        optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: L.lr_lambda(s, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.inner = accelerator.unwrap_model(self.model).heads

        # DeepSpeed / FSDP may shard parameters and optimizer state: their checkpoints go through
        # accelerator.save_state into a step-named directory that checkpoint.pt then points to.
        self.sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
        self.step, self.tokens_done, self.train_seconds = 0, 0, 0.0
        ckpt = self.ckpt
        if ckpt is not None:
            if ckpt.get("state_dir"):
                if not self.sharded:
                    raise CadenceError(f"{self.ckpt_path} was written by a DeepSpeed/FSDP run; "
                                       "resume it the same way")
                accelerator.load_state(str(self.out / ckpt["state_dir"]))
            else:
                if self.sharded:
                    raise CadenceError(f"{self.ckpt_path} was written without DeepSpeed/FSDP; "
                                       "resume it the same way")
                self.inner.load_state_dict(ckpt["heads"])
                self.optimizer.load_state_dict(ckpt["optimizer"])
            self.sched.load_state_dict(ckpt["scheduler"])
            self.step, self.tokens_done, self.train_seconds = ckpt["step"], ckpt["tokens"], ckpt["train_seconds"]
            set_rng_state(ckpt["rng"])

    def _setup_rows(self) -> None:
        """Packed rows of both splits and their datasets."""
        cfg = self.cfg
        whole = cfg.kind in ATTENTION_KINDS  # attention heads see the whole prompt, as when decoding
        self.train_rows = pack(segments(self.train_corpus, cfg.num_heads, cfg.max_len, whole), cfg.max_len,
                               seed=cfg.seed)
        self.val_rows = pack(segments(self.val_corpus, cfg.num_heads, cfg.max_len, whole), cfg.max_len, seed=None)
        if cfg.eval_rows:
            self.val_rows = self.val_rows[:cfg.eval_rows]
        self.rows_per_step = self.world * cfg.batch_size * cfg.grad_accum
        self.steps_per_epoch = len(self.train_rows) // self.rows_per_step
        if self.steps_per_epoch == 0:
            raise CadenceError(f"too little training data: {len(self.train_rows)} packed rows, but one step "
                               f"needs {self.rows_per_step} (processes x batch size x grad accumulation)")
        self.train_ds = RowDataset(self.train_corpus, self.train_rows, self.cache, self.need_argmax,
                                   self.boundary, self.use_topk, tuple(cfg.taps))
        self.val_ds = RowDataset(self.val_corpus, self.val_rows, self.cache, self.need_argmax,
                                 self.boundary, self.use_topk, tuple(cfg.taps))

    def _setup_loss(self) -> None:
        """The loss spec, the frozen LM head the loss uses, and the evaluation LM head."""
        cfg, dev, inner, backbone = self.cfg, self.accelerator.device, self.inner, self.backbone
        vocab_map = self.vocab_map
        sub = vocab_map is not None  # a draft vocabulary (and, with it, the context vocabulary)
        own = getattr(inner, "own_lm_head", False)  # eagle3: its own norm and LM head, trained with it
        self.spec = L.LossSpec(cfg.loss, cfg.target, cfg.teacher, cfg.loss_lambda, cfg.loss_chunk,
                               vocab_map.to(dev) if sub else None, cfg.context_vocab and sub and not own,
                               backbone.lm_head.weight.detach().to(dev) if sub and not own else None)
        # the frozen LM head: an nn.Linear takes the fused loss path (see losses.fused_loss)
        if own:  # a callable: the checkpointed path, whose gradient reaches the drafter's head
            loss_head = self.eval_lm = inner.draft_logits
        elif vocab_map is not None:
            loss_head = nn.Linear(backbone.hidden_size, len(inner.draft_vocab), bias=False).to(dev)
            loss_head.weight.data = backbone.lm_head.weight.detach()[inner.draft_vocab.to(dev)]
            loss_head.weight.requires_grad_(False)
            self.eval_lm = lambda f: loss_head(f.to(loss_head.weight.dtype)).float()  # noqa: E731
        else:
            loss_head = backbone.lm_head if isinstance(backbone.lm_head, nn.Linear) else inner.lm_logits
            self.eval_lm = inner.lm_logits
        self.loss_head = loss_head
        self.feature_kw = dict(backbone=None if self.cache is not None else backbone,
                               need_argmax=self.need_argmax, boundary=self.boundary, taps=tuple(cfg.taps))

    # ------------------------------------------------------------ eval / checkpoint

    def evaluate(self) -> dict | None:
        """Held-out accuracies and expected tau on the val rows (reduced over processes)."""
        if not len(self.val_ds):
            return None
        cfg, accelerator, model = self.cfg, self.accelerator, self.model
        model.eval()
        counts = None
        with torch.no_grad(), accelerator.autocast():
            mine = list(range(accelerator.process_index, len(self.val_ds), self.world))
            for i in range(0, len(mine), cfg.batch_size):
                idx = mine[i:i + cfg.batch_size]
                batch = to_batch(collate([self.val_ds[j] for j in idx]), accelerator.device, **self.feature_kw)
                feats = model(batch.hidden, batch.ids, batch.seg, batch.taps)
                c = L.chain_counts(self.eval_lm, feats, batch, self.eval_target, cfg.loss_chunk,
                                   self.spec.vocab_map)
                counts = c if counts is None else {k: counts[k] + c[k] for k in c}
        if counts is None:
            counts = {k: torch.zeros(cfg.num_heads, dtype=torch.float64, device=accelerator.device)
                      for k in ("n", "top1", "top5", "chain")}
        counts = {k: accelerator.reduce(v, "sum") for k, v in counts.items()}
        model.train()
        return L.summarize_counts({k: v.cpu() for k, v in counts.items()})

    def save_checkpoint(self) -> None:
        accelerator, out = self.accelerator, self.out
        accelerator.wait_for_everyone()
        state = {"format": CKPT_FORMAT, "config": self.fp, "shards": self.shards, "step": self.step,
                 "tokens": self.tokens_done, "train_seconds": self.train_seconds,
                 "scheduler": self.sched.state_dict(), "rng": rng_state()}
        if self.sharded:
            state["state_dir"] = f"state-{self.step:08d}"
            accelerator.save_state(str(out / state["state_dir"]))  # every rank writes its shard
            accelerator.wait_for_everyone()
        else:
            state["heads"] = {k: v.detach().cpu() for k, v in self.inner.state_dict().items()}
            state["optimizer"] = self.optimizer.state_dict()
        if self.main:
            atomic_write(self.ckpt_path, lambda tmp: torch.save(state, tmp))
            if self.sharded:  # older state directories (and any left half-written by a crash) go
                for d in out.glob("state-*"):
                    if d.name != state["state_dir"]:
                        shutil.rmtree(d, ignore_errors=True)
        accelerator.wait_for_everyone()

    def flush(self) -> None:
        """Reduce the window over processes and write one log record (all ranks call it)."""
        win = self.win
        if win.n == 0:
            return
        stats = torch.tensor([win.loss, win.n, win.tokens, win.seconds] + win.heads, dtype=torch.float64,
                             device=self.accelerator.device)
        stats = self.accelerator.reduce(stats, "sum")
        self.tokens_done += int(stats[2])
        rate = float(stats[2]) / max(float(stats[3]) / self.world, 1e-9)
        rec = {"kind": "train", "step": self.step, "loss": round(float(stats[0] / stats[1]), 5),
               "head_loss": [round(float(x / stats[1]), 4) for x in stats[4:]],
               "lr": self.sched.get_last_lr()[0], "tokens": self.tokens_done, "tokens_per_s": round(rate, 1),
               "time": round(self.train_seconds, 2)}
        self.log.write(rec)
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rate:.0f}")
        win.reset()

    # ------------------------------------------------------------ steps

    def _epoch_loader(self, epoch: int, within: int):
        """The data loader of one epoch (seeded order), skipping the batches already done."""
        cfg, accelerator = self.cfg, self.accelerator
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.train_rows), generator=g)[:self.steps_per_epoch * self.rows_per_step]
        dl = DataLoader(Subset(self.train_ds, order.tolist()), batch_size=cfg.batch_size, shuffle=False,
                        collate_fn=collate)
        dl = accelerator.prepare_data_loader(dl)
        if within:
            dl = accelerator.skip_first_batches(dl, within * cfg.grad_accum)
        return dl

    def _micro_step(self, raw: dict) -> None:
        """Forward, loss and backward of one micro-batch (optimizer step when gradients sync)."""
        cfg, accelerator, model = self.cfg, self.accelerator, self.model
        with accelerator.accumulate(model):
            batch = to_batch(raw, accelerator.device, **self.feature_kw)
            with accelerator.autocast():
                feats = model(batch.hidden, batch.ids, batch.seg, batch.taps)
                loss, parts, _ = L.head_losses(self.loss_head, feats, batch, self.spec)
                if cfg.feature_loss > 0 and getattr(self.inner, "regress_features", False):
                    loss = loss + cfg.feature_loss * L.feature_regression(feats, batch, cfg.loss_lambda)
            accelerator.backward(loss)
            if accelerator.sync_gradients and cfg.grad_clip > 0:
                accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.win.add(float(loss.detach()), parts, batch.num_tokens)

    def _after_step(self, dt: float) -> bool:
        """Bookkeeping after an optimizer step: log, evaluate, checkpoint; True to stop."""
        cfg, step = self.cfg, self.step
        self.train_seconds += dt
        self.win.seconds += dt
        self.bar.update(1)
        stop = bool(cfg.stop_after) and step - self.start_step >= cfg.stop_after and step < cfg.steps
        if step % cfg.log_every == 0 or step == cfg.steps or stop or step % cfg.save_every == 0:
            self.flush()
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            ev = self.evaluate()
            if ev is not None:
                self.log.write({"kind": "eval", "step": step, **ev})
        if step % cfg.save_every == 0 or step == cfg.steps or stop:
            self.save_checkpoint()
        if stop:
            self.status = "stopped"
        return stop or step >= cfg.steps

    def loop(self) -> str:
        """Train until ``cfg.steps`` (or ``--stop-after``); return 'finished' or 'stopped'."""
        cfg, accelerator = self.cfg, self.accelerator
        self.bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train {cfg.kind}", unit="step",
                        disable=not (self.main and cfg.progress), dynamic_ncols=True)
        self.start_step = self.step
        self.status = "finished"
        self.win = Window(cfg.num_heads)
        if cfg.init_from and self.step == 0 and cfg.eval_every:  # where the started-from heads stand
            ev = self.evaluate()
            if ev is not None:
                self.log.write({"kind": "eval", "step": 0, "init_from": cfg.init_from, **ev})
        while self.step < cfg.steps and self.status != "stopped":
            epoch, within = divmod(self.step, self.steps_per_epoch)
            dl = self._epoch_loader(epoch, within)
            t0 = time.time()
            for raw in dl:
                self._micro_step(raw)
                if not accelerator.sync_gradients:
                    continue
                self.sched.step()
                self.step += 1
                if self._after_step(time.time() - t0):
                    break
                t0 = time.time()
        self.bar.close()
        return self.status

    # ------------------------------------------------------------ finish

    def finish(self, status: str) -> TrainResult:
        """Summary, final evaluation and the saved heads."""
        cfg, accelerator, inner = self.cfg, self.accelerator, self.inner
        summary = {"status": status, "step": self.step, "steps": cfg.steps, "kind": cfg.kind,
                   "num_heads": cfg.num_heads, "loss": cfg.loss, "tokens": self.tokens_done,
                   "train_seconds": round(self.train_seconds, 2),
                   "tokens_per_s": round(self.tokens_done / max(self.train_seconds, 1e-9), 1),
                   "processes": self.world, "train_rows": len(self.train_rows), "val_rows": len(self.val_rows),
                   "train_reply_tokens": self.train_corpus.num_reply_tokens(),
                   "val_reply_tokens": self.val_corpus.num_reply_tokens(), "hidden_cache": bool(self.cache),
                   **peak_memory_mib(accelerator.device)}
        if status == "finished":
            final = self.evaluate()
            if final is not None:
                self.log.write({"kind": "eval", "step": self.step, **final})
            summary["heldout"] = final
            if self.sharded:  # gather full weights into plain heads

                full = accelerator.get_state_dict(self.model)
                final_heads = head_class(cfg.kind)(inner.cfg)
                final_heads.load_state_dict({k.removeprefix("heads."): v for k, v in full.items()})
                inner = final_heads.bind(self.backbone)
            if self.main:
                training = {k: v for k, v in fingerprint(cfg, self.world).items()}
                training.update(step=self.step, tokens=self.tokens_done, backbone_model=cfg.model,
                                draft_vocab_coverage=getattr(inner, "draft_vocab_coverage", None),
                                data_shards={k: len(v) for k, v in self.shards.items()})
                save_heads(inner, self.out / "heads", extra_config={"training": training, "heldout": final})
        if self.main:
            atomic_write_json(self.out / "summary.json", summary)
        accelerator.wait_for_everyone()
        return TrainResult(status, self.step, summary, inner)
