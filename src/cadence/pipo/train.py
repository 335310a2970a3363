"""``cadence train-pipo``: on-policy distillation (OPD) of the PIPO student from the unmodified backbone.

Knows: one training step (student rollouts, the teacher's distributions over them, the three
losses), the optimizer and schedule, checkpoints and snapshots. Uses ``cadence.training.run_files``
for the checkpoint file, random state and the JSONL log, as ``cadence train`` does.
Does not know decoding (``decode``) or the directory format (``student``).

One step, for ``batch_size`` prompts from the store:

1. Each sequence is a *pairs* sequence (reply also read as pairs, share ``pairs_share``) or a
   *prompt* sequence (compressed prompt, plain reply); its reply is the student's own rollout,
   sampled at ``temperature`` (or, share ``teacher_mix``, the store's teacher reply). In a pairs
   rollout each step commits the pair (a, b) with chance ``pair_rate``, else a alone as a plain
   position, so the fallback path is trained too.
2. The teacher (the backbone, unmodified, uncompressed) gives p_T at every reply token.
3. Losses, at every reply token the student predicts: KL(p_T || q) of the LM head at the
   position before it, and of the pair head at the position two before (given the true token
   between); the confidence head: binary cross-entropy to ``min(1, p_T(b) / q(b))`` for the pair
   head's sampled draft b and for its argmax draft, on detached features.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import DynamicCache

from cadence.errors import CadenceError
from cadence.pipo.config import StudentConfig, TrainPipoConfig
from cadence.pipo.data import load_pairs
from cadence.pipo.groups import pack, pad_batch, PAIR, PLAIN, prompt_groups, starts
from cadence.pipo.student import save_student, Student
from cadence.system.atomic import atomic_write
from cadence.training.run_files import (
    CHECKPOINT, CKPT_FORMAT, load_checkpoint, LOG, Log, rng_state, set_rng_state, trim_log,
)

# ---------------------------------------------------------------- rollouts


@torch.no_grad()
def rollout(student, prompts: list[list[int]], pairs_rows: list[bool], max_reply: int, temperature: float,
            pair_rate: float, gen: torch.Generator, eos: set[int]) -> list[tuple[list[int], list[int]]]:
    """Sample replies from the student, all rows at once. Returns (reply ids, reply group sizes)
    per row; EOS ends a row (and is part of its reply)."""
    s, dev = student, student.base.device
    packed = [pack(p, prompt_groups(len(p))) for p in prompts]
    ids, sizes, mask, pos = (t.to(dev) for t in pad_batch(packed, left=True))

    cache = DynamicCache(config=s.base.config)
    h = s.run(s.latents(ids, sizes), ((sizes == PAIR) & (mask == 1)).float(), cache, pos, mask)[:, -1]
    B = len(prompts)
    replies: list[list[int]] = [[] for _ in range(B)]
    groups: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    next_pos = mask.sum(1, keepdim=True)
    pairs_t = torch.tensor(pairs_rows, device=dev)

    def draw(logits):
        return torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen)[:, 0]

    while not all(done):
        a = draw(s.lm_logits(h).cpu()).to(dev)
        b = draw(s.lm_logits(s.pair_state(h, a)).cpu()).to(dev)
        coin = torch.rand(B, generator=gen).to(dev) < pair_rate
        is_pair = pairs_t & coin
        for i in range(B):
            if done[i]:
                continue
            room = max_reply - len(replies[i])
            take = [int(a[i])] + ([int(b[i])] if is_pair[i] and room >= 2 and int(a[i]) not in eos else [])
            if len(take) == 1:
                is_pair[i] = False
            replies[i] += take
            groups[i].append(len(take))
            done[i] = any(t in eos for t in take) or len(replies[i]) >= max_reply
        if all(done):
            break
        step_ids = torch.stack([a, torch.where(is_pair, b, torch.zeros_like(b))], -1)[:, None]
        step_sizes = torch.where(is_pair, PAIR, PLAIN)[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        h = s.run(s.latents(step_ids, step_sizes), is_pair.float()[:, None], cache, next_pos, mask)[:, -1]
        next_pos = next_pos + 1
    return list(zip(replies, groups))


def random_groups(n: int, pairs: bool, pair_rate: float, rng: np.random.Generator) -> list[int]:
    """Reply group sizes for a teacher reply of n tokens (as a rollout would draw them)."""
    out, t = [], 0
    while t < n:
        z = PAIR if pairs and t + 1 < n and rng.random() < pair_rate else PLAIN
        out.append(z)
        t += z
    return out


# ---------------------------------------------------------------- teacher and losses


@torch.no_grad()
def teacher_logprobs(base, seqs: list[tuple[list[int], int]], bf16: bool) -> list[torch.Tensor]:
    """log p_T (float32, (L - Lp, V)) of the unmodified backbone for each sequence (tokens, Lp):
    row r is its distribution over token Lp + r given the tokens before it."""
    dev = base.device
    T = max(len(t) for t, _ in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long, device=dev)
    mask = torch.zeros_like(ids)
    for i, (t, _) in enumerate(seqs):
        ids[i, :len(t)] = torch.tensor(t)
        mask[i, :len(t)] = 1
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        hid = base.model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = []
        for i, (t, lp) in enumerate(seqs):
            rows = hid[i, lp - 1:len(t) - 1]
            out.append(torch.log_softmax(base.get_output_embeddings()(rows).float(), -1))
    return out


def _kl(lp_t: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """Mean KL(p_T || q) over rows; both (N, V) log-probabilities."""
    return (lp_t.exp() * (lp_t - lq)).sum(-1).mean()


def student_losses(student, seqs: list[tuple[list[int], int, list[int]]], teacher: list[torch.Tensor],
                   bf16: bool, gen: torch.Generator, pair_grad: bool = False) -> tuple[dict, dict]:
    """Losses (tensors) and metrics (floats) of one batch. seqs: (tokens, Lp, group sizes) with
    the prompt grouped by ``prompt_groups``; teacher: ``teacher_logprobs`` of the same seqs.
    pair_grad: the pair head's KL also trains the adapter and compressor (else the head alone)."""
    s, dev = student, student.base.device
    ids, sizes, mask, pos = (t.to(dev) for t in pad_batch([pack(t, z) for t, _, z in seqs], left=False))
    lm_idx, lm_tgt, mt_idx, mt_tok, mt_tgt = [], [], [], [], []
    for i, (toks, lp, z) in enumerate(seqs):
        L = len(toks)
        for g, (st, n) in enumerate(zip(starts(z), z)):
            t1 = st + n
            if lp <= t1 < L:
                lm_idx.append((i, g))
                lm_tgt.append(teacher[i][t1 - lp])
            if lp <= t1 and t1 + 1 < L:
                mt_idx.append((i, g))
                mt_tok.append(toks[t1])
                mt_tgt.append(teacher[i][t1 + 1 - lp])
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        hid = s.run(s.latents(ids, sizes), ((sizes == PAIR) & (mask == 1)).float(), None, pos, mask)
        li = torch.tensor(lm_idx, device=dev)
        h_lm = hid[li[:, 0], li[:, 1]]
        lq = torch.log_softmax(s.lm_logits(h_lm), -1)
        mi = torch.tensor(mt_idx, device=dev)
        h_mt = hid[mi[:, 0], mi[:, 1]]
        a = torch.tensor(mt_tok, device=dev)
        g_mt = s.pair_state(h_mt if pair_grad else h_mt.detach(), a)
        lq2 = torch.log_softmax(s.lm_logits(g_mt), -1)
    lp_lm, lp_mt = torch.stack(lm_tgt), torch.stack(mt_tgt)
    kl_lm, kl_pair = _kl(lp_lm, lq), _kl(lp_mt, lq2)
    with torch.no_grad():
        lq2d = lq2.detach()
        b_s = torch.multinomial(lq2d.exp().cpu(), 1, generator=gen)[:, 0].to(dev)
        b_g = lq2d.argmax(-1)
        b = torch.cat([b_s, b_g])
        lq_b = torch.cat([lq2d, lq2d]).gather(-1, b[:, None])[:, 0]
        lp_b = torch.cat([lp_mt, lp_mt]).gather(-1, b[:, None])[:, 0]
        target = (lp_b - lq_b).exp().clamp(max=1.0)
        ent = -(lq2d.exp() * lq2d).sum(-1)
    hh, gg = torch.cat([h_mt, h_mt]).detach(), torch.cat([g_mt, g_mt]).detach()
    logit = s.confidence.logit(hh, gg, s.embed(b), lq_b, torch.cat([ent, ent]))
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logit.float(), target)
    with torch.no_grad():
        n_g = len(b_g)
        metrics = {"kl_lm": float(kl_lm), "kl_pair": float(kl_pair), "bce_conf": float(bce),
                   "top1_lm": float((lq.argmax(-1) == lp_lm.argmax(-1)).float().mean()),
                   "top1_pair": float((b_g == lp_mt.argmax(-1)).float().mean()),
                   "accept_greedy": float(target[n_g:].mean()),
                   "conf_greedy": float(torch.sigmoid(logit[n_g:].float()).mean()),
                   "rows": len(lm_idx) + len(mt_idx)}
    return {"kl_lm": kl_lm, "kl_pair": kl_pair, "bce_conf": bce}, metrics


