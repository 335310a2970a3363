"""Self-distillation data: the backbone answers prompts; its token ids are stored in shards.

Knows: batched left-padded generation, the run loop of ``cadence distill`` (resumable,
deduplicated by prompt, flushing a shard every few minutes), the train/val split of
sequences, and reading both shard formats. Prompt sources live in
``cadence.training.sources``, the store format in ``cadence.training.store``.
Does not know: heads or losses.

Two kinds of data directory are read (``read_shard`` / ``load_manifest``; the trainer,
the hidden cache, ``cadence calibrate`` and ``merge-data`` all go through them):

* a **store** (``cadence distill`` writes only these; ``store.FORMAT``): ``shard-NNNNN.npz``
  files of uint16 token ids, appended run after run and meant to be committed
  (``data/selfdistill/smollm2``); see ``cadence.training.store``.
* an older directory of ``shard-NNNNN.safetensors`` (int32 tokens, int64 offsets, int32
  prompt_lens; metadata "keys"; optional top-k arrays), e.g. made by earlier versions.

Either way a loaded shard is ``{"tokens", "offsets", "prompt_lens"[, "topk_ids",
"topk_logits"]}``: sequence i is ``tokens[offsets[i]:offsets[i+1]]``, its first
``prompt_lens[i]`` tokens the (chat-templated) prompt, the rest the backbone's reply.
Sequences whose key falls in the validation bucket (``is_val``) go to shards marked
``"split": "val"``; the trainer never trains on them.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file

from cadence.backbone.load import load_backbone
from cadence.batch.engine import BatchEngine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.prompts import held_out, item_hash, PromptItem
from cadence.system.atomic import atomic_write, atomic_write_json
from cadence.training.sources import mixed_items
from cadence.training.store import read_store_shard, Store

VAL_PERCENT = 3  # share of distilled sequences kept for the trainer's held-out evaluation
MANIFEST = "manifest.json"
DEFAULT_STORE = "data/selfdistill/smollm2"


@dataclass
class DistillConfig:
    """Settings of one self-distillation run; CLI flags derive from these fields."""

    out: str = field(default=DEFAULT_STORE, metadata={
        "help": "store directory (created; an existing store is appended to)"})
    sources: list[str] = field(default_factory=lambda: ["sharegpt", "gsm8k", "code", "writing", "sharegpt-turns",
                                                        "code-packages"], metadata={
        "help": "sharegpt | gsm8k | code | writing | sharegpt-turns | code-packages | translation | summarize | "
                "extract | chat-context | passage-qa | roleplay | stem | humanities | broad (the last eight) | "
                "path.jsonl (see cadence.training.sources)"})
    mode: str = field(default="generate", metadata={
        "help": "generate: backbone writes replies; reference: use the source's own replies (no generation)"})
    max_prompts: int = field(default=0, metadata={
        "help": "stop once the store holds this many prompts "
                "(answered + skipped); 0 = all prompts of the sources"})
    max_prompt_tokens: int = field(default=256, metadata={
        "help": "prompts longer than this are skipped (and remembered as skipped)"})
    max_new_tokens: int = field(default=256, metadata={"help": "reply length cap"})
    batch_size: int = field(default=64, metadata={
        "help": "rows decoded at once (transformers: prompts per left-padded generate call)"})
    shard_prompts: int = field(default=256, metadata={"help": "most sequences per shard"})
    flush_seconds: float = field(default=240.0, metadata={
        "help": "write a shard at least this often (seconds), so an interruption loses little"})
    temperature: float = field(default=0.0, metadata={
        "help": "0 = greedy replies (what T=0 decoding will see)"})
    topk_logits: int = field(default=0, metadata={
        "help": "store the backbone's top-k logits per reply position (for KL); 0 = off"})
    seed: int = field(default=0, metadata={"help": "prompt order shuffle (per source)"})
    threads: int = field(default=0, metadata={
        "help": "torch CPU threads; 0 = torch's default (1 is far more robust on a shared, busy 2-core machine)"})
    model: str = field(default="smollm2", metadata={"help": "backbone"})
    dtype: str = field(default="auto", metadata={
        "help": "backbone dtype (bfloat16 is several times faster on CPUs with AVX-512 BF16 / AMX)"})
    device: str = field(default="auto", metadata={"help": "backbone device"})
    backend: str = field(default="auto", metadata={
        "help": "auto: cadence's batched fast path where the model supports it (continuous batching, replies "
                "identical to what `cadence generate` decodes alone), else transformers' generate; "
                "fast | transformers force one"})


def is_val(key: str) -> bool:
    """Validation bucket of distilled sequences (independent of the benchmark's split)."""
    return held_out("val:" + key, VAL_PERCENT)


def load_manifest(out: Path) -> dict | None:
    path = out / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CadenceError(f"{path} is corrupt ({exc.msg}); delete the directory to start over") from exc


def write_shard(path: Path, seqs: list[list[int]], prompt_lens: list[int], keys: list[str],
                topk: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
    """Write one shard of the older safetensors format atomically (tests and tools that
    make synthetic data use it); return its token count. ``cadence distill`` writes store
    shards (``cadence.training.store``)."""
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    tensors = {
        "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32),
    }
    if topk:
        tensors["topk_ids"] = torch.cat([i for i, _ in topk]).to(torch.int32)
        tensors["topk_logits"] = torch.cat([v for _, v in topk]).to(torch.float16)
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"keys": json.dumps(keys)}))
    return offsets[-1]


