"""What a training run keeps on disk, and how it picks up where it stopped.

Knows: the checkpoint's file name and format version (and refusing anything else), the
random-number state saved with it (Python, NumPy, torch, CUDA) so a resumed run draws the
same batches, the append-only JSONL log (trimmed back to the checkpoint's step on resume),
per-window loss sums for log records, and peak memory for the summary. Does not know the
training loop, losses or data (``trainer``).
"""

from __future__ import annotations

import json
import math
import random
import resource
import sys
from pathlib import Path

import numpy as np
import torch

from cadence.system.atomic import atomic_write
from cadence.errors import CadenceError

CHECKPOINT = "checkpoint.pt"
LOG = "train_log.jsonl"
CKPT_FORMAT = 1


def rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def load_checkpoint(path: Path) -> dict:
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CadenceError(f"checkpoint {path} is unreadable ({exc}); delete it to start over") from exc
    if not isinstance(ck, dict) or ck.get("format") != CKPT_FORMAT:
        raise CadenceError(f"{path} is not a cadence training checkpoint")
    return ck


def diff(old: dict, new: dict) -> dict:
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def peak_memory_mib(device: torch.device | None = None) -> dict:
    """Peak resident memory of this process (ru_maxrss) and, on CUDA, peak allocated."""
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if sys.platform == "darwin":  # bytes there
        rss_kib //= 1024
    out = {"max_rss_mib": round(rss_kib / 1024, 1)}
    if device is not None and device.type == "cuda":
        out["cuda_max_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 20, 1)
    return out


class Window:
    """Per-process sums since the last log record."""

    def __init__(self, K: int):
        self.K = K
        self.reset()

    def reset(self) -> None:
        self.loss, self.n, self.tokens, self.seconds = 0.0, 0, 0, 0.0
        self.heads = [0.0] * self.K

    def add(self, loss: float, parts: list[float], tokens: int) -> None:
        self.loss += loss
        self.n += 1
        self.tokens += tokens
        self.heads = [a + (0.0 if math.isnan(b) else b) for a, b in zip(self.heads, parts)]


class Log:
    """Append-only JSONL training log, written by the main process."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def write(self, rec: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


def trim_log(path: Path, step: int) -> None:
    """Drop log records after ``step`` (written by a run that was interrupted after its checkpoint)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    atomic_write(path, lambda tmp: tmp.write_text("".join(x + "\n" for x in keep)))