# ---------------------------------------------------------------- the run


def _schedule(cfg: TrainPipoConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return f


# settings a resumed run must share with the checkpoint (others, e.g. --steps, may change)
_FIXED = ("data", "batch_size", "max_prompt", "max_reply", "seed")


class PipoRun:
    """One resumable ``cadence train-pipo`` run in ``cfg.out``."""

    def __init__(self, cfg: TrainPipoConfig, scfg: StudentConfig, backbone):
        self.cfg, self.out = cfg, Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.backbone = backbone
        self.eos = set(backbone.eos_token_ids)
        self.pairs = load_pairs(cfg.data, "train", cfg.max_prompt)
        self.student = Student(backbone, scfg).train()
        self.opt = torch.optim.AdamW(self.student.trainable(), lr=cfg.lr, weight_decay=0.0)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _schedule(cfg))
        self.rng = np.random.default_rng(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step, self.tokens, self.seconds = 0, 0, 0.0
        self._resume(scfg)

    def _resume(self, scfg: StudentConfig) -> None:
        path = self.out / CHECKPOINT
        if not path.exists():
            return
        ck = load_checkpoint(path)
        if ck.get("kind") != "pipo":
            raise CadenceError(f"{path} is not a train-pipo checkpoint; use another --out")
        old = ck["config"]
        changed = [k for k in _FIXED if old.get(k) != self.cfg.to_dict()[k]]
        if changed or ck["student_config"] != scfg.to_dict():
            raise CadenceError(f"{self.out} holds a run with other settings ({changed or 'student shape'}); "
                               "use another --out or the same settings")
        self.student.load_state(ck["student"])
        self.opt.load_state_dict(ck["optimizer"])
        self.sched.load_state_dict(ck["scheduler"])
        self.rng.bit_generator.state = ck["numpy_rng"]
        self.gen.set_state(ck["torch_gen"])
        set_rng_state(ck["rng"])
        self.step, self.tokens, self.seconds = ck["step"], ck["tokens"], ck["seconds"]
        trim_log(self.out / LOG, self.step)
        print(f"cadence: resuming {self.out} at step {self.step}", flush=True)

    def save_checkpoint(self) -> None:
        state = {"format": CKPT_FORMAT, "kind": "pipo", "step": self.step, "tokens": self.tokens,
                    "seconds": self.seconds, "config": self.cfg.to_dict(),
                    "student_config": self.student.cfg.to_dict(),
                    "student": {k: v.clone() for k, v in self.student.state().items()},
                    "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                    "numpy_rng": self.rng.bit_generator.state, "torch_gen": self.gen.get_state(),
                    "rng": rng_state()}
        atomic_write(self.out / CHECKPOINT, lambda tmp: torch.save(state, tmp))

    def meta(self, metrics: dict | None) -> dict:
        return {"training": {**self.cfg.to_dict(), "step": self.step, "reply_tokens": self.tokens,
                             "seconds": round(self.seconds, 1), "sequences": len(self.pairs),
                             "method": "on-policy distillation from the unmodified backbone"},
                "last_metrics": metrics or {}}

    def batch(self) -> list[tuple[list[int], int, list[int]]]:
        cfg = self.cfg
        picks = self.rng.choice(len(self.pairs), size=min(cfg.batch_size, len(self.pairs)), replace=False)
        rows = [(self.pairs[int(j)], self.rng.random() < cfg.pairs_share, self.rng.random() < cfg.teacher_mix)
                for j in picks]
        roll = [(p, pairs) for (p, _), pairs, teach in rows if not teach]
        got = iter([])
        if roll:
            with torch.autocast(self.backbone.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                got = iter(rollout(self.student, [p for p, _ in roll], [x for _, x in roll], cfg.max_reply,
                                   cfg.temperature, cfg.pair_rate, self.gen, self.eos))
        out = []
        for (p, reply), pairs, teach in rows:
            if teach:
                reply = reply[:cfg.max_reply]
                z = random_groups(len(reply), pairs, cfg.pair_rate, self.rng)
            else:
                reply, z = next(got)
            out.append((p + reply, len(p), prompt_groups(len(p)) + z))
        return out

    def train_step(self) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        seqs = self.batch()
        t1 = time.perf_counter()
        teacher = teacher_logprobs(self.student.base, [(t, lp) for t, lp, _ in seqs], cfg.bf16)
        losses, metrics = student_losses(self.student, seqs, teacher, cfg.bf16, self.gen, cfg.pair_grad)
        loss = losses["kl_lm"] + cfg.pair_head_weight * losses["kl_pair"] + cfg.confidence_weight * losses["bce_conf"]
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.student.trainable(), cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        dt = time.perf_counter() - t0
        self.step += 1
        self.seconds += dt
        self.tokens += sum(len(t) - lp for t, lp, _ in seqs)
        return {**metrics, "loss": float(loss.detach()), "lr": self.sched.get_last_lr()[0], "rollout_s": round(t1 - t0, 2),
                "step_s": round(dt, 2)}

    def loop(self) -> dict:
        cfg, log = self.cfg, Log(self.out / LOG, True)
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train-pipo", unit="step", disable=not cfg.progress)
        metrics: dict = {}
        try:
            while self.step < cfg.steps:
                metrics = self.train_step()
                log.write({"step": self.step, "tokens": self.tokens, "seconds": round(self.seconds, 1),
                           **{k: round(v, 5) if isinstance(v, float) else v for k, v in metrics.items()}})
                bar.update(1)
                bar.set_postfix(kl=f"{metrics['kl_lm']:.3f}", kl2=f"{metrics['kl_pair']:.3f}",
                                top1=f"{metrics['top1_lm']:.2f}", acc2=f"{metrics['accept_greedy']:.2f}")
                if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                    self.save_checkpoint()
                if self.step in cfg.snapshots:
                    save_student(self.student, self.out / f"step-{self.step:06d}", self.meta(metrics))
        finally:
            bar.close()
        final = save_student(self.student, self.out / "final", self.meta(metrics))
        return {"out": str(final), "step": self.step, "seconds": round(self.seconds, 1), "tokens": self.tokens,
                **{k: v for k, v in metrics.items()}}


def train_pipo(cfg: TrainPipoConfig, scfg: StudentConfig, backbone) -> dict:
    """Run (or resume) training; returns a summary with the final directory."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    return PipoRun(cfg, scfg, backbone).loop()