def read_shard(path: str | Path) -> dict:
    """Load a shard of either format (``.npz`` store shard or ``.safetensors``) as torch
    tensors; raise CadenceError if it is missing or unreadable."""
    path = Path(path)
    if path.suffix == ".npz" or (path.is_symlink() and path.resolve().suffix == ".npz"):
        return read_store_shard(path)
    if not path.is_file():
        raise CadenceError(f"shard {path} is missing")
    try:
        data = load_file(str(path))
    except Exception as exc:
        raise CadenceError(f"shard {path} is corrupt: {exc}") from exc
    for k in ("tokens", "offsets", "prompt_lens"):
        if k not in data:
            raise CadenceError(f"shard {path} lacks tensor {k!r}")
    return data


def encode_item(backbone, item: PromptItem) -> list[int]:
    """Prompt ids of an item, chat-templated: ``backbone.encode_prompt`` for a single user
    turn; the whole conversation (``item.messages()``, system message and earlier turns
    included) ending with the assistant's header when the item has earlier messages."""
    if not item.history:
        return backbone.encode_prompt(item.prompt, chat=True)
    tok = backbone.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise CadenceError(f"prompt {item.key} has earlier turns, but the backbone has no chat template")
    ids = tok.apply_chat_template(item.messages(), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def iter_sequences(data: dict) -> Iterator[tuple[torch.Tensor, int]]:
    """(token ids, prompt length) for each sequence of a loaded shard."""
    off = data["offsets"].tolist()
    for i, plen in enumerate(data["prompt_lens"].tolist()):
        yield data["tokens"][off[i]:off[i + 1]].long(), plen


def batched_replies(backbone, prompts: list[list[int]], cfg: DistillConfig) -> list[list[int]]:
    """Greedy replies (EOS included) through ``BatchEngine``: continuous batching over at most
    ``cfg.batch_size`` rows, each row decoding exactly as it would alone (vanilla, no heads)."""
    engine = BatchEngine(backbone, max_batch=cfg.batch_size)
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens)
    rids = [engine.add(p, gen) for p in prompts]
    out: dict[int, list[int]] = {r: [] for r in rids}
    while engine.has_work():
        for ev in engine.step():
            if ev.finish_reason == "error":
                raise CadenceError(f"distill: a batched request failed: {ev.error}")
            out[ev.rid] += ev.tokens
    return [out[r] for r in rids]


@torch.inference_mode()
def generate_batch(backbone, prompts: list[list[int]], cfg: DistillConfig
                   ) -> tuple[list[list[int]], list[tuple[torch.Tensor, torch.Tensor]] | None]:
    """Replies (cut after the first EOS) for a batch of prompt ids, left padded."""
    tok = backbone.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(backbone.eos_token_ids)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kwargs = dict(do_sample=cfg.temperature > 0, max_new_tokens=cfg.max_new_tokens, pad_token_id=pad,
                  return_dict_in_generate=True, output_logits=cfg.topk_logits > 0)
    if cfg.temperature > 0:
        kwargs.update(temperature=cfg.temperature, top_k=0, top_p=1.0)
    out = backbone.model.generate(input_ids=ids.to(backbone.device), attention_mask=mask.to(backbone.device),
                                  **kwargs)
    new = out.sequences[:, width:].cpu()
    eos = backbone.eos_token_ids
    replies, topk = [], [] if cfg.topk_logits > 0 else None
    for i in range(len(prompts)):
        row = new[i].tolist()
        n = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        replies.append(row[:n])
        if topk is not None:
            logits = torch.stack([step[i] for step in out.logits[:n]]).float()
            vals, idx = logits.topk(cfg.topk_logits, dim=-1)
            topk.append((idx.cpu(), vals.cpu()))
    return replies, topk


