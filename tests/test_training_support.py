"""Helpers for the training tests (no tests here): tiny model directories and synthetic shards."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from cadence.system.atomic import atomic_write_json  # noqa: E402
from cadence.training.data import MANIFEST, write_shard  # noqa: E402

VOCAB = 260


def tiny_model_dir(root: Path, seed: int = 0, name: str = "tiny") -> Path:
    """A tiny random Llama + byte tokenizer saved with save_pretrained (a --model directory)."""
    from tiny import tiny_backbone

    path = Path(root) / name
    if not (path / "config.json").exists():
        bb = tiny_backbone("llama", seed=seed)
        bb.model.save_pretrained(path)
        bb.tokenizer.save_pretrained(path)
    return path


def synthetic_sequence(rng: random.Random, plen: int, rlen: int) -> list[int]:
    """A random prompt, then a reply that follows a learnable rule (x_{i+1} = x_i + step mod 250)."""
    prompt = [rng.randrange(250) for _ in range(plen)]
    x, step = rng.randrange(250), rng.choice([1, 3, 7])
    reply = []
    for _ in range(rlen):
        reply.append(x)
        x = (x + step) % 250
    return prompt + reply


def make_data(root: Path, n_train: int = 40, n_val: int = 8, seed: int = 0, topk: int = 0,
              shard_size: int = 20, sequence=synthetic_sequence) -> Path:
    """Synthetic distilled data: train shards of ``shard_size`` sequences, one val shard, a
    manifest. ``sequence(rng, plen, rlen)`` makes each sequence."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    shards = []

    def add(split, seqs, plens):
        name = f"shard-{len(shards):05d}.safetensors"
        tk = None
        if topk:
            tk = []
            for s, p in zip(seqs, plens):
                r = len(s) - p
                logits = torch.randn(r, topk)
                ids = torch.stack([torch.randperm(VOCAB)[:topk] for _ in range(r)])
                tk.append((ids, logits))
        n = write_shard(root / name, seqs, plens, [f"k{len(shards)}-{i}" for i in range(len(seqs))], tk)
        shards.append({"file": name, "split": split, "sequences": len(seqs), "tokens": n,
                       "reply_tokens": sum(len(s) - p for s, p in zip(seqs, plens))})

    for split, count in (("train", n_train), ("val", n_val)):
        for start in range(0, count, shard_size):
            seqs, plens = [], []
            for _ in range(min(shard_size, count - start)):
                plen, rlen = rng.randint(3, 12), rng.randint(6, 30)
                seqs.append(sequence(rng, plen, rlen))
                plens.append(plen)
            add(split, seqs, plens)
    config = {"sources": ["synthetic"], "mode": "generate", "seed": seed, "topk_logits": topk}
    atomic_write_json(root / MANIFEST, {"config": config, "prompts_done": n_train + n_val, "skipped": 0,
                                        "shards": shards, "seconds": 0.0})
    return root


def base_config(data: Path, out: Path, model: Path, **kw):
    """A TrainConfig for a run of a few seconds on the tiny model."""
    from cadence.training.trainer import TrainConfig

    defaults = dict(data=str(data), out=str(out), model=str(model), device="cpu", kind="hydra", num_heads=3,
                    steps=8, batch_size=2, max_len=64, warmup_steps=2, lr=3e-3, log_every=2, eval_every=4,
                    save_every=4, progress=False)
    defaults.update(kw)
    return TrainConfig(**defaults)


def cli_args(cfg) -> list[str]:
    """``cadence train`` flags equal to ``cfg``."""
    import dataclasses

    args = ["train"]
    for f in dataclasses.fields(cfg):
        val = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(val, bool):
            args.append(flag if val else "--no-" + flag[2:])
        elif isinstance(val, (tuple, list)):
            if val:
                args += [flag, *map(str, val)]
        else:
            args += [flag, str(val)]
    return args
