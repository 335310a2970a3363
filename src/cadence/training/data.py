"""Self-distillation data: the backbone answers prompts; its token ids are written in shards.

Knows: prompt sources (via ``cadence.prompts``), batched left-padded generation,
the shard format, the manifest, resuming, and the train/val split of sequences.
Does not know: heads or losses.

Layout of an output directory::

    manifest.json                 config + list of finished shards (written atomically)
    shard-00000.safetensors       tokens (int32, flat), offsets (int64, n+1),
                                  prompt_lens (int32, n); metadata "keys" (JSON list)
                                  optional topk_ids (int32, R x k) / topk_logits (f16, R x k)
                                  for the R response positions, for KL training

Sequence i is ``tokens[offsets[i]:offsets[i+1]]``; its first ``prompt_lens[i]`` tokens
are the (chat-templated) prompt, the rest the backbone's reply. Sequences whose key
falls in the validation bucket go to shards marked ``"split": "val"``; the trainer
never trains on them.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from cadence.atomic import atomic_write, atomic_write_json
from cadence.errors import CadenceError
from cadence.prompts import PromptItem, gsm8k_items, held_out, jsonl_items, sharegpt_items

VAL_PERCENT = 3  # share of distilled sequences kept for the trainer's held-out evaluation
MANIFEST = "manifest.json"


@dataclass
class DistillConfig:
    """Settings of one self-distillation run; CLI flags derive from these fields."""

    out: str = "data/distill"  # output directory (created; resumed if it holds a manifest)
    sources: list[str] = field(default_factory=lambda: ["sharegpt", "gsm8k"])  # sharegpt | gsm8k | path.jsonl
    mode: str = "generate"  # generate: backbone writes replies; reference: use the source's own replies (no generation)
    max_prompts: int = 2000  # stop after this many prompts in total (raise it to extend a run)
    max_prompt_tokens: int = 256  # prompts longer than this are skipped
    max_new_tokens: int = 192  # reply length cap
    batch_size: int = 16  # prompts per generate call (left padding)
    shard_prompts: int = 64  # prompts per shard (the unit of resuming)
    temperature: float = 0.0  # 0 = greedy replies (what T=0 decoding will see)
    topk_logits: int = 0  # store the backbone's top-k logits per reply position (for KL); 0 = off
    seed: int = 0  # prompt order shuffle
    model: str = "smollm2"  # backbone
    dtype: str = "auto"  # backbone dtype
    device: str = "auto"  # backbone device


def iter_items(sources: Iterable[str]) -> Iterator[PromptItem]:
    """Training prompts from each named source (held-out ShareGPT is never included)."""
    for src in sources:
        if src == "sharegpt":
            yield from sharegpt_items("train")
        elif src == "gsm8k":
            yield from gsm8k_items("train")
        elif src.endswith(".jsonl"):
            yield from jsonl_items(src)
        else:
            raise CadenceError(f"unknown prompt source {src!r}: use sharegpt, gsm8k or a .jsonl file")


def ordered_items(cfg: DistillConfig) -> list[PromptItem]:
    """All training prompts, shuffled by ``cfg.seed`` (sources interleaved), deterministic."""
    items = list(iter_items(cfg.sources))
    random.Random(cfg.seed).shuffle(items)
    return items


def is_val(key: str) -> bool:
    """Validation bucket of distilled sequences (independent of the benchmark's split)."""
    return held_out("val:" + key, VAL_PERCENT)


def _config_fingerprint(cfg: DistillConfig) -> dict:
    d = asdict(cfg)
    for k in ("out", "max_prompts", "device", "batch_size"):  # may change between resumes
        d.pop(k)
    return d


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
    """Write one shard atomically; return its token count."""
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
    """Load a shard; raise CadenceError if it is missing or unreadable."""
    path = Path(path)
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


def iter_sequences(data: dict) -> Iterator[tuple[torch.Tensor, int]]:
    """(token ids, prompt length) for each sequence of a loaded shard."""
    off = data["offsets"].tolist()
    for i, plen in enumerate(data["prompt_lens"].tolist()):
        yield data["tokens"][off[i]:off[i + 1]].long(), plen


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


class _Writer:
    """Buffers sequences per split and writes shards; keeps the manifest in step."""

    def __init__(self, out: Path, manifest: dict):
        self.out, self.manifest = out, manifest

    def flush(self, buf: dict, prompts_done: int) -> None:
        for split in ("train", "val"):
            b = buf[split]
            if not b["seqs"]:
                continue
            idx = len(self.manifest["shards"])
            name = f"shard-{idx:05d}.safetensors"
            n_tok = write_shard(self.out / name, b["seqs"], b["plens"], b["keys"], b["topk"] or None)
            n_resp = sum(len(s) - p for s, p in zip(b["seqs"], b["plens"]))
            self.manifest["shards"].append({"file": name, "split": split, "sequences": len(b["seqs"]),
                                            "tokens": n_tok, "reply_tokens": n_resp})
        self.manifest["prompts_done"] = prompts_done
        atomic_write_json(self.out / MANIFEST, self.manifest)


def _empty_buf() -> dict:
    return {s: {"seqs": [], "plens": [], "keys": [], "topk": []} for s in ("train", "val")}


def run_distill(cfg: DistillConfig, backbone=None) -> dict:
    """Generate (or resume generating) a distillation set; return the manifest."""
    if cfg.mode not in ("generate", "reference"):
        raise CadenceError(f"unknown distill mode {cfg.mode!r}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(out)
    fp = _config_fingerprint(cfg)
    if manifest is None:
        manifest = {"config": fp, "prompts_done": 0, "skipped": 0, "shards": [], "seconds": 0.0}
    elif manifest["config"] != fp:
        diff = {k: (manifest["config"].get(k), v) for k, v in fp.items() if manifest["config"].get(k) != v}
        raise CadenceError(f"{out} was made with other settings {diff}; use a new --out directory")
    if backbone is None:
        from cadence.backbone import load_backbone
        backbone = load_backbone(cfg.model, cfg.dtype, cfg.device)
    items = ordered_items(cfg)[manifest["prompts_done"]:cfg.max_prompts]
    writer = _Writer(out, manifest)
    bar = tqdm(total=len(items), desc="distill", unit="prompt")
    done, n_new, t0, base_s = manifest["prompts_done"], 0, time.time(), manifest["seconds"]
    for start in range(0, len(items), cfg.shard_prompts):
        chunk = items[start:start + cfg.shard_prompts]
        buf = _empty_buf()
        encoded = [(it, backbone.encode_prompt(it.prompt, chat=True)) for it in chunk]
        kept = [(it, ids) for it, ids in encoded if len(ids) <= cfg.max_prompt_tokens]
        manifest["skipped"] += len(encoded) - len(kept)
        bar.update(len(encoded) - len(kept))
        kept.sort(key=lambda x: len(x[1]))  # less padding per batch
        for b in range(0, len(kept), cfg.batch_size):
            batch = kept[b:b + cfg.batch_size]
            if cfg.mode == "generate":
                replies, topk = generate_batch(backbone, [ids for _, ids in batch], cfg)
            else:
                replies, topk = reference_batch(backbone, [it for it, _ in batch]), None
            for j, ((it, ids), reply) in enumerate(zip(batch, replies)):
                b_ = buf["val" if is_val(it.key) else "train"]
                b_["seqs"].append(ids + reply)
                b_["plens"].append(len(ids))
                b_["keys"].append(it.key)
                if topk is not None:
                    b_["topk"].append(topk[j])
                n_new += len(reply)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{n_new / max(time.time() - t0, 1e-9):.1f}")
        done += len(chunk)
        manifest["seconds"] = base_s + time.time() - t0
        writer.flush(buf, done)
    bar.close()
    return manifest


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