def reference_batch(backbone, items: list[PromptItem]) -> list[list[int]]:
    """Replies taken from the sources themselves (mode 'reference'): no generation."""
    out = []
    for it in items:
        text = it.reference or ""
        out.append(backbone.tokenizer(text, add_special_tokens=False)["input_ids"][:512])
    return out


class _Stop(BaseException):
    """Raised by the SIGTERM handler: flush what is finished, then stop. A BaseException, as
    KeyboardInterrupt is: the batch engine retries failed steps row by row under ``except
    Exception``, which would otherwise swallow the stop and go on decoding."""


def _log(msg: str) -> None:
    print(f"[distill {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class _Buffer:
    """Finished sequences of one split, not yet in a shard."""

    def __init__(self):
        self.seqs, self.plens, self.keys, self.hashes, self.sources, self.topk = [], [], [], [], [], []

    def __len__(self) -> int:
        return len(self.seqs)


def _settings(backbone, cfg: DistillConfig) -> dict:
    dtype = str(getattr(backbone.model, "dtype", "unknown")).replace("torch.", "")
    return {"model": backbone.name, "dtype": dtype, "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature, "mode": cfg.mode, "topk_logits": cfg.topk_logits,
            "max_prompt_tokens": cfg.max_prompt_tokens,
            "decoder": "cadence-batched" if _uses_engine(backbone, cfg) else "transformers-generate"}


def run_distill(cfg: DistillConfig, backbone=None, items=None) -> dict:
    """Append self-distilled sequences to the store ``cfg.out``; return its manifest.

    Prompts come from ``cadence.training.sources.mixed_items`` (or ``items``, an iterable of
    (source, PromptItem), for tests). A prompt whose hash the store already holds is
    skipped, so running the same command again continues where the last run stopped, and
    a later run with more sources or a higher ``--max-prompts`` adds to the same store.
    A shard is written when ``shard_prompts`` sequences are finished or ``flush_seconds``
    have passed, and on SIGTERM / Ctrl-C (finished sequences are kept; the batch being
    generated is lost and its prompts are answered by the next run).
    """
    if cfg.mode not in ("generate", "reference"):
        raise CadenceError(f"unknown distill mode {cfg.mode!r}")
    if cfg.batch_size < 1 or cfg.shard_prompts < 1:
        raise CadenceError("--batch-size and --shard-prompts must be at least 1")
    if cfg.backend not in ("auto", "fast", "transformers"):
        raise CadenceError(f"unknown --backend {cfg.backend!r}; choose auto, fast or transformers")
    if cfg.backend == "fast" and (cfg.temperature > 0 or cfg.topk_logits > 0):
        raise CadenceError("--backend fast distils greedy replies only; use --backend transformers "
                           "for --temperature or --topk-logits")
    out = Path(cfg.out)
    manifest = load_manifest(out)
    if manifest is not None and manifest.get("format") is None:
        raise CadenceError(f"{out} holds data of another format (safetensors shards, made before the store); "
                           "train and calibrate still read it, but distill into a new --out")
    if backbone is None:
        backbone = load_backbone(cfg.model, cfg.dtype, cfg.device, backend=_backend(cfg))
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    store = Store(out, backbone.name, backbone.vocab_size, manifest)
    try:
        return _run(cfg, backbone, store, items if items is not None else mixed_items(cfg.sources, cfg.seed))
    finally:
        store.close()


def _backend(cfg: DistillConfig) -> str:
    """The backend to load: the fast path (``auto`` falls back to transformers for models it
    does not support) unless sampling or top-k logits need transformers' generate."""
    if cfg.backend == "auto" and (cfg.temperature > 0 or cfg.topk_logits > 0):
        return "transformers"
    return cfg.backend


def _uses_engine(backbone, cfg: DistillConfig) -> bool:
    return (cfg.mode == "generate" and cfg.temperature == 0 and cfg.topk_logits == 0
            and cfg.backend != "transformers" and hasattr(backbone, "forward_rows"))


def _run(cfg: DistillConfig, backbone, store, items) -> dict:
    return _DistillRun(cfg, backbone, store).run(items)


class _DistillRun:
    """One ``cadence distill`` run over a store: prompts are deduplicated against the store,
    pooled by length, generated in batches, buffered per split and flushed into shards."""

    def __init__(self, cfg: DistillConfig, backbone, store):
        self.cfg, self.backbone, self.store = cfg, backbone, store
        self.settings = _settings(backbone, cfg)
        self.m = store.manifest
        self.bufs = {"train": _Buffer(), "val": _Buffer()}
        self.skipped: list[str] = []  # hashes of prompts too long to answer, not yet recorded
        self.last_flush = self.flushed_s = time.time()
        self.reply = self.prompts = 0
        self.t0, self.cpu0 = time.time(), time.process_time()
        self.threads = max(torch.get_num_threads(), 1)
        self.engine = _uses_engine(backbone, cfg)

    def run(self, items) -> dict:
        """Answer every new prompt of ``items`` (up to ``max_prompts`` in the store); on SIGTERM
        or Ctrl-C keep what is finished. Returns the store's manifest."""
        cfg, m = self.cfg, self.m
        old = None
        if threading.current_thread() is threading.main_thread():
            old = signal.signal(signal.SIGTERM, _on_term)
        _log(f"store {self.store.dir}: {m['prompts_done']} prompts, {len(m['shards'])} shards, "
             f"{m['reply_tokens']} reply tokens; settings {self.settings}; batch {cfg.batch_size}, "
             f"{self.threads} threads")
        try:
            pool: list = []
            for entry in self._new_prompts(items):
                pool.append(entry)
                if len(pool) >= cfg.batch_size * 4:
                    self._drain(pool)
            self._drain(pool)
            self.flush(True)
        except (_Stop, KeyboardInterrupt):
            main = threading.current_thread() is threading.main_thread()
            old_int = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None  # a second Ctrl-C waits
            try:
                _log("interrupted: writing the finished sequences")
                self.flush(True)
            finally:
                if old_int is not None:
                    signal.signal(signal.SIGINT, old_int)
        finally:
            if old is not None:
                signal.signal(signal.SIGTERM, old)
        wall = time.time() - self.t0
        _log(f"done: {self.prompts} prompts, {self.reply} reply tokens in {wall:.0f} s "
             f"({self.reply / max(wall, 1e-9):.1f} tok/s); store {m['prompts_done']} prompts, "
             f"{len(m['shards'])} shards, {m['reply_tokens']} reply tokens")
        return m

    def _new_prompts(self, items):
        """(source, item, hash, ids) of each prompt the store has not seen, until the store
        would hold ``max_prompts``; prompts too long are recorded as skipped instead."""
        cfg = self.cfg
        limit = cfg.max_prompts if cfg.max_prompts > 0 else math.inf
        done, pending, start = self.store.done_hashes(), 0, self.m["prompts_done"]
        for src, it in items:
            if start + pending >= limit:
                return
            h = item_hash(it)
            if h in done:
                continue
            done.add(h)
            pending += 1
            chars = sum(len(t) for t in it.texts())
            ids = encode_item(self.backbone, it) if chars <= 16 * cfg.max_prompt_tokens else None
            if ids is None or len(ids) > cfg.max_prompt_tokens:
                self.skipped.append(h)
                continue
            yield src, it, h, ids

    def _drain(self, pool: list) -> None:
        """Answer every pooled prompt, shortest first (less padding per batch); empties ``pool``."""
        pool.sort(key=lambda x: len(x[3]))
        step = len(pool) if self.engine else self.cfg.batch_size  # the engine refills its rows itself
        while pool:
            self.process(pool[:step])
            del pool[:step]

    def process(self, batch: list[tuple[str, PromptItem, str, list[int]]]) -> None:
        """Answer one batch into the split buffers; flush when a shard is full or due."""
        cfg, t = self.cfg, time.time()
        if self.engine:
            replies, topk = batched_replies(self.backbone, [ids for *_, ids in batch], cfg), None
        elif cfg.mode == "generate":
            replies, topk = generate_batch(self.backbone, [ids for *_, ids in batch], cfg)
        else:
            replies, topk = reference_batch(self.backbone, [it for _, it, _, _ in batch]), None
        dt = time.time() - t
        n_reply = 0
        for j, ((src, it, h, ids), reply) in enumerate(zip(batch, replies)):
            b = self.bufs["val" if is_val(it.key) else "train"]
            b.seqs.append(ids + reply)
            b.plens.append(len(ids))
            b.keys.append(it.key)
            b.hashes.append(h)
            b.sources.append(src)
            if topk is not None:
                b.topk.append(topk[j])
            n_reply += len(reply)
        self.reply += n_reply
        self.prompts += len(batch)
        self._log_batch(batch, n_reply, dt)
        if len(self.bufs["train"]) >= cfg.shard_prompts or time.time() - self.last_flush >= cfg.flush_seconds:
            self.flush(False)

    def _log_batch(self, batch, n_reply: int, dt: float) -> None:
        m, bufs = self.m, self.bufs
        wall = time.time() - self.t0
        busy = (time.process_time() - self.cpu0) / self.threads  # excludes time spent paused (SIGSTOP)
        mix = ", ".join(f"{k} {v}" for k, v in sorted(_count(src for src, *_ in batch).items()))
        buffered = sum(len(s) - p for x in bufs.values() for s, p in zip(x.seqs, x.plens))
        _log(f"batch of {len(batch)} ({mix}): {n_reply} reply tokens in {dt:.1f} s = {n_reply / max(dt, 1e-9):.1f} tok/s; "
             f"this run {self.prompts} prompts, {self.reply} reply tokens, "
             f"{self.reply / max(wall, 1e-9):.1f} tok/s wall, {self.reply / max(busy, 1e-9):.1f} tok/s busy; "
             f"store {m['prompts_done'] + sum(len(x) for x in bufs.values())} prompts, "
             f"{(m['reply_tokens'] + buffered) / 1e6:.3f} M reply tokens")

    def flush(self, final: bool) -> None:
        """Write the buffered sequences as shards (val only when final or big enough) and
        record skipped prompts; the seconds since the last flush go to the first shard."""
        cfg, store = self.cfg, self.store
        now = time.time()
        seconds, self.flushed_s = now - self.flushed_s, now
        wrote = False
        for split in ("train", "val"):
            b = self.bufs[split]
            if not b or (split == "val" and not final and len(b) < max(8, cfg.shard_prompts // 8)):
                continue
            n = cfg.shard_prompts
            for a in range(0, len(b), n):
                entry = store.append(split, b.seqs[a:a + n], b.plens[a:a + n], b.keys[a:a + n], b.hashes[a:a + n],
                                     b.sources[a:a + n], self.settings,
                                     b.topk[a:a + n] if cfg.topk_logits > 0 else None, skipped=list(self.skipped),
                                     seconds=0.0 if wrote else seconds)
                self.skipped.clear()
                wrote = True
                size = (store.dir / entry["file"]).stat().st_size
                _log(f"wrote {entry['file']} ({split}: {entry['sequences']} sequences, {entry['tokens']} tokens, "
                     f"{entry['reply_tokens']} reply tokens, {size / 1024:.1f} KiB, "
                     f"{size / max(entry['tokens'], 1) * 1e6 / 2**20:.2f} MiB per million tokens)")
            self.bufs[split] = _Buffer()
        if not wrote and (self.skipped or final):
            store.append("train", [], [], [], [], [], self.settings, skipped=list(self.skipped), seconds=seconds)
            self.skipped.clear()
        self.last_flush = now


def _on_term(signum, frame):
    # one SIGTERM is enough: `timeout` and a process-group kill both send one, and a second
    # must not cut short the flush of the finished sequences (``run`` restores the handler)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Stop()


def _count(xs) -> dict:
    out: dict = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


def merge_datasets(out: str | Path, sources: list[tuple[str | Path, int | None]],
                   val_from: int | None = 0) -> dict:
    """Make ``out`` a dataset whose shards are links to the shards of several others.

    ``sources`` is a list of (directory, max train shards or None for all). Validation
    shards come only from source ``val_from`` (the data decoding will look like, e.g.
    self-distilled greedy replies), so held-out accuracy measures what matters.
    The new manifest's config records the sources' configs; nothing is copied.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards, configs = [], []
    for i, (src, limit) in enumerate(sources):
        src = Path(src).resolve()
        manifest = load_manifest(src)
        if manifest is None:
            raise CadenceError(f"{src} has no manifest.json")
        configs.append({"dir": str(src), "config": manifest["config"], "max_train_shards": limit})
        n_train = 0
        for s in manifest["shards"]:
            if s["split"] == "train":
                if limit is not None and n_train >= limit:
                    continue
                n_train += 1
            elif i != val_from:
                continue
            name = f"src{i}-{s['file']}"
            link = out / name
            if not link.exists():
                link.symlink_to(src / s["file"])
            shards.append({**s, "file": name})
    manifest = {"config": {"merged": configs}, "prompts_done": 0, "skipped": 0, "shards": shards, "seconds": 0.0}
    atomic_write_json(out / MANIFEST, manifest)
    return manifest
